"""Level 3 for sharding stages 2 and 3 (sharded gradients, and weights; layered accumulation): by enumeration.

At stages 2 and 3 every replica is one stage (a TP group; docs/cost-model.md, eq. 16-18), so a replica's layers
are all of them and what is left to decide is each group's units, each device's shard ratio and recompute set.
The iteration (eq. 17) is a chain of segments, each as long as its slowest replica, between the units'
collectives (eq. 16), which depend on the largest shard of each unit group. Here the *structure* (every
replica's units and every device's shard ratio) is enumerated; for one structure the unit collectives, owned
fractions, staging buffers and optimizer step are constants, taken from ``costmodel.sync_terms`` on the
structure's plan, as the evaluator takes them.

With the structure fixed the rest is exact in closed form, as for replicas of different shapes
(solver/unlike.py): a device's recompute set enters only its own memory (eq. 18 at its owned fraction and
buffer, ``costmodel.device_memory``, the evaluator's comparison) and its replica's per-layer backward (eq. 9's
per-block max), and eq. 17 does not decrease in any replica's backward (a sum of maxes). So each replica takes
the sets minimising its backward (``unlike._best_backward``), which minimises every segment.

What is enumerated:
  * units: replicas of one shape (one TP size) share one (U, units per rank), as the MILP's positions do;
    replicas of different shapes each their own (``unlike.unit_options``), interchangeable ones in
    non-decreasing order; in the structured family (``even``, whose TP groups are devices of one type on one
    node) only equal shares, a heuristic restriction (rule 3 of solver/README.md would justify it for tables
    monotone in the share, at equal parts);
  * shard ratios (``--shard-grid K``): replicas of one shape, at each position (TP rank) either every peer
    the equal part or multiples of 1/K adding up to 1, 0 allowed, as at stage 1; interchangeable replicas
    (same pattern and batch) in non-decreasing order of their ratios (swapping two maps a plan to one priced
    the same). With one rank per replica, members of one class take ratios within 1/K of each other (a single
    class: the equal part): giving every member the near-even part of the class's total and the recompute set
    of the member that owned most leaves every device's memory, every segment, every unit's largest shard and
    the optimizer step no larger. Replicas of different shapes: equal parts (the restriction of stage 1,
    solver/unlike.py), and so in the structured family (``even``), a heuristic restriction.

Pruned by bound only: the candidate's cheap bound (``bounds.layered_lower_bound``); a units choice whose value
without recomputation, at equal parts (every unit's largest shard is at least that) and with no optimizer step
is not below the incumbent; a structure whose value without recomputation (exact collectives and optimizer
step) is not below it.
"""
from __future__ import annotations

import itertools
import math


from baton.costmodel import (LayeredParts, device_optimizer_ms, device_slot, edge_cost, held_weights_bytes, layer_cost,
                             layer_prices, layered_iteration_ms, layered_iteration_of, layered_parts, sync_terms)
from baton.operators import operator_names
from baton.plan import LAYERED_ZERO_STAGES, DeviceShare, Plan, Stage, plan_of_replicas

from solver import stop
from solver.options import compositions, ratio_vectors
from solver.unlike import LAYOUT_LIMIT, _best_backward, fitting_backwards, unit_options

LAYERED_STAGES = LAYERED_ZERO_STAGES


def layered_skeleton(skeleton) -> bool:
    """Stages 2 and 3 apply: at least two replicas, each one stage."""
    return skeleton.num_replicas > 1 and all(len(pipe) == 1 for pipe in skeleton.pipelines)


class LayeredTables:
    """Per (replica, units): each device's slot (every micro-batch in flight), prices over the recompute space,
    edge costs, and the replica's ``LayeredParts`` with nothing recomputed; memoised for one candidate."""

    def __init__(self, spec, cluster, profiles, space, pipes, batches, zero_stage: int):
        # Layer by layer a device does not offload (the space offered, solver/README.md).
        self.spec, self.cluster, self.profiles, self.space = spec, cluster, profiles, space.plain
        self.pipes, self.batches, self.zero_stage = pipes, batches, zero_stage
        self._memo: dict = {}

    def group(self, rho: int, opt):
        key = (rho, opt)
        if key not in self._memo:
            (ids,), (b, m) = self.pipes[rho], self.batches[rho]
            U, us = opt
            shares = [u / U for u in us]
            slots = [device_slot(self.cluster, self.profiles, self.spec, b, i, stage=0, num_stages=1, num_microbatches=m,
                                 layered=True) for i in ids]
            prices = [layer_prices(sl.profile, self.spec, b, r, self.space) for sl, r in zip(slots, shares)]
            edges = [edge_cost(sl, self.spec, b, r) for sl, r in zip(slots, shares)]
            plain = layered_parts(self.cluster, self.spec, b, list(ids), [sl.profile for sl in slots], shares,
                                  [layer_cost(sl.profile, self.spec, b, r) for sl, r in zip(slots, shares)])
            self._memo[key] = (slots, prices, edges, shares, plain)
        return self._memo[key]

    def optimizer_ms(self, units, sync) -> float:
        """Eq. 10: the slowest device's Adam step over the share it owns."""
        N = self.spec.num_layers
        return max(device_optimizer_ms(sl, held_weights_bytes(N, t.param_bytes, e), sync.owned_fraction[sl.device_id])
                   for rho, opt in enumerate(units) for sl, t, e in zip(*self.group(rho, opt)[:3]))

    def iteration_ms(self, parts, sync, optimizer_ms: float) -> float:
        """Eq. 17 with ``parts`` = (micro-batches, LayeredParts) per replica."""
        return layered_iteration_of(sync, self.zero_stage, self.spec.num_layers, parts, optimizer_ms,
                                    self.cluster.replica_time_cv).iteration_ms

    def plain_parts(self, units):
        return [(self.batches[rho][1], self.group(rho, opt)[4]) for rho, opt in enumerate(units)]

    def plain_bound(self, units, sync, optimizer_ms: float = 0.0) -> float:
        """Eq. 17 with nothing recomputed: a lower bound on every plan of these units and syncs."""
        return self.iteration_ms(self.plain_parts(units), sync, optimizer_ms)

    def compute_bound(self, units) -> float:
        """Eq. 17's segments alone (no collective, no optimizer step), nothing recomputed."""
        N = self.spec.num_layers
        return layered_iteration_ms(self.zero_stage, N, self.plain_parts(units), 0.0, [0.0] * N, 0.0,
                                    replica_time_cv=self.cluster.replica_time_cv).iteration_ms


def layered_plan(spec, pipes, batches, zero_stage: int, units, ratios=None, recompute=None) -> Plan:
    """The plan of a structure: ``units[rho]`` = (U, units per rank), ``ratios[device]`` (default: equal parts),
    ``recompute[device]`` (default none)."""
    N = spec.num_layers
    replicas = []
    for (ids,), (U, us) in zip(pipes, units):
        devs = tuple(DeviceShare(id=i, units=u, recompute=() if recompute is None else recompute[i],
                                 shard_ratio=None if ratios is None else ratios.get(i)) for i, u in zip(ids, us))
        replicas.append([Stage(first_layer=0, num_layers=N, units_per_layer=U, devices=devs)])
    return plan_of_replicas(spec, batches, zero_stage, replicas)


def ratio_assignments(n: int, classes, grid: int):
    """Shard ratios of replicas of one shape, TP size ``n``: per position a vector over the replicas (None: equal
    parts), modulo swapping interchangeable replicas (``classes[rho]``: same class = same pattern and batch)."""
    r = len(classes)
    members: dict = {}
    for rho, c in enumerate(classes):
        members.setdefault(c, []).append(rho)
    yield (None,) * n
    if n == 1:  # one position: members of a class within 1/K of each other (module docstring)
        if len(members) == 1:
            return
        groups = list(members.values())
        for totals in compositions(grid, len(groups)):
            vec = [0] * r
            for group, total in zip(groups, totals):
                base, extra = divmod(total, len(group))
                for j, rho in enumerate(group):
                    vec[rho] = base + (1 if j >= len(group) - extra else 0)  # non-decreasing within the class
            if r * vec[0] == grid and len(set(vec)) == 1:
                continue  # the equal split on the grid: already None
            yield (tuple(k / grid for k in vec),)
        return
    per_position = list(ratio_vectors(r, grid))
    for combo in itertools.product(per_position, repeat=n):
        if all(vec is None for vec in combo):
            continue  # equal parts everywhere: yielded first
        values = [tuple(1.0 / r if vec is None else vec[rho] for vec in combo) for rho in range(r)]
        if all(values[a] <= values[b] for group in members.values() for a, b in zip(group, group[1:])):
            yield combo


def _options(spec, n: int, even: bool):
    """``unlike.unit_options``, or with ``even`` only the equal split (the fewest units that give it)."""
    opts = unit_options(spec, n)
    if even:
        equal = [(U, us) for U, us in opts if len(set(us)) == 1]
        return equal[:1] or opts
    return opts


def _unit_choices(spec, pipes, classes, even: bool = False):
    """Units per replica: one choice shared by replicas of one shape, else each its own (interchangeable ones in
    non-decreasing order); ``even``: every group split evenly."""
    sizes = [len(pipe[0]) for pipe in pipes]
    if len(set(sizes)) == 1:
        for opt in _options(spec, sizes[0], even):
            yield (opt,) * len(pipes)
        return
    opts = [_options(spec, n, even) for n in sizes]
    for combo in itertools.product(*(range(len(o)) for o in opts)):
        if all(combo[a] <= combo[b] for a in range(len(pipes)) for b in range(a + 1, len(pipes)) if classes[a] == classes[b]):
            yield tuple(o[j] for o, j in zip(opts, combo))


COLLECTIVES_BOUND_LIMIT = 64
"""Most units choices ``collectives_lower_bound`` prices (a sync_terms call each); beyond, it bounds by 0."""


def collectives_lower_bound(spec, cluster, pipes, zero_stage: int, patterns, even: bool = False) -> float:
    """The least collectives of eq. 17 (every ring pass of eq. 16 the iteration runs) over the skeleton's units
    choices, at equal parts (every unit group's largest shard is then as small as it gets); they do not depend
    on the batches, so this bounds every stage-``zero_stage`` plan of the skeleton. 0 (a bound too) when the
    skeleton has more than ``COLLECTIVES_BOUND_LIMIT`` units choices."""
    batches = [(1, 1)] * len(pipes)
    classes = list(patterns)
    N = spec.num_layers
    choices = list(itertools.islice(_unit_choices(spec, pipes, classes, even), COLLECTIVES_BOUND_LIMIT + 1))
    if len(choices) > COLLECTIVES_BOUND_LIMIT:
        return 0.0
    least = math.inf
    for units in choices:
        sync = sync_terms(cluster, layered_plan(spec, pipes, batches, zero_stage, units))
        least = min(least, layered_iteration_of(sync, zero_stage, N, [(0, _NOTHING)], 0.0, 0.0).collectives_ms)
    return least


_NOTHING = LayeredParts(emb_fwd_ms=0.0, layer_fwd_ms=0.0, head_fwd_ms=0.0, head_bwd_ms=0.0, layer_bwd_ms=0.0, emb_bwd_ms=0.0)


def expand_layered(spec, cluster, profiles, space, pipes, batches, zero_stage: int, patterns, limit_ms: float, *,
                   grid: int, even: bool = False, collectives_ms: float = 0.0, deadline_s: float = math.inf):
    """The structures of one stage-2/3 candidate that may beat an incumbent of ``limit_ms``: (entries, dropped),
    entries (bound, tables, structure, sync terms) below the limit, ``dropped`` a lower bound on every structure
    left out (inf when none was). Raises OverflowError when more than ``LAYOUT_LIMIT`` structures would be
    priced. ``collectives_ms``: a lower bound on the collectives of every structure (``collectives_lower_bound``),
    added to the compute alone to drop units choices before their syncs are priced. Raises TimeoutError when
    ``time.perf_counter()`` passes ``deadline_s`` (or a stop is requested) before every structure is priced."""
    tables = LayeredTables(spec, cluster, profiles, space, pipes, batches, zero_stage)
    classes = [(pattern, tuple(batch)) for pattern, batch in zip(patterns, batches)]
    one_shape = len({len(pipe[0]) for pipe in pipes}) == 1
    choose = one_shape and not even
    entries, dropped, priced = [], math.inf, 0
    for units in _unit_choices(spec, pipes, classes, even):
        if stop.past(deadline_s):
            raise TimeoutError
        lb = tables.compute_bound(units) + collectives_ms
        if lb >= limit_ms:
            dropped = min(dropped, lb)
            continue
        sync = sync_terms(cluster, layered_plan(spec, pipes, batches, zero_stage, units))  # the evaluator's own terms
        lb = tables.plain_bound(units, sync)  # equal parts: every unit's largest shard is as small as it gets
        if lb >= limit_ms:
            dropped = min(dropped, lb)
            continue
        assignments = ratio_assignments(len(pipes[0][0]), classes, grid) if choose else [None]
        by_largest = {}  # largest ratio per position -> value without recompute or optimizer step (eq. 16 sees only it)
        for combo in assignments:
            if combo is not None:
                largest = tuple(None if vec is None else max(vec) for vec in combo)
                if by_largest.get(largest, -math.inf) >= limit_ms:
                    dropped = min(dropped, by_largest[largest])
                    continue
            priced += 1
            if priced > LAYOUT_LIMIT:
                raise OverflowError(priced)
            if stop.past(deadline_s):
                raise TimeoutError
            ratios, terms = None, sync
            if combo is not None and any(vec is not None for vec in combo):
                ratios = {pipe[0][k]: (None if vec is None else vec[rho]) for k, vec in enumerate(combo)
                          for rho, pipe in enumerate(pipes)}
                terms = sync_terms(cluster, layered_plan(spec, pipes, batches, zero_stage, units, ratios))
            if combo is not None:
                by_largest.setdefault(largest, tables.plain_bound(units, terms))
            lb = tables.plain_bound(units, terms, tables.optimizer_ms(units, terms))
            if lb >= limit_ms:
                dropped = min(dropped, lb)
                continue
            entries.append((lb, tables, (units, ratios), terms))
    return entries, dropped


def solve_layered(tables: LayeredTables, struct, sync):
    """The best plan of a structure: (iteration ms, plan), or None when some device fits under no recompute set."""
    spec, space, N = tables.spec, tables.space, tables.spec.num_layers
    units, ratios = struct
    names = operator_names(spec)
    recompute, parts = {}, []
    for rho, opt in enumerate(units):
        slots, prices, edges, shares, _ = tables.group(rho, opt)
        per_device, fitting = fitting_backwards(spec, N, slots, prices, edges, sync, tables.zero_stage)
        got = _best_backward(per_device)
        if got is None:
            return None
        costs = []
        for sl, r, ok, j in zip(slots, shares, fitting, got[1]):
            rset = space.recompute_set(int(ok[j]))
            recompute[sl.device_id] = tuple(o for o in names if o in rset)
            costs.append(layer_cost(sl.profile, spec, tables.batches[rho][0], r, frozenset(recompute[sl.device_id])))
        b, m = tables.batches[rho]
        parts.append((m, layered_parts(tables.cluster, spec, b, [sl.device_id for sl in slots], [sl.profile for sl in slots],
                                       shares, costs)))
    total = tables.iteration_ms(parts, sync, tables.optimizer_ms(units, sync))
    return total, layered_plan(spec, tables.pipes, tables.batches, tables.zero_stage, units, ratios, recompute)
