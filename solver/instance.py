"""One candidate of the outer search: a skeleton (replicas of ordered TP groups), each replica's batch (its
micro-batch size and count) and the sharding stage, turned into the constants and per-device choices the
inner MILP needs.

Everything that depends only on the candidate (all-reduce and p2p times, embedding/head times, the tied
embedding sync, the in-flight count of each stage, the peer groups' sync lines and parameter counts) is a
constant here, computed with the same functions ``baton.evaluate`` uses.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from baton.cluster import ClusterSpec
from baton.costmodel import (device_slot, edge_cost, edge_param_count, embedding_sync_ms, group_sync_ms,
                             interleaved_memory_rows, layer_limits, layer_param_count, max_layers_with_sync_buffer,
                             pipeline_transfers, stage_constants)
from baton.memory import RecomputeSpace
from baton.model_spec import ModelSpec
from baton.profile import ProfileSet
from baton.schedules import interleaved_one_f_one_b

from solver.options import Choice, device_choices, interleaved_choices, valid_unit_counts
from solver.space import Skeleton

GB = 1e9
"""The MILP holds weights in GB and parameter counts in units of 1e9 parameters: numbers near 1 keep HiGHS accurate."""
DEFAULT_SHARD_GRID = 8
"""K: at stage 1 a device owns a multiple of 1/K of its peer group's optimizer state (or the equal part 1/r).
8 is the most devices of the exact family (so every equal split of up to 8 replicas but 3, 5, 6 and 7 is on
the grid, and those have the equal option), and a power of two keeps every owned fraction and every sum of
fractions exact in binary floating point, so the planner's memory limits are bit for bit the evaluator's."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Ratios:
    """What a device may own of its peer group's optimizer state (docs/cost-model.md, eq. 10, 13, 14).

    Three modes: 'none' (stage 0, or a single replica: every device owns what it holds); 'equal' (stage 1
    with the replicas modelled as one: every device owns 1/r, which minimises every peer group's largest
    shard, so for interchangeable replicas it is the best split of all, on the grid or not; or stage 1 with
    even shards imposed, see ``build_instance``); 'choose' (stage 1, replicas modelled one by one: at each
    position either every peer owns 1/r, the default even sharding, or the peers own multiples of 1/K adding
    up to 1, 0 allowed)."""

    mode: str
    values: tuple[float, ...]
    """Owned fraction of each option."""
    units: tuple[int | None, ...]
    """k of each option (it owns k/K), None for the equal option 1/r when that is not on the grid."""
    grid: int
    """K."""
    equal: int
    """Index of the option every peer takes for the even split 1/r."""

    @property
    def levels(self) -> tuple[float, ...]:
        """Distinct positive values, increasing: the thresholds of a position's largest ratio."""
        return tuple(sorted({v for v in self.values if v > 0}))


def ratio_options(zero_stage: int, replicas: int, classes: int, grid: int, even: bool = False) -> Ratios:
    """The owned-fraction options of a candidate whose replicas fall into ``classes`` classes of interchangeable
    ones; ``even`` imposes the equal split 1/r (a restriction when the replicas are not all alike)."""
    if zero_stage == 0 or replicas == 1:
        return Ratios(mode="none", values=(1.0,), units=(None,), grid=grid, equal=0)
    if classes == 1 or even:
        return Ratios(mode="equal", values=(1.0 / replicas,), units=(None,), grid=grid, equal=0)
    values = [k / grid for k in range(grid + 1)]
    units: list[int | None] = list(range(grid + 1))
    if grid % replicas == 0:
        equal = grid // replicas
    else:
        values.append(1.0 / replicas)
        units.append(None)
        equal = len(values) - 1
    return Ratios(mode="choose", values=tuple(values), units=tuple(units), grid=grid, equal=equal)


@dataclass(kw_only=True)
class Group:
    """Devices of one stage of one replica that take one decision together.

    Normally one device (one TP rank). For a stage of identical devices (same GPU, memory, reserve) whose
    profile grows with the share, all ranks take the equal share and one common recompute set: given any
    plan for such a stage, giving every device the share 1/n and the recompute set of the device with the
    largest share is no slower per block and needs no more memory on any device (proof in
    solver/README.md), so the reduction keeps the optimum. (Not at stage 1 with replicas modelled one by
    one: there each rank's owned fraction is its own decision, and the proof does not carry over.)
    """

    ids: list[str]
    rank: int | None
    """TP rank position (None for a tied group)."""
    choices: dict
    """(U, u) -> list[Choice]."""
    slots: list
    """DeviceSlot of each device of the group (position, memory, eq. 10's optimizer slope)."""
    buffer_limits: dict = field(default_factory=dict)
    """'choose' mode: (U, u) -> int array [own option, level]: the most layers at which the device fits while its
    peer group syncs (eq. 8, 14), owning that option's fraction, with the position's largest ratio at that level."""

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
    """Activation transfer to the next stage (eq. 6); 0 for the last, or in an interleaved pipeline the last
    group's to the first (the boundary between one chunk and the next)."""
    send_bwd_ms: float
    groups: list
    tied: bool


@dataclass(kw_only=True)
class Position:
    """A (stage, TP rank) position of the skeleton: its devices across the replicas hold the same parameters
    and form one peer group (``baton.peers``: replicas of one shape have one group per position)."""

    peers: list[str]
    sync_ms_per_gparam: float
    """Eq. 13 as a line: ms per 1e9 parameters of the group (stage 0, all-reduce) or of its largest shard
    (stage 1, reduce-scatter + all-gather), from ``costmodel.group_sync_ms``."""
    sync_fixed_ms: float
    """The line's value at zero parameters (latencies)."""
    params: dict
    """(U, u) -> (per layer, fixed) parameters (1e9) the group holds at that share: ``costmodel.layer_param_count``
    and ``edge_param_count``, the counts of the evaluator's peer groups."""


@dataclass(kw_only=True)
class Instance:
    """Everything the inner MILP needs for one candidate (skeleton, batches, sharding stage)."""

    spec: ModelSpec
    skeleton: Skeleton
    batches: list
    """(micro-batch size, micro-batches) of every replica of the skeleton."""
    zero_stage: int
    ratios: Ratios
    stages: list
    """stages[c][s] -> StageData of modelled replica c (the first replica of its class)."""
    modelled_replicas: int
    """Classes of interchangeable replicas (same devices, links and batch; one is modelled, the others copy
    its choices); every replica is its own class when owned fractions are chosen ('choose')."""
    replica_class: list
    """Modelled replica of each replica of the skeleton."""
    representatives: list
    """Replica of the skeleton each modelled replica is."""
    share_options: list
    """share_options[s] -> list of (U, u) allowed at stage s (shared by all replicas, eq. 2)."""
    unit_counts: list
    """unit_counts[s] -> list of U allowed at stage s."""
    min_layers: list
    """Fewest layers of each (virtual) stage."""
    max_layers: list
    embedding_sync_ms: float
    positions: list
    """positions[s][k] -> Position (peer group of TP rank k of stage s)."""
    replica_time_cv: float = 0.0
    """The cluster's noise in replica times (eq. 19: the last replica's arrival at the sync)."""
    infeasible_reason: str | None = None
    notes: list = field(default_factory=list)
    chunks: int = 1
    """Chunks per device group: 1 is 1F1B; more, interleaved 1F1B over ``chunks`` x stages virtual stages
    (docs/schedules.md), every replica alike, ``min_layers`` and ``max_layers`` per virtual stage."""
    host_memory: dict = field(default_factory=dict)
    """Node -> bytes of host memory, for the capped nodes (``ClusterSpec.host_memory``) holding devices of the
    skeleton, when its devices may offload (eq. 8o); empty otherwise."""
    node_of: dict = field(default_factory=dict)
    """Device id -> its node, for the devices of those nodes."""

    @property
    def micro_batch(self) -> int:
        """Replica 0's micro-batch size (the plan's default)."""
        return self.batches[0][0]

    @property
    def num_microbatches(self) -> int:
        return self.batches[0][1]

    def batch(self, rho: int) -> tuple[int, int]:
        """(micro-batch size, micro-batches) of modelled replica ``rho``."""
        return tuple(self.batches[self.representatives[rho]])


def _device_signature(cluster: ClusterSpec, i: str):
    d = cluster.device(i)
    return (d.gpu.name, d.memory_bytes, d.reserve_bytes, d.host_link_gb_per_s)


class _Infeasible(Exception):
    """The candidate holds no plan; the message says why (``Instance.infeasible_reason``)."""


def build_instance(spec: ModelSpec, cluster: ClusterSpec, profiles: ProfileSet, skeleton: Skeleton, batches: Sequence,
                   space: RecomputeSpace, *, zero_stage: int = 0, shard_grid: int = DEFAULT_SHARD_GRID, monotone: dict,
                   prune: bool = True, reduce_symmetry: bool = True, allowed=None, even_shards: bool = False,
                   chunks: int = 1, host_optimizer: bool = False) -> Instance:
    """Constants and choices for one candidate: ``batches[i]`` = (micro-batch size, micro-batches) of replica i.
    ``allowed`` optionally restricts choices (baselines); ``even_shards`` restricts stage 1 to equal parts
    (the constructive plan, and the structured family's replicas of one pattern). ``chunks`` > 1: every replica
    runs interleaved 1F1B with that many chunks per group, at equal parts (the space offered, solver/README.md).
    ``host_optimizer``: every device may also keep its optimizer state in host memory (eq. 7h, 10h), at 1F1B where
    the owned fractions are not chosen per device, unless ``allowed`` restricts the choices (a baseline's)."""
    if not skeleton.one_shape:
        raise ValueError(f"replicas of different shapes ({skeleton.describe()}) are solved by solver/unlike.py, not the MILP")
    r, p, N = skeleton.num_replicas, skeleton.num_stages, spec.num_layers
    batches = [tuple(x) for x in batches]
    if len(batches) != r:
        raise ValueError(f"{len(batches)} batches for {r} replicas")
    if p > N + 2:
        return _infeasible(spec, skeleton, batches, zero_stage, "more stages than layers")
    if chunks > 1 and p < 2:
        return _infeasible(spec, skeleton, batches, zero_stage, "interleaving needs at least two stages")
    min_layers, max_layers = layer_limits(N, p * chunks)
    if sum(min_layers) > N:
        return _infeasible(spec, skeleton, batches, zero_stage, "more stages than layers")
    zero_stage = zero_stage if r > 1 else 0
    host_optimizer = host_optimizer and chunks == 1 and allowed is None
    host_memory, node_of = _host_caps(cluster, skeleton, space, chunks, host_optimizer)
    if host_memory:  # eq. 8o couples a node's devices: twins and tied ranks may need different offload choices
        reduce_symmetry = False
    ratios, replica_class, representatives = _modelled_replicas(spec, cluster, skeleton, batches, zero_stage, shard_grid,
                                                                reduce_symmetry, even_shards or chunks > 1, chunks)
    try:
        share_options, unit_counts, tied = _share_options(spec, cluster, skeleton, ratios, monotone, reduce_symmetry, allowed)
        positions = [_positions(spec, cluster, skeleton, s, zero_stage, share_options[s]) for s in range(p)]
        rules = _ChoiceRules(spec=spec, space=space, ratios=ratios, min_layers=min_layers, max_layers=max_layers,
                             prune=prune, allowed=allowed, replicas=r, chunks=chunks,
                             host_optimizer=host_optimizer and ratios.mode != "choose")
        stages = [[_stage_data(cluster, profiles, rules, skeleton, batches, rep, s, share_options[s], tied[s], positions[s])
                   for s in range(p)] for rep in representatives]
    except _Infeasible as exc:
        return _infeasible(spec, skeleton, batches, zero_stage, str(exc))
    return Instance(spec=spec, skeleton=skeleton, batches=batches, zero_stage=zero_stage, ratios=ratios, stages=stages,
                    modelled_replicas=len(representatives), replica_class=replica_class, representatives=representatives,
                    share_options=share_options, unit_counts=unit_counts, min_layers=min_layers, max_layers=max_layers,
                    embedding_sync_ms=embedding_sync_ms(cluster, spec, skeleton.pipelines), positions=positions,
                    replica_time_cv=cluster.replica_time_cv, chunks=chunks, host_memory=host_memory, node_of=node_of)


def _host_caps(cluster: ClusterSpec, skeleton: Skeleton, space: RecomputeSpace, chunks: int,
               host_optimizer: bool) -> tuple[dict, dict]:
    """(node -> host memory bytes, device -> node) of the capped nodes the skeleton uses, when its devices may
    offload (1F1B over a space with offload rows, or optimizer state offered to the host)."""
    if chunks > 1 or not cluster.host_memory or not (space.offloads.any() or host_optimizer):
        return {}, {}
    node_of = {i: cluster.device(i).node for pipe in skeleton.pipelines for st in pipe for i in st
               if cluster.device(i).node in cluster.host_memory}
    return {n: cluster.host_memory[n] for n in set(node_of.values())}, node_of


def _modelled_replicas(spec, cluster, skeleton, batches, zero_stage, shard_grid, reduce_symmetry, even_shards, chunks=1):
    """(ratios, modelled replica of each replica, replica each modelled one is).

    Replicas are interchangeable when every stage matches device for device and link for link, and they train on
    the same batch: one of each class is modelled and its twins copy its choices (any twin's choices fit on every
    twin, and the max over replicas only needs the fastest twin's). Not when each device's owned fraction is its
    own decision ('choose'): twins then differ in what they own."""
    r, p = skeleton.num_replicas, skeleton.num_stages

    def replica_signature(rho):
        pipe, (b, m) = skeleton.pipelines[rho], batches[rho]
        return (b, m) + tuple((tuple(_device_signature(cluster, i) for i in ids), cluster.slowest_link(list(ids)),
                               pipeline_transfers(cluster, spec, b, ids, pipe[s + 1] if s + 1 < p else
                                                  pipe[0] if chunks > 1 else None))
                              for s, ids in enumerate(pipe))
    sigs = [replica_signature(rho) for rho in range(r)] if reduce_symmetry else list(range(r))
    ratios = ratio_options(zero_stage, r, len(set(sigs)), shard_grid, even_shards)
    if ratios.mode == "choose":
        sigs = list(range(r))
    first_of: dict = {}
    replica_class = [first_of.setdefault(sig, len(first_of)) for sig in sigs]
    representatives = [replica_class.index(c) for c in range(len(first_of))]
    return ratios, replica_class, representatives


def _share_options(spec, cluster, skeleton, ratios, monotone, reduce_symmetry, allowed):
    """(share options, unit counts, tied) of every stage position, shared by all replicas (eq. 2). A stage is tied
    (rule 3: equal shares, one recompute set) when it is homogeneous in every replica and its table monotone."""
    units_all = valid_unit_counts(spec)
    share_options, unit_counts, tied = [], [], []
    for s in range(skeleton.num_stages):
        n = len(skeleton.pipelines[0][s])
        sigs = {_device_signature(cluster, i) for pipe in skeleton.pipelines for i in pipe[s]}
        homog = len(sigs) == 1 and monotone[next(iter(sigs))[0]] and reduce_symmetry and ratios.mode != "choose"
        Us = [U for U in units_all if U >= n]
        if allowed is not None and allowed.get("uniform_tp"):
            Us = [U for U in Us if U % n == 0]
        if not Us:
            raise _Infeasible(f"stage {s} has {n} devices but no unit count U >= {n} divides the heads")
        equal = [U for U in Us if U % n == 0]
        if n == 1:  # one device holds every unit: any U gives share 1 and the same numbers
            share_options.append([(Us[0], Us[0])])
            unit_counts.append([Us[0]])
            tied.append(homog)
        elif (homog and equal) or (allowed is not None and allowed.get("uniform_tp")):
            if not equal:
                raise _Infeasible(f"stage {s}: no equal split of {n} devices")
            U0 = equal[0]
            share_options.append([(U0, U0 // n)])
            unit_counts.append([U0])
            tied.append(homog and bool(equal))
        else:
            share_options.append([(U, u) for U in Us for u in range(1, U - n + 2)])
            unit_counts.append(Us)
            tied.append(False)
    return share_options, unit_counts, tied


def _positions(spec, cluster, skeleton, s: int, zero_stage: int, share_options: list) -> list[Position]:
    """Stage s's peer groups, one per TP rank: the sync line and the parameters held at every share."""
    p, row = skeleton.num_stages, []
    for k in range(len(skeleton.pipelines[0][s])):
        peers = [pipe[s][k] for pipe in skeleton.pipelines]
        zero = group_sync_ms(cluster, spec, peers, 0.0, 0.0, zero_stage)
        slope = group_sync_ms(cluster, spec, peers, GB, GB, zero_stage) - zero
        params = {(U, u): (layer_param_count(spec, u / U) / GB, edge_param_count(spec, u / U, first=s == 0, last=s == p - 1) / GB)
                  for (U, u) in share_options}
        row.append(Position(peers=peers, sync_ms_per_gparam=slope, sync_fixed_ms=zero, params=params))
    return row


@dataclass(frozen=True, kw_only=True)
class _ChoiceRules:
    """What every device's choices of one candidate follow, whatever its stage."""

    spec: ModelSpec
    space: RecomputeSpace
    ratios: Ratios
    min_layers: list
    """Fewest layers of each stage (``costmodel.layer_limits``)."""
    max_layers: list
    """Most layers of each stage."""
    prune: bool
    """Drop dominated recompute sets (rule 2); the oracle keeps them all."""
    allowed: dict | None
    """The baselines' restrictions ('recompute': the sets allowed)."""
    replicas: int
    """r: the peers of every position."""
    chunks: int = 1
    """Chunks per device group (``Instance.chunks``); ``min_layers`` and ``max_layers`` are then per virtual stage."""
    host_optimizer: bool = False
    """Devices may keep their optimizer state in host memory (eq. 7h, 10h): each choice also with it there."""


def _stage_data(cluster, profiles, rules: _ChoiceRules, skeleton, batches, rep: int, s: int, share_options: list,
                tied: bool, positions: list) -> StageData:
    """Stage s of modelled replica ``rep``: its constants, and its devices' choices (one group for a tied stage)."""
    spec, p = rules.spec, skeleton.num_stages
    pipe = skeleton.pipelines[rep]
    b, m = batches[rep]
    ids = list(pipe[s])
    slots = [device_slot(cluster, profiles, spec, b, i, stage=s, num_stages=p, num_microbatches=m) for i in ids]
    const = stage_constants(cluster, spec, b, ids, first=s == 0, last=s == p - 1)
    to = pipe[s + 1] if s + 1 < p else pipe[0] if rules.chunks > 1 else None  # interleaved: the last group's chunks feed the first's
    sf, sb = pipeline_transfers(cluster, spec, b, ids, to)
    members = [list(range(len(ids)))] if tied else [[k] for k in range(len(ids))]
    groups = []
    for k, member in enumerate(members):
        if rules.chunks > 1:
            choices, buffer_limits = _interleaved_choices(rules, slots[member[0]], b, m, s, p, share_options,
                                                          positions[member[0]].params), {}
        else:
            choices, buffer_limits = _device_choices(rules, slots[member[0]], b, s, share_options, positions[member[0]].params)
        groups.append(Group(ids=[ids[j] for j in member], rank=None if tied else k, choices=choices,
                            slots=[slots[j] for j in member], buffer_limits=buffer_limits))
    if any(not g.choices for g in groups):
        bad = next(g for g in groups if not g.choices)
        raise _Infeasible(f"device {bad.ids[0]} cannot hold stage {s} under any share and recompute set")
    return StageData(replica=rep, index=s, ids=ids, allreduce_ms=const.allreduce_ms,
                     edge_fwd_comm_ms=const.edge_fwd_comm_ms, edge_bwd_comm_ms=const.edge_bwd_comm_ms,
                     send_fwd_ms=sf, send_bwd_ms=sb, groups=groups, tied=tied)


def _device_choices(rules: _ChoiceRules, slot, b: int, s: int, share_options: list, params: dict) -> tuple[dict, dict]:
    """(choices, buffer limits) of a device at ``slot``: for every share, its recompute sets worth keeping with
    the most layers that fit, the sync buffer of eq. 14 included ('equal': folded into the limit; 'choose': per own
    option and largest-ratio level, ``Group.buffer_limits``)."""
    spec, ratios, r = rules.spec, rules.ratios, rules.replicas
    owned, levels = ratios.values, np.array(ratios.levels)
    choices, buffer_limits = {}, {}
    for (U, u) in share_options:
        found = _allowed(rules, device_choices(slot, spec, b, u / U, rules.space, min_layers=rules.min_layers[s],
                                               cap=rules.max_layers[s], prune=rules.prune, owned_fractions=owned))
        edge = edge_cost(slot, spec, b, u / U)
        if not found:
            choices[(U, u)] = _host_optimizer_choices(rules, slot, b, s, (U, u), edge, params)
            continue
        per_layer, fixed = (x * GB for x in params[(U, u)])
        if ratios.mode == "equal":  # the sync buffer (eq. 14) at the one owned fraction 1/r
            buf = _equal_buffer_limit(rules, slot, found[0][2].param_bytes, edge, params[(U, u)], rules.max_layers[s])
            found = [(rset, oset, lc, (min(L[0], buf),)) for rset, oset, lc, L in found]
        elif ratios.mode == "choose":
            buffer_limits[(U, u)] = max_layers_with_sync_buffer(
                slot, spec, found[0][2].param_bytes, edge, rules.max_layers[s], owned_fraction=np.array(owned)[:, None],
                group_size=r, shard_params_per_layer=levels[None, :] * per_layer, shard_params_fixed=levels[None, :] * fixed)
        choices[(U, u)] = _choices(found, (U, u), edge) + _host_optimizer_choices(rules, slot, b, s, (U, u), edge, params)
    return {k: v for k, v in choices.items() if v}, buffer_limits


def _host_optimizer_choices(rules: _ChoiceRules, slot, b: int, s: int, share: tuple, edge, params: dict) -> list:
    """The device's choices with its optimizer state in host memory (eq. 7h): its rows pruned and limited as without
    it, but with no optimizer state on the device (owned fraction 0 in eq. 8 and, at equal parts, in eq. 14)."""
    if not math.isfinite(slot.host_optimizer_ms_per_byte) or not rules.host_optimizer:
        return []
    U, u = share
    found = _allowed(rules, device_choices(slot, rules.spec, b, u / U, rules.space, min_layers=rules.min_layers[s],
                                           cap=rules.max_layers[s], prune=rules.prune, owned_fractions=(0.0,)))
    if found and rules.ratios.mode == "equal":
        buf = _equal_buffer_limit(rules, slot, found[0][2].param_bytes, edge, params[share], rules.max_layers[s], owned=0.0)
        found = [(rset, oset, lc, (min(L[0], buf),)) for rset, oset, lc, L in found]
    return _choices([f for f in found if f[3][0] >= rules.min_layers[s]], share, edge, offload_optimizer=True)


def _choices(found: list, share: tuple, edge, *, offload_optimizer: bool = False) -> list[Choice]:
    """The MILP's view of (recompute set, offload set, cost, max layers) rows at ``share`` = (U, u)."""
    U, u = share
    return [Choice(units=u, units_per_layer=U, recompute=rset, offload=oset, host_bytes=lc.host_bytes,
                   offload_optimizer=offload_optimizer, fwd=lc.block_fwd_ms(), bwd=lc.block_bwd_ms(), max_layers=L,
                   param_bytes=lc.param_bytes, edge_fwd_ms=edge.fwd_ms, edge_bwd_ms=edge.bwd_ms,
                   edge_param_bytes=edge.param_bytes) for rset, oset, lc, L in found]


def _interleaved_choices(rules: _ChoiceRules, slot, b: int, m: int, s: int, p: int, share_options: list, params: dict) -> dict:
    """The choices of a device of group ``s`` of an interleaved pipeline: for every share, its recompute sets worth
    keeping (``options.interleaved_choices``), each with its memory as lines in its chunks' layer counts
    (``costmodel.interleaved_memory_rows``) and, at equal parts with replicas, the most layers it may hold in all
    while its peer group syncs (eq. 14; else every layer)."""
    spec, N = rules.spec, rules.spec.num_layers
    schedule = interleaved_one_f_one_b(p, rules.chunks, m)
    owned = rules.ratios.values[0]
    choices = {}
    for (U, u) in share_options:
        found = _allowed(rules, interleaved_choices(slot, spec, b, u / U, rules.space, prune=rules.prune))
        edge = edge_cost(slot, spec, b, u / U)
        buf = N
        if found and rules.ratios.mode == "equal":
            buf = _equal_buffer_limit(rules, slot, found[0][1].param_bytes, edge, params[(U, u)], N)
        if not found or buf < 1:  # every group of an interleaved pipeline holds a layer
            continue
        choices[(U, u)] = [Choice(units=u, units_per_layer=U, recompute=rset, fwd=lc.block_fwd_ms(), bwd=lc.block_bwd_ms(),
                                  max_layers=(buf,), param_bytes=lc.param_bytes, edge_fwd_ms=edge.fwd_ms,
                                  edge_bwd_ms=edge.bwd_ms, edge_param_bytes=edge.param_bytes,
                                  chunk_rows=tuple(interleaved_memory_rows(
                                      slot, spec, schedule, s, param_bytes=lc.param_bytes, held_bytes=lc.held_bytes,
                                      transient_bytes=lc.transient_bytes, edge=edge, owned_fraction=owned)))
                           for rset, lc in found]
    return choices


def _allowed(rules: _ChoiceRules, found: list) -> list:
    """The choices of ``found`` the baselines' restriction allows (all without one): its recompute sets, and no
    offload unless it allows some (``allowed['offload']``, the offload sets it may use)."""
    if rules.allowed is None:
        return found
    sets, offloads = rules.allowed.get("recompute"), rules.allowed.get("offload", (frozenset(),))
    return [f for f in found if (sets is None or f[0] in sets) and (len(f) == 2 or f[1] in offloads)]


def _equal_buffer_limit(rules: _ChoiceRules, slot, param_bytes: float, edge, params: tuple, cap: int,
                        owned: float | None = None) -> int:
    """The most layers (at most ``cap``) a device may hold while its peer group syncs (eq. 14) at the one owned
    fraction 1/r, its position holding ``params`` = (per layer, fixed) parameters (1e9); keeping ``owned`` of its
    optimizer state on the device when given (0: in host memory)."""
    shard = rules.ratios.values[0]
    owned = shard if owned is None else owned
    per_layer, fixed = (x * GB for x in params)
    return int(max_layers_with_sync_buffer(slot, rules.spec, param_bytes, edge, cap, owned_fraction=owned,
                                           group_size=rules.replicas, shard_params_per_layer=shard * per_layer,
                                           shard_params_fixed=shard * fixed))


def _infeasible(spec, skeleton, batches, zero_stage, reason) -> Instance:
    return Instance(spec=spec, skeleton=skeleton, batches=list(batches), zero_stage=zero_stage,
                    ratios=ratio_options(0, 1, 1, DEFAULT_SHARD_GRID), stages=[], modelled_replicas=0, replica_class=[],
                    representatives=[], share_options=[],
                    unit_counts=[], min_layers=[], max_layers=[], embedding_sync_ms=0.0, positions=[], infeasible_reason=reason)
