"""The MILP planner against the exhaustive oracle on random small instances.

Each instance: a tiny model (2-6 layers), synthetic profile tables (scaled per operator, some of them
not monotone in the share), 2-4 GPUs of 2-3 types with memory sized so that recompute and placement
matter, a universe of 2-5 recompute sets. The exhaustive search evaluates every plan with
baton.evaluate; the planner must return the same iteration time (relative 1e-6), or both must report
that nothing fits. These catch: an unsafe pruning rule (dominance, symmetry, tied stages, bounds), an
encoding error in a constraint family, a 1F1B recurrence that is not the longest path.
"""
from __future__ import annotations

import dataclasses
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from baton.costmodel import device_slot
from baton.errors import BatonError
from baton.memory import RecomputeSpace
from baton.evaluate import evaluate
from baton.operators import operator_names
from solver.baselines import all_splits, exhaustive
from solver.instance import build_instance
from solver.milp import InnerModel
from solver.options import device_choices
from solver.bounds import candidate_lower_bound
from solver.search import NoPlanFits, check_profiles, search, skeleton_family
from solver.space import replica_pattern
from solver.unlike import expand, solve_structure
from tests.test_solver_helpers import interleaved_wins_instance, random_instance, two_gpu_instance

ROOT = Path(__file__).resolve().parent.parent

GRID = 2
"""Shard ratios in halves: the oracle enumerates every grid vector per position, so a fine grid explodes it."""

CASES = [
    # seed, devices, layers, heads, universe, global batch, monotone tables, memory scale
    (3, 2, 5, 4, 4, 4, True, (0.25, 1.1)),
    (7, 3, 3, 2, 3, 4, False, (0.25, 1.1)),
    (11, 3, 4, 2, 2, 2, True, (0.25, 1.1)),
    (18, 2, 6, 4, 5, 2, False, (0.35, 0.9)),
    (21, 3, 3, 2, 3, 4, False, (0.25, 1.1)),
    (25, 3, 3, 4, 2, 2, True, (0.3, 0.9)),
    (33, 2, 6, 4, 5, 2, True, (0.3, 0.7)),
    (5, 4, 2, 2, 2, 2, True, (0.25, 1.1)),
]


def _instance(case):
    seed, n, layers, heads, uni, gb, mono, mem = case
    return random_instance(seed, num_devices=n, num_layers=layers, heads=heads, universe_size=uni, global_batch=gb,
                           monotone=mono, memory_scale=mem)


QUICK_SEEDS = {18}
"""The instance the default run checks (tables not monotone in the share, five recompute sets; about 7,500 plans for
the oracle, where the three- and four-GPU instances have 15,000 to 160,000); the rest run under -m long."""


INTERLEAVED_SEEDS = {3, 18, 33, 25}
"""Instances also checked with interleaving offered (2 chunks), under -m long: the two-GPU ones and a three-GPU one
(up to about 40,000 plans for the oracle)."""


@pytest.mark.parametrize("case,chunks", [pytest.param(c, (1,), marks=() if c[0] in QUICK_SEEDS else pytest.mark.long)
                                         for c in CASES]
                         + [pytest.param(c, (1, 2), marks=pytest.mark.long) for c in CASES if c[0] in INTERLEAVED_SEEDS],
                         ids=[f"seed{c[0]}-{c[1]}gpu-{c[2]}L" for c in CASES]
                         + [f"seed{c[0]}-{c[1]}gpu-{c[2]}L-interleaved" for c in CASES if c[0] in INTERLEAVED_SEEDS])
def test_milp_equals_exhaustive_optimum(case, chunks):
    inst = _instance(case)
    try:
        oracle = exhaustive(inst.spec, inst.cluster, inst.profiles, global_batch=inst.global_batch, universe=inst.universe,
                            shard_grid=GRID, chunks=chunks)
    except NoPlanFits:
        oracle = None
    try:
        got = search(inst.spec, inst.cluster, inst.profiles, global_batch=inst.global_batch, gap=0.0, time_limit=120,
                     space=RecomputeSpace(inst.spec, inst.universe), shard_grid=GRID, chunks=chunks)
    except NoPlanFits as exc:
        assert oracle is None, f"planner found nothing, exhaustive found {oracle.objective_ms}"
        assert "over by" in str(exc) or "rejected" in str(exc)
        return
    assert oracle is not None, "planner returned a plan where exhaustive search found none"
    assert math.isclose(got.objective_ms, oracle.objective_ms, rel_tol=1e-6), (got.plan.to_json(), oracle.plan.to_json())
    # The evaluator agrees with the MILP's own value of the returned decisions.
    rep = evaluate(got.plan, inst.cluster, inst.profiles)
    assert rep.fits
    assert math.isclose(rep.iteration_time_ms, got.objective_ms, rel_tol=1e-6)
    assert got.status == "optimal" and got.gap <= 1e-9


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1) < 2,
                    reason="one core: the search starts no workers")
@pytest.mark.parametrize("chunks", [(1,), (1, 2)], ids=["1f1b", "interleaved"])
def test_exhaustive_search_keeps_the_same_plan_in_several_processes(monkeypatch, chunks):
    """Two identical GPUs: many plans tie (any device swap), and the oracle keeps the first in enumeration
    order. Catches workers' results merged out of order (another of the equal plans kept), or tasks lost
    (fewer plans evaluated); offered 2 chunks, interleaved tasks too."""
    from solver import baselines

    inst = two_gpu_instance(types=("a100-40gb", "a100-40gb"), slowdown=1.0, memory_gib=(40.0, 40.0))
    monkeypatch.setattr(baselines, "PARALLEL_FROM_PLANS", 0)  # workers even for this small instance
    runs = [exhaustive(inst.spec, inst.cluster, inst.profiles, global_batch=inst.global_batch, universe=inst.universe,
                       shard_grid=GRID, workers=w, chunks=chunks) for w in (1, 2)]
    one, two = runs
    assert two.candidates == one.candidates > 100
    assert two.objective_ms == one.objective_ms
    assert (two.plan.pipelines, two.plan.zero_stage) == (one.plan.pipelines, one.plan.zero_stage)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1) < 2,
                    reason="one core: the search starts no workers")
def test_exhaustive_search_from_a_script_without_a_main_guard_fails_in_one_line(tmp_path):
    """Each spawned worker runs the calling script's top level again; without an `if __name__ == "__main__":`
    guard it dies there. The search used to wait forever on the pipe to that worker (the instance it was
    handed at start filled the pipe); now it stops with a line that says what to do."""
    script = tmp_path / "unguarded.py"
    script.write_text("import sys\n"
                      f"sys.path.insert(0, {str(ROOT)!r})\n"
                      "from solver import baselines\n"
                      "from tests.test_solver_exact import CASES, _instance\n"
                      "inst = _instance(CASES[7])  # an instance too big for the pipe's buffer\n"
                      "baselines.exhaustive(inst.spec, inst.cluster, inst.profiles, global_batch=inst.global_batch,\n"
                      "                     universe=inst.universe, shard_grid=2, workers=2)\n")
    res = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert res.returncode != 0
    assert "a worker process of the exhaustive search died" in res.stderr and "__main__" in res.stderr, res.stderr[-2000:]


def test_infeasible_instance_names_the_device():
    inst = random_instance(2, num_devices=2, num_layers=4, heads=2, universe_size=2, memory_scale=(0.01, 0.02))
    with pytest.raises(NoPlanFits, match=r"needs .* of .*over by"):
        search(inst.spec, inst.cluster, inst.profiles, global_batch=2, gap=0.0, space=RecomputeSpace(inst.spec, inst.universe))
    with pytest.raises(NoPlanFits):
        exhaustive(inst.spec, inst.cluster, inst.profiles, global_batch=2, universe=inst.universe)


@pytest.mark.parametrize("seed", [3, 18, pytest.param(11, marks=pytest.mark.long)])
def test_cheap_bound_never_exceeds_a_candidates_optimum(seed):
    """The outer search skips candidates by bound; a bound above the candidate's optimum would lose plans."""
    case = next(c for c in CASES if c[0] == seed)
    assert _bounds_hold(_instance(case), random.Random(seed))[0] > 0


def test_cheap_bound_holds_for_uneven_splits_and_stage_one():
    """The same for replicas on uneven batches at both sharding stages (grid ratios at stage 1: its layer caps
    take owned fraction 0 and the shared-state caps), where those plans fit and win."""
    checked, multi = _bounds_hold(two_gpu_instance(slowdown=2.0, global_batch=6), random.Random(0))
    assert multi >= 5


def _bounds_hold(inst, rng) -> tuple[int, int]:
    """Every skeleton (up to 30 checks): uniform splits and two random uneven ones, both stages; the cheap
    bound is at most the candidate's MILP optimum. Returns (checked, of which with replicas)."""
    space = RecomputeSpace(inst.spec, inst.universe)
    mono = check_profiles(inst.spec, inst.cluster, inst.profiles)
    _, skeletons = skeleton_family(inst.spec, inst.cluster)
    checked = multi = 0
    for sk in skeletons:
        if checked >= 30:
            break
        r = sk.num_replicas
        splits = [[(b, inst.global_batch // (b * r))] * r for b in (1, 2) if inst.global_batch % (b * r) == 0]
        if r > 1:
            every = list(all_splits([(1, 2)] * r, inst.global_batch))
            splits += rng.sample(every, min(2, len(every)))
        for batches in splits:
            for z in ((0, 1) if r > 1 else (0,)):
                lb = candidate_lower_bound(inst.spec, inst.cluster, inst.profiles, sk, batches, space, monotone=mono, zero_stage=z)
                if not sk.one_shape:  # unlike replicas: the best of every layout (solver/unlike.py)
                    entries, _ = expand(inst.spec, inst.cluster, inst.profiles, space, sk.pipelines, batches, z,
                                        [replica_pattern(inst.cluster, pipe) for pipe in sk.pipelines], math.inf)
                    got = [solve_structure(t, st, sy, t.emb_ms, z) for _, t, st, sy in entries]
                    values = [g[0] for g in got if g is not None]
                    if values:
                        assert lb <= min(values) * (1 + 1e-9), (sk.describe(), batches, z, lb, min(values))
                        checked += 1
                        multi += 1
                    continue
                built = build_instance(inst.spec, inst.cluster, inst.profiles, sk, batches, space, monotone=mono, zero_stage=z,
                                       shard_grid=GRID)
                if built.infeasible_reason:
                    continue
                res = InnerModel(built).solve(time_limit=30, rel_gap=0.0, threads=1)
                if res.objective_ms is None:
                    continue
                assert lb <= res.objective_ms * (1 + 1e-9), (sk.describe(), batches, z, lb, res.objective_ms)
                checked += 1
                multi += r > 1
    return checked, multi


def test_recompute_pruning_keeps_a_dominating_set():
    """Every feasible recompute set is matched by a kept one that is no slower per block and fits as many layers."""
    inst = _instance(CASES[3])
    space = RecomputeSpace(inst.spec)  # all 2^13 sets
    dev = inst.cluster.devices[0]
    for stage in (0, 1):  # first of two stages (2 micro-batches in flight), then the last (1)
        slot = dataclasses.replace(device_slot(inst.cluster, inst.profiles, inst.spec, 1, dev.id, stage=stage, num_stages=2,
                                               num_microbatches=2), memory_bytes=dev.memory_bytes * 2, reserve_bytes=0)
        full = device_choices(slot, inst.spec, 1, 0.5, space, min_layers=0, cap=inst.spec.num_layers, prune=False)
        kept = device_choices(slot, inst.spec, 1, 0.5, space, min_layers=0, cap=inst.spec.num_layers, prune=True)
        assert 0 < len(kept) < len(full)
        for _, _, lc, (L,) in full:
            assert any(L2 >= L and lc2.recompute_ms["attn"] <= lc.recompute_ms["attn"] + 1e-12
                       and lc2.recompute_ms["mlp"] <= lc.recompute_ms["mlp"] + 1e-12 for _, _, lc2, (L2,) in kept)


def _planner_and_oracle(inst, **kw):
    space = RecomputeSpace(inst.spec, inst.universe)
    oracle = exhaustive(inst.spec, inst.cluster, inst.profiles, global_batch=inst.global_batch, universe=inst.universe,
                        shard_grid=GRID, **kw)
    got = search(inst.spec, inst.cluster, inst.profiles, global_batch=inst.global_batch, gap=0.0, time_limit=120,
                 space=space, shard_grid=GRID, **kw)
    assert math.isclose(got.objective_ms, oracle.objective_ms, rel_tol=1e-6), (got.plan.to_json(), oracle.plan.to_json())
    assert got.status == "optimal"
    return got, oracle


def test_planner_equals_oracle_when_an_uneven_split_wins():
    """A100 and a GPU half as fast, 6 samples: each its own replica, 4 and 2 samples (Poplar's uneven batches),
    beats every even split, every pipeline and either GPU alone; the planner finds the oracle's optimum."""
    inst = two_gpu_instance(slowdown=2.0, global_batch=6)
    got, oracle = _planner_and_oracle(inst)
    plan = got.plan
    assert len(plan.pipelines) == 2 and not plan.uniform_batches
    assert sorted(plan.samples(i) for i in range(2)) == [2, 4]
    fast = next(i for i, p in enumerate(plan.pipelines) if p.stages[0].devices[0].id == "n:0")
    assert plan.samples(fast) == 4
    # With every replica on one batch the best is slower.
    even = search(inst.spec, inst.cluster, inst.profiles, global_batch=6, gap=0.0, time_limit=120, splits="uniform",
                  space=RecomputeSpace(inst.spec, inst.universe), shard_grid=GRID)
    assert even.objective_ms > got.objective_ms * (1 + 1e-3)


def test_planner_equals_oracle_when_only_stage_one_fits():
    """Two 1.3 MB devices and an embedding-heavy model (one head, so no tensor parallelism): a pipeline keeps a
    copy of the tied embedding on both stages, one device alone holds everything, and replicas at stage 0
    each keep all the optimizer state; only two replicas sharing it (stage 1) fit. The planner finds the
    oracle's plan, and neither finds one at stage 0."""
    mem = 1.3e6 / 2**30
    inst = two_gpu_instance(types=("t4", "t4"), slowdown=1.0, memory_gib=(mem, mem), vocab_size=4096, global_batch=4)
    got, oracle = _planner_and_oracle(inst)
    assert got.plan.zero_stage == 1 and oracle.plan.zero_stage == 1
    assert got.report.fits and max(d.owned_fraction for d in got.report.devices) < 1
    with pytest.raises(NoPlanFits):
        exhaustive(inst.spec, inst.cluster, inst.profiles, global_batch=4, universe=inst.universe, zero_stages=(0,))
    with pytest.raises(NoPlanFits):
        search(inst.spec, inst.cluster, inst.profiles, global_batch=4, gap=0.0, time_limit=60, zero_stages=(0,),
               space=RecomputeSpace(inst.spec, inst.universe))


def _oracle(inst, **kw):
    return exhaustive(inst.spec, inst.cluster, inst.profiles, global_batch=inst.global_batch, universe=inst.universe,
                      shard_grid=GRID, **kw)


def test_oracle_interleaves_where_it_wins():
    """On ``interleaved_wins_instance`` the oracle offered 2 chunks evaluates 160 plans more than with 1F1B only (two
    stage orders x 10 splits of the 4 layers over 4 virtual stages, comb(5, 3) x 2 batch splits x 4 recompute pairs,
    stage 0 only: one replica), its size estimate counts exactly those, and its best plan is interleaved and 6.8% shorter
    than the best 1F1B plan. Catches interleaved plans not enumerated, enumerated twice or left out of the estimate."""
    inst = interleaved_wins_instance()
    plain, both = _oracle(inst), _oracle(inst, chunks=(1, 2))
    assert both.candidates - plain.candidates == 160
    assert [p.chunks for p in plain.plan.pipelines] == [1] and plain.objective_ms == pytest.approx(1.3863, abs=1e-4)
    assert [p.chunks for p in both.plan.pipelines] == [2] and both.objective_ms == pytest.approx(1.2919, abs=1e-4)
    assert [s.num_layers for s in both.plan.pipelines[0].stages] == [0, 1, 2, 1]
    rep = evaluate(both.plan, inst.cluster, inst.profiles)
    assert rep.fits and rep.iteration_time_ms == both.objective_ms
    _oracle(inst, chunks=(1, 2), max_plans=both.candidates)  # the estimate is exact here: one replica
    with pytest.raises(BatonError, match="would evaluate about"):
        _oracle(inst, chunks=(1, 2), max_plans=both.candidates - 1)


def test_oracle_interleaves_replicas_at_both_stages_with_equal_parts(monkeypatch):
    """Two replicas of two one-GPU stages, 2 layers, offered 2 chunks (only this layout searched): the interleaved plans
    are every replica on 2 chunks of 0, 1, 1 and 0 layers, at stage 0 and at stage 1 with equal parts (every device
    owns half of what it holds), each group's units (U 1 or 2) and every device's recompute set (2^4) shared by its
    chunks: 64 plans per stage, each once. Catches replicas with different chunk counts, a grid of shard ratios (or
    none at all) at stage 1, a device with another share or recompute set on its second chunk."""
    from solver import baselines

    inst = random_instance(5, num_devices=4, num_layers=2, heads=2, universe_size=2, global_batch=2, memory_scale=(2.0, 3.0))
    inst = dataclasses.replace(inst, universe=[frozenset(), frozenset(operator_names(inst.spec))])  # its own has () twice
    a, b, c, d = (dev.id for dev in inst.cluster.devices)
    monkeypatch.setattr(baselines, "raw_layouts", lambda ids, max_stages: iter([(((a,), (b,)), ((c,), (d,)))]))
    seen, consider = [], baselines._consider

    def record(best, plan, cluster, profiles):
        if any(p.chunks > 1 for p in plan.pipelines):
            seen.append(plan)
        return consider(best, plan, cluster, profiles)

    monkeypatch.setattr(baselines, "_consider", record)
    _oracle(inst, chunks=(1, 2), zero_stages=(0, 1), workers=1)
    assert len(seen) == 128 and len({plan.with_info().to_json() for plan in seen}) == 128
    assert sorted(plan.zero_stage for plan in seen) == [0] * 64 + [1] * 64
    for plan in seen:
        assert [p.chunks for p in plan.pipelines] == [2, 2]
        assert all([s.num_layers for s in p.stages] == [0, 1, 1, 0] for p in plan.pipelines)
        assert all(dev.shard_ratio is None for p in plan.pipelines for s in p.stages for dev in s.devices)
    rep = evaluate(next(plan for plan in seen if plan.zero_stage == 1), inst.cluster, inst.profiles)
    assert [dev.owned_fraction for dev in rep.devices] == [0.5] * 4


@pytest.mark.long
def test_oracle_offered_interleaving_is_never_worse():
    """Seed 18 (two GPUs, six layers, tables not monotone in the share, five recompute sets): offered 2 chunks the
    oracle's optimum is no worse, and its plan is the evaluator's. About 39,000 plans."""
    inst = _instance(next(c for c in CASES if c[0] == 18))
    plain, both = _oracle(inst), _oracle(inst, chunks=(1, 2))
    assert both.candidates > plain.candidates and both.objective_ms <= plain.objective_ms
    assert evaluate(both.plan, inst.cluster, inst.profiles).iteration_time_ms == both.objective_ms


def test_planner_equals_oracle_with_interleaving():
    """On ``interleaved_wins_instance`` the planner offered 2 chunks finds the oracle's optimum, an interleaved
    pipeline (1.2919 ms; the best 1F1B plan takes 1.3863 ms)."""
    got, oracle = _planner_and_oracle(interleaved_wins_instance(), chunks=(1, 2))
    assert any(p.chunks == 2 for p in got.plan.pipelines)
    assert any(p.chunks == 2 for p in oracle.plan.pipelines)


@pytest.mark.parametrize("seed", [18, pytest.param(3, marks=pytest.mark.long), pytest.param(25, marks=pytest.mark.long)])
def test_interleaved_bound_never_exceeds_an_interleaved_optimum(seed):
    """The bound interleaved candidates are pushed at (``bounds.interleaved_candidate_bound``) is at most the
    candidate's interleaved MILP optimum at 2 and 3 chunks, uniform splits, both stages: a bound above it would
    lose interleaved plans (it has no fill or drain term and 1F1B-with-one-micro-batch memory caps: solver/README.md)."""
    from solver.bounds import BoundCache, interleaved_candidate_bound

    inst = _instance(next(c for c in CASES if c[0] == seed))
    space = RecomputeSpace(inst.spec, inst.universe)
    mono = check_profiles(inst.spec, inst.cluster, inst.profiles)
    _, skeletons = skeleton_family(inst.spec, inst.cluster)
    checked = 0
    for sk in (s for s in skeletons if s.one_shape and s.num_stages >= 2):
        r = sk.num_replicas
        for b in (1, 2):
            if inst.global_batch % (b * r):
                continue
            batches = [(b, inst.global_batch // (b * r))] * r
            for z in ((0, 1) if r > 1 else (0,)):
                lb = interleaved_candidate_bound(inst.spec, inst.cluster, inst.profiles, sk, batches, space, BoundCache(),
                                                 mono, zero_stage=z)
                for v in (2, 3):
                    built = build_instance(inst.spec, inst.cluster, inst.profiles, sk, batches, space, monotone=mono,
                                           zero_stage=z, shard_grid=GRID, chunks=v)
                    if built.infeasible_reason:
                        continue
                    res = InnerModel(built).solve(time_limit=30, rel_gap=0.0, threads=1)
                    if res.objective_ms is not None:
                        assert lb <= res.objective_ms * (1 + 1e-9), (sk.describe(), batches, z, v, lb, res.objective_ms)
                        checked += 1
    assert checked >= 4
