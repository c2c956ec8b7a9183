"""Interleaved 1F1B against 1F1B under the cost model, on the shipped clusters (docs/schedules.md).

For each case, ``baton solve`` (1F1B, its exact or structured family) gives the best plan; then every pipeline of
that plan keeps its devices, units, recomputation and each device group's layers, and those layers are cut into
v = 2 or 3 chunks per group in every possible way (the first group's first chunk may hold only the embedding and
the last group's last chunk only the head; every other chunk at least one layer; beyond ``VARIANTS`` cuts only
those within ``NEAR`` layers of the even one), the same cut for every replica of one layer split. Each variant is priced by the evaluator (``baton.evaluate``, the interleaved schedule of
``baton.schedules``); the table shows the 1F1B plan's time, the best interleaved variant that fits, and the change.
That searches interleaving around the 1F1B optimum only. The last columns are the planner's own choice, searching
chunks jointly with everything else: ``baton solve --max-chunks 3`` (1F1B, or 2 or 3 chunks per group; ``PLANNER_S``
seconds), its time, its change against the 1F1B plan, the chunks of its pipelines and its proven gap.

Run: ``python bench/bench_schedules.py``; writes bench/results/schedules.json and .md.
"""
from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from baton.cluster import load_cluster  # noqa: E402
from baton.evaluate import evaluate  # noqa: E402
from baton.plan import Pipeline, Plan, interleaved_pipeline, load_plan, validate  # noqa: E402
from baton.profile import ProfileSet  # noqa: E402

CASES = [
    # (cluster, model, global batch)
    ("a100x2_t4x2", "gpt3-1.3b", 64),
    ("a100x2_t4x2", "gpt3-1.3b", 8),
    ("a100x2_t4x2", "gpt3-2.7b", 64),
    ("poplar_b", "gpt3-1.3b", 64),
    ("poplar_b", "gpt3-1.3b", 8),
    ("poplar_b", "gpt3-760m", 64),
]
CHUNKS = (2, 3)
VARIANTS = 20_000
"""Most cuts priced per case and v; beyond, each group's cuts are limited to those within ``NEAR`` layers of its
most even cut (the table says where)."""
NEAR = 2
PLANNER_CHUNKS = 3
PLANNER_S = 180
"""Time limit of the planner's joint search (its cheap bounds of interleaved candidates are weaker than 1F1B's)."""


def chunk_cuts(layers: int, chunks: int, *, first: bool, last: bool):
    """Every cut of ``layers`` into ``chunks`` parts in order; only the model's first and last virtual stage may be empty."""
    for bars in itertools.combinations_with_replacement(range(layers + 1), chunks - 1):
        parts = [b - a for a, b in zip((0,) + bars, bars + (layers,))]
        if all(n > 0 or (first and c == 0) or (last and c == chunks - 1) for c, n in enumerate(parts)):
            yield parts


def interleave(pipe: Pipeline, cuts) -> Pipeline:
    """``pipe``'s groups with group g's layers cut as ``cuts[g]``: virtual stage c p + g holds ``cuts[g][c]``."""
    return interleaved_pipeline(pipe, [cuts[g][c] for c in range(len(cuts[0])) for g in range(len(cuts))])


def best_interleaved(plan: Plan, cluster, profiles, chunks: int) -> tuple[float, Plan, bool] | None:
    """The fastest fitting variant of ``plan`` with ``chunks`` chunks per group, and whether every cut was priced
    (``None``: no pipeline, or none fits)."""
    shapes = sorted({tuple(s.num_layers for s in pipe.stages) for pipe in plan.pipelines if len(pipe.stages) > 1})
    if not shapes:
        return None
    options = []
    for shape in shapes:
        p = len(shape)
        per_group = [list(chunk_cuts(n, chunks, first=g == 0, last=g == p - 1)) for g, n in enumerate(shape)]
        options.append(per_group)
    whole = math.prod(len(cuts) for per_group in options for cuts in per_group) <= VARIANTS
    if not whole:
        options = [[[c for c in cuts if max(abs(x - sum(c) / chunks) for x in c) <= NEAR] for cuts in per_group]
                   for per_group in options]
    options = [list(itertools.product(*per_group)) for per_group in options]
    best = None
    for choice in itertools.product(*options):
        by_shape = dict(zip(shapes, choice))
        pipes = tuple(interleave(pipe, by_shape[tuple(s.num_layers for s in pipe.stages)]) if len(pipe.stages) > 1 else pipe
                      for pipe in plan.pipelines)
        candidate = validate(replace(plan, pipelines=pipes))
        rep = evaluate(candidate, cluster, profiles)
        if rep.fits and (best is None or rep.iteration_time_ms < best[0]):
            best = (rep.iteration_time_ms, candidate, whole)
    return best


def solve(cluster: str, model: str, batch: int, out: Path, *extra: str) -> tuple[Plan, dict]:
    """``baton solve``'s plan and its solver figures (status, gap, ...)."""
    done = subprocess.run([sys.executable, "-m", "cli", "solve", "--cluster", str(ROOT / "clusters" / f"{cluster}.yaml"),
                           "--model", model, "--global-batch", str(batch), "--out", str(out), "--threads", "1", "--json",
                           *extra], check=True, cwd=ROOT, capture_output=True, text=True)
    return load_plan(out), json.loads(done.stdout)["solver"]


def describe(plan: Plan) -> str:
    parts = []
    for pipe in plan.pipelines:
        groups = pipe.device_stages
        cut = ", ".join("+".join(str(pipe.stages[k].num_layers) for k in range(g, len(pipe.stages), len(groups)))
                         for g in range(len(groups)))
        parts.append(f"{'/'.join(','.join(s.device_ids) for s in groups)} [{cut}] m={plan.batch(plan.pipelines.index(pipe))[1]}")
    return "; ".join(parts)


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for cluster_name, model, batch in CASES:
            plan, _ = solve(cluster_name, model, batch, Path(tmp) / "plan.json")
            cluster, profiles = load_cluster(ROOT / "clusters" / f"{cluster_name}.yaml"), ProfileSet(plan.model)
            base = evaluate(plan, cluster, profiles)
            row = {"case": f"{cluster_name} / {model} / batch {batch}", "one_f_one_b_ms": base.iteration_time_ms,
                   "plan": describe(plan), "interleaved": {}}
            for v in CHUNKS:
                found = best_interleaved(plan, cluster, profiles, v)
                row["interleaved"][str(v)] = None if found is None else {
                    "ms": found[0], "change": found[0] / base.iteration_time_ms - 1, "plan": describe(found[1]),
                    "every_cut": found[2]}
            chosen, info = solve(cluster_name, model, batch, Path(tmp) / "chosen.json", "--max-chunks", str(PLANNER_CHUNKS),
                                 "--time-limit", str(PLANNER_S))
            ms = evaluate(chosen, cluster, profiles).iteration_time_ms
            row["planner"] = {"ms": ms, "change": ms / base.iteration_time_ms - 1, "plan": describe(chosen),
                              "chunks": [pipe.chunks for pipe in chosen.pipelines], "status": info["status"],
                              "gap": info["gap"], "seconds": info.get("total_s")}
            rows.append(row)
            print(json.dumps(row), flush=True)
    out = ROOT / "bench" / "results"
    (out / "schedules.json").write_text(json.dumps(rows, indent=2) + "\n")
    (out / "schedules.md").write_text(markdown(rows))


def markdown(rows: list[dict]) -> str:
    lines = ["# Interleaved 1F1B around Baton's 1F1B optimum (cost model)", "",
             "Generated by `python bench/bench_schedules.py`. Each 1F1B plan is `baton solve`'s; its pipelines keep their "
             "devices, units, recomputation and each group's layers, cut into v chunks every possible way (the same cut "
             "for every replica of one layer split); the fastest variant that fits is shown. Layers per chunk are listed "
             "per group, groups in pipeline order (`a+b` = chunk 0 + chunk 1). The planner's columns: `baton solve "
             f"--max-chunks {PLANNER_CHUNKS} --time-limit {PLANNER_S}`, choosing the schedule with everything else "
             "(its time, change against the 1F1B plan, plan and proven gap).", "",
             "| case | 1F1B plan | 1F1B ms | " + " | ".join(f"v={v} ms (change)" for v in CHUNKS)
             + " | best interleaved plan | planner ms (change) | planner's plan | proven gap |",
             "| --- | --- | ---: | " + " | ".join("---:" for _ in CHUNKS) + " | --- | ---: | --- | ---: |"]
    for r in rows:
        cells = []
        for v in CHUNKS:
            it = r["interleaved"][str(v)]
            cells.append("no pipeline / none fits" if it is None else
                         f"{it['ms']:.1f} ({100 * it['change']:+.1f}%){'' if it['every_cut'] else ' (near-even cuts)'}")
        best = min((it for it in r["interleaved"].values() if it), key=lambda it: it["ms"], default=None)
        chosen = r["planner"]
        lines.append(f"| {r['case']} | {r['plan']} | {r['one_f_one_b_ms']:.1f} | " + " | ".join(cells)
                     + f" | {best['plan'] if best else '-'} | {chosen['ms']:.1f} ({100 * chosen['change']:+.1f}%) | "
                     + f"{chosen['plan']} | {100 * chosen['gap']:.2f}%{'' if chosen['status'] == 'optimal' else ' (time limit)'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
