"""Replicas of any shape, per-replica batches and sharded optimizer state: the plan format, the peer groups
of baton/peers.py and the evaluator's data-parallel terms (docs/cost-model.md, section 9)."""
from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest

from baton.cluster import load_cluster
from baton.costmodel import allreduce_ms, edge_param_count, group_sync_ms, layer_param_count, sync_schedule_ms
from baton.errors import BatonError
from baton.evaluate import evaluate
from baton.model_files import load_model
from baton.model_spec import PRESETS
from baton.operators import padded_vocab
from baton.peers import (held_params, owned_fractions, owned_params, peer_groups, replicated_param_count, shard_sizes,
                         split_param_count)
from baton.plan import DeviceShare, Pipeline, Plan, Stage, from_dict, simple_plan, validate
from baton.profile import ProfileSet

ROOT = Path(__file__).resolve().parent.parent
TINY = load_model("tiny")  # 4 layers, 4 heads: unit counts 1, 2, 4


def model_params(spec) -> int:
    h = spec.hidden_dim
    return spec.num_layers * (split_param_count(spec) + replicated_param_count(spec)) + padded_vocab(spec) * h + spec.seq_len * h + 2 * h


def random_pipeline(rng: random.Random, spec, ids: list[str]) -> Pipeline:
    """A random valid replica over ``ids``: stages of random TP degree, random layer cuts and units."""
    n = len(ids)
    p = rng.randint(1, min(n, spec.num_layers))
    sizes = [1] * p
    for _ in range(n - p):
        sizes[rng.randrange(p)] += 1
    sizes = [min(s, spec.num_heads) for s in sizes]
    cuts = sorted(rng.sample(range(1, spec.num_layers), p - 1)) if p > 1 else []
    bounds = [0, *cuts, spec.num_layers]
    stages, k = [], 0
    for s in range(p):
        group = ids[k:k + sizes[s]]
        k += sizes[s]
        U = rng.choice([u for u in (1, 2, 4) if u >= len(group)])
        units = [1] * len(group)
        for _ in range(U - len(group)):
            units[rng.randrange(len(group))] += 1
        stages.append(Stage(first_layer=bounds[s], num_layers=bounds[s + 1] - bounds[s], units_per_layer=U,
                            devices=tuple(DeviceShare(id=i, units=u) for i, u in zip(group, units))))
    return Pipeline(stages=tuple(stages), micro_batch_size=rng.randint(1, 3), num_microbatches=rng.randint(1, 4))


def random_plan(seed: int, spec=TINY, zero_stage: int = 0) -> Plan:
    rng = random.Random(seed)
    r = rng.randint(1, 3)
    ids = [f"n:{i}" for i in range(8)]
    rng.shuffle(ids)
    pipes, k = [], 0
    for _ in range(r):
        n = rng.randint(1, 3)
        pipes.append(random_pipeline(rng, spec, ids[k:k + n]))
        k += n
    return validate(Plan(model=spec, cluster="c", micro_batch_size=1, num_microbatches=1, pipelines=tuple(pipes),
                         zero_stage=zero_stage))


@pytest.mark.parametrize("seed", range(40))
def test_every_group_adds_every_replica_once(seed):
    """In every group each replica's holders weigh 1 in all (gradient / copies each), so the group's sum is
    the sum of the replicas' gradients, whatever the shapes; and every piece a device holds is in a group."""
    plan = random_plan(seed)
    rep_of = {d: i for i, p in enumerate(plan.pipelines) for s in p.stages for d in s.device_ids}
    for g in peer_groups(plan):
        assert len(set(g.holders)) == g.size
        weight = [0.0] * len(plan.pipelines)
        for h, c, r in zip(g.holders, g.copies, g.replicas):
            assert rep_of[h] == r
            weight[r] += 1 / c
        assert weight == pytest.approx([1.0] * len(plan.pipelines), rel=1e-12)
    # Each replica holds the whole model, the tied head's rows once more when its last stage is another stage.
    held = held_params(plan)
    for pipe in plan.pipelines:
        copies = sum(held[d] for s in pipe.stages for d in s.device_ids)
        tp_copies = sum((len(s.devices) - 1) * s.num_layers * replicated_param_count(TINY) for s in pipe.stages)
        h = TINY.hidden_dim
        tp_copies += (len(pipe.stages[0].devices) - 1) * TINY.seq_len * h + (len(pipe.stages[-1].devices) - 1) * 2 * h
        tied = padded_vocab(TINY) * h if len(pipe.stages) > 1 else 0
        assert copies == model_params(TINY) + tp_copies + tied


@pytest.mark.parametrize("seed", range(40))
def test_held_parameters_are_what_the_device_holds(seed):
    """A device's pieces add up to its layers at its share plus its edge rows: the same counts the cost model
    uses for identical replicas (layer_param_count, edge_param_count)."""
    plan = random_plan(seed)
    held = held_params(plan)
    for pipe in plan.pipelines:
        p = len(pipe.stages)
        for si, stage in enumerate(pipe.stages):
            for d in stage.devices:
                share = d.units / stage.units_per_layer
                want = stage.num_layers * layer_param_count(TINY, share) + edge_param_count(TINY, share, first=si == 0, last=si == p - 1)
                assert held[d.id] == pytest.approx(want, rel=1e-12)


def test_replicas_of_one_shape_sync_by_position():
    a = simple_plan(TINY, cluster="c", stages=[[("a0", 1), ("a1", 3)], [("a2", 2)]], layers=[1, 3], units_per_layer=[4, 2])
    b = simple_plan(TINY, cluster="c", stages=[[("b0", 1), ("b1", 3)], [("b2", 2)]], layers=[1, 3], units_per_layer=[4, 2])
    plan = validate(replace(a, pipelines=a.pipelines + b.pipelines))
    groups = peer_groups(plan)
    assert sorted(g.holders for g in groups) == [("a0", "b0"), ("a1", "b1"), ("a2", "b2")]
    assert all(g.copies == (1, 1) for g in groups)


def test_unlike_replicas_share_pieces_with_the_single_device():
    a = simple_plan(TINY, cluster="c", stages=[[("a0", 1), ("a1", 1)], [("a2", 2)]], layers=[2, 2], units_per_layer=2)
    c = simple_plan(TINY, cluster="c", stages=[[("c0", 1)]], layers=[4], units_per_layer=1)
    plan = validate(replace(a, pipelines=a.pipelines + c.pipelines))
    holders = {g.holders for g in peer_groups(plan)}
    assert ("a0", "c0") in holders and ("a1", "c0") in holders and ("a2", "c0") in holders
    # The first stage's LayerNorm copies (two TP ranks) against one copy in the single device: one set, weighted.
    mixed = [g for g in peer_groups(plan) if len(g.holders) > 2]
    assert mixed and all(set(g.copies) <= {1, 2} for g in mixed)


def test_shard_sizes_add_up_and_follow_the_ratios():
    assert shard_sizes(10, [0.7, 0.3]) == (7, 3)
    assert shard_sizes(10, [0.0, 1.0]) == (0, 10)
    assert shard_sizes(7, [1, 1, 1]) == (3, 2, 2)
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(0, 10_000)
        w = [rng.choice([0.0, rng.random()]) for _ in range(rng.randint(1, 6))]
        if sum(w) == 0:
            continue
        got = shard_sizes(n, w)
        assert sum(got) == n
        assert all(abs(x - n * wi / sum(w)) < 1 for x, wi in zip(got, w))
        assert all(x == 0 for x, wi in zip(got, w) if wi == 0)


def two_replica_plan(spec, *, zero_stage=0, ratios=None, batches=((2, 4), (2, 4))):
    a = simple_plan(spec, cluster="a100x2_t4x2", stages=[[("a100:0", 8), ("a100:1", 8)]], layers=[spec.num_layers], units_per_layer=16)
    b = simple_plan(spec, cluster="a100x2_t4x2", stages=[[("t4:0", 8), ("t4:1", 8)]], layers=[spec.num_layers], units_per_layer=16,
                    recompute={"t4:0": ["attn_core"], "t4:1": ["attn_core"]})
    ratios = ratios or {}
    pipes = tuple(replace(p.pipelines[0], micro_batch_size=bm[0], num_microbatches=bm[1],
                          stages=tuple(replace(s, devices=tuple(replace(d, shard_ratio=ratios.get(d.id)) for d in s.devices))
                                       for s in p.pipelines[0].stages))
                  for p, bm in zip((a, b), batches))
    return validate(replace(a, pipelines=pipes, zero_stage=zero_stage))


@pytest.fixture(scope="module")
def gpu_setup():
    spec = PRESETS["gpt3-1.3b"]
    return spec, load_cluster(ROOT / "clusters" / "a100x2_t4x2.yaml"), ProfileSet(spec)


def test_each_replica_runs_its_own_batch(gpu_setup):
    spec, cluster, profiles = gpu_setup
    plan = two_replica_plan(spec, batches=((2, 6), (1, 4)))
    rep = evaluate(plan, cluster, profiles)
    assert rep.global_batch == 16 and rep.replica_samples == [12, 4]
    for r in range(2):
        alone = replace(plan, pipelines=(plan.pipelines[r],), micro_batch_size=plan.batch(r)[0], num_microbatches=plan.batch(r)[1])
        alone = replace(alone, pipelines=(replace(alone.pipelines[0], micro_batch_size=None, num_microbatches=None),))
        assert rep.replica_pipeline_ms[r] == pytest.approx(evaluate(alone, cluster, profiles).pipeline_ms, rel=1e-12)
    assert rep.pipeline_ms == max(rep.replica_pipeline_ms)


def test_sharded_state_scales_optimizer_memory_and_step(gpu_setup):
    spec, cluster, profiles = gpu_setup
    full = evaluate(two_replica_plan(spec), cluster, profiles)
    half = evaluate(two_replica_plan(spec, zero_stage=1), cluster, profiles)
    tilted = evaluate(two_replica_plan(spec, zero_stage=1, ratios={"a100:0": 0.75, "a100:1": 0.75, "t4:0": 0.25, "t4:1": 0.25}),
                      cluster, profiles)
    for f, h, t in zip(full.devices, half.devices, tilted.devices):
        assert h.owned_fraction == pytest.approx(0.5) and h.optimizer_bytes == pytest.approx(f.optimizer_bytes / 2)
        assert t.optimizer_bytes == pytest.approx(f.optimizer_bytes * (0.75 if f.gpu.startswith("a100") else 0.25))
        assert h.optimizer_ms == pytest.approx(f.optimizer_ms / 2)
        assert h.weights_bytes == f.weights_bytes and h.grads_bytes == f.grads_bytes
    # Equal shards: reduce-scatter + all-gather cost exactly the all-reduce (eq. 13).
    assert half.dp_sync_ms == pytest.approx(full.dp_sync_ms, rel=1e-12)
    # Uneven shards pad every chunk to the largest: 0.75 of the bytes per chunk instead of 0.5.
    assert tilted.dp_sync_ms > half.dp_sync_ms


def test_sync_groups_sharing_a_device_run_one_after_another(gpu_setup):
    _, cluster, _ = gpu_setup
    assert sync_schedule_ms([(("a", "b"), 2.0), (("c", "d"), 3.0)]) == 3.0
    assert sync_schedule_ms([(("a", "b"), 2.0), (("b", "c"), 3.0), (("d", "e"), 4.0)]) == 5.0
    assert sync_schedule_ms([(("a",), 9.0)]) == 0.0
    spec = PRESETS["gpt3-1.3b"]
    ids = ["a100:0", "t4:0"]
    ar = allreduce_ms(1e8 * spec.dtype_bytes, 2, cluster.slowest_link(ids))
    assert group_sync_ms(cluster, spec, ids, 1e8, 5e7, 0) == pytest.approx(ar)
    assert group_sync_ms(cluster, spec, ids, 1e8, 5e7, 1) == pytest.approx(ar, rel=1e-12)


def test_plan_format_round_trips_and_reads_version_1():
    plan = two_replica_plan(PRESETS["gpt3-1.3b"], zero_stage=1, ratios={"a100:0": 0.7, "t4:0": 0.3, "a100:1": 0.5, "t4:1": 0.5},
                            batches=((2, 3), (1, 2)))
    again = from_dict(json.loads(plan.to_json()))
    assert again == plan and again.global_batch == 8 and again.batch(1) == (1, 2)
    old = json.loads(simple_plan(TINY, cluster="c", stages=[[("a", 1)]], layers=[4], units_per_layer=1).to_json())
    old["format"] = "baton-plan/1"
    del old["zero_stage"]
    assert from_dict(old).zero_stage == 0


@pytest.mark.parametrize("edit, field, words", [
    (lambda d: d["pipelines"][0]["stages"][0]["devices"][0].update(shard_ratio=0.5), "shard_ratio", "needs zero_stage"),
    (lambda d: d.update(zero_stage=4), "zero_stage", "<= 3"),
    (lambda d: d.update(zero_stage=1) or d["pipelines"][0]["stages"][0]["devices"][0].update(shard_ratio=0.5), "pipelines", "all or none"),
    (lambda d: d.update(zero_stage=1) or [x["stages"][0]["devices"][0].update(shard_ratio=0.0) for x in d["pipelines"]], "pipelines", "shard_ratio 0"),
    (lambda d: d["pipelines"][1].update(num_microbatches=0), "num_microbatches", ">= 1"),
    (lambda d: d["pipelines"][0]["stages"][0]["devices"][0].update(shard_ratio=1.5), "shard_ratio", "<= 1"),
])
def test_bad_replica_fields_are_named(edit, field, words):
    a = simple_plan(TINY, cluster="c", stages=[[("a", 1)]], layers=[4], units_per_layer=1)
    b = simple_plan(TINY, cluster="c", stages=[[("b", 1)]], layers=[4], units_per_layer=1)
    data = json.loads(validate(replace(a, pipelines=a.pipelines + b.pipelines)).to_json())
    edit(data)
    with pytest.raises(BatonError) as e:
        from_dict(data, source="p.json")
    assert field in str(e.value) and words in str(e.value) and "p.json" in str(e.value)


@pytest.mark.parametrize("seed", range(10))
def test_owned_fractions_add_up_per_group(seed):
    plan = random_plan(seed, zero_stage=1)
    for g in peer_groups(plan):
        assert sum(owned_fractions(plan, g)) == pytest.approx(1.0)
    owned, held = owned_params(plan), held_params(plan)
    assert all(0 < owned[d] <= held[d] for d in held)


def test_show_prints_replicas_and_groups_alike_rows_on_large_plans(tmp_path):
    """`baton show` lists every replica's batch and the owned state share; beyond MAX_DEVICE_ROWS devices
    alike replicas, stages and devices share a row, so a 64-replica plan stays a few lines long."""
    from baton.plan import save_plan
    from tests.conftest import run_cli

    cluster = load_cluster(ROOT / "clusters" / "scale_64.yaml")
    spec = PRESETS["gpt3-350m"]
    pipes = tuple(Pipeline(stages=(Stage(first_layer=0, num_layers=spec.num_layers, units_per_layer=1,
                                         devices=(DeviceShare(id=d.id, units=1),)),), num_microbatches=1 + (i % 2))
                  for i, d in enumerate(cluster.devices))
    plan = validate(Plan(model=spec, cluster=cluster.name, micro_batch_size=1, num_microbatches=2, pipelines=pipes, zero_stage=1))
    save_plan(plan, tmp_path / "dp.json")
    code, out, err = run_cli("show", tmp_path / "dp.json", "--cluster", ROOT / "clusters" / "scale_64.yaml")
    assert code == 0, out + err
    assert "alike" in out and "state owned" in out and "micro-batches" in out
    assert len(out.splitlines()) < 45


def test_unlike_replicas_stage_their_groups_and_shard_in_two_passes(gpu_setup):
    """Replicas of different shapes: a device's groups are parts of what it holds, so stage 0 copies each into
    a staging buffer (eq. 14) and the groups share devices, so their collectives queue (eq. 15); at stage 1
    every reduce-scatter runs before every all-gather: two schedules of one ring pass each."""
    from baton.costmodel import ring_step_ms

    spec, cluster, profiles = gpu_setup
    a = simple_plan(spec, cluster="a100x2_t4x2", stages=[[("a100:0", 16)], [("a100:1", 16)]], layers=[12, 12], units_per_layer=16)
    b = simple_plan(spec, cluster="a100x2_t4x2", stages=[[("t4:0", 8), ("t4:1", 8)]], layers=[24], units_per_layer=16,
                    recompute={"t4:0": ["attn_core"], "t4:1": ["attn_core"]})
    plan = validate(replace(a, pipelines=a.pipelines + b.pipelines, micro_batch_size=1, num_microbatches=4))
    groups = peer_groups(plan)
    rep0 = evaluate(plan, cluster, profiles)
    for d in rep0.devices:
        mine = [g for g in groups if d.id in g.holders and g.size > 1]
        assert len(mine) > 1
        assert d.sync_buffer_bytes == pytest.approx(max(g.num_params for g in mine) * spec.dtype_bytes)
    want0 = sync_schedule_ms([(g.holders, allreduce_ms(g.num_params * spec.dtype_bytes, g.size, cluster.slowest_link(list(g.holders))))
                              for g in groups])
    assert rep0.dp_sync_ms == pytest.approx(want0, rel=1e-12)
    sharded = validate(replace(plan, zero_stage=1))
    rep1 = evaluate(sharded, cluster, profiles)
    ring = [(g.holders, ring_step_ms(max(owned_fractions(sharded, g)) * g.num_params * spec.dtype_bytes, g.size,
                                     cluster.slowest_link(list(g.holders)), "reduce_scatter")) for g in groups]
    assert rep1.dp_sync_ms == pytest.approx(2 * sync_schedule_ms(ring), rel=1e-12)
    assert rep1.dp_sync_ms >= sync_schedule_ms([(h, 2 * t) for h, t in ring]) - 1e-9


def test_ideal_bound_takes_each_replica_at_its_own_micro_batch(gpu_setup):
    """Eq. 12 sums every device's solo throughput at its replica's micro-batch size."""
    from baton.evaluate import ideal_tokens_per_s

    spec, cluster, profiles = gpu_setup
    plan = two_replica_plan(spec, batches=((2, 6), (1, 4)))
    rep = evaluate(plan, cluster, profiles)
    want = ideal_tokens_per_s(spec, ["a100-40gb"] * 2, profiles, 2) + ideal_tokens_per_s(spec, ["t4"] * 2, profiles, 1)
    assert rep.ideal_tokens_per_s == pytest.approx(want, rel=1e-12)
    assert rep.efficiency_vs_ideal == pytest.approx(rep.tokens_per_s / want, rel=1e-12)
