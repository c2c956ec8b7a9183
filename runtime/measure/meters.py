"""What a run measures about itself: operator calls, recompute time, saved bytes, and throughput.

The planner charges every recomputed operator and every kept activation; these counters let the
tests and ``baton train --report`` check that the runtime does exactly what was charged. ``throughput``
turns a run's steps into tokens/s and MFU (model FLOPs of ``baton.costmodel.model_flops_per_s``
over the catalog peaks of the devices used, as the evaluator's MFU).
"""
from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from baton.costmodel import model_flops_per_s
from baton.model_spec import ModelSpec


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
    recompute_spans: list | None = None
    """When a list (``--trace``): (start, end) perf_counter seconds of every recomputed segment."""

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
        self.moving: list | None = None
        self.live: dict[int, dict[int, int]] = {}
        self.current: dict[int, int] | None = None
        self.peak = 0

    def track_params(self, params) -> None:
        """Parameters whose storage moves (stage 3 gathers a layer into new storage and releases it after):
        their addresses are read again at every ``record``, since an activation may take the address a
        released layer had, and must not be taken for a parameter."""
        self.moving = list(params)
        self._refresh()

    def _refresh(self) -> None:
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in self.moving} - {0}

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
    def record(self, mb):
        if self.moving is not None:
            self._refresh()
        self.current = self.live.setdefault(mb, {})
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield
        finally:
            self.current = None
            self.peak = max(self.peak, self.total())

    def release(self, mb) -> None:
        self.live.pop(mb, None)

    def total(self) -> int:
        return sum(sum(d.values()) for d in self.live.values())


@dataclass(frozen=True, kw_only=True, slots=True)
class Throughput:
    """A run's average speed."""

    steps: int
    """Steps averaged: all but the first when there are several (the first pays for warm-up)."""
    tokens_per_s: float
    """Tokens of those steps over their wall time."""
    model_tflops_per_s: float
    """Model FLOPs (no recomputation counted) per second, 10^12."""
    peak_tflops: float | None
    """Sum of the catalog matrix peaks of the devices used, for the model's dtype (None: unknown)."""
    mfu: float | None
    """model_tflops_per_s / peak_tflops."""
    skipped_steps: int
    """Steps of the whole run whose update was skipped (fp16 overflow)."""


def throughput(history, spec: ModelSpec, global_batch: int, peak_flops: float | None) -> Throughput:
    """Average tokens/s and MFU over ``history`` (StepStats of one rank, in order)."""
    timed = history[1:] if len(history) > 1 else history
    seconds = sum(s.iteration_ms for s in timed) / 1e3
    tokens = sum(s.tokens for s in timed)
    flops = model_flops_per_s(spec, global_batch, seconds * 1e3 / len(timed)) if timed else 0.0
    return Throughput(steps=len(timed), tokens_per_s=tokens / seconds if seconds > 0 else 0.0, model_tflops_per_s=flops / 1e12,
                      peak_tflops=peak_flops / 1e12 if peak_flops else None,
                      mfu=flops / peak_flops if peak_flops else None,
                      skipped_steps=sum(1 for s in history if s.skipped))
