"""Ending the worker processes a run or a measurement spawned, whatever state they are in."""
from __future__ import annotations


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
