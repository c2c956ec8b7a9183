"""Heterogeneous data parallelism in the planner: per-replica batches (Poplar) and sharded optimizer state with
uneven ratios (Cephalo), the split enumeration, and the two baselines under the same evaluator.

The exact optimum against the exhaustive oracle on cases where an uneven split or stage 1 wins is in
tests/test_solver_exact.py; the MILP against the evaluator term by term on random data-parallel plans is in
tests/test_priced_plan.py.
"""
from __future__ import annotations

import math
import random

import pytest

from baton.costmodel import edge_param_count, layer_param_count
from baton.evaluate import evaluate
from baton.memory import RecomputeSpace
from baton.peers import peer_groups
from baton.plan import DeviceShare, Pipeline, Plan, Stage, validate
from solver.baselines import all_splits, cephalo, poplar
from solver.options import ratio_vectors
from solver.instance import build_instance, ratio_options
from solver.milp import InnerModel
from solver.search import NoPlanFits, check_profiles, search
from solver.space import Skeleton
from solver.splits import canonical, exact_splits_below, structured_splits, uniform_splits
from tests.test_priced_plan import _random_plan
from tests.test_solver_helpers import random_instance, two_gpu_instance


@pytest.mark.parametrize("seed", [s if s < 3 else pytest.param(s, marks=pytest.mark.long) for s in range(10)])
def test_peer_groups_hold_the_analytic_parameter_counts(seed):
    """The MILP's sync term (eq. 13) prices each position's peer group at layer_param_count(share) L +
    edge_param_count(share): for replicas of one shape, the evaluator's peer groups (baton.peers) must hold
    exactly that many parameters, one group per (stage, rank) position. A planner that priced the sync from
    the tables' parameter bytes, or a peer rule that split a position in two, would disagree here."""
    rng = random.Random(seed)
    reps = rng.choice([2, 3])
    inst = random_instance(seed, num_devices=reps * rng.choice([1, 2]), num_layers=rng.choice([2, 3, 5]), heads=4,
                           universe_size=2, global_batch=6, memory_scale=(50.0, 60.0))
    plan = _random_plan(inst, rng, replicas=reps)
    groups = {g.holders: g for g in peer_groups(plan)}
    p = plan.num_stages
    positions = 0
    for s, stage in enumerate(plan.pipelines[0].stages):
        for k, d in enumerate(stage.devices):
            holders = tuple(pipe.stages[s].devices[k].id for pipe in plan.pipelines)
            share = d.units / stage.units_per_layer
            expected = (layer_param_count(inst.spec, share) * stage.num_layers
                        + edge_param_count(inst.spec, share, first=s == 0, last=s == p - 1))
            assert math.isclose(groups[holders].num_params, expected, rel_tol=1e-12), (holders, groups[holders].num_params, expected)
            positions += 1
    assert len(groups) == positions  # nothing else syncs


def test_exact_splits_are_every_split_modulo_interchangeable_replicas():
    """The exact family's enumeration against brute force: every split, each once up to swapping replicas of one
    class, and with a threshold exactly those whose replicas' bounds are all below it."""
    sizes = [(1, 2), (1, 2), (1, 4), (2,)]
    classes = [0, 0, 1, 2]
    weight = [1.0, 1.0, 0.7, 1.3]

    def phi(i, b, m):  # non-decreasing in m, like a replica's cheap bound
        return weight[i] * m * (1 + 0.5 / b)

    G = 9
    brute = {canonical(x, classes) for x in all_splits(sizes, G)}
    got = list(exact_splits_below(phi, sizes, classes, G, math.inf))
    assert len(got) == len(set(got)) and set(got) == brute
    limit = 5.0
    below = {x for x in brute if all(phi(i, b, m) < limit for i, (b, m) in enumerate(x))}
    assert set(exact_splits_below(phi, sizes, classes, G, limit)) == below and below


def test_structured_splits_hold_the_uniform_and_the_speed_proportional_split():
    """Two classes, one three times as fast: besides the uniform split (8 samples each) the structured family
    offers 12/4 (proportional) and its neighbours 11/5 and 13/3 in micro-batches of 1, 6/2 in micro-batches
    of 2 and so on; replicas of one class stay within one micro-batch of each other."""
    classes = [0, 0, 1, 1]

    def phi(i, b, m):
        return (1.0 if classes[i] == 0 else 3.0) * m * b

    got = structured_splits(phi, [(1, 2)] * 4, classes, 32)
    assert set(uniform_splits([(1, 2)] * 4, 32)) <= set(got)
    assert ((1, 12), (1, 12), (1, 4), (1, 4)) in got
    assert ((1, 11), (1, 12), (1, 4), (1, 5)) in got and ((1, 12), (1, 13), (1, 3), (1, 4)) in got
    assert ((2, 6), (2, 6), (2, 2), (2, 2)) in got
    for split in got:
        assert sum(b * m for b, m in split) == 32
        for c in (0, 1):
            counts = [m for (b, m), k in zip(split, classes) if k == c]
            assert max(counts) - min(counts) <= 1


def test_structured_splits_give_a_replica_the_micro_batch_size_its_bound_ranks_best():
    """Class 0 pays 1.0 per micro-batch on top of its samples, class 1 nothing: every split is also offered with
    class 0 at micro-batches of 2 where its samples allow (its samples kept), and class 1 keeps the size it has
    where sizes tie."""
    classes = [0, 0, 1, 1]

    def phi(i, b, m):
        return m * b + (m if classes[i] == 0 else 0.0)

    got = structured_splits(phi, [(1, 2)] * 4, classes, 32)
    assert ((2, 4), (2, 4), (1, 8), (1, 8)) in got  # the uniform split of 1s, class 0 at 2
    assert ((2, 4), (2, 4), (2, 4), (2, 4)) in got
    assert all(sum(b * m for b, m in split) == 32 for split in got)
    mixed = [split for split in got if len({b for b, _ in split}) > 1]
    assert mixed
    for split in mixed:  # class 0 at 2 wherever its samples allow; class 1 at the size it had
        assert all(b == 2 for (b, m), k in zip(split, classes) if k == 0 and b * m % 2 == 0)


def test_ratio_options_and_vectors():
    """The owned-fraction grid: multiples of 1/K and, when 1/r is not one of them, the equal part."""
    r = ratio_options(1, 3, 3, 4)
    assert r.mode == "choose" and r.values[-1] == pytest.approx(1 / 3) and r.units[-1] is None
    assert ratio_options(1, 2, 2, 4).values == (0.0, 0.25, 0.5, 0.75, 1.0)
    assert ratio_options(1, 4, 1, 8).mode == "equal" and ratio_options(0, 4, 4, 8).mode == "none"
    vecs = list(ratio_vectors(3, 2))
    assert None in vecs and all(sum(v) == pytest.approx(1) for v in vecs if v is not None) and len(vecs) == 7


def test_interchangeable_replicas_share_evenly_and_the_milp_prices_it_exactly():
    """Two identical GPUs as two replicas at stage 1: modelled as one ('equal' mode, every device owning 1/2,
    the sync buffer folded into the layer limit), and the MILP fixed to the plan reproduces the evaluator."""
    inst = two_gpu_instance(types=("t4", "t4"), slowdown=1.0, memory_gib=(16.0, 16.0), global_batch=4)
    spec = inst.spec
    stages = [Pipeline(stages=(Stage(first_layer=0, num_layers=spec.num_layers, units_per_layer=1,
                                     devices=(DeviceShare(id=i, units=1),)),)) for i in ("n:0", "n:1")]
    plan = validate(Plan(model=spec, cluster=inst.cluster.name, micro_batch_size=2, num_microbatches=1,
                         pipelines=tuple(stages), zero_stage=1))
    rep = evaluate(plan, inst.cluster, inst.profiles)
    assert rep.fits and [d.owned_fraction for d in rep.devices] == [0.5, 0.5]
    sk = Skeleton(pipelines=((("n:0",),), (("n:1",),)))
    mono = check_profiles(spec, inst.cluster, inst.profiles)
    built = build_instance(spec, inst.cluster, inst.profiles, sk, [(2, 1), (2, 1)], RecomputeSpace(spec, [frozenset()]),
                           zero_stage=1, monotone=mono)
    assert built.ratios.mode == "equal" and built.modelled_replicas == 1
    model = InnerModel(built)
    res = model.solve(time_limit=30, rel_gap=0.0, threads=1)
    assert math.isclose(res.objective_ms, rep.iteration_time_ms, rel_tol=1e-9)
    assert res.plan.zero_stage == 1 and all(d.shard_ratio is None for p in res.plan.pipelines for s in p.stages for d in s.devices)


def test_baselines_are_pure_data_parallel_and_never_beat_the_planner():
    inst = two_gpu_instance(slowdown=2.0, global_batch=6, universe_size=2)
    best = search(inst.spec, inst.cluster, inst.profiles, global_batch=6, gap=0.0, time_limit=60)
    for strategy in (poplar, cephalo):
        got = strategy(inst.spec, inst.cluster, inst.profiles, global_batch=6)
        plan = got.plan
        assert got.report.fits and len(plan.pipelines) == 2
        assert all(len(p.stages) == 1 and len(p.stages[0].devices) == 1 for p in plan.pipelines)
        assert plan.global_batch == 6
        assert best.objective_ms <= got.objective_ms * (1 + 1e-9)
    # Poplar balances compute time: the faster GPU gets more samples.
    plan = poplar(inst.spec, inst.cluster, inst.profiles, global_batch=6).plan
    fast = next(i for i, p in enumerate(plan.pipelines) if p.stages[0].devices[0].id == "n:0")
    assert plan.samples(fast) > plan.samples(1 - fast)
    # Cephalo: stage 3 (FSDP, layered accumulation), every layer recomputed, uneven shards adding up to one.
    plan = cephalo(inst.spec, inst.cluster, inst.profiles, global_batch=6).plan
    ratios = [p.stages[0].devices[0].shard_ratio for p in plan.pipelines]
    assert plan.zero_stage == 3 and sum(ratios) == pytest.approx(1.0)
    assert all(len(p.stages[0].devices[0].recompute) == len(plan.pipelines[0].stages[0].devices[0].recompute) > 0
               for p in plan.pipelines)


@pytest.mark.parametrize("name", ["cephalo_8gpu", "poplar_b"])
def test_cephalo_plans_on_its_own_clusters_by_keeping_the_layer_boundary_in_host_memory(name):
    """GPT-3 1.3B on Cephalo's cluster and Poplar's: with the boundary of every checkpointed layer in host memory
    (Cephalo's mechanism) its rules find a plan; the same plan keeping the boundary on the devices does not fit."""
    import dataclasses

    from baton.cluster import load_cluster
    from baton.evaluate import evaluate
    from baton.model_spec import PRESETS
    from baton.profile import ProfileSet
    from solver.baselines import cephalo_offload
    from tests.conftest import ROOT

    spec, cluster = PRESETS["gpt3-1.3b"], load_cluster(ROOT / "clusters" / f"{name}.yaml")
    profiles = ProfileSet(spec)
    got = cephalo(spec, cluster, profiles, global_batch=64)
    assert got.report.fits and got.plan.zero_stage == 3 and len(got.plan.pipelines) == len(cluster.devices)
    boundary = cephalo_offload(spec)
    assert set(boundary) == {"layer_input", "attn_out", "x_mid", "mlp_out"}
    assert all(d.offload == boundary for p in got.plan.pipelines for d in p.stages[0].devices)
    kept = dataclasses.replace(got.plan, pipelines=tuple(
        dataclasses.replace(p, stages=tuple(dataclasses.replace(s, devices=tuple(dataclasses.replace(d, offload=())
                                                                                 for d in s.devices)) for s in p.stages))
        for p in got.plan.pipelines))
    assert not evaluate(kept, cluster, profiles).fits


@pytest.mark.parametrize("strategy", [poplar, cephalo])
def test_baselines_say_when_nothing_fits(strategy):
    mem = 0.2e6 / 2**30
    inst = two_gpu_instance(types=("t4", "t4"), slowdown=1.0, memory_gib=(mem, mem), vocab_size=4096, global_batch=4)
    with pytest.raises(NoPlanFits, match="no plan allowed by its rules fits"):
        strategy(inst.spec, inst.cluster, inst.profiles, global_batch=4)


def test_stage_zero_is_skipped_only_when_stage_one_dominates():
    """Rule 8 of solver/README.md: in mixed precision with the tables' parameter bytes at least the analytic
    counts, stage 1 with equal parts is never worse; in fp32 with two replicas the staging buffer can outgrow
    the optimizer bytes saved, so both stages are searched."""
    from solver.search import stage_one_dominates

    inst = two_gpu_instance()
    assert stage_one_dominates(inst.spec, inst.cluster, inst.profiles)
    fp32 = random_instance(3, num_devices=2, num_layers=2, heads=4, universe_size=1)
    assert fp32.spec.dtype == "fp32" or stage_one_dominates(fp32.spec, fp32.cluster, fp32.profiles)
    if fp32.spec.dtype == "fp32":
        assert not stage_one_dominates(fp32.spec, fp32.cluster, fp32.profiles)
