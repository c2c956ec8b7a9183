"""``unlike.replica_layouts`` screens a replica's layer splits a block at a time with eq. 1's two quick bounds in numpy
and prices eq. 1 only below the limit (rule 15's pass lists millions of layouts). Screening must change nothing: the
same layouts, times and order, and the same least time of those left out, as pricing every layout one by one."""
from __future__ import annotations

import itertools
import math

import pytest

import solver.unlike as U
from baton.memory import RecomputeSpace
from tests.test_solver_helpers import random_instance


def _one_by_one(tables: U.StageTables, rho: int, limit_ms: float):
    """What ``replica_layouts`` answers, pricing every (layer split, units) with ``pipeline_ms`` in turn."""
    spec, pipe = tables.spec, tables.pipes[rho]
    unit_sets = list(itertools.product(*(U.unit_options(spec, len(g)) for g in pipe)))
    kept, least = [], math.inf
    for layers in U.layer_splits(spec.num_layers, len(pipe)):
        for units in unit_sets:
            t = tables.pipeline_ms(rho, layers, units, below=limit_ms)
            if t < limit_ms:
                kept.append(U.Layout(layers=layers, units=units, pipe_ms=t))
            else:
                least = min(least, t)
    return sorted(kept, key=lambda x: x.pipe_ms), least  # a stable sort: ties stay in splits-then-units order


@pytest.mark.parametrize("seed", range(6))
def test_screened_layouts_are_the_layouts_priced_one_by_one(seed, monkeypatch):
    monkeypatch.setattr(U, "_SPLIT_BLOCK", 5)  # several blocks per replica, and a short last one
    inst = random_instance(seed, num_devices=6, num_layers=7, heads=4, universe_size=2, global_batch=4)
    ids = [d.id for d in inst.cluster.devices]
    # Two replicas of different shapes: three stages (the middle one a TP pair), and two stages.
    pipes = (((ids[0],), (ids[1], ids[2]), (ids[3],)), ((ids[4],), (ids[5],)))
    tables = U.StageTables(inst.spec, inst.cluster, inst.profiles, RecomputeSpace(inst.spec, inst.universe), pipes,
                           ((1, 2), (2, 1)))
    compared = 0
    for rho in range(len(pipes)):
        every, _ = _one_by_one(tables, rho, math.inf)
        times = sorted(x.pipe_ms for x in every)
        # No limit, one inside the spread of times, and one under every layout.
        for limit in (math.inf, times[len(times) // 2], times[0] * 0.5):
            got, got_least = U.replica_layouts(tables, rho, limit)
            want, want_least = _one_by_one(tables, rho, limit)
            assert got == want, (seed, rho, limit)
            assert got_least == want_least, (seed, rho, limit)
            compared += len(want)
    assert compared > 0


@pytest.mark.parametrize("seed", range(4))
def test_the_sync_floor_lies_under_every_structures_sync(seed):
    """``unlike.expand`` drops a structure when its pipeline and rule 13's device-by-device floor on its sync already
    reach the limit, before pricing eq. 15. The floor must lie under the evaluator's own T_dp of every structure, at
    stages 0 and 1, and be worth computing (at least half of T_dp on some structure)."""
    inst = random_instance(seed, num_devices=6, num_layers=5, heads=16, universe_size=2, global_batch=4)
    ids = [d.id for d in inst.cluster.devices]
    pipes = (((ids[0],), (ids[1], ids[2]), (ids[3],)), ((ids[4],), (ids[5],)))
    batches = ((1, 2), (2, 1))
    tables = U.StageTables(inst.spec, inst.cluster, inst.profiles, RecomputeSpace(inst.spec, inst.universe), pipes, batches)
    layouts = [U.replica_layouts(tables, rho, math.inf)[0] for rho in range(len(pipes))]
    floor = U._sync_floor(inst.spec, inst.cluster, pipes)
    ratios = []
    for struct in itertools.islice(U.structures(layouts, [None, None]), 400):
        lb = floor(struct)
        for z in (0, 1):
            exact = U.sync_terms(inst.cluster, U.structure_plan(inst.spec, pipes, batches, z, struct)).dp_sync_ms
            assert lb <= exact * (1 + 1e-9), (seed, z, lb, exact)
            ratios.append(lb / exact)
    assert max(ratios) >= 0.5, max(ratios)
