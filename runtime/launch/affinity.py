"""Core pinning of measurement runs (``BATON_PIN_CPUS=1``): one core and one torch thread per rank.

Ranks neither migrate nor oversubscribe their core (two OpenMP threads spinning on one core ran ~30x
slower on a loaded 2-core box). Call it after the process group exists: on Linux the affinity of a
thread is inherited by the threads it creates later, and gloo's I/O threads, created while the group
forms (those of every subgroup included: call it after the last ``new_group``), then stay free to run
on any core instead of queueing behind their rank's compute (pinned before, a 256 KiB all-reduce
between two ranks took about twice as long).
"""
from __future__ import annotations

import os

import torch


def pinning_requested() -> bool:
    return os.environ.get("BATON_PIN_CPUS") == "1" and hasattr(os, "sched_setaffinity")


def pin_rank(rank: int) -> None:
    """Pin the calling thread to core ``rank mod cores`` and use one torch thread (no-op unless requested)."""
    if not pinning_requested():
        return
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})
    torch.set_num_threads(1)
