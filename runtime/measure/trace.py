"""``baton train --trace trace.json``: what every rank measured, as a Chrome trace (opens in
ui.perfetto.dev or chrome://tracing).

Each rank is a process row (named by rank, device, pipeline, stage and TP rank) with one thread; its
spans are the engine's own measurements: forward and backward per micro-batch, recomputation inside
backward, pipeline receives (the wait for a peer included) and the posting of sends, tensor-parallel
all-reduces, the gradient synchronisation and step all-reduces, the optimizer, and validation. Spans
nest by time (an all-reduce inside a forward shows under it).

The file follows the Trace Event Format as Perfetto's JSON importer reads it: complete events (``ph``
"X") and metadata events ("M": process and thread names, process order); ``ts`` and ``dur`` in
microseconds; integer ``pid`` and ``tid``, rank r being process and thread r + 1 (Perfetto treats
pid/tid 0 as the kernel's idle task); spans of one thread either nested or disjoint (Perfetto drops or
moves a slice that overlaps another partly).

Clock: every span is taken with ``perf_counter`` and placed on the wall clock (``time.time_ns``) in
integer nanoseconds, so ranks on one machine line up exactly, across machines as closely as their
clocks do. ``ts`` counts from a whole second of wall-clock time before the first span
(``otherData.origin_unix_ns``): absolute microseconds since 1970 would be doubles of 16 digits, too
coarse (0.25 us) to keep a nested span inside its parent.
"""
from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path

from baton.atomic import write_atomically


class Tracer:
    """The spans one rank records."""

    def __init__(self):
        # perf_counter is precise but has no epoch; this offset (integer ns) puts it on the wall clock.
        self.offset_ns = time.time_ns() - time.perf_counter_ns()
        self.events: list[dict] = []
        """Spans as dicts: name, cat, args, and wall-clock ``start_ns`` / ``end_ns`` (integers)."""

    def add(self, name: str, cat: str, t0: float, t1: float, **args) -> None:
        """A span from perf_counter ``t0`` to ``t1`` (seconds)."""
        start = round(t0 * 1e9) + self.offset_ns
        end = max(round(t1 * 1e9) + self.offset_ns, start)
        self.events.append({"name": name, "cat": cat, "start_ns": start, "end_ns": end, "args": args})

    @contextmanager
    def span(self, name: str, cat: str, **args):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, cat, t0, time.perf_counter(), **args)


def pid_of(rank: int) -> int:
    """The trace's process (and thread) id of ``rank``: never 0, which Perfetto reserves for the idle task."""
    return rank + 1


def rank_of(pid: int) -> int:
    return pid - 1


def rank_name(plan, topo, rank: int) -> str:
    pos = topo.position(rank)
    return f"rank {rank} {plan.device_ids()[rank]} (pipeline {pos.pipeline}, stage {pos.stage}, tp {pos.tp_rank})"


def chrome_trace(plan, per_rank: dict[int, list[dict]]) -> dict:
    """Every rank's spans (``Tracer.events``) as one Chrome trace: one process per rank, in rank order."""
    from runtime.parallel.topology import Topology

    topo = Topology(plan)
    starts = [e["start_ns"] for spans in per_rank.values() for e in spans]
    origin = (min(starts) // 10**9) * 10**9 if starts else 0
    events: list[dict] = []
    for rank in sorted(per_rank):
        pid = pid_of(rank)
        name = rank_name(plan, topo, rank)
        events += [{"name": "process_name", "ph": "M", "pid": pid, "tid": pid, "args": {"name": name}},
                   {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": pid, "args": {"sort_index": rank}},
                   {"name": "thread_name", "ph": "M", "pid": pid, "tid": pid, "args": {"name": f"rank {rank}"}}]
        events += [{"name": e["name"], "cat": e["cat"], "ph": "X", "ts": (e["start_ns"] - origin) / 1e3,
                    "dur": (e["end_ns"] - e["start_ns"]) / 1e3, "pid": pid, "tid": pid, "args": e["args"]}
                   for e in per_rank[rank]]
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"origin_unix_ns": origin, "clock": "ts: microseconds since origin_unix_ns (wall clock)"}}


def write_chrome_trace(path: str | Path, plan, per_rank: dict[int, list[dict]]) -> Path:
    """Write every rank's spans as one Chrome trace JSON file (``chrome_trace``)."""
    path = Path(path)
    write_atomically(path, json.dumps(chrome_trace(plan, per_rank)))
    return path


def read_spans(path: str | Path) -> dict[int, list[dict]]:
    """The complete events of a trace written by ``write_chrome_trace``, per rank, in file order."""
    out: dict[int, list[dict]] = {}
    for e in json.loads(Path(path).read_text())["traceEvents"]:
        if e.get("ph") == "X":
            out.setdefault(rank_of(e["pid"]), []).append(e)
    return out
