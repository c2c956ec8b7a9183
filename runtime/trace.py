"""``baton train --trace trace.json``: what every rank measured, as a Chrome trace (opens in
ui.perfetto.dev or chrome://tracing).

Each rank is a process row (named by rank, device, pipeline, stage and TP rank); its spans are the
engine's own measurements: forward and backward per micro-batch, recomputation inside backward,
pipeline receives (the wait for a peer included) and the posting of sends, tensor-parallel all-reduces,
the gradient synchronisation and step all-reduces, the optimizer, and validation. Spans nest by time
(an all-reduce inside a forward shows under it).

Timestamps are wall-clock microseconds (``time.time``), taken through ``perf_counter`` for precision:
ranks on one machine line up exactly; across machines they are as close as the machines' clocks.
"""
from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path


class Tracer:
    """The spans one rank records."""

    def __init__(self):
        # perf_counter is precise but has no epoch; this offset turns it into wall-clock time.
        self.offset_s = time.time() - time.perf_counter()
        self.events: list[dict] = []

    def add(self, name: str, cat: str, t0: float, t1: float, **args) -> None:
        """A span from perf_counter ``t0`` to ``t1`` (seconds)."""
        self.events.append({"name": name, "cat": cat, "ph": "X", "ts": round((t0 + self.offset_s) * 1e6, 3),
                            "dur": round(max(t1 - t0, 0.0) * 1e6, 3), "args": args})

    @contextmanager
    def span(self, name: str, cat: str, **args):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, cat, t0, time.perf_counter(), **args)


def rank_name(plan, topo, rank: int) -> str:
    pos = topo.position(rank)
    return f"rank {rank} {plan.device_ids()[rank]} (pipeline {pos.pipeline}, stage {pos.stage}, tp {pos.tp_rank})"


def write_chrome_trace(path: str | Path, plan, per_rank: dict[int, list[dict]]) -> Path:
    """Write every rank's spans as one Chrome trace JSON file (one process per rank, in rank order)."""
    from runtime.topology import Topology

    topo = Topology(plan)
    events: list[dict] = []
    for rank in sorted(per_rank):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": rank_name(plan, topo, rank)}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        events += [{**e, "pid": rank, "tid": 0} for e in per_rank[rank]]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return path
