"""Does the cost model predict what the runtime does? Predicted vs measured, plan by plan, on this CPU.

Set-up (explicit, because CPU processes share this machine's cores):
* one torch thread per process, and each process pinned to one core (rank r on core r mod cores;
  BATON_PIN_CPUS=1), both while profiling and while training, so an operator runs under the same
  conditions in the table and in the run; gloo's I/O threads are left free to run on any core;
* the operator profilers and the training ranks keep the host memory they free for reuse
  (``runtime.launch.host_memory``): with glibc's defaults a rank faulted 1,000-20,000 fresh pages in per
  step, depending on its allocation history, and ran up to ~18% slower than the table;
* the operator table is measured on every core at once (``profile_table(concurrent=procs)``: training
  keeps every core busy, and a layer runs ~14% slower beside a busy core than beside an idle one),
  median of repetitions after warm-up, for the ``small`` preset (6 layers, width 256, 8 heads,
  sequence 128, fp32, dropout 0.1) at every micro-batch size and share the plans use; the link is
  measured over gloo between two processes, its all-reduces inside the tensor-parallel layer, and
  written into a copy of clusters/cpu2.yaml (and cpu4 when 4 processes are asked for);
* this machine's speed wanders by 10-35% over tens of seconds (other tenants), so prediction and
  measurement are *paired*: the benchmark runs in rounds, each round measures the link, then for every
  plan profiles exactly the micro-batch sizes and shares the plan runs, at once trains it for
  ``--steps`` steps (the first dropped) and profiles them again; the round's prediction uses the mean of
  the two tables, so drift across the pair cancels to first order. A plan's error is the median over
  rounds of its paired errors (the round's prediction from the round's tables and link against the
  round's median step), so drift between rounds cancels instead of landing on one side; the measured and predicted times shown are the
  medians over rounds of each. (Round 1 also profiles every size and share once, for ``baton solve``.)

Plans: pipelines with even and uneven layers (with ``--machines`` the even one also across two "machines" on
this host: network namespaces joined by a 40 Mbit/s link, tests/machines_harness.py, root only, each machine's
`baton train --node` pinned to a core of its own), an interleaved pipeline (two uneven chunks per device,
docs/schedules.md), recomputation on one stage, tensor parallelism with
even and uneven (3:1) units, data-parallel replicas (equal batches, uneven micro-batch counts 3 vs 1 and
sizes 4 vs 2, optimizer state sharded 0.7/0.3 at zero_stage 1, everything sharded 0.7/0.3 at zero_stage 3,
run layer by layer; with 4 processes also a two-stage pipeline
beside a single device), and the plan ``baton solve`` picks for this cluster under the measured table.
Reported per plan: iteration time and activation memory, predicted and measured, with their relative
errors; then the mean absolute and worst relative error over the plans. For plans with replicas, the
waits at the gradient sync from every rank's trace (``wait_analysis``): each replica's arrival and its
jitter, each rank's sync split into waiting for the peers and the collective itself, and the wait and
the step's excess over the slowest replica against a model of noisy replicas (expected maximum of
normals), its sigma taken from the run or from the spread of a layer's profiled repetitions.

Run: ``python bench/bench_fidelity.py [--rounds 4] [--steps 8] [--procs 2] [--variant fp32-eager|bf16-fused] [--machines]``;
writes bench/results/fidelity.json and .md (``fidelity_bf16_fused.*`` for the bf16, fused-attention variant)
after every round, so a run cut short keeps the rounds it finished (the table then says so).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import yaml  # noqa: E402

from baton.cluster import load_cluster  # noqa: E402
from baton.evaluate import evaluate  # noqa: E402
from baton.profile import ProfileSet  # noqa: E402
from baton.model_spec import PRESETS  # noqa: E402
from baton.plan import Pipeline, Plan, interleaved_pipeline, load_plan, simple_plan, validate  # noqa: E402
from baton.memory import held_tensors  # noqa: E402
from baton.operators import EMBEDDING, HEAD, operator_names  # noqa: E402
from baton.profile import OPTIMIZER, table_filename, write_table  # noqa: E402
from runtime.measure.comm_profiler import measure_links, median_link  # noqa: E402
from runtime.launch.launcher import TrainConfig, train  # noqa: E402
from runtime.measure.op_profiler import median_of_tables, profile_table  # noqa: E402
from runtime.train.precision import cpu_runs_natively  # noqa: E402
from runtime.measure.report import build_report  # noqa: E402
from runtime.parallel.topology import Topology  # noqa: E402
from runtime.measure.trace import read_spans  # noqa: E402

SPEC = PRESETS["small"]
ATTN = ["attn_scores", "softmax", "attn_dropout", "attn_v"]
VARIANTS = {
    # name -> (model, attention operators a plan recomputes, result file stem)
    "fp32-eager": (PRESETS["small"], ATTN, "fidelity"),
    "bf16-fused": (PRESETS["small"].with_overrides(name="small-bf16-fused", dtype="bf16", attention="fused"), ["attn_core"],
                   "fidelity_bf16_fused"),
    # The small preset's sizes as a Llama layer: 8 query heads over 4 KV heads (units of one KV head), SwiGLU
    # of the same width, untied head, residual dropout 0.1.
    "llama": (PRESETS["small"].with_overrides(name="small-llama", architecture="llama", num_kv_heads=4, attention="fused",
                                              tie_embeddings=False), ["rope", "attn_core"], "fidelity_llama"),
}
MLP_TAIL = {"gpt": ["gelu", "fc2"], "llama": ["swiglu", "down"]}
"""What the 'tp2 3:1' plan's rank 0 recomputes: the MLP's activation and its row-parallel matmul."""


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
        "pp2 interleaved, 2 chunks of 1+2 and 2+1": interleaved_plan(cluster_name, d[:2], [1, 2, 2, 1], m=4),
        "tp2 2:2": simple_plan(SPEC, cluster=cluster_name, stages=[[(d[0], 2), (d[1], 2)]], layers=[6],
                               units_per_layer=4, micro_batch_size=2, num_microbatches=2),
        f"tp2 3:1, rank 0 recomputes {'+'.join(MLP_TAIL[SPEC.architecture])}": simple_plan(
            SPEC, cluster=cluster_name, stages=[[(d[0], 3), (d[1], 1)]], layers=[6], units_per_layer=4,
            micro_batch_size=2, num_microbatches=2, recompute={d[0]: MLP_TAIL[SPEC.architecture]}),
    }
    # Cephalo's way (docs/cost-model.md, section 4o): every layer recomputed, its boundary kept in host memory.
    everything = operator_names(SPEC)
    out["pp2 3+3, every layer recomputed, its boundary offloaded"] = with_offload(simple_plan(
        SPEC, cluster=cluster_name, stages=[[(d[0], 1)], [(d[1], 1)]], layers=[3, 3], units_per_layer=1,
        micro_batch_size=2, num_microbatches=4, recompute={d[0]: everything, d[1]: everything}),
        held_tensors(SPEC, frozenset(everything)))
    # Data-parallel replicas (docs/cost-model.md, section 9): ranks that meet at every gradient sync.
    single = dict(stages=[[1]], layers=[6])
    out.update({
        "dp2 2x2 + 2x2": replicas_plan(cluster_name, d, [dict(single, m=2, mbs=2), dict(single, m=2, mbs=2)]),
        "dp2 3x2 + 1x2 (uneven micro-batch counts)": replicas_plan(
            cluster_name, d, [dict(single, m=3, mbs=2), dict(single, m=1, mbs=2)]),
        "dp2 1x4 + 1x2 (uneven micro-batch sizes)": replicas_plan(
            cluster_name, d, [dict(single, m=1, mbs=4), dict(single, m=1, mbs=2)]),
        "dp2 2x2 + 2x2, zero-1 0.7/0.3": replicas_plan(
            cluster_name, d, [dict(single, m=2, mbs=2), dict(single, m=2, mbs=2)], zero_stage=1, ratios=[0.7, 0.3]),
        "dp2 3x2 + 1x2, zero-1 0.7/0.3": replicas_plan(
            cluster_name, d, [dict(single, m=3, mbs=2), dict(single, m=1, mbs=2)], zero_stage=1, ratios=[0.7, 0.3]),
        "dp2 3x2 + 1x2, zero-3 0.7/0.3 (layer by layer)": replicas_plan(
            cluster_name, d, [dict(single, m=3, mbs=2), dict(single, m=1, mbs=2)], zero_stage=3, ratios=[0.7, 0.3]),
    })
    if procs >= 4:
        out["pp2 x tp2 (4 processes)"] = simple_plan(
            SPEC, cluster=cluster_name, stages=[[(d[0], 2), (d[1], 2)], [(d[2], 2), (d[3], 2)]], layers=[3, 3],
            units_per_layer=4, micro_batch_size=2, num_microbatches=4)
        pipe = dict(stages=[[1], [1]], layers=[3, 3], m=4, mbs=2)
        out["pp2 3+3 (4x2) + single (2x2) (3 processes)"] = replicas_plan(cluster_name, d, [pipe, dict(single, m=2, mbs=2)])
        out["pp2 3+3 (4x2) + single (2x2), zero-1 0.7/0.7/0.3 (3 processes)"] = replicas_plan(
            cluster_name, d, [pipe, dict(single, m=2, mbs=2)], zero_stage=1, ratios=[0.7, 0.7, 0.3])
    return out


MACHINES_CASE = "pp2 3+3 across 2 machines, 40 Mbit/s between"
MACHINES_MBIT = 40
"""The NIC rate of each of the two namespaced machines (tc tbf both ways), and the ``nic`` their cluster file gives:
slow enough that the pipeline's transfers (256 KiB activations, 52 ms each) are a tenth of its step."""


def machines_plan() -> Plan:
    """The two-stage pipeline of 'pp2 3+3' with its stages on two machines (tests/machines_harness.py)."""
    return simple_plan(SPEC, cluster="cpu1x2", stages=[[("m1:0", 1)], [("m2:0", 1)]], layers=[3, 3], units_per_layer=1,
                       micro_batch_size=2, num_microbatches=4)


def write_machines_cluster(dst: Path, link) -> Path:
    """Two machines of one CPU process each, their NICs the shaped rate, a message's latency the measured gloo one."""
    node = lambda name, k: {"name": name, "interface": f"bm{k}", "gpus": [{"type": "cpu", "count": 1, "memory_gib": 12}],  # noqa: E731
                            "nic": {"bandwidth_gb_per_s": MACHINES_MBIT / 8000, "latency_us": round(link.latency_us, 2)}}
    data = {"name": "cpu1x2", "nodes": [node("m1", 1), node("m2", 2)]}
    dst.mkdir(parents=True, exist_ok=True)
    path = dst / "cpu1x2.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def run_on_machines(plan: Plan, cluster_path: Path, profiles: Path, steps: int, work: Path) -> dict:
    """Train ``plan`` on two namespaced machines, each its own `baton train --node` pinned to a core of its own; the
    report rank 0 writes (measured against the prediction from ``profiles``)."""
    from tests.machines_harness import Machines

    save = work / "machines-plan.json"
    save.write_text(plan.to_json())
    report = work / "machines-report.json"
    env = {**os.environ, "BATON_PIN_CPUS": "1"}
    with Machines(2, [MACHINES_MBIT, MACHINES_MBIT]) as ms:
        procs = []
        for k, node in enumerate(("m1", "m2")):
            args = ["taskset", "-c", str(k % (os.cpu_count() or 1)), sys.executable, "-m", "cli", "train", "--plan", str(save),
                    "--node", node, "--rdzv-endpoint", f"{ms.machines[0].address}:29400", "--cluster", str(cluster_path),
                    "--profiles", str(profiles), "--device", "cpu", "--steps", str(steps), "--timeout", "300",
                    "--report", str(report), "--run-dir", str(work / "machines-run")]
            procs.append(ms.machines[k].popen(args, env=env, cwd=ROOT, log=work / f"machine{k + 1}.log"))
            time.sleep(1.0 if k == 0 else 0)  # the rendezvous host first
        for p in procs:
            p.wait(1800)
        if any(p.returncode for p in procs):
            raise RuntimeError("the run across machines failed: " + (work / "machine1.log.err").read_text()[-500:])
    return json.loads(report.read_text())


def with_offload(plan: Plan, offload) -> Plan:
    """``plan`` with every device keeping ``offload`` in host memory between the passes."""
    return validate(replace(plan, pipelines=tuple(
        replace(p, stages=tuple(replace(s, devices=tuple(replace(d, offload=tuple(offload)) for d in s.devices))
                                for s in p.stages)) for p in plan.pipelines)))


def interleaved_plan(cluster_name: str, ids: list[str], layers: list[int], *, m: int, mbs: int = 2) -> Plan:
    """Interleaved 1F1B (docs/schedules.md) over one device per group: virtual stage k holds ``layers[k]`` layers and
    runs on ``ids[k mod p]``."""
    p = len(ids)
    flat = simple_plan(SPEC, cluster=cluster_name, stages=[[(i, 1)] for i in ids], layers=[sum(layers[g::p]) for g in range(p)],
                       units_per_layer=1, micro_batch_size=mbs, num_microbatches=m)
    return validate(replace(flat, pipelines=(interleaved_pipeline(flat.pipelines[0], layers),)))


def replicas_plan(cluster_name: str, ids: list[str], replicas: list[dict], *, zero_stage: int = 0,
                  ratios: list[float] | None = None) -> Plan:
    """A plan of data-parallel replicas, each its own shape and batch: ``replicas[r]`` has ``stages`` ([[units,
    ...], ...], one unit per layer), ``layers`` per stage, ``m`` micro-batches of ``mbs`` samples; devices
    ``ids`` in order; ``ratios``: one ``shard_ratio`` per device in that order (zero_stage 1)."""
    pipes, it = [], iter(ids)
    for rep in replicas:
        one = simple_plan(SPEC, cluster=cluster_name, stages=[[(next(it), u) for u in st] for st in rep["stages"]],
                          layers=rep["layers"], units_per_layer=1)
        pipes.append(Pipeline(stages=one.pipelines[0].stages, micro_batch_size=rep["mbs"], num_microbatches=rep["m"]))
    if ratios is not None:
        flat = iter(ratios)
        pipes = [replace(p, stages=tuple(replace(s, devices=tuple(replace(dv, shard_ratio=next(flat)) for dv in s.devices))
                                         for s in p.stages)) for p in pipes]
    return validate(Plan(model=SPEC, cluster=cluster_name, micro_batch_size=pipes[0].micro_batch_size,
                         num_microbatches=pipes[0].num_microbatches, pipelines=tuple(pipes), zero_stage=zero_stage))


# --- waits at the gradient sync ------------------------------------------------------------------------
#
# Replicas run the same kind of work on their own cores and meet at every step's gradient sync; the cost
# model prices each replica at its profile's (median) time and the sync as the collective alone (eq. 11,
# 15). A step really lasts as long as the replica that arrives last *in that step*, so noise in every
# replica's time adds E[max_r P_r] - max_r E[P_r] per step. Measured from the ranks' traces (one wall
# clock on one machine, ``runtime.measure.trace``), per kept step k:
#   S_k        the step's start: the earliest span of the step on any rank (the ranks leave the previous
#              step's last all-reduce together);
#   A_{r,k}    replica r's arrival: the last of its ranks to enter the gradient-sync span, minus S_k;
#   wait       L_k - A_{r,k} with L_k = max_r A_{r,k} (the step's last arrival); per step the mean over
#              the replicas, W_k = L_k - mean_r A_{r,k};
#   collective exit - max_j enter_j per rank: the sync once every peer has arrived;
#   excess     mean_k L_k - max_r mean_k A_{r,k}: what the step pays over the slowest replica's mean.
# The model: P_r ~ Normal(mu_r, sigma_r^2), independent; E[max] by Clark's (1961) moments, exact for
# two (E[max] - mu = sigma / sqrt(pi) for two equal replicas).

def _phi(x: float) -> float:
    return math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _Phi(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2)))


def expected_max(mus: list[float], sigmas: list[float], rho: float = 0.0) -> float:
    """E[max_r X_r] for X_r ~ Normal(mu_r, sigma_r^2): Clark's recursion (pairs exact; the running maximum
    is taken as normal for three or more). ``rho``: correlation of the first two (the rest independent)."""
    m, v = mus[0], sigmas[0] ** 2
    for i, (mu, sd) in enumerate(zip(mus[1:], sigmas[1:])):
        r = rho if i == 0 else 0.0
        theta = math.sqrt(max(v + sd * sd - 2 * r * math.sqrt(v) * sd, 0.0))
        if theta < 1e-12:
            m, v = max(m, mu), v
            continue
        a = (m - mu) / theta
        first = m * _Phi(a) + mu * _Phi(-a) + theta * _phi(a)
        second = (m * m + v) * _Phi(a) + (mu * mu + sd * sd) * _Phi(-a) + (m + mu) * theta * _phi(a)
        m, v = first, max(second - first * first, 0.0)
    return m


def _sd(xs: list[float]) -> float:
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def _robust_sd(xs: list[float]) -> float:
    """The interquartile range as a normal's sd: blind to the rare stalls of a loaded machine."""
    if len(xs) < 4:
        return _sd(xs)
    q = statistics.quantiles(xs, n=4)
    return (q[2] - q[0]) / 1.349


def sync_samples(plan: Plan, spans: dict[int, list[dict]], per_rank: dict) -> list[dict]:
    """Per step of one run (its first, warm-up step dropped): replica arrivals A_r (ms from the step's start),
    every rank's sync entry wait and collective (ms), and every rank's compute (forward + backward, ms)."""
    topo = Topology(plan)
    replica_of = [topo.position(r).pipeline for r in range(topo.world_size)]
    out = []
    steps = sorted({e["args"].get("step") for ev in spans.values() for e in ev if "step" in e.get("args", {})})
    for k in steps[1:]:
        start, enter, leave = math.inf, {}, {}
        for rank, events in spans.items():
            for e in events:
                if e.get("args", {}).get("step") != k:
                    continue
                start = min(start, e["ts"])
                if e["name"].startswith("gradient sync"):
                    enter[rank], leave[rank] = e["ts"], e["ts"] + e["dur"]
        if len(enter) != topo.world_size:
            continue
        last = max(enter.values())
        arrivals = [max(enter[j] for j in enter if replica_of[j] == r) for r in range(len(plan.pipelines))]
        hist = {r: next((st for st in h if st.step == k), None) for r, h in per_rank.items()}
        out.append({"arrival_ms": [(a - start) / 1e3 for a in arrivals],
                    "wait_ms": [(last - enter[j]) / 1e3 for j in sorted(enter)],
                    "collective_ms": [(leave[j] - last) / 1e3 for j in sorted(enter)],
                    "sync_ms": [(leave[j] - enter[j]) / 1e3 for j in sorted(enter)],
                    "compute_ms": [sum(h.forward_ms) + sum(h.backward_ms) if h else None for _, h in sorted(hist.items())]})
    return out


def wait_analysis(samples: list[dict], num_replicas: int) -> dict | None:
    """Measured waits at the sync and what the noise model, with the run's own sigmas, gives for them (see above)."""
    if num_replicas < 2 or len(samples) < 3:
        return None
    arr = [[s["arrival_ms"][r] for s in samples] for r in range(num_replicas)]
    mus, sds = [statistics.mean(a) for a in arr], [_sd(a) for a in arr]
    meds, rsds = [statistics.median(a) for a in arr], [_robust_sd(a) for a in arr]
    last = [max(s["arrival_ms"]) for s in samples]
    waits = [max(s["arrival_ms"]) - statistics.mean(s["arrival_ms"]) for s in samples]
    rho = statistics.correlation(arr[0], arr[1]) if min(sds[:2]) > 0 else 0.0
    ranks = len(samples[0]["wait_ms"])
    compute = [[s["compute_ms"][j] for s in samples if s["compute_ms"][j] is not None] for j in range(ranks)]
    out = {
        "steps": len(samples),
        "replica_arrival_ms": {"mean": mus, "sd": sds, "median": meds, "robust_sd": rsds, "correlation_01": rho,
                               "per_step": arr},
        "wait_per_step_ms": {"mean": statistics.mean(waits), "sd": _sd(waits), "median": statistics.median(waits)},
        "excess_over_slowest_mean_ms": statistics.mean(last) - max(mus),
        # The same with medians (what the benchmark's iteration figure is) and the IQR's sigma: robust to stalls.
        "excess_over_slowest_median_ms": statistics.median(last) - max(meds),
        "rank_sync_ms": {
            "sync": [statistics.mean(s["sync_ms"][j] for s in samples) for j in range(ranks)],
            "wait": [statistics.mean(s["wait_ms"][j] for s in samples) for j in range(ranks)],
            "collective": [statistics.median(s["collective_ms"][j] for s in samples) for j in range(ranks)]},
        "rank_compute_ms": {"mean": [statistics.mean(c) if c else None for c in compute],
                            "sd": [_sd(c) if c else None for c in compute]},
        "model": {
            # sigma from the run itself: how well the formula explains the wait, given the jitter.
            "wait_ms": expected_max(mus, sds) - statistics.mean(mus),
            "wait_ms_with_correlation": expected_max(mus, sds, rho) - statistics.mean(mus),
            "excess_ms": expected_max(mus, sds) - max(mus),
            "excess_ms_with_correlation": expected_max(mus, sds, rho) - max(mus),
            "excess_ms_robust": expected_max(meds, rsds) - max(meds),
        },
    }
    return out


def _layer_ms(table) -> float:
    """The layer operators' forward + backward at the table's smallest micro-batch size and whole share (both
    attention forms): a figure of the machine's speed while the table was measured."""
    rows = table[(table["micro_batch"] == table["micro_batch"].min()) & (table["tp_share"] == 1.0)
                 & ~table["op"].isin([EMBEDDING, HEAD, OPTIMIZER])]
    return float(rows["fwd_ms"].sum() + rows["bwd_ms"].sum())


def time_targets(dtype: str) -> dict:
    """Iteration-time targets of a variant. Only fp32 has them: CPUs without bf16 instructions emulate its matrix
    products, and CPUs are not what users train bf16 on, so a bf16 row on a CPU is reported, not held to a
    target (issue 27 dropped it; the GPU benchmark holds bf16 to 5% / 10%)."""
    return {"iteration_mean": 0.05, "iteration_worst": 0.10} if dtype == "fp32" else {}


def time_target_text(dtype: str) -> str:
    t = time_targets(dtype)
    return (f"targets {t['iteration_mean']:.0%} / {t['iteration_worst']:.0%}" if t
            else f"no time target for {dtype} on a CPU")


def cpu_description() -> str:
    """The CPU model and whether it has bf16 instructions: without them PyTorch's bf16 matrix products run
    an emulation (``runtime.train.precision.emulation_note``; on an AVX2-only EPYC a bf16 layer of the small
    preset ran 18x slower than in fp32), which changes a bf16 plan's balance of compute and communication."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
                break
    except OSError:
        pass
    native = cpu_runs_natively("bf16")
    return f"{model}, " + {True: "bf16 instructions", False: "no bf16 instructions", None: "bf16 support unknown"}[native]


def write_cluster(dst: Path, procs: int, link) -> Path:
    data = yaml.safe_load((ROOT / "clusters" / "cpu2.yaml").read_text())
    data["name"] = f"cpu{procs}"
    data["nodes"][0]["gpus"][0]["count"] = procs
    data["nodes"][0]["gpus"][0]["memory_gib"] = 24 // procs
    data["nodes"][0]["intra_node_link"] = link.link_fields()
    if link.replica_time_cv is not None:  # eq. 19, measured with the link
        data["replica_time_cv"] = round(link.replica_time_cv, 4)
    dst.mkdir(parents=True, exist_ok=True)
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
    ap.add_argument("--isolated", action="store_true",
                    help="profile each layer from an idle device, without host columns (the tables before eq. 2h), "
                         "instead of inside training iterations")
    ap.add_argument("--only", action="append", default=None,
                    help="run only the plans whose name contains this text (repeatable: any of them); the solver's "
                         "plan, named once solved, runs when the text is part of 'baton solve'")
    ap.add_argument("--machines", action="store_true",
                    help="also run 'pp2 3+3' across two namespaced machines joined by a 40 Mbit/s link (root only)")
    ap.add_argument("--variant", default="fp32-eager", choices=tuple(VARIANTS),
                    help="the small preset as it is (fp32, eager attention), in bf16 with fused attention, or as a "
                         "Llama layer")
    args = ap.parse_args()
    global SPEC, ATTN
    SPEC, ATTN, _ = VARIANTS[args.variant]
    torch.set_num_threads(1)
    os.environ["BATON_PIN_CPUS"] = "1"
    work = Path(tempfile.mkdtemp(prefix="baton-fidelity-"))
    profiles = work / "profiles"
    t0 = time.time()
    cases = plans(f"cpu{args.procs}", args.procs)
    from tests.machines_harness import unavailable

    if args.machines:
        if args.procs != 2 or unavailable() is not None:
            raise SystemExit(f"--machines needs --procs 2 and network namespaces ({unavailable() or 'procs'})")
        cases[MACHINES_CASE] = machines_plan()
    if args.only:
        cases = {k: v for k, v in cases.items() if any(o in k for o in args.only)}
    # Every micro-batch size and share the hand plans use, plus those the solver may pick.
    mbs = sorted({p.batch(i)[0] for p in cases.values() for i in range(len(p.pipelines))} | {1, 2, 4})
    shares = sorted({d.units / s.units_per_layer for p in cases.values() for pipe in p.pipelines for s in pipe.stages
                     for d in s.devices}
                    | {0.25, 0.5, 0.75, 1.0})
    table_path = profiles / "measured" / table_filename("cpu", SPEC.name, SPEC.seq_len)
    links, syncs, rounds, drifts = [], {}, {}, {}
    for r in range(args.rounds):
        print(f"round {r + 1}/{args.rounds}: measuring the link over gloo ...")
        # In the model's own dtype: gloo reduces bf16 at a fraction of fp32's rate per byte.
        links.append(measure_links(world_size=2, spec=SPEC, micro_batches=(1, 2, 4)))
        cluster_path = write_cluster(work / f"round-{r}", args.procs, links[-1])
        cluster = load_cluster(cluster_path)
        if r == 0 and (not args.only or any(o in "baton solve" for o in args.only)):
            print(f"round 1: profiling {SPEC.name} for the solver (micro-batches {mbs}, shares {shares}) ...")
            write_table(profile_table(SPEC, device="cpu", micro_batches=tuple(mbs), shares=tuple(shares), warmup=3,
                                      reps=args.reps, concurrent=args.procs, in_step=not args.isolated), table_path)
            extra = solver_plan(cluster_path, profiles, work / "solved.json")
            if extra is not None:
                cases[f"baton solve (mb {extra.micro_batch_size} x {extra.num_microbatches})"] = extra
        for index, (name, plan) in enumerate(cases.items()):
            # Paired: the table of exactly what this plan runs, measured right before and right after it runs, so
            # the machine's drift (10-35% over tens of seconds here) hits prediction and measurement alike.
            plan_mbs = sorted({plan.batch(i)[0] for i in range(len(plan.pipelines))})
            plan_shares = sorted({d.units / st.units_per_layer for pipe in plan.pipelines for st in pipe.stages
                                  for d in st.devices} | {1.0})
            print(f"  profiling, running, profiling again {name} ...")
            plan_profiles = work / f"round-{r}" / f"plan-{index}"

            def plan_table():
                return profile_table(SPEC, device="cpu", micro_batches=tuple(plan_mbs), shares=tuple(plan_shares), warmup=3,
                                     reps=args.reps, concurrent=args.procs, in_step=not args.isolated)

            before = plan_table()
            table_file = plan_profiles / "measured" / table_filename("cpu", SPEC.name, SPEC.seq_len)
            if name == MACHINES_CASE:
                write_table(before, table_file)
                machines_cluster = write_machines_cluster(work / f"round-{r}", links[-1])
                rep = run_on_machines(plan, machines_cluster, plan_profiles, args.steps, work / f"round-{r}")
                after = plan_table()
                write_table(median_of_tables([before, after]), table_file)
                drifts.setdefault(name, []).append(_layer_ms(after) / _layer_ms(before) - 1.0)
                # The worker priced the run with the table before it; the pair's mean, as for every other plan.
                predicted = evaluate(plan, load_cluster(machines_cluster), ProfileSet(SPEC, directory=plan_profiles)).iteration_time_ms
                it = rep["iteration_time_ms"]
                it["predicted"], it["rel_error"] = predicted, (predicted - it["measured"]) / it["measured"]
                rounds.setdefault(name, []).append(rep)
                print(f"    round {r + 1}: {it['measured']:.1f} ms measured, {predicted:.1f} predicted ({it['rel_error']:+.1%})")
                continue
            per_rank: dict = {}
            trace = work / f"trace-{index}-{r}.json"
            train(TrainConfig(plan=plan, steps=args.steps, seed=0, collect_all_ranks=True, timeout_s=300, trace=str(trace)),
                  per_rank=per_rank)
            after = plan_table()
            # The run sits between two tables: their mean cancels the machine's drift across the pair, to first order.
            write_table(median_of_tables([before, after]), table_file)
            drifts.setdefault(name, []).append(_layer_ms(after) / _layer_ms(before) - 1.0)
            syncs.setdefault(name, []).extend(sync_samples(plan, read_spans(trace), per_rank))
            rep = build_report(plan, cluster, ProfileSet(SPEC, directory=plan_profiles), per_rank)
            rounds.setdefault(name, []).append(rep)
            print(f"    round {r + 1}: {rep['iteration_time_ms']['measured']:.1f} ms measured, "
                  f"{rep['iteration_time_ms']['predicted']:.1f} predicted ({rep['iteration_time_ms']['rel_error']:+.1%})")
        # Written after every round, so a run cut short (a lent machine's time running out) still leaves its figures.
        write_results(args, cases, rounds, syncs, drifts, links, t0, rounds_done=r + 1)


def write_results(args, cases: dict, rounds: dict, syncs: dict, drifts: dict, links: list, t0: float, *, rounds_done: int) -> None:
    """Summarise the rounds done so far into ``<stem>.json`` and ``.md`` (printing the per-plan detail after the last)."""
    stem = VARIANTS[args.variant][2]
    final = rounds_done == args.rounds
    link = median_link(links)

    rows = []
    for name, plan in ((n, p) for n, p in cases.items() if n in rounds):
        reps = rounds[name]
        measured = [x["iteration_time_ms"]["measured"] for x in reps]
        predicted = [x["iteration_time_ms"]["predicted"] for x in reps]
        paired = [x["iteration_time_ms"]["rel_error"] for x in reps]
        # The round whose error is the median stands for the plan (its phases and stages are printed).
        rep = sorted(reps, key=lambda x: x["iteration_time_ms"]["rel_error"])[len(reps) // 2]
        act_m = sum(d["measured"]["peak_saved_bytes"] for d in rep["devices"])
        act_p = sum(d["predicted"]["activation_bytes"] for d in rep["devices"])
        worst_act = max(abs(d["activation_rel_error"]) for x in reps for d in x["devices"])
        waits = wait_analysis(syncs.get(name, []), len(plan.pipelines))
        if waits is not None:  # eq. 19 as the cost model prices it, from each round's measured replica_time_cv
            waits["cost_model_ms"] = statistics.median(x["arrival_wait_ms"]["predicted"] for x in reps)
            waits["replica_time_cv"] = statistics.median(x["arrival_wait_ms"]["replica_time_cv"] for x in reps)
        rows.append({
            "plan": name, "devices": len(plan.device_ids()), "sync_wait": waits,
            "iteration_ms_measured": statistics.median(measured), "iteration_ms_predicted": statistics.median(predicted),
            "iteration_rel_error": statistics.median(paired), "iteration_rel_error_per_round": paired,
            "activation_bytes_measured": act_m, "activation_bytes_predicted": act_p,
            "activation_worst_device_rel_error": worst_act,
            "iteration_ms_per_round": measured, "iteration_ms_predicted_per_round": predicted,
            "round_spread": (max(measured) - min(measured)) / statistics.median(measured),
            "table_drift_per_round": drifts[name],
            "stages": rep["stages"], "report": rep,
        })
        if not final:
            continue
        print(f"  {name}: iteration {statistics.median(measured):.1f} ms measured, {statistics.median(predicted):.1f} ms predicted "
              f"(paired error, median over rounds: {statistics.median(paired):+.1%}; rounds "
              + ", ".join(f"{e:+.1%}" for e in paired) + f"); activations worst device {worst_act:.2%}")
        print("    phases (measured/predicted ms): " + ", ".join(
            f"{k.removesuffix('_ms')} {v['measured']:.1f}/{v['predicted']:.1f}" for k, v in rep["phases"].items()))
        if waits is not None:
            print(f"    sync wait per step {waits['wait_per_step_ms']['mean']:.2f} ms (sd {waits['wait_per_step_ms']['sd']:.2f}; "
                  f"model {waits['model']['wait_ms']:.2f}); replica arrival sd "
                  + ", ".join(f"{v:.2f}" for v in waits["replica_arrival_ms"]["sd"])
                  + f" ms; excess over the slowest mean {waits['excess_over_slowest_mean_ms']:.2f} ms "
                  f"(model {waits['model']['excess_ms']:.2f})")
        print("    stages per micro-batch (measured/predicted ms, TP all-reduce): " + ", ".join(
            f"{st['measured_ms']:.1f}/{st['predicted_ms']:.1f} ({st['allreduce_measured_ms'] or 0:.1f}/{st['allreduce_predicted_ms']:.1f})"
            for st in rep["stages"]))

    it_err = [abs(r["iteration_rel_error"]) for r in rows]
    act_err = [r["activation_worst_device_rel_error"] for r in rows]
    summary = {
        "iteration_time_mean_abs_rel_error": statistics.mean(it_err), "iteration_time_worst_abs_rel_error": max(it_err),
        "activation_mean_abs_rel_error": statistics.mean(act_err), "activation_worst_abs_rel_error": max(act_err),
        "targets": time_targets(SPEC.dtype) | {"activation": 0.02},
    }
    env = {"python": platform.python_version(), "torch": torch.__version__, "cpu": cpu_description(), "cores": os.cpu_count(),
           "threads_per_process": 1,
           "pinned": True, "model": SPEC.to_dict(), "steps": args.steps, "rounds": rounds_done, "rounds_asked": args.rounds, "reps": args.reps, "link": link.to_dict(), "seconds": round(time.time() - t0, 1)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps({"summary": summary, "environment": env, "plans": rows}, indent=2) + "\n")
    lines = ["| plan | devices | iteration ms measured | spread over rounds | table drift | predicted | error | activations MiB measured | predicted | worst device error |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        drift = max(r["table_drift_per_round"], key=abs)
        lines.append(f"| {r['plan']} | {r['devices']} | {r['iteration_ms_measured']:.1f} | {r['round_spread']:.0%} | {drift:+.0%} | "
                     f"{r['iteration_ms_predicted']:.1f} | "
                     f"{r['iteration_rel_error']:+.1%} | {r['activation_bytes_measured'] / 2**20:.2f} | "
                     f"{r['activation_bytes_predicted'] / 2**20:.2f} | {r['activation_worst_device_rel_error']:.2%} |")
    cut = "" if final else f" (of {args.rounds} asked: cut short)"
    lines += ["", f"Iteration time: mean absolute error {summary['iteration_time_mean_abs_rel_error']:.1%}, worst "
              f"{summary['iteration_time_worst_abs_rel_error']:.1%} ({time_target_text(SPEC.dtype)}). Activation memory: mean "
              f"{summary['activation_mean_abs_rel_error']:.2%}, worst {summary['activation_worst_abs_rel_error']:.2%} (target 2%).",
              "", f"Model `{SPEC.name}` ({SPEC.dtype}, {SPEC.attention} attention), {args.procs} CPU processes ({env['cpu']}), one thread each, pinned; link measured over gloo in {link.dtype} messages: "
              f"{link.bandwidth_gb_per_s:.2f} GB/s, {link.latency_us:.0f} us per transfer; all-reduce {link.allreduce_bandwidth_gb_per_s:.2f} GB/s, "
              f"{link.allreduce_latency_us:.0f} us per ring step between idle ranks, {link.tp_allreduce_bandwidth_gb_per_s:.2f} GB/s, "
              f"{link.tp_allreduce_latency_us:.0f} us inside the tensor-parallel layer, reduce-scatter "
              f"{link.reduce_scatter_bandwidth_gb_per_s:.2f} GB/s and all-gather {link.all_gather_bandwidth_gb_per_s:.2f} GB/s "
              f"per ring step (medians over rounds); {rounds_done} rounds{cut} of "
              f"(link; then per plan: profile its sizes and shares on {args.procs} cores at once, median of {args.reps}, run it "
              f"{args.steps} steps, first dropped, and profile it again). Measured and predicted: medians over rounds; error: median "
              "over rounds of the round's (predicted - measured) / measured, each round's prediction from that round's link and the "
              "mean of the two tables around the run; spread: (slowest - fastest round) / median; table drift: the largest change "
              "of a layer's profiled time from the table before the run to the one after it, over the rounds."]
    lines += wait_table(rows)
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    if final:
        print("\n".join(lines))


def wait_table(rows: list[dict]) -> list[str]:
    """Markdown: the waits at the gradient sync of the plans with replicas (``wait_analysis``)."""
    rows = [r for r in rows if r["sync_wait"] is not None]
    if not rows:
        return []
    out = ["", "Waits at the gradient sync (plans with replicas; ms per step, mean over kept steps):", "",
           "| plan | replica arrival ms (sd) | rank compute sd | sync per rank: wait + collective | wait per step (sd) | "
           "model wait (independent / with rho) | excess over slowest | model excess (run sigma) | median excess | model (IQR sigma) | cost model, eq. 19 (cv) |",
           "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        w = r["sync_wait"]
        a, mdl = w["replica_arrival_ms"], w["model"]
        arrivals = " / ".join(f"{m:.1f} ({s:.2f})" for m, s in zip(a["mean"], a["sd"]))
        compute = " / ".join("-" if v is None else f"{v:.2f}" for v in w["rank_compute_ms"]["sd"])
        ranks = " / ".join(f"{x:.1f}+{c:.1f}" for x, c in zip(w["rank_sync_ms"]["wait"], w["rank_sync_ms"]["collective"]))
        eq19 = f"{w['cost_model_ms']:.2f} ({w['replica_time_cv']:.1%})" if "cost_model_ms" in w else "-"
        out.append(f"| {r['plan']} | {arrivals} | {compute} | {ranks} | {w['wait_per_step_ms']['mean']:.2f} "
                   f"({w['wait_per_step_ms']['sd']:.2f}) | {mdl['wait_ms']:.2f} / {mdl['wait_ms_with_correlation']:.2f} "
                   f"(rho {a['correlation_01']:+.2f}) | "
                   f"{w['excess_over_slowest_mean_ms']:.2f} | "
                   f"{mdl['excess_ms']:.2f} | {w['excess_over_slowest_median_ms']:.2f} | {mdl['excess_ms_robust']:.2f} | {eq19} |")
    out += ["", "Replica arrival: its last rank's entry into the gradient sync, from the step's first span (one wall clock, "
            "`runtime.measure.trace`). Wait per step: last arrival minus the replicas' mean arrival; model: E[max] of independent "
            "normals (Clark) with each replica's measured mean and sd, minus their mean (sigma / sqrt(pi) for two equal "
            "replicas); with rho: the first two replicas' measured correlation (ranks that share a core arrive "
            "together). Excess: mean of the steps' last arrival minus the slowest replica's mean arrival, what the cost model "
            "(max of the replicas' pipelines) leaves out; median excess: the same with medians, against the model with each "
            "replica's median and interquartile sigma (robust to a loaded machine's stalls). Cost model: what eq. 19 adds to the "
            "slowest replica's predicted pipeline (the planner's and the evaluator's figure), with the cluster's replica_time_cv "
            "measured before the runs by `measure_links` (rounds of the whole model's forward and backward started together on "
            "both ranks; median over rounds)."]
    return out


if __name__ == "__main__":
    main()
