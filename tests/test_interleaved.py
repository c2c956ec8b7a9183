"""Interleaved 1F1B in the plan format and the evaluator (docs/schedules.md): virtual stages in model order, stage k
on the group of stage k mod p, priced from ``baton.schedules.interleaved_one_f_one_b``."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from baton.cluster import load_cluster
from baton.costmodel import edge_cost, device_slot, layer_cost, pipeline_transfers
from baton.errors import BatonError
from baton.evaluate import evaluate
from baton.model_spec import PRESETS
from baton.pipeline import PipelineTiming, iteration_time
from baton.plan import FORMAT, INTERLEAVED_FORMAT, from_dict, interleaved_pipeline, simple_plan, validate
from baton.profile import ProfileSet
from baton.schedules import interleaved_one_f_one_b, peak_in_flight

SPEC = PRESETS["gpt3-1.3b"]


@pytest.fixture(scope="module")
def priced():
    """(clusters/a100x2_t4x2.yaml, GPT-3 1.3B's shipped tables)."""
    return load_cluster(Path(__file__).resolve().parent.parent / "clusters" / "a100x2_t4x2.yaml"), ProfileSet(SPEC)


def _one_f_one_b(m: int, layers=(20, 4)):
    return simple_plan(SPEC, cluster="a100x2_t4x2", stages=[[("a100:0", 1)], [("t4:0", 1)]], layers=list(layers),
                       units_per_layer=1, num_microbatches=m)


def _interleaved(m: int, layers=(10, 2, 10, 2)):
    """The same two devices, their layers cut into two chunks each: A100 0-9, T4 10-11, A100 12-21, T4 22-23."""
    flat = _one_f_one_b(m)
    return validate(replace(flat, pipelines=(interleaved_pipeline(flat.pipelines[0], layers),)))


def test_plan_format_round_trip():
    """Catches an interleaved plan read back as a 1F1B pipeline of p v stages (an old reader would), or a 1F1B plan
    whose file changed."""
    plan = _interleaved(4)
    data = plan.to_dict()
    assert data["format"] == INTERLEAVED_FORMAT and data["pipelines"][0]["chunks"] == 2
    assert "devices" not in data["pipelines"][0]["stages"][2]  # the later virtual stages name no devices
    assert from_dict(data) == plan
    assert plan.device_ids() == ["a100:0", "t4:0"]
    assert _one_f_one_b(4).to_dict()["format"] == FORMAT and "chunks" not in _one_f_one_b(4).to_dict()["pipelines"][0]


def test_plan_validation_of_chunks():
    data = _interleaved(4).to_dict()
    bad = {**data, "pipelines": [{**data["pipelines"][0], "stages": data["pipelines"][0]["stages"][:3]}]}
    with pytest.raises(BatonError, match="multiple of 2 virtual stages"):
        from_dict(bad)
    other = [dict(s) for s in data["pipelines"][0]["stages"]]
    other[2] = {**other[1], "first_layer": other[2]["first_layer"], "num_layers": other[2]["num_layers"]}  # the T4's group
    with pytest.raises(BatonError, match="runs on the group of stage 0"):
        from_dict({**data, "pipelines": [{**data["pipelines"][0], "stages": other}]})


def test_evaluator_prices_the_interleaved_schedule(priced):
    """Every virtual stage is eq. 9 over its own layers on its group (the embedding on the first, the head on the last),
    the boundary from the last group back to the first is eq. 6 between them, the replica's time is the interleaved
    schedule's longest path, and each device holds what its list keeps alive at its peak. Catches the evaluator pricing
    an interleaved plan as the 1F1B pipeline of its virtual stages, or counting a device's memory once per chunk."""
    (cluster, profiles), plan, flat = priced, _interleaved(4), _one_f_one_b(4, layers=(20, 4))
    rep, ref = evaluate(plan, cluster, profiles), evaluate(flat, cluster, profiles)
    assert [s.num_layers for s in rep.stages] == [10, 2, 10, 2] and [d.id for d in rep.devices] == ["a100:0", "t4:0"]
    back = pipeline_transfers(cluster, SPEC, 1, ["t4:0"], ["a100:0"])
    assert (rep.stages[1].send_fwd_ms, rep.stages[1].send_bwd_ms) == pytest.approx(back)
    a100, t4 = (layer_cost(profiles[g], SPEC, 1, 1.0) for g in ("a100-40gb", "t4"))
    assert rep.stages[2].fwd_ms == pytest.approx(10 * sum(a100.fwd_ms.values()), rel=1e-12)  # no edge on a middle chunk
    assert sum(s.fwd_ms for s in rep.stages) == pytest.approx(sum(s.fwd_ms for s in ref.stages), rel=1e-12)
    timing = PipelineTiming(fwd_ms=tuple(s.fwd_ms for s in rep.stages), bwd_ms=tuple(s.bwd_ms for s in rep.stages),
                            send_fwd_ms=tuple(s.send_fwd_ms for s in rep.stages[:-1]),
                            send_bwd_ms=tuple(s.send_bwd_ms for s in rep.stages[:-1]))
    sch = interleaved_one_f_one_b(2, 2, 4)
    assert rep.pipeline_ms == pytest.approx(iteration_time(sch, timing), rel=1e-12)
    for dev, flat_dev, lc, (k0, k1) in zip(rep.devices, ref.devices, (a100, t4), ((0, 2), (1, 3))):
        assert dev.weights_bytes == flat_dev.weights_bytes and dev.fwd_ms == pytest.approx(flat_dev.fwd_ms)
        slot = device_slot(cluster, profiles, SPEC, 1, dev.id, stage=k0, num_stages=2, num_microbatches=4)
        edge = edge_cost(slot, SPEC, 1, 1.0)
        held = {k0: 10 * lc.held_bytes if k0 == 0 else 2 * lc.held_bytes, k1: 10 * lc.held_bytes if k1 == 2 else 2 * lc.held_bytes}
        extra = {0: edge.saved_bytes, 3: edge.head_saved_bytes}
        assert dev.activation_bytes == pytest.approx(peak_in_flight(sch, k0, lambda k: held[k] + extra.get(k, 0.0)))


def test_interleaving_shortens_a_pipeline_whose_bubble_dominates(priced):
    """Two micro-batches over an A100 (20 layers) and a T4 (4): 1F1B idles for a third of the step. Cut into uneven
    chunks (A100 1 + 19 layers, T4 3 + 1) the devices' same layers fill the bubble at the price of four transfers per
    micro-batch instead of two: 529.0 ms -> 432.5 ms under the cost model (docs/schedules.md)."""
    one = evaluate(_one_f_one_b(2, layers=(20, 4)), *priced).pipeline_ms
    two = evaluate(_interleaved(2, (1, 3, 19, 1)), *priced).pipeline_ms
    assert one == pytest.approx(529.0, abs=0.1) and two == pytest.approx(432.5, abs=0.1)


def _tiny_interleaved(layers, m: int, stages=(("local:0",), ("local:1",))):
    """A tiny GPT on clusters/cpu4.yaml's processes: ``layers`` per virtual stage, group k mod p."""
    from tests.runtime_helpers import tiny

    spec = tiny(0.1)
    groups = [[(d, 1) for d in ids] for ids in stages]
    p = len(groups)
    flat = simple_plan(spec, cluster="cpu4", stages=groups, layers=[sum(layers[g::p]) for g in range(p)],
                       units_per_layer=[len(g) for g in groups], micro_batch_size=2, num_microbatches=m)
    return validate(replace(flat, pipelines=(interleaved_pipeline(flat.pipelines[0], layers),)))


@pytest.mark.parametrize("layers,m,stages", [
    pytest.param((1, 1, 1, 1), 3, (("local:0",), ("local:1",)), marks=pytest.mark.long),  # the TP pair's case runs by default
    ((0, 3, 1, 0), 2, (("local:0", "local:1"), ("local:2",))),
])
def test_interleaved_runs_as_one_device_and_holds_the_predicted_activations(layers, m, stages):
    """The interpreter runs the interleaved lists over real processes: loss and every gradient after one step and the
    losses of three AdamW steps equal the single-device model's (1e-5 relative), and each rank's peak of saved
    activations is the evaluator's (``scheduled_activation_bytes``). The cases: two devices, four chunks of one layer
    and three micro-batches (not a multiple of the two devices: one round of three); a TP pair and a single device
    with uneven chunks (the pair: the embedding alone, then one layer; the single device: three layers, then the
    head alone), the two groups' chunks talking back and forth over the same pairs of ranks.

    Catches: a chunk run on the wrong device or with the wrong layers, the activation of the last group not sent
    back to the first (or a gradient not sent the other way), activations and gradients from one peer taken for each
    other (their tags), the embedding or head run on a middle chunk, and the in-flight count of 1F1B used for an
    interleaved device."""
    from baton.cluster import load_cluster
    from runtime.launch.devices import prediction_profiles
    from tests.conftest import ROOT
    from tests.runtime_helpers import assert_parity

    plan = _tiny_interleaved(layers, m, stages)
    results = assert_parity(plan)
    cluster = load_cluster(ROOT / "clusters" / "cpu4.yaml")
    pred = {d.id: d for d in evaluate(plan, cluster, prediction_profiles(plan, cluster, None)).devices}
    for res in results:
        dev = plan.device_ids()[res["position"].rank]
        assert res["stats"].peak_saved_bytes == pytest.approx(pred[dev].activation_bytes, rel=1e-9), dev


@pytest.mark.parametrize("p,v,m", [(2, 2, 1), (2, 2, 5), (3, 2, 4), (2, 3, 2), (4, 2, 8)])
def test_memory_rows_are_the_evaluators_peak(priced, p, v, m):
    """``interleaved_memory_rows`` (what the planner's eq. 8i constraints read): for every layer split tried, the
    largest line equals the evaluator's peak of that device bit for bit up to summation order, and every line's
    moment is undominated (``live_counts``). Catches a line that misses a moment, counts the edges' activations on
    the wrong virtual stage, or a slope that is not the evaluator's."""
    import itertools

    from baton.costmodel import device_memory, interleaved_memory_rows, scheduled_activation_bytes
    from baton.schedules import live_counts

    cluster, profiles = priced
    sch = interleaved_one_f_one_b(p, v, m)
    K = p * v
    for g in range(p):
        counts = live_counts(sch, g)
        assert all(not any(o != n and all(x >= y for x, y in zip(o, n)) for o in counts) for n in counts)
        slot = device_slot(cluster, profiles, SPEC, 1, "a100:0", stage=g, num_stages=p, num_microbatches=m)
        lc, edge = layer_cost(slot.profile, SPEC, 1, 1.0, frozenset()), edge_cost(slot, SPEC, 1, 1.0)
        rows = interleaved_memory_rows(slot, SPEC, sch, g, param_bytes=lc.param_bytes, held_bytes=lc.held_bytes,
                                       transient_bytes=lc.transient_bytes, edge=edge)
        for layers in itertools.islice(itertools.product(range(1, 4), repeat=K), 0, None, 7):
            mine = [layers[c * p + g] for c in range(v)]
            acts = scheduled_activation_bytes(sch, g, layers, lc.held_bytes, edge)
            peak = device_memory(slot, SPEC, sum(mine), param_bytes=lc.param_bytes, held_bytes=lc.held_bytes,
                                 transient_bytes=lc.transient_bytes, edge=edge, activation_bytes=acts).peak_bytes
            line = max(r.fixed_bytes + sum(a * L for a, L in zip(r.per_layer_bytes, mine)) for r in rows)
            assert line == pytest.approx(peak, rel=1e-12)


def test_live_counts_of_one_f_one_b_are_the_in_flight_count():
    from baton.schedules import live_counts, one_f_one_b

    for p, m in ((1, 3), (3, 2), (4, 8)):
        assert [live_counts(one_f_one_b(p, m), s) for s in range(p)] == [[(min(p - s, m),)] for s in range(p)]
