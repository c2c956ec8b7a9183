"""Stages 2 and 3 in the cost model and the evaluator (docs/cost-model.md, eq. 16-18): sharded gradients
and weights over unit groups, every micro-batch in flight, and replicas waiting for each other at every
unit's collective."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from baton.cluster import load_cluster
from baton.costmodel import LayeredParts, layered_iteration_ms, optimizer_bytes, ring_step_ms, unit_pass_ms
from baton.errors import BatonError
from baton.evaluate import evaluate
from baton.model_spec import PRESETS
from baton.peers import EDGES, held_params, owned_fractions, owned_params, peer_groups, position_param_count, unit_groups
from baton.plan import from_dict, simple_plan, validate
from baton.profile import ProfileSet

ROOT = Path(__file__).resolve().parent.parent
SPEC = PRESETS["gpt3-1.3b"]


@pytest.fixture(scope="module")
def setup():
    return load_cluster(ROOT / "clusters" / "a100x2_t4x2.yaml"), ProfileSet(SPEC)


def dp_plan(zero_stage, *, groups=(("a100:0", "a100:1"), ("t4:0", "t4:1")), batches=((2, 6), (1, 4)), ratios=None,
            units=((8, 8), (8, 8))):
    pipes = []
    for ids, bm, us in zip(groups, batches, units):
        p = simple_plan(SPEC, cluster="a100x2_t4x2", stages=[list(zip(ids, us))], layers=[SPEC.num_layers],
                        units_per_layer=sum(us), recompute={i: ["attn_core"] for i in ids})
        stage = p.pipelines[0].stages[0]
        stage = replace(stage, devices=tuple(replace(d, shard_ratio=(ratios or {}).get(d.id)) for d in stage.devices))
        pipes.append(replace(p.pipelines[0], stages=(stage,), micro_batch_size=bm[0], num_microbatches=bm[1]))
    return validate(replace(p, pipelines=tuple(pipes), zero_stage=zero_stage))


def test_unit_groups_cut_every_group_by_unit():
    plan = dp_plan(2, groups=(("a100:0", "a100:1"), ("t4:0",)), units=((12, 4), (16,)), batches=((2, 2), (2, 2)))
    units = unit_groups(plan)
    assert [u for u, _ in units] == [EDGES] + list(range(SPEC.num_layers))
    # Same parameters, same holders: the unit groups partition every peer group's blocks.
    whole = {g.holders: g.num_params for g in peer_groups(plan)}
    cut: dict = {}
    for _, gs in units:
        for g in gs:
            cut[g.holders] = cut.get(g.holders, 0) + g.num_params
            assert {b.layer for b in g.blocks} <= {None} | set(range(SPEC.num_layers))
    assert cut == whole
    # Every layer's groups are alike (one stage per replica holds all layers the same way).
    sizes = {tuple(sorted((g.holders, g.num_params) for g in gs)) for u, gs in units if u is not EDGES}
    assert len(sizes) == 1


def test_pipelines_cannot_shard_gradients():
    p = simple_plan(PRESETS["tiny"], cluster="c", stages=[[("a", 1)], [("b", 1)]], layers=[2, 2], units_per_layer=1)
    data = json.loads(p.to_json())
    data["zero_stage"] = 2
    with pytest.raises(BatonError) as e:
        from_dict(data, source="p.json")
    assert "p.json" in str(e.value) and "pipelines[0].stages" in str(e.value) and "one stage" in str(e.value)
    data["zero_stage"] = 1
    assert from_dict(data).zero_stage == 1


@pytest.mark.parametrize("ratios", [None, {"a100:0": 0.75, "a100:1": 0.75, "t4:0": 0.25, "t4:1": 0.25}])
def test_memory_terms_follow_eq_18(setup, ratios):
    cluster, profiles = setup
    one = evaluate(dp_plan(1, ratios=ratios), cluster, profiles)
    two = evaluate(dp_plan(2, ratios=ratios), cluster, profiles)
    three = evaluate(dp_plan(3, ratios=ratios), cluster, profiles)
    for d1, d2, d3 in zip(one.devices, two.devices, three.devices):
        phi, W = d1.owned_fraction, d1.weights_bytes
        # the same owned share, optimizer state and Adam step at every sharded stage
        assert d2.owned_fraction == d3.owned_fraction == pytest.approx(phi)
        assert d2.optimizer_bytes == d3.optimizer_bytes == pytest.approx(optimizer_bytes(phi * W, SPEC))
        assert d2.optimizer_ms == d3.optimizer_ms == pytest.approx(d1.optimizer_ms)
        # stage 2 keeps every weight; both keep the owned gradient shards plus whole edges and one layer
        assert d2.weights_bytes == pytest.approx(W)
        assert d2.grads_bytes == pytest.approx(d3.grads_bytes)
        assert phi * W < d2.grads_bytes < W
        assert d3.weights_bytes < d2.weights_bytes
        # every micro-batch of the replica in flight (m = 6 or 4), where 1F1B on one stage holds one
        m = 6 if d1.pipeline == 0 else 4
        head = profiles[d1.gpu].cost("head", d1.micro_batch_size, d1.share).saved_bytes  # one micro-batch's head at a time
        assert d2.activation_bytes == pytest.approx(m * (d1.activation_bytes - head) + head)
        assert d2.activation_bytes < m * d1.activation_bytes
        assert d2.peak_memory_bytes == pytest.approx(d2.weights_bytes + d2.grads_bytes + d2.optimizer_bytes + d2.activation_bytes
                                                     + d2.transient_bytes + d2.sync_buffer_bytes + d2.reserve_bytes)


def test_stage_3_weights_are_owned_layers_edges_and_one_layer(setup):
    cluster, profiles = setup
    plan = dp_plan(3, ratios={"a100:0": 0.75, "a100:1": 0.75, "t4:0": 0.25, "t4:1": 0.25})
    rep = evaluate(plan, cluster, profiles)
    e = SPEC.dtype_bytes
    layer_held: dict = {}
    layer_owned: dict = {}
    edge_held: dict = {}
    for unit, gs in unit_groups(plan):
        for g in gs:
            for h, f in zip(g.holders, owned_fractions(plan, g)):
                if unit is EDGES:
                    edge_held[h] = edge_held.get(h, 0) + g.num_params
                else:
                    layer_held[h] = layer_held.get(h, 0) + g.num_params
                    layer_owned[h] = layer_owned.get(h, 0) + f * g.num_params
    held, owned = held_params(plan), owned_params(plan)
    for d in rep.devices:
        one_layer = layer_held[d.id] / SPEC.num_layers
        want_w = (layer_owned[d.id] + edge_held[d.id] + one_layer) * e
        want_g = (owned[d.id] + edge_held[d.id] + max(one_layer - position_param_count(SPEC), 0)) * e
        # the evaluator prices the analytic counts; the pieces are whole parameters: within a part in a million
        assert d.weights_bytes == pytest.approx(want_w, rel=1e-6)
        assert d.grads_bytes == pytest.approx(want_g, rel=1e-6)
        assert d.owned_fraction == pytest.approx(owned[d.id] / held[d.id])
        biggest = max(max(owned_fractions(plan, g)) * g.num_params for _, gs in unit_groups(plan) for g in gs if d.id in g.holders)
        assert d.sync_buffer_bytes == pytest.approx(3 * biggest * e)


def parts(x):
    return LayeredParts(emb_fwd_ms=x[0], layer_fwd_ms=x[1], head_fwd_ms=x[2], head_bwd_ms=x[3], layer_bwd_ms=x[4], emb_bwd_ms=x[5])


def test_lockstep_chain_by_hand():
    a, b = parts((1, 10, 3, 4, 20, 2)), parts((2, 5, 1, 1, 30, 1))
    # stage 2, 2 layers: [emb + 2 fwd + head + bwd1] R1 [bwd0] R0 [emb bwd] Redge [opt] AG(all)
    it = layered_iteration_ms(2, 2, [(1, a), (1, b)], 0.5, [0.25, 0.75], 7.0)
    seg0 = max(1 + 20 + 7 + 20, 2 + 10 + 2 + 30)
    want = seg0 + 0.75 + max(20, 30) + 0.25 + max(2, 1) + 0.5 + 7.0 + (0.5 + 0.25 + 0.75)
    assert it.iteration_ms == pytest.approx(want)
    assert it.collectives_ms == pytest.approx(0.75 + 0.25 + 0.5 + 1.5)
    assert it.replica_compute_ms == (pytest.approx(1 + 20 + 7 + 40 + 2), pytest.approx(2 + 10 + 2 + 60 + 1))
    # stage 3: gathers before every forward and backward, no final all-gather
    it3 = layered_iteration_ms(3, 2, [(2, a), (1, b)], 0.5, [0.25, 0.75], 7.0)
    want3 = (0.5 + max(2, 2) + 0.25 + max(20, 5) + 0.75 + max(20 + 14, 5 + 2) + 0.75 + max(40, 30) + 0.75
             + 0.25 + max(40, 30) + 0.25 + max(4, 1) + 0.5 + 7.0)
    assert it3.iteration_ms == pytest.approx(want3)
    # a replica slower in every part alone sets the pace: its compute plus every collective and the step
    slow = parts((3, 30, 9, 12, 60, 6))
    it4 = layered_iteration_ms(2, 4, [(1, a), (1, slow)], 1.0, [1.0] * 4, 5.0)
    assert it4.iteration_ms == pytest.approx(it4.replica_compute_ms[1] + it4.collectives_ms + 5.0)


def test_replicas_that_differ_per_part_wait_at_every_layer(setup):
    """Each replica is slowest in some segment: the chain is longer than either replica alone plus the syncs
    (the waits the once-per-iteration sync of stages 0 and 1 does not pay)."""
    it = layered_iteration_ms(2, 4, [(1, parts((1, 10, 1, 1, 10, 1))), (1, parts((1, 2, 1, 1, 14, 1)))], 0.0, [0.0] * 4, 0.0)
    alone = max(it.replica_compute_ms)
    assert it.iteration_ms > alone


def test_unit_pass_is_one_padded_ring_pass(setup):
    cluster, _ = setup
    ids = ("a100:0", "t4:0")
    link = cluster.slowest_link(list(ids))
    for kind in ("reduce_scatter", "all_gather"):
        assert unit_pass_ms(cluster, SPEC, [(ids, 1e6)], kind) == pytest.approx(ring_step_ms(1e6 * SPEC.dtype_bytes, 2, link, kind))
    assert unit_pass_ms(cluster, SPEC, [(("a100:0",), 1e6)]) == 0.0


def test_stage_3_pays_three_passes_per_layer_and_stage_2_two(setup):
    cluster, profiles = setup
    plan2, plan3 = dp_plan(2), dp_plan(3)
    r2, r3 = evaluate(plan2, cluster, profiles), evaluate(plan3, cluster, profiles)
    per_unit = {u: unit_pass_ms(cluster, SPEC, [(g.holders, max(owned_fractions(plan2, g)) * g.num_params) for g in gs])
                for u, gs in unit_groups(plan2)}
    total = sum(per_unit.values())
    assert r2.dp_sync_ms == pytest.approx(2 * total)
    assert r3.dp_sync_ms == pytest.approx(3 * total - per_unit[EDGES])
    # the compute is the same; stage 3 saves weights memory for gathers
    assert r2.replica_pipeline_ms == pytest.approx(r3.replica_pipeline_ms)
    assert all(d3.weights_bytes < d2.weights_bytes for d2, d3 in zip(r2.devices, r3.devices))
    assert r2.iteration_time_ms == pytest.approx(r2.pipeline_ms + r2.dp_sync_ms + r2.optimizer_ms)


def test_measured_ring_passes_price_the_sharded_syncs(setup, tmp_path):
    """A link with its own reduce-scatter and all-gather figures (gloo runs the two halves of an all-reduce at
    different speeds): stage 1's sync and stages 2-3's unit passes take them; without them, the all-reduce's."""
    import yaml

    from baton.cluster import load_cluster
    from baton.costmodel import RING_PASSES, group_sync_ms

    data = yaml.safe_load((ROOT / "clusters" / "a100x2_t4x2.yaml").read_text())
    data["inter_node_link"].update(reduce_scatter_bandwidth_gb_per_s=1.0, reduce_scatter_latency_us=100.0,
                                   all_gather_bandwidth_gb_per_s=4.0, all_gather_latency_us=10.0)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    measured, (cluster, profiles) = load_cluster(path), setup
    ids = ["a100:0", "t4:0"]
    link = measured.slowest_link(ids)
    assert link.ring_pass_figures("reduce_scatter") == (1.0, 100.0) and link.ring_pass_figures("all_gather") == (4.0, 10.0)
    shard = 1e8
    want = (shard * SPEC.dtype_bytes / 1e9 * 1e3 + 0.1) + (shard * SPEC.dtype_bytes / 4e9 * 1e3 + 0.01)
    assert group_sync_ms(measured, SPEC, ids, 2 * shard, shard, 1) == pytest.approx(want)
    # the all-reduce (stage 0) does not change; without pass figures the two passes cost it exactly
    assert group_sync_ms(measured, SPEC, ids, 2 * shard, shard, 0) == pytest.approx(group_sync_ms(cluster, SPEC, ids, 2 * shard, shard, 0))
    assert group_sync_ms(cluster, SPEC, ids, 2 * shard, shard, 1) == pytest.approx(group_sync_ms(cluster, SPEC, ids, 2 * shard, shard, 0))
    assert RING_PASSES == ("reduce_scatter", "all_gather")
    # stage 3 gathers twice per layer and reduce-scatters once: a slow reduce-scatter costs once, a slow gather twice
    plan = dp_plan(3, groups=(("a100:0",), ("t4:0",)), units=((16,), (16,)), batches=((2, 2), (2, 2)))
    plan = replace(plan, cluster=measured.name) if measured.name != plan.cluster else plan
    r_meas, r_plain = evaluate(plan, measured, profiles), evaluate(plan, cluster, profiles)
    assert r_meas.dp_sync_ms > r_plain.dp_sync_ms


def test_ring_pass_fit_recovers_the_link_it_was_made_from():
    """``baton profile --comm`` fits a reduce-scatter and an all-gather of X bytes (n chunks of X/n) as
    (n - 1) (latency + X/n / bandwidth): points made from known figures give them back, and the link block
    carries them to ``Link.ring_pass_figures``."""
    from baton.cluster import Link
    from runtime.measure.comm_profiler import link_fit

    n, sizes = 4, [2**k for k in range(16, 25, 2)]

    def ring_pass(bw, lat):
        return [[x, (n - 1) * (lat * 1e-3 + x / n / (bw * 1e9) * 1e3)] for x in sizes]

    points = {"p2p": [[x, 0.05 + x / 5e9 * 1e3] for x in sizes],
              "allreduce": [[x, 2 * (n - 1) * (0.1 + x / n / 2e9 * 1e3)] for x in sizes],
              "reduce_scatter": ring_pass(0.5, 400.0), "all_gather": ring_pass(1.5, 150.0)}
    fit = link_fit("gloo", n, points)
    assert fit.reduce_scatter_bandwidth_gb_per_s == pytest.approx(0.5, rel=1e-6)
    assert fit.reduce_scatter_latency_us == pytest.approx(400.0, rel=1e-6)
    assert fit.all_gather_bandwidth_gb_per_s == pytest.approx(1.5, rel=1e-6)
    assert fit.all_gather_latency_us == pytest.approx(150.0, rel=1e-6)
    link = Link(**fit.link_fields())
    assert link.ring_pass_figures("reduce_scatter") == pytest.approx((0.5, 400.0), rel=1e-4)
    assert link.ring_pass_figures("all_gather") == pytest.approx((1.5, 150.0), rel=1e-4)
    # without pass figures (an older link block), the passes take the all-reduce's
    del points["reduce_scatter"], points["all_gather"]
    plain = Link(**link_fit("gloo", n, points).link_fields())
    assert plain.ring_pass_figures("reduce_scatter") == (plain.collective_bandwidth_gb_per_s, plain.collective_latency_us)
