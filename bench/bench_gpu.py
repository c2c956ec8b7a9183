"""The runtime on this machine's GPU against the cost model: profile, plan, train, compare (issue 9).

On a CUDA machine it
1. profiles GPU 0 with the runtime's own layer (``runtime.measure.op_profiler.profile_table``): the model in bf16
   with fused attention, at several micro-batch sizes and tensor-parallel shares, and writes the table to
   ``profiles/measured/<gpu>__<model>__s<seq>.csv`` with ``<same>.command.json`` beside it (the command,
   torch and CUDA versions, the device); then profiles it again with each layer, embedding and head timed
   back to back (``back_to_back=True``: the host's launches overlap the kernels, as in a step) into
   ``bench/results/gpu_table_back_to_back.csv``;
2. describes the GPU as a one-device cluster (its catalog type, its total memory as capacity);
3. builds one-GPU plans (micro-batch sizes x recomputation none / attention / everything), keeps those the
   evaluator says fit, trains each for ``--steps`` steps (``baton train``'s code path: pre-flight check,
   NCCL, one rank) and compares with the evaluator: iteration time, peak allocated memory against the
   predicted peak, tokens/s and MFU (catalog bf16 peak), the step's passes and phases measured against
   predicted, and the time predicted from the back-to-back table beside the default one;
4. writes ``bench/results/gpu.json`` and ``gpu.md``.

Several ranks on one GPU would need a backend that allows it; NCCL refuses two ranks on one device, so
multi-rank plans wait for a machine with several GPUs.

Without a CUDA device it prints ``skipped: no CUDA device`` and exits 0 (CI has none).

Run: ``python bench/bench_gpu.py [--steps 6] [--model gpt3-350m] [--seq-len 1024]``.
"""
from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from baton.model_spec import PRESETS, ModelSpec  # noqa: E402
from baton.plan import Plan, simple_plan  # noqa: E402

GIB = 1024**3
MICRO_BATCHES = (1, 2, 4, 8)
SHARES = (0.25, 0.5, 1.0)
DEVICE_ID = "gpu:0"
CLUSTER_NAME = "local-gpu"


def bench_model(base: str = "gpt3-350m", seq_len: int = 1024) -> ModelSpec:
    """The benchmark's model: a preset in bf16 with fused attention and no dropout, as large models are
    pretrained (the name says so, since its tables are kept under it)."""
    return PRESETS[base].with_overrides(name=f"{base}-bf16-s{seq_len}", dtype="bf16", attention="fused", dropout=0.0,
                                        seq_len=seq_len)


def cluster_mapping(gpu_type: str, memory_bytes: int) -> dict:
    """A cluster spec (as parsed YAML) of this one GPU: catalog type, its real memory, no links to price."""
    return {"name": CLUSTER_NAME, "description": "the benchmark's local GPU",
            "nodes": [{"name": "gpu", "gpus": [{"type": gpu_type, "count": 1, "memory_gib": memory_bytes / GIB}],
                       "intra_node_link": {"bandwidth_gb_per_s": 100.0, "latency_us": 10.0}}]}


def recompute_sets(spec: ModelSpec) -> dict[str, list[str]]:
    """Recomputation choices the plans try: none, the attention core, every operator of the layer."""
    from baton.operators import operator_names

    names = operator_names(spec)
    attention = [n for n in names if n in ("attn_core", "attn_scores", "softmax", "attn_dropout", "attn_v")]
    return {"none": [], "attention": attention, "all": names}


def candidate_plans(spec: ModelSpec, global_batch: int = 8) -> list[tuple[str, Plan]]:
    """One-GPU plans: every micro-batch size dividing ``global_batch``, times every recompute set."""
    out = []
    for mb in MICRO_BATCHES:
        if global_batch % mb:
            continue
        for label, ops in recompute_sets(spec).items():
            plan = simple_plan(spec, cluster=CLUSTER_NAME, stages=[[(DEVICE_ID, 1)]], layers=[spec.num_layers],
                               units_per_layer=1, micro_batch_size=mb, num_microbatches=global_batch // mb,
                               recompute={DEVICE_ID: ops})
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
            "back_to_back": None if back_to_back is None else {
                "iteration_ms_predicted": back_to_back["iteration_time_ms"]["predicted"],
                "iteration_rel_error": back_to_back["iteration_time_ms"]["rel_error"],
                "passes_ms": {k: back_to_back["devices"][0]["predicted"][k] for k in ("fwd_ms", "bwd_ms", "recompute_ms")},
                "phases_ms": {k: v["predicted"] for k, v in back_to_back["phases"].items()}}}


def markdown(rows: list[dict], env: dict) -> str:
    def pct(x):
        return "-" if x is None else f"{x:+.1%}"

    def passes(r):
        p = r.get("passes_ms")
        if not p or p["fwd_ms"]["measured"] is None:
            return "-"
        return " / ".join(f"{p[k]['measured']:.1f} ({p[k]['predicted']:.1f})" for k in ("fwd_ms", "bwd_ms", "recompute_ms"))

    def b2b(r, key, fmt):
        x = (r.get("back_to_back") or {}).get(key)
        return "-" if x is None else fmt(x)

    lines = ["| plan | iteration ms | predicted | error | predicted, table back to back | error | "
             "per micro-batch: fwd / bwd / recompute ms (predicted) | peak allocated GiB | "
             "predicted peak | error | tokens/s | MFU | predicted MFU |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        mfu = "-" if r["mfu"] is None else f"{r['mfu']:.1%}"
        lines.append(f"| {r['plan']} | {r['iteration_ms']:.1f} | {r['iteration_ms_predicted']:.1f} | {pct(r['iteration_rel_error'])} | "
                     f"{b2b(r, 'iteration_ms_predicted', lambda x: f'{x:.1f}')} | {b2b(r, 'iteration_rel_error', pct)} | "
                     f"{passes(r)} | {r['peak_allocated_gib']:.2f} | {r['peak_predicted_gib']:.2f} | {pct(r['peak_rel_error'])} | "
                     f"{r['tokens_per_s']:,.0f} | {mfu} | {r['mfu_predicted']:.1%} |")
    for label, errs in (("", [r["iteration_rel_error"] for r in rows]),
                        (" with the table timed back to back", [(r.get("back_to_back") or {}).get("iteration_rel_error") for r in rows])):
        errs = [abs(e) for e in errs if e is not None]
        if errs:
            lines += ["", f"Iteration time{label}: mean absolute error {statistics.mean(errs):.1%}, worst {max(errs):.1%}."]
    lines += ["", f"Model `{env['model']}` (bf16, {env['attention']} attention) on {env['device']} "
                  f"(catalog `{env['gpu_type']}`), torch {env['torch']}, CUDA {env['cuda']}; table: `{env['table']}`; "
                  f"{env['steps']} steps per plan, the first dropped."]
    lines += [f"Failed: {name}: {why}" for name, why in env.get("failed", {}).items()]
    done = len(rows) + len(env.get("failed", {}))
    if env.get("plans_asked", done) > done:  # written after every plan: a run cut short says so
        lines += [f"Cut short: {done} of {env['plans_asked']} plans ran."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--model", default="gpt3-350m", choices=sorted(PRESETS))
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--profiles", type=Path, default=ROOT / "profiles",
                        help="tables folder: the measured table is written to its measured/ and the plans priced from it")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        print("skipped: no CUDA device")
        return 0

    import yaml

    from baton.atomic import write_atomically
    from baton.cluster import load_cluster
    from baton.errors import BatonError
    from baton.profile import Profile, ProfileSet, table_filename, write_table
    from runtime.launch.devices import catalog_gpu
    from runtime.launch.launcher import TrainConfig, train
    from runtime.measure.op_profiler import profile_table
    from runtime.measure.report import build_report

    props = torch.cuda.get_device_properties(0)
    gpu_type = catalog_gpu(props.name, props.total_memory)
    if gpu_type is None:
        print(f"skipped: {props.name} is not in the GPU catalog (baton show gpus); add it to compare with the cost model")
        return 0
    spec = bench_model(args.model, args.seq_len)

    # Into the checkout's shipped tables (profiles/measured/), which the plans below are priced with.
    table = args.profiles / "measured" / table_filename(gpu_type, spec.profile_name, spec.seq_len)
    df = profile_table(spec, device="cuda", micro_batches=MICRO_BATCHES, shares=SHARES, warmup=3, reps=args.reps, gpu_name=gpu_type)
    write_table(df, table)
    command = {"command": shlex.join([sys.executable, *sys.argv]), "function": "runtime.measure.op_profiler.profile_table",
               "micro_batches": list(MICRO_BATCHES), "shares": list(SHARES), "reps": args.reps, "warmup": 3,
               "device": props.name, "torch": torch.__version__, "cuda": torch.version.cuda, "model": spec.to_dict()}
    write_atomically(table.with_suffix(".command.json"), json.dumps(command, indent=2) + "\n")
    # The same table with each layer, embedding and head timed back to back (launches overlapping kernels, as
    # in a step): every plan below is priced from both, to see which one the runs follow.
    profiles_b2b = None
    try:
        b2b_table = profile_table(spec, device="cuda", micro_batches=MICRO_BATCHES, shares=SHARES, warmup=3, reps=args.reps,
                                  gpu_name=gpu_type, back_to_back=True)
    except (BatonError, RuntimeError) as err:  # out of memory, say: the runs and the default table still count
        print(f"back-to-back table failed, plans priced from the default table only: {err}", flush=True)
    else:
        b2b_path = args.out / "gpu_table_back_to_back.csv"
        write_table(b2b_table, b2b_path)
        profiles_b2b = ProfileSet(spec, tables={gpu_type: Profile(b2b_table, source=str(b2b_path))})
    work = Path(tempfile.mkdtemp(prefix="baton-bench-gpu-"))
    cluster_path = work / "cluster.yaml"
    cluster_path.write_text(yaml.safe_dump(cluster_mapping(gpu_type, props.total_memory), sort_keys=False))
    cluster = load_cluster(cluster_path)
    profiles = ProfileSet(spec, directory=args.profiles)
    env = {"device": props.name, "gpu_type": gpu_type, "memory_gib": props.total_memory / GIB, "torch": torch.__version__,
           "cuda": torch.version.cuda, "model": spec.name, "attention": spec.attention, "steps": args.steps,
           "table": str(table.relative_to(ROOT)) if table.is_relative_to(ROOT) else str(table), "python": platform.python_version()}
    rows = []
    plans = fitting(candidate_plans(spec, args.global_batch), cluster, profiles)
    env["plans_asked"] = len(plans)
    for name, plan in plans:
        per_rank: dict = {}
        cfg = TrainConfig(plan=plan, steps=args.steps, device="cuda", gpus=(0,), cluster_path=str(cluster_path),
                          collect_all_ranks=True, timeout_s=600)
        try:
            train(cfg, per_rank=per_rank)
        except BatonError as err:  # one plan's failure (out of memory, say) is a finding, not the end of the table
            print(f"{name}: failed: {err}", flush=True)
            env.setdefault("failed", {})[name] = str(err)
            write_results(args.out, rows, env)
            continue
        rows.append(row_of(name, build_report(plan, cluster, profiles, per_rank),
                           build_report(plan, cluster, profiles_b2b, per_rank) if profiles_b2b is not None else None))
        print(f"{name}: {rows[-1]['iteration_ms']:.1f} ms (predicted {rows[-1]['iteration_ms_predicted']:.1f}), "
              f"{rows[-1]['tokens_per_s']:,.0f} tokens/s, MFU {rows[-1]['mfu']:.1%}", flush=True)
        # After every plan, so a run cut short (a lent machine's time running out) still leaves its rows.
        write_results(args.out, rows, env)
    print(markdown(rows, env))
    return 0


def write_results(out: Path, rows: list[dict], env: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu.json").write_text(json.dumps({"environment": env, "plans": rows}, indent=2) + "\n")
    (out / "gpu.md").write_text(markdown(rows, env))


if __name__ == "__main__":
    sys.exit(main())
