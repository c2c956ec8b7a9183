"""Replicas of different shapes in the planner: the skeleton enumeration, the layout enumeration of
solver/unlike.py, and the planner against the exhaustive oracle where the best plan's replicas differ."""
from __future__ import annotations

import math

import pytest

from baton.cluster import from_mapping
from baton.evaluate import evaluate
from baton.memory import RecomputeSpace
from baton.model_spec import ModelSpec
from baton.operators import operator_names
from baton.profile import Profile, ProfileSet, derive_table
from solver.baselines import exhaustive, raw_layouts
from solver.search import search
from solver.space import device_classes, exact_skeletons
from solver.unlike import _best_backward, layer_splits, unit_options
from tests.test_solver_exact import GRID
from tests.test_solver_helpers import Instance, random_instance


def fast_and_two_slow(*, memory_mb: float = 0.17, slowdown: float = 1.5, global_batch: int = 6) -> Instance:
    """One A100 and two GPUs ``slowdown`` times slower, on one node; one head (no tensor parallelism), four layers.
    A slow GPU of 0.17 MB cannot hold the model alone but two can as a pipeline, so the candidates are the A100
    alone, pipelines through two or three GPUs, the A100 with one slow GPU, and replicas of different shapes."""
    spec = ModelSpec(name="dp3", num_layers=4, hidden_dim=16, num_heads=1, ffn_dim=64, seq_len=32, vocab_size=128,
                     dtype="fp16", dropout=0.0)
    base = derive_table(spec, "a100-40gb", micro_batches=(1, 2))
    tables = {}
    for gpu, factor in (("a100-40gb", 1.0), ("t4", slowdown)):
        df = base.copy()
        df["gpu"] = gpu
        df["fwd_ms"] *= factor
        df["bwd_ms"] *= factor
        tables[gpu] = Profile(df, source=f"<scaled {gpu}>")
    gpus = [{"type": "a100-40gb", "count": 1, "memory_gib": 40.0, "memory_reserve_gib": 0.0},
            {"type": "t4", "count": 2, "memory_gib": memory_mb * 1e6 / 2**30, "memory_reserve_gib": 0.0}]
    cluster = from_mapping({"name": "dp3", "nodes": [{"name": "n", "gpus": gpus, "intra_node_link": {
        "bandwidth_gb_per_s": 50.0, "latency_us": 1.0}}]}, source="<dp3>")
    universe = [frozenset(), frozenset(operator_names(spec))]
    return Instance(spec=spec, cluster=cluster, profiles=ProfileSet(spec, tables=tables), global_batch=global_batch,
                    universe=universe, seed=0)


def _shapes(plan) -> list[tuple[int, ...]]:
    return [tuple(len(s.devices) for s in p.stages) for p in plan.pipelines]


def test_planner_equals_oracle_when_replicas_of_different_shapes_win():
    """The A100 alone as one replica (4 samples) and the two slow GPUs as a two-stage pipeline (2 samples) beat
    every plan whose replicas share a shape; the planner finds the oracle's optimum, and it has those replicas.
    A planner that forced every replica to the first one's shape would return a slower plan; one that priced the
    sync of unlike replicas wrongly would fail the evaluator's re-check or disagree with the oracle."""
    inst = fast_and_two_slow()
    space = RecomputeSpace(inst.spec, inst.universe)
    oracle = exhaustive(inst.spec, inst.cluster, inst.profiles, global_batch=inst.global_batch, universe=inst.universe,
                        shard_grid=GRID)
    got = search(inst.spec, inst.cluster, inst.profiles, global_batch=inst.global_batch, gap=0.0, time_limit=120,
                 space=space, shard_grid=GRID)
    assert math.isclose(got.objective_ms, oracle.objective_ms, rel_tol=1e-6), (got.plan.to_json(), oracle.plan.to_json())
    assert got.status == "optimal"
    assert sorted(_shapes(got.plan)) == [(1,), (1, 1)] and sorted(_shapes(oracle.plan)) == [(1,), (1, 1)]
    fast = next(i for i, p in enumerate(got.plan.pipelines) if len(p.stages) == 1)
    assert got.plan.pipelines[fast].stages[0].devices[0].id == "n:0" and got.plan.samples(fast) == 4
    rep = evaluate(got.plan, inst.cluster, inst.profiles)
    assert rep.fits and math.isclose(rep.iteration_time_ms, got.objective_ms, rel_tol=1e-6)
    # Without unlike replicas (only the skeletons whose replicas share a shape) the best is strictly slower.
    alike = [sk for sk in exact_skeletons(inst.cluster, max_stages=inst.spec.num_layers + 2) if sk.one_shape]
    same = search(inst.spec, inst.cluster, inst.profiles, global_batch=inst.global_batch, gap=0.0, time_limit=120,
                  space=space, shard_grid=GRID, skeletons=alike, family="exact")
    assert same.objective_ms > got.objective_ms * (1 + 1e-3)


# Long: about 24,000 plans for the oracle each; unlike replicas against the oracle run quick in the test above.
@pytest.mark.long
@pytest.mark.parametrize("seed", [7, 25])
def test_planner_equals_oracle_with_tensor_parallel_unlike_replicas(seed):
    """Three GPUs, two heads: unlike replicas include a TP group next to a single device, whose unit boundaries cut
    the peer groups (solver/unlike.py enumerates the units). The planner equals the oracle, which enumerates every
    replica's layers and units on its own."""
    inst = random_instance(seed, num_devices=3, num_layers=2, heads=2, universe_size=2, global_batch=4,
                           memory_scale=(0.4, 1.1))
    oracle = exhaustive(inst.spec, inst.cluster, inst.profiles, global_batch=inst.global_batch, universe=inst.universe,
                        shard_grid=GRID)
    got = search(inst.spec, inst.cluster, inst.profiles, global_batch=inst.global_batch, gap=0.0, time_limit=120,
                 space=RecomputeSpace(inst.spec, inst.universe), shard_grid=GRID)
    assert math.isclose(got.objective_ms, oracle.objective_ms, rel_tol=1e-6), (got.plan.to_json(), oracle.plan.to_json())
    assert got.status == "optimal"


def _class_form(cluster, reps) -> tuple:
    """A replica set up to interchangeable devices and replica order: devices as their class, single-node groups
    sorted (their rank order changes nothing, solver/space.py)."""
    cls = {i: k for k, c in enumerate(device_classes(cluster)) for i in c.ids}
    node = {d.id: d.node for d in cluster.devices}
    out = []
    for pipe in reps:
        stages = []
        for g in pipe:
            row = tuple(cls[i] for i in g)
            stages.append(tuple(sorted(row)) if len({node[i] for i in g}) == 1 else row)
        out.append(tuple(stages))
    return tuple(sorted(out))


@pytest.mark.parametrize("seed,devices", [(3, 3), (5, 4)])
def test_exact_skeletons_are_every_layout_modulo_symmetry(seed, devices):
    """exact_skeletons against brute force (every replica set of any shapes over the devices): the same set of
    layouts up to interchangeable devices, replica order and rank order in single-node groups, each once. A
    skeleton family that forced replicas to one shape, or dropped a layout, would differ here."""
    inst = random_instance(seed, num_devices=devices, num_layers=3, heads=2, universe_size=2)
    sks = exact_skeletons(inst.cluster, max_stages=5)
    forms = [_class_form(inst.cluster, sk.pipelines) for sk in sks]
    assert len(forms) == len(set(forms))
    brute = {_class_form(inst.cluster, reps) for reps in raw_layouts([d.id for d in inst.cluster.devices], 5)}
    assert set(forms) == brute
    assert any(not sk.one_shape for sk in sks)


def test_layer_splits_and_unit_options_are_complete():
    """Every split within the stage limits (middle stages at least one layer), every distinct vector of shares."""
    assert sorted(layer_splits(3, 3)) == [(0, 1, 2), (0, 2, 1), (0, 3, 0), (1, 1, 1), (1, 2, 0), (2, 1, 0)]
    spec = ModelSpec(name="u", num_layers=2, hidden_dim=64, num_heads=4, ffn_dim=256, seq_len=8, vocab_size=64)
    shares = {tuple(u / U for u in us) for U, us in unit_options(spec, 2)}
    assert shares == {(0.25, 0.75), (0.5, 0.5), (0.75, 0.25)}


def test_best_backward_is_the_least_over_every_choice():
    """The per-stage minimisation against brute force over every set per device (two blocks)."""
    import itertools
    import random

    import numpy as np

    rng = random.Random(0)
    for _ in range(50):
        devs = [(np.array([rng.choice([1.0, 2.0, 3.0, 4.0]) for _ in range(k)]),
                 np.array([rng.choice([1.0, 2.0, 3.0, 4.0]) for _ in range(k)])) for k in (rng.randint(1, 4) for _ in range(3))]
        value, picks = _best_backward(devs)
        brute = min(max(a[j] for (a, _), j in zip(devs, js)) + max(b[j] for (_, b), j in zip(devs, js))
                    for js in itertools.product(*[range(len(a)) for a, _ in devs]))
        assert value == brute
        assert max(a[j] for (a, _), j in zip(devs, picks)) + max(b[j] for (_, b), j in zip(devs, picks)) == value
