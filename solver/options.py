"""What one device can choose: its tensor-parallel share and its recompute set, with safe pruning.

Every number here comes from the cost model's own functions (``baton.costmodel.layer_cost``,
``baton.costmodel.optimizer_bytes``, ``baton.memory``) so that the MILP and ``baton.evaluate`` agree.

Pruning (docs/cost-model.md, eq. 2-4 and 8): for a device at a fixed position of a fixed skeleton and a
fixed share, a recompute set R enters the model only through
  * its recompute time per block, rec_attn(R) and rec_mlp(R) (added to the block's backward, eq. 9), and
  * the largest layer count that still fits in memory, max_layers(R) (eq. 8 is linear in the layer count).
R is dropped when another set has rec_attn <= , rec_mlp <= and max_layers >= : whatever plan uses R, the
same plan with the other set is as fast and fits too. Nothing else of the plan depends on R.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from baton.costmodel import BLOCKS, LayerCost, edge_param_bytes, layer_cost, optimizer_bytes
from baton.memory import tensor_bytes, tensor_roles
from baton.model_spec import ModelSpec
from baton.operators import EMBEDDING, HEAD, layer_operators
from baton.profile import Profile


def valid_unit_counts(spec: ModelSpec) -> list[int]:
    """Partition granularities U: divide both the head count and the FFN width."""
    return [u for u in range(1, spec.num_heads + 1) if spec.num_heads % u == 0 and spec.ffn_dim % u == 0]


class RecomputeSpace:
    """Candidate recompute sets of one layer as bit masks, and which tensors each keeps or re-creates (eq. 3-4)."""

    def __init__(self, spec: ModelSpec, universe: list[frozenset[str]] | None = None):
        ops = layer_operators(spec)
        self.ops = [o.name for o in ops]
        self.blocks = [o.block for o in ops]
        bit = {name: 1 << i for i, name in enumerate(self.ops)}
        if universe is None:
            masks = np.arange(1 << len(self.ops), dtype=np.int64)
        else:
            unknown = {op for r in universe for op in r} - set(self.ops)
            if unknown:
                raise ValueError(f"unknown operators in recompute universe: {sorted(unknown)}")
            masks = np.array(sorted({sum(bit[o] for o in r) for r in universe}), dtype=np.int64)
        self.masks = masks
        roles = tensor_roles(spec)
        self.tensors = list(roles)
        held = np.zeros((len(masks), len(self.tensors)), dtype=bool)
        remat = np.zeros_like(held)
        for j, t in enumerate(self.tensors):
            r = roles[t]
            need = sum(bit[x] for x in r.needers)
            cons = sum(bit[x] for x in r.consumers)
            prod = bit.get(r.producer, 0)
            rule_a = (masks & need) != need  # some needer keeps it
            rule_b = ((masks & cons) != 0) & ((masks & prod) == 0)  # recomputation starts from it
            held[:, j] = rule_a | rule_b
            remat[:, j] = (need != 0) & ~(rule_a | rule_b)
        self.held = held.astype(float)
        self.remat = remat.astype(float)
        self.op_bits = ((masks[:, None] >> np.arange(len(self.ops))) & 1).astype(float)

    def recompute_set(self, i: int) -> frozenset[str]:
        m = int(self.masks[i])
        return frozenset(name for k, name in enumerate(self.ops) if m >> k & 1)

    def __len__(self) -> int:
        return len(self.masks)


@dataclass(frozen=True, kw_only=True, slots=True)
class ShareTable:
    """Per-layer cost of every candidate recompute set for one (GPU type, micro-batch, share)."""

    fwd: tuple[float, float]
    """Forward ms per block (attn, mlp); independent of the recompute set."""
    bwd: tuple[float, float]
    """Backward ms per block without recomputation."""
    rec_attn: np.ndarray
    """Recompute ms of the attn block, per candidate set."""
    rec_mlp: np.ndarray
    """Recompute ms of the mlp block, per candidate set."""
    held: np.ndarray
    """Held activation bytes per layer per in-flight micro-batch (eq. 3)."""
    transient: np.ndarray
    """Recompute buffer bytes (eq. 4)."""
    param_bytes: float
    """Parameter bytes per layer at this share."""


@functools.lru_cache(maxsize=4096)
def share_table(profile: Profile, spec: ModelSpec, micro_batch: int, share: float, space: RecomputeSpace) -> ShareTable:
    ops = layer_operators(spec)
    costs = {o.name: profile.cost(o.name, micro_batch, share if o.tp_split else 1.0) for o in ops}
    sizes = tensor_bytes(spec, micro_batch, share, {k: v.saved_bytes for k, v in costs.items()},
                         {k: v.output_bytes for k, v in costs.items()}, profile.seq_len)
    sz = np.array([sizes[t] for t in space.tensors])
    fwd_ops = np.array([costs[o].fwd_ms for o in space.ops])
    attn = np.array([b == "attn" for b in space.blocks])
    return ShareTable(
        fwd=tuple(sum(costs[o.name].fwd_ms for o in ops if o.block == b) for b in BLOCKS),
        bwd=tuple(sum(costs[o.name].bwd_ms for o in ops if o.block == b) for b in BLOCKS),
        rec_attn=space.op_bits @ (fwd_ops * attn), rec_mlp=space.op_bits @ (fwd_ops * ~attn),
        held=space.held @ sz, transient=space.remat @ sz,
        param_bytes=sum(c.param_bytes for c in costs.values()))


@dataclass(frozen=True, kw_only=True, slots=True)
class Slot:
    """Where a device sits in a skeleton: what eq. 8 needs besides its own choice."""

    profile: Profile
    memory_bytes: int
    reserve_bytes: int
    in_flight: int
    """min(p - s, m) micro-batches held at the peak (1F1B)."""
    first: bool
    last: bool

    def edge_param_bytes(self, spec: ModelSpec, mb: int) -> float:
        return edge_param_bytes(self.profile, spec, mb, first=self.first, last=self.last)

    def edge_saved_bytes(self, mb: int) -> float:
        return ((self.profile.cost(EMBEDDING, mb).saved_bytes if self.first else 0.0)
                + (self.profile.cost(HEAD, mb).saved_bytes if self.last else 0.0))


def peak_bytes(slot: Slot, spec: ModelSpec, mb: int, lc: LayerCost, num_layers: int) -> float:
    """Eq. 8, written exactly as baton.evaluate computes it."""
    weights = num_layers * lc.param_bytes + slot.edge_param_bytes(spec, mb)
    activ = slot.in_flight * (num_layers * lc.held_bytes + slot.edge_saved_bytes(mb))
    transient = lc.transient_bytes if num_layers else 0.0
    return 2 * weights + optimizer_bytes(weights, spec) + activ + transient + slot.reserve_bytes


def exact_max_layers(slot: Slot, spec: ModelSpec, mb: int, lc: LayerCost, guess: int, cap: int) -> int:
    """Largest L in [0, cap] that fits (memory grows with L), -1 if even L = 0 does not fit."""
    def fits(L: int) -> bool:
        return peak_bytes(slot, spec, mb, lc, L) <= slot.memory_bytes
    if not fits(0):
        return -1
    L = min(max(guess, 0), cap)
    while L > 0 and not fits(L):
        L -= 1
    while L < cap and fits(L + 1):
        L += 1
    return L


def approx_max_layers(t: ShareTable, slot: Slot, spec: ModelSpec, mb: int, cap: int) -> np.ndarray:
    """Eq. 8 solved for L, vectorised over recompute sets (checked exactly later for the survivors)."""
    k = 2 + optimizer_bytes(1.0, spec)
    ep, es = slot.edge_param_bytes(spec, mb), slot.edge_saved_bytes(mb)
    base = slot.memory_bytes - slot.reserve_bytes - k * ep - slot.in_flight * es
    if base < 0:
        return np.full(len(t.held), -1)
    slope = k * t.param_bytes + slot.in_flight * t.held
    with np.errstate(divide="ignore", invalid="ignore"):
        L = np.floor((base - t.transient) / np.where(slope > 0, slope, np.nan))
    L = np.where(slope > 0, L, np.where(base - t.transient >= 0, cap, 0))
    return np.clip(np.nan_to_num(L, nan=0.0), 0, cap).astype(int)


@dataclass(frozen=True, kw_only=True, slots=True)
class Choice:
    """One device's (share, recompute set) with the per-layer numbers the MILP needs."""

    units: int
    units_per_layer: int
    recompute: frozenset
    fwd: tuple[float, float]
    """Forward ms per block (eq. 2)."""
    bwd: tuple[float, float]
    """Backward + recompute ms per block (eq. 2, 9)."""
    max_layers: int
    """Largest layer count of its stage that fits this device's memory (eq. 8)."""
    param_bytes: float
    """Parameter bytes per layer."""


def device_choices(slot: Slot, spec: ModelSpec, mb: int, share: float, space: RecomputeSpace, *, min_layers: int,
                   cap: int, prune: bool = True) -> list[tuple[frozenset, LayerCost, int]]:
    """Recompute sets worth considering for a device at ``slot`` with ``share``: (set, cost, max layers).

    Keeps the sets on the (min rec_attn, min rec_mlp, max max_layers) Pareto front that fit at least
    ``min_layers`` layers. With ``prune=False`` keeps every feasible set (the exhaustive oracle's view).
    """
    t = share_table(slot.profile, spec, mb, share, space)
    approx = approx_max_layers(t, slot, spec, mb, cap)
    idx = np.flatnonzero(approx >= min_layers - 1)  # -1 slack: the exact check below decides
    if prune and len(idx):
        idx = _front(idx, approx[idx], t.rec_attn[idx], t.rec_mlp[idx], space.op_bits[idx].sum(axis=1))
    out = []
    for i in idx:
        r = space.recompute_set(int(i))
        lc = layer_cost(slot.profile, spec, mb, share, r)
        L = exact_max_layers(slot, spec, mb, lc, int(approx[i]), cap)
        if L >= min_layers:
            out.append((r, lc, L))
    if prune:  # re-check dominance with exact numbers (the vectorised pass can differ in the last bit)
        final = []
        for j, (r, lc, L) in enumerate(out):
            ra, rm = lc.recompute_ms["attn"], lc.recompute_ms["mlp"]
            dom = False
            for k, (r2, lc2, L2) in enumerate(out):
                if k == j:
                    continue
                a2, m2 = lc2.recompute_ms["attn"], lc2.recompute_ms["mlp"]
                better_eq = L2 >= L and a2 <= ra and m2 <= rm
                strictly = L2 > L or a2 < ra or m2 < rm or k < j
                if better_eq and strictly:
                    dom = True
                    break
            if not dom:
                final.append((r, lc, L))
        out = final
    return out


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
        for col in ("fwd_ms", "bwd_ms", "saved_bytes", "output_bytes", "param_bytes"):
            v = g[col].to_numpy()
            if len(v) > 1 and np.any(np.diff(v) < -1e-12 * max(1.0, float(np.abs(v).max()))):
                return False
    return True


def block_times(lc: LayerCost) -> tuple[tuple[float, float], tuple[float, float]]:
    """(forward per block, backward + recompute per block) as evaluate uses them."""
    return (tuple(lc.fwd_ms[b] for b in BLOCKS), tuple(lc.bwd_ms[b] + lc.recompute_ms[b] for b in BLOCKS))

