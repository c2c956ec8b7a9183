"""Offloaded activations in the cost model (docs/cost-model.md, section 4o): the plan field, eq. 2o-4o and 8o as
the evaluator applies them, checked against figures computed here from the tensor sizes and the host link."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from baton.cluster import from_mapping, load_cluster
from baton.costmodel import layer_cost, layer_tensor_bytes
from baton.errors import BatonError
from baton.evaluate import evaluate, explain_over_capacity
from baton.memory import tensor_blocks
from baton.model_spec import PRESETS
from baton.operators import operator_names
from baton.plan import from_dict, simple_plan
from baton.profile import ProfileSet

ROOT = Path(__file__).resolve().parent.parent
SPEC = PRESETS["gpt3-1.3b"]
ALL = tuple(operator_names(SPEC))
BOUNDARY = ("layer_input", "attn_out", "x_mid", "mlp_out")
"""What every operator recomputed leaves held: Cephalo's layer-boundary checkpoint, all of it offloadable."""


def _cluster(**t4_node):
    """a100x2_t4x2 with extra fields on the T4 node."""
    data = yaml.safe_load((ROOT / "clusters" / "a100x2_t4x2.yaml").read_text())
    for node in data["nodes"]:
        if any(g["type"] == "t4" for g in node["gpus"]):
            node.update(t4_node)
    return from_mapping(data, source="a100x2_t4x2.yaml")


def _plan(offload=(), recompute=ALL, m=8):
    return simple_plan(SPEC, cluster="a100x2_t4x2", stages=[[("a100:0", 1)], [("t4:0", 1)]], layers=[16, 8],
                       units_per_layer=1, num_microbatches=m,
                       recompute={"a100:0": [], "t4:0": list(recompute)})


def _with_offload(plan, device: str, offload):
    data = plan.to_dict()
    for pipe in data["pipelines"]:
        for st in pipe["stages"]:
            for d in st["devices"]:
                if d["id"] == device:
                    d["offload"] = list(offload)
    return from_dict(json.loads(json.dumps(data)), source="plan.json")


@pytest.fixture(scope="module")
def profiles():
    return ProfileSet(SPEC)


def test_offloaded_tensors_leave_the_device_for_the_host_and_come_back_as_a_buffer(profiles):
    """Eq. 3o, 4o and 8o term by term: the T4 (last stage, 1 micro-batch in flight of its 8 layers) keeps the layer
    boundary in host memory."""
    cluster = _cluster()
    base = evaluate(_plan(), cluster, profiles)
    off = evaluate(_with_offload(_plan(), "t4:0", BOUNDARY), cluster, profiles)
    sizes = layer_tensor_bytes(profiles["t4"], SPEC, 1, 1.0)
    h = sum(sizes[t] for t in BOUNDARY)
    b, o = base.devices[1], off.devices[1]
    in_flight = 1  # the last of two stages under 1F1B
    assert o.host_activation_bytes == pytest.approx(in_flight * 8 * h, rel=1e-12)
    assert b.activation_bytes - o.activation_bytes == pytest.approx(in_flight * 8 * h, rel=1e-12)
    assert o.transient_bytes - b.transient_bytes == pytest.approx(2 * h, rel=1e-12)
    assert o.offload == list(BOUNDARY) and off.devices[0].host_activation_bytes == 0.0
    assert [(x.node, x.activation_bytes, x.capacity_bytes) for x in off.host_memory] == [("t4", o.host_activation_bytes, None)]
    # Under every operator recomputed the held tensors are exactly the boundary: nothing is left on the device.
    assert layer_cost(profiles["t4"], SPEC, 1, 1.0, frozenset(ALL), frozenset(BOUNDARY), 12.0).held_bytes == pytest.approx(0.0, abs=1e-6)


def test_copies_that_fit_beside_the_compute_cost_nothing(profiles):
    """PCIe 3 (12 GB/s) moves a micro-batch's boundary of a GPT-3 1.3B layer (4 x 8 MiB) in under 3 ms, while the T4
    computes the layer for far longer: the iteration time is the plan's without offload."""
    cluster = _cluster()
    base = evaluate(_plan(), cluster, profiles)
    off = evaluate(_with_offload(_plan(), "t4:0", BOUNDARY), cluster, profiles)
    assert cluster.device("t4:0").host_link_gb_per_s == 12.0 and cluster.device("a100:0").host_link_gb_per_s == 24.0
    assert off.devices[1].offload_ms == 0.0
    assert off.iteration_time_ms == pytest.approx(base.iteration_time_ms, rel=1e-12)


def test_a_slow_host_link_exposes_what_the_block_does_not_hide(profiles):
    """Eq. 2o per block: with the T4 node's host link overridden to 0.01 GB/s the copies take longer than the blocks,
    and each pass of each block costs its copy time instead of its compute."""
    cluster = _cluster(host_link_gb_per_s=0.01)
    lc = layer_cost(profiles["t4"], SPEC, 1, 1.0, frozenset(ALL), frozenset(BOUNDARY), 0.01)
    plain = layer_cost(profiles["t4"], SPEC, 1, 1.0, frozenset(ALL))
    sizes, blocks = layer_tensor_bytes(profiles["t4"], SPEC, 1, 1.0), tensor_blocks(SPEC)
    for k, (f, b) in enumerate(zip(plain.block_fwd_ms(), plain.block_bwd_ms())):
        copy = sum(sizes[t] for t in BOUNDARY if blocks[t] == ("attn", "mlp")[k]) / 0.01e9 * 1e3
        assert copy > max(f, b)
        assert lc.block_fwd_ms()[k] == pytest.approx(copy, rel=1e-12)
        assert lc.block_bwd_ms()[k] == pytest.approx(copy, rel=1e-12)
    base = evaluate(_plan(), cluster, profiles)
    off = evaluate(_with_offload(_plan(), "t4:0", BOUNDARY), cluster, profiles)
    assert off.stages[1].fwd_ms - base.stages[1].fwd_ms == pytest.approx(
        8 * sum(a - b for a, b in zip(lc.block_fwd_ms(), plain.block_fwd_ms())), rel=1e-9)
    assert off.iteration_time_ms > base.iteration_time_ms


def test_a_cpu_process_pays_for_its_copies_in_full():
    """On a ``Profile.SYNCHRONOUS`` device the copies are the process's own work: they add, however short."""
    spec = PRESETS["small"] if "small" in PRESETS else PRESETS["gpt3-125m"]
    prof = ProfileSet(spec)["cpu"]
    ops = tuple(operator_names(spec))
    plain = layer_cost(prof, spec, 1, 1.0, frozenset(ops))
    lc = layer_cost(prof, spec, 1, 1.0, frozenset(ops), frozenset(BOUNDARY), 5.0)
    sizes, blocks = layer_tensor_bytes(prof, spec, 1, 1.0), tensor_blocks(spec)
    for k, block in enumerate(("attn", "mlp")):
        copy = sum(sizes[t] for t in BOUNDARY if blocks[t] == block) / 5.0e9 * 1e3
        assert lc.block_fwd_ms()[k] - plain.block_fwd_ms()[k] == pytest.approx(copy, rel=1e-12)
        assert lc.block_bwd_ms()[k] - plain.block_bwd_ms()[k] == pytest.approx(copy, rel=1e-12)


def test_host_memory_is_a_capacity_per_node(profiles):
    """Eq. 8o: a node's ``host_memory_gib`` below what its devices offload makes the plan not fit, in one line
    naming the node."""
    plan = _with_offload(_plan(), "t4:0", BOUNDARY)
    need = evaluate(plan, _cluster(), profiles).host_memory[0].activation_bytes
    roomy = evaluate(plan, _cluster(host_memory_gib=need / 2**30 * 1.01), profiles)
    tight = evaluate(plan, _cluster(host_memory_gib=need / 2**30 * 0.99), profiles)
    assert roomy.fits and roomy.host_memory[0].fits
    assert not tight.fits and all(d.fits for d in tight.devices)
    assert "node t4's host memory holds" in explain_over_capacity(tight)


def test_the_plan_field_round_trips_and_is_checked():
    plan = _with_offload(_plan(), "t4:0", BOUNDARY)
    again = from_dict(json.loads(plan.to_json()), source="p.json")
    assert again == plan and again.pipelines[0].stages[1].devices[0].offload == BOUNDARY
    assert "offload" not in json.dumps(_plan().to_dict())  # written only where used
    for offload, recompute, words in [
        (["qkv_out"], ALL, "offloads unknown tensors qkv_out"),
        (["gelu_out"], ALL, "offloads gelu_out not held"),  # recomputed inside its segment
        (["q"], (), "offloads q but not all of q, k, v"),  # fused attention: one qkv storage
        (["layer_input", "layer_input"], ALL, "names a tensor more than once"),
    ]:
        with pytest.raises(BatonError) as err:
            _with_offload(_plan(recompute=recompute), "t4:0", offload)
        assert err.value.field == "pipelines[0].stages[1].devices[0].offload" and words in err.value.message, err.value.message


def test_cluster_fields_of_the_host():
    cluster = _cluster(host_memory_gib=64, host_link_gb_per_s=20)
    assert cluster.host_memory == {"t4": 64 * 2**30}
    assert cluster.device("t4:1").host_link_gb_per_s == 20.0 and cluster.device("a100:1").host_link_gb_per_s == 24.0
    assert load_cluster(ROOT / "clusters" / "a100x2_t4x2.yaml").host_memory == {}
    with pytest.raises(BatonError) as err:
        _cluster(host_memory_gib=-1)
    assert "host_memory_gib" in str(err.value)
