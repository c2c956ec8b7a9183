"""Eq. 19, the last replica's arrival at a sync: the planes against Clark's exact formula and Monte Carlo,
the evaluator and the layer-by-layer chain using it, and the planner exact with it (MILP = exhaustive
oracle = evaluator)."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from baton.cluster import from_mapping
from baton.costmodel import LayeredParts, layered_iteration_ms
from baton.errors import BatonError
from baton.evaluate import evaluate
from baton.memory import RecomputeSpace
from baton.plan import DeviceShare, Pipeline, Plan, Stage, validate
from baton.waits import ALPHAS, arrival_planes, expected_max_of_normals, last_arrival_ms, pair_gradient
from solver.baselines import exhaustive
from solver.search import search
from tests.test_solver_helpers import random_instance, two_gpu_instance


def _clark(m1: float, m2: float, cv: float) -> float:
    """E[max] of two independent normals with sd cv * mean, written out here from Clark (1961)."""
    theta = cv * math.hypot(m1, m2)
    a = (m1 - m2) / theta
    Phi = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))  # noqa: E731
    phi = lambda x: math.exp(-x * x / 2) / math.sqrt(2 * math.pi)  # noqa: E731
    return m1 * Phi(a) + m2 * Phi(-a) + theta * phi(a)


def test_expected_maxima_of_normals():
    assert expected_max_of_normals(1) == 0.0
    assert expected_max_of_normals(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-9)
    # e_3 = 3 / (2 sqrt(pi)); e_4 and e_8 from tables of normal order statistics
    assert expected_max_of_normals(3) == pytest.approx(1.5 / math.sqrt(math.pi), rel=1e-9)
    assert expected_max_of_normals(4) == pytest.approx(1.029375, abs=1e-6)
    assert expected_max_of_normals(8) == pytest.approx(1.423600, abs=1e-6)


@pytest.mark.parametrize("cv", [pytest.param(0.005, marks=pytest.mark.long), pytest.param(0.03, marks=pytest.mark.long), 0.1,
                                pytest.param(0.3, marks=pytest.mark.long)])
def test_two_replicas_follow_clark_from_below(cv):
    """Equal at every grid point and at t = 1, never above, at most 0.004 theta below (the ALPHAS note)."""
    for t in np.linspace(0.0, 1.0, 4001):
        exact, got = _clark(1.0, t, cv), last_arrival_ms([t, 1.0], cv)
        theta = cv * math.hypot(1.0, t)
        assert got <= exact + 1e-12
        assert exact - got <= 0.004 * theta
    assert last_arrival_ms([1.0, 1.0], cv) == pytest.approx(1 + cv / math.sqrt(math.pi), rel=1e-12)
    for b, c in arrival_planes(2, cv).pairs:  # each pair plane touches Clark's value at its own ratio
        g1 = b + c
        t = next(t for t in np.linspace(0, 1, 200001) if abs(pair_gradient(t, cv)[1] - b) < 1e-4)
        assert g1 + b * t == pytest.approx(_clark(1.0, t, cv), rel=2e-4)


@pytest.mark.parametrize("times", [[100.0] * 2, [100.0] * 5, [100.0, 99.0, 97.0], [100.0, 60.0, 99.5, 99.8]])
def test_many_replicas_against_monte_carlo(times):
    """A lower bound on E[max] under the noise model, exact when all are equal; tight within 0.5% here."""
    cv = 0.04
    rng = np.random.default_rng(0)
    draws = np.asarray(times)[None, :] * (1 + cv * rng.standard_normal((400_000, len(times))))
    mc = float(draws.max(axis=1).mean())
    got = last_arrival_ms(times, cv)
    assert got <= mc * 1.0005
    assert got >= mc * 0.995
    if len(set(times)) == 1:
        assert got == pytest.approx(times[0] * (1 + cv * expected_max_of_normals(len(times))), rel=1e-12)


def test_no_noise_or_one_replica_is_the_maximum():
    assert last_arrival_ms([3.0, 5.0, 4.0], 0.0) == 5.0
    assert last_arrival_ms([5.0], 0.2) == 5.0
    assert arrival_planes(1, 0.1).top_k == () and arrival_planes(3, 0.0).pairs == ()


def test_the_value_never_decreases_when_a_replica_slows():
    rng = np.random.default_rng(1)
    for _ in range(200):
        times = list(rng.uniform(50, 100, size=rng.integers(2, 6)))
        base = last_arrival_ms(times, 0.05)
        i = int(rng.integers(len(times)))
        slower = list(times)
        slower[i] += float(rng.uniform(0, 5))
        assert last_arrival_ms(slower, 0.05) >= base - 1e-12
    assert all(a > 0 for _, a in arrival_planes(6, 0.05).top_k)
    assert all(b > 0 and c >= 0 for b, c in arrival_planes(6, 0.05).pairs)
    assert len(arrival_planes(2, 0.05).pairs) == len(ALPHAS)


def test_cluster_field_is_checked():
    base = {"name": "x", "nodes": [{"name": "n", "gpus": [{"type": "t4", "count": 1}]}]}
    assert from_mapping(base, source="c.yaml").replica_time_cv == 0.0
    assert from_mapping({**base, "replica_time_cv": 0.02}, source="c.yaml").replica_time_cv == 0.02
    for bad in (-0.1, 0.9, "x"):
        with pytest.raises(BatonError, match="replica_time_cv"):
            from_mapping({**base, "replica_time_cv": bad}, source="c.yaml")


def test_layered_chain_charges_each_segment():
    """Two equal replicas: every segment of eq. 17 ends (1 + cv e_2) times later; unequal ones far apart, none."""
    part = LayeredParts(emb_fwd_ms=1.0, layer_fwd_ms=2.0, head_fwd_ms=1.0, head_bwd_ms=1.0, layer_bwd_ms=4.0, emb_bwd_ms=1.0)
    cv = 0.05
    quiet = layered_iteration_ms(2, 3, [(2, part), (2, part)], 0.5, [0.5] * 3, 0.0)
    noisy = layered_iteration_ms(2, 3, [(2, part), (2, part)], 0.5, [0.5] * 3, 0.0, replica_time_cv=cv)
    compute = quiet.iteration_ms - quiet.collectives_ms
    assert noisy.noise_wait_ms == pytest.approx(compute * cv * expected_max_of_normals(2), rel=1e-12)
    assert noisy.iteration_ms == pytest.approx(quiet.iteration_ms + noisy.noise_wait_ms, rel=1e-12)
    apart = layered_iteration_ms(2, 3, [(8, part), (1, part)], 0.5, [0.5] * 3, 0.0, replica_time_cv=cv)
    assert apart.noise_wait_ms == 0.0


def test_evaluator_prices_the_wait_of_equal_replicas():
    inst = two_gpu_instance(types=("t4", "t4"), slowdown=1.0, memory_gib=(16.0, 16.0), global_batch=4)
    spec = inst.spec
    pipes = tuple(Pipeline(stages=(Stage(first_layer=0, num_layers=spec.num_layers, units_per_layer=1,
                                         devices=(DeviceShare(id=i, units=1),)),)) for i in ("n:0", "n:1"))
    plan = validate(Plan(model=spec, cluster=inst.cluster.name, micro_batch_size=2, num_microbatches=1, pipelines=pipes))
    quiet = evaluate(plan, inst.cluster, inst.profiles)
    noisy = evaluate(plan, dataclasses.replace(inst.cluster, replica_time_cv=0.05), inst.profiles)
    assert quiet.arrival_wait_ms == 0.0
    slowest = max(quiet.replica_pipeline_ms)
    assert noisy.arrival_wait_ms == pytest.approx(slowest * 0.05 / math.sqrt(math.pi), rel=1e-9)
    assert noisy.iteration_time_ms == pytest.approx(quiet.iteration_time_ms + noisy.arrival_wait_ms, rel=1e-12)


def _noisy(inst, cv):
    return dataclasses.replace(inst, cluster=dataclasses.replace(inst.cluster, replica_time_cv=cv))


@pytest.mark.parametrize("case", [
    # (instance, cv): several replicas of equal and unequal speed, stage 0 and 1, pipelines and replicas mixed;
    # the two random instances (seconds each) under -m long
    ("equal-pair", 0.08), ("fast-slow", 0.15), pytest.param(("seed5-4gpu", 0.05), marks=pytest.mark.long),
    pytest.param(("seed7-3gpu", 0.1), marks=pytest.mark.long)])
def test_planner_equals_oracle_with_noisy_replicas(case):
    name, cv = case
    if name == "equal-pair":
        inst = two_gpu_instance(types=("t4", "t4"), slowdown=1.0, memory_gib=(16.0, 16.0), global_batch=4)
    elif name == "fast-slow":
        inst = two_gpu_instance(slowdown=1.2, global_batch=6)
    elif name == "seed5-4gpu":
        inst = random_instance(5, num_devices=4, num_layers=2, heads=2, universe_size=2, global_batch=2)
    else:
        inst = random_instance(7, num_devices=3, num_layers=3, heads=2, universe_size=3, global_batch=4, monotone=False)
    inst = _noisy(inst, cv)
    space = RecomputeSpace(inst.spec, inst.universe)
    oracle = exhaustive(inst.spec, inst.cluster, inst.profiles, global_batch=inst.global_batch, universe=inst.universe,
                        shard_grid=2)
    got = search(inst.spec, inst.cluster, inst.profiles, global_batch=inst.global_batch, gap=0.0, time_limit=120,
                 space=space, shard_grid=2)
    assert math.isclose(got.objective_ms, oracle.objective_ms, rel_tol=1e-6), (got.plan.to_json(), oracle.plan.to_json())
    rep = evaluate(got.plan, inst.cluster, inst.profiles)
    assert math.isclose(rep.iteration_time_ms, got.objective_ms, rel_tol=1e-6)
    assert got.status == "optimal"


def test_noise_can_change_the_plan():
    """An A100 and a GPU 1.5x slower, 8 samples: without noise two replicas of 4 samples each (equal finish
    times) beat a two-stage pipeline by 0.2%; with cv = 0.3 their waits at the sync cost more than that and the
    pipeline (one replica, no wait) wins. Each plan is the better one only under its own cluster."""
    inst = two_gpu_instance(slowdown=1.5, memory_gib=(16.0, 16.0), global_batch=8, num_layers=4, bandwidth_gb_per_s=300)
    loud_inst = _noisy(inst, 0.3)
    space = RecomputeSpace(inst.spec, inst.universe)
    quiet = search(inst.spec, inst.cluster, inst.profiles, global_batch=8, gap=0.0, time_limit=60, space=space)
    loud = search(loud_inst.spec, loud_inst.cluster, loud_inst.profiles, global_batch=8, gap=0.0, time_limit=60, space=space)
    assert [len(p.stages) for p in quiet.plan.pipelines] == [1, 1] and quiet.report.arrival_wait_ms == 0.0
    assert [len(p.stages) for p in loud.plan.pipelines] == [2] and loud.report.arrival_wait_ms == 0.0
    assert evaluate(quiet.plan, loud_inst.cluster, inst.profiles).iteration_time_ms > loud.objective_ms * (1 + 1e-3)
    assert evaluate(loud.plan, inst.cluster, inst.profiles).iteration_time_ms > quiet.objective_ms * (1 + 1e-4)


@pytest.mark.parametrize("zero_stage", [0, 1])
@pytest.mark.parametrize("types", [("t4",) * 4, ("t4", "t4", "t4", "a100-40gb"), ("t4", "t4", "a100-40gb", "a100-40gb")])
def test_milp_prices_classes_of_interchangeable_replicas_exactly(types, zero_stage):
    """Every device its own replica, replicas of one type modelled once (multiplicity n_c in the top-k sums; at
    stage 1 with several types each replica chooses its own ratio, so each is modelled): the MILP's value of its
    plan is the evaluator's."""
    from baton.model_spec import ModelSpec
    from baton.profile import Profile, ProfileSet, derive_table
    from solver.instance import build_instance
    from solver.milp import InnerModel
    from solver.search import check_profiles
    from solver.space import Skeleton

    spec = ModelSpec(name="dp4", num_layers=2, hidden_dim=16, num_heads=1, ffn_dim=64, seq_len=32, vocab_size=128,
                     dtype="fp16", dropout=0.0)
    base = derive_table(spec, "a100-40gb", micro_batches=(1, 2))
    tables = {}
    for gpu, factor in (("a100-40gb", 1.0), ("t4", 1.1)):
        df = base.copy()
        df["gpu"], df["fwd_ms"], df["bwd_ms"] = gpu, df["fwd_ms"] * factor, df["bwd_ms"] * factor
        tables[gpu] = Profile(df, source=f"<{gpu}>")
    profiles = ProfileSet(spec, tables=tables)
    cluster = from_mapping({"name": "dp4", "replica_time_cv": 0.07, "nodes": [{"name": "n", "gpus": [
        {"type": g, "count": 1, "memory_gib": 16.0, "memory_reserve_gib": 0.0} for g in types],
        "intra_node_link": {"bandwidth_gb_per_s": 50.0, "latency_us": 1.0}}]}, source="<dp4>")
    sk = Skeleton(pipelines=tuple(((f"n:{i}",),) for i in range(4)))
    built = build_instance(spec, cluster, profiles, sk, [(2, 1)] * 4, RecomputeSpace(spec, [frozenset()]),
                           zero_stage=zero_stage, monotone=check_profiles(spec, cluster, profiles))
    assert built.modelled_replicas == (len(set(types)) if zero_stage == 0 or len(set(types)) == 1 else 4)
    res = InnerModel(built).solve(time_limit=30, rel_gap=0.0, threads=1)
    plan = dataclasses.replace(res.plan, cluster=cluster.name)
    rep = evaluate(plan, cluster, profiles)
    assert math.isclose(res.objective_ms, rep.iteration_time_ms, rel_tol=1e-9)
    assert rep.arrival_wait_ms > 0


def test_measured_cv_keeps_only_what_the_ranks_do_not_share():
    """The profiler's estimate from rounds started together: a 10% slowdown common to every rank in a round
    drops out, each rank's own 3% stays, whatever the ranks' own speeds."""
    from runtime.measure.comm_profiler import replica_time_cv

    rng = np.random.default_rng(3)
    for n in (2, 4):
        common = 1 + 0.1 * rng.standard_normal(4000)
        speeds = rng.uniform(50, 200, size=(n, 1))
        times = speeds * common[None, :] * (1 + 0.03 * rng.standard_normal((n, 4000)))
        assert replica_time_cv(times.tolist()) == pytest.approx(0.03, rel=0.05)
    assert replica_time_cv([[100.0] * 5, [80.0] * 5]) == 0.0
