"""``baton train --trace``: the file opens in Perfetto as it should.

Two checks of a trace written by a real 2-rank run (two stages over gloo, recomputation, validation):

* ``perfetto_json_problems`` applies the rules of Perfetto's JSON importer (google/perfetto,
  src/trace_processor/importers/json/ and importers/common/slice_tracker.cc) without Perfetto: events
  of phase X and M only; integer pid and tid in uint32, never 0 (Perfetto and its UI treat 0 as the
  kernel's idle task); ts and dur numbers of microseconds, turned into integer nanoseconds as Perfetto
  does (an integral value times 1000, else rounded); no negative duration; a process_name and a
  thread_name for every thread that has slices; and, per thread, slices that nest or are disjoint once
  sorted as Perfetto sorts them (by ts, the longer of two X events at one ts first; a slice ending exactly
  where the next starts is closed first), since Perfetto drops or moves a slice that overlaps another
  partly. ``displayTimeUnit`` is ignored by Perfetto since 2021 (it only counts it); older versions
  read "ns"/"ms" as the unit of ts, so only those two values are accepted.
* The real trace processor, through the ``perfetto`` Python package, when it can run here: the package
  downloads its ``trace_processor_shell`` binary on first use, which needs a network this machine does
  not have (``BATON_TRACE_PROCESSOR=/path/to/trace_processor_shell`` points the test at a local one).
  Otherwise that test is skipped and says why.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from runtime.launch.launcher import TrainConfig, train
from runtime.measure.trace import pid_of
from tests.runtime_helpers import plan_of, tiny

UINT32 = 2**32
METADATA = {"process_name", "process_sort_index", "thread_name", "thread_sort_index"}


def _ns(us) -> int:
    """A ts or dur in microseconds as the nanoseconds Perfetto stores (its CoerceToTs)."""
    return int(us) * 1000 if float(us) == math.trunc(us) else round(us * 1000.0)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return (isinstance(x, (int, float)) and not isinstance(x, bool)) and math.isfinite(x)


def perfetto_json_problems(trace) -> list[str]:
    """What Perfetto's JSON importer would reject, drop or misplace in ``trace`` (the parsed file); [] when
    every event lands where it was meant to."""
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        return ["not an object with a traceEvents list"]
    problems = []
    if "displayTimeUnit" in trace and trace["displayTimeUnit"] not in ("ms", "ns"):
        problems.append(f"displayTimeUnit {trace['displayTimeUnit']!r}")
    named_processes, named_threads, tracks = set(), set(), {}
    for i, e in enumerate(trace["traceEvents"]):
        where = f"event {i} ({e.get('name')!r})" if isinstance(e, dict) else f"event {i}"
        if not isinstance(e, dict):
            problems.append(f"{where}: not an object")
            continue
        ph, pid, tid = e.get("ph"), e.get("pid"), e.get("tid")
        if ph not in ("X", "M"):
            problems.append(f"{where}: phase {ph!r} (this trace writes X and M only)")
            continue
        if not isinstance(e.get("name"), str) or not e["name"]:
            problems.append(f"{where}: no name")
        if not (_is_int(pid) and _is_int(tid) and 0 < pid < UINT32 and 0 < tid < UINT32):
            problems.append(f"{where}: pid {pid!r} / tid {tid!r} not integers in 1..2^32-1")
            continue
        if "args" in e and not isinstance(e["args"], dict):
            problems.append(f"{where}: args is not an object")
        if ph == "M":
            name, args = e.get("name"), e.get("args") or {}
            if name not in METADATA:
                problems.append(f"{where}: unknown metadata event")
            elif name.endswith("_name"):
                if not isinstance(args.get("name"), str) or not args["name"]:
                    problems.append(f"{where}: {name} without args.name")
                (named_processes if name == "process_name" else named_threads).add(pid if name == "process_name" else (pid, tid))
            elif not _is_int(args.get("sort_index")):
                problems.append(f"{where}: {name} without an integer args.sort_index")
            continue
        ts, dur = e.get("ts"), e.get("dur")
        if not (_is_number(ts) and _is_number(dur)):
            problems.append(f"{where}: ts {ts!r} / dur {dur!r} not finite numbers (microseconds)")
            continue
        if dur < 0 or ts < 0:
            problems.append(f"{where}: negative ts or dur")
            continue
        if not isinstance(e.get("cat", ""), str):
            problems.append(f"{where}: cat is not a string")
        tracks.setdefault((pid, tid), []).append((_ns(ts), _ns(dur), i, e["name"]))
    for (pid, tid), slices in sorted(tracks.items()):
        if pid not in named_processes:
            problems.append(f"pid {pid}: slices but no process_name")
        if (pid, tid) not in named_threads:
            problems.append(f"pid {pid} tid {tid}: slices but no thread_name")
        problems += _nesting_problems(pid, tid, slices)
    return problems


def _nesting_problems(pid: int, tid: int, slices: list[tuple[int, int, int, str]]) -> list[str]:
    """Slices of one thread, in Perfetto's order, against the stack of open ones (its SliceTracker)."""
    problems, stack = [], []  # stack of (start, end, name)
    for ts, dur, i, name in sorted(slices, key=lambda s: (s[0], -s[1], s[2])):
        while stack and (stack[-1][1] < ts or (stack[-1][1] == ts and not (stack[-1][1] == stack[-1][0] and dur == 0))):
            stack.pop()
        if stack and ts + dur > stack[-1][1]:
            a, b, parent = stack[-1]
            problems.append(f"pid {pid} tid {tid}: event {i} ({name!r}, {ts}..{ts + dur} ns) overlaps {parent!r} "
                            f"({a}..{b} ns) partly: Perfetto drops or moves it")
            continue
        stack.append((ts, ts + dur, name))
    return problems


def slices_per_thread(trace) -> dict[tuple[int, int], list[str]]:
    """(pid, tid) -> slice names in time order: what Perfetto's slice table holds per thread track."""
    out: dict[tuple[int, int], list[tuple]] = {}
    for i, e in enumerate(trace["traceEvents"]):
        if e["ph"] == "X":
            out.setdefault((e["pid"], e["tid"]), []).append((_ns(e["ts"]), -_ns(e["dur"]), i, e["name"]))
    return {k: [name for *_, name in sorted(v)] for k, v in out.items()}


@pytest.fixture(scope="module")
def real_trace(tmp_path_factory):
    """A trace written by a real run: 2 ranks, 2 stages, rank 0 recomputing, validation at the end."""
    from runtime.data.tokens import TokenizerChoice, prepare

    root = tmp_path_factory.mktemp("trace")
    (root / "a.txt").write_text("spans of every rank, nested or disjoint, on one clock. " * 60)
    prepare([root / "a.txt"], root / "ds", TokenizerChoice(bytes=True), val_fraction=0.2)
    plan = plan_of(tiny(0.0), [[1], [1]], [3, 1], [1, 1], m=3, recompute={0: ["gelu", "fc2"]})
    train(TrainConfig(plan=plan, steps=2, data=str(root / "ds"), eval_every=2, timeout_s=60, trace=str(root / "trace.json")))
    return plan, root / "trace.json"


@pytest.mark.long  # a real run; test_train_metrics.py's trace test checks a real trace against these rules by default
def test_trace_keeps_the_rules_of_perfettos_json_importer(real_trace):
    """Catches: a rank on pid 0, spans of one rank that overlap partly (Perfetto would drop them), negative
    durations, timestamps too coarse to keep a child inside its parent, threads without names, and
    slices missing from or added to a rank's thread."""
    plan, path = real_trace
    trace = json.loads(path.read_text())
    assert perfetto_json_problems(trace) == []
    per_thread = slices_per_thread(trace)
    assert sorted(per_thread) == [(pid_of(r), pid_of(r)) for r in range(2)]  # one thread per rank, no other
    m = plan.num_microbatches
    for rank in range(2):
        names = per_thread[(pid_of(rank), pid_of(rank))]
        assert sum(n.startswith("F") and n[1:].isdigit() for n in names) == 2 * m
        assert names.count("optimizer") == 2 and names.count("validation") == 1
    assert "recompute" in per_thread[(pid_of(0), pid_of(0))] and "recompute" not in per_thread[(pid_of(1), pid_of(1))]

    # The nesting the rules were checked on is there: recomputation inside backward passes, the last stage's
    # receives inside validation.
    def spans(rank, pred):
        return [(_ns(e["ts"]), _ns(e["ts"]) + _ns(e["dur"])) for e in trace["traceEvents"]
                if e["ph"] == "X" and e["pid"] == pid_of(rank) and pred(e)]

    def inside(inner, outer):
        return all(any(a <= c and d <= b for a, b in outer) for c, d in inner)

    assert inside(spans(0, lambda e: e["cat"] == "recompute"), spans(0, lambda e: e["cat"] == "backward"))
    receives = spans(1, lambda e: e["name"].startswith("recv from") and "validation_batch" in e["args"])
    assert receives and inside(receives, spans(1, lambda e: e["cat"] == "eval"))


@pytest.mark.parametrize("change, needle", [
    (lambda t: t["traceEvents"].append({"name": "x", "ph": "X", "ts": 1.0, "dur": 1.0, "pid": 0, "tid": 0}), "pid 0"),
    (lambda t: t["traceEvents"].append({"name": "x", "ph": "X", "ts": 1.0, "dur": -1.0, "pid": 1, "tid": 1}), "negative"),
    (lambda t: t["traceEvents"].append({"name": "x", "ph": "X", "ts": "1", "dur": 1.0, "pid": 1, "tid": 1}), "not finite numbers"),
    (lambda t: t["traceEvents"].append({"name": "x", "ph": "B", "ts": 1.0, "pid": 1, "tid": 1}), "phase 'B'"),
    (lambda t: t["traceEvents"].append({"name": "late", "ph": "X", "ts": 5.0, "dur": 10.0, "pid": 1, "tid": 1}), "overlaps 'outer'"),
    (lambda t: t["traceEvents"].append({"name": "x", "ph": "X", "ts": 1.0, "dur": 1.0, "pid": 2, "tid": 2}), "pid 2: slices but no process_name"),
    (lambda t: t.update(displayTimeUnit="us"), "displayTimeUnit"),
])
def test_the_rules_catch_what_perfetto_would_misread(change, needle):
    trace = {"traceEvents": [
        {"name": "process_name", "ph": "M", "pid": 1, "tid": 1, "args": {"name": "rank 0"}},
        {"name": "thread_name", "ph": "M", "pid": 1, "tid": 1, "args": {"name": "rank 0"}},
        {"name": "outer", "ph": "X", "ts": 0.0, "dur": 10.0, "pid": 1, "tid": 1},
        {"name": "inner", "ph": "X", "ts": 0.0, "dur": 4.0, "pid": 1, "tid": 1},   # same start: the longer is the parent
        {"name": "next", "ph": "X", "ts": 10.0, "dur": 2.0, "pid": 1, "tid": 1},   # starts where outer ends: disjoint
    ]}
    assert perfetto_json_problems(trace) == []
    change(trace)
    problems = perfetto_json_problems(trace)
    assert any(needle in p for p in problems), problems


def _trace_processor_shell() -> tuple[str | None, str]:
    """A runnable trace_processor_shell, or None and why not. The download is tried in a child process with
    a time limit: without a network it fails (or could hang) there, not here."""
    local = os.environ.get("BATON_TRACE_PROCESSOR")
    if local:
        return (local, "") if os.access(local, os.X_OK) else (None, f"BATON_TRACE_PROCESSOR={local} is not executable")
    code = ("from perfetto.prebuilts.manifests.trace_processor_shell import TRACE_PROCESSOR_SHELL_MANIFEST as M\n"
            "from perfetto.prebuilts.perfetto_prebuilts import get_perfetto_prebuilt\n"
            "print(get_perfetto_prebuilt(M))\n")
    try:
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return None, "fetching perfetto's trace_processor_shell took over 120 s"
    path = res.stdout.strip().splitlines()[-1] if res.returncode == 0 and res.stdout.strip() else ""
    if path and os.access(path, os.X_OK):
        return path, ""
    last = (res.stderr.strip().splitlines() or ["no output"])[-1]
    return None, (f"perfetto's trace_processor_shell is not on this machine and could not be downloaded ({last}); "
                  "set BATON_TRACE_PROCESSOR to a local trace_processor_shell to run this test")


@pytest.mark.long  # the real run of real_trace (and perfetto's importer, where there is one)
def test_trace_loads_in_perfettos_trace_processor(real_trace):
    """The same trace in the real importer: every span becomes a slice on its rank's thread, in its rank's
    named process, and the importer counts no error and no data loss."""
    pytest.importorskip("perfetto.trace_processor", reason="the perfetto package is not installed (pip install perfetto)")
    from perfetto.trace_processor import TraceProcessor, TraceProcessorConfig

    shell, why = _trace_processor_shell()
    if shell is None:
        pytest.skip(why)
    _, path = real_trace
    trace = json.loads(path.read_text())
    want = slices_per_thread(trace)
    process_names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    tp = TraceProcessor(trace=str(path), config=TraceProcessorConfig(bin_path=shell, load_timeout=60))
    try:
        rows = tp.query("""
            select p.pid as pid, p.name as process, t.tid as tid, s.name as name, s.ts as ts, s.dur as dur
            from slice s join thread_track tt on s.track_id = tt.id join thread t using (utid)
            join process p using (upid) order by p.pid, t.tid, s.ts, s.dur desc""")
        got: dict[tuple[int, int], list[str]] = {}
        names = {}
        for r in rows:
            got.setdefault((r.pid, r.tid), []).append(r.name)
            names[r.pid] = r.process
        errors = [(r.name, r.value) for r in tp.query(
            "select name, value from stats where severity in ('error', 'data_loss') and value > 0")]
    finally:
        tp.close()
    assert got == want
    assert names == process_names
    assert errors == []
