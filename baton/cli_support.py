"""Shared plumbing for the ``baton`` subcommands: one-line errors, exit codes, literal user text.

Anything that came from the user (a message quoting a file or a value, a path, a library's error text)
is printed literally: rich would read ``[red]`` in a file name, or ``[/path:line]`` in a gloo message,
as markup, and drop it or crash the printer.
"""
from __future__ import annotations

import functools
import os
import sys
import tempfile
from pathlib import Path

import typer
from rich.console import Console
from rich.text import Text

from baton.errors import BatonError

# Piped output (logs, tests, CI) gets a wide fixed width so tables never wrap device names.
console = Console(width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True, width=10_000)

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130
MAX_MESSAGE_CHARS = 600
"""An error line longer than this is cut in the middle: it quoted something huge."""


def one_line(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``message`` on one line (newlines and control characters become spaces), at most ``limit``
    characters (the middle replaced by ' ... ')."""
    text = "".join(ch if ch.isprintable() else " " for ch in str(message))
    if len(text) > limit:
        half = (limit - 5) // 2
        text = f"{text[:half]} ... {text[-half:]}"
    return text


def say(message: str, *, err: bool = False) -> None:
    """Print ``message`` literally (no markup, no highlighting) to stdout or stderr."""
    (err_console if err else console).print(Text(str(message)), highlight=False, soft_wrap=True)


def fail(message: str) -> "typer.Exit":
    """Print one line to stderr and return the Exit to raise (code 2)."""
    err_console.print(Text("error: ", style="bold red") + Text(one_line(message)), highlight=False, soft_wrap=True)
    return typer.Exit(EXIT_USER_ERROR)


def check_output_path(path: str | Path, flag: str) -> None:
    """Fail now, before a long solve or run, if ``path`` cannot be written as a file."""
    p = Path(path)
    if str(path) == "" or p.name in ("", ".", ".."):
        raise BatonError("not a file name", source=str(path), field=flag)
    if p.is_dir():
        raise BatonError("is a directory, expected a file name", source=str(p), field=flag)
    if p.exists() and not os.access(p, os.W_OK):
        raise BatonError("file is not writable", source=str(p), field=flag)
    require_writable_ancestor(p, flag, "cannot be written")


def require_writable_ancestor(path: Path, flag: str, what: str) -> None:
    """The nearest existing ancestor of ``path`` is a directory we may write into, so ``path`` (a file or a
    directory still to be made) can be created there; otherwise one error saying ``what`` went wrong."""
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise BatonError(f"{what}: {parent} is not a directory", source=str(path), field=flag)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise BatonError(f"{what}: directory {parent} is not writable", source=str(path), field=flag)
    refused = _refuses_new_files(parent)
    if refused is not None:
        raise BatonError(f"{what}: directory {parent} refuses new files ({refused})", source=str(path), field=flag)


def _refuses_new_files(directory: Path) -> str | None:
    """Why a file cannot be created in ``directory`` (the OS's words), or None when one can: tried for real,
    since ``os.access`` reads permission bits only and says yes to root, whom a read-only or special
    file system (/sys, /proc, an NFS export) still refuses."""
    try:
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".baton-probe-")
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    os.close(fd)
    os.unlink(probe)
    return None


def check_writable_dir(path: str | Path, flag: str) -> None:
    """``path`` is (or can be created as) a directory we may write into; checked before any long work
    starts, so a bad --save-dir or --out is not found after it."""
    p = Path(path)
    if p.exists():
        if not p.is_dir():
            raise BatonError("exists and is not a directory", source=str(p), field=flag)
        refused = _refuses_new_files(p)
        if refused is not None:
            raise BatonError(f"directory refuses new files ({refused})", source=str(p), field=flag)
        return
    require_writable_ancestor(p, flag, "cannot be created")


def guarded(fn):
    """Turn BatonError (and user-caused OS errors) into one line on stderr and exit code 2; an
    interrupt (Ctrl-C, or SIGTERM where the command maps it) into one line and 130 (143 for SIGTERM)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except BatonError as exc:
            raise fail(str(exc)) from None
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError) as exc:
            raise fail(f"{exc.filename}: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise fail(f"input is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        except OSError as exc:
            if exc.filename is None:
                raise
            raise fail(f"{exc.filename}: {exc.strerror or exc}") from None
        except KeyboardInterrupt as exc:
            detail = f": {exc.args[0]}" if exc.args and exc.args[0] else ""
            word = "terminated" if getattr(exc, "exit_code", None) == 143 else "interrupted"
            say(one_line(f"{word}{detail}"), err=True)
            raise typer.Exit(getattr(exc, "exit_code", EXIT_INTERRUPTED)) from None

    return wrapper


def _show_flags_as_flags() -> None:
    """typer 0.29 prints every boolean flag's type in help (``--json <bool>``), which reads as if the
    flag took a value. Show no type for flags; a no-op where typer has no such hook."""
    try:
        from typer.core import TyperOption
    except ImportError:
        return
    original = getattr(TyperOption, "display_type_rich", None)
    if original is None or getattr(original, "_baton_flags", False):
        return

    def display_type_rich(self, ctx):
        if getattr(self, "is_flag", False) and not getattr(self, "count", False):
            return None
        return original(self, ctx)

    display_type_rich._baton_flags = True
    TyperOption.display_type_rich = display_type_rich


def _usage_errors_on_one_line() -> None:
    """A usage error (an unknown option, ``--steps abc``) is bad input like any other: one line, exit 2,
    instead of typer's usage line, hint and boxed panel."""
    try:
        from typer import rich_utils
    except ImportError:
        return
    if not hasattr(rich_utils, "rich_format_error") or getattr(rich_utils.rich_format_error, "_baton", False):
        return

    def one_line_usage_error(exc) -> None:
        if type(exc).__name__ == "NoArgsIsHelpError":
            return
        ctx = getattr(exc, "ctx", None)
        where = f"{ctx.command_path}: " if ctx is not None else ""
        hint = f" (see '{ctx.command_path} -h')" if ctx is not None else ""
        err_console.print(Text("error: ", style="bold red") + Text(one_line(f"{where}{exc.format_message()}{hint}")),
                          highlight=False, soft_wrap=True)

    one_line_usage_error._baton = True
    rich_utils.rich_format_error = one_line_usage_error


_show_flags_as_flags()
_usage_errors_on_one_line()
