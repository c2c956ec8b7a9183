"""Does the cost model predict what the runtime does? Predicted vs measured, plan by plan, on this CPU.

Set-up (explicit, because CPU processes share this machine's cores):
* one torch thread per process, and each process pinned to one core (rank r on core r mod cores;
  BATON_PIN_CPUS=1), both while profiling and while training, so an operator runs under the same
  conditions in the table and in the run; gloo's I/O threads are left free to run on any core;
* the operator profilers and the training ranks keep the host memory they free for reuse
  (``runtime.host_memory``): with glibc's defaults a rank faulted 1,000-20,000 fresh pages in per
  step, depending on its allocation history, and ran up to ~18% slower than the table;
* the operator table is measured on every core at once (``profile_table(concurrent=procs)``: training
  keeps every core busy, and a layer runs ~14% slower beside a busy core than beside an idle one),
  median of repetitions after warm-up, for the ``small`` preset (6 layers, width 256, 8 heads,
  sequence 128, fp32, dropout 0.1) at every micro-batch size and share the plans use; the link is
  measured over gloo between two processes, its all-reduces inside the tensor-parallel layer, and
  written into a copy of clusters/cpu2.yaml (and cpu4 when 4 processes are asked for);
* this machine's speed wanders by 10-35% over tens of seconds (other tenants), so the benchmark runs
  in rounds: each round measures the link and the table again, then trains every plan for ``--steps``
  steps (the first dropped). Predictions come from the median of the rounds' tables and links,
  measurements from the median of all kept steps, so both sample the same stretch of time.

Plans: pipelines with even and uneven layers, recomputation on one stage, tensor parallelism with
even and uneven (3:1) units, and the plan ``baton solve`` picks for this cluster under the measured
table. Reported per plan: iteration time and activation memory, predicted and measured, with their
relative errors; then the mean absolute and worst relative error over the plans.

Run: ``python bench/bench_fidelity.py [--rounds 4] [--steps 8] [--procs 2] [--variant fp32-eager|bf16-fused]``;
writes bench/results/fidelity.json and .md (``fidelity_bf16_fused.*`` for the bf16, fused-attention variant).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import yaml  # noqa: E402

from baton.cluster import load_cluster  # noqa: E402
from baton.profile import ProfileSet  # noqa: E402
from baton.model_spec import PRESETS  # noqa: E402
from baton.plan import Plan, load_plan, simple_plan  # noqa: E402
from baton.profile import table_filename, write_table  # noqa: E402
from runtime.comm_profiler import measure_links, median_link  # noqa: E402
from runtime.launch import TrainConfig, train  # noqa: E402
from runtime.op_profiler import median_of_tables, profile_table  # noqa: E402
from runtime.report import build_report  # noqa: E402

SPEC = PRESETS["small"]
ATTN = ["attn_scores", "softmax", "attn_dropout", "attn_v"]
VARIANTS = {
    # name -> (model, attention operators a plan recomputes, result file stem)
    "fp32-eager": (PRESETS["small"], ATTN, "fidelity"),
    "bf16-fused": (PRESETS["small"].with_overrides(name="small-bf16-fused", dtype="bf16", attention="fused"), ["attn_core"],
                   "fidelity_bf16_fused"),
}


def plans(cluster_name: str, procs: int) -> dict[str, Plan]:
    d = [f"local:{i}" for i in range(procs)]
    out = {
        "pp2 3+3": simple_plan(SPEC, cluster=cluster_name, stages=[[(d[0], 1)], [(d[1], 1)]], layers=[3, 3],
                               units_per_layer=1, micro_batch_size=2, num_microbatches=4),
        "pp2 4+2, stage 0 recomputes attention": simple_plan(
            SPEC, cluster=cluster_name, stages=[[(d[0], 1)], [(d[1], 1)]], layers=[4, 2], units_per_layer=1,
            micro_batch_size=2, num_microbatches=4, recompute={d[0]: ATTN}),
        "pp2 2+4, mb 4": simple_plan(SPEC, cluster=cluster_name, stages=[[(d[0], 1)], [(d[1], 1)]], layers=[2, 4],
                                     units_per_layer=1, micro_batch_size=4, num_microbatches=2),
        "tp2 2:2": simple_plan(SPEC, cluster=cluster_name, stages=[[(d[0], 2), (d[1], 2)]], layers=[6],
                               units_per_layer=4, micro_batch_size=2, num_microbatches=2),
        "tp2 3:1, rank 0 recomputes gelu+fc2": simple_plan(
            SPEC, cluster=cluster_name, stages=[[(d[0], 3), (d[1], 1)]], layers=[6], units_per_layer=4,
            micro_batch_size=2, num_microbatches=2, recompute={d[0]: ["gelu", "fc2"]}),
    }
    if procs >= 4:
        out["pp2 x tp2 (4 processes)"] = simple_plan(
            SPEC, cluster=cluster_name, stages=[[(d[0], 2), (d[1], 2)], [(d[2], 2), (d[3], 2)]], layers=[3, 3],
            units_per_layer=4, micro_batch_size=2, num_microbatches=4)
    return out


def write_cluster(dst: Path, procs: int, link) -> Path:
    data = yaml.safe_load((ROOT / "clusters" / "cpu2.yaml").read_text())
    data["name"] = f"cpu{procs}"
    data["nodes"][0]["gpus"][0]["count"] = procs
    data["nodes"][0]["gpus"][0]["memory_gib"] = 24 // procs
    data["nodes"][0]["intra_node_link"] = link.link_fields()
    path = dst / f"cpu{procs}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def solver_plan(cluster_path: Path, profiles: Path, out: Path) -> Plan | None:
    """The plan `baton solve` picks under the measured table (None if the solver is not available)."""
    model = out.with_name("model.yaml")  # the spec as written, so a variant solves as itself
    model.write_text(yaml.safe_dump(SPEC.to_dict()))
    cmd = [sys.executable, "-m", "cli", "solve", "--cluster", str(cluster_path), "--model", str(model),
           "--global-batch", "8", "--profiles", str(profiles), "--out", str(out), "--time-limit", "60"]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        print(f"  solver unavailable or failed: {(res.stderr or res.stdout).strip().splitlines()[-1:] }")
        return None
    return load_plan(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8, help="training steps per plan and round (the first is dropped)")
    ap.add_argument("--rounds", type=int, default=4, help="rounds of profiling then running every plan")
    ap.add_argument("--procs", type=int, default=2, choices=(2, 4))
    ap.add_argument("--reps", type=int, default=15, help="repetitions per operator measurement")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--only", default=None, help="run only the plans whose name contains this text")
    ap.add_argument("--variant", default="fp32-eager", choices=tuple(VARIANTS),
                    help="the small preset as it is (fp32, eager attention) or in bf16 with fused attention")
    args = ap.parse_args()
    global SPEC, ATTN
    SPEC, ATTN, stem = VARIANTS[args.variant]
    torch.set_num_threads(1)
    os.environ["BATON_PIN_CPUS"] = "1"
    work = Path(tempfile.mkdtemp(prefix="baton-fidelity-"))
    profiles = work / "profiles"
    t0 = time.time()
    cases = plans(f"cpu{args.procs}", args.procs)
    if args.only:
        cases = {k: v for k, v in cases.items() if args.only in k}
    # Every micro-batch size and share the hand plans use, plus those the solver may pick.
    mbs = sorted({p.micro_batch_size for p in cases.values()} | {1, 2, 4})
    shares = sorted({d.units / s.units_per_layer for p in cases.values() for s in p.pipelines[0].stages for d in s.devices}
                    | {0.25, 0.5, 0.75, 1.0})
    table_path = profiles / "measured" / table_filename("cpu", SPEC.name, SPEC.seq_len)
    tables, links, histories, round_ms = [], [], {}, {}
    for r in range(args.rounds):
        print(f"round {r + 1}/{args.rounds}: measuring the link over gloo ...")
        # The in-layer all-reduce measurement runs fp32 layers only; its GB/s figure carries over to a bf16
        # twin of the same shape (the bytes it moves are priced from the model's own dtype).
        links.append(measure_links(world_size=2, spec=SPEC.with_overrides(dtype="fp32"), micro_batches=(1, 2, 4)))
        if r == 0:
            cluster_path = write_cluster(work, args.procs, links[0])
        print(f"round {r + 1}/{args.rounds}: profiling {SPEC.name} on this CPU (micro-batches {mbs}, shares {shares}) ...")
        tables.append(profile_table(SPEC, device="cpu", micro_batches=tuple(mbs), shares=tuple(shares), warmup=3, reps=args.reps,
                                    concurrent=args.procs))
        if r == 0:
            write_table(tables[0], table_path)
            extra = solver_plan(cluster_path, profiles, work / "solved.json")
            if extra is not None and (not args.only or args.only in "baton solve"):
                cases[f"baton solve (mb {extra.micro_batch_size} x {extra.num_microbatches})"] = extra
        for name, plan in cases.items():
            print(f"  running {name} ...")
            per_rank: dict = {}
            train(TrainConfig(plan=plan, steps=args.steps, seed=0, collect_all_ranks=True, timeout_s=300), per_rank=per_rank)
            for rank, hist in per_rank.items():
                # Each round's first step pays for warm-up; the report drops the first of the whole history.
                histories.setdefault(name, {}).setdefault(rank, hist[:1]).extend(hist[1:])
            round_ms.setdefault(name, []).append(statistics.median(st.iteration_ms for st in per_rank[0][1:]))
    write_table(median_of_tables(tables), table_path)
    link = median_link(links)
    cluster = load_cluster(write_cluster(work, args.procs, link))

    rows = []
    for name, plan in cases.items():
        per_rank = histories[name]
        rep = build_report(plan, cluster, ProfileSet(SPEC, directory=profiles), per_rank)
        act_m = sum(d["measured"]["peak_saved_bytes"] for d in rep["devices"])
        act_p = sum(d["predicted"]["activation_bytes"] for d in rep["devices"])
        worst_act = max(abs(d["activation_rel_error"]) for d in rep["devices"])
        rows.append({
            "plan": name, "devices": len(plan.device_ids()),
            "iteration_ms_measured": rep["iteration_time_ms"]["measured"],
            "iteration_ms_predicted": rep["iteration_time_ms"]["predicted"],
            "iteration_rel_error": rep["iteration_time_ms"]["rel_error"],
            "activation_bytes_measured": act_m, "activation_bytes_predicted": act_p,
            "activation_worst_device_rel_error": worst_act,
            "iteration_ms_per_round": round_ms[name],
            "round_spread": (max(round_ms[name]) - min(round_ms[name])) / statistics.median(round_ms[name]),
            "stages": rep["stages"], "report": rep,
        })
        print(f"  iteration {rep['iteration_time_ms']['measured']:.1f} ms measured, "
              f"{rep['iteration_time_ms']['predicted']:.1f} ms predicted ({rep['iteration_time_ms']['rel_error']:+.1%}); "
              f"activations worst device {worst_act:.2%}")
        print("    phases (measured/predicted ms): " + ", ".join(
            f"{k.removesuffix('_ms')} {v['measured']:.1f}/{v['predicted']:.1f}" for k, v in rep["phases"].items()))
        print("    stages per micro-batch (measured/predicted ms, TP all-reduce): " + ", ".join(
            f"{st['measured_ms']:.1f}/{st['predicted_ms']:.1f} ({st['allreduce_measured_ms'] or 0:.1f}/{st['allreduce_predicted_ms']:.1f})"
            for st in rep["stages"]))

    it_err = [abs(r["iteration_rel_error"]) for r in rows]
    act_err = [r["activation_worst_device_rel_error"] for r in rows]
    summary = {
        "iteration_time_mean_abs_rel_error": statistics.mean(it_err), "iteration_time_worst_abs_rel_error": max(it_err),
        "activation_mean_abs_rel_error": statistics.mean(act_err), "activation_worst_abs_rel_error": max(act_err),
        "targets": {"iteration_mean": 0.05, "iteration_worst": 0.10, "activation": 0.02},
    }
    env = {"python": platform.python_version(), "torch": torch.__version__, "cores": os.cpu_count(), "threads_per_process": 1,
           "pinned": True, "model": SPEC.to_dict(), "steps": args.steps, "rounds": args.rounds, "reps": args.reps, "link": link.to_dict(), "seconds": round(time.time() - t0, 1)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps({"summary": summary, "environment": env, "plans": rows}, indent=2) + "\n")
    lines = ["| plan | devices | iteration ms measured | spread over rounds | predicted | error | activations MiB measured | predicted | worst device error |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['plan']} | {r['devices']} | {r['iteration_ms_measured']:.1f} | {r['round_spread']:.0%} | "
                     f"{r['iteration_ms_predicted']:.1f} | "
                     f"{r['iteration_rel_error']:+.1%} | {r['activation_bytes_measured'] / 2**20:.2f} | "
                     f"{r['activation_bytes_predicted'] / 2**20:.2f} | {r['activation_worst_device_rel_error']:.2%} |")
    lines += ["", f"Iteration time: mean absolute error {summary['iteration_time_mean_abs_rel_error']:.1%}, worst "
              f"{summary['iteration_time_worst_abs_rel_error']:.1%} (targets 5% / 10%). Activation memory: mean "
              f"{summary['activation_mean_abs_rel_error']:.2%}, worst {summary['activation_worst_abs_rel_error']:.2%} (target 2%).",
              "", f"Model `{SPEC.name}` ({SPEC.dtype}, {SPEC.attention} attention), {args.procs} CPU processes, one thread each, pinned; link measured over gloo: "
              f"{link.bandwidth_gb_per_s:.2f} GB/s, {link.latency_us:.0f} us per transfer; all-reduce {link.allreduce_bandwidth_gb_per_s:.2f} GB/s, "
              f"{link.allreduce_latency_us:.0f} us per ring step between idle ranks, {link.tp_allreduce_bandwidth_gb_per_s:.2f} GB/s, "
              f"{link.tp_allreduce_latency_us:.0f} us inside the tensor-parallel layer; {args.rounds} rounds of "
              f"(profile on {args.procs} cores at once, median of {args.reps}; run every plan {args.steps} steps, first dropped). "
              "Measured: median over all kept steps; spread: (slowest - fastest round median) / median; predicted: from the "
              "median of the rounds' tables."]
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
