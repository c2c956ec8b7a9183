"""Model, cluster and catalog specs: presets, YAML parsing and validation errors."""
from __future__ import annotations

import pytest

from baton.catalog import CATALOG, GIB, gpu_type
from baton.cluster import from_mapping as cluster_from_mapping, load_cluster
from baton.costmodel import allreduce_ms, tp_allreduce_ms
from baton.errors import BatonError
from baton.model_spec import PRESETS, from_mapping as model_from_mapping

REQUIRED_GPUS = ["a100-40gb", "a100-80gb", "h100", "h200", "v100-16gb", "v100-32gb", "t4", "l4", "a10g", "a6000",
                 "p100", "p40", "rtx3090", "rtx4090", "cpu"]


def test_catalog_has_required_gpus_with_positive_figures():
    for name in REQUIRED_GPUS:
        g = CATALOG[name]
        assert g.memory_bytes > 0 and g.peak_fp16_tflops > 0 and g.peak_fp32_tflops > 0 and g.memory_bandwidth_gb_per_s > 0
    assert CATALOG["a100-40gb"].memory_bytes == 40 * GIB
    assert CATALOG["h100"].peak_bf16_tflops > CATALOG["a100-80gb"].peak_bf16_tflops > CATALOG["t4"].peak_fp16_tflops


def test_gpu_lookup_is_case_insensitive_and_knows_aliases():
    assert gpu_type("T4").name == "t4"
    assert gpu_type("A100").name == "a100-40gb"


def test_unknown_gpu_names_the_field():
    with pytest.raises(BatonError, match="unknown GPU type 'b200'"):
        gpu_type("b200", source="c.yaml", field="nodes[0].gpus[0].type")


def test_bf16_rejected_on_gpus_without_it():
    with pytest.raises(BatonError, match="no bf16"):
        CATALOG["t4"].peak_tflops("bf16")


@pytest.mark.parametrize("name,params_b", [("gpt3-125m", 0.125), ("gpt3-350m", 0.35), ("gpt3-1.3b", 1.3),
                                           ("gpt3-2.7b", 2.7), ("gpt3-6.7b", 6.7), ("gpt3-13b", 13.0)])
def test_gpt3_presets_have_their_nominal_size(name, params_b):
    """Catches a wrong width/depth in a preset: parameter counts must be within 10% of the name."""
    assert PRESETS[name].num_params() / 1e9 == pytest.approx(params_b, rel=0.1)


def test_gpt3_1_3b_is_megatrons_configuration():
    m = PRESETS["gpt3-1.3b"]
    assert (m.num_layers, m.hidden_dim, m.num_heads, m.seq_len) == (24, 2048, 16, 2048)


def test_model_yaml_with_base_preset_overrides_fields():
    m = model_from_mapping({"base": "gpt3-1.3b", "num_layers": 12, "name": "half"}, source="m.yaml")
    assert m.num_layers == 12 and m.hidden_dim == 2048 and m.name == "half"


@pytest.mark.parametrize("data,field", [
    ({"num_layers": 0, "hidden_dim": 64, "num_heads": 4, "seq_len": 8, "vocab_size": 16}, "num_layers"),
    ({"num_layers": 2, "hidden_dim": -64, "num_heads": 4, "seq_len": 8, "vocab_size": 16}, "hidden_dim"),
    ({"num_layers": 2, "hidden_dim": 64, "num_heads": 5, "seq_len": 8, "vocab_size": 16}, "num_heads"),
    ({"num_layers": 2, "hidden_dim": 64, "num_heads": 4, "vocab_size": 16}, "seq_len"),
    ({"num_layers": 2, "hidden_dim": 64, "num_heads": 4, "seq_len": 8, "vocab_size": 16, "dtype": "fp8"}, "dtype"),
    ({"num_layers": 2, "hidden_dim": 64, "num_heads": 4, "seq_len": 8, "vocab_size": 16, "hiden": 3}, "hiden"),
])
def test_bad_model_fields_name_file_and_field(data, field):
    with pytest.raises(BatonError) as exc:
        model_from_mapping(data, source="m.yaml")
    assert "m.yaml" in str(exc.value) and f"'{field}'" in str(exc.value)


def test_shipped_reference_cluster(cluster_path):
    c = load_cluster(cluster_path)
    assert [d.gpu.name for d in c.devices] == ["a100-40gb", "a100-40gb", "t4", "t4"]
    assert c.link("a100:0", "a100:1").bandwidth_gb_per_s > c.link("t4:0", "t4:1").bandwidth_gb_per_s > c.link("a100:0", "t4:0").bandwidth_gb_per_s
    assert all(d.reserve_bytes == GIB for d in c.devices)


def test_every_shipped_cluster_loads(root):
    paths = sorted((root / "clusters").glob("*.yaml"))
    assert len(paths) >= 8
    for p in paths:
        c = load_cluster(p)
        assert c.devices and len({d.id for d in c.devices}) == len(c.devices)


def test_cluster_node_count_expands_into_named_nodes():
    c = cluster_from_mapping({
        "nodes": [{"name": "g", "count": 3, "gpus": [{"type": "t4", "count": 2}], "intra_node_link": {"bandwidth_gb_per_s": 10}}],
        "inter_node_link": {"bandwidth_gb_per_s": 1, "latency_us": 10},
    }, source="c.yaml")
    assert [d.id for d in c.devices] == ["g-0:0", "g-0:1", "g-1:0", "g-1:1", "g-2:0", "g-2:1"]
    assert c.link("g-0:0", "g-2:1").bandwidth_gb_per_s == 1


@pytest.mark.parametrize("data,field", [
    ({"nodes": [{"gpus": [{"type": "b200"}]}]}, "nodes[0].gpus[0].type"),
    ({"nodes": [{"gpus": [{"type": "t4", "count": 0}]}]}, "nodes[0].gpus[0].count"),
    ({"nodes": [{"gpus": [{"type": "t4", "count": 2}]}]}, "nodes[0].intra_node_link"),
    ({"nodes": [{"gpus": [{"type": "t4"}]}, {"gpus": [{"type": "t4"}]}]}, "inter_node_link"),
    ({"nodes": [{"gpus": [{"type": "t4", "memory_gib": -1}]}]}, "nodes[0].gpus[0].memory_gib"),
    ({"nodes": []}, "nodes"),
    ({"nodes": [{"gpus": [{"type": "t4"}]}], "inter_node_link": {"bandwidth_gb_per_s": 0}}, "inter_node_link.bandwidth_gb_per_s"),
    ({"nodes": [{"gpus": [{"type": "t4", "count": 2}], "intra_node_link": {"bandwidth_gb_per_s": 5, "allreduce_bandwidth_gb_per_s": -2}}]},
     "nodes[0].intra_node_link.allreduce_bandwidth_gb_per_s"),
])
def test_bad_cluster_fields_name_file_and_field(data, field):
    with pytest.raises(BatonError) as exc:
        cluster_from_mapping(data, source="c.yaml")
    assert str(exc.value).startswith(f"c.yaml: field '{field}'")


def test_links_carry_measured_all_reduce_figures_into_eq5():
    c = cluster_from_mapping({
        "nodes": [{"name": "a", "gpus": [{"type": "t4", "count": 2}],
                   "intra_node_link": {"bandwidth_gb_per_s": 10, "latency_us": 5,
                                       "allreduce_bandwidth_gb_per_s": 2, "allreduce_latency_us": 100}},
                  {"name": "b", "gpus": [{"type": "t4", "count": 2}], "intra_node_link": {"bandwidth_gb_per_s": 10, "latency_us": 5}}],
        "inter_node_link": {"bandwidth_gb_per_s": 4, "latency_us": 30},
    }, source="c.yaml")
    measured, plain = c.link("a:0", "a:1"), c.link("b:0", "b:1")
    # Without in-layer figures, tensor parallelism's all-reduces use the all-reduce ones.
    assert tp_allreduce_ms(1e6, 2, measured) == pytest.approx(allreduce_ms(1e6, 2, measured))
    assert measured.transfer_ms(1e6) == pytest.approx(0.005 + 0.1)  # transfers keep the point-to-point figures
    assert allreduce_ms(1e6, 2, measured) == pytest.approx(1e6 / 2e9 * 1e3 + 2 * 0.1)
    assert allreduce_ms(1e6, 2, plain) == pytest.approx(1e6 / 10e9 * 1e3 + 2 * 0.005)
    # A group spanning both nodes runs at its slowest collective figures.
    slow = c.slowest_link(["a:0", "a:1", "b:0"])
    assert (slow.collective_bandwidth_gb_per_s, slow.collective_latency_us) == (2, 100)
    assert allreduce_ms(1e6, 3, slow) == pytest.approx(4 / 3 * 1e6 / 2e9 * 1e3 + 4 * 0.1)


def test_in_layer_all_reduce_figures_apply_to_tensor_parallelism_only():
    c = cluster_from_mapping({"nodes": [{"name": "a", "gpus": [{"type": "t4", "count": 2}], "intra_node_link": {
        "bandwidth_gb_per_s": 10, "latency_us": 5, "allreduce_bandwidth_gb_per_s": 2, "allreduce_latency_us": 100,
        "tp_allreduce_bandwidth_gb_per_s": 0.5, "tp_allreduce_latency_us": 1000}}]}, source="c.yaml")
    link = c.slowest_link(["a:0", "a:1"])
    assert tp_allreduce_ms(1e6, 2, link) == pytest.approx(1e6 / 0.5e9 * 1e3 + 2 * 1.0)
    assert allreduce_ms(1e6, 2, link) == pytest.approx(1e6 / 2e9 * 1e3 + 2 * 0.1)


def test_exponent_without_a_dot_reads_as_a_number(tmp_path):
    """PyYAML reads 1e9 (no dot) as text; a link figure written that way is still a number."""
    (tmp_path / "c.yaml").write_text("nodes:\n  - name: n\n    gpus: [{type: t4, count: 2}]\n"
                                     "    intra_node_link: {bandwidth_gb_per_s: 1e9, latency_us: 5}\n")
    assert load_cluster(tmp_path / "c.yaml").link("n:0", "n:1").bandwidth_gb_per_s == 1e9
    with pytest.raises(BatonError, match="expected a number, got 'fast'"):
        cluster_from_mapping({"nodes": [{"gpus": [{"type": "t4", "count": 2}], "intra_node_link": {"bandwidth_gb_per_s": "fast"}}]},
                             source="c.yaml")
