"""Baselines, each the best plan its rules allow, all scored by the same evaluator.

* megatron: uniform layers per stage, uniform TP (equal shares), data parallelism, recompute none /
  selective (attention core) / full on every device; ranks laid out TP-fastest, then DP, then PP over the
  devices in cluster order (optionally only some GPU types).
* hethub: stages of one GPU type each with a TP degree per type (equal shares), uneven layers (chosen
  exactly by the inner MILP), recompute none or full per stage, every type order tried.
* hap: one TP group (no pipeline) with uneven shares from HAP's sharding-ratio LP, rounded to units.
* exhaustive: every plan (layout, rank order, micro-batch, layers, units, recompute sets from a given
  universe), each evaluated. Small instances only: the test oracle.
"""
from __future__ import annotations

import itertools
import math
import time

import pyomo.environ as pyo

from baton.errors import BatonError
from baton.costmodel import layer_train_ms
from baton.evaluate import evaluate
from baton.memory import recompute_space
from baton.operators import operator_names
from baton.plan import DeviceShare, Pipeline, Plan, Stage, validate

from solver.milp import highs_solve
from solver.options import units_in_proportion, valid_unit_counts
from solver.space import Skeleton, hethub_layout, megatron_layout
from solver.search import NoPlanFits, SolveResult, micro_batch_candidates, search

SELECTIVE = ("attn_scores", "softmax", "attn_dropout", "attn_v")


def recompute_modes(spec) -> dict[str, tuple[str, ...]]:
    names = operator_names(spec)
    return {"none": (), "selective": tuple(o for o in names if o in SELECTIVE), "full": tuple(names)}


def _result(best, strategy, t0, evaluated, notes=()) -> SolveResult:
    if best is None:
        raise NoPlanFits(f"{strategy}: no plan allowed by its rules fits in memory ({evaluated} evaluated)")
    report, plan = best
    total = time.perf_counter() - t0
    res = SolveResult(plan=plan, report=report, strategy=strategy, status="best of enumeration",
                      objective_ms=report.iteration_time_ms, bound_ms=report.iteration_time_ms, gap=0.0, build_s=0.0,
                      solve_s=total, total_s=total, family="enumeration", candidates=evaluated, notes=list(notes))
    res.plan = plan.with_info(**res.info())
    return res


def _consider(best, plan, cluster, profiles):
    report = evaluate(plan, cluster, profiles)
    if report.fits and (best is None or report.iteration_time_ms < best[0].iteration_time_ms):
        return (report, plan)
    return best


def _type_subsets(cluster):
    types = cluster.gpu_types
    for k in range(len(types), 0, -1):
        for sub in itertools.combinations(types, k):
            yield [d for d in cluster.devices if d.gpu.name in sub]


def megatron(spec, cluster, profiles, *, global_batch: int, micro_batch: int | None = None) -> SolveResult:
    t0 = time.perf_counter()
    N = spec.num_layers
    Us = valid_unit_counts(spec)
    modes = recompute_modes(spec)
    best, n_eval = None, 0
    for b in micro_batch_candidates(spec, cluster, profiles, global_batch, micro_batch):
        for devs in _type_subsets(cluster):
            n = len(devs)
            for t in [u for u in Us if n % u == 0]:
                for p in [q for q in range(1, N + 1) if N % q == 0 and (n // t) % q == 0]:
                    layout = megatron_layout([d.id for d in devs], t, p)
                    if global_batch % (b * layout.num_replicas):
                        continue
                    for rec in modes.values():
                        pipes = tuple(Pipeline(stages=tuple(
                            Stage(first_layer=s * (N // p), num_layers=N // p, units_per_layer=t,
                                  devices=tuple(DeviceShare(id=i, units=1, recompute=rec) for i in ids))
                            for s, ids in enumerate(pipe))) for pipe in layout.pipelines)
                        plan = validate(Plan(model=spec, cluster=cluster.name, micro_batch_size=b,
                                             num_microbatches=global_batch // (b * layout.num_replicas), pipelines=pipes))
                        best = _consider(best, plan, cluster, profiles)
                        n_eval += 1
    return _result(best, "megatron", t0, n_eval)


def hethub_skeletons(spec, cluster) -> list[Skeleton]:
    """Stages of one GPU type; each type cut into equal TP groups (devices in cluster order)."""
    by_type: dict[str, list[str]] = {}
    for d in cluster.devices:
        by_type.setdefault(d.gpu.name, []).append(d.id)
    out = []
    types = list(by_type)
    for k in range(1, len(types) + 1):
        for order in itertools.permutations(types, k):
            degrees = [[t for t in valid_unit_counts(spec) if len(by_type[g]) % t == 0] for g in order]
            for ts in itertools.product(*degrees):
                sk = hethub_layout(by_type, order, ts)
                if sk.num_stages <= spec.num_layers + 2:
                    out.append(sk)
    return out


def hethub(spec, cluster, profiles, *, global_batch: int, micro_batch: int | None = None, time_limit: float = 60.0,
           gap: float = 1e-4, threads: int = 2) -> SolveResult:
    modes = recompute_modes(spec)
    allowed = {"uniform_tp": True, "recompute": {frozenset(), frozenset(modes["full"])}}
    res = search(spec, cluster, profiles, global_batch=global_batch, micro_batch=micro_batch, time_limit=time_limit, gap=gap,
                 threads=threads, skeletons=hethub_skeletons(spec, cluster), family="hethub", strategy="hethub",
                 allowed=allowed, space=recompute_space(spec, (frozenset(), frozenset(modes["full"]))))
    return res


def hap_shares(times_at: list[list[float]], U: int, threads: int = 1) -> list[int]:
    """HAP's sharding-ratio LP (Sec. 5.1): minimise max_j comp_j(B_j), comp_j linear in the ratio, sum B = 1;
    then round B_j * U to units (largest remainder, at least one each)."""
    n = len(times_at)
    m = pyo.ConcreteModel()
    m.B = pyo.Var(range(n), domain=pyo.NonNegativeReals)
    m.z = pyo.Var(domain=pyo.NonNegativeReals)
    m.c = pyo.ConstraintList()
    m.c.add(sum(m.B[j] for j in range(n)) == 1)
    for j, (a, slope) in enumerate(times_at):  # comp_j(B) = a + slope * B
        m.c.add(m.z >= a + slope * m.B[j])
    m.obj = pyo.Objective(expr=m.z)
    res = highs_solve(m, threads=threads)
    res.solution_loader.load_vars()
    ratios = [max(0.0, pyo.value(m.B[j])) for j in range(n)]
    return units_in_proportion(ratios, U)


def hap(spec, cluster, profiles, *, global_batch: int, micro_batch: int | None = None, threads: int = 1) -> SolveResult:
    t0 = time.perf_counter()
    N = spec.num_layers
    modes = recompute_modes(spec)
    best, n_eval = None, 0

    for b in micro_batch_candidates(spec, cluster, profiles, global_batch, micro_batch):
        for devs in _type_subsets(cluster):
            Us = [u for u in valid_unit_counts(spec) if u >= len(devs)]
            if not Us:
                continue
            U = max(Us)
            times = []
            for d in devs:  # HAP's linear cost model, through shares 1/U and 1
                prof = profiles[d.gpu.name]
                full, least = layer_train_ms(prof, spec, b, 1.0), layer_train_ms(prof, spec, b, 1.0 / U)
                slope = (full - least) / (1 - 1.0 / U) if U > 1 else full
                times.append((full - slope, slope))
            units = hap_shares(times, U, threads)
            for rec in modes.values():
                stage = Stage(first_layer=0, num_layers=N, units_per_layer=U,
                              devices=tuple(DeviceShare(id=d.id, units=u, recompute=rec) for d, u in zip(devs, units)))
                plan = validate(Plan(model=spec, cluster=cluster.name, micro_batch_size=b, num_microbatches=global_batch // b,
                                     pipelines=(Pipeline(stages=(stage,)),)))
                best = _consider(best, plan, cluster, profiles)
                n_eval += 1
    return _result(best, "hap", t0, n_eval)


# -- exhaustive --------------------------------------------------------------------------------------


def _ordered_groups(devs):
    for k in range(1, len(devs) + 1):
        for combo in itertools.combinations(devs, k):
            for perm in itertools.permutations(combo):
                yield perm


def _raw_pipelines(devs, shape=None):
    """Every sequence of disjoint ordered groups (optionally with fixed group sizes)."""
    if shape is not None and not shape:
        yield (), devs
        return
    for g in _ordered_groups(devs):
        if shape is not None and len(g) != shape[0]:
            continue
        rest = [d for d in devs if d not in g]
        if shape is None:
            yield (g,), rest
            for tail, left in _raw_pipelines(rest):
                yield (g,) + tail, left
        else:
            for tail, left in _raw_pipelines(rest, shape[1:]):
                yield (g,) + tail, left


def raw_layouts(device_ids: list[str], max_stages: int):
    """All replica sets: each replica a sequence of ordered groups; replicas share the group sizes."""
    def more(reps, left, shape):
        yield reps
        for pipe, rest in _raw_pipelines(left, shape):
            if pipe > reps[-1]:
                yield from more(reps + (pipe,), rest, shape)
    for pipe, rest in _raw_pipelines(list(device_ids)):
        if len(pipe) <= max_stages:
            yield from more((pipe,), rest, tuple(len(g) for g in pipe))


def _splits(N, p):
    lo = [N] if p == 1 else [0] + [1] * (p - 2) + [0]
    def rec(s, left):
        if s == p - 1:
            if left >= lo[s]:
                yield (left,)
            return
        for L in range(lo[s], left + 1):
            for tail in rec(s + 1, left - L):
                yield (L,) + tail
    yield from rec(0, N)


def _unit_splits(n, Us):
    for U in Us:
        if U < n:
            continue
        for cut in itertools.combinations(range(1, U), n - 1):
            bounds = (0,) + cut + (U,)
            yield U, tuple(bounds[i + 1] - bounds[i] for i in range(n))


def exhaustive(spec, cluster, profiles, *, global_batch: int, micro_batch: int | None = None,
               universe: list[frozenset] | None = None, max_plans: int = 3_000_000) -> SolveResult:
    """Evaluate every plan. ``universe`` is the list of recompute sets each device may use (default: all)."""
    t0 = time.perf_counter()
    N = spec.num_layers
    names = operator_names(spec)
    if len(cluster.devices) > 6:
        raise BatonError(f"exhaustive search is for small instances only (at most 6 devices, the cluster has "
                         f"{len(cluster.devices)})", field="--strategy")
    if universe is None:
        universe = [frozenset(c) for k in range(len(names) + 1) for c in itertools.combinations(names, k)]
    universe = [tuple(o for o in names if o in r) for r in universe]
    Us = valid_unit_counts(spec)
    mbs = micro_batch_candidates(spec, cluster, profiles, global_batch, micro_batch)
    layouts = list(raw_layouts([d.id for d in cluster.devices], N + 2))
    # Rough size check before starting: layouts x splits x units x recompute choices.
    estimate = 0
    for reps in layouts:
        p = len(reps[0])
        units = math.prod(sum(1 for _ in _unit_splits(len(g), Us)) for g in reps[0])
        estimate += math.comb(N + 1, max(p - 1, 0)) * units * len(universe) ** sum(len(g) for pp in reps for g in pp)
    estimate *= len(mbs)
    if estimate > max_plans:
        raise BatonError(f"exhaustive search would evaluate about {estimate:.2g} plans (limit {max_plans:.2g}); "
                         "use it on small instances only", field="--strategy")
    best, n_eval = None, 0
    for b in mbs:
        for reps in layouts:
            r, p = len(reps), len(reps[0])
            if global_batch % (b * r):
                continue
            m = global_batch // (b * r)
            flat = [d for pp in reps for g in pp for d in g]
            for layers in _splits(N, p):
                for units in itertools.product(*[list(_unit_splits(len(g), Us)) for g in reps[0]]):
                    for recs in itertools.product(universe, repeat=len(flat)):
                        rec_of = dict(zip(flat, recs))
                        pipes = []
                        for pp in reps:
                            stages, first = [], 0
                            for s, g in enumerate(pp):
                                U, us = units[s]
                                stages.append(Stage(first_layer=first, num_layers=layers[s], units_per_layer=U,
                                                    devices=tuple(DeviceShare(id=d, units=u, recompute=rec_of[d]) for d, u in zip(g, us))))
                                first += layers[s]
                            pipes.append(Pipeline(stages=tuple(stages)))
                        plan = validate(Plan(model=spec, cluster=cluster.name, micro_batch_size=b, num_microbatches=m,
                                             pipelines=tuple(pipes)))
                        best = _consider(best, plan, cluster, profiles)
                        n_eval += 1
    return _result(best, "exhaustive", t0, n_eval)
