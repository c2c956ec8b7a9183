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
"""
from __future__ import annotations

import math

import numpy as np

from baton.cluster import ClusterSpec
from baton.costmodel import (device_slot, edge_cost, embedding_sync_ms, stage_constants, layer_allreduce_ms, layer_cost, layer_limits, layer_prices,
                             layer_train_ms, fitting_layers, pipeline_transfers)
from baton.memory import RecomputeSpace
from baton.model_spec import ModelSpec
from baton.profile import ProfileSet

from solver.options import valid_unit_counts
from solver.space import Skeleton, replica_pattern


def _layer_ms(profile, spec, mb, share, part="fb") -> float:
    """fwd + bwd (part 'fb') or bwd only (part 'b') of one layer, no recomputation (eq. 2)."""
    if part == "fb":
        return layer_train_ms(profile, spec, mb, share)
    return sum(layer_cost(profile, spec, mb, share).bwd_ms.values())


def stage_layer_lower_bound(spec, cluster, profiles, mb, ids, part="fb") -> float:
    """Smallest possible per-layer F + B (or B alone) of a TP group, all-reduces included, memory ignored."""
    n = len(ids)
    Umax = max(valid_unit_counts(spec))
    ar = layer_allreduce_ms(cluster, spec, mb, ids) * (2 if part == "fb" else 1)
    if n == 1:
        return _layer_ms(profiles[cluster.device(ids[0]).gpu.name], spec, mb, 1.0, part) + ar
    if n > Umax:
        return float("inf")
    # g_d(k) = time of device d at share k/Umax; find min t with sum_d max{k : g_d(k) <= t} >= Umax.
    tables = []
    for i in ids:
        prof = profiles[cluster.device(i).gpu.name]
        tables.append([_layer_ms(prof, spec, mb, k / Umax, part) for k in range(1, Umax - n + 2)])
    for t in sorted({v for tab in tables for v in tab}):
        total = 0
        for tab in tables:
            ks = [k + 1 for k, v in enumerate(tab) if v <= t]
            if not ks:
                total = -1
                break
            total += max(ks)
        if total >= Umax:
            return t + ar
    return float("inf")


def _slot(spec, cluster, profiles, mb, device_id, s, p, m):
    return device_slot(cluster, profiles, spec, mb, device_id, stage=s, num_stages=p, num_microbatches=m)


def possible_shares(spec, n: int, tied: bool) -> list[float]:
    """Every share a rank of an n-device group can get (only the equal one when the stage is tied)."""
    Umax = max(valid_unit_counts(spec))
    return [1.0 / n] if tied else [k / Umax for k in range(1, Umax - n + 2)]


def edge_lower_bounds(spec, slot, mb, shares) -> tuple[float, float, float]:
    """(fwd + bwd, bwd, parameter bytes) of a device's embedding/head, each the least over its possible
    shares: the vocabulary is split like the units, so a smaller share costs less."""
    edges = [edge_cost(slot, spec, mb, r) for r in shares]
    if not edges:  # more ranks than units: the group cannot exist
        return math.inf, math.inf, math.inf
    return (min(e.fwd_ms + e.bwd_ms for e in edges), min(e.bwd_ms for e in edges), min(e.param_bytes for e in edges))


def stage_layer_cap(spec, cluster, profiles, mb, ids, s, p, m, space: RecomputeSpace, N: int, tied: bool) -> int:
    """Upper bound on the layers stage s can hold: every device at its least memory-hungry recompute set,
    maximised over the shares it may get (only the equal share when the stage is tied, see instance.py)."""
    n = len(ids)
    shares = possible_shares(spec, n, tied)
    if not shares:
        return -1
    cap = N
    for i in ids:
        slot = _slot(spec, cluster, profiles, mb, i, s, p, m)
        best = max(int(fitting_layers(slot, spec, mb, sh, space, N).max()) for sh in shares)
        cap = min(cap, best)
    return cap


class BoundCache:
    """Memo of per-group figures: many skeletons share the same TP groups."""

    def __init__(self):
        self.tau: dict = {}
        self.cap: dict = {}
        self.per_layer: dict = {}
        self.replica: dict = {}
        self.stage: dict = {}


def _group_key(cluster, ids):
    devs = [cluster.device(i) for i in ids]
    link = cluster.slowest_link(list(ids))
    return (tuple(sorted((d.gpu.name, d.memory_bytes, d.reserve_bytes) for d in devs)),
            link)


def candidate_lower_bound(spec: ModelSpec, cluster: ClusterSpec, profiles: ProfileSet, skeleton: Skeleton, mb: int,
                          global_batch: int, space: RecomputeSpace, cache: BoundCache | None = None,
                          monotone: dict | None = None) -> float:
    """A lower bound on every plan of the candidate: the slowest replica's pipeline bound, the tied
    embedding sync, and the least optimizer step of any device.

    A replica is bounded once per ``replica_pattern`` (the same replica on other nodes of the same kinds
    costs the same), here and across candidates: large clusters repeat one replica hundreds of times."""
    cache = cache or BoundCache()
    r, p, N = skeleton.num_replicas, skeleton.num_stages, spec.num_layers
    m = global_batch // (mb * r)
    if p > N + 2:
        return float("inf")
    lo, _ = layer_limits(N, p)
    if sum(lo) > N:
        return float("inf")
    best, opt = 0.0, 0.0
    for pipe in skeleton.pipelines:
        key = (mb, m, replica_pattern(cluster, pipe), bool(monotone))
        if key not in cache.replica:
            links = sum(sum(pipeline_transfers(cluster, spec, mb, pipe[s], pipe[s + 1])) for s in range(p - 1))
            cache.replica[key] = _replica_bound(spec, cluster, profiles, pipe, mb, m, lo, links, space, cache, monotone)
        rb, ro = cache.replica[key]
        if not math.isfinite(rb):
            return float("inf")
        best, opt = max(best, rb), max(opt, ro)
    return best + embedding_sync_ms(cluster, spec, skeleton.pipelines) + opt


def _replica_bound(spec, cluster, profiles, pipe, mb, m, lo, links, space, cache, monotone) -> tuple[float, float]:
    """(pipeline bound, least optimizer step of its devices) of one replica."""
    p, N = len(pipe), spec.num_layers
    rows = []
    for s, ids in enumerate(pipe):
        # A stage's figures depend on its group up to interchangeable nodes and on its position only.
        key = (mb, s == 0, s == p - 1, min(p - s, m), replica_pattern(cluster, (ids,)), bool(monotone))
        if key not in cache.stage:
            cache.stage[key] = _stage_bound(spec, cluster, profiles, ids, s, p, m, mb, space, cache, monotone)
        rows.append(cache.stage[key])
    tau, tau_b, edge, edge_b, cap, per_fb, per_b, opts = (list(x) for x in zip(*rows))
    tau, edge, cap, lo_a = np.array(tau), np.array(edge), np.array(cap), np.array(lo)
    tau_b, edge_b = np.array(tau_b), np.array(edge_b)
    if np.any(cap < lo_a) or cap.sum() < N or not np.all(np.isfinite(tau)):
        return float("inf"), 0.0
    Ls = np.arange(N + 1)
    with np.errstate(invalid="ignore"):
        c = np.where(Ls[None, :] > 0, Ls[None, :] * np.array(per_fb), 0.0) + edge[:, None]
        cb = np.where(Ls[None, :] > 0, Ls[None, :] * np.array(per_b), 0.0) + edge_b[:, None]
    bound = max(_pipeline_bound(c, tau, edge, cap, lo_a, N, m, p), _chain_bound(c, cb, tau, edge, cap, lo_a, N, m, p) + links)
    return bound, max(opts)


def _stage_bound(spec, cluster, profiles, ids, s, p, m, mb, space, cache, monotone):
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
    tied = (len(gk[0]) == 1 or len(set(gk[0])) == 1) and Umax % len(ids) == 0 and bool(monotone and monotone.get(gk[0][0][0]))
    const = stage_constants(cluster, spec, mb, ids, first=s == 0, last=s == p - 1)
    low = [edge_lower_bounds(spec, x, mb, possible_shares(spec, len(ids), tied)) for x in slots]
    edge = max(x[0] for x in low) + const.edge_fwd_comm_ms + const.edge_bwd_comm_ms
    edge_b = max(x[1] for x in low) + const.edge_bwd_comm_ms
    # Every device steps at least its embedding/head weights (eq. 10).
    opt = max(x.optimizer_ms_per_byte * lo_[2] for x, lo_ in zip(slots, low))
    ck = (mb, gk[0], s == 0, s == p - 1, slots[0].in_flight, tied)
    if ck not in cache.cap:
        cache.cap[ck] = stage_layer_cap(spec, cluster, profiles, mb, ids, s, p, m, space, N, tied)
    if tied:
        pk = ck + (gk[1],)  # the per-layer time includes the group's all-reduces: its link matters
        if pk not in cache.per_layer:
            cache.per_layer[pk] = tied_per_layer(spec, cluster, profiles, mb, ids, s, p, m, space, N)
        fb, bb = cache.per_layer[pk]
        per_fb, per_b = np.maximum(fb, tau), np.maximum(bb, tau_b)
    else:
        per_fb, per_b = np.full(N + 1, tau), np.full(N + 1, tau_b)
    return tau, tau_b, edge, edge_b, cache.cap[ck], per_fb, per_b, opt


def _fill_cost(tau, edge, caps, lo, N):
    """min sum_s (L_s tau_s + E_s) with lo <= L <= caps, sum L = N (caps: rows = scenarios); inf if impossible."""
    caps = np.atleast_2d(caps)
    order = np.argsort(tau, kind="stable")
    extra = np.clip(caps - lo, 0, None)[:, order]
    need = N - lo.sum()
    before = np.cumsum(extra, axis=1) - extra
    take = np.clip(need - before, 0, extra)
    cost = (take * tau[order]).sum(axis=1) + (lo * tau).sum() + edge.sum()
    feasible = (extra.sum(axis=1) >= need) & np.all(caps >= lo, axis=1)
    return np.where(feasible, cost, np.inf)


def _caps_from(values, term, cap):
    """Largest L per stage with term[s, L] <= T for each threshold T (term non-decreasing in L)."""
    out = np.empty((len(values), term.shape[0]))
    for s in range(term.shape[0]):
        out[:, s] = np.searchsorted(term[s], values, side="right") - 1
    return np.minimum(out, cap[None, :])


def _pipeline_bound(c, tau, edge, cap, lo, N, m, p) -> float:
    """m * min over splits of max_s c_s(L_s)."""
    values = np.unique(c[np.isfinite(c)])
    caps = _caps_from(values, c, cap)
    ok = np.isfinite(_fill_cost(tau, edge, caps, lo, N))
    if not ok.any():
        return float("inf")
    return m * float(values[np.argmax(ok)])


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


def tied_per_layer(spec, cluster, profiles, mb, ids, s, p, m, space, N):
    """For a tied stage (equal shares, one recompute set): per-layer F + B and B alone as functions of
    the layer count L: the cheapest recompute set that still fits L layers (eq. 8), all-reduces included."""
    n = len(ids)
    slot = _slot(spec, cluster, profiles, mb, ids[0], s, p, m)
    t = layer_prices(slot.profile, spec, mb, 1.0 / n, space)
    ar = layer_allreduce_ms(cluster, spec, mb, ids)
    fits = fitting_layers(slot, spec, mb, 1.0 / n, space, N)
    b_all = sum(t.bwd_ms) + t.rec_attn_ms + t.rec_mlp_ms + ar
    fb_all = sum(t.fwd_ms) + ar + b_all
    fb, bb = np.full(N + 1, np.inf), np.full(N + 1, np.inf)
    for L in range(N + 1):
        ok = fits >= L
        if ok.any():
            fb[L], bb[L] = fb_all[ok].min(), b_all[ok].min()
    return fb, bb
