"""The runtime on this machine's GPU against the cost model and against the plainest fast PyTorch loop (issues 9, 27).

On a CUDA machine, for each model (``--models``, default ``gpt3-350m`` and ``gpt3-1.3b``, both in bf16 with fused
attention, sequence ``--seq-len`` 1024), it
1. profiles GPU 0 with the runtime's own layer (``runtime.measure.op_profiler.profile_table``) at the plans'
   micro-batch sizes (``--shares``: tensor-parallel shares, 1.0 by default: the plans here are one GPU) and writes the
   table to ``profiles/measured/<gpu>__<model>__s<seq>.csv`` with ``<same>.command.json`` beside it (the command,
   torch and CUDA versions, the device); then profiles it again with each layer, embedding and head timed back
   to back (``back_to_back=True``) into ``bench/results/gpu_table_back_to_back[_<model>].csv``;
2. describes the GPU as a one-device cluster (its catalog type, its total memory as capacity, and as its node's
   ``host_link_gb_per_s`` the slower direction of this machine's pinned copies, ``runtime.measure.host_link``,
   which the offloading plans' copies are priced at, eq. 2o);
3. builds one-GPU plans: global batch ``--global-batch`` 16 at three micro-batch sizes (``--micro-batches`` 2,4,8),
   each without recomputation and recomputing every operator (``--recompute none,all``), and for the smaller model
   (``--offload-models``) each of these again keeping activations in host memory (``none+offload``: the attention
   block's held tensors, whose copies the cost model expects to outlast the block's compute both ways;
   ``all+offload``: Cephalo's layer boundary, whose copies it expects to hide behind the backward and its
   recomputation but not quite behind a 350m layer's forward; ``bench_reference.plan_choices``), each offloading
   plan right after the same plan without offload; keeps those the evaluator says fit, and for each runs
   ``bench/bench_reference.py``'s comparison: Baton's engine on the plan, with its offload (``baton train``'s one rank: pre-flight check, NCCL, ``Engine.train_step``) interleaved with the reference loop (the
   single-device model, ``AdamW(fused=True)``, the same bf16 weights with fp32 masters), ``--rounds`` rounds of
   ``--steps`` steps each after ``--warmup`` warm-up steps;
4. reports for every plan: measured and predicted iteration time (from the default table and the one timed back
   to back), peak allocated memory against the predicted peak, tokens/s, MFU (catalog bf16 peak), the passes and
   phases measured against predicted, the reference's tokens/s and the ratio Baton/reference (target >= 0.97);
   and for an offloading plan the exposed transfer (section "Exposed transfer of offloaded activations" of gpu.md,
   ``exposed_transfer`` in gpu.json): its measured step time less that of the same micro-batch size and recompute
   set without offload, both measured in this run one after the other (each against the reference loop, which
   offloads nothing), against the evaluator's ``offload_ms`` x micro-batches (eq. 2o) and the difference of the two
   predicted iteration times; the host's measured peak of offloaded bytes against ``host_activation_bytes``
   (eq. 8o), and the bytes the backward found not yet prefetched;
5. writes ``bench/results/gpu.json`` and ``gpu.md`` after every plan, so a run cut short keeps its rows.

Both models live on the GPU during a comparison: a step's peak memory is the contender's own state plus what the step
allocated above all that was allocated before it (``bench_reference.interleave``).

``--device cpu`` runs the same code end to end at tiny sizes (the ``tiny`` preset, a couple of steps, tables into
``<out>/profiles``, the GPU named ``h100`` for the cost model) so that a lent GPU's run can fail only on the GPU;
tests/test_bench_gpu.py runs it. Without a CUDA device and without ``--device cpu`` it prints ``skipped: no CUDA
device`` and exits 0 (CI has none).

Time budget on one H100/H200 (the defaults; under 8 minutes asked). From the H200 run of 2026-11-26 (gpt3-350m,
global batch 8: 74-355 ms a step without recomputation, 129-732 ms with) the 350m steps at global batch 16 take
about 150-370 ms (none) and 260-550 ms (all); 1.3b has 3.7x the FLOPs at a higher MFU: about 370-520 ms (none) and
500-700 ms (all). Each plan runs (2 warm-up + 4 rounds x 2) = 10 steps of Baton and 10 of the reference: about
35 s of steps for 350m's six plans and 60 s for 1.3b's. Building the models on the host (reference once per model,
an engine per plan): about 25 s for 350m and 80 s for 1.3b. Profiling, two tables of three micro-batch sizes per
model: about 25 s for 350m and 40 s for 1.3b (the 2026-11-26 run took about 75 s for 350m's two tables of twelve).
Start-up, CUDA and NCCL: about 20 s. In all about 5 minutes without offload.

The offloading plans run for the smaller model only (``--offload-models``, default the smallest of ``--models``: 350m),
at its three micro-batch sizes: 350m's steps are the shortest, its rows come first (before the deadline can bite), and
its hidden width of 1024 gives the copies the least compute to hide behind, so the exposure is largest against its
step (the cost model on the analytic H100 table: +175 ms on a 150 ms step without recomputation, where 1.3b's is
+300 ms on 455 ms); the three micro-batch sizes show whether the exposure follows the copies per micro-batch as
eq. 2o says, which one size at both models would not, and they cost less than 1.3b's pair would (its pinned buffers
alone: up to 5.7 GB). Their cost: ``none+offload`` copies the attention block's seven hidden-width tensors, 24 layers
x 16 samples x 1024 tokens x 7 x 2 KiB = 5.6 GB each way a step, about 120 ms each way at PCIe 5's 48 GB/s (predicted
steps about 325 ms); ``all+offload`` copies the layer boundary (four tensors) beside the full recomputation (predicted
about 30 ms more than ``all``). Six plans of 10 + 10 steps (the reference again beside each) at about 8 s, an engine
each (3 s) and the first step's pinned buffers (up to 2.8 GB at micro-batch 8): about 70 s, so about 6.2 minutes in
all. ``--rounds``/``--steps`` trade precision for time, and ``--deadline-s`` (420 s) starts no model or plan after
that time, so the run ends by about 8 minutes whatever the estimate got wrong (the table then says which plans did
not run; an offloading plan past it loses its row, not its base's).

Several ranks on one GPU would need a backend that allows it; NCCL refuses two ranks on one device, so multi-rank
plans wait for a machine with several GPUs.

On CPU the run is one process that copies by itself, so its exposed transfer only tests the fields (the cost model
is told the CPU is an H100, whose copies would hide at these sizes). Its host bytes come within 2% of eq. 8o, not to
the byte: CPU bf16 LayerNorm keeps 128-byte statistics per sample where the analytic split has 256, the measured
table records that in the LayerNorm's saved bytes, and ``baton.memory.tensor_bytes`` scales the LayerNorm's input
(``layer_input``, ``x_mid``, copied whole by the runtime) by the same factor.

Run: ``python bench/bench_gpu.py [--models gpt3-350m,gpt3-1.3b] [--recompute none,all,all+offload]
[--offload-models gpt3-350m] [--rounds 4] [--steps 2] [--device cpu]``.
"""
from __future__ import annotations

import argparse
import gc
import json
import platform
import shlex
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from baton.model_spec import PRESETS, ModelSpec  # noqa: E402
from baton.plan import Plan  # noqa: E402
from bench_reference import (CLUSTER_NAME, DEVICE_ID, OFFLOAD, base_label, build_reference, one_device_plan,  # noqa: E402,F401
                             one_rank_group, plan_choices, recompute_sets, run_reference)

GIB = 1024**3
MICRO_BATCHES = (1, 2, 4, 8)
"""Micro-batch sizes ``candidate_plans`` tries by default."""
SHARES = (0.25, 0.5, 1.0)
RECOMPUTE = ("none", "all")
"""Labels of every model's plans by default."""
OFFLOADING = ("none" + OFFLOAD, "all" + OFFLOAD)
"""Labels added by default for the models of ``--offload-models`` (the module docstring says why only those)."""
CPU_GPU_TYPE = "h100"
"""The catalog GPU the cost model is told the CPU is, in ``--device cpu`` (its tables are measured on the CPU)."""


def bench_model(base: str = "gpt3-350m", seq_len: int = 1024) -> ModelSpec:
    """The benchmark's model: a preset in bf16 with fused attention and no dropout, as large models are
    pretrained (the name says so, since its tables are kept under it)."""
    return PRESETS[base].with_overrides(name=f"{base}-bf16-s{seq_len}", dtype="bf16", attention="fused", dropout=0.0,
                                        seq_len=seq_len)


def cluster_mapping(gpu_type: str, memory_bytes: int, host_link_gb_per_s: float | None = None) -> dict:
    """A cluster spec (as parsed YAML) of this one GPU: catalog type, its real memory, no links to price, and the host
    link this machine measured (``runtime.measure.host_link``; the catalog's figure where None)."""
    node = {"name": "gpu", "gpus": [{"type": gpu_type, "count": 1, "memory_gib": memory_bytes / GIB}],
            "intra_node_link": {"bandwidth_gb_per_s": 100.0, "latency_us": 10.0}}
    if host_link_gb_per_s is not None:
        node["host_link_gb_per_s"] = round(float(host_link_gb_per_s), 2)
    return {"name": CLUSTER_NAME, "description": "the benchmark's local GPU", "nodes": [node]}


def with_bases(labels) -> tuple[str, ...]:
    """``labels`` in the order their recompute sets first appear, each set's plan without offload first and its
    offloading label right after it (the base added where not named): an offloading plan's exposed transfer is
    measured against the plan run just before it."""
    groups: dict[str, list[str]] = {}
    for label in labels:
        group = groups.setdefault(base_label(label), [base_label(label)])
        if label not in group:
            group.append(label)
    return tuple(label for group in groups.values() for label in group)


def candidate_plans(spec: ModelSpec, global_batch: int = 8, micro_batches=MICRO_BATCHES,
                    recompute=("none", "attention", "all")) -> list[tuple[str, Plan]]:
    """One-GPU plans: every micro-batch size dividing ``global_batch``, times every label named (``plan_choices``:
    a recompute set, with ``+offload`` also its offloaded tensors; an offloading label's base comes first)."""
    choices = plan_choices(spec)
    unknown = [label for label in recompute if label not in choices]
    if unknown:
        raise ValueError(f"unknown plan labels {', '.join(unknown)} (known: {', '.join(choices)})")
    out = []
    for mb in micro_batches:
        if global_batch % mb:
            continue
        for label in with_bases(recompute):
            ops, offload = choices[label]
            plan = one_device_plan(spec, micro_batch_size=mb, num_microbatches=global_batch // mb, recompute=ops,
                                   offload=offload)
            out.append((f"mb {mb} x {global_batch // mb}, recompute {label}", plan))
    return out


def fitting(plans: list[tuple[str, Plan]], cluster, profiles) -> list[tuple[str, Plan]]:
    """The plans the evaluator says fit the GPU."""
    from baton.evaluate import evaluate

    return [(name, plan) for name, plan in plans if evaluate(plan, cluster, profiles).fits]


def row_of(name: str, report: dict, back_to_back: dict | None = None) -> dict:
    """One result line from a ``runtime.measure.report.build_report`` dict of a one-device run (and, when given, the
    report of the same run priced from the table timed back to back)."""
    dev = report["devices"][0]
    it = report["iteration_time_ms"]
    peak_measured = dev["measured"]["peak_allocated_bytes"]
    peak_predicted = dev["predicted"]["peak_memory_bytes"]
    tp = report["throughput"]
    predicted_device = report["prediction"]["devices"][0]
    return {"plan": name, "iteration_ms": it["measured"], "iteration_ms_predicted": it["predicted"],
            "iteration_rel_error": it["rel_error"],
            "peak_allocated_gib": peak_measured / GIB, "peak_predicted_gib": peak_predicted / GIB,
            "peak_rel_error": (peak_predicted - peak_measured) / peak_measured if peak_measured else None,
            "activation_rel_error": dev["activation_rel_error"],
            "tokens_per_s": tp["tokens_per_s"], "tokens_per_s_predicted": report["tokens_per_s"]["predicted"],
            "mfu": tp["mfu"]["measured"], "mfu_predicted": tp["mfu"]["predicted"],
            # Where the time goes, per micro-batch (backward includes its recomputation) and per step.
            "passes_ms": {k: {"measured": dev["measured"][k], "predicted": dev["predicted"][k]}
                          for k in ("fwd_ms", "bwd_ms", "recompute_ms")},
            "phases_ms": report["phases"],
            # Offloaded activations (0 without offload): the host's peak, and what eq. 2o adds per micro-batch.
            "host_activation_bytes": {"measured": dev["measured"].get("peak_host_activation_bytes"),
                                      "predicted": dev["predicted"].get("host_activation_bytes", 0.0)},
            "offload_ms_predicted": predicted_device.get("offload_ms", 0.0),
            "back_to_back": None if back_to_back is None else {
                "iteration_ms_predicted": back_to_back["iteration_time_ms"]["predicted"],
                "iteration_rel_error": back_to_back["iteration_time_ms"]["rel_error"],
                "passes_ms": {k: back_to_back["devices"][0]["predicted"][k] for k in ("fwd_ms", "bwd_ms", "recompute_ms")},
                "phases_ms": {k: v["predicted"] for k, v in back_to_back["phases"].items()}}}


def exposed_transfer(row: dict, base: dict | None) -> dict | None:
    """What offloading added to ``row``'s step, measured against ``base`` (the same model, micro-batch size and
    recompute set without offload, measured in the same run) and predicted (eq. 2o: ``offload_ms`` per micro-batch
    x micro-batches; and the difference of the two predicted iteration times, which also holds the rest of the
    step); the host's peak of offloaded bytes against eq. 8o. None without a base (it failed or did not fit)."""
    if base is None:
        return None
    measured = row["iteration_ms"] - base["iteration_ms"]
    predicted = row["offload_ms_predicted"] * row["num_microbatches"]
    host = row["host_activation_bytes"]
    return {"against": base["plan"], "base_iteration_ms": base["iteration_ms"], "iteration_ms": row["iteration_ms"],
            "measured_ms": measured,
            # Wall time of the steps as the comparison with the reference took it (the engine's own clock above).
            "measured_wall_ms": row["baton_median_ms"] - base["baton_median_ms"],
            "predicted_ms": predicted,
            "predicted_iteration_difference_ms": row["iteration_ms_predicted"] - base["iteration_ms_predicted"],
            # In ms, not relative: a transfer that hides measures about 0.
            "error_ms": predicted - measured,
            "host_bytes_measured": host["measured"], "host_bytes_predicted": host["predicted"],
            "host_rel_error": (host["predicted"] - host["measured"]) / host["measured"] if host["measured"] else None,
            "late_bytes": row.get("offload_late_bytes")}


def attach_exposed(rows: list[dict]) -> None:
    """Set ``exposed_transfer`` on every offloading row, against the row of its base in ``rows``."""
    for r in rows:
        if r.get("offload"):
            base = next((b for b in rows if not b.get("offload") and b.get("model") == r.get("model")
                         and b.get("micro_batch_size") == r["micro_batch_size"] and b.get("label") == base_label(r["label"])),
                        None)
            r["exposed_transfer"] = exposed_transfer(r, base)


def _bytes(n) -> str:
    if n is None:
        return "-"
    return f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{n / 1024**2:.2f} MiB" if n >= 1024**2 / 10 else f"{n / 1024:.1f} KiB"


def exposed_markdown(rows: list[dict]) -> list[str]:
    """The section of the offloading rows (none without any)."""
    off = [r for r in rows if r.get("offload")]
    if not off:
        return []
    lines = ["", "## Exposed transfer of offloaded activations", "",
             "| plan | offloaded per layer | without offload ms | with ms | exposed ms | predicted: offload_ms x m | "
             "predicted iteration difference | error ms | host peak | predicted | error | not prefetched |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in off:
        e = r.get("exposed_transfer")
        tensors = ", ".join(r["offload"])
        host = r["host_activation_bytes"]
        if e is None:
            lines.append(f"| {r['plan']} | {tensors} | - | {r['iteration_ms']:.1f} | - | "
                         f"{r['offload_ms_predicted'] * r['num_microbatches']:.1f} | - | - | {_bytes(host['measured'])} | "
                         f"{_bytes(host['predicted'])} | - | {_bytes(r.get('offload_late_bytes'))} |")
            continue
        err = "-" if e["host_rel_error"] is None else f"{e['host_rel_error']:+.1%}"
        lines.append(f"| {r['plan']} | {tensors} | {e['base_iteration_ms']:.1f} | {e['iteration_ms']:.1f} | "
                     f"{e['measured_ms']:+.1f} | {e['predicted_ms']:+.1f} | {e['predicted_iteration_difference_ms']:+.1f} | "
                     f"{e['error_ms']:+.1f} | {_bytes(e['host_bytes_measured'])} | {_bytes(e['host_bytes_predicted'])} | "
                     f"{err} | {_bytes(e['late_bytes'])} |")
    lines += ["", "Exposed: the offloading plan's measured iteration time less that of the same micro-batch size and "
                  "recompute set without offload (the row before it in the table above), both measured in this run, "
                  "one after the other, each interleaved with the reference loop (which offloads nothing). Predicted: "
                  "the evaluator's `offload_ms` (eq. 2o, per micro-batch) x micro-batches, and the difference of the two "
                  "predicted iteration times. Host peak: the offloaded bytes the host held at once (`StepStats."
                  "peak_host_activation_bytes`) against `host_activation_bytes` (eq. 8o); not prefetched: the bytes the "
                  "backward had to wait for (`offload_late_bytes`, the most in a step)."]
    return lines


def markdown(rows: list[dict], env: dict) -> str:
    def pct(x):
        return "-" if x is None else f"{x:+.1%}"

    def passes(r):
        p = r.get("passes_ms")
        if not p or p["fwd_ms"]["measured"] is None:
            return "-"
        return " / ".join(f"{p[k]['measured']:.1f} ({p[k]['predicted']:.1f})" for k in ("fwd_ms", "bwd_ms", "recompute_ms"))

    def optimizer(r):  # the step's phase against the table's row (eq. 10)
        o = (r.get("phases_ms") or {}).get("optimizer_ms")
        return "-" if o is None else f"{o['measured']:.1f} ({o['predicted']:.1f})"

    def b2b(r, key, fmt):
        x = (r.get("back_to_back") or {}).get(key)
        return "-" if x is None else fmt(x)

    lines = ["| plan | iteration ms | predicted | error | predicted, table back to back | error | "
             "per micro-batch: fwd / bwd / recompute ms (predicted) | optimizer ms (predicted) | peak allocated GiB | "
             "predicted peak | error | tokens/s | MFU | predicted MFU | reference tokens/s | Baton / reference |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        mfu = "-" if r["mfu"] is None else f"{r['mfu']:.1%}"
        ref = "-" if r.get("reference") is None else f"{r['reference']['tokens_per_s']:,.0f}"
        ratio = "-" if r.get("ratio") is None else f"{r['ratio']:.3f}"
        lines.append(f"| {r['plan']} | {r['iteration_ms']:.1f} | {r['iteration_ms_predicted']:.1f} | {pct(r['iteration_rel_error'])} | "
                     f"{b2b(r, 'iteration_ms_predicted', lambda x: f'{x:.1f}')} | {b2b(r, 'iteration_rel_error', pct)} | "
                     f"{passes(r)} | {optimizer(r)} | {r['peak_allocated_gib']:.2f} | {r['peak_predicted_gib']:.2f} | {pct(r['peak_rel_error'])} | "
                     f"{r['tokens_per_s']:,.0f} | {mfu} | {r['mfu_predicted']:.1%} | {ref} | {ratio} |")
    for label, errs in (("", [r["iteration_rel_error"] for r in rows]),
                        (" with the table timed back to back", [(r.get("back_to_back") or {}).get("iteration_rel_error") for r in rows])):
        errs = [abs(e) for e in errs if e is not None]
        if errs:
            lines += ["", f"Iteration time{label}: mean absolute error {statistics.mean(errs):.1%}, worst {max(errs):.1%}."]
    ratios = [r["ratio"] for r in rows if r.get("ratio") is not None]
    if ratios:
        lines += ["", f"Baton / reference tokens/s: median {statistics.median(ratios):.3f}, worst {min(ratios):.3f} "
                      f"(target >= 0.97; the reference recomputes nothing, so a recomputing plan's ratio includes its recomputation)."]
    models = env.get("models") or [{"model": env["model"], "attention": env["attention"], "table": env["table"]}]
    lines += [""] + [f"Model `{m['model']}` (bf16, {m['attention']} attention); table: `{m['table']}`." for m in models]
    if "rounds" in env:
        steps = (f"{env['warmup']} warm-up steps, then {env['rounds']} rounds of {env['steps']} steps interleaved with the "
                 f"reference loop, per plan; the cost-model report drops the last warm-up step")
    else:
        steps = f"{env['steps']} steps per plan, the first dropped"
    lines += [f"On {env['device']} (catalog `{env['gpu_type']}`), torch {env['torch']}, CUDA {env['cuda']}; {steps}."]
    if env.get("host_link"):
        link = env["host_link"]
        lines += [f"Host link: {link['to_host_gb_per_s']:.1f} GB/s to the host, {link['to_device_gb_per_s']:.1f} GB/s to the "
                  f"device (pinned copies of {link['copy_bytes'] >> 20} MiB); the cost model takes the slower, "
                  f"{env['host_link_gb_per_s']:.2f} GB/s."]
    lines += [f"Failed: {name}: {why}" for name, why in env.get("failed", {}).items()]
    if env.get("not_run"):
        lines += [f"Not started (past --deadline-s): {', '.join(env['not_run'])}."]
    done = len(rows) + len(env.get("failed", {}))
    if env.get("plans_asked", done) > done:  # written after every plan: a run cut short says so
        lines += [f"Cut short: {done} of {env['plans_asked']} plans ran."]
    lines += exposed_markdown(rows)
    return "\n".join(lines) + "\n"




def parse_list(text: str, kind=str) -> tuple:
    return tuple(kind(x) for x in text.split(",") if x.strip())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cpu: the whole run at tiny sizes (the defaults below become tiny's), to test it without a GPU")
    parser.add_argument("--models", default=None, help="presets, comma-separated (default gpt3-350m,gpt3-1.3b; cpu: tiny)")
    parser.add_argument("--seq-len", type=int, default=None, help="default 1024 (cpu: 32)")
    parser.add_argument("--global-batch", type=int, default=None, help="default 16 (cpu: 4)")
    parser.add_argument("--micro-batches", default=None, help="default 2,4,8 (cpu: 1,2)")
    parser.add_argument("--recompute", default=None,
                        help="labels of every model's plans: a recompute set (none, attention, all), with +offload also "
                             "keeping activations in host memory (bench_reference.plan_choices; its base runs first); "
                             "default none,all, and none+offload,all+offload for --offload-models")
    parser.add_argument("--offload-models", default=None,
                        help="models that get the offloading labels by default, comma-separated (default: the smallest "
                             "of --models; '' for none); ignored with --recompute")
    parser.add_argument("--steps", type=int, default=None, help="steps of each contender per round (default 2; cpu: 1)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 4; cpu: 2)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps of each contender (default 2; cpu: 1)")
    parser.add_argument("--reps", type=int, default=None, help="profiler repetitions (default 10; cpu: 2)")
    parser.add_argument("--shares", default="1.0", help="tensor-parallel shares to profile, comma-separated")
    parser.add_argument("--deadline-s", type=float, default=420.0,
                        help="start no model or plan after this many seconds (0: no limit): a lent GPU's time is short")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--profiles", type=Path, default=None,
                        help="tables folder: the measured tables are written to its measured/ and the plans priced from "
                             "them (default: the checkout's profiles/; cpu: <out>/profiles)")
    args = parser.parse_args(argv)
    cpu = args.device == "cpu"
    pick = (lambda value, gpu, tiny: (tiny if cpu else gpu) if value is None else value)
    models = parse_list(pick(args.models, "gpt3-350m,gpt3-1.3b", "tiny"))
    seq_len = pick(args.seq_len, 1024, 32)
    global_batch = pick(args.global_batch, 16, 4)
    micro_batches = parse_list(pick(args.micro_batches, "2,4,8", "1,2"), int)
    offload_models = (parse_list(args.offload_models) if args.offload_models is not None
                      else (min(models, key=lambda b: PRESETS[b].num_params()),) if models else ())
    labels = {base: parse_list(args.recompute) if args.recompute is not None
              else RECOMPUTE + (OFFLOADING if base in offload_models else ()) for base in models}
    steps, rounds, warmup, reps = pick(args.steps, 2, 1), pick(args.rounds, 4, 2), pick(args.warmup, 2, 1), pick(args.reps, 10, 2)
    profiles_dir = pick(args.profiles, ROOT / "profiles", args.out / "profiles")
    for base in models:
        if base not in PRESETS:
            parser.error(f"--models: unknown preset {base!r}")
    known = plan_choices(bench_model(models[0], seq_len)) if models else {}
    for label in {x for v in labels.values() for x in v} - set(known):
        parser.error(f"--recompute: unknown label {label!r} (known: {', '.join(known)})")

    import dataclasses

    import torch

    from runtime.measure.host_link import measure_host_link

    if not cpu and (not torch.cuda.is_available() or torch.cuda.device_count() == 0):
        print("skipped: no CUDA device")
        return 0

    import yaml

    from baton.cluster import load_cluster
    from runtime.launch.devices import catalog_gpu, cpu_capacity

    started = time.perf_counter()
    if cpu:  # one thread: a smoke run at tiny sizes, steadier on a shared machine than every core
        torch.set_num_threads(1)
        gpu_type, name, capacity = CPU_GPU_TYPE, f"CPU ({platform.processor() or platform.machine()})", cpu_capacity(1)
    else:
        props = torch.cuda.get_device_properties(0)
        gpu_type, name, capacity = catalog_gpu(props.name, props.total_memory), props.name, (f"cuda:0 ({props.name})",
                                                                                            int(props.total_memory))
        if gpu_type is None:
            print(f"skipped: {props.name} is not in the GPU catalog (baton show gpus); add it to compare with the cost model")
            return 0
    # The offloading plans' copies priced at this machine's own pinned-copy rate, not its PCIe generation's: the
    # H200 host of 2026-11-27 copied at 52-55 GB/s each way where the catalog says 48 (eq. 2o).
    link = None if cpu else measure_host_link(torch.device("cuda", 0))
    work = Path(tempfile.mkdtemp(prefix="baton-bench-gpu-"))
    cluster_path = work / "cluster.yaml"
    cluster_path.write_text(yaml.safe_dump(cluster_mapping(gpu_type, capacity[1], link.gb_per_s if link else None),
                                           sort_keys=False))
    cluster = load_cluster(cluster_path)
    env = {"device": name, "gpu_type": gpu_type, "memory_gib": capacity[1] / GIB, "torch": torch.__version__,
           "cuda": torch.version.cuda, "python": platform.python_version(), "command": shlex.join([sys.executable, *sys.argv]),
           "global_batch": global_batch, "micro_batches": list(micro_batches),
           "recompute": {base: list(with_bases(v)) for base, v in labels.items()},
           "steps": steps, "rounds": rounds, "warmup": warmup, "reps": reps, "models": [], "plans_asked": 0,
           "host_link": dataclasses.asdict(link) if link else None,
           "host_link_gb_per_s": cluster.devices[0].host_link_gb_per_s}
    rows: list[dict] = []
    dev = torch.device("cpu" if cpu else "cuda:0")
    try:
        with one_rank_group(dev):  # baton train's one rank: one process group (NCCL on CUDA) for every plan
            run_models(models, seq_len, global_batch, micro_batches, labels, dev, gpu_type, cluster, cluster_path,
                       capacity, profiles_dir, args, env, rows, steps=steps, rounds=rounds, warmup=warmup, reps=reps,
                       started=started)
    finally:  # the cluster file is only the preflight's input; every run left one behind in the temp folder
        shutil.rmtree(work, ignore_errors=True)
    print(markdown(rows, env))
    print(f"bench_gpu: {time.perf_counter() - started:.0f} s")
    return 0


def run_models(models, seq_len, global_batch, micro_batches, labels, dev, gpu_type, cluster, cluster_path, capacity,
               profiles_dir, args, env, rows, *, steps, rounds, warmup, reps, started) -> None:
    """Profile, plan and compare every model of ``models`` (see the module docstring), writing after every plan."""
    import torch

    cpu = dev.type == "cpu"

    def out_of_time(what: str) -> bool:
        late = args.deadline_s and time.perf_counter() - started > args.deadline_s
        if late:
            env.setdefault("not_run", []).append(what)
        return bool(late)

    for base in models:
        spec = bench_model(base, seq_len)
        if out_of_time(base):
            continue
        t0 = time.perf_counter()
        try:
            profiles, profiles_b2b, table = profile_both_ways(
                spec, dev, gpu_type, micro_batches, parse_list(args.shares, float), reps, profiles_dir, args.out,
                suffix="" if base == models[0] else f"_{base}", warmup=1 if cpu else 3)
        except Exception as err:  # noqa: BLE001 (no table, no predictions: the next model may still run)
            traceback.print_exc()
            env.setdefault("failed", {})[f"{base} profile"] = f"{type(err).__name__}: {err}".splitlines()[0]
            gc.collect()
            if not cpu:
                torch.cuda.empty_cache()
            write_results(args.out, rows, env)
            continue
        env["models"].append({"model": spec.name, "attention": spec.attention,
                              "table": str(table.relative_to(ROOT)) if table.is_relative_to(ROOT) else str(table),
                              "profile_s": time.perf_counter() - t0})
        plans = fitting(candidate_plans(spec, global_batch, micro_batches, labels[base]), cluster, profiles)
        env["plans_asked"] += len(plans)
        write_results(args.out, rows, env)
        t0 = time.perf_counter()
        built = build_reference(spec, device=dev)
        env["models"][-1]["reference_build_s"] = time.perf_counter() - t0
        for plan_name, plan in plans:
            name_of_row = f"{base} {plan_name}"
            if out_of_time(name_of_row):
                continue
            try:
                row = compare(spec, plan, plan_name, dev, cluster, cluster_path, capacity, profiles, profiles_b2b, profiles_dir,
                              built=built, steps=steps, rounds=rounds, warmup=warmup, label=_label(plan_name))
            except Exception as err:  # noqa: BLE001 (out of memory, a refused plan: a finding, not the end of the table)
                traceback.print_exc()
                print(f"{name_of_row}: failed: {type(err).__name__}: {err}", flush=True)
                env.setdefault("failed", {})[name_of_row] = f"{type(err).__name__}: {err}".splitlines()[0]
                gc.collect()
                if not cpu:
                    torch.cuda.empty_cache()
            else:
                row["plan"], row["model"] = name_of_row, base
                rows.append(row)
                attach_exposed(rows)
                print(f"{name_of_row}: {row['iteration_ms']:.1f} ms (predicted {row['iteration_ms_predicted']:.1f}), "
                      f"{row['tokens_per_s']:,.0f} tokens/s, MFU {row['mfu'] or 0:.1%}; reference "
                      f"{row['reference']['tokens_per_s']:,.0f} tokens/s, Baton/reference {row['ratio']:.3f}", flush=True)
                if row.get("exposed_transfer"):
                    e = row["exposed_transfer"]
                    print(f"{name_of_row}: exposed transfer {e['measured_ms']:+.1f} ms (predicted {e['predicted_ms']:+.1f}), "
                          f"host {e['host_bytes_measured']} bytes (predicted {e['host_bytes_predicted']:.0f})", flush=True)
            env["elapsed_s"] = time.perf_counter() - started
            # After every plan, so a run cut short (a lent machine's time running out) still leaves its rows.
            write_results(args.out, rows, env)
        del built
        gc.collect()
        if not cpu:
            torch.cuda.empty_cache()


def _label(plan_name: str) -> str:
    return plan_name.rsplit("recompute ", 1)[1]


def profile_both_ways(spec: ModelSpec, dev, gpu_type: str, micro_batches, shares, reps: int, profiles_dir: Path, out: Path,
                      suffix: str = "", warmup: int = 3):
    """The measured table of ``spec`` into ``profiles_dir/measured`` (its command beside it), and the table timed back
    to back into ``out``; returns (profiles, back-to-back profiles or None, the table's path)."""
    import torch

    from baton.atomic import write_atomically
    from baton.errors import BatonError
    from baton.profile import Profile, ProfileSet, table_filename, write_table
    from runtime.measure.op_profiler import profile_table

    table = profiles_dir / "measured" / table_filename(gpu_type, spec.profile_name, spec.seq_len)
    device = "cuda" if dev.type == "cuda" else "cpu"
    df = profile_table(spec, device=device, micro_batches=micro_batches, shares=shares, warmup=warmup, reps=reps, gpu_name=gpu_type)
    write_table(df, table)
    command = {"command": shlex.join([sys.executable, *sys.argv]), "function": "runtime.measure.op_profiler.profile_table",
               "micro_batches": list(micro_batches), "shares": list(shares), "reps": reps, "warmup": warmup,
               "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "torch": torch.__version__,
               "cuda": torch.version.cuda, "model": spec.to_dict()}
    write_atomically(table.with_suffix(".command.json"), json.dumps(command, indent=2) + "\n")
    profiles_b2b = None
    try:
        b2b_table = profile_table(spec, device=device, micro_batches=micro_batches, shares=shares, warmup=warmup, reps=reps,
                                  gpu_name=gpu_type, back_to_back=True)
    except (BatonError, RuntimeError) as err:  # out of memory, say: the runs and the default table still count
        print(f"back-to-back table failed, plans priced from the default table only: {err}", flush=True)
    else:
        b2b_path = out / f"gpu_table_back_to_back{suffix}.csv"
        write_table(b2b_table, b2b_path)
        profiles_b2b = ProfileSet(spec, tables={gpu_type: Profile(b2b_table, source=str(b2b_path))})
    return ProfileSet(spec, directory=profiles_dir), profiles_b2b, table


def compare(spec: ModelSpec, plan: Plan, plan_name: str, dev, cluster, cluster_path: Path, capacity, profiles, profiles_b2b,
            profiles_dir: Path, *, built, steps: int, rounds: int, warmup: int, label: str) -> dict:
    """One plan: ``baton train``'s pre-flight check, then Baton against the reference loop (``run_reference``), then the
    row of the cost model's report of Baton's steps with the reference's speed and the ratio beside it."""
    import torch

    from runtime.launch.devices import preflight
    from runtime.measure.report import build_report

    preflight(plan, [capacity], cluster_path=str(cluster_path), profiles_dir=str(profiles_dir))
    share = plan.pipelines[0].stages[0].devices[0]
    ops, offload = list(share.recompute), list(share.offload)
    result, stats = run_reference(spec, device=str(dev), micro_batch_size=plan.micro_batch_size,
                                  global_batch=plan.global_batch, steps=steps, rounds=rounds, warmup=warmup,
                                  recompute={label: ops}, offload={label: offload}, built=built,
                                  threads=torch.get_num_threads())
    (pair,) = result["pairs"]
    per_rank = {0: stats[label]}
    row = row_of(plan_name, build_report(plan, cluster, profiles, per_rank),
                 build_report(plan, cluster, profiles_b2b, per_rank) if profiles_b2b is not None else None)
    # What pairs an offloading row with its base (attach_exposed).
    row.update(label=label, micro_batch_size=plan.micro_batch_size, num_microbatches=plan.num_microbatches, offload=offload)
    if offload:  # over the report's steps (the first dropped): the bytes the backward found not yet prefetched, and
        # the bytes moved each way (out == in: every offloaded byte came back)
        measured = stats[label][1:] if len(stats[label]) > 1 else stats[label]
        row["offload_late_bytes"] = max(s.offload_late_bytes for s in measured)
        row["offload_copied_bytes"] = {"out": max(s.offload_out_bytes for s in measured),
                                       "in": max(s.offload_in_bytes for s in measured)}
    ref = pair["reference"]
    row["reference"] = {"median_ms": ref["median_ms"], "tokens_per_s": ref["tokens_per_s"],
                        "peak_allocated_gib": ref["peak_allocated_bytes"] / GIB if "peak_allocated_bytes" in ref else None,
                        "adamw": result["settings"]["reference_adamw"], "precision": result["settings"]["precision"]}
    row["baton_median_ms"] = pair["baton"]["median_ms"]
    row["ratio"], row["ratio_paired"] = pair["ratio"], pair["ratio_paired"]
    row["build_s"] = result["settings"]["build_s"]
    row["losses"] = {"baton": pair["baton"]["losses"], "reference": pair["reference"]["losses"]}
    return row


def write_results(out: Path, rows: list[dict], env: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu.json").write_text(json.dumps({"environment": env, "plans": rows}, indent=2) + "\n")
    (out / "gpu.md").write_text(markdown(rows, env))


if __name__ == "__main__":
    sys.exit(main())
