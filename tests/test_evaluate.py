"""The evaluator on hand-built plans for a100x2_t4x2 x GPT-3 1.3B, checked against figures computed here
from the profile tables and the cost-model equations, one term at a time."""
from __future__ import annotations

from pathlib import Path

import pytest

from baton.cluster import load_cluster
from baton.costmodel import activation_bytes, allreduce_ms, layer_cost
from baton.evaluate import evaluate, ideal_tokens_per_s
from baton.profile import ProfileSet
from baton.model_spec import PRESETS
from baton.operators import padded_vocab, EMBEDDING, HEAD
from baton.pipeline import PipelineTiming, iteration_time_1f1b
from baton.plan import simple_plan

SPEC = PRESETS["gpt3-1.3b"].with_overrides(attention="eager")  # the tests name eager operators
ATTN = ["attn_scores", "softmax", "attn_dropout", "attn_v"]


@pytest.fixture(scope="module")
def cluster():
    return load_cluster(Path(__file__).resolve().parent.parent / "clusters" / "a100x2_t4x2.yaml")


@pytest.fixture(scope="module")
def profiles():
    return ProfileSet(SPEC)


def two_stage_plan(a100_units=(8, 8), t4_units=(8, 8), layers=(16, 8), m=16, t4_recompute=()):
    return simple_plan(SPEC, cluster="a100x2_t4x2",
                       stages=[[("a100:0", a100_units[0]), ("a100:1", a100_units[1])], [("t4:0", t4_units[0]), ("t4:1", t4_units[1])]],
                       layers=list(layers), units_per_layer=16, num_microbatches=m,
                       recompute={"t4:0": list(t4_recompute), "t4:1": list(t4_recompute)})


def test_stage_times_follow_the_equations(cluster, profiles):
    plan = two_stage_plan(t4_recompute=ATTN)
    rep = evaluate(plan, cluster, profiles)
    a100, t4 = profiles["a100-40gb"], profiles["t4"]
    act = activation_bytes(SPEC, 1)
    ar_a = allreduce_ms(act, 2, cluster.link("a100:0", "a100:1"))
    lc = layer_cost(a100, SPEC, 1, 0.5)
    # The embedding's vocabulary is split like the units (share 0.5), then summed by one all-reduce.
    f0 = 16 * (sum(lc.fwd_ms.values()) + 2 * ar_a) + a100.cost(EMBEDDING, 1, 0.5).fwd_ms + ar_a
    assert rep.stages[0].fwd_ms == pytest.approx(f0, rel=1e-12)
    lt = layer_cost(t4, SPEC, 1, 0.5, frozenset(ATTN))
    ar_t = allreduce_ms(act, 2, cluster.link("t4:0", "t4:1"))
    # The head's input gradient is a partial sum over vocabulary shares: one all-reduce in the backward.
    b1 = 8 * (sum(lt.bwd_ms.values()) + sum(lt.recompute_ms.values()) + 2 * ar_t) + t4.cost(HEAD, 1, 0.5).bwd_ms + ar_t
    assert rep.stages[1].bwd_ms == pytest.approx(b1, rel=1e-12)
    # 25 GbE between the nodes: the activation of one micro-batch (8 MiB) takes 3 ms.
    link = cluster.link("a100:0", "t4:0")
    assert rep.stages[0].send_fwd_ms == pytest.approx(link.transfer_ms(act) * 1)  # one receiver per sender
    timing = PipelineTiming(fwd_ms=tuple(s.fwd_ms for s in rep.stages), bwd_ms=tuple(s.bwd_ms for s in rep.stages),
                            send_fwd_ms=(rep.stages[0].send_fwd_ms,), send_bwd_ms=(rep.stages[0].send_bwd_ms,))
    assert rep.pipeline_ms == pytest.approx(iteration_time_1f1b(timing, 16))
    assert rep.iteration_time_ms == pytest.approx(rep.pipeline_ms + rep.embedding_sync_ms + rep.optimizer_ms)
    tied = padded_vocab(SPEC) * SPEC.hidden_dim * 2
    assert rep.embedding_sync_ms == pytest.approx(allreduce_ms(tied, 4, cluster.slowest_link(["a100:0", "a100:1", "t4:0", "t4:1"])))


def test_the_tied_sync_is_every_replica_of_more_than_one_stage(cluster):
    """Eq. 11's T_emb is the slowest tied all-reduce over the replicas of more than one stage: a replica of one stage
    holds one copy and joins no such group (``runtime.parallel.topology.tied_rank_lists``), whichever replica comes
    first in the plan. Fails if the first replica's stage count decides for all of them (it did: a plan whose first
    replica had one stage was charged nothing, and one stage was charged an all-reduce with itself)."""
    from baton.costmodel import embedding_sync_ms

    tied = padded_vocab(SPEC) * SPEC.hidden_dim * 2
    two = [["a100:1"], ["t4:0", "t4:1"]]
    alone = [["a100:0"]]
    expected = allreduce_ms(tied, 3, cluster.slowest_link(["a100:1", "t4:0", "t4:1"]))
    assert embedding_sync_ms(cluster, SPEC, [alone, two]) == pytest.approx(expected, rel=1e-12)
    assert embedding_sync_ms(cluster, SPEC, [two, alone]) == pytest.approx(expected, rel=1e-12)
    assert embedding_sync_ms(cluster, SPEC, [alone, [["a100:1"]]]) == 0.0


def test_recomputation_trades_time_for_memory_on_the_t4s(cluster, profiles):
    plain = evaluate(two_stage_plan(), cluster, profiles)
    rec = evaluate(two_stage_plan(t4_recompute=ATTN), cluster, profiles)
    t4p = next(d for d in plain.devices if d.id == "t4:0")
    t4r = next(d for d in rec.devices if d.id == "t4:0")
    assert t4r.activation_bytes < t4p.activation_bytes
    assert t4r.recompute_ms > 0 and t4p.recompute_ms == 0
    assert rec.stages[1].bwd_ms > plain.stages[1].bwd_ms
    assert next(d for d in rec.devices if d.id == "a100:0") == next(d for d in plain.devices if d.id == "a100:0")


def test_uneven_units_shift_work_and_memory(cluster, profiles):
    even = evaluate(two_stage_plan(a100_units=(8, 8)), cluster, profiles)
    skew = evaluate(two_stage_plan(a100_units=(12, 4)), cluster, profiles)
    d0, d1 = (next(d for d in skew.devices if d.id == i) for i in ("a100:0", "a100:1"))
    assert d0.weights_bytes > d1.weights_bytes and d0.fwd_ms > d1.fwd_ms
    # The group waits for its slowest rank, so a skewed split of identical GPUs is slower.
    assert skew.stages[0].fwd_ms > even.stages[0].fwd_ms


def test_memory_is_flagged_when_over_capacity(cluster, profiles):
    """All 24 layers on the T4 pair with 64 micro-batches in flight cannot fit in 16 GiB."""
    plan = simple_plan(SPEC, cluster="a100x2_t4x2", stages=[[("t4:0", 8), ("t4:1", 8)], [("a100:0", 8), ("a100:1", 8)]],
                       layers=[24, 0], units_per_layer=16, num_microbatches=8)
    rep = evaluate(plan, cluster, profiles)
    assert not rep.fits
    assert {d.id for d in rep.over_capacity()} == {"t4:0", "t4:1"}


def test_throughput_mfu_and_ideal_bound(cluster, profiles):
    rep = evaluate(two_stage_plan(), cluster, profiles)
    assert rep.tokens_per_s == pytest.approx(16 * 2048 / (rep.iteration_time_ms / 1e3))
    assert 0 < rep.mfu < 1
    ideal = ideal_tokens_per_s(SPEC, ["a100-40gb"] * 2 + ["t4"] * 2, profiles, 1)
    assert rep.ideal_tokens_per_s == pytest.approx(ideal)
    assert 0 < rep.efficiency_vs_ideal < 1


def test_data_parallel_replicas_add_gradient_sync(cluster, profiles):
    from baton.plan import DeviceShare, Pipeline, Plan, Stage, validate

    def pipe(a, t):
        return Pipeline(stages=(Stage(first_layer=0, num_layers=16, units_per_layer=1, devices=(DeviceShare(id=a, units=1),)),
                                Stage(first_layer=16, num_layers=8, units_per_layer=1, devices=(DeviceShare(id=t, units=1, recompute=tuple(ATTN)),))))
    plan = validate(Plan(model=SPEC, cluster="a100x2_t4x2", micro_batch_size=1, num_microbatches=8,
                         pipelines=(pipe("a100:0", "t4:0"), pipe("a100:1", "t4:1"))))
    rep = evaluate(plan, cluster, profiles)
    assert rep.global_batch == 16 and rep.dp_sync_ms > 0
    assert rep.iteration_time_ms == pytest.approx(rep.pipeline_ms + rep.embedding_sync_ms + rep.dp_sync_ms + rep.optimizer_ms)
