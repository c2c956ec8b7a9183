"""What one device can choose: its tensor-parallel share, its recompute set and what it offloads, with safe pruning.

Every number here comes from the cost model (``baton.costmodel.layer_prices`` over the liveness matrix of
``baton.memory.RecomputeSpace``, and ``max_layers_that_fit``), so the MILP and ``baton.evaluate`` agree.

Pruning (docs/cost-model.md, eq. 2-4 and 8): for a device at a fixed position of a fixed skeleton and a
fixed share, a recompute set R enters the model only through
  * its recompute time per block, rec_attn(R) and rec_mlp(R) (added to the block's backward, eq. 9), and
  * the largest layer count that still fits in memory, max_layers(R) (eq. 8 is linear in the layer count).
R is dropped when another set has rec_attn <= , rec_mlp <= and max_layers >= : whatever plan uses R, the
same plan with the other set is as fast and fits too. Nothing else of the plan depends on R. At sharding
stage 1 the layer limit depends on the fraction of its optimizer state the device owns, one more decision
of the device; a set is kept when it is on the front for at least one of the fractions it may own.

With offload (eq. 2o-4o, 8o) a row is a recompute set with what it keeps in host memory, and it enters the
model through its forward and backward per block (the copies' exposed part), max_layers, and its host bytes per
layer (a node's host memory, eq. 8o, a sum over the node's devices that only grows with them). A row no better
in all of these than another is dropped: the same plan with the other row is as fast and fits the device and
its node too.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from baton.costmodel import DeviceSlot, LayerCost, LayerPrices, fitting_layers, layer_cost_of, slot_prices
from baton.memory import RecomputeSpace
from baton.model_spec import ModelSpec, unit_counts
from baton.profile import HOST_COLUMNS, Profile


@functools.lru_cache(maxsize=256)
def valid_unit_counts(spec: ModelSpec) -> tuple[int, ...]:
    """Partition granularities U (the rule is ``baton.model_spec.splits_into``, which plans are checked by);
    memoised, the search asks for them once per stage of every candidate."""
    return tuple(unit_counts(spec))


def plan_shares(spec: ModelSpec) -> list[float]:
    """Every share of a layer a device of a plan can hold: k / U for each valid unit count U."""
    return sorted({k / U for U in valid_unit_counts(spec) for k in range(1, U + 1)})


def units_in_proportion(weights: list[float], U: int) -> list[int]:
    """U units split in proportion to ``weights`` (largest remainder), at least one each: how the
    constructive plan and HAP's baseline turn continuous shares into whole units."""
    n = len(weights)
    raw = [U * w / sum(weights) for w in weights]
    units = [max(1, math.floor(r)) for r in raw]
    while sum(units) > U:
        j = max((j for j in range(n) if units[j] > 1), key=lambda j: units[j] - raw[j])
        units[j] -= 1
    while sum(units) < U:
        j = max(range(n), key=lambda j: raw[j] - units[j])
        units[j] += 1
    return units


def compositions(total: int, parts: int):
    """Every vector of ``parts`` non-negative integers adding up to ``total``, in lexicographic order."""
    if parts == 1:
        yield (total,)
        return
    for k in range(total + 1):
        for tail in compositions(total - k, parts - 1):
            yield (k,) + tail


def ratio_vectors(replicas: int, grid: int):
    """Every way a position's peers may own its optimizer state at a sharding stage: None (equal parts, 1/r
    each), or multiples of 1/grid adding up to 1 (0 allowed), one per replica."""
    yield None
    for ks in compositions(grid, replicas):
        if replicas * ks[0] == grid and len(set(ks)) == 1:
            continue  # the equal split on the grid: already None
        yield tuple(k / grid for k in ks)


@dataclass(frozen=True, kw_only=True, slots=True)
class Choice:
    """One device's (share, recompute set) with the per-layer numbers the MILP needs."""

    units: int
    """Units u it holds per layer."""
    units_per_layer: int
    """Its stage's granularity U."""
    recompute: frozenset
    """Operators it recomputes."""
    offload: frozenset = frozenset()
    """Tensors it keeps in host memory between the passes (eq. 3o)."""
    host_bytes: float = 0.0
    """Their bytes per layer and in-flight micro-batch (eq. 8o)."""
    offload_optimizer: bool = False
    """Its optimizer state lives in host memory and its Adam step runs there (eq. 7h, 10h); ``max_layers`` then
    counts no optimizer state on the device."""
    fwd: tuple[float, float]
    """Forward ms per block (eq. 2)."""
    bwd: tuple[float, float]
    """Backward + recompute ms per block (eq. 2, 9)."""
    max_layers: tuple[int, ...]
    """Largest layer count of its stage that fits this device's memory (eq. 8), for each owned fraction of
    the optimizer state it may get (``Group.ratios``; one entry when the fraction is fixed)."""
    param_bytes: float
    """Parameter bytes per layer."""
    edge_fwd_ms: float = 0.0
    """Its embedding/head forward at this share (first/last stage; compute only)."""
    edge_bwd_ms: float = 0.0
    """Its embedding/head backward at this share."""
    edge_param_bytes: float = 0.0
    """Embedding/head parameters it holds at this share."""
    chunk_rows: tuple = ()
    """In an interleaved group: its memory as lines in its chunks' layer counts (``costmodel.ChunkMemoryRow``), in
    place of ``max_layers``; and the most layers it holds in all while its peer group syncs (eq. 14) is
    ``max_layers[0]``."""


def device_choices(slot: DeviceSlot, spec: ModelSpec, mb: int, share: float, space: RecomputeSpace, *, min_layers: int,
                   cap: int, prune: bool = True, owned_fractions: tuple[float, ...] = (1.0,)
                   ) -> list[tuple[frozenset, frozenset, LayerCost, tuple[int, ...]]]:
    """Rows of ``space`` (recompute set, offload set) worth considering for a device at ``slot`` with ``share``:
    (recompute set, offload set, cost, max layers per owned fraction of ``owned_fractions``).

    Keeps the rows not dominated in (max max_layers, min forward and backward per block, min host bytes) that fit
    at least ``min_layers`` layers, for at least one owned fraction (the union of the fronts: the fraction is one
    decision of the device, so for the fraction an optimum uses, the front of that fraction holds a row as good).
    Rows without offload all share one forward and no host bytes, so among them the (max_layers, rec_attn,
    rec_mlp) front is the same front. A row that offloads on a device without a host link is never kept. With
    ``prune=False`` keeps every feasible row (the exhaustive oracle's view). Every number is the cost model's
    (``slot_prices``, ``max_layers_that_fit``), the same row the evaluator prices for that choice.
    """
    prices = slot_prices(slot, spec, mb, share, space)
    fits = np.stack([fitting_layers(slot, spec, mb, share, space, cap, f) for f in owned_fractions])
    usable = np.isfinite(prices.offload_fwd_ms).all(axis=1) & np.isfinite(prices.offload_bwd_ms).all(axis=1)
    kept: set[int] = set()
    for fit in fits:
        idx = np.flatnonzero((fit >= min_layers) & usable)
        if prune and len(idx):
            idx = _pareto(idx, fit, prices, space)
        kept.update(int(i) for i in idx)
    return [(space.recompute_set(i), space.offload_set(i), layer_cost_of(prices, i), tuple(int(x) for x in fits[:, i]))
            for i in sorted(kept)]


def _pareto(idx: np.ndarray, fit: np.ndarray, prices: LayerPrices, space: RecomputeSpace) -> np.ndarray:
    """The rows of ``idx`` no other row dominates in (max fit, min forward per block, min backward per block, min
    host bytes); of rows equal in all of them the one with the fewest recomputed operators, then offloaded tensors,
    then the lowest index is kept. Rows without offload first go through ``_front`` (their forward and host bytes
    are equal), then rows that offload and survive every plain row of that front are compared with all."""
    pop = space.op_bits.sum(axis=1)
    plain, off = idx[~space.offloads[idx]], idx[space.offloads[idx]]
    front = _front(plain, fit[plain], prices.rec_attn_ms[plain], prices.rec_mlp_ms[plain], pop[plain]) if len(plain) else plain
    if not len(off):
        return front
    keys = np.column_stack([-fit.astype(float), prices.block_fwd_ms(), prices.block_bwd_ms(), prices.host_bytes])
    # A plain row no worse in every key beats an offloading one outright: it offloads fewer tensors.
    beaten = np.zeros(len(off), dtype=bool)
    for chunk in range(0, len(front), 256):
        f = front[chunk:chunk + 256]
        beaten |= np.all(keys[f][None, :, :] <= keys[off][:, None, :], axis=2).any(axis=1)
    cand = np.concatenate([front, off[~beaten]])
    tie = np.lexsort((cand, space.off[cand].sum(axis=1), pop[cand]))  # of equal rows the earliest here is kept
    rank = np.empty(len(cand), dtype=float)
    rank[tie] = np.arange(len(cand))
    k = keys[cand]
    # In lexicographic order of (keys, tie rank) a row's dominators all come before it; a dropped dominator is
    # itself dominated by an earlier row, so comparing with every earlier row, block by block, is exact.
    order = np.lexsort((rank, *k.T[::-1]))
    k, cand, rank = k[order], cand[order], rank[order]
    survive = np.ones(len(cand), dtype=bool)
    kept_k = np.empty((0, k.shape[1]))
    for start in range(0, len(cand), 256):
        rows = slice(start, start + 256)
        block = k[rows]
        hit = np.all(kept_k[None, :, :] <= block[:, None, :], axis=2).any(axis=1)
        earlier = np.tril(np.ones((len(block), len(block)), dtype=bool), -1)
        hit |= (np.all(block[None, :, :] <= block[:, None, :], axis=2) & earlier).any(axis=1)
        survive[rows] = ~hit
        kept_k = np.concatenate([kept_k, block[~hit]])
    return np.sort(cand[survive])


def interleaved_choices(slot: DeviceSlot, spec: ModelSpec, mb: int, share: float, space: RecomputeSpace, *,
                        prune: bool = True) -> list[tuple[frozenset, LayerCost]]:
    """Recompute sets worth considering for a device of an interleaved group (docs/schedules.md) with ``share``;
    interleaved groups do not offload (the space offered, solver/README.md), so the sets of ``space.plain``.

    Its memory is a line per moment of the schedule in the layer counts of several chunks, so no single layer
    limit orders the sets; but every line grows with the set's held and transient bytes. A set is dropped when
    another has rec_attn, rec_mlp, held and transient bytes all no larger (one of them smaller, or all equal and
    fewer operators): any plan using it is as fast and fits with the other. ``prune=False``: every set."""
    space = space.plain
    prices = slot_prices(slot, spec, mb, share, space)
    keys = np.stack([prices.rec_attn_ms, prices.rec_mlp_ms, prices.held_bytes, prices.transient_bytes,
                     space.op_bits.sum(axis=1).astype(float)], axis=1)
    kept = []
    for i in range(len(keys)):
        if prune:
            no_worse = np.all(keys[:, :4] <= keys[i, :4], axis=1)
            better = np.any(keys[:, :4] < keys[i, :4], axis=1) | ((keys[:, 4] < keys[i, 4]) |
                                                                  ((keys[:, 4] == keys[i, 4]) & (np.arange(len(keys)) < i)))
            if np.any(no_worse & better):
                continue
        kept.append(i)
    return [(space.recompute_set(i), layer_cost_of(prices, i)) for i in kept]


def _front(idx, L, a, m, pop):
    """Indices not dominated in (max L, min a, min m); ties keep the set with the fewest operators."""
    kept = []
    stair_a = np.empty(0)
    stair_m = np.empty(0)  # prefix minimum of m over the staircase sorted by a
    for level in np.unique(L)[::-1]:
        sel = np.flatnonzero(L == level)
        order = sel[np.lexsort((pop[sel], m[sel], a[sel]))]
        la, lm = a[order], m[order]
        run = np.minimum.accumulate(lm)
        prev = np.concatenate([[np.inf], run[:-1]])
        ok = lm < prev - 1e-12  # strictly better than every earlier set of this level with a <=
        if len(stair_a):
            pos = np.searchsorted(stair_a, la + 1e-12, side="right") - 1
            higher = np.where(pos >= 0, stair_m[np.maximum(pos, 0)], np.inf)
            ok &= lm < higher - 1e-12
        kept.extend(order[ok].tolist())
        ka = np.concatenate([stair_a, la[ok]])
        km = np.concatenate([stair_m, lm[ok]])
        srt = np.argsort(ka, kind="stable")
        stair_a, stair_m = ka[srt], np.minimum.accumulate(km[srt])
    return idx[np.array(sorted(kept), dtype=int)]


def monotone_in_share(profile: Profile) -> bool:
    """True when every column of the table grows (weakly) with the share, for every op and micro-batch.

    The equal-split reduction for stages of identical devices (see solver/space.py) relies on it.
    """
    df = profile.df
    for (_, _), g in df.groupby(["op", "micro_batch"]):
        g = g.sort_values("tp_share")
        for col in ("fwd_ms", "bwd_ms", "saved_bytes", "output_bytes", "param_bytes", *(c for c in HOST_COLUMNS if c in df)):
            v = g[col].to_numpy()
            if len(v) > 1 and np.any(np.diff(v) < -1e-12 * max(1.0, float(np.abs(v).max()))):
                return False
    return True
