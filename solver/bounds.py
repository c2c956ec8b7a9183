"""Cheap lower bounds on the iteration time of a (micro-batch, skeleton) candidate.

They let the outer search skip candidates without building their MILP. Each bound relaxes the model
(docs/cost-model.md) so it never exceeds the best plan of the candidate:
  * per-layer stage time >= the stage's time with no recomputation, at the most favourable shares
    (for a mixed group: sum over blocks of the max over devices >= max over devices of the sum, and the
    shares must add up to one, eq. 2/9);
  * a stage holds at most as many layers as fit with its least memory-hungry choice (eq. 8);
  * 1F1B (eq. 1): every stage runs m forwards and m backwards, so makespan >= m (F_s + B_s); and for
    every stage b, makespan >= sum over all stages of (F_s + B_s) + all links + (m - 1 - w_b)(F_b + B_b)
    where w_b = min(p - b - 1, m) is b's warm-up count: the first micro-batch must reach b, the last must
    leave it, the chain after b's last forward crosses every later stage twice, and b runs at least
    m - 1 - w_b backwards before its last forward.
  * every replica is bounded with its own micro-batch size and count; a candidate's bound is the slowest
    replica's, so it holds for any batch split. At sharding stage 1 a device may own anything from none to
    all of its optimizer state: the layer caps take owned fraction 0, the optimizer step 0, and no stage is
    tied (solver/instance.py unties them there).
  * data-parallel sync (eq. 13, 15, ``dp_sync_lower_bound``): the slowest position's group sync with the
    fewest parameters the position can hold; at stage 1 the largest shard is at least 1/r of the group, and
    2 ring steps of P/r cost exactly the all-reduce of P, so one bound serves both stages.
"""
from __future__ import annotations

import math

import numpy as np

from baton.cluster import ClusterSpec
from baton.costmodel import (RING_PASSES, allreduce_ms, device_memory, device_slot, edge_cost, edge_param_count,
                             embedding_sync_ms, fitting_layers, group_sync_ms, layer_allreduce_ms, layer_backward_ms,
                             layer_limits, layer_param_count, layer_train_ms, layered_chain, optimizer_bytes,
                             pipeline_transfers, ring_step_ms, slot_prices, stage_constants)
from baton.memory import RecomputeSpace
from baton.model_spec import ModelSpec
from baton.profile import ProfileSet

from solver.options import valid_unit_counts
from solver.space import Skeleton, device_codes, replica_pattern
from solver.splits import class_members, replica_classes


def _layer_ms(profile, spec, mb, share, part="fb") -> float:
    """fwd + bwd (part 'fb') or bwd only (part 'b') of one layer, no recomputation (eq. 2)."""
    if part == "fb":
        return layer_train_ms(profile, spec, mb, share)
    return layer_backward_ms(profile, spec, mb, share)


def stage_layer_lower_bound(spec, cluster, profiles, mb, ids, part="fb") -> float:
    """Smallest possible per-layer F + B (or B alone) of a TP group, all-reduces included, memory ignored."""
    n = len(ids)
    Umax = max(valid_unit_counts(spec))
    ar = layer_allreduce_ms(cluster, spec, mb, ids) * (2 if part == "fb" else 1)
    if n == 1:
        return _layer_ms(profiles[cluster.device(ids[0]).gpu.name], spec, mb, 1.0, part) + ar
    if n > Umax:
        return float("inf")
    # g_d(k) = time of device d at share k/Umax: the least t at which shares within t add up to Umax.
    per_rank = [{k: _layer_ms(profiles[cluster.device(i).gpu.name], spec, mb, k / Umax, part) for k in range(1, Umax - n + 2)}
                for i in ids]
    return least_slowest(per_rank, Umax) + ar


def least_slowest(per_rank: list[dict], U: int) -> float:
    """min over u_k with sum_k u_k = U of max_k time_k(u_k), each rank's ``{u: time}`` (a TP group waits for its
    slowest rank, eq. 2): the least threshold at which the ranks' shares within it can add up to U, a subset-sum
    over the ranks; inf if none can."""
    for t in sorted({v for times in per_rank for v in times.values()}):
        reach = {0}
        for times in per_rank:
            reach = {r + u for r in reach for u, v in times.items() if v <= t and r + u <= U}
        if U in reach:
            return t
    return float("inf")


def _slot(spec, cluster, profiles, mb, device_id, s, p, m):
    return device_slot(cluster, profiles, spec, mb, device_id, stage=s, num_stages=p, num_microbatches=m)


def possible_shares(spec, n: int, tied: bool) -> list[float]:
    """Every share a rank of an n-device group can get (only the equal one when the stage is tied; all of the
    layer for a lone device)."""
    Umax = max(valid_unit_counts(spec))
    return [1.0 / n] if tied or n == 1 else [k / Umax for k in range(1, Umax - n + 2)]


def edge_lower_bounds(spec, slot, mb, shares) -> tuple[float, float, float]:
    """(fwd + bwd, bwd, parameter bytes) of a device's embedding/head, each the least over its possible
    shares: the vocabulary is split like the units, so a smaller share costs less."""
    edges = [edge_cost(slot, spec, mb, r) for r in shares]
    if not edges:  # more ranks than units: the group cannot exist
        return math.inf, math.inf, math.inf
    return (min(e.fwd_ms + e.bwd_ms for e in edges), min(e.bwd_ms for e in edges), min(e.param_bytes for e in edges))


def stage_layer_cap(spec, cluster, profiles, mb, ids, s, p, m, space: RecomputeSpace, N: int, tied: bool,
                    owned_fraction: float = 1.0) -> int:
    """Upper bound on the layers stage s can hold: every device at its least memory-hungry recompute set,
    maximised over the shares it may get (only the equal share when the stage is tied, see instance.py),
    owning at least ``owned_fraction`` of its optimizer state."""
    n = len(ids)
    shares = possible_shares(spec, n, tied)
    if not shares:
        return -1
    most = []  # per device: the most layers it fits at each share
    for i in ids:
        slot = _slot(spec, cluster, profiles, mb, i, s, p, m)
        most.append([int(fitting_layers(slot, spec, mb, sh, space, N, owned_fraction).max()) for sh in shares])
    return _cap_with_shares(shares, np.array(most), N)


def _cap_with_shares(shares, most: np.ndarray, N: int) -> int:
    """The most layers L a group can hold when rank d fits L layers only at the shares where most[d, share] >= L
    (memory grows with the share, so those are the small ones) and the ranks' shares add up to one: the
    largest L at which the ranks' largest fitting shares add up to at least one; -1 if not even 0."""
    shares = np.asarray(shares)
    for L in range(N, -1, -1):
        largest = np.where(most >= L, shares[None, :], 0.0).max(axis=1)
        if np.all(largest > 0) and largest.sum() >= 1 - 1e-9:
            return L
    return -1


class BoundCache:
    """Memo of per-group figures: many skeletons share the same TP groups."""

    def __init__(self):
        self.tau: dict = {}
        self.cap: dict = {}
        self.per_layer: dict = {}
        self.replica: dict = {}
        self.stage: dict = {}
        self.skeleton: dict = {}
        self.rows: dict = {}
        self.links: dict = {}
        self.scopes: dict = {}
        """(ids of a skeleton, its patterns and classes) -> (those, {(class, b, m, ...): (bound, step, key number)})."""
        self.key_numbers: dict = {}
        """Replica key (``_replica_key``) -> its number, for the joint memo's keys."""
        self.numbered_keys: list = []
        self.transfers: dict = {}
        """(micro-batch, TP group, next TP group) -> both transfers between them: replicas of other patterns
        (other skeletons) pass between the same groups."""
        self.pipeline: dict = {}
        """(stage keys of ``_stage_rows``, m) -> (1F1B bound, chain bound without links, optimizer step, joint row):
        replicas of other patterns (nodes shared differently across stages) often have the same stage rows."""
        self.joint: dict = {}
        self.shared: dict = {}
        self.slack: dict = {}
        self.group_pattern: dict = {}
        """TP group (device ids) -> its ``replica_pattern`` as a one-stage replica."""
        self.device_sets: dict = {}
        """(None or a stage, the replicas' device sets sorted) -> ``unlike_sync_lower_bound`` or
        ``layered_collectives_bound`` (``_by_device_sets``): the exact family's skeletons share a few thousand
        device sets on 8 GPUs."""


def _group_key(cluster, ids):
    devs = [cluster.device(i) for i in ids]
    link = cluster.slowest_link(list(ids))
    return (tuple(sorted((d.gpu.name, d.memory_bytes, d.reserve_bytes, d.host_link_gb_per_s) for d in devs)),
            link)


def candidate_lower_bound(spec: ModelSpec, cluster: ClusterSpec, profiles: ProfileSet, skeleton: Skeleton, batches,
                          space: RecomputeSpace, cache: BoundCache | None = None, monotone: dict | None = None, *,
                          zero_stage: int = 0, patterns=None, classes=None, sync: bool = True, even_shards: bool = False,
                          host_optimizer: bool = False) -> float:
    """A lower bound on every plan of the candidate (``batches[i]`` = (micro-batch size, micro-batches) of
    replica i): the slowest replica's pipeline bound, the tied embedding sync, the least optimizer step of
    any device and (``sync``) the data-parallel sync bound.

    A replica is bounded once per ``replica_pattern`` and batch (the same replica on other nodes of the same
    kinds costs the same), here and across candidates: large clusters repeat one replica hundreds of times;
    ``patterns`` may give the replicas' patterns, computed once per skeleton, and ``classes`` their
    ``splits.replica_classes``. With ``host_optimizer`` a device may
    keep its optimizer state in host memory (eq. 7h): its layer caps count none on the device, and the least
    optimizer step is 0 (a bound on the host step too)."""
    cache = cache or BoundCache()
    best, opt = 0.0, 0.0
    scope = _skeleton_scope(cache, skeleton, patterns, classes) if patterns is not None and classes is not None else None
    patterns = patterns if patterns is not None else [replica_pattern(cluster, pipe) for pipe in skeleton.pipelines]
    classes = classes if classes is not None else replica_classes(patterns)  # small keys for what the patterns say
    owned = bound_owned(skeleton.num_replicas, zero_stage, even_shards or (monotone is not None and len(set(classes)) == 1
                                                                           and len(set(batches)) == 1))
    if not skeleton.one_shape:  # a device of unlike replicas may own less than 1/r (groups of more holders)
        owned = None
    if host_optimizer:
        owned = 0.0
    # Replicas alike on one micro-batch size: only the one with the most micro-batches counts (its bound, and
    # its row in the joint bound, dominate the others': more passes, more in-flight activations).
    most: dict = {}
    for rho, (c, (b, m)) in enumerate(zip(classes, batches)):
        if m > most.get((c, b), (0, 0))[0]:
            most[c, b] = (m, rho)
    seen = {}
    mono = bool(monotone)
    for (c, b), (m, rho) in most.items():
        # A replica's key holds its whole pattern, costly to hash on 10^5 candidates: within one skeleton its class
        # stands for it, and across skeletons a number given to each key once.
        hit = scope.get((c, b, m, mono, zero_stage, owned)) if scope is not None else None
        if hit is None:
            pattern = patterns[rho]
            rb, ro = replica_bound(spec, cluster, profiles, skeleton.pipelines[rho], b, m, space, cache, monotone,
                                   zero_stage=zero_stage, pattern=pattern, owned=owned)
            key = _replica_key(b, m, pattern, monotone, zero_stage, owned)
            number = cache.key_numbers.get(key)
            if number is None:
                number = cache.key_numbers[key] = len(cache.numbered_keys)
                cache.numbered_keys.append(key)
            hit = (rb, ro, number)
            if scope is not None:
                scope[c, b, m, mono, zero_stage, owned] = hit
        rb, ro, seen[c, b, m] = hit
        if not math.isfinite(rb):
            return float("inf")
        best, opt = max(best, rb), max(opt, ro)
    shared = None
    if scope is None:
        constant = skeleton_constant(spec, cluster, skeleton, cache, sync=sync, classes=classes)
    else:  # hashing the skeleton (every device id) to find its constant cost more than the rest of a bound
        constant = scope.get(("constant", sync))
        if constant is None:
            constant = scope["constant", sync] = skeleton_constant(spec, cluster, skeleton, cache, sync=sync, classes=classes)
    if not skeleton.one_shape:  # each replica its own layer split (solver/unlike.py): nothing couples them here
        return best + constant + opt
    if zero_stage and owned is None and skeleton.num_replicas > 1:  # each position's peers share its state
        shared = shared_state_caps(spec, cluster, profiles, skeleton, batches, space, cache)
    if len(seen) > 1 or shared is not None:  # replicas share one layer split (and, at stage 1, their state)
        keys = frozenset(seen.values())  # the joint bound does not depend on the rows' order (min, max, unique)
        if (keys, shared) not in cache.joint:
            cache.joint[keys, shared] = _joint_pipeline_bound([cache.rows[cache.numbered_keys[k]] for k in keys],
                                                              spec.num_layers, shared)
        best = max(best, cache.joint[keys, shared])
        if sync and len(seen) > 1:  # costlier: where the sync bound is added too (at the front of the heap)
            if (keys, shared, "chain") not in cache.joint:
                cache.joint[keys, shared, "chain"] = _joint_chain_bound(
                    [cache.rows[cache.numbered_keys[k]] for k in keys], spec.num_layers, shared)
            best = max(best, cache.joint[keys, shared, "chain"])
    if sync and skeleton.num_replicas > 1:  # at the front: the pipeline and the sync through one split
        keys = frozenset(seen.values())
        memo = scope if scope is not None else {}
        if ("joint sync", keys, shared) not in memo:
            if "dp rows" not in memo:
                memo["dp rows"] = _dp_sync_rows(spec, cluster, skeleton)
            memo["joint sync", keys, shared] = _pipeline_and_sync_bound(spec, memo["dp rows"], cache, keys, shared)
        if ("constant", False) not in memo:
            memo["constant", False] = skeleton_constant(spec, cluster, skeleton, cache, sync=False, classes=classes)
        return max(best + constant, memo["joint sync", keys, shared] + memo["constant", False]) + opt
    return best + constant + opt


def _pipeline_and_sync_bound(spec, D, cache: BoundCache, keys, shared) -> float:
    """``_joint_sync_bound`` over the rows of the replica kinds numbered ``keys`` and the skeleton's sync rows ``D``
    (``_dp_sync_rows``; 0 where it has no positions)."""
    if D is None:
        return 0.0
    G, caps, lo = _joint_chain_rows([cache.rows[cache.numbered_keys[k]] for k in keys], spec.num_layers, shared)
    return float("inf") if G is None else _joint_sync_bound(G, caps, lo, D, spec.num_layers)


def _skeleton_scope(cache: BoundCache, skeleton: Skeleton, patterns, classes) -> dict:
    """A memo for one skeleton's replicas, found by the identity of its skeleton, patterns and classes (kept alive
    here, so no other object can take their ids)."""
    key = (id(skeleton), id(patterns), id(classes))
    hit = cache.scopes.get(key)
    if hit is None:
        hit = cache.scopes[key] = (skeleton, patterns, classes, {})
    return hit[3]


def bound_owned(replicas: int, zero_stage: int, even: bool) -> float | None:
    """The owned fraction a stage-1 candidate's bound may assume: with even shards (imposed, or replicas that are
    interchangeable and train on one batch, solver/instance.py) every device owns exactly 1/r, and the bound
    takes the power of two at or below it, so that candidates with other replica counts share their stage
    bounds (a smaller fraction only lowers the bound); otherwise None (anything from 0)."""
    if zero_stage == 0 or not even:
        return None
    return 0.5 ** math.ceil(math.log2(replicas))


def _replica_key(b, m, pattern, monotone, zero_stage, owned):
    owned = (1.0 if zero_stage == 0 else 0.0) if owned is None else owned
    return (b, m, pattern, bool(monotone), zero_stage, owned)


def _joint_pipeline_bound(rows, N: int, shared=None) -> float:
    """min over one layer split shared by every replica of max over replicas of m (F_s + B_s) of its slowest
    stage: the first 1F1B bound of each replica, with the coupling the MILP has (layers per stage are one
    decision for all replicas, eq. 1, 9). ``rows`` = (m, c, cap, lo) per replica kind, c[s, L] = F + B of
    stage s holding L layers; ``shared``: further layer caps per stage (``shared_state_caps``)."""
    if any(row is None for row in rows):
        return float("inf")
    scaled = np.stack([row[0] * row[1] for row in rows])  # (kinds, stages, L); non-decreasing in L
    caps, lo = _joint_caps(rows, shared)
    # A stage fits L layers within T in every replica iff the slowest replica's c[s, L] is within T.
    return _least_largest(scaled.max(axis=0), caps, lo, N)


def _joint_caps(rows, shared):
    """(layer caps, lower limits) of a split every kind of ``rows`` can hold, within ``shared`` if given."""
    caps = np.min([row[2] for row in rows], axis=0)
    return (caps if shared is None else np.minimum(caps, np.array(shared))), rows[0][3]


def _joint_chain_bound(rows, N: int, shared=None) -> float:
    """Both 1F1B bounds of every replica kind through one layer split shared by all of them (the MILP's
    coupling, eq. 1, 9), where ``_joint_pipeline_bound`` couples the first only: min over shared splits of
    max_s G[s, L_s] (``_joint_chain_rows``, ``_least_largest_any``). On a 256-GPU candidate whose replicas of two
    kinds (an H100 -> V100 -> V100 -> A100 pipeline and an H100 -> V100 -> A100 -> A100 one) share the split,
    5,654 ms, where each kind at its own best split gave 5,196 and 5,124 and the MILP's best is 5,743. ``rows``:
    (m, c, cap, lo, cb, tau, edge, links) per kind."""
    G, caps, lo = _joint_chain_rows(rows, N, shared)
    return float("inf") if G is None else _least_largest_any(G, caps, lo, N)


def _joint_chain_rows(rows, N: int, shared=None):
    """(G, caps, lo): G[s, L] bounds from below the pipeline of every kind of ``rows`` at any split giving stage s
    L layers. For kind k and stage b, the chain bound (``_chain_bound``) at split L is sum_s (L_s tau_s + E_s) +
    (m - 1 - w_b) c_b(L_b) + w_b B_b(L_b) + links; its sum is at least L_b tau_b + the least the other stages'
    layers can cost given L_b (the cheapest of their units within their caps, ``_rest_fill``) + every stage's E.
    So g_kb(L_b) = max(that, m c_b(L_b)) bounds kind k's pipeline whatever the other stages hold, and G is the
    largest over the kinds. G is None where no split fits."""
    if any(row is None for row in rows):
        return None, None, None
    caps, lo = _joint_caps(rows, shared)
    if np.any(caps < lo):
        return None, None, None
    p = len(lo)
    Ls = np.arange(N + 1)
    G = np.zeros((p, N + 1))
    for m, c, _, _, cb, tau, edge, links in rows:
        w = np.minimum(p - 1 - np.arange(p), m - 1).astype(float)
        with np.errstate(invalid="ignore"):
            chain = ((m - 1 - w)[:, None] * c + w[:, None] * cb + Ls[None, :] * tau[:, None] + _rest_fill(tau, caps, lo, N)
                     + float(np.sum(edge)) + links)
        G = np.maximum(G, np.maximum(np.where(np.isnan(chain), np.inf, chain), m * c))
    return G, caps, lo


def _joint_sync_bound(G, caps, lo, D, N: int) -> float:
    """min over layer splits of max_s G[s, L_s] + max_s D[s, L_s]: the pipeline and the data-parallel sync through
    the one split (eq. 11, 13, 15), where a bound of each alone lets the pipeline pile layers on the fast stages
    while the sync counts them spread out. D[s, L], non-decreasing in L: the least sync of stage s's slowest position
    holding L layers (``_dp_sync_rows``). For each sync level d (D's values in order), the stages may hold at most
    the layers whose sync is within d, and the pipeline's least largest within those caps + d bounds every split
    whose sync is d; the levels stop once the unconstrained pipeline bound + d reaches the best so far."""
    floor = _least_largest_any(G, caps, lo, N)
    if not math.isfinite(floor):
        return floor
    Ls = np.arange(N + 1)
    allowed = (Ls[None, :] >= lo[:, None]) & (Ls[None, :] <= caps[:, None])
    best = math.inf
    for d in np.unique(D[allowed]):
        if floor + d >= best:
            break
        within = np.minimum(caps, (D <= d).sum(axis=1) - 1)  # D non-decreasing: its count within d, less one
        if np.any(within < lo) or within.sum() < N:
            continue
        best = min(best, _least_largest_any(G, within, lo, N) + d)
    return best


def _rest_fill(tau, caps, lo, N: int) -> np.ndarray:
    """rest[b, L]: the least sum over the stages other than b of L_s tau_s, lo_s <= L_s <= caps_s, when b holds L of
    the N layers (inf where the others cannot take the rest): their lower limits, then the cheapest of their extra
    layers."""
    p = len(tau)
    extra = np.tile(np.clip(caps - lo, 0, None), (p, 1))
    extra[np.arange(p), np.arange(p)] = 0  # row b: the stages other than b
    base = (lo * tau).sum() - lo * tau  # their lower limits
    need = N - np.arange(N + 1)[None, :] - (lo.sum() - lo)[:, None]  # extra layers the others take
    return base[:, None] + _cheapest_extra(tau, extra, need)


def _cheapest_extra(tau, extra, need) -> np.ndarray:
    """For each row r of ``extra`` (layers each stage may take beyond its lower limit) and each count need[r, j]: the
    least cost of that many extra layers, stage s's at tau_s each (the cheapest stages first); inf where the row
    cannot take them or the count is negative."""
    order = np.argsort(tau, kind="stable")
    ext = extra[:, order]
    within = np.cumsum(ext, axis=1)
    take = np.clip(need[:, :, None] - (within - ext)[:, None, :], 0, ext[:, None, :])
    cost = take @ tau[order]
    cost[(need < 0) | (need > within[:, -1:])] = np.inf
    return cost


def _least_largest_any(G, caps, lo, N: int) -> float:
    """min over layer splits (lo_s <= L_s <= caps_s, sum N) of max_s G[s, L_s] for any rows (``_least_largest`` needs
    them non-decreasing): the least of G's values at which the layer counts each stage allows can add up to N
    (a reachability pass over the stages), by bisection over the sorted values."""
    Ls = np.arange(G.shape[1])
    allowed = (Ls[None, :] >= lo[:, None]) & (Ls[None, :] <= caps[:, None]) & np.isfinite(G)
    values = np.unique(G[allowed])

    def feasible(T) -> bool:
        reach = np.zeros(N + 1)
        reach[0] = 1.0
        for s in range(G.shape[0]):
            reach = (np.convolve(reach, (allowed[s] & (G[s] <= T)).astype(float))[:N + 1] > 0).astype(float)
        return bool(reach[N])

    if len(values) == 0 or not feasible(values[-1]):
        return float("inf")
    lo_i, hi_i = 0, len(values) - 1
    while lo_i < hi_i:
        mid = (lo_i + hi_i) // 2
        lo_i, hi_i = (lo_i, mid) if feasible(values[mid]) else (mid + 1, hi_i)
    return float(values[lo_i])


def _least_largest(c, caps, lo, N: int) -> float:
    """min over layer splits (lo_s <= L_s <= caps_s, sum N) of max_s c[s, L_s], each row of c non-decreasing in L;
    inf if none. At a threshold T stage s holds at most its largest L with c[s, L] <= T (capped), so T suffices iff
    T >= c[s, lo_s] for every s and at least N - sum(lo) of the steps c[s, L], lo_s < L <= caps_s, are within T: the
    least T is the larger of the first and the (N - sum(lo))-th smallest step. The search this replaces tried every
    value of c (a few thousand numpy operations per replica, on 10^5 replicas)."""
    if np.any(caps < lo):
        return float("inf")
    p, width = c.shape
    least = c[np.arange(p), lo].max()
    need = N - int(lo.sum())
    if need > 0:
        Ls = np.arange(width)
        steps = c[(Ls[None, :] > lo[:, None]) & (Ls[None, :] <= caps[:, None])]
        if steps.size < need:
            return float("inf")
        least = max(least, np.partition(steps, need - 1)[need - 1])
    return float(least) if np.isfinite(least) else float("inf")


def skeleton_constant(spec, cluster, skeleton: Skeleton, cache: BoundCache, *, sync: bool = True,
                       classes=None) -> float:
    """The terms of a candidate's bound that depend on its skeleton alone: the tied embedding sync (eq. 11)
    and (``sync``) the data-parallel sync bound; memoised per skeleton. ``classes`` (``splits.replica_classes`` of
    its replicas' patterns): the embedding sync is taken over one replica of each, the same figure (a replica's
    first and last groups have the same links as another of its pattern's, rule 6), and on 1,024 GPUs a tenth of
    the time of enumerating the family."""
    key = (skeleton, sync)
    if key not in cache.skeleton:
        pipes = skeleton.pipelines
        if classes is not None:
            pipes = [pipes[ids[0]] for ids in class_members(classes).values()]
        cache.skeleton[key] = embedding_sync_ms(cluster, spec, pipes) + (data_parallel_sync_bound(spec, cluster, skeleton, cache)
                                                                         if sync else 0.0)
    return cache.skeleton[key]


def replica_bound(spec, cluster, profiles, pipe, b: int, m: int, space, cache: BoundCache, monotone=None, *,
                  zero_stage: int = 0, pattern=None, owned: float | None = None) -> tuple[float, float]:
    """(pipeline bound, least optimizer step of its devices) of one replica training on m micro-batches of b
    samples; the pipeline bound does not decrease with m (more passes, more in-flight activations). At stage 1
    every device is taken to own ``owned`` of its optimizer state when that is known (replicas modelled as
    one), else anything from none to all."""
    pattern = pattern if pattern is not None else replica_pattern(cluster, pipe)
    key = _replica_key(b, m, pattern, monotone, zero_stage, owned)
    found = cache.replica.get(key)  # asked millions of times on 1,024 GPUs, mostly for a replica already bounded
    if found is not None:  # only bounds that passed the checks below are kept
        return found
    p = len(pipe)
    if p > spec.num_layers + 2:
        return float("inf"), 0.0
    lo, _ = layer_limits(spec.num_layers, p)
    if sum(lo) > spec.num_layers:
        return float("inf"), 0.0
    if (b, pattern) not in cache.links:  # transfers depend on the micro-batch size, not the count
        cache.links[b, pattern] = sum(_transfers(cluster, spec, b, pipe[s], pipe[s + 1], cache) for s in range(p - 1))
    links = cache.links[b, pattern]
    bound, opt, rows = _replica_bound(spec, cluster, profiles, pipe, b, m, lo, links, space, cache, monotone, zero_stage,
                                      key[-1])
    cache.replica[key], cache.rows[key] = (bound, opt), None if rows is None else rows + (links,)
    return cache.replica[key]


def _transfers(cluster, spec, b: int, ids, next_ids, cache: BoundCache) -> float:
    """Both transfers between two consecutive stages (eq. 6), memoised per pair of groups."""
    key = (b, ids, next_ids)
    found = cache.transfers.get(key)
    if found is None:
        found = cache.transfers[key] = sum(pipeline_transfers(cluster, spec, b, ids, next_ids))
    return found


def shared_state_caps(spec, cluster, profiles, skeleton: Skeleton, batches, space: RecomputeSpace,
                      cache: BoundCache) -> tuple[int, ...]:
    """Stage 1 with owned fractions to choose (eq. 8, 14): at each position the peers' fractions add up to 1, so
    besides every peer fitting its weights, gradients and activations with nothing owned, their room left,
    slack_d, must hold the position's optimizer state between them: sum_d slack_d / O_d >= 1 (Cephalo's
    aggregate memory). Per stage, the most layers for which the positions pass that test at shares adding up
    to one, each device at the recompute set with the least activations for that layer count (the sync
    buffer is left out): a cap on the stage's layers in any plan of the candidate."""
    key = (skeleton, tuple(batches))
    if key in cache.shared:
        return cache.shared[key]
    p, N = skeleton.num_stages, spec.num_layers
    caps = []
    for s in range(p):
        n = len(skeleton.pipelines[0][s])
        shares = possible_shares(spec, n, False)
        most = np.full((n, len(shares)), -1)  # per position and share: the most layers passing the test
        for k in range(n):
            for si, share in enumerate(shares):
                ok = np.ones(N + 1, dtype=bool)
                ratio = np.zeros(N + 1)
                for rho, pipe in enumerate(skeleton.pipelines):
                    b, m = batches[rho]
                    slot = _slot(spec, cluster, profiles, b, pipe[s][k], s, p, m)
                    slack, state = _slack(spec, slot, b, share, space, N, cache)
                    ok &= slack >= 0
                    with np.errstate(divide="ignore", invalid="ignore"):
                        ratio += np.where(state > 0, slack / np.where(state > 0, state, 1.0), np.inf)
                ok &= ratio >= 1
                most[k, si] = int(np.argmin(ok)) - 1 if not ok.all() else N
        caps.append(_cap_with_shares(shares, most, N))  # the ranks' shares add up to one
    cache.shared[key] = tuple(caps)
    return cache.shared[key]


def _slack(spec, slot, b: int, share: float, space, N: int, cache: BoundCache):
    """Per layer count L: the room a device has left for optimizer state with nothing owned (its weights,
    gradients, reserve and the least activations plus recompute buffer over the sets), and the optimizer bytes
    of all its weights (eq. 7, 8); memoised per device position."""
    key = (slot, b, share)
    if key not in cache.slack:
        Ls = np.arange(N + 1)
        t = slot_prices(slot, spec, b, share, space)
        edge = edge_cost(slot, spec, b, share)
        act = (slot.in_flight * Ls[None, :] * t.held_bytes[:, None] + t.transient_bytes[:, None] * (Ls[None, :] > 0)).min(axis=0)
        bare = device_memory(slot, spec, Ls, param_bytes=t.param_bytes, held_bytes=0.0, transient_bytes=0.0, edge=edge,
                             owned_fraction=0.0)
        cache.slack[key] = (slot.memory_bytes - (bare.peak_bytes + act),
                            np.asarray(optimizer_bytes(bare.weights_bytes, spec), dtype=float))
    return cache.slack[key]


def data_parallel_sync_bound(spec: ModelSpec, cluster: ClusterSpec, skeleton: Skeleton, cache: BoundCache) -> float:
    """A lower bound on the data-parallel sync (eq. 13, 15) of every stage-0/1 plan of the skeleton: replicas of one
    shape by their positions (``dp_sync_lower_bound``), of different shapes by their devices
    (``unlike_sync_lower_bound``, memoised by the replicas' device sets)."""
    if skeleton.one_shape:
        return dp_sync_lower_bound(spec, cluster, skeleton)
    return _by_device_sets(cache, None, skeleton, lambda: unlike_sync_lower_bound(spec, cluster, skeleton))


def layered_collectives_memo(spec: ModelSpec, cluster: ClusterSpec, skeleton: Skeleton, zero_stage: int,
                             cache: BoundCache) -> float:
    """``layered_collectives_bound``, memoised by the replicas' device sets."""
    return _by_device_sets(cache, zero_stage, skeleton,
                           lambda: layered_collectives_bound(spec, cluster, skeleton, zero_stage))


def _by_device_sets(cache: BoundCache, tag, skeleton: Skeleton, compute) -> float:
    """``compute()``, memoised under ``tag`` and the skeleton's replicas' device sets: rules 13 and 14 depend on
    nothing else."""
    key = (tag, tuple(sorted(tuple(sorted(d for stage in pipe for d in stage)) for pipe in skeleton.pipelines)))
    found = cache.device_sets.get(key)
    if found is None:
        found = cache.device_sets[key] = compute()
    return found


def dp_sync_lower_bound(spec: ModelSpec, cluster: ClusterSpec, skeleton: Skeleton) -> float:
    """Eq. 13, 15 for replicas of one shape: T_dp = the slowest position's group sync, at least max_s of
    ``_dp_sync_lines``' line of stage s at its layer count; minimised over real-valued layer splits (L_s within its
    limits, sum N) by bisection: a lower bound on every plan of the skeleton, whatever its batches and sharding
    stage."""
    lines = _dp_sync_lines(spec, cluster, skeleton)
    if lines is None:
        return 0.0
    N = spec.num_layers
    lo, hi = layer_limits(N, skeleton.num_stages)

    def layers_within(T):
        return sum(min(hi[s], (T - c) / a if a > 0 else hi[s]) if T >= a * lo[s] + c else -math.inf
                   for s, (a, c) in enumerate(lines))

    low, high = 0.0, max(a * hi[s] + c for s, (a, c) in enumerate(lines))
    if layers_within(low) >= N:
        return low
    for _ in range(60):
        mid = (low + high) / 2
        if layers_within(mid) >= N:
            high = mid
        else:
            low = mid
    return low


def unlike_sync_lower_bound(spec: ModelSpec, cluster: ClusterSpec, skeleton: Skeleton) -> float:
    """Eq. 13, 15 for replicas of different shapes (rule 13 of solver/README.md): a lower bound on T_dp of every plan
    of the skeleton at stage 0 or 1, whatever its layer splits, units, batches and shard ratios; 0 for one replica.

    Every group holding a piece of device d's parameters has at least one holder in each of the r replicas, so
    r or more holders, and its slowest link is, figure by figure, no faster than d's link to the holder in any
    other replica r'. Its collectives (an all-reduce, or a reduce-scatter and an all-gather padded to a largest
    shard of at least its parameters over its holders) then cost at least alpha P_g + beta, with alpha and beta
    the least over the devices x of r' of the slope and the fixed cost at r holders over link(d, x); both grow
    with the holders and with a slower link. Sched runs d's groups one after another, so T_dp >= alpha_d P_d +
    beta_d with P_d all that d holds (for every r'), and the devices of each replica hold every layer at least
    once between them (``_least_holding_time``)."""
    r = skeleton.num_replicas
    if r < 2:
        return 0.0
    return _least_holding_time(cluster, skeleton, _sync_line(spec, r), spec.num_layers * layer_param_count(spec, 1.0))


def unlike_sync_device_lines(spec: ModelSpec, cluster: ClusterSpec, skeleton: Skeleton) -> dict[str, tuple]:
    """Rule 13 device by device: for each device d of the skeleton, lines (a, b), one per other replica, with
    T_dp >= a P_d + b for each of them, P_d the parameters d holds, at stage 0 or 1, in every plan of the skeleton
    where d holds any (``unlike_sync_lower_bound`` is the least T at which a replica's devices could hold every layer
    so). Empty for one replica."""
    r = skeleton.num_replicas
    if r < 2:
        return {}
    lines = _device_lines(cluster, skeleton, _sync_line(spec, r))
    return {d: tuple(own) for pipe, per in zip(skeleton.pipelines, lines)
            for d, own in zip([d for stage in pipe for d in stage], per)}


def _sync_line(spec: ModelSpec, r: int):
    """Rule 13's cost line of one group of r or more holders over a link: (ms per parameter, fixed ms)."""
    e = spec.dtype_bytes

    def line(link) -> tuple[float, float]:
        # The cheaper of stage 0's all-reduce and stage 1's two ring passes at equal shards, slope and fixed cost
        # taken apart (the pointwise least of two lines lies above neither's own slope or fixed cost).
        stage0 = _affine(lambda x: allreduce_ms(x * e, r, link))
        stage1 = _affine(lambda x: sum(ring_step_ms(x / r * e, r, link, kind) for kind in RING_PASSES))
        return min(stage0[0], stage1[0]), min(stage0[1], stage1[1])

    return line


def layered_collectives_bound(spec: ModelSpec, cluster: ClusterSpec, skeleton: Skeleton, zero_stage: int) -> float:
    """A lower bound on eq. 17's collectives of every stage-2/3 plan of the skeleton (rule 14 of solver/README.md),
    whatever its units, batches and shard ratios, in closed form: ``layered.collectives_lower_bound`` prices every
    units choice as a plan (0.3 s a skeleton on 8 GPUs) and gives up past a limit.

    Each layer's reduce-scatter R_l and all-gather G_l is a sched of its unit groups, each with a holder in every
    replica: as in rule 13, over the devices of each replica holding the layer's parameters between them, one
    ring pass per group at r or more holders with a chunk of at least its parameters over its holders. The layer
    passes are counted from the schedule (``costmodel.layered_chain``: stage 2 runs R_l and G_l once per layer,
    stage 3 G_l twice and R_l once); the edges' collectives only add."""
    r = skeleton.num_replicas
    if r < 2:
        return 0.0
    e, layer = spec.dtype_bytes, layer_param_count(spec, 1.0)
    passes = {kind: _least_holding_time(cluster, skeleton,
                                        lambda link, kind=kind: _affine(lambda x: ring_step_ms(x / r * e, r, link, kind)),
                                        layer)
              for kind in RING_PASSES}
    chain = layered_chain(zero_stage, spec.num_layers)
    count = {kind: sum(1 for k, unit in chain if k == kind and isinstance(unit, int)) for kind in ("reduce", "gather")}
    return count["reduce"] * passes["reduce_scatter"] + count["gather"] * passes["all_gather"]


def _affine(cost) -> tuple[float, float]:
    """(ms per parameter, fixed ms) of ``cost(parameters)``, affine in them (eq. 5 and 13's ring passes)."""
    fixed = cost(0.0)
    return (cost(1e9) - fixed) / 1e9, fixed


def _least_holding_time(cluster: ClusterSpec, skeleton: Skeleton, line, need: float) -> float:
    """The largest over the replicas of the least T at which their devices could hold ``need`` parameters between
    them, each device d at most P with alpha_d P + beta_d <= T for every other replica r' (alpha and beta the least
    slope and fixed cost of ``line(link)`` over d's links to the devices of r'); a device may hold nothing, at no
    cost. Bisection from below: the bound stays valid whatever the rounding."""
    per_replica = _device_lines(cluster, skeleton, line)

    def held(lines, T: float) -> float:
        total = 0.0
        for device in lines:
            most = math.inf
            for a, b in device:
                most = min(most, 0.0 if T < b else ((T - b) / a if a > 0 else math.inf))
            total += most
        return total

    bound = 0.0
    for lines in per_replica:
        if held(lines, 0.0) >= need:
            continue
        lo, hi = 0.0, max(b for device in lines for _, b in device) + 1.0
        while held(lines, hi) < need:
            hi *= 2
        while hi - lo > 1e-9 * hi:
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if held(lines, mid) >= need else (mid, hi)
        bound = max(bound, lo)
    return bound


def _device_lines(cluster: ClusterSpec, skeleton: Skeleton, line) -> list[list[list[tuple[float, float]]]]:
    """Per replica, per device (stage by stage, rank order), per other replica r': the least slope and the least
    fixed cost of ``line(link)`` over the device's links to the devices of r'."""
    r = skeleton.num_replicas
    devices = [[d for stage in pipe for d in stage] for pipe in skeleton.pipelines]
    memo: dict = {}

    def pair(d: str, x: str) -> tuple[float, float]:
        link = cluster.slowest_link([d, x])
        if link not in memo:
            memo[link] = line(link)
        return memo[link]

    out = []
    for i, own in enumerate(devices):
        lines = []
        for d in own:
            others = [[pair(d, x) for x in devices[j]] for j in range(r) if j != i]
            lines.append([(min(a for a, _ in o), min(b for _, b in o)) for o in others])
        out.append(lines)
    return out


def _dp_sync_lines(spec: ModelSpec, cluster: ClusterSpec, skeleton: Skeleton):
    """Per stage s, (a, c): its slowest position's group sync (eq. 13, 15) is at least a L + c with L layers (None:
    unlike or single replicas, no positions). A stage s of n_s ranks has a rank at share >= 1/n_s, whose group holds
    at least P_s(L) = layer_param_count(1/n_s) L + edge_param_count(1/n_s) parameters; its sync costs at least the
    cheapest line among the stage's positions at P_s(L) (at stage 1 the largest shard is >= P/r: the cheaper of the
    all-reduce of P and the two ring passes of P/r, equal without measured pass figures)."""
    r, p, N = skeleton.num_replicas, skeleton.num_stages, spec.num_layers
    if r == 1 or p > N + 2 or not skeleton.one_shape:
        return None
    lines = []
    for s in range(p):
        n = len(skeleton.pipelines[0][s])
        # The cheaper of stage 0's all-reduce and stage 1's two passes at equal parts (its least largest shard),
        # which need not cost the same when a link has measured pass figures.
        ends = [(min(group_sync_ms(cluster, spec, peers, 0.0, 0.0, 0), group_sync_ms(cluster, spec, peers, 0.0, 0.0, 1)),
                 min(group_sync_ms(cluster, spec, peers, 1e9, 1e9, 0), group_sync_ms(cluster, spec, peers, 1e9, 1e9 / r, 1)))
                for peers in ([pipe[s][k] for pipe in skeleton.pipelines] for k in range(n))]
        fixed = min(e[0] for e in ends)
        slope = min(e[1] - e[0] for e in ends) / 1e9  # ms per parameter
        a, c = layer_param_count(spec, 1.0 / n), edge_param_count(spec, 1.0 / n, first=s == 0, last=s == p - 1)
        lines.append((slope * a, slope * c + fixed))
    return lines


def _dp_sync_rows(spec: ModelSpec, cluster: ClusterSpec, skeleton: Skeleton):
    """D[s, L] = ``_dp_sync_lines`` at every layer count L (None where it has none)."""
    lines = _dp_sync_lines(spec, cluster, skeleton)
    if lines is None:
        return None
    Ls = np.arange(spec.num_layers + 1)
    return np.array([a * Ls + c for a, c in lines])


def _replica_bound(spec, cluster, profiles, pipe, mb, m, lo, links, space, cache, monotone, zero_stage=0, owned=1.0) -> tuple[float, float]:
    """(pipeline bound, least optimizer step of its devices) of one replica."""
    p, N = len(pipe), spec.num_layers
    keys = tuple(_stage_keys(cluster, pipe, mb, m, cache, monotone, zero_stage, owned))
    if (keys, m) not in cache.pipeline:
        rows = [_stage_row(spec, cluster, profiles, pipe, s, key, mb, m, space, cache, monotone, zero_stage, owned)
                for s, key in enumerate(keys)]
        tau, tau_b, edge, edge_b, cap, per_fb, per_b, opts = (list(x) for x in zip(*rows))
        tau, edge, cap, lo_a = np.array(tau), np.array(edge), np.array(cap), np.array(lo)
        if np.any(cap < lo_a) or cap.sum() < N or not np.all(np.isfinite(tau)):
            cache.pipeline[keys, m] = None
        else:
            c, cb = _stage_costs(per_fb, edge, N), _stage_costs(per_b, np.array(edge_b), N)
            cache.pipeline[keys, m] = (_pipeline_bound(c, cap, lo_a, N, m),
                                       _chain_bound(c, cb, tau, edge, cap, lo_a, N, m, p), max(opts),
                                       (m, c, cap, lo_a, cb, tau, edge))
    found = cache.pipeline[keys, m]
    if found is None:
        return float("inf"), 0.0, None
    one_f_one_b, chain, opt, row = found
    return max(one_f_one_b, chain + links), opt, row


def replica_rate_bound(spec, cluster, profiles, pipe, b: int, space, cache: BoundCache, monotone=None, *,
                       zero_stage: int = 0, owned: float | None = None, pattern=None) -> tuple[float, float]:
    """(a, least optimizer step): on m micro-batches of b, every bound of the replica (1F1B, interleaved, layer by
    layer) is at least m a, for every m >= 1. Pipelined (stages 0, 1): a = min over layer splits of the slowest
    stage's F + B with one micro-batch in flight. The 1F1B bound is m min_split max_s c_s(L_s) at m's in-flight
    counts, and more in flight only shrinks the layer caps and raises a tied stage's per-layer time (the cheapest
    set that still fits), so it is at least m a; the interleaved bound is that with one in flight and every stage
    at least one layer (lo_s <= 1 here). Layered (stages 2, 3): ``layered_replica_bound`` at m = 1, which is linear
    in m. The step is ``replica_bound``'s (it does not depend on m)."""
    pattern = pattern if pattern is not None else replica_pattern(cluster, pipe)
    owned = (1.0 if zero_stage == 0 else 0.0) if owned is None else owned
    memo = ("rate", b, pattern, bool(monotone), zero_stage, owned)
    if memo in cache.replica:
        return cache.replica[memo]
    p, N = len(pipe), spec.num_layers
    if zero_stage in (2, 3):
        found = (layered_replica_bound(spec, cluster, profiles, pipe[0], b, 1, space, cache, zero_stage), 0.0)
    elif p > N + 2 or sum(layer_limits(N, p)[0]) > N:
        found = (math.inf, 0.0)
    else:
        found = _one_in_flight(spec, cluster, profiles, pipe, b, space, cache, monotone, zero_stage, owned,
                               np.array(layer_limits(N, p)[0]))
    cache.replica[memo] = found
    return found


def _one_in_flight(spec, cluster, profiles, pipe, b, space, cache, monotone, zero_stage, owned, lo) -> tuple[float, float]:
    """(min over layer splits, L_s >= ``lo``, of the slowest stage's F + B with one micro-batch in flight, least
    optimizer step of the replica's devices); inf where no split fits."""
    N = spec.num_layers
    rows = _stage_rows(spec, cluster, profiles, pipe, b, 1, space, cache, monotone, zero_stage, owned)
    tau, _, edge, _, cap, per_fb, _, opts = (list(x) for x in zip(*rows))
    cap = np.array(cap)
    if np.any(cap < lo) or cap.sum() < N or not np.all(np.isfinite(tau)):
        return float("inf"), 0.0
    return _least_largest(_stage_costs(per_fb, np.array(edge), N), cap, lo, N), max(opts)


def splits_lower_bound(spec, cluster, profiles, skeleton: Skeleton, sizes, classes, patterns, global_batch: int,
                       space, cache: BoundCache, monotone=None, *, zero_stage: int = 0, owned: float | None = None,
                       extra_ms: float = 0.0) -> float:
    """A lower bound on every candidate of the skeleton at the stage, whatever its batch split: replica i runs
    m_i >= 1 micro-batches of some b_i of ``sizes[i]`` with sum_i b_i m_i = G. A candidate's bound is at least its
    slowest replica's, at least m_i a_i(b_i) (``replica_rate_bound``), plus the skeleton's constant (no sync) and
    the largest of its replicas' least optimizer steps. Within T a replica of class c thus runs at most
    n_c(T) = max_b b floor(T / a_c(b)) samples, so T must satisfy sum_i n_{c(i)}(T) >= G, and T >= max_c min_b
    a_c(b) (every replica runs a micro-batch): the least such T is a breakpoint of n (``_least_time_for``).
    ``owned``: what the candidates' bounds may assume at stage 1 (less only lowers this bound). ``extra_ms``:
    a bound on what every candidate pays on top whatever its split (the sync of rule 13, the collectives of rule 14). Lets
    the structured family list a skeleton's splits only when this bound reaches the front of the search."""
    per, floor, step = [], 0.0, 0.0
    for ids in class_members(classes).values():
        i = ids[0]
        rates = [(b,) + replica_rate_bound(spec, cluster, profiles, skeleton.pipelines[i], b, space, cache, monotone,
                                           zero_stage=zero_stage, owned=owned, pattern=patterns[i]) for b in sizes[i]]
        rates = [x for x in rates if math.isfinite(x[1])]
        if not rates:
            return math.inf
        floor = max(floor, min(a for _, a, _ in rates))
        step = max(step, min(o for _, _, o in rates))
        per.append((len(ids), [(b, a) for b, a, _ in rates]))
    least = _least_time_for(per, global_batch, floor)
    return least + skeleton_constant(spec, cluster, skeleton, cache, sync=False, classes=classes) + step + extra_ms


_BREAKPOINT_SLACK = 1e-13
"""Relative nudge around a breakpoint k a of ``_least_time_for``: far above floating-point error in k a / a, far
below any gap the search is asked for."""
_MOST_BREAKPOINTS = 20_000
"""Beyond this many breakpoints (global batches of thousands) bisection is cheaper than sorting them."""


def _least_time_for(per, global_batch: int, floor: float) -> float:
    """A lower bound, within a relative 1e-13, on the least T >= ``floor`` with n(T) = sum over classes of
    count * max_b b min(G // b, floor(T / a_b)) >= G (``splits_lower_bound``); ``per``: (count, [(b, a_b), ...])
    per class. n is a step function that steps up only at T = k a_b, so the least T is ``floor`` or one of those
    breakpoints, found by binary search over them (a tenth of the calls of bisecting T to 1e-12, which it
    replaced). Each breakpoint is tested just above itself and returned just below, so floating-point rounding
    of k a_b / a_b can only lower the result; inf where no T places G samples."""
    G = global_batch

    def samples(T: float) -> int:
        return sum(n * max(b * min(G // b, int(T / a)) if a > 0 else G for b, a in rates) for n, rates in per)

    up, down = 1.0 + _BREAKPOINT_SLACK, 1.0 - _BREAKPOINT_SLACK
    if samples(floor * up) >= G:
        return floor
    if sum(G // b for _, rates in per for b, a in rates if a > 0) > _MOST_BREAKPOINTS:
        lo = hi = floor
        while samples(hi) < G:
            if hi > 1e300:
                return math.inf
            hi *= 2
        while hi - lo > 1e-12 * hi:  # lo stays below the least T: the bound stays valid whatever the rounding
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if samples(mid) >= G else (mid, hi)
        return lo
    points = np.unique(np.concatenate([np.arange(1, G // b + 1) * a for _, rates in per for b, a in rates if a > 0]))
    points = points[points > floor]
    lo, hi = 0, len(points)
    while lo < hi:
        mid = (lo + hi) // 2
        if samples(float(points[mid]) * up) >= G:
            hi = mid
        else:
            lo = mid + 1
    return max(floor, float(points[lo]) * down) if lo < len(points) else math.inf


def interleaved_replica_bound(spec, cluster, profiles, pipe, b: int, m: int, space, cache: BoundCache, monotone=None, *,
                              zero_stage: int = 0, owned: float | None = None, pattern=None) -> tuple[float, float]:
    """(pipeline bound, least optimizer step) of one replica under interleaved 1F1B, whatever its chunks
    (docs/schedules.md): every group runs the forward and backward of each of its layers once per micro-batch,
    the first and last group their embedding and head too, and every group holds a layer, so
    m min over splits of max_s c_s(L_s), L_s >= 1, bounds its pipeline. Right after a device's forward of
    micro-batch 0 through its last chunk it still holds that micro-batch's activations of every chunk (no
    backward of it can have run), so its peak is at least 1F1B's with one micro-batch in flight: the layer caps
    and the per-layer times (recomputation to fit) of a stage holding one micro-batch hold here too. No fill or
    drain: weaker than ``replica_bound``, valid for every chunk count."""
    p, N = len(pipe), spec.num_layers
    if p < 2 or p > N:
        return float("inf"), 0.0
    owned = (1.0 if zero_stage == 0 else 0.0) if owned is None else owned
    pattern = pattern if pattern is not None else replica_pattern(cluster, pipe)
    memo = ("interleaved", b, m, pattern, bool(monotone), zero_stage, owned)
    if memo not in cache.replica:
        cache.replica[memo] = _interleaved_replica_bound(spec, cluster, profiles, pipe, b, m, space, cache, monotone,
                                                         zero_stage, owned)
    return cache.replica[memo]


def _interleaved_replica_bound(spec, cluster, profiles, pipe, b, m, space, cache, monotone, zero_stage, owned):
    least, opt = _one_in_flight(spec, cluster, profiles, pipe, b, space, cache, monotone, zero_stage, owned,
                                np.ones(len(pipe), dtype=int))
    return m * least, opt


def _stage_rows(spec, cluster, profiles, pipe, mb, m, space, cache, monotone, zero_stage, owned) -> list:
    """``_stage_bound`` of every stage of ``pipe`` on m micro-batches, memoised: a stage's figures depend on its
    group up to interchangeable nodes and on its position and in-flight count only."""
    return [_stage_row(spec, cluster, profiles, pipe, s, key, mb, m, space, cache, monotone, zero_stage, owned)
            for s, key in enumerate(_stage_keys(cluster, pipe, mb, m, cache, monotone, zero_stage, owned))]


def _stage_keys(cluster, pipe, mb, m, cache, monotone, zero_stage, owned) -> list:
    """What each stage's ``_stage_bound`` depends on: its group up to interchangeable nodes, its position and
    in-flight count."""
    p, keys = len(pipe), []
    for s, ids in enumerate(pipe):
        if ids not in cache.group_pattern:
            cache.group_pattern[ids] = replica_pattern(cluster, (ids,))
        keys.append((mb, s == 0, s == p - 1, min(p - s, m), cache.group_pattern[ids], bool(monotone), zero_stage, owned))
    return keys


def _stage_row(spec, cluster, profiles, pipe, s, key, mb, m, space, cache, monotone, zero_stage, owned):
    if key not in cache.stage:
        cache.stage[key] = _stage_bound(spec, cluster, profiles, pipe[s], s, len(pipe), m, mb, space, cache, monotone,
                                        zero_stage, owned)
    return cache.stage[key]


def _stage_costs(per_layer, edge, N: int) -> np.ndarray:
    """c[s, L]: stage s's time per micro-batch holding L layers, L times its per-layer time at L (``per_layer[s]``,
    by L) plus its embedding/head time ``edge[s]``."""
    Ls = np.arange(N + 1)
    with np.errstate(invalid="ignore"):
        return np.where(Ls[None, :] > 0, Ls[None, :] * np.array(per_layer), 0.0) + np.asarray(edge)[:, None]


def interleaved_candidate_bound(spec: ModelSpec, cluster: ClusterSpec, profiles: ProfileSet, skeleton: Skeleton, batches,
                                space: RecomputeSpace, cache: BoundCache, monotone: dict | None = None, *,
                                zero_stage: int = 0, sync: bool = True, patterns=None) -> float:
    """``candidate_lower_bound``'s terms for the candidate run interleaved, at equal parts (the space offered):
    ``interleaved_replica_bound`` per replica (no joint split), and the tied embedding sync, the data-parallel
    sync and the optimizer step, which do not depend on the schedule."""
    owned = bound_owned(skeleton.num_replicas, zero_stage, True)
    patterns = patterns if patterns is not None else [replica_pattern(cluster, pipe) for pipe in skeleton.pipelines]
    best, opt = 0.0, 0.0
    for pipe, (b, m), pattern in zip(skeleton.pipelines, batches, patterns):
        rb, ro = interleaved_replica_bound(spec, cluster, profiles, pipe, b, m, space, cache, monotone,
                                           zero_stage=zero_stage, owned=owned, pattern=pattern)
        if not math.isfinite(rb):
            return float("inf")
        best, opt = max(best, rb), max(opt, ro)
    return best + skeleton_constant(spec, cluster, skeleton, cache, sync=sync) + opt


def _stage_bound(spec, cluster, profiles, ids, s, p, m, mb, space, cache, monotone, zero_stage=0, owned=1.0):
    """(tau, tau_b, edge F+B, edge B, layer cap, per-layer F+B by L, per-layer B by L, least optimizer step)
    of one stage at its position."""
    N = spec.num_layers
    gk = _group_key(cluster, ids)
    if (mb, gk) not in cache.tau:
        cache.tau[mb, gk] = (stage_layer_lower_bound(spec, cluster, profiles, mb, ids),
                             stage_layer_lower_bound(spec, cluster, profiles, mb, ids, "b"))
    tau, tau_b = cache.tau[mb, gk]
    slots = [_slot(spec, cluster, profiles, mb, i, s, p, m) for i in ids]
    Umax = max(valid_unit_counts(spec))
    # Stages are tied as in solver/instance.py: not at stage 1 with owned fractions to choose (owned 0 here).
    tied = ((len(gk[0]) == 1 or len(set(gk[0])) == 1) and Umax % len(ids) == 0 and bool(monotone and monotone.get(gk[0][0][0]))
            and owned > 0)
    const = stage_constants(cluster, spec, mb, ids, first=s == 0, last=s == p - 1)
    low = [edge_lower_bounds(spec, x, mb, possible_shares(spec, len(ids), tied)) for x in slots]
    edge = max(x[0] for x in low) + const.edge_fwd_comm_ms + const.edge_bwd_comm_ms
    edge_b = max(x[1] for x in low) + const.edge_bwd_comm_ms
    # Every device steps at least its embedding/head weights (eq. 10); at stage 1 it may own none of them.
    opt = max(x.optimizer_ms_per_byte * lo_[2] for x, lo_ in zip(slots, low)) * owned
    ck = (mb, gk[0], s == 0, s == p - 1, slots[0].in_flight, tied, owned)
    if ck not in cache.cap:
        cache.cap[ck] = stage_layer_cap(spec, cluster, profiles, mb, ids, s, p, m, space, N, tied, owned)
    if tied:
        pk = ck + (gk[1],)  # the per-layer time includes the group's all-reduces: its link matters
        if pk not in cache.per_layer:
            cache.per_layer[pk] = tied_per_layer(spec, cluster, profiles, mb, ids, s, p, m, space, N, owned)
        fb, bb = cache.per_layer[pk]
        per_fb, per_b = np.maximum(fb, tau), np.maximum(bb, tau_b)
    else:
        per_fb, per_b = np.full(N + 1, tau), np.full(N + 1, tau_b)
    return tau, tau_b, edge, edge_b, cache.cap[ck], per_fb, per_b, opt


def _fill_cost(tau, edge, caps, lo, N):
    """min sum_s (L_s tau_s + E_s) with lo <= L <= caps, sum L = N (caps: rows = scenarios); inf if impossible."""
    caps = np.atleast_2d(caps)
    need = np.full((caps.shape[0], 1), N - lo.sum())
    cost = _cheapest_extra(tau, np.clip(caps - lo, 0, None), need)[:, 0] + (lo * tau).sum() + edge.sum()
    return np.where(np.all(caps >= lo, axis=1), cost, np.inf)


def _caps_from(values, term, cap):
    """Largest L per stage with term[s, L] <= T for each threshold T (term non-decreasing in L, ``values`` sorted
    and unique): the count of a row's entries at or below T, less one. One search of every entry among the
    thresholds and a running count, rather than a search per stage (tens of thousands of replicas each)."""
    V, p = len(values), term.shape[0]
    first = np.searchsorted(values, term, side="left")  # first threshold an entry is at or below (V: none)
    first += np.arange(0, p * (V + 1), V + 1)[:, None]
    counts = np.bincount(first.ravel(), minlength=p * (V + 1)).reshape(p, V + 1)[:, :V].cumsum(axis=1)
    return np.minimum(counts.T - 1, cap[None, :]).astype(float)


def _pipeline_bound(c, cap, lo, N, m) -> float:
    """m * min over splits of max_s c_s(L_s) (inf where no split fits)."""
    return m * _least_largest(c, cap, lo, N)


def _chain_bound(c, cb, tau, edge, cap, lo, N, m, p) -> float:
    """min over splits of [sum_s c_s + max_b ((m - 1 - w_b) c_b + w_b B_b)], w_b = min(p - b - 1, m - 1).

    For stage b: its first backward cannot start before micro-batch 0 has gone forward through b and
    forward and backward through every later stage; after that b still runs m backwards and
    m - 1 - w_b forwards; then the last backward goes down through the earlier stages.
    The sum is bounded below with each stage's cheapest per-layer time (tau), the max term exactly.
    """
    w = np.array([min(p - b - 1, m - 1) for b in range(p)], dtype=float)
    k = m - 1 - w
    with np.errstate(invalid="ignore"):
        term = k[:, None] * c + w[:, None] * cb
    term = np.where(np.isnan(term), np.inf, term)
    values = np.unique(np.concatenate([[0.0], term[np.isfinite(term)]]))
    caps = _caps_from(values, term, cap)
    cost = _fill_cost(tau, edge, caps, lo, N)
    total = values + cost
    return float(total.min()) if np.isfinite(total).any() else float("inf")


def tied_per_layer(spec, cluster, profiles, mb, ids, s, p, m, space, N, owned: float = 1.0):
    """For a tied stage (equal shares, one recompute set): per-layer F + B and B alone as functions of
    the layer count L: the cheapest recompute set that still fits L layers (eq. 8), all-reduces included."""
    n = len(ids)
    slot = _slot(spec, cluster, profiles, mb, ids[0], s, p, m)
    t = slot_prices(slot, spec, mb, 1.0 / n, space)
    ar = layer_allreduce_ms(cluster, spec, mb, ids)
    fits = fitting_layers(slot, spec, mb, 1.0 / n, space, N, owned)
    b_all = t.block_bwd_ms().sum(axis=1) + ar  # with what offloading adds (eq. 2o)
    fb_all = t.block_fwd_ms().sum(axis=1) + ar + b_all
    # Sets in decreasing order of the layers they fit; the cheapest set fitting at least L layers is a running
    # minimum over a prefix of that order.
    order = np.argsort(-fits, kind="stable")
    fb_run, b_run = np.minimum.accumulate(fb_all[order]), np.minimum.accumulate(b_all[order])
    count = np.searchsorted(-fits[order], -np.arange(N + 1), side="right")  # sets with fits >= L
    fb = np.where(count > 0, fb_run[np.maximum(count - 1, 0)], np.inf)
    bb = np.where(count > 0, b_run[np.maximum(count - 1, 0)], np.inf)
    return fb, bb


def layered_replica_bound(spec, cluster, profiles, ids, b: int, m: int, space, cache: BoundCache, zero_stage: int) -> float:
    """Stages 2 and 3 (eq. 17): a one-stage replica's own compute, m (N tau + edges), with nothing recomputed at
    the most favourable shares; eq. 17 is at least every replica's compute (a sum of per-segment maxima) plus
    the collectives. Infinite when a device cannot fit owning nothing (``_layered_room``). It does not decrease
    with the count (linear in m; more micro-batches in flight)."""
    rooms = [_layered_state(spec, cluster, profiles, i, b, m, len(ids), space, cache, zero_stage)[0] for i in ids]
    if any(len(room) == 0 or room.max() < 0 for room in rooms):  # more ranks than units, or a device that cannot hold
        return float("inf")  # even its part owning nothing, at its leanest share and set
    key = ("layered", b, tuple(ids))
    if key not in cache.tau:
        tau = stage_layer_lower_bound(spec, cluster, profiles, b, ids)
        slots = [_slot(spec, cluster, profiles, b, i, 0, 1, 1) for i in ids]
        low = [edge_lower_bounds(spec, x, b, possible_shares(spec, len(ids), False)) for x in slots]
        const = stage_constants(cluster, spec, b, ids, first=True, last=True)
        cache.tau[key] = spec.num_layers * tau + max(x[0] for x in low) + const.edge_fwd_comm_ms + const.edge_bwd_comm_ms
    return m * cache.tau[key]


def layered_lower_bound(spec, cluster, profiles, skeleton: Skeleton, batches, space, cache: BoundCache | None = None, *,
                        zero_stage: int, collectives: float | None = None) -> float:
    """A lower bound on every stage-2/3 plan of the candidate: the slowest replica's compute
    (``layered_replica_bound``) plus ``collectives`` when given (the skeleton's least collectives over its units
    at equal parts, ``layered.collectives_lower_bound``; not ``dp_sync_lower_bound``, which takes a reduce-scatter
    and an all-gather to cost an all-reduce, while a link may have measured figures of its own for each pass).
    Replicas of one stage hold no tied-embedding copy (eq. 11's term is 0). Eq. 17 is at least every replica's
    compute plus every collective. Infinite when the state cannot fit (``_layered_state_fits``)."""
    cache = cache or BoundCache()
    codes = device_codes(cluster)[1]
    alike = {}  # replicas of the same devices' kinds on one batch have one bound: a skeleton may hold 1,024
    for pipe, batch in zip(skeleton.pipelines, batches):
        alike.setdefault((tuple(codes[i] for i in pipe[0]), batch), pipe[0])
    best = max(layered_replica_bound(spec, cluster, profiles, ids, b, m, space, cache, zero_stage)
               for (_, (b, m)), ids in alike.items())
    if math.isfinite(best) and not _layered_state_fits(spec, cluster, profiles, skeleton, batches, space, cache, zero_stage):
        return float("inf")
    return best + skeleton_constant(spec, cluster, skeleton, cache, sync=False) + (collectives or 0.0)


def _layered_state(spec, cluster, profiles, device_id: str, b: int, m: int, n: int, space, cache: BoundCache,
                   zero_stage: int):
    """Per share a rank of a one-stage replica of TP size n may get (``possible_shares``): (its room left at stage
    2 or 3 owning nothing, at the recompute set with the least memory and no staging buffer: capacity - peak(0);
    the bytes owning everything adds, peak(1) - peak(0)). Eq. 18 is linear in the owned fraction phi (the owned
    gradients, the optimizer state and, at stage 3, the owned layer weights). Memoised, first by device (finding
    its slot is most of the cost of a repeated call), then by slot (alike devices share the figures)."""
    by_device = ("layered-state-of", device_id, b, m, n, zero_stage)
    if by_device in cache.slack:
        return cache.slack[by_device]
    slot = device_slot(cluster, profiles, spec, b, device_id, stage=0, num_stages=1, num_microbatches=m, layered=True)
    key = ("layered-state", slot, b, n, zero_stage)
    if key not in cache.slack:
        N = spec.num_layers
        room, state = [], []
        for share in possible_shares(spec, n, False):
            t = slot_prices(slot, spec, b, share, space.plain)  # layered plans do not offload
            edge = edge_cost(slot, spec, b, share)
            def peak(owned, held, transient):
                return device_memory(slot, spec, N, param_bytes=t.param_bytes, held_bytes=held, transient_bytes=transient,
                                     edge=edge, owned_fraction=owned, zero_stage=zero_stage, owned_layer_fraction=owned).peak_bytes
            room.append(slot.memory_bytes - float(np.min(peak(0.0, t.held_bytes, t.transient_bytes))))
            state.append(float(peak(1.0, 0.0, 0.0) - peak(0.0, 0.0, 0.0)))
        cache.slack[key] = (np.array(room), np.array(state))
    cache.slack[by_device] = cache.slack[key]
    return cache.slack[key]


def _layered_state_fits(spec, cluster, profiles, skeleton: Skeleton, batches, space, cache: BoundCache, zero_stage: int) -> bool:
    """Replicas of one shape at stage 2 or 3: at each position the peers' owned fractions add up to 1 and each
    device fits only if phi_d <= room_d / state_d, so the peers' sum of room_d / state_d must reach 1 at the
    position's share (Cephalo's aggregate memory; every peer has the same share); and the positions' largest
    shares passing that test must add up to at least 1 (the shares of a plan do). Replicas of
    different shapes take equal parts (solver/layered.py): every device owns 1/n_g of each group it holds, n_g at
    most the skeleton's device count D, so it must fit owning 1/D."""
    if not skeleton.one_shape:
        D = sum(len(pipe[0]) for pipe in skeleton.pipelines)
        for pipe, (b, m) in zip(skeleton.pipelines, batches):
            for i in pipe[0]:
                room, state = _layered_state(spec, cluster, profiles, i, b, m, len(pipe[0]), space, cache, zero_stage)
                if np.all(room < state / D * (1 - 1e-9)):
                    return False
        return True
    largest, codes = [], device_codes(cluster)[1]
    for k in range(len(skeleton.pipelines[0][0])):
        peers: dict = {}  # alike devices on one batch have one row: (device, batch) -> how many peers
        for pipe, batch in zip(skeleton.pipelines, batches):
            i = pipe[0][k]
            first, count = peers.get((codes[i], batch), (i, 0))
            peers[codes[i], batch] = (first, count + 1)
        n = len(skeleton.pipelines[0][0])
        rows = [(_layered_state(spec, cluster, profiles, i, b, m, n, space, cache, zero_stage), count)
                for (_, (b, m)), (i, count) in peers.items()]
        ok = np.all([room >= 0 for (room, _), _ in rows], axis=0)
        with np.errstate(divide="ignore", invalid="ignore"):
            total = np.sum([count * np.where(state > 0, room / np.where(state > 0, state, 1.0), np.inf)
                            for (room, state), count in rows], axis=0)
        ok &= total >= 1 - 1e-9  # loose: the evaluator's sums may round the other way
        shares = np.array(possible_shares(spec, n, False))
        if not ok.any():
            return False
        largest.append(float(shares[ok].max()))
    return sum(largest) >= 1 - 1e-9
