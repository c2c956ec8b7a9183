"""Stopping a search early on request (Ctrl-C in ``baton solve``) the way its time limit stops it.

Everything that watches the time limit asks ``past(deadline_s)`` or ``seconds_left(deadline_s)`` here, so a request
ends the search at the same checks a deadline does, and what it returns is as sound as a timed-out search's: the best
plan so far, re-checked by the evaluator, and a bound over every candidate not searched to the end (or none, when
some were never bounded). A MILP running at the time is cancelled through HiGHS's interrupt callback (Pyomo turns it
on) and returns its incumbent and dual bound as at its own time limit. A request raises nothing: stopping at an
arbitrary bytecode could leave a candidate popped from the search's heap and not yet accounted for, and the bound
would then claim too much.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager

_requested = threading.Event()
_running: list = []
"""Pyomo's HiGHS solvers of the MILPs being solved (one at a time; a list so nesting stays simple)."""


def request() -> None:
    """Ask the search to stop at its next check, and cancel the MILP being solved."""
    _requested.set()
    for solver in list(_running):
        highs = getattr(solver, "_solver_model", None)  # Pyomo's highspy.Highs, made when the solve starts
        if highs is not None:
            highs.cancelSolve()


def requested() -> bool:
    return _requested.is_set()


def clear() -> None:
    """Forget a request: the next search runs to its own limit."""
    _requested.clear()


def past(deadline_s: float) -> bool:
    """The search must stop: ``time.perf_counter()`` is past ``deadline_s``, or a stop was requested."""
    return _requested.is_set() or time.perf_counter() > deadline_s


def seconds_left(deadline_s: float) -> float:
    """Seconds until ``deadline_s``; 0 once a stop was requested."""
    return 0.0 if _requested.is_set() else deadline_s - time.perf_counter()


@contextmanager
def solving(solver):
    """Within: ``request`` cancels this Pyomo HiGHS solver's solve."""
    _running.append(solver)
    try:
        yield
    finally:
        _running.remove(solver)


class _HideInterruptStatus(logging.Filter):
    """Pyomo 6.10 does not know HiGHS's 'interrupted' model status and warns of it; here it is expected."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "kInterrupt" not in record.getMessage()


logging.getLogger("pyomo.contrib.solver.solvers.highs").addFilter(_HideInterruptStatus())


@contextmanager
def on_interrupt(message: str):
    """Within: the first Ctrl-C requests a stop and writes ``message`` to stderr, a second one interrupts as usual
    (KeyboardInterrupt). Outside the main thread, where no handler can be set, Ctrl-C interrupts as usual."""
    def handler(signum, frame):
        if _requested.is_set():
            raise KeyboardInterrupt
        request()
        _write_err(message + "\n")

    clear()
    try:
        previous = signal.signal(signal.SIGINT, handler)
    except ValueError:  # not the main thread
        previous = None
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
        clear()


def _write_err(text: str) -> None:
    # Straight to the file descriptor: the handler may run in the middle of the console's own writing.
    try:
        os.write(sys.stderr.fileno(), text.encode())
    except (OSError, ValueError, AttributeError):  # stderr captured without a descriptor (tests)
        sys.stderr.write(text)
