"""How far derived profile tables are from measurements: per GPU, derived / measured layer time and the
error of the GPU's speed relative to a reference GPU measured the same way. Writes
bench/results/profiles.{json,md}.

    python bench/bench_profiles.py            # reference figures, shipped measured tables, this CPU
    python bench/bench_profiles.py --no-cpu   # skip measuring this machine's CPU

Sources of measurements:
- profiles/reference/layers.csv: published or quoted per-GPU figures, with source and settings, each in the
  fitting set (`set` = fit: the figures the catalog's fitted fractions were chosen on) or the held-out set
  (held_out: other sources, never used to choose a fraction; profiles/reference/README.md has the rule), each
  derived as its code ran: eager or fused attention, and for eager the passes over the scores its code made
  (`score_passes`: baton.operators.SCORE_PASSES; `--score-passes` derives every GPT-layer row with one instead); the layer
  it ran (`layer`: Transformer-XL's over its cached memory, bench/reference_layers.py); how it was timed (`timing`:
  `op_alone`, each operator on its own from Python, at least the host's dispatch); and, where the row states its
  model's layers, parameters and micro-batches per optimizer step, a throughput figure as whole steps;
- profiles/measured/*.csv (shipped) and the user's measured/ tables: tables measured with `baton profile --device`
  or bench/bench_gpu.py (a lent GPU's table goes here; the model is read from the `.command.json` beside it);
- this CPU: the runtime's layer timed here (absolute ratio only: the `cpu` catalog entry is a stand-in).

Relative-speed error of a GPU = (derived time / derived time of the group's reference GPU) /
(measured time / measured time of the reference GPU), folded to >= 1 (a factor either way). Geometric mean
and worst are reported for each set apart. Targets (issue 14 for the fitting set, issue 27 for the held-out
set): geometric mean <= 1.15, worst <= 1.4.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from baton.catalog import gpu_type  # noqa: E402
from baton.costmodel import optimizer_step_ms  # noqa: E402
from baton.model_spec import PRESETS, from_mapping  # noqa: E402
from baton.operators import RUNTIME_SCORE_PASSES, SCORE_PASSES, layer_operators  # noqa: E402
from baton.operators import EMBEDDING, HEAD  # noqa: E402
from baton.profile import OPTIMIZER, derive_table, profiles_dir, read_table  # noqa: E402
from reference_layers import TRANSFORMER_XL, transformer_xl_layer_ms  # noqa: E402

TARGET_GEOMEAN, TARGET_WORST = 1.15, 1.4


SETS = ("fit", "held_out")
"""The reference file's sets: figures the fitted fractions were chosen on, and figures kept out of that."""

METRICS = ("layer_ms", "layer_fwd_ms", "samples_per_s", "tokens_per_s")
"""One layer forward + backward; its forward alone; whole-model training throughput in sequences or tokens."""


def parse_overrides(text) -> dict:
    """The reference file's `overrides` cell ("hidden_dim=512;num_heads=8") as ModelSpec fields."""
    if not isinstance(text, str) or not text.strip():
        return {}
    out = {}
    for item in text.split(";"):
        key, _, value = item.partition("=")
        out[key.strip()] = int(value) if value.strip().isdigit() else value.strip()
    return out


TIMINGS = ("step", "op_alone")
"""How a figure was timed: `step`, operators run one after another as a training step runs them (the host runs
ahead of the GPU, so launches hide behind kernels); `op_alone`, each operator timed on its own from Python (Aceso's
op profiler), so an operator takes at least the host's time to dispatch it, on any GPU."""

LAYERS = ("gpt", TRANSFORMER_XL)
"""The layer a figure ran: a GPT/BERT layer (`baton.operators`), or Transformer-XL's (`bench/reference_layers.py`)."""


def derived_layer_ms(base: str, gpu: str, *, seq_len: int, micro_batch: int, dtype: str, tf32: bool,
                     attention: str, overrides: dict | None = None, forward_only: bool = False,
                     score_passes: str = RUNTIME_SCORE_PASSES, layer: str = "gpt", memory_len: int = 0,
                     attention_dropout: bool = False, host_floor: "HostFloor | None" = None) -> float:
    """Forward + backward (or the forward alone) of one layer (every operator, share 1) from the derivation,
    with the attention implementation, the passes over its scores and the layer shape the measurement ran.
    ``layer`` = transformer_xl: Transformer-XL's layer over ``memory_len`` cached tokens, its attention dropout on
    or off (its kernels are its own: ``score_passes`` and ``host_floor`` do not apply). ``host_floor``: every
    operator's forward and backward at least the host's dispatch of it, for figures timed one operator at a time."""
    spec = PRESETS[base].with_overrides(seq_len=seq_len, dtype=dtype, attention=attention, **(overrides or {}))
    if layer == TRANSFORMER_XL:
        return transformer_xl_layer_ms(gpu_type(gpu), d=spec.hidden_dim, n=spec.num_heads, f=spec.ffn_dim, q=seq_len,
                                       memory=memory_len, b=micro_batch, dtype=dtype, e=spec.dtype_bytes, tf32=tf32,
                                       attention_dropout=attention_dropout, forward_only=forward_only)
    df = derive_table(spec, gpu, micro_batches=(micro_batch,), shares=(1.0,), tf32=tf32, score_pass_impl=score_passes)
    if host_floor is not None:
        df = host_floor.clip(df)
    return layer_ms_of(df, [o.name for o in layer_operators(spec)], micro_batch, forward_only=forward_only)


def layer_ms_of(df: pd.DataFrame, ops: list[str], micro_batch: int, *, forward_only: bool = False) -> float:
    rows = df[df.op.isin(ops) & (df.micro_batch == micro_batch) & (df.tp_share == 1.0)]
    return float(rows.fwd_ms.sum() + (0.0 if forward_only else rows.bwd_ms.sum()))


HOST_DISPATCH_TABLES = ("h200__gpt3-350m-bf16-s1024__s1024.csv", "h200__gpt3-1.3b-bf16-s1024__s1024.csv")
"""The shipped measured tables whose host columns give the host's dispatch of each operator (bench/bench_gpu.py on
an H200 host, torch 2.11, 2026-11-27), named so that a table measured later does not move a published figure's
derivation."""


@dataclass(frozen=True, kw_only=True, slots=True)
class HostFloor:
    """The host's time to launch one pass of each layer operator, from Python."""

    fwd_ms: dict
    """Operator -> its forward's host time, ms."""
    bwd_ms: dict
    """Operator -> its backward's host time, ms."""
    any_fwd_ms: float
    """For a layer operator none of the tables holds: the median of ``fwd_ms``."""
    any_bwd_ms: float
    """Likewise for the backward."""

    def clip(self, df: pd.DataFrame) -> pd.DataFrame:
        """A derived table with every operator's forward and backward at least the host's dispatch of it."""
        return df.assign(fwd_ms=df.fwd_ms.clip(lower=df.op.map(self.fwd_ms).fillna(self.any_fwd_ms)),
                         bwd_ms=df.bwd_ms.clip(lower=df.op.map(self.bwd_ms).fillna(self.any_bwd_ms)))


def host_dispatch_ms(directory: Path = ROOT / "profiles" / "measured", tables=HOST_DISPATCH_TABLES) -> HostFloor:
    """Per layer operator, the median over ``tables`` of its forward (and apart, its backward) host time at the
    table's smallest micro-batch, where the kernels hide least of the host's work. It is the project's only
    measurement of a Python framework's per-operator dispatch; a published figure timed one operator at a time paid
    its own host's, which no source states, so this is a stand-in, the same on every GPU."""
    rows = []
    for name in tables:
        df = read_table(directory / name)
        rows.append(df[(df.micro_batch == df.micro_batch.min()) & (df.tp_share == 1.0) & (df.fwd_host_ms > 0)
                       & ~df.op.isin((EMBEDDING, HEAD, OPTIMIZER))])
    per_op = pd.concat(rows).groupby("op")[["fwd_host_ms", "bwd_host_ms"]].median()
    return HostFloor(fwd_ms=per_op.fwd_host_ms.to_dict(), bwd_ms=per_op.bwd_host_ms.to_dict(),
                     any_fwd_ms=float(per_op.fwd_host_ms.median()), any_bwd_ms=float(per_op.bwd_host_ms.median()))


CADENCE = ("num_layers", "params_m", "optimizer_every")
"""What a throughput figure's source must state for it to be derived as whole training steps."""


def optimizer_cadences(ref: pd.DataFrame, path: Path) -> set[str]:
    """Groups whose whole-model figures are derived as whole training steps: every row of the group states its
    model's layer count, its parameters and how many micro-batches it runs per optimizer step. Others keep the old
    reading (the layers' share of the step assumed equal on every GPU). A group that states them on some rows only
    is refused: its GPUs would be compared on different terms."""
    if not all(c in ref.columns for c in CADENCE):
        return set()
    stated = ref[list(CADENCE)].notna().all(axis=1)
    partial = sorted(g for g, ok in stated.groupby(ref.group) if ok.any() and not ok.all())
    if partial:
        raise ValueError(f"{path}: {', '.join(CADENCE)} given on some rows of {', '.join(partial)} only")
    bad = ref[stated & ((ref.num_layers < 1) | (ref.params_m <= 0) | (ref.optimizer_every < 1))]
    if len(bad):
        raise ValueError(f"{path}: num_layers and optimizer_every must be >= 1 and params_m > 0 ({bad.group.iloc[0]})")
    return {g for g, ok in stated.groupby(ref.group) if ok.all()}


def fold(x: float) -> float:
    return max(x, 1.0 / x)


def reference_rows(path: Path, *, score_passes: str | None = None) -> list[dict]:
    """Each published figure next to its derivation, as time per sample of one layer. Eager attention is derived
    with the passes over its scores that the row's code made (its ``score_passes`` cell, Baton's runtime where
    the file has none); ``score_passes`` derives every row with the one given instead."""
    ref = pd.read_csv(path)
    if "score_passes" not in ref.columns:
        ref["score_passes"] = RUNTIME_SCORE_PASSES
    if "set" not in ref.columns:  # a reference file from before the split: all of it was fitted on
        ref["set"] = "fit"
    for column, default in (("overrides", ""), ("layer", "gpt"), ("timing", "step"), ("memory_len", 0),
                            ("attention_dropout", 0.0), ("added", "")):
        if column not in ref.columns:
            ref[column] = default
        ref[column] = ref[column].fillna(default)
    whole_step = optimizer_cadences(ref, path)
    host_floor = host_dispatch_ms() if (ref.timing == "op_alone").any() else None
    out = []
    for r in ref.itertuples(index=False):
        if r.set not in SETS:
            raise ValueError(f"{path}: set must be one of {SETS}, got {r.set!r} ({r.group} {r.gpu})")
        if r.metric not in METRICS:
            raise ValueError(f"{path}: unknown metric {r.metric!r}")
        tf32 = str(r.tf32).strip().lower() == "true"
        mb = int(r.micro_batch)
        # The published figures predate fused attention (PyTorch 1.13 for Lambda's): each row says what it ran.
        passes = score_passes or r.score_passes
        if passes not in SCORE_PASSES:
            raise ValueError(f"{path}: score_passes must be one of {tuple(SCORE_PASSES)}, got {passes!r} ({r.group} {r.gpu})")
        if r.layer not in LAYERS or r.timing not in TIMINGS:
            raise ValueError(f"{path}: layer must be one of {LAYERS} and timing one of {TIMINGS} ({r.group} {r.gpu})")
        if r.layer == TRANSFORMER_XL and (int(r.memory_len) < 1 or r.timing != "step" or r.attention != "eager"):
            raise ValueError(f"{path}: a transformer_xl row needs memory_len >= 1, timing step and eager attention "
                             f"({r.group} {r.gpu})")
        gpu = gpu_type(r.gpu)
        derived = derived_layer_ms(r.base_model, gpu.name, seq_len=int(r.seq_len), micro_batch=mb, dtype=r.dtype,
                                   tf32=tf32, attention=r.attention, overrides=parse_overrides(r.overrides),
                                   forward_only=r.metric == "layer_fwd_ms", score_passes=passes, layer=r.layer,
                                   memory_len=int(r.memory_len), attention_dropout=float(r.attention_dropout) > 0,
                                   host_floor=host_floor if r.timing == "op_alone" else None)
        derived_sample = derived / mb
        if r.group in whole_step and r.metric in ("samples_per_s", "tokens_per_s"):
            # A whole training step: the layers, and the optimizer step (eq. 10) once per optimizer_every micro-batches;
            # the embedding and the head are still assumed to take the layers' share of it on every GPU.
            spec = PRESETS[r.base_model].with_overrides(dtype=r.dtype)
            step = optimizer_step_ms(float(r.params_m) * 1e6 * spec.dtype_bytes, spec, gpu.memory_bandwidth_gb_per_s)
            derived_sample = (int(r.num_layers) * derived + step / float(r.optimizer_every)) / (int(r.num_layers) * mb)
        if r.metric in ("layer_ms", "layer_fwd_ms"):
            measured_per_sample = float(r.value) / mb
        elif r.metric == "samples_per_s":
            # whole-model throughput: only the ratio between GPUs is comparable, not the absolute time
            measured_per_sample = 1000.0 / float(r.value)
        else:  # tokens_per_s: one sample is one sequence of seq_len tokens
            measured_per_sample = 1000.0 * int(r.seq_len) / float(r.value)
        out.append({"group": r.group, "set": r.set, "gpu": gpu_type(r.gpu).name, "device_as_named": r.device_as_named,
                    "dtype": r.dtype, "tf32": tf32, "micro_batch": mb, "seq_len": int(r.seq_len), "metric": r.metric,
                    "score_passes": passes if r.attention == "eager" else None,
                    "reference_gpu": gpu_type(r.reference_gpu).name, "derived_ms": derived, "measured_value": float(r.value),
                    "derived_per_sample": derived_sample, "measured_per_sample": measured_per_sample, "layer": r.layer,
                    "timing": r.timing, "whole_step": r.group in whole_step, "added": str(r.added),
                    "absolute": r.metric in ("layer_ms", "layer_fwd_ms"), "source": r.source})
    return out


def measured_table_rows(*directories: Path) -> list[dict]:
    """Every measured table against the derivation of the same GPU, model and sequence length. A table name
    found in several directories counts once, from the first directory given."""
    out = []
    seen: set[str] = set()
    paths = [p for d in directories if d.is_dir() for p in sorted(d.glob("*.csv"))]
    for path in paths:
        if path.name in seen:
            continue
        seen.add(path.name)
        df = read_table(path)
        gpu, model, seq = str(df.gpu.iloc[0]), str(df.model.iloc[0]), int(df.seq_len.iloc[0])
        command = path.with_suffix(".command.json")  # bench/bench_gpu.py records the whole model beside its table
        if command.is_file():
            spec = from_mapping(json.loads(command.read_text())["model"], source=str(command)).with_overrides(seq_len=seq)
        elif model in PRESETS:
            spec = PRESETS[model].with_overrides(seq_len=seq)
        else:
            continue
        ops = [o.name for o in layer_operators(spec)]
        mb = int(df[df.op.isin(ops)].micro_batch.min())
        measured = layer_ms_of(df, ops, mb)
        derived = layer_ms_of(derive_table(spec, gpu, micro_batches=(mb,), shares=(1.0,)), ops, mb)
        out.append({"group": f"measured/{model}-s{seq}", "set": "measured", "gpu": gpu, "device_as_named": path.name, "dtype": spec.dtype,
                    "tf32": spec.tf32, "micro_batch": mb, "seq_len": seq, "metric": "layer_ms", "reference_gpu": None,
                    "derived_ms": derived, "measured_value": measured, "derived_per_sample": derived / mb,
                    "measured_per_sample": measured / mb, "absolute": True, "source": str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)})
    # a group's reference is its first GPU that is not the CPU stand-in
    for g in {r["group"] for r in out}:
        rows = [r for r in out if r["group"] == g]
        ref = next((r["gpu"] for r in rows if r["gpu"] != "cpu"), None)
        for r in rows:
            r["reference_gpu"] = ref
    return out


def local_cpu_row() -> dict:
    """The runtime's own `small` layer timed on this CPU, one thread, against the `cpu` stand-in's derivation."""
    import torch

    from runtime.measure.op_profiler import profile_table

    torch.set_num_threads(1)
    spec = PRESETS["small"]
    df = profile_table(spec, micro_batches=(1,), shares=(1.0,), warmup=1, reps=5)
    ops = [o.name for o in layer_operators(spec)]
    measured = layer_ms_of(df, ops, 1)
    derived = layer_ms_of(derive_table(spec, "cpu", micro_batches=(1,), shares=(1.0,)), ops, 1)
    return {"group": "local-cpu/small-s128", "set": "measured", "gpu": "cpu", "device_as_named": platform.processor() or platform.machine(),
            "dtype": "fp32", "tf32": False, "micro_batch": 1, "seq_len": spec.seq_len, "metric": "layer_ms", "reference_gpu": None,
            "derived_ms": derived, "measured_value": measured, "derived_per_sample": derived, "measured_per_sample": measured,
            "absolute": True, "source": "measured now (runtime/measure/op_profiler.py, 1 thread, median of 5)"}


def score(rows: list[dict]) -> dict:
    """Relative-speed errors within each group against its reference GPU; geometric mean and worst of each
    set (fit, held_out, and measured tables where a group has two GPUs)."""
    for r in rows:
        r["derived_over_measured"] = r["derived_per_sample"] / r["measured_per_sample"] if r["absolute"] else None
        r["relative_error"] = None
        ref = next((x for x in rows if x["group"] == r["group"] and x["gpu"] == r["reference_gpu"]), None)
        if ref is None or ref is r:
            continue
        derived_rel = r["derived_per_sample"] / ref["derived_per_sample"]
        measured_rel = r["measured_per_sample"] / ref["measured_per_sample"]
        r["derived_relative"], r["measured_relative"] = derived_rel, measured_rel
        r["relative_error"] = derived_rel / measured_rel
    summary = {name: set_summary([r for r in rows if r.get("set") == name]) for name in (*SETS, "measured")}
    # the held-out figures by the day they joined the file: each batch is unseen until the day it is first scored
    summary["held_out_by_added"] = {day: set_summary([r for r in rows if r.get("set") == "held_out" and r.get("added") == day])
                                    for day in sorted({r.get("added", "") for r in rows if r.get("set") == "held_out"})}
    return summary


def set_summary(rows: list[dict]) -> dict:
    """Geometric mean and worst folded error of some scored rows, overall and per dtype."""
    scored = [r for r in rows if r["relative_error"] is not None]
    summary: dict = {"count": len(scored)}
    if not scored:
        return summary
    errs = [fold(r["relative_error"]) for r in scored]
    summary["geomean"] = geomean(errs)
    summary["worst"] = max(errs)
    worst = max(scored, key=lambda r: fold(r["relative_error"]))
    summary["worst_row"] = f"{worst['group']} {worst['gpu']}"
    summary["meets_targets"] = summary["geomean"] <= TARGET_GEOMEAN and summary["worst"] <= TARGET_WORST
    for dtype in ("fp32", "fp16", "bf16"):
        sub = [fold(r["relative_error"]) for r in scored if r["dtype"] == dtype]
        if sub:
            summary[f"{dtype}_geomean"] = geomean(sub)
            summary[f"{dtype}_worst"] = max(sub)
    return summary


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


UNITS = {"layer_ms": "ms", "layer_fwd_ms": "ms fwd", "samples_per_s": "samples/s", "tokens_per_s": "tokens/s"}
SET_TITLES = {"fit": "Fitting set", "held_out": "Held-out set", "measured": "Measured tables"}


def markdown(rows: list[dict], summary: dict) -> str:
    lines = []
    for name in (*SETS, "measured"):
        part = [r for r in rows if r.get("set") == name]
        if not part:
            continue
        lines += [f"## {SET_TITLES[name]}", "",
                  "| group | gpu (as measured) | dtype | mb | derived as | derived ms | measured | derived / measured | speed vs reference: derived | measured | error |",
                  "| --- | --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in part:
            unit = UNITS[r["metric"]]
            dtype = r["dtype"] + (" (TF32)" if r["tf32"] else "")
            d_over_m = f"{r['derived_over_measured']:.2f}" if r["derived_over_measured"] is not None else "-"
            head = (f"| {r['group']} | {r['gpu']} ({r['device_as_named']}) | {dtype} | {r['micro_batch']} | {derived_as(r)} | "
                    f"{r['derived_ms']:.2f} | "
                    f"{r['measured_value']:g} {unit} | {d_over_m} | ")
            if r["relative_error"] is None:
                rel = "reference" if r["gpu"] == r["reference_gpu"] else "-"
                lines.append(head + f"{rel} | | |")
            else:
                lines.append(head + f"{r['derived_relative']:.2f}x | {r['measured_relative']:.2f}x | {fold(r['relative_error']):.2f} |")
        lines += ["", summary_line(SET_TITLES[name], summary[name]), ""]
        if name == "held_out":
            for day, sub in summary["held_out_by_added"].items():
                lines += [summary_line(f"Held-out figures added {day or '(undated)'}", sub), ""]
    lines.append("Times are one layer, forward + backward ('ms fwd': the forward alone), per the row's micro-batch. 'speed vs "
                 "reference' is the time per sample relative to the group's reference GPU (lower is faster); error is derived / "
                 "measured of that, folded to >= 1. Throughput rows compare ratios only (derived / measured is '-'); where "
                 "'derived as' says '+ optimizer step', the ratio is of whole steps (every layer, and the optimizer step of "
                 "eq. 10 once per optimizer update). 'each op >= host dispatch': every operator's pass at least the host's time "
                 "to launch it (the shipped measured tables' host columns). The fitted fractions in baton/catalog.py were "
                 "chosen on the fitting set alone.")
    return "\n".join(lines) + "\n"


def derived_as(r: dict) -> str:
    """How a row was derived beyond its GPU's table: the layer it ran, how it was timed, whether as a whole step."""
    parts = ["Transformer-XL layer" if r.get("layer") == TRANSFORMER_XL else "layer"]
    if r.get("timing") == "op_alone":
        parts.append("each op >= host dispatch")
    if r.get("whole_step"):
        parts.append("+ optimizer step")
    return ", ".join(parts)


def summary_line(title: str, s: dict) -> str:
    if not s.get("count"):
        return f"{title}: no relative figures."
    verdict = "meets" if s["meets_targets"] else "misses"
    return (f"{title}: relative speed over {s['count']} GPU figures, geometric mean error {s['geomean']:.2f}x, worst "
            f"{s['worst']:.2f}x ({s['worst_row']}); {verdict} the targets {TARGET_GEOMEAN}x / {TARGET_WORST}x. "
            + "; ".join(f"{d}: {s[d + '_geomean']:.2f}x / {s[d + '_worst']:.2f}x" for d in ("fp32", "fp16", "bf16")
                        if d + "_geomean" in s) + ".")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reference", default=str(ROOT / "profiles" / "reference" / "layers.csv"))
    ap.add_argument("--no-cpu", action="store_true", help="do not time the layer on this CPU")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--name", default="profiles", help="file stem of the results")
    ap.add_argument("--score-passes", choices=tuple(SCORE_PASSES), default=None,
                    help="derive every GPT-layer reference row's eager attention with these passes over the scores instead of the "
                         "row's own (fused_softmax: the accounting before the passes were priced)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    try:
        rows = reference_rows(Path(args.reference), score_passes=args.score_passes)
    except (OSError, ValueError, KeyError) as exc:  # a reference file that cannot be read or derived as stated
        print(f"bench_profiles: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    rows += measured_table_rows(ROOT / "profiles" / "measured", profiles_dir() / "measured")  # shipped, then the user's
    if not args.no_cpu:
        rows.append(local_cpu_row())
    summary = score(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"summary": summary, "rows": rows, "targets": {"geomean": TARGET_GEOMEAN, "worst": TARGET_WORST},
              "wall_s": time.perf_counter() - t0, "host": platform.node()}
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=2, default=float))
    md = markdown(rows, summary)
    (out / f"{args.name}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
