"""The bound over every plan (solver/ideal.py): never above any plan the evaluator prices, on any shipped cluster,
whatever the layout; tight where nothing but compute and the Adam step is left (one device, no memory pressure);
the same whatever order the cluster file lists its nodes in."""
from __future__ import annotations

import functools

import pytest
import yaml

from baton.cluster import load_cluster
from baton.evaluate import evaluate
from baton.model_spec import PRESETS
from baton.profile import ProfileSet
from solver import baselines
from solver.ideal import ideal_bound
from solver.options import plan_shares
from solver.moves import price_neighbours
from solver.search import search
from tests.conftest import ROOT

CASES = [("cpu2", "tiny", 8), ("cpu4", "tiny", 8), ("a100x2_t4x2", "gpt3-1.3b", 64), ("poplar_a", "gpt3-1.3b", 64),
         ("cephalo_8gpu", "gpt3-350m", 64), ("hethub_nv_gpua", "llama2-7b", 64)]


@functools.cache
def _inputs(cluster: str, model: str):
    spec = PRESETS[model]
    return spec, load_cluster(ROOT / "clusters" / f"{cluster}.yaml"), ProfileSet(spec)


@pytest.mark.parametrize(("cluster", "model", "batch"), CASES, ids=[c[0] for c in CASES])
def test_no_plan_the_evaluator_prices_is_faster_than_the_bound(cluster, model, batch):
    """Megatron's plan and every plan one move from it (other layouts, batches, shares, recompute sets, micro-batch
    sizes, replicas of different sizes), priced by the evaluator."""
    spec, c, profiles = _inputs(cluster, model)
    bound = ideal_bound(spec, c, profiles, batch).bound_ms
    start = baselines.megatron(spec, c, profiles, global_batch=batch)
    priced, _ = price_neighbours(start.plan, c, profiles, max_per_move=25)
    times = [start.objective_ms] + [p.iteration_ms for p in priced]
    assert len(times) > 10
    assert bound <= min(times) * (1 + 1e-12), (bound, min(times))
    assert bound > 0.3 * min(times)  # a bound of nothing would pass the line above


def test_the_bound_is_below_the_proven_optimum_of_an_exact_instance():
    spec, c, profiles = _inputs("a100x2_t4x2", "gpt3-1.3b")
    res = search(spec, c, profiles, global_batch=64, time_limit=120, gap=1e-7, threads=1)
    assert res.status == "optimal" and res.family == "exact"
    bound = ideal_bound(spec, c, profiles, 64).bound_ms
    assert bound <= res.objective_ms
    assert res.objective_ms / bound < 1.2  # 4565.9 against 4181.2 ms: bubbles and links are what is left out


def _one_device(tmp_path, gpu: str):
    path = tmp_path / "one.yaml"
    path.write_text(yaml.safe_dump({"name": "one", "nodes": [{"name": "n", "gpus": [{"type": gpu, "count": 1}]}]}))
    return load_cluster(path)


def test_on_one_device_with_memory_to_spare_the_bound_is_the_plan(tmp_path):
    """One A100 and a 350M model: no pipeline, no links, nothing recomputed; the optimum is G/b micro-batches through
    every layer and both edges, then the step. The bound differs only where the layers' best micro-batch size is not
    the edges' (each is taken at its own best)."""
    spec = PRESETS["gpt3-350m"]
    c, profiles = _one_device(tmp_path, "a100-40gb"), ProfileSet(spec)
    res = search(spec, c, profiles, global_batch=64, time_limit=60, gap=1e-7, threads=1)
    ib = ideal_bound(spec, c, profiles, 64)
    rep = evaluate(res.plan, c, profiles)
    assert ib.bound_ms <= rep.iteration_time_ms * (1 + 1e-12)
    assert ib.bound_ms == pytest.approx(rep.iteration_time_ms, rel=0.02)  # equal to the last bit on this instance
    assert ib.optimizer_ms == pytest.approx(rep.optimizer_ms, rel=1e-9)


def test_every_share_a_plan_can_give_is_priced():
    spec = PRESETS["gpt3-1.3b"]
    shares = plan_shares(spec)
    assert shares[-1] == 1.0 and 0.5 in shares
    assert all(0 < s <= 1 for s in shares)


def test_the_order_of_the_cluster_file_does_not_change_the_bound(tmp_path):
    spec, c, profiles = _inputs("poplar_a", "gpt3-1.3b")
    raw = yaml.safe_load((ROOT / "clusters" / "poplar_a.yaml").read_text())
    raw["nodes"] = list(reversed(raw["nodes"]))
    path = tmp_path / "reversed.yaml"
    path.write_text(yaml.safe_dump(raw))
    flipped = load_cluster(path)
    assert ideal_bound(spec, flipped, profiles, 64).bound_ms == pytest.approx(ideal_bound(spec, c, profiles, 64).bound_ms,
                                                                               rel=1e-12)
