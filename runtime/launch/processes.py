"""Worker processes that end with the run that started them, and leave nothing behind.

* ``stop_processes`` kills and reaps what a run (or a measurement) spawned, whatever state it is in.
* ``die_with_parent`` (``baton.lifetime``) makes a spawned worker end when its launcher ends, however the launcher ends:
  a SIGTERM or SIGKILL to the launcher does not reach its children, which would otherwise train to the
  end with nobody watching (and keep writing checkpoints).
* ``run_directory`` / ``sweep_stale_run_directories``: every run keeps its temporary files (the
  rendezvous store) in one directory named after its pid; the run removes it, and the next run
  removes those of launchers that were killed before they could.
* ``terminate_as_interrupt``: SIGTERM stops a run the way Ctrl-C does.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import tempfile
import threading
from pathlib import Path

from baton.lifetime import die_with_parent  # noqa: F401  (the runtime's workers use it from here)

RUN_DIR_PREFIX = "baton-run-"


def stop_processes(procs, *, grace_s: float = 0.0) -> None:
    """Give each process ``grace_s`` to exit on its own, kill those still running, and reap them all
    (an unreaped child stays a zombie; a live one would keep its cores and its rendezvous)."""
    for p in procs:
        if grace_s > 0:
            p.join(grace_s)
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(5)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def process_state(pid: int) -> str | None:
    """The one-letter state of a process from /proc (``T``: stopped, ``Z``: zombie); None if unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: the state follows the last ')'.
    return stat[stat.rfind(")") + 2:][:1] or None


def run_directory() -> Path:
    """A fresh temporary directory for this run, named with our pid so a later run can tell whether
    its owner is still alive."""
    return Path(tempfile.mkdtemp(prefix=f"{RUN_DIR_PREFIX}{os.getpid()}-"))


_RUN_DIR = re.compile(re.escape(RUN_DIR_PREFIX) + r"([0-9]+)-")


def sweep_stale_run_directories(root: str | Path | None = None) -> int:
    """Remove run directories whose launcher no longer exists (it was SIGKILLed before it could clean
    up); returns how many were removed. Directories of live launchers and of other users stay."""
    root = Path(root or tempfile.gettempdir())
    removed = 0
    try:
        entries = list(root.iterdir())
    except OSError:
        return 0
    uid = os.getuid() if hasattr(os, "getuid") else None
    for entry in entries:
        m = _RUN_DIR.match(entry.name)
        if not m or int(m.group(1)) == os.getpid():
            continue
        try:
            if not entry.is_dir() or entry.is_symlink() or (uid is not None and entry.stat().st_uid != uid):
                continue
        except OSError:
            continue
        if not pid_alive(int(m.group(1))):
            shutil.rmtree(entry, ignore_errors=True)
            removed += 1
    return removed


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C would raise KeyboardInterrupt (so every cleanup path is shared)."""

    exit_code = 128 + signal.SIGTERM


def _raise_terminated(signum, frame):
    raise Terminated()


@contextlib.contextmanager
def interrupts_as_flags():
    """Within the block, Ctrl-C and SIGTERM only note themselves; the function it yields raises the first one
    waiting (KeyboardInterrupt, ``Terminated``) where the caller calls it. For a loop that reads a pipe: an
    exception that cuts a message in half leaves the rest of it in the pipe, and the next read takes those
    bytes for a length and waits forever; one raised right after a read loses the message."""
    came: list[int] = []

    def check() -> None:
        if came:
            raise Terminated() if came.pop(0) == signal.SIGTERM else KeyboardInterrupt()
    if threading.current_thread() is not threading.main_thread():
        yield check
        return

    def hold(signum, frame):
        came.append(signum)
    previous = _swap_handlers({signal.SIGINT: hold, signal.SIGTERM: hold})
    try:
        yield check
    finally:
        _swap_handlers(previous)


def _swap_handlers(handlers: dict) -> dict:
    """Install ``handlers`` with both signals blocked meanwhile (one landing between the two would run under
    a half-swapped pair); returns the previous ones."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, set(handlers)) if hasattr(signal, "pthread_sigmask") else None
    try:
        return {s: signal.signal(s, h) for s, h in handlers.items()}
    finally:
        if mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)


@contextlib.contextmanager
def terminate_as_interrupt():
    """Within the block, SIGTERM raises ``Terminated`` (a KeyboardInterrupt) in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
