"""The planner and the evaluator read one priced model (baton/costmodel.py): these tests hold them to it.

* The liveness matrix the planner prunes with is the evaluator's rule, set by set, tensor by tensor
  (a second copy of rule (b) without the segment test once disagreed on 2,816 pairs for gpt3-1.3b).
* Term by term over random plans: the MILP instance's stage constants, transfers, syncs, per-device
  block times and memory limits equal what the evaluator computes for the same plan, and the MILP with
  every decision fixed to the plan reproduces the evaluator's iteration time.
* Exact optimum against an exhaustive search whose recompute universe is the whole power set.
* Local moves from a returned plan (a layer, a unit, a recomputed operator, the micro-batch) never
  improve it under the evaluator.
"""
from __future__ import annotations

import dataclasses
import math
import random

import pyomo.environ as pyo
import pytest

from baton.costmodel import device_memory, device_slot, edge_cost, layer_cost, layer_cost_of, layer_prices, max_layers_that_fit
from baton.evaluate import evaluate
from baton.memory import is_held, is_rematerialised, layer_order, recompute_space, tensor_roles
from baton.model_spec import PRESETS
from baton.operators import operator_names
from baton.peers import owned_fractions, peer_groups
from baton.plan import DeviceShare, Pipeline, Plan, Stage, simple_plan, validate
from solver.baselines import exhaustive
from solver.instance import build_instance
from solver.milp import InnerModel, highs_solve
from solver.options import valid_unit_counts
from solver.search import NoPlanFits, check_profiles, micro_batch_candidates, search
from solver.space import Skeleton
from tests.test_solver_helpers import random_instance


@pytest.mark.parametrize("preset,attention", [("gpt3-1.3b", "eager"), ("tiny", "eager"), ("gpt3-1.3b", "fused")])
def test_liveness_matrix_is_the_evaluators_rule(preset, attention):
    spec = PRESETS[preset].with_overrides(attention=attention)
    space = recompute_space(spec)
    roles, order = tensor_roles(spec), layer_order(spec)
    assert len(space) == 2 ** len(operator_names(spec))
    for i in range(len(space)):
        r = space.recompute_set(i)
        for j, t in enumerate(space.tensors):
            assert bool(space.held[i, j]) == is_held(roles[t], r, order)
            assert bool(space.remat[i, j]) == is_rematerialised(roles[t], r, order)
    if attention == "fused":
        return
    # The smallest disagreement of the old copy: recomputing qkv and attn_v keeps v (attn_v's segment
    # starts after qkv's, across the kept attn_scores/softmax), so v is not freed.
    i = next(i for i in range(len(space)) if space.recompute_set(i) == frozenset({"qkv", "attn_v"}))
    assert space.held[i, space.tensors.index("v")] == 1.0


def test_one_set_priced_alone_equals_its_row_in_the_whole_space():
    """The evaluator prices one set at a time, the planner all sets at once: the numbers must be identical."""
    inst = random_instance(3, num_devices=2, num_layers=4, heads=4, universe_size=3)
    spec = inst.spec
    prof = inst.profiles[inst.cluster.devices[0].gpu.name]
    space = recompute_space(spec)
    prices = layer_prices(prof, spec, 2, 0.5, space)
    for i in random.Random(0).sample(range(len(space)), 300):
        alone = layer_cost(prof, spec, 2, 0.5, space.recompute_set(i))
        assert alone == layer_cost_of(prices, i)


def test_memory_limit_is_the_evaluators_fits():
    inst = random_instance(18, num_devices=2, num_layers=6, heads=4, universe_size=5, memory_scale=(0.15, 0.6))
    spec = inst.spec
    space = recompute_space(spec)
    dev = inst.cluster.devices[0]
    for stage in (0, 1):
        slot = device_slot(inst.cluster, inst.profiles, spec, 1, dev.id, stage=stage, num_stages=2, num_microbatches=4)
        prices = layer_prices(slot.profile, spec, 1, 0.5, space)
        edge = edge_cost(slot, spec, 1, 0.5)
        fit = max_layers_that_fit(slot, spec, prices, edge, spec.num_layers)
        for i in range(0, len(space), 37):
            lc = layer_cost_of(prices, i)
            for L in range(spec.num_layers + 1):
                peak = device_memory(slot, spec, L, param_bytes=lc.param_bytes, held_bytes=lc.held_bytes,
                                     transient_bytes=lc.transient_bytes, edge=edge).peak_bytes
                assert (peak <= slot.memory_bytes) == (L <= fit[i]), (i, L)


def _random_plan(inst, rng: random.Random, *, replicas: int | None = None, zero_stage: int | None = None) -> Plan:
    """A random valid plan: random layout (replicas of equal shape), layer split, units, recompute sets, batch
    per replica and (with replicas) sharding stage and shard ratios; ``replicas``/``zero_stage`` fix those."""
    spec, ids = inst.spec, [d.id for d in inst.cluster.devices]
    rng.shuffle(ids)
    used = ids[:rng.randint(1, len(ids))] if replicas is None else ids[:len(ids) - len(ids) % replicas]
    Us = valid_unit_counts(spec)
    while True:
        reps = replicas or rng.choice([r for r in (1, 2) if len(used) % r == 0 and inst.global_batch % r == 0])
        per = len(used) // reps
        sizes = []
        left = per
        while left:
            sizes.append(rng.randint(1, min(left, max(Us))))
            left -= sizes[-1]
        p = len(sizes)
        if p <= spec.num_layers + 2 and (p <= 2 or p - 2 <= spec.num_layers):
            break
    lo = [spec.num_layers] if p == 1 else [0] + [1] * (p - 2) + [0]
    layers = list(lo)
    for _ in range(spec.num_layers - sum(lo)):
        layers[rng.randrange(p)] += 1
    names = operator_names(spec)
    units = []
    for n in sizes:
        U = rng.choice([u for u in Us if u >= n])
        cut = sorted(rng.sample(range(1, U), n - 1))
        units.append((U, [b - a for a, b in zip([0] + cut, cut + [U])]))
    # Every replica its own batch (Poplar), and at stage 1 per position equal parts or grid ratios (Cephalo).
    while True:
        batches = [(rng.choice([1, 2]), rng.randint(1, 4)) for _ in range(reps)]
        if sum(b * m for b, m in batches) == inst.global_batch or reps == 1:
            break
    if reps == 1:
        b = rng.choice([b for b in (1, 2) if inst.global_batch % b == 0])
        batches = [(b, inst.global_batch // b)]
    zero_stage = (rng.choice([0, 1]) if zero_stage is None else zero_stage) if reps > 1 else 0
    ratio = {}
    for s, n in enumerate(sizes):
        for j in range(n):
            if zero_stage and rng.random() < 0.7:
                ks = [rng.randint(0, GRID) for _ in range(reps - 1)]
                while sum(ks) > GRID:
                    ks[rng.randrange(reps - 1)] -= 1
                    ks = [max(0, k) for k in ks]
                ks.append(GRID - sum(ks))
                rng.shuffle(ks)
                for r in range(reps):
                    ratio[r, s, j] = ks[r] / GRID
    pipes = []
    for r in range(reps):
        group = used[r * per:(r + 1) * per]
        stages, first, k = [], 0, 0
        for s, n in enumerate(sizes):
            U, us = units[s]
            stages.append(Stage(first_layer=first, num_layers=layers[s], units_per_layer=U, devices=tuple(
                DeviceShare(id=group[k + j], units=us[j], recompute=tuple(o for o in names if rng.random() < 0.3),
                            shard_ratio=ratio.get((r, s, j))) for j in range(n))))
            first += layers[s]
            k += n
        uniform = len(set(batches)) == 1
        pipes.append(Pipeline(stages=tuple(stages), micro_batch_size=None if uniform else batches[r][0],
                              num_microbatches=None if uniform else batches[r][1]))
    return validate(Plan(model=spec, cluster=inst.cluster.name, micro_batch_size=batches[0][0], num_microbatches=batches[0][1],
                         pipelines=tuple(pipes), zero_stage=zero_stage))


GRID = 4
"""Shard ratios of the random plans: multiples of 1/4, or equal parts."""


def _option(inst, s: int, stage: Stage, d: DeviceShare) -> tuple[int, int]:
    """The instance's (U, u) option for a device of the plan (a lone device's share is 1 whatever its U)."""
    opt = (stage.units_per_layer, d.units)
    if opt in inst.share_options[s]:
        return opt
    assert len(stage.devices) == 1
    return inst.share_options[s][0]


def _ratio_option(inst, plan: Plan, d: DeviceShare) -> int:
    """Index of the device's owned-fraction option in the instance."""
    ratios = inst.ratios
    if ratios.mode != "choose":
        return 0
    if d.shard_ratio is None:
        return ratios.equal
    return ratios.units.index(round(d.shard_ratio * ratios.grid))


def _fix_milp_to(model: InnerModel, plan: Plan) -> None:
    """Fix every discrete decision of the MILP to the plan's."""
    inst, m = model.inst, model.m
    for s in range(model.p):
        L = plan.pipelines[0].stages[s].num_layers
        m.L[s].fix(L)
        for j in range(model.nbits):
            m.z[s, j].fix(L >> j & 1)
        stage = plan.pipelines[0].stages[s]
        U0 = _option(inst, s, stage, stage.devices[0])[0]
        for i, U in enumerate(inst.unit_counts[s]):
            m.w[s, i].fix(int(U == U0))
        for k, d in enumerate(stage.devices):
            for o, opt in enumerate(inst.share_options[s]):
                m.v[s, k, o].fix(int(opt == _option(inst, s, stage, d)))
    for key in model.x_index:
        rho, s, g, o, c = key
        stage = plan.pipelines[rho].stages[s]
        d = stage.devices[g]
        choice = model._choice(key)
        picked = inst.share_options[s][o] == _option(inst, s, stage, d) and choice.recompute == frozenset(d.recompute)
        m.x[key].fix(int(picked))
    largest = {}
    for (rho, s, k, j) in model.y_index:
        d = plan.pipelines[rho].stages[s].devices[k]
        mine = _ratio_option(inst, plan, d)
        m.y[rho, s, k, j].fix(int(j == mine))
        largest[s, k] = max(largest.get((s, k), 0.0), inst.ratios.values[mine])
    for (s, k, t) in model.u_index:
        m.u[s, k, t].fix(int(largest[s, k] >= inst.ratios.levels[t]))


@pytest.mark.parametrize("seed", [s if s < 4 else pytest.param(s, marks=pytest.mark.long) for s in range(12)])
def test_milp_and_evaluator_agree_term_by_term(seed):
    rng = random.Random(seed)
    inst = random_instance(seed, num_devices=rng.choice([2, 3, 4]), num_layers=rng.choice([2, 3, 5]), heads=4,
                           universe_size=2, global_batch=4, memory_scale=(50.0, 60.0))  # memory is tested above
    _agree_term_by_term(inst, _random_plan(inst, rng))


# Seeds 0-3 (the default run) take both memory branches and stages 0 and 1; the rest run under -m long.
@pytest.mark.parametrize("seed", [s if s < 4 else pytest.param(s, marks=pytest.mark.long) for s in range(16)])
def test_milp_and_evaluator_agree_on_data_parallel_plans(seed):
    """Two or three replicas, each with its own batch; stage 0, or stage 1 with equal or grid shard ratios per
    position; every other seed with memory tight enough that some devices do not fit, one branch or the other."""
    rng = random.Random(1000 + seed)
    reps = rng.choice([2, 2, 3])
    inst = random_instance(seed, num_devices=reps * rng.choice([1, 2]), num_layers=rng.choice([2, 3, 5]), heads=4,
                           universe_size=2, global_batch=rng.choice([6, 7]),
                           memory_scale=(0.4, 1.2) if seed % 2 else (50.0, 60.0))
    _agree_term_by_term(inst, _random_plan(inst, rng, replicas=reps, zero_stage=1 if seed % 4 < 3 else 0))


def _agree_term_by_term(inst, plan: Plan) -> None:
    """Stage constants, transfers, block times, memory limits (both branches), optimizer steps, peer groups'
    parameters and syncs of the MILP instance equal the evaluator's for ``plan``, and the MILP with every
    decision fixed to the plan prices it as the evaluator does."""
    rep = evaluate(plan, inst.cluster, inst.profiles)
    sets = tuple({frozenset(d.recompute) for pipe in plan.pipelines for st in pipe.stages for d in st.devices})
    sk = Skeleton(pipelines=tuple(tuple(tuple(st.device_ids) for st in pipe.stages) for pipe in plan.pipelines))
    mono = check_profiles(inst.spec, inst.cluster, inst.profiles)
    batches = [plan.batch(i) for i in range(len(plan.pipelines))]
    built = build_instance(inst.spec, inst.cluster, inst.profiles, sk, batches, recompute_space(inst.spec, sets),
                           zero_stage=plan.zero_stage, shard_grid=GRID, monotone=mono, prune=False, reduce_symmetry=False)
    if built.infeasible_reason is not None:  # some device fits the stage under no choice at all
        assert not rep.fits, built.infeasible_reason
        return
    assert math.isclose(built.embedding_sync_ms, rep.embedding_sync_ms, rel_tol=1e-12, abs_tol=1e-12)
    groups = {g.holders: g for g in peer_groups(plan)}
    dp = 0.0
    fits = True
    for rho, pipe in enumerate(plan.pipelines):
        for s, stage in enumerate(pipe.stages):
            sd, sr = built.stages[rho][s], next(x for x in rep.stages if x.pipeline == rho and x.index == s)
            assert math.isclose(2 * stage.num_layers * sd.allreduce_ms, sr.allreduce_ms, rel_tol=1e-12, abs_tol=1e-12)
            if any(_option(built, s, stage, d) not in sd.groups[g].choices for g, d in enumerate(stage.devices)):
                assert not rep.fits  # that share fits no recompute set on some device
                return
            edges = [next(c for c in sd.groups[g].choices[_option(built, s, stage, d)]) for g, d in enumerate(stage.devices)]
            assert math.isclose(stage.num_layers * (sum(max(c.fwd[k] for c in edges) for k in range(2)) + sd.allreduce_ms)
                                + max(c.edge_fwd_ms for c in edges) + sd.edge_fwd_comm_ms, sr.fwd_ms, rel_tol=1e-12)
            assert (sd.send_fwd_ms, sd.send_bwd_ms) == (sr.send_fwd_ms, sr.send_bwd_ms)
            for g, d in enumerate(stage.devices):
                dr = next(x for x in rep.devices if x.id == d.id)
                opt = _option(built, s, stage, d)
                c = next((c for c in sd.groups[g].choices[opt] if c.recompute == frozenset(d.recompute)), None)
                if c is None:  # dropped: it fits too few layers at every owned fraction
                    assert not dr.fits
                    fits = False
                    continue
                assert math.isclose(stage.num_layers * sum(c.fwd) + c.edge_fwd_ms, dr.fwd_ms, rel_tol=1e-12)
                assert math.isclose(stage.num_layers * sum(c.bwd) + c.edge_bwd_ms,
                                    dr.bwd_ms + dr.recompute_ms, rel_tol=1e-12)
                # Memory (eq. 8, 14): the activation branch at the device's owned fraction, and the sync buffer
                # branch at the position's largest ratio.
                j = _ratio_option(built, plan, d)
                assert math.isclose(built.ratios.values[j], dr.owned_fraction, rel_tol=1e-12)
                ok = stage.num_layers <= c.max_layers[j]
                if built.ratios.mode == "choose":
                    peers = [p_.stages[s].devices[g] for p_ in plan.pipelines]
                    t = built.ratios.levels.index(max(built.ratios.values[_ratio_option(built, plan, x)] for x in peers))
                    ok = ok and stage.num_layers <= sd.groups[g].buffer_limits[opt][j, t]
                assert ok == dr.fits, (d.id, ok, dr.fits)
                fits = fits and ok
                # Eq. 10: the Adam step over the owned weights.
                assert math.isclose(sd.groups[g].opt_ms_per_gb[0] * dr.weights_bytes / 1e9 * dr.owned_fraction,
                                    dr.optimizer_ms, rel_tol=1e-9, abs_tol=1e-12)
                if len(plan.pipelines) == 1:
                    continue
                # Eq. 13: the position's peer group holds the analytic parameter count; its sync is the line's value
                # at the group's parameters (stage 0) or its largest shard (stage 1).
                pos = built.positions[s][g]
                a, fixed = pos.params[opt]
                group = groups[tuple(pos.peers)]
                assert math.isclose((a * stage.num_layers + fixed) * 1e9, group.num_params, rel_tol=1e-12)
                shard = max(owned_fractions(plan, group)) if plan.zero_stage else 1.0
                dp = max(dp, pos.sync_ms_per_gparam * shard * group.num_params / 1e9 + pos.sync_fixed_ms)
    assert fits == rep.fits
    assert math.isclose(dp, rep.dp_sync_ms, rel_tol=1e-9, abs_tol=1e-12)
    # The MILP, every decision fixed to the plan, prices it as the evaluator does.
    model = InnerModel(built)
    _fix_milp_to(model, plan)
    res = highs_solve(model.m, threads=1, time_limit=60)
    if rep.fits:
        res.solution_loader.load_vars()
        assert math.isclose(pyo.value(model.m.obj), rep.iteration_time_ms, rel_tol=1e-6), plan.to_json()


@pytest.mark.parametrize("seed,between", [pytest.param(1, 0.15, marks=pytest.mark.long), (4, 0.4),
                                          pytest.param(9, 0.7, marks=pytest.mark.long)])
def test_full_power_set_oracle_single_device(seed, between):
    """One device, every one of the 2^12 recompute sets (no dropout), each with every block-level offload choice:
    the planner with all its pruning equals the exhaustive search over the whole power set. Memory lies ``between`` of the way from
    the full-recompute peak to the no-recompute peak at micro-batch 1, so which set wins matters."""
    inst = random_instance(seed, num_devices=1, num_layers=3, heads=2, universe_size=1, global_batch=2,
                           memory_scale=(50.0, 60.0), dropout=0.0)
    spec, dev = inst.spec, inst.cluster.devices[0]
    peaks = [evaluate(simple_plan(spec, cluster=inst.cluster.name, stages=[[(dev.id, 1)]], layers=[spec.num_layers],
                                  units_per_layer=1, micro_batch_size=1, num_microbatches=2,
                                  recompute={dev.id: rec}), inst.cluster, inst.profiles).devices[0].peak_memory_bytes
             for rec in (operator_names(spec), ())]
    capacity = int(peaks[0] + between * (peaks[1] - peaks[0]))
    cluster = dataclasses.replace(inst.cluster, devices=(dataclasses.replace(dev, memory_bytes=capacity),))
    oracle = exhaustive(spec, cluster, inst.profiles, global_batch=2, max_plans=10**5, offload=True)
    got = search(spec, cluster, inst.profiles, global_batch=2, gap=0.0, time_limit=120, threads=1, offload=True)
    assert math.isclose(got.objective_ms, oracle.objective_ms, rel_tol=1e-6), (got.plan.to_json(), oracle.plan.to_json())
    dev = got.plan.pipelines[0].stages[0].devices[0]
    assert dev.offload or 0 < len(dev.recompute) < len(operator_names(spec)), \
        "memory should make a partial recompute set, or offload, the best"


def _neighbours(plan: Plan, micro_batches=()):
    """Plans one local move away: a layer between adjacent stages, a unit between ranks, one operator
    added to or dropped from a device's recompute set, the micro-batch size halved or doubled (among
    ``micro_batches``, the sizes the tables hold: the planner does not extrapolate beyond them)."""
    names = operator_names(plan.model)
    pipes = [list(p.stages) for p in plan.pipelines]

    def rebuild(stages_per_pipe, **kw):
        fixed = []
        for stages in stages_per_pipe:
            first, out = 0, []
            for st in stages:
                out.append(dataclasses.replace(st, first_layer=first))
                first += st.num_layers
            fixed.append(Pipeline(stages=tuple(out)))
        return dataclasses.replace(plan, pipelines=tuple(fixed), **kw)

    p = len(pipes[0])
    for s in range(p - 1):
        for a, b in ((s, s + 1), (s + 1, s)):
            new = [[dataclasses.replace(st, num_layers=st.num_layers + (1 if i == b else -1 if i == a else 0))
                    for i, st in enumerate(stages)] for stages in pipes]
            yield rebuild(new)
    for s in range(p):
        n = len(pipes[0][s].devices)
        for a in range(n):
            for b in range(n):
                if a != b:
                    new = []
                    for stages in pipes:
                        st = stages[s]
                        devs = [dataclasses.replace(d, units=d.units + (1 if k == b else -1 if k == a else 0))
                                for k, d in enumerate(st.devices)]
                        new.append([*stages[:s], dataclasses.replace(st, devices=tuple(devs)), *stages[s + 1:]])
                    yield rebuild(new)
    for r, stages in enumerate(pipes):
        for s, st in enumerate(stages):
            for k, d in enumerate(st.devices):
                for op in names:
                    rec = set(d.recompute) ^ {op}
                    dev = dataclasses.replace(d, recompute=tuple(o for o in names if o in rec))
                    devs = list(st.devices)
                    devs[k] = dev
                    new = [list(x) for x in pipes]
                    new[r][s] = dataclasses.replace(st, devices=tuple(devs))
                    yield rebuild(new)
    gb = plan.global_batch
    for mb in (plan.micro_batch_size // 2, plan.micro_batch_size * 2):
        if mb in micro_batches and gb % (mb * len(pipes)) == 0:
            yield rebuild(pipes, micro_batch_size=mb, num_microbatches=gb // (mb * len(pipes)))


@pytest.mark.parametrize("seed", [3, pytest.param(11, marks=pytest.mark.long), 18, pytest.param(25, marks=pytest.mark.long)])
def test_local_moves_never_improve_a_returned_plan(seed):
    inst = random_instance(seed, num_devices=3, num_layers=4, heads=4, universe_size=2, global_batch=4,
                           memory_scale=(0.25, 0.8))
    try:
        got = search(inst.spec, inst.cluster, inst.profiles, global_batch=4, gap=0.0, time_limit=120, threads=1)
    except NoPlanFits:
        pytest.skip("nothing fits this instance")
    best = got.objective_ms
    tried = 0
    sizes = micro_batch_candidates(inst.spec, inst.cluster, inst.profiles, 4, None)
    for cand in _neighbours(got.plan, sizes):
        try:
            cand = validate(cand)
        except Exception:  # noqa: BLE001 - a move that leaves the plan invalid is no neighbour
            continue
        rep = evaluate(cand, inst.cluster, inst.profiles)
        tried += 1
        if rep.fits:
            assert rep.iteration_time_ms >= best * (1 - 1e-9), cand.to_json()
    assert tried > 0
