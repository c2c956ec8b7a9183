"""The independent plan evaluator: time and memory of a plan under the cost model, no solver involved."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from baton.cluster import ClusterSpec
from baton.costmodel import (ALLREDUCES_PER_LAYER, BLOCKS, activation_bytes, allreduce_ms, tp_allreduce_ms, edge_param_bytes,
                             in_flight_microbatches, layer_cost, model_flops_per_sample, optimizer_bytes,
                             optimizer_step_ms, p2p_ms)
from baton.errors import BatonError
from baton.model_spec import ModelSpec
from baton.operators import EMBEDDING, HEAD, layer_operators
from baton.pipeline import PipelineTiming, iteration_time_1f1b
from baton.plan import Plan, check_against_cluster
from baton.profile import Profile, ProfileSet


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceReport:
    """What one device does and holds."""

    id: str
    """Cluster device id."""
    gpu: str
    """Catalog GPU type."""
    pipeline: int
    """Data-parallel replica index."""
    stage: int
    """Pipeline stage index."""
    units: int
    """Tensor-parallel units held per layer."""
    share: float
    """units / units_per_layer."""
    recompute: list
    """Recomputed operators."""
    fwd_ms: float
    """Own forward compute per micro-batch (all its layers, embedding/head included)."""
    bwd_ms: float
    """Own backward compute per micro-batch, without recomputation."""
    recompute_ms: float
    """Own recomputation per micro-batch."""
    weights_bytes: float
    """Parameters held."""
    grads_bytes: float
    """Their gradients."""
    optimizer_bytes: float
    """Adam state (and fp32 master weights in mixed precision)."""
    activation_bytes: float
    """Activations of the in-flight micro-batches."""
    transient_bytes: float
    """Recomputation buffer of one layer."""
    reserve_bytes: float
    """Held back by the cluster spec."""
    peak_memory_bytes: float
    """Sum of the above."""
    capacity_bytes: float
    """Device memory."""
    fits: bool
    """peak_memory_bytes <= capacity_bytes."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StageReport:
    """One pipeline stage's per-micro-batch times."""

    pipeline: int
    """Replica index."""
    index: int
    """Stage index."""
    devices: list
    """Device ids in TP rank order."""
    first_layer: int
    """First layer held."""
    num_layers: int
    """Layers held."""
    fwd_ms: float
    """F_s: forward of one micro-batch, TP waits and all-reduces included."""
    bwd_ms: float
    """B_s: backward of one micro-batch, recomputation included."""
    allreduce_ms: float
    """TP all-reduce time inside F_s + B_s."""
    send_fwd_ms: float
    """Activation transfer to the next stage (0 for the last)."""
    send_bwd_ms: float
    """Gradient transfer from the next stage (0 for the last)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanReport:
    """Everything the evaluator predicts for a plan."""

    iteration_time_ms: float
    """Pipeline time + embedding sync + data-parallel sync + optimizer step."""
    pipeline_ms: float
    """Exact 1F1B time of the slowest replica."""
    embedding_sync_ms: float
    """Tied-embedding gradient all-reduce between first and last stage."""
    dp_sync_ms: float
    """Gradient all-reduce across data-parallel replicas."""
    optimizer_ms: float
    """Slowest device's Adam step."""
    tokens_per_s: float
    """global batch * seq_len / iteration time."""
    mfu: float
    """Model FLOPs per second / sum of the catalog peaks of the devices used."""
    ideal_tokens_per_s: float
    """Additive bound: every device training alone at its profiled speed, no recompute, no bubble."""
    efficiency_vs_ideal: float
    """tokens_per_s / ideal_tokens_per_s."""
    global_batch: int
    """Samples per iteration."""
    fits: bool
    """Every device within capacity."""
    stages: list
    """StageReport per stage of every replica."""
    devices: list
    """DeviceReport per device."""

    def to_dict(self) -> dict:
        return asdict(self)

    def over_capacity(self) -> list[DeviceReport]:
        return [d for d in self.devices if not d.fits]


def _max(values):
    return max(values) if values else 0.0


def evaluate(plan: Plan, cluster: ClusterSpec, profiles: ProfileSet, *, plan_source: str = "<plan>") -> PlanReport:
    """Predict iteration time and per-device memory of ``plan`` on ``cluster`` (docs/cost-model.md)."""
    check_against_cluster(plan, cluster, source=plan_source)
    spec = plan.model
    mb, m = plan.micro_batch_size, plan.num_microbatches
    act = activation_bytes(spec, mb)
    stage_reports: list[StageReport] = []
    device_reports: list[DeviceReport] = []
    pipeline_times = []
    for pi, pipe in enumerate(plan.pipelines):
        p = len(pipe.stages)
        fwd, bwd, sf, sb = [], [], [], []
        for si, stage in enumerate(pipe.stages):
            first, last = si == 0, si == p - 1
            ids = stage.device_ids
            n = len(ids)
            ar = tp_allreduce_ms(act, n, cluster.slowest_link(ids)) * ALLREDUCES_PER_LAYER
            per_dev = []
            for d in stage.devices:
                dev = cluster.device(d.id)
                prof = profiles[dev.gpu.name]
                share = d.units / stage.units_per_layer
                lc = layer_cost(prof, spec, mb, share, frozenset(d.recompute))
                edge_f = (prof.cost(EMBEDDING, mb).fwd_ms if first else 0.0) + (prof.cost(HEAD, mb).fwd_ms if last else 0.0)
                edge_b = (prof.cost(EMBEDDING, mb).bwd_ms if first else 0.0) + (prof.cost(HEAD, mb).bwd_ms if last else 0.0)
                edge_saved = (prof.cost(EMBEDDING, mb).saved_bytes if first else 0.0) + (prof.cost(HEAD, mb).saved_bytes if last else 0.0)
                per_dev.append((d, dev, prof, share, lc, edge_f, edge_b, edge_saved))
            L = stage.num_layers
            f_layer = sum(_max([x[4].fwd_ms[b] for x in per_dev]) for b in BLOCKS)
            b_layer = sum(_max([x[4].bwd_ms[b] + x[4].recompute_ms[b] for x in per_dev]) for b in BLOCKS)
            F = L * (f_layer + (ar if L else 0.0)) + _max([x[5] for x in per_dev])
            B = L * (b_layer + (ar if L else 0.0)) + _max([x[6] for x in per_dev])
            fwd.append(F)
            bwd.append(B)
            if not last:
                nxt = pipe.stages[si + 1].device_ids
                sf.append(p2p_ms(cluster, ids, nxt, act))
                sb.append(p2p_ms(cluster, nxt, ids, act))
            stage_reports.append(StageReport(
                pipeline=pi, index=si, devices=ids, first_layer=stage.first_layer, num_layers=L, fwd_ms=F, bwd_ms=B,
                allreduce_ms=2 * L * ar, send_fwd_ms=sf[-1] if not last else 0.0, send_bwd_ms=sb[-1] if not last else 0.0))
            inflight = in_flight_microbatches(si, p, m)
            for d, dev, prof, share, lc, edge_f, edge_b, edge_saved in per_dev:
                weights = L * lc.param_bytes + edge_param_bytes(prof, spec, mb, first=first, last=last)
                activ = inflight * (L * lc.held_bytes + edge_saved)
                transient = lc.transient_bytes if L else 0.0
                peak = 2 * weights + optimizer_bytes(weights, spec) + activ + transient + dev.reserve_bytes
                device_reports.append(DeviceReport(
                    id=d.id, gpu=dev.gpu.name, pipeline=pi, stage=si, units=d.units, share=share,
                    recompute=list(d.recompute),
                    fwd_ms=L * sum(lc.fwd_ms.values()) + edge_f, bwd_ms=L * sum(lc.bwd_ms.values()) + edge_b,
                    recompute_ms=L * sum(lc.recompute_ms.values()),
                    weights_bytes=weights, grads_bytes=weights, optimizer_bytes=optimizer_bytes(weights, spec),
                    activation_bytes=activ, transient_bytes=transient, reserve_bytes=float(dev.reserve_bytes),
                    peak_memory_bytes=peak, capacity_bytes=float(dev.memory_bytes), fits=peak <= dev.memory_bytes))
        timing = PipelineTiming(fwd_ms=tuple(fwd), bwd_ms=tuple(bwd), send_fwd_ms=tuple(sf), send_bwd_ms=tuple(sb))
        pipeline_times.append(iteration_time_1f1b(timing, m))

    emb_sync = 0.0
    if plan.num_stages > 1:
        tied = spec.vocab_size * spec.hidden_dim * spec.dtype_bytes
        emb_sync = max(
            allreduce_ms(tied, len(pipe.stages[0].devices) + len(pipe.stages[-1].devices),
                         cluster.slowest_link(pipe.stages[0].device_ids + pipe.stages[-1].device_ids))
            for pipe in plan.pipelines)
    dp_sync = 0.0
    if len(plan.pipelines) > 1:
        by_position: dict[tuple[int, int], list[DeviceReport]] = {}
        for pi, pipe in enumerate(plan.pipelines):
            for si, stage in enumerate(pipe.stages):
                for k, d in enumerate(stage.devices):
                    rep = next(r for r in device_reports if r.id == d.id)
                    by_position.setdefault((si, k), []).append(rep)
        dp_sync = max(allreduce_ms(peers[0].grads_bytes, len(peers), cluster.slowest_link([r.id for r in peers]))
                      for peers in by_position.values())
    opt = max(optimizer_step_ms(r.weights_bytes, spec, cluster.device(r.id).gpu.memory_bandwidth_gb_per_s,
                                profiles[r.gpu].optimizer_sample()) for r in device_reports)
    total = max(pipeline_times) + emb_sync + dp_sync + opt

    tokens = plan.global_batch * spec.seq_len
    tokens_per_s = tokens / (total / 1e3)
    used = [cluster.device(i) for i in plan.device_ids()]
    peak_flops = sum(d.gpu.peak_tflops(spec.dtype) for d in used) * 1e12
    mfu = plan.global_batch * model_flops_per_sample(spec) / (total / 1e3) / peak_flops
    ideal = ideal_tokens_per_s(spec, [d.gpu.name for d in used], profiles, mb)
    return PlanReport(
        iteration_time_ms=total, pipeline_ms=max(pipeline_times), embedding_sync_ms=emb_sync, dp_sync_ms=dp_sync,
        optimizer_ms=opt, tokens_per_s=tokens_per_s, mfu=mfu, ideal_tokens_per_s=ideal,
        efficiency_vs_ideal=tokens_per_s / ideal, global_batch=plan.global_batch,
        fits=all(r.fits for r in device_reports), stages=stage_reports, devices=device_reports)


def single_device_ms(spec: ModelSpec, profile: Profile, micro_batch: int) -> float:
    """One micro-batch of the whole model on one device: all units, no recompute, no communication."""
    per_layer = sum(profile.cost(o.name, micro_batch, 1.0).fwd_ms + profile.cost(o.name, micro_batch, 1.0).bwd_ms
                    for o in layer_operators(spec))
    edges = sum(profile.cost(n, micro_batch).fwd_ms + profile.cost(n, micro_batch).bwd_ms for n in (EMBEDDING, HEAD))
    return spec.num_layers * per_layer + edges


def ideal_tokens_per_s(spec: ModelSpec, gpus: list[str], profiles: ProfileSet, micro_batch: int) -> float:
    """Eq. 12: the HetHub additive bound generalised: sum over devices of their solo throughput."""
    tokens = micro_batch * spec.seq_len
    return sum(tokens / (single_device_ms(spec, profiles[g], micro_batch) / 1e3) for g in gpus)


def explain_over_capacity(report: PlanReport) -> str:
    """One line naming the devices that run out of memory and by how much."""
    gib = 1024**3
    parts = [f"{d.id} ({d.gpu}) needs {d.peak_memory_bytes / gib:.2f} GiB of {d.capacity_bytes / gib:.2f} GiB "
             f"(over by {(d.peak_memory_bytes - d.capacity_bytes) / gib:.2f} GiB)" for d in report.over_capacity()]
    return "; ".join(parts)


def require_fits(report: PlanReport, *, source: str) -> None:
    if not report.fits:
        raise BatonError("plan does not fit in memory: " + explain_over_capacity(report), source=source, field="pipelines")
