"""Scale benchmark of `baton solve` on generated clusters (bench/scale_clusters.py: 64-1,024 GPUs, mixes of 2-4 GPU
types, some mixes held out of the planner's tuning), against issue 25's targets: a first plan within 10 s, a proven
gap within 60 s, a gap <= 1% within 2 minutes at 64-256 GPUs and <= 3% within 10 minutes at 1,024.

Per case: seconds to the first plan and to the first proven gap, the gap at 60 s, at the target time (2 or 10
minutes) and at the end, the plan's iteration time, the solver's peak memory, and the Megatron baseline under the
same evaluator. Each case runs in its own process, so its peak memory is its own: the peak resident set size of that
process (``resource.getrusage(RUSAGE_SELF).ru_maxrss``; HiGHS runs inside it), read right after the search, and
the resident size before the search (imports, tables, cluster) beside it. Writes bench/results/solver_scale.{json,md}
(``--quick``: solver_scale_quick.{json,md}, so a smoke run never overwrites the full table).

    python bench/bench_solver_scale.py                         # every case at its target time (10 min at 1,024 GPUs)
    python bench/bench_solver_scale.py --quick                 # one 64-GPU and one 256-GPU case, 60 s each
    python bench/bench_solver_scale.py --cases 64:h100-a100,1024 --time-limit 120

Gaps before the end come from the planner's progress lines (one per better plan, with the bound proven then): the
bound may rise between two lines without a line, so a gap at 60 s read from them is an upper estimate, and the time
to the first proven gap a late estimate; the gap at the end is the result's own.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from baton.atomic import write_atomically  # noqa: E402
from bench.scale_clusters import MIXES  # noqa: E402

MODELS = {64: ("gpt3-6.7b", 512), 128: ("gpt3-13b", 1024), 256: ("gpt3-13b", 1024), 512: ("gpt3-13b", 2048),
          1024: ("gpt3-13b", 4096)}
"""Model and global batch per cluster size: about 8-16 samples per GPU at 64, 4 at 1,024 (the earlier scale runs')."""

FIRST_PLAN_S, FIRST_GAP_S = 10.0, 60.0
"""Issue 25: a first plan within 10 s, a proven gap within 60 s."""


def gap_target(gpus: int) -> tuple[float, float]:
    """(gap, seconds): <= 1% within 2 minutes at 64-256 GPUs, <= 3% within 10 minutes beyond (issue 25)."""
    return (0.01, 120.0) if gpus <= 256 else (0.03, 600.0)


CASES = [(64, "a100-v100"), (64, "h100-a100"), (64, "h100-a100-l4"), (64, "h100-v100"),
         (128, "h100-a100-v100"), (128, "a100-v100-t4"),
         (256, "h100-a100-v100"), (256, "h100-a100-l4"), (256, "h200-a800-a10g-t4"),
         (1024, "h100-a100-v100-a10g"), (1024, "h200-a800-a10g-t4")]
"""(GPUs, mix) of the full run, each at its target time; mixes marked held out in bench/scale_clusters.py are
reported apart."""
QUICK = [(64, "a100-v100"), (256, "h100-a100-l4")]
"""``--quick``: one tuning mix at 64 GPUs and one held-out mix at 256, 60 s each."""
QUICK_LIMIT_S = 60.0

_LINE = re.compile(r"^\s*(?P<t>[0-9.]+)s\s+plan (?P<ms>[0-9.]+) ms \([^)]*\), (?:bound (?P<bound>[0-9.]+) ms, gap (?P<gap>[0-9.]+)%"
                   r"|bound pending)")


def progress_points(lines: list[str]) -> list[tuple[float, float, float | None]]:
    """(seconds, plan ms, gap or None while bounds are pending) of every progress line of ``solver.search.Progress``."""
    out = []
    for line in lines:
        m = _LINE.match(line)
        if m:
            out.append((float(m["t"]), float(m["ms"]), float(m["gap"]) / 100 if m["gap"] is not None else None))
    return out


def gap_at(points, seconds: float) -> float | None:
    """The gap of the last progress line at or before ``seconds`` (None: no bound proven by then)."""
    gaps = [g for t, _, g in points if t <= seconds]
    return gaps[-1] if gaps and gaps[-1] is not None else None


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def one(gpus: int, mix: str, seed: int, time_limit: float, threads: int, baseline: bool) -> dict:
    """Run in a child process: the planner, then Megatron; return one row."""
    from baton.cluster import load_cluster
    from baton.model_spec import PRESETS
    from baton.profile import ProfileSet
    from bench.scale_clusters import write_cluster
    from solver.search import NoPlanFits, search

    model, global_batch = MODELS[gpus]
    with tempfile.TemporaryDirectory() as tmp:  # through the YAML file, as a user would run it
        cluster = load_cluster(write_cluster(Path(tmp) / "cluster.yaml", gpus, mix, seed))
    spec = PRESETS[model]
    profiles = ProfileSet(spec)
    for g in cluster.gpu_types:  # the tables are inputs, not the solver's memory: load them first
        profiles[g]
    rss_before = rss_mib()
    lines: list[str] = []
    t0 = time.perf_counter()
    base = {"gpus": gpus, "mix": mix, "held_out": MIXES[mix].held_out, "seed": seed, "types": len(cluster.gpu_types),
            "model": model, "global_batch": global_batch, "time_limit_s": time_limit}
    try:
        res = search(spec, cluster, profiles, global_batch=global_batch, time_limit=time_limit, gap=1e-4, threads=threads,
                     log=lines.append, every_plan=True)  # as `baton solve` runs it: eq. 12c where it applies
    except NoPlanFits as exc:  # no plan within the limit is a result (every target failed), not a crash
        row = {**base, "error": f"NoPlanFits: {exc.message}", "wall_s": time.perf_counter() - t0,
               "rss_before_mib": rss_before, "peak_rss_mib": rss_mib(), "progress": lines}
        return _with_baseline(row, spec, cluster, profiles, global_batch) if baseline else row
    wall = time.perf_counter() - t0
    rss_peak = rss_mib()
    points = progress_points(lines)
    first_gap_s = next((t for t, _, g in points if g is not None), None)
    if first_gap_s is None and not res.unbounded:
        first_gap_s = wall  # bounded by the end, with no line to say when
    row = {**base, "wall_s": wall,
           "first_plan_s": res.first_plan_s, "first_gap_s": first_gap_s, "gap_60s": gap_at(points, 60.0),
           "iteration_ms": res.objective_ms, "bound_ms": res.bound_ms, "gap": None if res.unbounded else res.gap,
           "space_bound_ms": res.space_bound_ms, "space_gap": res.space_gap, "space_bound_from": res.space_bound_from,
           "status": res.status, "milps": res.solved, "candidates": res.candidates, "zero_stage": res.plan.zero_stage,
           "replicas": len(res.plan.pipelines), "stages": res.plan.num_stages, "gpus_used": len(res.plan.device_ids()),
           "uniform_batches": res.plan.uniform_batches, "rss_before_mib": rss_before, "peak_rss_mib": rss_peak,
           "progress": lines}
    return _with_baseline(row, spec, cluster, profiles, global_batch) if baseline else row


def _with_baseline(row: dict, spec, cluster, profiles, global_batch: int) -> dict:
    """The row with Megatron's plan under the same evaluator (after the search: its memory is not the solver's)."""
    from solver import baselines

    t1 = time.perf_counter()
    try:
        row["megatron_ms"] = baselines.megatron(spec, cluster, profiles, global_batch=global_batch).objective_ms
    except Exception as exc:  # noqa: BLE001 - a baseline that finds nothing is a result, not a crash
        row["megatron_error"] = str(exc)
    row["megatron_wall_s"] = time.perf_counter() - t1
    return row


def judge(row: dict) -> dict:
    """Pass/fail of each target; 'n/a' where the run was shorter than the target's time and had not met it yet."""
    if "error" in row:  # no plan within the limit, or a crash: nothing met
        return {"first_plan": "fail", "proven_gap": "fail", "gap": "fail"}
    gap, target_s = gap_target(row["gpus"])
    out = {"first_plan": _verdict(row["first_plan_s"] is not None and row["first_plan_s"] <= FIRST_PLAN_S)}
    if row["first_gap_s"] is None and row["time_limit_s"] < FIRST_GAP_S:
        out["proven_gap"] = "n/a"
    else:
        out["proven_gap"] = _verdict(row["first_gap_s"] is not None and row["first_gap_s"] <= FIRST_GAP_S)
    final = row["gap"]
    if final is not None and final <= gap and row["wall_s"] <= target_s * 1.05:
        out["gap"] = "pass"  # met earlier than the target time: a longer run only narrows it
    elif row["time_limit_s"] < target_s:
        out["gap"] = "n/a"
    else:
        out["gap"] = _verdict(final is not None and final <= gap)
    return out


def _verdict(ok: bool) -> str:
    return "pass" if ok else "fail"


def _pct(x) -> str:
    return "-" if x is None else f"{x:.2%}"


def _s(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def _source(row: dict) -> str:
    """Which bound the row's gap over every plan is against, as the table says it (nothing for rows written before
    it was recorded)."""
    from solver.search import BOUND_SOURCE_SHORT

    source = row.get("space_bound_from")
    return f" ({BOUND_SOURCE_SHORT.get(source, source)})" if source else ""


def markdown(rows, meta) -> str:
    out = ["# `baton solve` at scale (generated clusters)", "",
           f"Machine: {meta['machine']}, {meta['threads']} solver thread(s), {meta['cpus']} CPU(s). Generated by "
           f"`{meta['command']}`. Clusters: `bench/scale_clusters.py` (seed {meta['seed']}). Targets (issue 25): first plan "
           f"<= {FIRST_PLAN_S:g} s, a proven gap <= {FIRST_GAP_S:g} s, gap <= 1% at 2 min (64-256 GPUs) or <= 3% at "
           "10 min (1,024). Gaps before the end are read from the progress lines (upper estimates); 'gap at end' is the "
           "result's, over the family the search proves its optimum in; 'over every plan' is the gap against the highest "
           "bound it has on every plan whatever its layout, in brackets: eq. 12b (solver/README.md, 'The bound over every "
           "plan'), known from the first plan on, or eq. 12c (replicas, 'A sharper bound from replicas'), computed after "
           "the search with the time left where the cluster's classes are few enough. Peak memory: the solver "
           "process's peak resident set size (`ru_maxrss`), with its size before the search in brackets.", ""]
    head = ("| GPUs | mix | model / batch | limit s | first plan s | first gap s | gap 60 s | gap at end | over every plan | "
            "Baton ms | Megatron ms (x) | peak MiB (before) | first plan | proven gap | gap target |")
    rule = "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | --- |"
    for title, held in (("Tuning mixes", False), ("Held-out mixes (never used to tune the planner)", True)):
        part = [r for r in rows if r.get("held_out") == held]
        if not part:
            continue
        out += [f"## {title}", "", head, rule]
        for r in part:
            if "error" in r:
                meg = f"{r['megatron_ms']:.0f}" if "megatron_ms" in r else "none fits" if "megatron_error" in r else "-"
                mem = f"{r['peak_rss_mib']:.0f} ({r['rss_before_mib']:.0f})" if "peak_rss_mib" in r else "-"
                out.append(f"| {r['gpus']} | {r['mix']} | {r.get('model', '')} / {r.get('global_batch', '')} | "
                           f"{r.get('time_limit_s', 0):g} | none: {r['error'][:90]} | - | - | - | - | - | {meg} | {mem} | fail | "
                           "fail | fail |")
                continue
            meg = (f"{r['megatron_ms']:.0f} ({r['megatron_ms'] / r['iteration_ms']:.2f}x)" if "megatron_ms" in r
                   else "none fits" if "megatron_error" in r else "-")
            v = judge(r)
            target_gap, target_s = gap_target(r["gpus"])
            out.append(f"| {r['gpus']} | {r['mix']} | {r['model']} / {r['global_batch']} | {r['time_limit_s']:g} | "
                       f"{_s(r['first_plan_s'])} | {_s(r['first_gap_s'])} | {_pct(r['gap_60s'])} | {_pct(r['gap'])} | "
                       f"{_pct(r.get('space_gap'))}{_source(r)} | "
                       f"{r['iteration_ms']:.0f} | {meg} | {r['peak_rss_mib']:.0f} ({r['rss_before_mib']:.0f}) | "
                       f"{v['first_plan']} | {v['proven_gap']} | {v['gap']} (<= {target_gap:.0%} at {target_s:g} s) |")
        out.append("")
    out += ["'n/a': the run was shorter than the target's time and had not met it yet. A gap of '-' means no proven "
            "bound: the time limit stopped the enumeration of candidates first."]
    return "\n".join(out) + "\n"


def select(spec: str, cases):
    """``--cases``: comma-separated ``GPUS`` or ``GPUS:MIX`` or ``MIX``."""
    wanted = [w.strip() for w in spec.split(",") if w.strip()]
    out = []
    for gpus, mix in cases:
        for w in wanted:
            g, m = w.split(":", 1) if ":" in w else (w, "") if w.isdigit() else ("", w)
            if (not g or int(g) == gpus) and (not m or m == mix):
                out.append((gpus, mix))
                break
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description="Scale benchmark of `baton solve` on generated clusters (bench/scale_clusters.py) "
                                             "against issue 25's targets.")
    ap.add_argument("--quick", action="store_true", help=f"only {QUICK} at {QUICK_LIMIT_S:g} s (a smoke run)")
    ap.add_argument("--time-limit", type=float, default=None, help="override every case's limit (default: its target time)")
    ap.add_argument("--cases", default="", help="comma-separated GPUS, MIX or GPUS:MIX (e.g. 64,1024:h200-a800-a10g-t4); "
                                                "a GPUS:MIX not in the list is run too")
    ap.add_argument("--seed", type=int, default=0, help="the generator's seed for every case")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-baseline", action="store_true", help="skip the Megatron baseline")
    ap.add_argument("--only", default="", help=argparse.SUPPRESS)  # the earlier name of --cases GPUS
    ap.add_argument("--one", nargs=2, metavar=("GPUS", "MIX"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(int(args.one[0]), args.one[1], args.seed, args.time_limit or 60.0, args.threads,
                             not args.no_baseline)))
        return
    cases = QUICK if args.quick else CASES
    args.cases = args.cases or args.only
    if args.cases:
        chosen = select(args.cases, CASES + QUICK)
        extra = [(int(g), m) for g, _, m in (w.partition(":") for w in args.cases.split(",") if ":" in w)
                 if m in MIXES and (int(g), m) not in chosen]
        cases = list(dict.fromkeys(chosen + extra))
    rows = []
    for gpus, mix in cases:
        limit = args.time_limit or (QUICK_LIMIT_S if args.quick else gap_target(gpus)[1])
        print(f"{gpus} GPUs / {mix} / {limit:g} s ...", flush=True)
        cmd = [sys.executable, __file__, "--one", str(gpus), mix, "--time-limit", str(limit), "--threads", str(args.threads),
               "--seed", str(args.seed)] + (["--no-baseline"] if args.no_baseline else [])
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit * 3 + 600)
        try:
            row = json.loads(proc.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:]
            row = {"gpus": gpus, "mix": mix, "held_out": MIXES[mix].held_out, "error": " ".join(tail)}
        row["targets"] = judge(row)
        rows.append(row)
        print("  " + json.dumps({k: v for k, v in row.items() if k != "progress"}), flush=True)
    meta = {"machine": f"{platform.machine()}, Python {platform.python_version()}", "threads": args.threads,
            "cpus": os.cpu_count(), "seed": args.seed, "command": "python bench/bench_solver_scale.py " + " ".join(sys.argv[1:])}
    out = ROOT / "bench" / "results"
    stem = "solver_scale_quick" if args.quick else "solver_scale"
    write_atomically(out / f"{stem}.json", json.dumps({"meta": meta, "rows": rows}, indent=2))
    write_atomically(out / f"{stem}.md", markdown(rows, meta))
    print(markdown(rows, meta))


if __name__ == "__main__":
    main()
