"""Worker processes that end with the process that started them (the runtime's ranks and profilers, the
exhaustive search's workers): a SIGTERM or SIGKILL to a parent does not reach its children, which would
otherwise run on with nobody watching, holding the cores."""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent_pid: int, *, poll_s: float = 0.5) -> None:
    """End this process when ``parent_pid`` ends.

    Linux delivers SIGKILL the moment the parent dies (prctl PR_SET_PDEATHSIG), even while this
    process is blocked inside a collective. SIGKILL rather than SIGTERM: a rank blocked in C++ would
    run a Python handler only when the call returns, which may be a whole --timeout later. A thread
    that polls the parent pid backs it up where prctl is missing (macOS) and closes the window in
    which the parent died before prctl was called.
    """
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:
        os._exit(1)  # the parent is already gone (we were re-parented before prctl took effect)

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watch, name="baton-parent-watchdog", daemon=True).start()
