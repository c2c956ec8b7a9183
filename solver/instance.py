"""One candidate of the outer search: a micro-batch size and a skeleton (replicas of ordered TP groups),
turned into the constants and per-device choices the inner MILP needs.

Everything that depends only on the skeleton (all-reduce and p2p times, embedding/head times, the tied
embedding sync, the in-flight count of each stage) is a constant here, computed with the same functions
``baton.evaluate`` uses.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from baton.cluster import ClusterSpec
from baton.costmodel import (ALLREDUCES_PER_LAYER, activation_bytes, allreduce_ms, tp_allreduce_ms, in_flight_microbatches,
                             optimizer_step_ms, p2p_ms)
from baton.profile import ProfileSet
from baton.model_spec import ModelSpec
from baton.operators import EMBEDDING, HEAD

from solver.options import Choice, RecomputeSpace, Slot, block_times, device_choices, valid_unit_counts

GB = 1e9


@dataclass(frozen=True, kw_only=True, slots=True)
class Skeleton:
    """Device layout without numbers: replicas, each a list of stages, each a TP group in rank order."""

    pipelines: tuple[tuple[tuple[str, ...], ...], ...]

    @property
    def num_replicas(self) -> int:
        return len(self.pipelines)

    @property
    def num_stages(self) -> int:
        return len(self.pipelines[0])

    def device_ids(self) -> list[str]:
        return [d for p in self.pipelines for s in p for d in s]

    def describe(self) -> str:
        return " | ".join(" -> ".join("[" + ",".join(s) + "]" for s in p) for p in self.pipelines)


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
    edge_param_gb: float
    """Embedding / head parameters this device holds (GB)."""
    opt_ms_per_gb: list
    """Adam step ms per GB of weights for each device of the group (eq. 10)."""


@dataclass(kw_only=True)
class StageData:
    replica: int
    index: int
    ids: list[str]
    allreduce_ms: float
    """TP all-reduce ms per layer per direction (both all-reduces, eq. 5)."""
    edge_fwd_ms: float
    """Slowest device's embedding/head forward (eq. 9)."""
    edge_bwd_ms: float
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
    """dp_ms_per_gb[s][k] = (alpha, beta): all-reduce of replica 0's rank-k weights across replicas (eq. 5)."""
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
    act = activation_bytes(spec, micro_batch)
    units_all = valid_unit_counts(spec)
    min_layers = [N] if p == 1 else [0] + [1] * (p - 2) + [0]
    max_layers = [N - (sum(min_layers) - min_layers[s]) for s in range(p)]
    if p > N + 2 or sum(min_layers) > N:
        return _infeasible(spec, skeleton, micro_batch, m, "more stages than layers")

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
        sig = []
        for s, ids in enumerate(pipe):
            link = cluster.slowest_link(list(ids))
            nxt = pipe[s + 1] if s + 1 < p else None
            sig.append((tuple(_device_signature(cluster, i) for i in ids),
                        link,
                        p2p_ms(cluster, list(ids), list(nxt), act) if nxt else 0.0,
                        p2p_ms(cluster, list(nxt), list(ids), act) if nxt else 0.0))
        return tuple(sig)
    same = reduce_symmetry and len({replica_signature(pipe) for pipe in skeleton.pipelines}) == 1
    modelled = 1 if same else r

    stages = []
    for rho in range(modelled):
        pipe = skeleton.pipelines[rho]
        row = []
        for s, ids in enumerate(pipe):
            ids = list(ids)
            first, last = s == 0, s == p - 1
            n = len(ids)
            ar = tp_allreduce_ms(act, n, cluster.slowest_link(ids)) * ALLREDUCES_PER_LAYER
            edge_f = max((profiles[cluster.device(i).gpu.name].cost(EMBEDDING, micro_batch).fwd_ms if first else 0.0)
                         + (profiles[cluster.device(i).gpu.name].cost(HEAD, micro_batch).fwd_ms if last else 0.0) for i in ids)
            edge_b = max((profiles[cluster.device(i).gpu.name].cost(EMBEDDING, micro_batch).bwd_ms if first else 0.0)
                         + (profiles[cluster.device(i).gpu.name].cost(HEAD, micro_batch).bwd_ms if last else 0.0) for i in ids)
            sf = p2p_ms(cluster, ids, list(pipe[s + 1]), act) if not last else 0.0
            sb = p2p_ms(cluster, list(pipe[s + 1]), ids, act) if not last else 0.0
            members = [ids] if tied[s] else [[i] for i in ids]
            groups = []
            for k, g_ids in enumerate(members):
                dev = cluster.device(g_ids[0])
                slot = Slot(profile=profiles[dev.gpu.name], memory_bytes=dev.memory_bytes, reserve_bytes=dev.reserve_bytes,
                            in_flight=in_flight_microbatches(s, p, m), first=first, last=last)
                choices = {}
                for (U, u) in share_options[s]:
                    found = device_choices(slot, spec, micro_batch, u / U, space, min_layers=min_layers[s],
                                           cap=max_layers[s], prune=prune)
                    if allowed is not None and allowed.get("recompute") is not None:
                        found = [f for f in found if f[0] in allowed["recompute"]]
                    lst = []
                    for rset, lc, L in found:
                        fwd, bwd = block_times(lc)
                        lst.append(Choice(units=u, units_per_layer=U, recompute=rset, fwd=fwd, bwd=bwd, max_layers=L,
                                          param_bytes=lc.param_bytes))
                    if lst:
                        choices[(U, u)] = lst
                groups.append(Group(
                    ids=g_ids, rank=None if tied[s] else k, choices=choices,
                    edge_param_gb=slot.edge_param_bytes(spec, micro_batch) / GB,
                    opt_ms_per_gb=[optimizer_step_ms(GB, spec, cluster.device(i).gpu.memory_bandwidth_gb_per_s,
                                                     profiles[cluster.device(i).gpu.name].optimizer_sample()) for i in g_ids]))
            if any(not g.choices for g in groups):
                bad = next(g for g in groups if not g.choices)
                return _infeasible(spec, skeleton, micro_batch, m, f"device {bad.ids[0]} cannot hold stage {s} under any share and recompute set")
            row.append(StageData(replica=rho, index=s, ids=ids, allreduce_ms=ar, edge_fwd_ms=edge_f, edge_bwd_ms=edge_b,
                                 send_fwd_ms=sf, send_bwd_ms=sb, groups=groups, tied=tied[s]))
        stages.append(row)

    emb = 0.0
    if p > 1:
        tied_bytes = spec.vocab_size * spec.hidden_dim * spec.dtype_bytes
        emb = max(allreduce_ms(tied_bytes, len(pipe[0]) + len(pipe[-1]), cluster.slowest_link(list(pipe[0]) + list(pipe[-1])))
                  for pipe in skeleton.pipelines)
    dp = []
    for s in range(p):
        row = []
        for k in range(len(skeleton.pipelines[0][s])):
            if r == 1:
                row.append((0.0, 0.0))
                continue
            peers = [pipe[s][k] for pipe in skeleton.pipelines]
            link = cluster.slowest_link(peers)
            beta = allreduce_ms(0.0, r, link)
            alpha = allreduce_ms(GB, r, link) - beta
            row.append((alpha, beta))
        dp.append(row)
    return Instance(spec=spec, skeleton=skeleton, micro_batch=micro_batch, num_microbatches=m, stages=stages,
                    modelled_replicas=modelled, share_options=share_options, unit_counts=unit_counts,
                    min_layers=min_layers, max_layers=max_layers, embedding_sync_ms=emb, dp_ms_per_gb=dp)


def _infeasible(spec, skeleton, micro_batch, m, reason) -> Instance:
    return Instance(spec=spec, skeleton=skeleton, micro_batch=micro_batch, num_microbatches=m, stages=[], modelled_replicas=0,
                    share_options=[], unit_counts=[], min_layers=[], max_layers=[], embedding_sync_ms=0.0,
                    dp_ms_per_gb=[], infeasible_reason=reason)
