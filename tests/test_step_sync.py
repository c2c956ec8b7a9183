"""One host read per training step (runtime/train/engine.py): on CUDA a read of the device (a synchronize, an
``Event.synchronize``, ``.item()``, ``.cpu()``, ``.tolist()``, ``float(tensor)``, ``bool(tensor)``) stalls the
host until the GPU has run everything launched before it, and the GPU then idles while the host launches the
next work; a step that reads once per micro-batch pays that stall once per micro-batch.

These tests stand in for CUDA on CPU: ``torch.cuda.Event`` is a fake whose ``synchronize`` counts as a read
and whose ``elapsed_time`` returns set times, ``torch.cuda.synchronize`` counts as a read, and the engine is told
to time with events (``Engine.events``, what it does on CUDA). Every call of the reading methods of
``torch.Tensor`` made by the project's code (``baton``, ``runtime``; the data source's token indices, host
tensors by design, left out) counts too. One step may read once: the all-reduced metrics the clip coefficient
and the skip decision need. Reads inside torch itself are not seen here; on a GPU
``torch.cuda.set_sync_debug_mode("error")`` sees those.

Catches: a ``.item()`` of each micro-batch's loss, a ``torch.cuda.synchronize()`` around each pass to time it,
the overflow flag or the gradient norm read on their own, the memory of the ranks all-reduced and read after the
update.
"""
from __future__ import annotations

import os
import traceback
from collections import Counter

import pytest
import torch

from tests.runtime_helpers import plan_of, replicas_plan, run_ranks, tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROJECT = (os.path.join(ROOT, "runtime") + os.sep, os.path.join(ROOT, "baton") + os.sep)
HOST_SIDE = (os.path.join(ROOT, "runtime", "data") + os.sep,)
READERS = ("item", "cpu", "tolist", "numpy", "__float__", "__bool__", "__int__")


class _FakeEvent:
    """Stands in for ``torch.cuda.Event``: each record is 1 ms after the one before; ``synchronize`` is a read."""

    clock_ms = 0.0
    reads: Counter | None = None

    def __init__(self, enable_timing: bool = False, **_):
        self.at_ms = None

    def record(self, stream=None):
        _FakeEvent.clock_ms += 1.0
        self.at_ms = _FakeEvent.clock_ms

    def elapsed_time(self, other) -> float:
        assert self.at_ms is not None and other.at_ms is not None, "elapsed_time of an event never recorded"
        return other.at_ms - self.at_ms

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        _FakeEvent.reads["Event.synchronize"] += 1


class HostReads:
    """Counts the host reads made while ``counting`` is on (see the module docstring)."""

    def __init__(self, monkeypatch):
        self.reads: Counter = Counter()
        self.counting = False
        _FakeEvent.reads = self.reads
        monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: self._count("torch.cuda.synchronize"))
        for name in READERS:
            original = getattr(torch.Tensor, name)

            def reader(t, *args, _original=original, _name=name, **kwargs):
                caller = traceback.extract_stack(limit=2)[0]
                path = os.path.abspath(caller.filename)
                if path.startswith(PROJECT) and not path.startswith(HOST_SIDE):
                    self._count(f"Tensor.{_name} at {os.path.relpath(path, ROOT)}:{caller.lineno}")
                return _original(t, *args, **kwargs)
            monkeypatch.setattr(torch.Tensor, name, reader)

    def _count(self, what: str) -> None:
        if self.counting:
            self.reads[what] += 1

    def step(self, engine, step: int, data):
        """``engine.train_step`` counted; returns (its StepStats, the reads it made)."""
        self.reads.clear()
        self.counting = True
        try:
            stats = engine.train_step(step, data)
        finally:
            self.counting = False
        return stats, Counter(self.reads)


def _engine(plan, rank: int = 0, **kwargs):
    from runtime.data.source import TokenSource
    from runtime.train.engine import Engine

    engine = Engine(plan, rank, seed=0, lr=1e-3, **kwargs)
    engine.events = True  # time with (fake) CUDA events, as on CUDA
    return engine, TokenSource(plan.model, seed=0, global_batch=plan.global_batch)


def _assert_one_read(reads: Counter) -> None:
    assert sum(reads.values()) <= 1, f"one step read the device {sum(reads.values())} times: {dict(reads)}"


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_a_step_reads_the_device_once(one_rank_group, monkeypatch, dtype):
    """A one-device plan of 3 micro-batches with recomputation, clipping, a trace; fp16 adds the overflow flag."""
    from runtime.measure.trace import Tracer

    counter = HostReads(monkeypatch)
    plan = plan_of(tiny(0.1, dtype=dtype), [[1]], [4], 1, m=3, mbs=1, recompute={0: ["gelu", "fc1"]})
    engine, data = _engine(plan, clip_grad=0.5)
    engine.tracer = Tracer()
    for step in range(3):
        stats, reads = counter.step(engine, step, data)
        _assert_one_read(reads)
    # The event times reached the stats after the read: every pass took whole (fake) milliseconds. They are offsets
    # from the host clock (PhaseClock.resolve), whose size after days of uptime leaves ~1e-8 ms of float64 noise.
    assert all(ms >= 1.0 - 1e-6 for ms in stats.forward_ms + stats.backward_ms), stats
    assert all(0.0 < r < b for r, b in zip(stats.recompute_ms, stats.backward_ms)), stats
    assert stats.stage_ms[0] > 0.0  # the step before's, carried by this step's all-reduce
    assert stats.grad_sync_ms > 0.0 and stats.norm_ms > 0.0
    assert stats.optimizer_ms >= stats.norm_ms + 1.0  # the update before's events, read with this step's read
    assert stats.clipped and stats.grad_norm > 0.5
    assert len(stats.memory_bytes) == 1 and stats.memory_bytes[0] > 0
    names = {e["name"] for e in engine.tracer.events}
    assert {"F0", "B2", "recompute", "optimizer"} <= names, names


def test_a_step_without_measurement_records_no_events(one_rank_group, monkeypatch):
    """Nothing asked for the times (no report, no trace): on CUDA not one event is recorded, and the step still
    reads once."""
    counter = HostReads(monkeypatch)
    plan = plan_of(tiny(0.1), [[1]], [4], 1, m=2, mbs=1)
    engine, data = _engine(plan, measure=False)
    counter.step(engine, 0, data)
    before = _FakeEvent.clock_ms
    stats, reads = counter.step(engine, 1, data)
    _assert_one_read(reads)
    assert _FakeEvent.clock_ms == before, "events recorded for times nobody asked for"
    assert stats.loss > 0.0


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_a_layered_step_reads_the_device_once(one_rank_group, monkeypatch, zero_stage):
    """ZeRO 2 and 3 (layer by layer, per-unit reduce-scatters and at 3 gathers) in fp16."""
    counter = HostReads(monkeypatch)
    plan = replicas_plan(tiny(0.1, dtype="fp16"), [dict(stages=[[1]], layers=[4], units=1, m=2, mbs=1)],
                         zero_stage=zero_stage)
    engine, data = _engine(plan, clip_grad=1.0)
    for step in range(2):
        stats, reads = counter.step(engine, step, data)
        _assert_one_read(reads)
    assert len(stats.unit_reduce_ms) == 5 and all(ms > 0.0 for ms in stats.unit_reduce_ms)
    assert stats.grad_sync_ms == pytest.approx(sum(stats.unit_reduce_ms))


def _pipeline_worker(rank, world, plan):
    """Counts each rank's reads over three steps of a 2-stage pipeline (real processes)."""
    mp = pytest.MonkeyPatch()
    try:
        counter = HostReads(mp)
        engine, data = _engine(plan, rank, clip_grad=1.0)
        out = []
        for step in range(3):
            stats, reads = counter.step(engine, step, data)
            out.append((dict(reads), stats.loss, list(stats.stage_ms)))
        return out
    finally:
        mp.undo()


def test_a_pipeline_step_reads_the_device_once_on_every_rank():
    """Two stages over two processes, 1F1B over 3 micro-batches: both ranks read once a step, agree on the
    loss, and from the second step carry both stages' times."""
    plan = plan_of(tiny(0.1, dtype="fp16"), [[1], [1]], [2, 2], 1, m=3, mbs=1)
    results = run_ranks(_pipeline_worker, 2, plan)
    for rank, steps in enumerate(results):
        for step, (reads, _, _) in enumerate(steps):
            assert sum(reads.values()) <= 1, f"rank {rank} step {step}: {reads}"
    for (_, loss0, stage0), (_, loss1, stage1) in zip(*results):
        assert loss0 == loss1 and stage0 == stage1
    assert all(ms > 0.0 for ms in results[0][-1][2])
