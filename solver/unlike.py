"""Level 3 for candidates whose replicas differ in shape (stage count or TP group sizes): by enumeration.

For replicas of one shape the peer groups are the (stage, TP rank) positions, so the data-parallel sync is a
line in the stage's layers and the MILP (solver/milp.py) prices it exactly. For replicas of different shapes
the groups (``baton.peers``) are the pieces of the model between every boundary any replica uses: which
devices sync together, how many parameters each group holds, in which order the groups run and who waits for
whom (eq. 13-15), the owned fractions (eq. 10, 14) and the stage-0 staging copies (eq. 14) all jump when one
replica moves a layer or a unit boundary. So here the *layout* of every replica, its layer split and every
stage's units, is enumerated (``replica_layouts``), and for one layout of every replica (a *structure*) each
of those is a constant, computed with the evaluator's own functions on the structure's plan.

With the structure fixed, what is left is exact in closed form: a device's recompute set enters only its own
memory (fits or not, at its fixed layers, owned fraction and sync buffer: eq. 8, ``costmodel.device_memory``)
and its stage's backward (the per-block max over the group, eq. 9); forward times, weights, the optimizer step
and every sync do not depend on it, and eq. 1 does not decrease in any stage's backward. So each stage takes
the sets minimising its backward (``_best_backward``: for two blocks, the min over thresholds of the first
block of that threshold plus the largest least second block), which minimises every replica's 1F1B time and
so the iteration time. Nothing is pruned but by bound: a layout whose replica's pipeline without
recomputation is already too slow, or a structure whose bound (that pipeline, the exact syncs and optimizer
step) is not below the incumbent.

Restriction: at stage 1 every peer group of unlike replicas is split evenly (``shard_ratio`` unset). One ratio
per device weighs it in all its groups (``baton.peers.owned_fractions``: ratio over the group's sum), which is
not linear in anything; the grid of ratios is searched for replicas of one shape only.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from baton.costmodel import (BLOCKS, SyncTerms, device_memory, device_optimizer_ms, device_slot, edge_cost,
                             embedding_sync_ms, group_layer_ms, held_weights_bytes, layer_limits, layer_param_count, layer_prices,
                             pipeline_transfers, stage_constants, stage_time_ms, sync_terms)
from baton.operators import operator_names
from baton.pipeline import PipelineTiming, iteration_time_1f1b
from baton.plan import DeviceShare, Plan, Stage, plan_of_replicas
from baton.waits import last_arrival_ms

from solver import stop
from solver.bounds import unlike_sync_device_lines
from solver.options import valid_unit_counts
from solver.space import Skeleton

LAYOUT_LIMIT = 200_000
"""Most structures (products of the replicas' layouts left after the per-replica bound) one candidate is expanded
into; a candidate with more is not searched and its cheap bound stays in the proven bound (the gap says so)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """One replica cut one way: what the structure fixes for it."""

    layers: tuple[int, ...]
    """Layers per stage."""
    units: tuple[tuple[int, tuple[int, ...]], ...]
    """(U, units per rank) per stage."""
    pipe_ms: float
    """Its 1F1B time with nothing recomputed (a lower bound on its pipeline in any plan of this layout)."""


def unit_options(spec, n: int) -> list[tuple[int, tuple[int, ...]]]:
    """Every way n ranks may cut a layer (U, units per rank, each >= 1), one per distinct vector of shares."""
    out, seen = [], set()
    for U in valid_unit_counts(spec):
        if U < n:
            continue
        for cut in itertools.combinations(range(1, U), n - 1):
            us = tuple(b - a for a, b in zip((0,) + cut, cut + (U,)))
            key = tuple(Fraction(u, U) for u in us)
            if key not in seen:
                seen.add(key)
                out.append((U, us))
    return out


def layer_splits(N: int, p: int):
    """Every layers-per-stage vector within ``costmodel.layer_limits`` adding up to N."""
    lo, hi = layer_limits(N, p)

    def rec(s, left):
        if s == p - 1:
            if lo[s] <= left <= hi[s]:
                yield (left,)
            return
        for L in range(lo[s], min(hi[s], left) + 1):
            for tail in rec(s + 1, left - L):
                yield (L,) + tail

    if sum(lo) <= N:
        yield from rec(0, N)


class StageTables:
    """Per (replica, stage, units): each device's prices and slot, the stage constants and the forward/backward
    without recomputation per layer; memoised for one candidate."""

    def __init__(self, spec, cluster, profiles, space, pipes, batches):
        # Replicas of different shapes do not offload (the space offered, solver/README.md).
        self.spec, self.cluster, self.profiles, self.space = spec, cluster, profiles, space.plain
        self.pipes, self.batches = pipes, batches
        self.emb_ms = embedding_sync_ms(cluster, spec, pipes)
        """Eq. 11's tied-embedding sync: a constant of the skeleton."""
        self._memo: dict = {}

    def stage(self, rho: int, s: int, opt):
        key = (rho, s, opt)
        if key not in self._memo:
            pipe, (b, m) = self.pipes[rho], self.batches[rho]
            p, ids = len(pipe), list(pipe[s])
            U, us = opt
            slots = [device_slot(self.cluster, self.profiles, self.spec, b, i, stage=s, num_stages=p, num_microbatches=m)
                     for i in ids]
            prices = [layer_prices(sl.profile, self.spec, b, u / U, self.space) for sl, u in zip(slots, us)]
            edges = [edge_cost(sl, self.spec, b, u / U) for sl, u in zip(slots, us)]
            const = stage_constants(self.cluster, self.spec, b, ids, first=s == 0, last=s == p - 1)
            f_layer, b_plain = group_layer_ms([t.fwd_ms for t in prices], [t.bwd_ms for t in prices])
            self._memo[key] = (slots, prices, edges, const, f_layer, b_plain)
        return self._memo[key]

    def _stage_terms(self, rho: int, s: int, opt):
        """What eq. 9 takes of ``stage``: per-layer forward and backward, in-layer all-reduce, and the edges with
        their communication each way; asked once per layout, millions of times in rule 15's pass."""
        key = ("terms", rho, s, opt)
        if key not in self._memo:
            _, _, edges, const, f_layer, b_plain = self.stage(rho, s, opt)
            self._memo[key] = (f_layer, b_plain, const.allreduce_ms,
                               max(e.fwd_ms for e in edges) + const.edge_fwd_comm_ms,
                               max(e.bwd_ms for e in edges) + const.edge_bwd_comm_ms)
        return self._memo[key]

    def transfers(self, rho: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """Eq. 6 between the replica's stages, both ways: they depend on its groups and micro-batch size, not on its
        layout, so once per replica (pricing them per layout was most of rule 15's time on poplar_c)."""
        key = ("transfers", rho)
        if key not in self._memo:
            pipe, (b, _) = self.pipes[rho], self.batches[rho]
            sends = [pipeline_transfers(self.cluster, self.spec, b, list(pipe[s]), list(pipe[s + 1]))
                     for s in range(len(pipe) - 1)]
            self._memo[key] = tuple(x[0] for x in sends), tuple(x[1] for x in sends)
        return self._memo[key]

    def stage_passes(self, rho: int, layers, units, bwd_layer=None) -> tuple[list, list]:
        """Eq. 9 both ways, stage by stage, for replica ``rho`` with these layers (per stage: a count, or a numpy
        array of counts, one per layer split) and units; backward per layer ``bwd_layer[s]`` (default: nothing
        recomputed)."""
        fwd, bwd = [], []
        for s, (L, opt) in enumerate(zip(layers, units)):
            f_layer, b_plain, allreduce, edge_fwd, edge_bwd = self._stage_terms(rho, s, opt)
            bl = b_plain if bwd_layer is None else bwd_layer[s]
            fwd.append(stage_time_ms(L, f_layer, allreduce, edge_fwd))
            bwd.append(stage_time_ms(L, bl, allreduce, edge_bwd))
        return fwd, bwd

    def pipeline_ms(self, rho: int, layers, units, bwd_layer=None, below: float = math.inf) -> float:
        """Eq. 1 for replica ``rho`` with these layers and units; backward per layer ``bwd_layer[s]`` (default:
        nothing recomputed). When two lower bounds of eq. 1 (every stage runs m forwards and backwards; micro-batch
        0 crosses every stage and link both ways) already reach ``below``, their max is returned instead."""
        fwd, bwd = self.stage_passes(rho, layers, units, bwd_layer)
        sf, sb = self.transfers(rho)
        quick = float(quick_pipeline_ms(fwd, bwd, sf, sb, self.batches[rho][1]))
        if quick >= below:
            return quick
        return iteration_time_1f1b(PipelineTiming(fwd_ms=tuple(fwd), bwd_ms=tuple(bwd), send_fwd_ms=sf, send_bwd_ms=sb),
                                   self.batches[rho][1])


def quick_pipeline_ms(fwd, bwd, send_fwd, send_bwd, m: int):
    """Two lower bounds of eq. 1, their larger: every stage runs m forwards and backwards; micro-batch 0 crosses
    every stage and link both ways. Per-stage times may be numpy arrays (a block of layer splits at once); the sums
    run stage by stage, so a float and an array's element agree exactly."""
    passes = fwds = bwds = 0.0
    for f, b in zip(fwd, bwd):
        passes, fwds, bwds = np.maximum(passes, f + b), fwds + f, bwds + b
    return np.maximum(m * passes, fwds + bwds + sum(send_fwd) + sum(send_bwd))


def replica_layouts(tables: StageTables, rho: int, limit_ms: float, deadline_s: float = math.inf) -> tuple[list[Layout], float]:
    """Every layout of replica ``rho`` (layer split x units per stage) whose pipeline without recomputation is
    below ``limit_ms``, fastest first; and the least such time of the layouts left out (inf if none). Raises
    TimeoutError when ``time.perf_counter()`` passes ``deadline_s`` (or a stop is requested, ``solver.stop``) first: a replica of seven stages over 32 layers
    has 736,281 layer splits (poplar_a's exact family, searched after the structured one, ran a minute over)."""
    spec, pipe = tables.spec, tables.pipes[rho]
    unit_sets = list(itertools.product(*(unit_options(spec, len(g)) for g in pipe)))
    sf, sb = tables.transfers(rho)
    m = tables.batches[rho][1]
    found, least = [], math.inf  # (layout, its position in splits-then-units order: ties stay in that order)
    splits = layer_splits(spec.num_layers, len(pipe))
    first = 0
    # ``pipeline_ms``'s two quick bounds over a block of layer splits at once, for each unit choice; eq. 1 itself
    # only where they stay below the limit.
    while block := list(itertools.islice(splits, _SPLIT_BLOCK)):
        if stop.past(deadline_s):
            raise TimeoutError
        L = np.array(block, dtype=float)
        for u, units in enumerate(unit_sets):
            if not math.isfinite(limit_ms):  # nothing to screen out: eq. 1 for every split
                for k, layers in enumerate(block):
                    found.append(((first + k) * len(unit_sets) + u, Layout(layers=layers, units=units,
                                                                           pipe_ms=tables.pipeline_ms(rho, layers, units))))
                continue
            quick = quick_pipeline_ms(*tables.stage_passes(rho, L.T, units), sf, sb, m)
            below = quick < limit_ms
            if not below.all():
                least = min(least, float(quick[~below].min()))
            for k in np.flatnonzero(below):
                layers = block[k]
                t = tables.pipeline_ms(rho, layers, units, below=limit_ms)
                if t < limit_ms:
                    found.append(((first + int(k)) * len(unit_sets) + u, Layout(layers=layers, units=units, pipe_ms=t)))
                else:
                    least = min(least, t)
        first += len(block)
    found.sort(key=lambda x: (x[1].pipe_ms, x[0]))
    return [lay for _, lay in found], least


_SPLIT_BLOCK = 4096
"""Layer splits priced together by ``replica_layouts``: a deadline check per block."""


def structures(layouts: list[list[Layout]], twins: list[int | None]):
    """Every combination of one layout per replica; ``twins[i]`` = an earlier replica interchangeable with i
    (same pattern and batch): its layout index is then at most i's, so each structure comes once up to swaps."""
    chosen: list = [None] * len(layouts)

    def rec(i):
        if i == len(layouts):
            yield tuple(layouts[k][j] for k, j in enumerate(chosen))
            return
        start = chosen[twins[i]] if twins[i] is not None else 0
        for j in range(start, len(layouts[i])):
            chosen[i] = j
            yield from rec(i + 1)

    yield from rec(0)


def structure_plan(spec, pipes, batches, zero_stage: int, struct, recompute=None) -> Plan:
    """The plan of a structure (``recompute[(rho, s, k)]`` per device, default none; even shards)."""
    replicas = []
    for rho, (pipe, lay) in enumerate(zip(pipes, struct)):
        stages, first = [], 0
        for s, (ids, L, (U, us)) in enumerate(zip(pipe, lay.layers, lay.units)):
            devs = tuple(DeviceShare(id=i, units=u, recompute=() if recompute is None else recompute[rho, s, k])
                         for k, (i, u) in enumerate(zip(ids, us)))
            stages.append(Stage(first_layer=first, num_layers=L, units_per_layer=U, devices=devs))
            first += L
        replicas.append(stages)
    return plan_of_replicas(spec, batches, zero_stage, replicas)


def structure_bound(tables: StageTables, struct, sync: SyncTerms, emb_ms: float) -> float:
    """Slowest replica without recomputation + tied-embedding sync + data-parallel sync + optimizer step: the
    structure's exact value but for the recompute time."""
    return (last_arrival_ms([x.pipe_ms for x in struct], tables.cluster.replica_time_cv) + emb_ms + sync.dp_sync_ms
            + _optimizer_ms(tables, struct, sync))


def _optimizer_ms(tables: StageTables, struct, sync: SyncTerms) -> float:
    """Eq. 10: the slowest device's Adam step over the weights it owns (the set does not change the weights)."""
    worst = 0.0
    for rho, lay in enumerate(struct):
        for s, (L, opt) in enumerate(zip(lay.layers, lay.units)):
            slots, prices, edges, _, _, _ = tables.stage(rho, s, opt)
            for sl, t, e in zip(slots, prices, edges):
                worst = max(worst, device_optimizer_ms(sl, held_weights_bytes(L, t.param_bytes, e),
                                                       sync.owned_fraction[sl.device_id]))
    return worst


def fitting_backwards(spec, num_layers: int, slots, prices, edges, sync: SyncTerms, zero_stage: int):
    """Per device of a group: its recompute sets that fit at ``num_layers`` layers with the structure's owned
    fractions and staging (eq. 8, or eq. 18 at stages 2-3: ``costmodel.device_memory``, the evaluator's
    comparison), and their per-block backward (attn, mlp) with recomputation. Returns (per_device, fitting):
    the backward arrays and the indices of the fitting sets in the space."""
    per_device, fitting = [], []
    for sl, t, e in zip(slots, prices, edges):
        mem = device_memory(sl, spec, num_layers, param_bytes=t.param_bytes, held_bytes=t.held_bytes,
                            transient_bytes=t.transient_bytes, edge=e, owned_fraction=sync.owned_fraction[sl.device_id],
                            sync_buffer_bytes=sync.buffer_bytes[sl.device_id], zero_stage=zero_stage,
                            owned_layer_fraction=sync.owned_layer_fraction.get(sl.device_id))
        ok = np.flatnonzero(mem.peak_bytes <= sl.memory_bytes)
        fitting.append(ok)
        per_device.append((t.bwd_ms[0] + t.rec_attn_ms[ok], t.bwd_ms[1] + t.rec_mlp_ms[ok]))
    return per_device, fitting


def _best_backward(per_device) -> tuple[float, list[int]] | None:
    """min over one set per device of sum_k max_d bwd_k (two blocks, eq. 9): for each threshold t of the first
    block, each device takes, among its sets within t, the least second block. ``per_device``: (first, second)
    arrays over each device's fitting sets. Returns (per-layer backward, chosen index per device)."""
    assert len(BLOCKS) == 2
    if any(len(a) == 0 for a, _ in per_device):
        return None
    best = None
    for t in sorted({float(x) for a, _ in per_device for x in a}):
        picks, first, second = [], 0.0, 0.0
        for a, b in per_device:
            ok = np.flatnonzero(a <= t)
            if not len(ok):
                break
            j = int(ok[np.argmin(b[ok])])
            picks.append(j)
            first, second = max(first, float(a[j])), max(second, float(b[j]))
        else:
            value = first + second
            if best is None or value < best[0]:
                best = (value, picks)
    return best


def solve_structure(tables: StageTables, struct, sync: SyncTerms, emb_ms: float, zero_stage: int):
    """The best plan of a structure: (iteration ms, plan), or None when some device cannot fit its layers under
    any recompute set."""
    spec, space = tables.spec, tables.space
    names = operator_names(spec)
    recompute, pipes_ms = {}, []
    for rho, lay in enumerate(struct):
        bwd_layer = []
        for s, (L, opt) in enumerate(zip(lay.layers, lay.units)):
            slots, prices, edges, _, _, _ = tables.stage(rho, s, opt)
            per_device, fitting = fitting_backwards(spec, L, slots, prices, edges, sync, zero_stage)
            got = _best_backward(per_device)
            if got is None:
                return None
            bwd_layer.append(got[0])
            for k, j in enumerate(got[1]):
                rset = space.recompute_set(int(fitting[k][j]))
                recompute[rho, s, k] = tuple(o for o in names if o in rset)
        pipes_ms.append(tables.pipeline_ms(rho, lay.layers, lay.units, bwd_layer))
    total = last_arrival_ms(pipes_ms, tables.cluster.replica_time_cv) + emb_ms + sync.dp_sync_ms + _optimizer_ms(tables, struct, sync)
    return total, structure_plan(spec, tables.pipes, tables.batches, zero_stage, struct, recompute)


def _sync_floor(spec, cluster, pipes):
    """A structure -> a lower bound on its T_dp (eq. 13, 15 at stage 0 or 1): rule 13 of solver/README.md device by
    device, T_dp >= a P_d + b for each of d's lines (``bounds.unlike_sync_device_lines``), with P_d at least its
    layers' parameters at its share (the edges only add)."""
    lines = unlike_sync_device_lines(spec, cluster, Skeleton(pipelines=tuple(tuple(tuple(g) for g in pipe) for pipe in pipes)))
    if not lines:
        return lambda struct: 0.0
    per_layer: dict = {}

    def floor(struct) -> float:
        best = 0.0
        for pipe, lay in zip(pipes, struct):
            for group, L, (U, us) in zip(pipe, lay.layers, lay.units):
                if not L:
                    continue
                for d, u in zip(group, us):
                    if (U, u) not in per_layer:
                        per_layer[U, u] = layer_param_count(spec, u / U)
                    held = L * per_layer[U, u]
                    best = max(best, max(a * held + b for a, b in lines[d]))
        return best

    return floor


def expand(spec, cluster, profiles, space, pipes, batches, zero_stage: int, patterns, limit_ms: float, *,
           deadline_s: float = math.inf):
    """The structures of one candidate that may beat an incumbent of ``limit_ms``: (entries, dropped) with entries
    (bound, tables, structure, sync terms) below the limit, and ``dropped`` a lower bound on every structure left
    out (inf when none was). Raises OverflowError when more than ``LAYOUT_LIMIT`` structures would be listed, and
    TimeoutError when ``time.perf_counter()`` passes ``deadline_s`` (or a stop is requested) before they are."""
    tables = StageTables(spec, cluster, profiles, space, pipes, batches)
    emb = tables.emb_ms
    layouts, dropped = [], math.inf
    for rho in range(len(pipes)):
        kept, least = replica_layouts(tables, rho, limit_ms - emb, deadline_s)
        layouts.append(kept)
        dropped = min(dropped, least + emb)
    if any(not x for x in layouts):
        return [], dropped
    if math.prod(len(x) for x in layouts) > LAYOUT_LIMIT:
        raise OverflowError(math.prod(len(x) for x in layouts))
    twins = [next((j for j in range(i - 1, -1, -1) if patterns[j] == patterns[i] and batches[j] == batches[i]), None)
             for i in range(len(pipes))]
    entries = []
    sync_floor = _sync_floor(spec, cluster, pipes)
    for struct in structures(layouts, twins):
        if stop.past(deadline_s):
            raise TimeoutError
        pipe_lb = last_arrival_ms([x.pipe_ms for x in struct], cluster.replica_time_cv) + emb
        if pipe_lb >= limit_ms:
            dropped = min(dropped, pipe_lb)
            continue
        # Rule 13 device by device before eq. 15 itself: almost every structure listed ends above the limit by its
        # sync (on poplar_a's pass all 42,120 that came this far), and its peer groups cost a millisecond each.
        sync_lb = pipe_lb + sync_floor(struct)
        if sync_lb >= limit_ms:
            dropped = min(dropped, sync_lb)
            continue
        sync = sync_terms(cluster, structure_plan(spec, pipes, batches, zero_stage, struct))  # the evaluator's own terms
        lb = structure_bound(tables, struct, sync, emb)
        if lb >= limit_ms:
            dropped = min(dropped, lb)
            continue
        entries.append((lb, tables, struct, sync))
    return entries, dropped
