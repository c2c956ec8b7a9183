"""Plans one local move away from a given plan, priced by the evaluator (issue 25: "local moves never win").

A returned plan that a single move improves shows a gap in the searched family or a bug in the search; the moves
are those that matter on heterogeneous clusters:

* ``drop-device``: a device leaves its TP group (its units go to one peer), or a one-device stage leaves its
  pipeline (its layers go to a neighbouring stage), or a one-device replica leaves (its micro-batches go to another
  replica of the same micro-batch size);
* ``add-device``: an idle device of the cluster joins a stage's TP group, taking one unit (U doubled when every
  member holds one unit and the model splits that finely);
* ``swap-devices``: two devices of different GPU types trade places, between stages or replicas (or a used device
  with an idle one of another type);
* ``move-layer``: one layer between adjacent stages, in one replica or in every replica of the same shape;
* ``move-unit``: one TP unit between two members of a group (at twice the granularity U when the giver holds one),
  in one replica or in every replica of the same shape;
* ``move-sample``: one micro-batch from one replica to another (uneven data parallelism);
* ``shard-ratio``: 1/K of a peer group's optimizer state from one holder to another (zero stage >= 1);
* ``recompute``: one operator added to or removed from one device's recompute set (or at one position of every
  replica of the same shape);
* ``micro-batch``: every replica's (or one replica's) micro-batch size to another profiled size, samples kept;
* ``zero-stage``: the sharding stage changed, the rest kept.

A move is a change of the plan's data only; whether the result is a valid plan that fits is the evaluator's call
(``price_neighbours`` skips what ``baton.plan.validate`` or ``baton.evaluate.evaluate`` refuses and what does not
fit). On large plans a move kind may have thousands of instances; ``max_per_move`` keeps a deterministic sample.
"""
from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from baton.cluster import ClusterSpec
from baton.errors import BatonError
from baton.evaluate import evaluate
from baton.memory import offload_problem
from baton.model_spec import splits_into
from baton.operators import operator_names
from baton.peers import peer_groups
from baton.plan import LAYERED_ZERO_STAGES, SUPPORTED_ZERO_STAGES, DeviceShare, Pipeline, Plan, validate
from baton.profile import ProfileSet

from solver.instance import DEFAULT_SHARD_GRID

MOVES = ("drop-device", "add-device", "swap-devices", "move-layer", "move-unit", "move-sample", "shard-ratio",
         "recompute", "micro-batch", "zero-stage")
"""Every move kind, in the order ``neighbours`` yields them."""



@dataclass(frozen=True, kw_only=True, slots=True)
class Neighbour:
    """A plan one move away from another."""

    move: str
    """The move kind, one of ``MOVES``."""
    detail: str
    """Which instance of the move: devices, replicas, stages, operators involved."""
    plan: Plan
    """The moved plan, not yet validated."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Priced:
    """A neighbour the evaluator accepted, with its time."""

    move: str
    """The move kind."""
    detail: str
    """Which instance of the move."""
    iteration_ms: float
    """The evaluator's iteration time of the neighbour."""
    fits: bool
    """Every device (and host) within capacity."""
    plan: Plan
    """The neighbour itself, to print when it wins."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Tally:
    """What happened to the neighbours of one move kind."""

    generated: int
    """Instances of the move (after sampling)."""
    invalid: int
    """Refused by validation or the evaluator (a move that breaks a rule of plans is no neighbour)."""
    over_capacity: int
    """Valid, priced, but some device or host does not fit."""
    priced: int
    """Valid and fitting."""
    reasons: tuple[str, ...] = ()
    """The first few distinct reasons given for invalid ones (to tell a rule of plans from a broken move)."""


# --- plan surgery --------------------------------------------------------------------------------------------

def _relaid(plan: Plan, pipes, **kw) -> Plan:
    """``plan`` with these pipelines, every stage's ``first_layer`` recomputed from the layer counts."""
    fixed = []
    for pipe in pipes:
        first, stages = 0, []
        for st in pipe.stages:
            stages.append(dataclasses.replace(st, first_layer=first))
            first += st.num_layers
        fixed.append(dataclasses.replace(pipe, stages=tuple(stages)))
    return dataclasses.replace(plan, pipelines=tuple(fixed), **kw)


def _with_group(pipe: Pipeline, s: int, units_per_layer: int, devices) -> Pipeline:
    """Device group ``s`` of the pipeline replaced, on every virtual stage it runs (interleaved: s, s + p, ...)."""
    p = len(pipe.device_stages)
    stages = [dataclasses.replace(st, units_per_layer=units_per_layer, devices=tuple(devices)) if k % p == s else st
              for k, st in enumerate(pipe.stages)]
    return dataclasses.replace(pipe, stages=tuple(stages))


def _set_pipe(plan: Plan, r: int, pipe: Pipeline, **kw) -> Plan:
    pipes = list(plan.pipelines)
    pipes[r] = pipe
    return _relaid(plan, pipes, **kw)


def _set_batch(plan: Plan, r: int, b: int, m: int) -> Pipeline:
    """Replica ``r`` with its own (micro-batch size, count) written out (None where they equal the plan's)."""
    return dataclasses.replace(plan.pipelines[r], micro_batch_size=b, num_microbatches=m)


def _shape(pipe: Pipeline) -> tuple:
    """What replicas of one shape share: stage count, layers, U and units per rank (the MILP's positions)."""
    return (pipe.chunks, tuple((st.num_layers, st.units_per_layer, tuple(d.units for d in st.devices)) for st in pipe.stages))


def _same_shape_replicas(plan: Plan, r: int) -> list[int]:
    key = _shape(plan.pipelines[r])
    return [i for i, p in enumerate(plan.pipelines) if _shape(p) == key]


def _equal_ratio(plan: Plan) -> float:
    """The ratio that stands for equal parts: every peer group has one holder per replica (each replica holds the
    whole model, and a block is cut where any replica's units are), so 1/r is every holder's equal weight."""
    return 1.0 / len(plan.pipelines)


def _explicit_ratios(plan: Plan) -> Plan:
    """The plan with every device's ``shard_ratio`` written out (None read as the equal part); same plan priced."""
    if all(d.shard_ratio is not None for p in plan.pipelines for st in p.stages for d in st.devices):
        return plan
    eq = _equal_ratio(plan)
    pipes = [dataclasses.replace(p, stages=tuple(dataclasses.replace(st, devices=tuple(
        dataclasses.replace(d, shard_ratio=eq if d.shard_ratio is None else d.shard_ratio) for d in st.devices))
        for st in p.stages)) for p in plan.pipelines]
    return dataclasses.replace(plan, pipelines=tuple(pipes))


def _summed_ratio(plan: Plan, a: float | None, b: float | None) -> float | None:
    """The shard ratio of a device that takes over another's: the sum of the two, None (equal parts) where both are,
    a None beside a number read as the equal part (a stage may mix them)."""
    if a is None and b is None:
        return None
    eq = _equal_ratio(plan)
    return (eq if a is None else a) + (eq if b is None else b)


def _map_devices(plan: Plan, fn: Callable[[DeviceShare], DeviceShare]) -> Plan:
    pipes = [dataclasses.replace(p, stages=tuple(dataclasses.replace(st, devices=tuple(fn(d) for d in st.devices))
                                                 for st in p.stages)) for p in plan.pipelines]
    return dataclasses.replace(plan, pipelines=tuple(pipes))


# --- the moves: each yields (detail, thunk) so that a large plan's instances can be sampled before any is built ---

Lazy = Iterator[tuple[str, Callable[[], Plan]]]


def _drop_device(plan: Plan) -> Lazy:
    for r, pipe in enumerate(plan.pipelines):
        groups = pipe.device_stages
        for s, st in enumerate(groups):
            if len(st.devices) >= 2:
                for k, d in enumerate(st.devices):
                    for j, peer in enumerate(st.devices):
                        if j == k:
                            continue

                        def build(r=r, s=s, st=st, k=k, j=j, d=d):
                            devs = [dataclasses.replace(x, units=x.units + d.units,
                                                        shard_ratio=_summed_ratio(plan, x.shard_ratio, d.shard_ratio))
                                    if i == j else x for i, x in enumerate(st.devices) if i != k]
                            return _set_pipe(plan, r, _with_group(plan.pipelines[r], s, st.units_per_layer, devs))
                        yield f"replica {r} stage {s}: drop {d.id}, its {d.units} units to {peer.id}", build
            elif len(groups) >= 2 and pipe.chunks == 1:
                for into in (s - 1, s + 1):
                    if 0 <= into < len(groups):
                        def build(r=r, s=s, into=into):
                            stages = list(plan.pipelines[r].stages)
                            stages[into] = dataclasses.replace(stages[into], num_layers=stages[into].num_layers + stages[s].num_layers)
                            del stages[s]
                            return _set_pipe(plan, r, dataclasses.replace(plan.pipelines[r], stages=tuple(stages)))
                        yield f"replica {r}: drop stage {s} ({st.devices[0].id}), its layers to stage {into}", build
        if len(pipe.stages) == 1 and len(pipe.stages[0].devices) == 1 and len(plan.pipelines) >= 2:
            b, m = plan.batch(r)
            for o in range(len(plan.pipelines)):
                if o != r and plan.batch(o)[0] == b:
                    def build(r=r, o=o, b=b, m=m):
                        pipes = list(plan.pipelines)
                        pipes[o] = _set_batch(plan, o, b, plan.batch(o)[1] + m)
                        for i in range(len(pipes)):  # every replica states its own batch: the plan's default may go
                            pipes[i] = pipes[i] if i == o else _set_batch(plan, i, *plan.batch(i))
                        del pipes[r]
                        return _relaid(plan, pipes)
                    yield f"drop replica {r} ({pipe.stages[0].devices[0].id}), its {m} micro-batches to replica {o}", build


def _idle(plan: Plan, cluster: ClusterSpec) -> list[str]:
    """Idle devices, one per (node, GPU type): the others of a node are interchangeable with it for every move."""
    used = set(plan.device_ids())
    seen, out = set(), []
    for d in cluster.devices:
        if d.id not in used and (d.node, d.gpu.name) not in seen:
            seen.add((d.node, d.gpu.name))
            out.append(d.id)
    return out


def _add_device(plan: Plan, cluster: ClusterSpec) -> Lazy:
    idle = _idle(plan, cluster)
    for r, pipe in enumerate(plan.pipelines):
        for s, st in enumerate(pipe.device_stages):
            U = st.units_per_layer
            if max(d.units for d in st.devices) >= 2:
                scale = 1
            elif splits_into(plan.model, 2 * U):
                scale = 2
            else:
                continue
            for new in idle:
                def build(r=r, s=s, st=st, new=new, scale=scale):
                    devs = [dataclasses.replace(d, units=d.units * scale) for d in st.devices]
                    k = max(range(len(devs)), key=lambda i: devs[i].units)
                    devs[k] = dataclasses.replace(devs[k], units=devs[k].units - 1)
                    # The newcomer weighs what the member it took from weighs: all or none of a group state a ratio.
                    devs.append(DeviceShare(id=new, units=1, shard_ratio=devs[k].shard_ratio))
                    return _set_pipe(plan, r, _with_group(plan.pipelines[r], s, st.units_per_layer * scale, devs))
                yield f"replica {r} stage {s}: add idle {new} with one unit", build


def _swap_devices(plan: Plan, cluster: ClusterSpec) -> Lazy:
    # Positions are (replica, group, rank); two devices of one group trade only units, which move-unit covers.
    where = [(r, s, k, d.id) for r, p in enumerate(plan.pipelines) for s, st in enumerate(p.device_stages)
             for k, d in enumerate(st.devices)]
    gpu = {d.id: d.gpu.name for d in cluster.devices}
    # One device per (replica, group, GPU type): the others of the group are the same to a swap up to their node.
    reps, seen = [], set()
    for r, s, k, i in where:
        if (r, s, gpu[i]) not in seen:
            seen.add((r, s, gpu[i]))
            reps.append((r, s, k, i))

    def renamed(mapping: dict[str, str]) -> Plan:
        return _map_devices(plan, lambda d: dataclasses.replace(d, id=mapping.get(d.id, d.id)))

    for x in range(len(reps)):
        for y in range(x + 1, len(reps)):
            a, b = reps[x], reps[y]
            if (a[0], a[1]) != (b[0], b[1]) and gpu[a[3]] != gpu[b[3]]:
                yield (f"swap {a[3]} (replica {a[0]} stage {a[1]}) with {b[3]} (replica {b[0]} stage {b[1]})",
                       lambda a=a, b=b: renamed({a[3]: b[3], b[3]: a[3]}))
    for r, s, k, i in reps:
        for new in _idle(plan, cluster):
            if gpu[new] != gpu[i]:
                yield f"swap {i} (replica {r} stage {s}) with idle {new}", lambda i=i, new=new: renamed({i: new})


def _move_layer(plan: Plan) -> Lazy:
    def moved(replicas, a, b):
        pipes = list(plan.pipelines)
        for r in replicas:
            stages = list(pipes[r].stages)
            stages[a] = dataclasses.replace(stages[a], num_layers=stages[a].num_layers - 1)
            stages[b] = dataclasses.replace(stages[b], num_layers=stages[b].num_layers + 1)
            pipes[r] = dataclasses.replace(pipes[r], stages=tuple(stages))
        return _relaid(plan, pipes)

    done = set()
    for r, pipe in enumerate(plan.pipelines):
        alike = _same_shape_replicas(plan, r)
        for s in range(len(pipe.stages) - 1):
            for a, b in ((s, s + 1), (s + 1, s)):
                if pipe.stages[a].num_layers == 0:
                    continue
                yield f"replica {r}: a layer from stage {a} to {b}", lambda r=r, a=a, b=b: moved([r], a, b)
                if len(alike) > 1 and (tuple(alike), a, b) not in done:
                    done.add((tuple(alike), a, b))
                    yield (f"replicas {alike[0]}..{alike[-1]} (one shape): a layer from stage {a} to {b}",
                           lambda alike=alike, a=a, b=b: moved(alike, a, b))


def _move_unit(plan: Plan) -> Lazy:
    def moved(replicas, s, a, b, scale):
        pipes = list(plan.pipelines)
        for r in replicas:
            st = pipes[r].device_stages[s]
            devs = [dataclasses.replace(d, units=d.units * scale + (1 if k == b else -1 if k == a else 0))
                    for k, d in enumerate(st.devices)]
            pipes[r] = _with_group(pipes[r], s, st.units_per_layer * scale, devs)
        return _relaid(plan, pipes)

    done = set()
    for r, pipe in enumerate(plan.pipelines):
        alike = _same_shape_replicas(plan, r)
        for s, st in enumerate(pipe.device_stages):
            # A member holding one unit can give one only at a finer granularity: U doubled (every member's units
            # doubled first, the same split), where the model's heads and FFN columns allow it.
            scale = 2 if splits_into(plan.model, 2 * st.units_per_layer) else 1
            for a, da in enumerate(st.devices):
                for b, db in enumerate(st.devices):
                    k = 1 if da.units >= 2 else scale
                    if a == b or da.units * k < 2:
                        continue
                    finer = f" (U {st.units_per_layer} -> {st.units_per_layer * k})" if k > 1 else ""
                    yield (f"replica {r} stage {s}: a unit from {da.id} to {db.id}{finer}",
                           lambda r=r, s=s, a=a, b=b, k=k: moved([r], s, a, b, k))
                    if len(alike) > 1 and (tuple(alike), s, a, b) not in done:
                        done.add((tuple(alike), s, a, b))
                        yield (f"replicas {alike[0]}..{alike[-1]} (one shape) stage {s}: a unit from rank {a} to {b}{finer}",
                               lambda alike=alike, s=s, a=a, b=b, k=k: moved(alike, s, a, b, k))


def _move_sample(plan: Plan) -> Lazy:
    """One micro-batch of replica ``i`` (b_i samples) to replica ``j``, whose micro-batch size must divide b_i."""
    n = len(plan.pipelines)
    for i in range(n):
        bi, mi = plan.batch(i)
        if mi < 2:
            continue  # a replica with no micro-batch left is a dropped device, not a moved sample
        for j in range(n):
            bj, mj = plan.batch(j)
            if j == i or bi % bj:
                continue

            def build(i=i, j=j, bi=bi, mi=mi, bj=bj, mj=mj):
                pipes = [_set_batch(plan, k, *plan.batch(k)) for k in range(n)]
                pipes[i] = _set_batch(plan, i, bi, mi - 1)
                pipes[j] = _set_batch(plan, j, bj, mj + bi // bj)
                return _relaid(plan, pipes)
            yield f"a micro-batch ({bi} samples) from replica {i} to replica {j}", build


def _shard_ratio(plan: Plan, grid: int) -> Lazy:
    if plan.zero_stage < 1:
        return
    explicit = _explicit_ratios(plan)
    ratio = {d.id: d.shard_ratio for p in explicit.pipelines for st in p.stages for d in st.devices}
    # One grid step, or with more replicas than grid steps (equal parts 1/r off the grid, below 1/K) one equal part:
    # a holder then hands its whole part to a peer, the smallest change that stays a multiple of what it owns.
    step = min(1.0 / grid, _equal_ratio(plan))
    seen = set()
    for g in peer_groups(plan):
        if len(g.holders) < 2 or g.holders in seen:
            continue
        seen.add(g.holders)
        for a in g.holders:
            if ratio[a] < step * (1 - 1e-12):
                continue
            for b in g.holders:
                if a == b:
                    continue

                def build(a=a, b=b):
                    new = {a: max(0.0, ratio[a] - step), b: ratio[b] + step}
                    return _map_devices(explicit, lambda d: dataclasses.replace(d, shard_ratio=new.get(d.id, d.shard_ratio)))
                yield f"{step:g} of the state of peers {g.holders[0]}.. from {a} to {b}", build


def _recompute(plan: Plan) -> Lazy:
    names = operator_names(plan.model)

    def toggled(targets, op):
        def fn(d):
            if d.id not in targets:
                return d
            rec = frozenset(set(d.recompute) ^ {op})
            # A recomputed operator no longer holds what it made: an offloaded tensor it made has nothing left to
            # move, so it stops being offloaded too (else the move is only ever refused: baton.memory.offload_problem).
            off = tuple(t for t in d.offload if offload_problem(plan.model, rec, frozenset({t})) is None)
            if off and offload_problem(plan.model, rec, frozenset(off)) is not None:
                off = ()  # q, k, v of fused attention move together or not at all
            return dataclasses.replace(d, recompute=tuple(o for o in names if o in rec), offload=off)
        return _map_devices(plan, fn)

    done = set()
    for r, pipe in enumerate(plan.pipelines):
        alike = _same_shape_replicas(plan, r)
        for s, st in enumerate(pipe.device_stages):
            for k, d in enumerate(st.devices):
                for op in names:
                    how = "drop" if op in d.recompute else "add"
                    yield f"{d.id} (replica {r} stage {s}): {how} {op}", lambda d=d, op=op: toggled({d.id}, op)
                    if len(alike) > 1 and (tuple(alike), s, k, op) not in done:
                        done.add((tuple(alike), s, k, op))
                        same = {plan.pipelines[i].device_stages[s].devices[k].id for i in alike}
                        yield (f"replicas {alike[0]}..{alike[-1]} stage {s} rank {k}: toggle {op}",
                               lambda same=same, op=op: toggled(same, op))


def _micro_batch(plan: Plan, cluster: ClusterSpec, profiles: ProfileSet) -> Lazy:
    gpu = {d.id: d.gpu.name for d in cluster.devices}

    def sizes(r: int) -> set[int]:
        types = {gpu[i] for st in plan.pipelines[r].device_stages for i in st.device_ids}
        return set.intersection(*(set(profiles[g].micro_batches("qkv")) for g in types))

    n = len(plan.pipelines)
    held = [sizes(r) for r in range(n)]
    for b in sorted(set.intersection(*held)):
        if all(plan.batch(r)[0] == b for r in range(n)) or any(plan.samples(r) % b for r in range(n)):
            continue

        def build(b=b):
            if plan.uniform_batches:
                return _relaid(plan, list(plan.pipelines), micro_batch_size=b, num_microbatches=plan.samples(0) // b)
            return _relaid(plan, [_set_batch(plan, r, b, plan.samples(r) // b) for r in range(n)])
        yield f"every replica at micro-batch size {b}", build
    if n > 1:
        for r in range(n):
            for b in sorted(held[r]):
                if b != plan.batch(r)[0] and plan.samples(r) % b == 0:
                    def build(r=r, b=b):
                        return _relaid(plan, [_set_batch(plan, k, *((b, plan.samples(r) // b) if k == r else plan.batch(k)))
                                              for k in range(n)])
                    yield f"replica {r} at micro-batch size {b}", build


def _zero_stage(plan: Plan) -> Lazy:
    for z in SUPPORTED_ZERO_STAGES:
        if z == plan.zero_stage:
            continue
        if z in LAYERED_ZERO_STAGES and any(len(p.stages) > 1 for p in plan.pipelines):
            continue  # stages 2 and 3 need one-stage replicas: that is another layout, not one move

        def build(z=z):
            moved = plan if z >= 1 else _map_devices(plan, lambda d: dataclasses.replace(d, shard_ratio=None))
            return dataclasses.replace(moved, zero_stage=z)
        yield f"zero stage {plan.zero_stage} -> {z}", build


def neighbours(plan: Plan, cluster: ClusterSpec, profiles: ProfileSet, *, moves=MOVES, shard_grid: int = DEFAULT_SHARD_GRID,
               max_per_move: int | None = None, seed: int = 0) -> Iterator[Neighbour]:
    """Every plan one move of ``moves`` away from ``plan`` (not yet validated); at most ``max_per_move`` of each kind,
    a deterministic sample (``seed``) where there are more."""
    makers = {"drop-device": lambda: _drop_device(plan), "add-device": lambda: _add_device(plan, cluster),
              "swap-devices": lambda: _swap_devices(plan, cluster), "move-layer": lambda: _move_layer(plan),
              "move-unit": lambda: _move_unit(plan), "move-sample": lambda: _move_sample(plan),
              "shard-ratio": lambda: _shard_ratio(plan, shard_grid), "recompute": lambda: _recompute(plan),
              "micro-batch": lambda: _micro_batch(plan, cluster, profiles), "zero-stage": lambda: _zero_stage(plan)}
    unknown = set(moves) - set(makers)
    if unknown:
        raise ValueError(f"unknown moves {sorted(unknown)} (known: {', '.join(MOVES)})")
    for move in MOVES:
        if move not in moves:
            continue
        lazy = list(makers[move]())
        if max_per_move is not None and len(lazy) > max_per_move:
            lazy = random.Random(f"{move}/{seed}").sample(lazy, max_per_move)
        for detail, build in lazy:
            yield Neighbour(move=move, detail=detail, plan=build())


def price_neighbours(plan: Plan, cluster: ClusterSpec, profiles: ProfileSet, **kw) -> tuple[list[Priced], dict[str, Tally]]:
    """Every neighbour (``neighbours``'s keywords) that validates, priced by the evaluator; and a tally per move kind."""
    out: list[Priced] = []
    counts: dict[str, list[int]] = {m: [0, 0, 0, 0] for m in MOVES}
    reasons: dict[str, list[str]] = {m: [] for m in MOVES}
    for nb in neighbours(plan, cluster, profiles, **kw):
        c = counts[nb.move]
        c[0] += 1
        try:
            moved = validate(nb.plan)
            rep = evaluate(moved, cluster, profiles)
        except (BatonError, ValueError, KeyError, ZeroDivisionError) as exc:
            # A move that breaks a rule of plans (units, coverage, a shard ratio all zero, a size no table holds) is
            # no neighbour; the evaluator refuses it by raising, the same way it refuses a user's plan.
            c[1] += 1
            why = f"{type(exc).__name__}: {str(exc)[:160]}"
            if len(reasons[nb.move]) < 3 and why not in reasons[nb.move]:
                reasons[nb.move].append(why)
            continue
        if not rep.fits:
            c[2] += 1
        else:
            c[3] += 1
        out.append(Priced(move=nb.move, detail=nb.detail, iteration_ms=rep.iteration_time_ms, fits=rep.fits, plan=moved))
    tally = {m: Tally(generated=c[0], invalid=c[1], over_capacity=c[2], priced=c[3], reasons=tuple(reasons[m]))
             for m, c in counts.items()}
    return out, tally
