"""Sharding stages 2 and 3 in the planner (solver/layered.py) against the exhaustive oracle, which enumerates every
plan at every stage (every shard-ratio grid per position, no symmetry), and in the baselines.

The instances are memory-bound on purpose: a model whose tied embedding is large (so a pipeline, which keeps a
copy of it on its first and last stage, does not fit), one head (no tensor parallelism), and capacities between
what a stage-3 plan and what every other plan needs. A planner that priced stage 2/3 memory or the lockstep
segments of eq. 17 differently from the evaluator, dropped a ratio vector or a split it must search, or bounded
a candidate above its optimum would disagree with the oracle here.
"""
from __future__ import annotations

import math

import pytest

from baton.cluster import from_mapping
from baton.evaluate import evaluate
from baton.memory import RecomputeSpace
from baton.model_spec import ModelSpec
from baton.operators import operator_names
from baton.profile import Profile, ProfileSet, derive_table
from solver.baselines import exhaustive
from solver.layered import ratio_assignments
from solver.search import NoPlanFits, search

GRID = 2


def _instance(memory_bytes, slowdown=1.0, num_layers=6):
    """Two GPUs on one node (the second ``slowdown`` times slower), a 6-layer model with one head and a 4096-row
    vocabulary at sequence length 8; universe: no recomputation and full recomputation."""
    spec = ModelSpec(name="z3", num_layers=num_layers, hidden_dim=64, num_heads=1, ffn_dim=256, seq_len=8, vocab_size=4096,
                     dtype="fp16", dropout=0.0)
    base = derive_table(spec, "a100-40gb", micro_batches=(1, 2))
    tables = {}
    for gpu, factor in zip(("a100-40gb", "t4"), (1.0, slowdown)):
        df = base.copy()
        df["gpu"] = gpu
        df["fwd_ms"] *= factor
        df["bwd_ms"] *= factor
        tables[gpu] = Profile(df, source=f"<scaled {gpu}>")
    gpus = [{"type": g, "count": 1, "memory_gib": m / 2**30, "memory_reserve_gib": 0.0}
            for g, m in zip(("a100-40gb", "t4"), memory_bytes)]
    cluster = from_mapping({"name": "z3", "nodes": [{"name": "n", "gpus": gpus, "intra_node_link": {
        "bandwidth_gb_per_s": 50.0, "latency_us": 1.0}}]}, source="<z3>")
    universe = [frozenset(), frozenset(operator_names(spec))]
    return spec, cluster, ProfileSet(spec, tables=tables), universe


CASES = [
    # memory per GPU (bytes), slowdown of the second, global batch, stages the optimum may use
    ((6.6e6, 6.6e6), 1.0, 2, {3}),      # only stage 3 fits
    ((6.6e6, 6.6e6), 1.0, 4, {3}),      # only stage 3 fits, with every micro-batch in flight
    ((6.8e6, 6.8e6), 1.0, 4, {3}),      # stages 0 and 2 fit too; stage 3 is fastest
    ((7.0e6, 6.8e6), 1.5, 6, {3}),      # GPUs of two speeds: uneven batches
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0][0]:.2g}-{c[0][1]:.2g}B-x{c[1]}-G{c[2]}" for c in CASES])
def test_planner_equals_oracle_when_the_optimum_needs_sharded_gradients_or_weights(case):
    memory, slowdown, gb, stages = case
    spec, cluster, profiles, universe = _instance(memory, slowdown)
    oracle = exhaustive(spec, cluster, profiles, global_batch=gb, universe=universe, shard_grid=GRID)
    got = search(spec, cluster, profiles, global_batch=gb, gap=0.0, time_limit=120, space=RecomputeSpace(spec, universe),
                 shard_grid=GRID)
    assert math.isclose(got.objective_ms, oracle.objective_ms, rel_tol=1e-6), (got.plan.to_json(), oracle.plan.to_json())
    assert got.status == "optimal"
    assert got.plan.zero_stage in stages and oracle.plan.zero_stage in stages
    rep = evaluate(got.plan, cluster, profiles)
    assert rep.fits and math.isclose(rep.iteration_time_ms, got.objective_ms, rel_tol=1e-6)


def test_only_stage_three_fits_and_restricting_the_stages_says_so():
    """With 6.6 MB per GPU nothing but stage 3 fits: searching stages 0-2 finds no plan, in the planner and in the
    oracle alike."""
    spec, cluster, profiles, universe = _instance((6.6e6, 6.6e6))
    for z in (0, 1, 2):
        with pytest.raises(NoPlanFits):
            exhaustive(spec, cluster, profiles, global_batch=2, universe=universe, shard_grid=GRID, zero_stages=(z,))
        with pytest.raises(NoPlanFits):
            search(spec, cluster, profiles, global_batch=2, gap=0.0, time_limit=60, zero_stages=(z,),
                   space=RecomputeSpace(spec, universe), shard_grid=GRID)
    got = search(spec, cluster, profiles, global_batch=2, gap=0.0, time_limit=60, zero_stages=(3,),
                 space=RecomputeSpace(spec, universe), shard_grid=GRID)
    assert got.plan.zero_stage == 3 and all(len(p.stages) == 1 for p in got.plan.pipelines)


def test_ratio_assignments_cover_every_vector_modulo_interchangeable_replicas():
    """Against brute force: with TP ranks, every per-position grid vector up to swapping replicas of one class; with
    one rank per replica, members of a class within one grid step of each other (one class: the equal part)."""
    import itertools

    from solver.options import ratio_vectors

    grid = 4
    for classes in ([0, 0, 1], [0, 1, 2], [0, 0]):
        r = len(classes)
        every = list(itertools.product(list(ratio_vectors(r, grid)), repeat=2))
        got = set(ratio_assignments(2, classes, grid))
        assert got <= set(every)

        def value(combo, rho):
            return tuple(1.0 / r if v is None else v[rho] for v in combo)

        def canon(combo):
            order = sorted(range(r), key=lambda rho: (classes[rho], value(combo, rho)))
            slots = sorted(range(r), key=lambda rho: classes[rho])
            out = [None] * r
            for slot, rho in zip(slots, order):
                out[slot] = value(combo, rho)
            return tuple(out)

        assert {canon(c) for c in every} == {canon(c) for c in got}
    assert list(ratio_assignments(1, [0, 0, 0], grid)) == [(None,)]
    one = list(ratio_assignments(1, [0, 0, 1], 8))
    for (vec,) in one[1:]:
        assert abs(vec[0] - vec[1]) <= 1 / 8 and math.isclose(sum(vec), 1.0)
    assert len(one) == 1 + 9  # the equal part, and every total of the pair's class (0..8 eighths)
