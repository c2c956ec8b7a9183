"""Shared plumbing for the ``baton`` subcommands: one-line errors and exit codes."""
from __future__ import annotations

import functools
import sys

import typer
from rich.console import Console

from baton.errors import BatonError

# Piped output (logs, tests, CI) gets a wide fixed width so tables never wrap device names.
console = Console(width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True, width=10_000)

EXIT_USER_ERROR = 2


def fail(message: str) -> "typer.Exit":
    """Print one line to stderr and return the Exit to raise (code 2)."""
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    return typer.Exit(EXIT_USER_ERROR)


def guarded(fn):
    """Turn BatonError (and a few user-caused OS errors) into one line on stderr and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except BatonError as exc:
            raise fail(str(exc)) from None
        except (FileNotFoundError, IsADirectoryError, PermissionError) as exc:
            raise fail(f"{exc.filename}: {exc.strerror}") from None
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            raise typer.Exit(130) from None

    return wrapper
