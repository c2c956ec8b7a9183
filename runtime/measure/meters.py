"""What a run measures about itself: operator calls, recompute time, saved bytes, and throughput.

The planner charges every recomputed operator and every kept activation; these counters let the
tests and ``baton train --report`` check that the runtime does exactly what was charged. ``throughput``
turns a run's steps into tokens/s and MFU (model FLOPs of ``baton.costmodel.model_flops_per_s``
over the catalog peaks of the devices used, as the evaluator's MFU).
"""
from __future__ import annotations

import time
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
    in_backward: bool = False
    saved: "SavedBytes | None" = None
    clock: "PhaseClock | None" = None
    """The step's clock (set by the engine for a step): recomputed segments are timed on it, under
    ``("recompute", backward_mb)``."""
    backward_mb: int = 0
    """The micro-batch whose backward runs now (meaningful while ``in_backward``)."""

    def reset(self) -> None:
        self.calls.clear()
        self.recomputed.clear()


class PhaseClock:
    """Times the phases of one step (passes, recomputation, collectives) without reading the device inside it.

    On CPU every op has finished when it returns, so ``perf_counter`` around a phase is its time. On CUDA a
    ``perf_counter`` around a phase times its launches only, and a ``torch.cuda.synchronize()`` per phase
    would stall the host once per micro-batch (the GPU then idles while the host launches the next pass):
    instead a pair of ``torch.cuda.Event``s is recorded on the current stream around each phase, and the
    events are read by ``resolve`` once the step's one host read has waited for the stream, when every
    event is complete (``elapsed_time`` then reads the recorded times without waiting for the device).
    With ``enabled`` False (CUDA, nothing asked for the times) nothing is recorded at all.

    A span's host times (trace spans) on CUDA are the clock's host start plus the event's time after the
    clock's first event: exact when the stream was idle at the clock's start, else shifted by the wait."""

    def __init__(self, *, events: bool, enabled: bool = True):
        self.events = events
        """Time with CUDA events (else ``perf_counter``)."""
        self.enabled = enabled
        self.spans: list[tuple[object, object, object]] = []
        """(key, start, end): perf_counter seconds, or recorded events until ``resolve``."""
        self.host_start_s = time.perf_counter()
        self._origin = self._mark() if events and enabled else None

    def _mark(self):
        if not self.events:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()  # on the current stream, behind the work launched so far
        return event

    def start(self):
        """A phase begins: a token for ``stop`` (None when disabled)."""
        return self._mark() if self.enabled else None

    def stop(self, token, key) -> None:
        """The phase begun at ``token`` ends; its time counts under ``key``."""
        if token is not None:
            self.spans.append((key, token, self._mark()))

    def resolve(self) -> list[tuple[object, float, float]]:
        """Every span as (key, start, end) host perf_counter seconds, in the order they were stopped. On CUDA
        call it only after a host read that waited for the stream (``Event.elapsed_time`` refuses an event
        the GPU has not reached)."""
        if not self.events:
            return list(self.spans)
        o, h = self._origin, self.host_start_s
        return [(key, h + o.elapsed_time(a) / 1e3, h + o.elapsed_time(b) / 1e3) for key, a, b in self.spans]

    @staticmethod
    def totals_ms(spans) -> dict:
        """Key -> summed milliseconds of resolved ``spans``."""
        out: dict = {}
        for key, a, b in spans:
            out[key] = out.get(key, 0.0) + (b - a) * 1e3
        return out


class SavedBytes:
    """Bytes of activations kept for backward, per micro-batch in flight, and their peak sum.

    Counts tensors autograd saves outside recomputed segments (a saved-tensors hook) plus the inputs
    a recomputed segment keeps to replay itself; storages are counted once; parameters not at all.

    ``known``: bytes by ``record`` key that an earlier step measured (``measured`` of its meter). A key found there
    is recorded without hooks: it holds those bytes until its ``release``, so the peak is summed as if measured
    again. The engine's passes save the same tensors every step (the same operators on the same shapes), and the
    hooks cost each saved tensor two calls into Python: 616 tensors a step of a 6-layer model of 4 micro-batches,
    1% of its time on a CPU.
    """

    def __init__(self, params, known: dict | None = None):
        self._params = params
        self._param_ptrs: set[int] | None = None
        self.moving: list | None = None
        self.live: dict[int, dict[int, int]] = {}
        self.current: dict[int, int] | None = None
        self.peak = 0
        self.known = known if known is not None else {}
        self.measured: dict = {}
        """Bytes of every key recorded with hooks, when its ``record`` ended (what a later step's ``known`` takes)."""

    @property
    def param_ptrs(self) -> set[int]:
        """Storage addresses of the parameters (read at the first measured ``record``: a step that measures
        nothing reads none)."""
        if self._param_ptrs is None:
            self._param_ptrs = {p.untyped_storage().data_ptr() for p in self._params}
        return self._param_ptrs

    @param_ptrs.setter
    def param_ptrs(self, value: set[int]) -> None:
        self._param_ptrs = value

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
        ptr = s.data_ptr()
        if ptr not in self.param_ptrs:
            self.current[ptr] = s.nbytes()

    def _pack(self, t):
        self.add(t)
        return t

    @contextmanager
    def record(self, mb):
        if mb in self.known:  # measured before: no hooks, nothing added (``current`` stays None)
            self.live[mb] = {None: self.known[mb]}
            try:
                yield
            finally:
                self.peak = max(self.peak, self.total())
            return
        if self.moving is not None:
            self._refresh()
        self.current = self.live.setdefault(mb, {})
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield
        finally:
            self.measured[mb] = sum(self.current.values())
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
