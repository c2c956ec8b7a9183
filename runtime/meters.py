"""What a stage measures about itself while it trains: operator calls, recompute time, saved bytes.

The planner charges every recomputed operator and every kept activation; these counters let the
tests and ``baton train --report`` check that the runtime does exactly what was charged.
"""
from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass
class Meter:
    """Counters a stage fills while it runs; the schedule reads and resets them every step."""

    calls: Counter = field(default_factory=Counter)
    """Operator executions (forward and recompute) by operator name."""
    recomputed: Counter = field(default_factory=Counter)
    """Operator executions during the backward pass (recomputation) by operator name."""
    recompute_s: float = 0.0
    """Seconds spent re-running recomputed segments."""
    in_backward: bool = False
    saved: "SavedBytes | None" = None

    def reset(self) -> None:
        self.calls.clear()
        self.recomputed.clear()
        self.recompute_s = 0.0


class SavedBytes:
    """Bytes of activations kept for backward, per micro-batch in flight, and their peak sum.

    Counts tensors autograd saves outside recomputed segments (a saved-tensors hook) plus the inputs
    a recomputed segment keeps to replay itself; storages are counted once; parameters not at all.
    """

    def __init__(self, params):
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in params}
        self.live: dict[int, dict[int, int]] = {}
        self.current: dict[int, int] | None = None
        self.peak = 0

    def add(self, t: torch.Tensor) -> None:
        if self.current is None or not isinstance(t, torch.Tensor):
            return
        s = t.untyped_storage()
        if s.data_ptr() not in self.param_ptrs:
            self.current[s.data_ptr()] = s.nbytes()

    def _pack(self, t):
        self.add(t)
        return t

    @contextmanager
    def record(self, mb: int):
        self.current = self.live.setdefault(mb, {})
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield
        finally:
            self.current = None
            self.peak = max(self.peak, self.total())

    def release(self, mb: int) -> None:
        self.live.pop(mb, None)

    def total(self) -> int:
        return sum(sum(d.values()) for d in self.live.values())
