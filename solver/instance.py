"""One candidate of the outer search: a micro-batch size and a skeleton (replicas of ordered TP groups),
turned into the constants and per-device choices the inner MILP needs.

Everything that depends only on the skeleton (all-reduce and p2p times, embedding/head times, the tied
embedding sync, the in-flight count of each stage) is a constant here, computed with the same functions
``baton.evaluate`` uses.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from baton.cluster import ClusterSpec
from baton.costmodel import (data_parallel_sync_line, device_slot, edge_cost, embedding_sync_ms, layer_limits,
                             pipeline_transfers, stage_constants)
from baton.memory import RecomputeSpace
from baton.model_spec import ModelSpec
from baton.profile import ProfileSet

from solver.options import Choice, device_choices, valid_unit_counts
from solver.space import Skeleton

GB = 1e9


@dataclass(kw_only=True)
class Group:
    """Devices of one stage of one replica that take one decision together.

    Normally one device (one TP rank). For a stage of identical devices (same GPU, memory, reserve) whose
    profile grows with the share, all ranks take the equal share and one common recompute set: given any
    plan for such a stage, giving every device the share 1/n and the recompute set of the device with the
    largest share is no slower per block and needs no more memory on any device (proof in
    solver/README.md), so the reduction keeps the optimum.
    """

    ids: list[str]
    rank: int | None
    """TP rank position (None for a tied group)."""
    choices: dict
    """(U, u) -> list[Choice]."""
    slots: list
    """DeviceSlot of each device of the group (position, memory, eq. 10's optimizer slope)."""

    @property
    def opt_ms_per_gb(self) -> list[float]:
        """Adam step ms per GB of weights for each device of the group (eq. 10)."""
        return [s.optimizer_ms_per_byte * GB for s in self.slots]


@dataclass(kw_only=True)
class StageData:
    replica: int
    index: int
    ids: list[str]
    allreduce_ms: float
    """TP all-reduce ms per layer per direction (both all-reduces, eq. 5)."""
    edge_fwd_comm_ms: float
    """All-reduces of the vocabulary-parallel embedding/loss in the forward (StageConstants)."""
    edge_bwd_comm_ms: float
    """The head's input-gradient all-reduce in the backward."""
    send_fwd_ms: float
    """Activation transfer to the next stage (eq. 6); 0 for the last."""
    send_bwd_ms: float
    groups: list
    tied: bool


@dataclass(kw_only=True)
class Instance:
    """Everything the inner MILP needs for one (micro-batch, skeleton)."""

    spec: ModelSpec
    skeleton: Skeleton
    micro_batch: int
    num_microbatches: int
    stages: list
    """stages[replica][s] -> StageData for the replicas that are modelled."""
    modelled_replicas: int
    """1 when all replicas are interchangeable (the others copy replica 0's choices), else all."""
    share_options: list
    """share_options[s] -> list of (U, u) allowed at stage s (shared by all replicas, eq. 2)."""
    unit_counts: list
    """unit_counts[s] -> list of U allowed at stage s."""
    min_layers: list
    max_layers: list
    embedding_sync_ms: float
    dp_ms_per_gb: list
    """dp_ms_per_gb[s][k] = (alpha, beta): all-reduce of replica 0's rank-k weights across replicas is
    alpha * GB + beta ms (eq. 5, 11)."""
    infeasible_reason: str | None = None
    notes: list = field(default_factory=list)


def _device_signature(cluster: ClusterSpec, i: str):
    d = cluster.device(i)
    return (d.gpu.name, d.memory_bytes, d.reserve_bytes)


def build_instance(spec: ModelSpec, cluster: ClusterSpec, profiles: ProfileSet, skeleton: Skeleton, micro_batch: int,
                   global_batch: int, space: RecomputeSpace, *, monotone: dict, prune: bool = True,
                   reduce_symmetry: bool = True, allowed=None) -> Instance:
    """Constants and choices for one candidate. ``allowed`` optionally restricts choices (baselines)."""
    r, p, N = skeleton.num_replicas, skeleton.num_stages, spec.num_layers
    m = global_batch // (micro_batch * r)
    units_all = valid_unit_counts(spec)
    if p > N + 2:
        return _infeasible(spec, skeleton, micro_batch, m, "more stages than layers")
    min_layers, max_layers = layer_limits(N, p)
    if sum(min_layers) > N:
        return _infeasible(spec, skeleton, micro_batch, m, "more stages than layers")

    def slots_of(pipe, s):
        return [device_slot(cluster, profiles, spec, micro_batch, i, stage=s, num_stages=p, num_microbatches=m) for i in pipe[s]]

    # Share options per stage position; a stage is "tied" when it is homogeneous in every replica.
    share_options, unit_counts, tied = [], [], []
    for s in range(p):
        n = len(skeleton.pipelines[0][s])
        sigs = {_device_signature(cluster, i) for pipe in skeleton.pipelines for i in pipe[s]}
        homog = len(sigs) == 1 and monotone[next(iter(sigs))[0]] and reduce_symmetry
        Us = [U for U in units_all if U >= n]
        if allowed is not None and allowed.get("uniform_tp"):
            Us = [U for U in Us if U % n == 0]
        if not Us:
            return _infeasible(spec, skeleton, micro_batch, m, f"stage {s} has {n} devices but no unit count U >= {n} divides the heads")
        equal = [U for U in Us if U % n == 0]
        if (homog and equal) or (allowed is not None and allowed.get("uniform_tp")):
            if not equal:
                return _infeasible(spec, skeleton, micro_batch, m, f"stage {s}: no equal split of {n} devices")
            U0 = equal[0]
            share_options.append([(U0, U0 // n)])
            unit_counts.append([U0])
            tied.append(homog and bool(equal))
        else:
            share_options.append([(U, u) for U in Us for u in range(1, U - n + 2)])
            unit_counts.append(Us)
            tied.append(False)

    # Replicas are interchangeable when every stage matches device for device and link for link.
    def replica_signature(pipe):
        return tuple((tuple(_device_signature(cluster, i) for i in ids), cluster.slowest_link(list(ids)),
                      pipeline_transfers(cluster, spec, micro_batch, ids, pipe[s + 1] if s + 1 < p else None))
                     for s, ids in enumerate(pipe))
    same = reduce_symmetry and len({replica_signature(pipe) for pipe in skeleton.pipelines}) == 1
    modelled = 1 if same else r

    stages = []
    for rho in range(modelled):
        pipe = skeleton.pipelines[rho]
        row = []
        for s, ids in enumerate(pipe):
            ids = list(ids)
            slots = slots_of(pipe, s)
            const = stage_constants(cluster, spec, micro_batch, ids, first=s == 0, last=s == p - 1)
            sf, sb = pipeline_transfers(cluster, spec, micro_batch, ids, pipe[s + 1] if s + 1 < p else None)
            members = [list(range(len(ids)))] if tied[s] else [[k] for k in range(len(ids))]
            groups = []
            for k, member in enumerate(members):
                slot = slots[member[0]]
                choices = {}
                for (U, u) in share_options[s]:
                    found = device_choices(slot, spec, micro_batch, u / U, space, min_layers=min_layers[s],
                                           cap=max_layers[s], prune=prune)
                    if allowed is not None and allowed.get("recompute") is not None:
                        found = [f for f in found if f[0] in allowed["recompute"]]
                    edge = edge_cost(slot, spec, micro_batch, u / U)
                    lst = [Choice(units=u, units_per_layer=U, recompute=rset, fwd=lc.block_fwd_ms(), bwd=lc.block_bwd_ms(),
                                  max_layers=L, param_bytes=lc.param_bytes, edge_fwd_ms=edge.fwd_ms, edge_bwd_ms=edge.bwd_ms,
                                  edge_param_bytes=edge.param_bytes) for rset, lc, L in found]
                    if lst:
                        choices[(U, u)] = lst
                groups.append(Group(ids=[ids[j] for j in member], rank=None if tied[s] else k, choices=choices,
                                    slots=[slots[j] for j in member]))
            if any(not g.choices for g in groups):
                bad = next(g for g in groups if not g.choices)
                return _infeasible(spec, skeleton, micro_batch, m, f"device {bad.ids[0]} cannot hold stage {s} under any share and recompute set")
            row.append(StageData(replica=rho, index=s, ids=ids, allreduce_ms=const.allreduce_ms,
                                 edge_fwd_comm_ms=const.edge_fwd_comm_ms, edge_bwd_comm_ms=const.edge_bwd_comm_ms, send_fwd_ms=sf, send_bwd_ms=sb, groups=groups, tied=tied[s]))
        stages.append(row)

    emb = embedding_sync_ms(cluster, spec, skeleton.pipelines)
    dp = []
    for s in range(p):
        row = []
        for k in range(len(skeleton.pipelines[0][s])):
            if r == 1:
                row.append((0.0, 0.0))
                continue
            per_byte, fixed = data_parallel_sync_line(cluster, [pipe[s][k] for pipe in skeleton.pipelines])
            row.append((per_byte * GB, fixed))
        dp.append(row)
    return Instance(spec=spec, skeleton=skeleton, micro_batch=micro_batch, num_microbatches=m, stages=stages,
                    modelled_replicas=modelled, share_options=share_options, unit_counts=unit_counts,
                    min_layers=min_layers, max_layers=max_layers, embedding_sync_ms=emb, dp_ms_per_gb=dp)


def _infeasible(spec, skeleton, micro_batch, m, reason) -> Instance:
    return Instance(spec=spec, skeleton=skeleton, micro_batch=micro_batch, num_microbatches=m, stages=[], modelled_replicas=0,
                    share_options=[], unit_counts=[], min_layers=[], max_layers=[], embedding_sync_ms=0.0,
                    dp_ms_per_gb=[], infeasible_reason=reason)
