"""The independent plan evaluator: time and memory of a plan under the cost model, no solver involved."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from baton.cluster import ClusterSpec
from baton.costmodel import (device_memory, device_optimizer_ms, device_slot, edge_cost, embedding_sync_ms, group_passes,
                             host_activation_bytes, host_optimizer_bytes, interleaved_timing, layer_cost, layer_train_ms, layered_iteration_of,
                             layered_parts, model_flops_per_s, peak_flops, scheduled_activation_bytes, stage_constants,
                             sync_terms)
from baton.errors import BatonError
from baton.model_spec import ModelSpec
from baton.operators import EMBEDDING, HEAD
from baton.pipeline import iteration_time
from baton.plan import Plan, check_against_cluster
from baton.schedules import interleaved_one_f_one_b
from baton.profile import Profile, ProfileSet
from baton.waits import last_arrival_ms


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
    """Parameters kept (stage 3: the owned shards of its layers, the edges and one gathered layer, eq. 18)."""
    grads_bytes: float
    """Their gradients (stages 2 and 3: the owned shards, the edges' and one layer's whole, eq. 18)."""
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
    optimizer_ms: float
    """Its Adam step (eq. 10) over the weights it owns."""
    owned_fraction: float
    """Share of its weights whose optimizer state it keeps (1 unless the state is sharded, eq. 14)."""
    sync_buffer_bytes: float
    """Staging of its largest group's sharded sync (eq. 14), alive only after the backward pass; at stages 2
    and 3 of its largest unit group's (eq. 18), alive beside the activations."""
    micro_batch_size: int
    """Its replica's micro-batch size."""
    offload: list = field(default_factory=list)
    """Tensors of its layers it keeps in host memory between the passes."""
    host_activation_bytes: float = 0.0
    """Activations it keeps in host memory at its peak: in-flight micro-batches x its layers x offloaded bytes per
    layer (eq. 8o); pinned buffers on its node."""
    offload_ms: float = 0.0
    """What its copies to and from host memory add to its forward and backward per micro-batch, beyond the compute
    they overlap (eq. 2o)."""
    offload_optimizer: bool = False
    """Its optimizer state lives in host memory and its Adam step runs there (eq. 7h, 10h)."""
    host_optimizer_bytes: float = 0.0
    """What that puts in its node's host memory (eq. 7h): fp32 master and moments of its owned weights, and the
    buffer its gradients land in."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StageReport:
    """One pipeline stage's per-micro-batch times."""

    pipeline: int
    """Replica index."""
    index: int
    """Stage index (an interleaved replica's virtual stage; it runs on stage ``index mod p``'s devices)."""
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
    """Activation transfer to the next stage (0 for the last; interleaved, the last group's goes to the first)."""
    send_bwd_ms: float
    """Gradient transfer from the next stage (0 for the last)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanReport:
    """Everything the evaluator predicts for a plan."""

    iteration_time_ms: float
    """Pipeline time + embedding sync + data-parallel sync + optimizer step."""
    pipeline_ms: float
    """When the last replica reaches the gradient sync (eq. 19 over the replicas' exact pipeline times: the
    slowest one's, plus what noise in the others' adds); at stages 2 and 3 (eq. 17) the compute of the
    iteration's chain, each segment at its last replica, so a replica's waits at the collectives are in it."""
    replica_pipeline_ms: list
    """Exact time of every replica's schedule (1F1B, or interleaved: docs/schedules.md), with its own micro-batch
    size and count (stages 2 and 3: its own compute, no waits)."""
    replica_samples: list
    """Samples each replica trains on per iteration (they add up to global_batch)."""
    embedding_sync_ms: float
    """Tied-embedding gradient all-reduce between first and last stage."""
    arrival_wait_ms: float
    """The part of ``pipeline_ms`` that noise in the replicas' times adds over their predicted maxima (eq. 19;
    0 for one replica or a cluster without ``replica_time_cv``)."""
    dp_sync_ms: float
    """Gradient sync across data-parallel replicas: the peer groups' collectives in order (eq. 13, 15); at
    stages 2 and 3 every unit's reduce-scatters and all-gathers (eq. 16, 17)."""
    zero_stage: int
    """Sharding stage of the training state (0 replicated, 1 optimizer state, 2 and gradients, 3 and weights)."""
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
    """Every device within capacity, and every node's host memory (eq. 8o)."""
    stages: list
    """StageReport per stage of every replica (an interleaved replica: per virtual stage)."""
    devices: list
    """DeviceReport per device."""
    host_memory: list = field(default_factory=list)
    """HostMemory of every node whose devices offload activations."""

    def to_dict(self) -> dict:
        return asdict(self)

    def over_capacity(self) -> list[DeviceReport]:
        return [d for d in self.devices if not d.fits]

    def over_host_capacity(self) -> list["HostMemory"]:
        return [h for h in self.host_memory if not h.fits]


@dataclass(frozen=True, kw_only=True, slots=True)
class HostMemory:
    """One node's host memory holding its devices' offloaded activations and optimizer state (eq. 8o, 7h)."""

    node: str
    """Cluster node name."""
    activation_bytes: float
    """The sum of its devices' ``host_activation_bytes``."""
    optimizer_bytes: float = 0.0
    """The sum of its devices' ``host_optimizer_bytes`` (eq. 7h)."""
    capacity_bytes: float | None
    """The cluster file's ``host_memory_gib`` of the node; None: not stated, not limited."""
    fits: bool
    """activation_bytes + optimizer_bytes <= capacity_bytes (True without a capacity)."""


def evaluate(plan: Plan, cluster: ClusterSpec, profiles: ProfileSet, *, plan_source: str = "<plan>") -> PlanReport:
    """Predict iteration time and per-device memory of ``plan`` on ``cluster`` (docs/cost-model.md).

    It assembles the plan from ``baton.costmodel``'s functions, the same ones the planner reads, and
    shares no code with the planner beyond them.
    """
    check_against_cluster(plan, cluster, source=plan_source)
    spec = plan.model
    layered = plan.zero_stage >= 2
    sync = sync_terms(cluster, plan)
    parts = []
    stage_reports: list[StageReport] = []
    device_reports: list[DeviceReport] = []
    pipeline_times = []
    for pi, pipe in enumerate(plan.pipelines):
        p = len(pipe.device_stages)  # device groups: the stages, or interleaved the first p of the p v virtual stages
        mb, m = plan.batch(pi)
        schedule = interleaved_one_f_one_b(p, pipe.chunks, m)
        layers = [st.num_layers for st in pipe.stages]
        groups = []
        for si, stage in enumerate(pipe.device_stages):
            ids = stage.device_ids
            slots = [device_slot(cluster, profiles, spec, mb, i, stage=si, num_stages=p, num_microbatches=m, layered=layered)
                     for i in ids]
            const = stage_constants(cluster, spec, mb, ids, first=si == 0, last=si == p - 1)
            shares = [d.units / stage.units_per_layer for d in stage.devices]
            costs = [layer_cost(slot.profile, spec, mb, r, frozenset(d.recompute), frozenset(d.offload),
                                cluster.device(d.id).host_link_gb_per_s) for slot, d, r in zip(slots, stage.devices, shares)]
            edges = [edge_cost(slot, spec, mb, r) for slot, r in zip(slots, shares)]
            L = sum(layers[si::p])  # every chunk of the group
            if layered:
                parts.append((m, layered_parts(cluster, spec, mb, ids, [sl.profile for sl in slots], shares, costs)))
            nxt = pipe.stages[(si + 1) % p].device_ids if si + 1 < p or pipe.chunks > 1 else None
            groups.append(group_passes(cluster, spec, mb, ids, costs, edges, const, nxt))
            for d, slot, lc, edge in zip(stage.devices, slots, costs, edges):
                own = sync.owned_fraction[d.id]
                activations = None if pipe.chunks == 1 else scheduled_activation_bytes(schedule, si, layers, lc.held_bytes, edge)
                mem = device_memory(slot, spec, L, param_bytes=lc.param_bytes, held_bytes=lc.held_bytes,
                                    transient_bytes=lc.transient_bytes, edge=edge, owned_fraction=own,
                                    sync_buffer_bytes=sync.buffer_bytes[d.id], zero_stage=plan.zero_stage,
                                    owned_layer_fraction=sync.owned_layer_fraction.get(d.id), activation_bytes=activations,
                                    offload_optimizer=d.offload_optimizer)
                dev = cluster.device(d.id)
                host = host_activation_bytes(slot, L, lc.host_bytes, schedule=None if pipe.chunks == 1 else schedule,
                                             group=si, layers=layers)
                device_reports.append(DeviceReport(
                    id=d.id, gpu=dev.gpu.name, pipeline=pi, stage=si, units=d.units, share=d.units / stage.units_per_layer,
                    recompute=list(d.recompute),
                    fwd_ms=L * sum(lc.fwd_ms.values()) + edge.fwd_ms, bwd_ms=L * sum(lc.bwd_ms.values()) + edge.bwd_ms,
                    recompute_ms=L * sum(lc.recompute_ms.values()),
                    weights_bytes=float(mem.weights_bytes), grads_bytes=float(mem.grads_bytes),
                    optimizer_bytes=float(mem.optimizer_bytes), activation_bytes=float(mem.activation_bytes),
                    transient_bytes=float(mem.transient_bytes), reserve_bytes=float(mem.reserve_bytes),
                    peak_memory_bytes=float(mem.peak_bytes), capacity_bytes=float(slot.memory_bytes),
                    fits=bool(mem.peak_bytes <= slot.memory_bytes),
                    optimizer_ms=float(device_optimizer_ms(slot, mem.held_weights_bytes, own, d.offload_optimizer)),
                    owned_fraction=own, offload_optimizer=d.offload_optimizer,
                    host_optimizer_bytes=float(host_optimizer_bytes(mem.held_weights_bytes * own, spec)) * d.offload_optimizer,
                    sync_buffer_bytes=sync.buffer_bytes[d.id], micro_batch_size=mb, offload=list(d.offload),
                    host_activation_bytes=float(host),
                    offload_ms=L * (sum(lc.offload_fwd_ms.values()) + sum(lc.offload_bwd_ms.values()))))
        timing = interleaved_timing(groups, layers)
        last = len(layers) - 1
        for k, stage in enumerate(pipe.stages):
            stage_reports.append(StageReport(
                pipeline=pi, index=k, devices=stage.device_ids, first_layer=stage.first_layer, num_layers=stage.num_layers,
                fwd_ms=timing.fwd_ms[k], bwd_ms=timing.bwd_ms[k], allreduce_ms=2 * stage.num_layers * groups[k % p].allreduce_ms,
                send_fwd_ms=timing.send_fwd_ms[k] if k < last else 0.0, send_bwd_ms=timing.send_bwd_ms[k] if k < last else 0.0))
        pipeline_times.append(iteration_time(schedule, timing))

    emb_sync = embedding_sync_ms(cluster, spec, [[s.device_ids for s in pipe.stages] for pipe in plan.pipelines])
    opt = max(r.optimizer_ms for r in device_reports)
    if not layered:
        dp_sync = sync.dp_sync_ms
        pipe_ms = last_arrival_ms(pipeline_times, cluster.replica_time_cv)
        total = pipe_ms + emb_sync + dp_sync + opt
        wait = pipe_ms - max(pipeline_times)
    else:  # eq. 17: replicas wait for each other at every unit's collective
        it = layered_iteration_of(sync, plan.zero_stage, spec.num_layers, parts, opt, cluster.replica_time_cv)
        total, dp_sync, wait = it.iteration_ms, it.collectives_ms, it.noise_wait_ms
        pipeline_times = list(it.replica_compute_ms)
        pipe_ms = total - dp_sync - opt - emb_sync  # the slowest replica's compute and its waits

    tokens = plan.global_batch * spec.seq_len
    tokens_per_s = tokens / (total / 1e3)
    used = [cluster.device(i) for i in plan.device_ids()]
    mfu = model_flops_per_s(spec, plan.global_batch, total) / peak_flops([d.gpu for d in used], spec)
    # Eq. 12 with every device at its own replica's micro-batch size (replicas may differ).
    ideal = 0.0
    for r, pipe in enumerate(plan.pipelines):
        gpus = [cluster.device(d).gpu.name for st in pipe.device_stages for d in st.device_ids]
        ideal += ideal_tokens_per_s(spec, gpus, profiles, plan.batch(r)[0])
    hosts = host_memory_of(cluster, device_reports)
    return PlanReport(
        iteration_time_ms=total, pipeline_ms=pipe_ms, replica_pipeline_ms=pipeline_times,
        replica_samples=[plan.samples(i) for i in range(len(plan.pipelines))],
        embedding_sync_ms=emb_sync, arrival_wait_ms=wait, dp_sync_ms=dp_sync, zero_stage=plan.zero_stage,
        optimizer_ms=opt, tokens_per_s=tokens_per_s, mfu=mfu, ideal_tokens_per_s=ideal,
        efficiency_vs_ideal=tokens_per_s / ideal, global_batch=plan.global_batch,
        fits=all(r.fits for r in device_reports) and all(h.fits for h in hosts), stages=stage_reports, devices=device_reports,
        host_memory=hosts)


def host_memory_of(cluster: ClusterSpec, devices: list[DeviceReport]) -> list[HostMemory]:
    """Eq. 8o per node: its devices' offloaded activations and optimizer state against its host memory."""
    used: dict[str, list[float]] = {}
    for d in devices:
        if d.host_activation_bytes or d.host_optimizer_bytes:
            row = used.setdefault(cluster.device(d.id).node, [0.0, 0.0])
            row[0] += d.host_activation_bytes
            row[1] += d.host_optimizer_bytes
    out = []
    for node, (activations, optimizer) in used.items():
        cap = cluster.host_memory.get(node)
        out.append(HostMemory(node=node, activation_bytes=activations, optimizer_bytes=optimizer,
                              capacity_bytes=None if cap is None else float(cap),
                              fits=cap is None or activations + optimizer <= cap))
    return out


def single_device_ms(spec: ModelSpec, profile: Profile, micro_batch: int) -> float:
    """One micro-batch of the whole model on one device: all units, no recompute, no communication."""
    emb, head = profile.cost(EMBEDDING, micro_batch), profile.cost(HEAD, micro_batch)
    edges = emb.fwd_ms + emb.bwd_ms + head.fwd_ms + head.bwd_ms
    return spec.num_layers * layer_train_ms(profile, spec, micro_batch, 1.0) + edges


def ideal_tokens_per_s(spec: ModelSpec, gpus: list[str], profiles: ProfileSet, micro_batch: int) -> float:
    """Eq. 12: the HetHub additive bound generalised: sum over devices of their solo throughput."""
    tokens = micro_batch * spec.seq_len
    return sum(tokens / (single_device_ms(spec, profiles[g], micro_batch) / 1e3) for g in gpus)


def explain_over_capacity(report: PlanReport) -> str:
    """One line naming the devices that run out of memory and by how much."""
    gib = 1024**3
    parts = [f"{d.id} ({d.gpu}) needs {d.peak_memory_bytes / gib:.2f} GiB of {d.capacity_bytes / gib:.2f} GiB "
             f"(over by {(d.peak_memory_bytes - d.capacity_bytes) / gib:.2f} GiB)" for d in report.over_capacity()]
    parts += [f"node {h.node}'s host memory holds {(h.activation_bytes + h.optimizer_bytes) / gib:.2f} GiB of offloaded "
              f"activations and optimizer state, more than its {h.capacity_bytes / gib:.2f} GiB" for h in report.over_host_capacity()]
    return "; ".join(parts)


def require_fits(report: PlanReport, *, source: str) -> None:
    if not report.fits:
        raise BatonError("plan does not fit in memory: " + explain_over_capacity(report), source=source, field="pipelines")
