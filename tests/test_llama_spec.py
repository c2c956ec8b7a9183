"""The Llama layer in the planner (issue 24): presets, operators, units under grouped-query attention,
parameter counts, the untied head in memory and peer groups, Hugging Face configs as models, and plans."""
from __future__ import annotations

import json
import math

import pytest

from baton.catalog import CATALOG
from baton.cluster import load_cluster
from baton.costmodel import edge_param_count, embedding_sync_ms, layer_param_count
from baton.errors import BatonError
from baton.evaluate import evaluate
from baton.model_files import load_model
from baton.model_spec import PRESETS, from_mapping, unit_counts
from baton.operators import operator_names, padded_vocab, tensor_sizes
from baton.peers import peer_groups
from baton.plan import load_plan
from baton.profile import ProfileSet, derive_table
from tests.conftest import ROOT, run_cli
from tests.runtime_helpers import plan_of

PUBLISHED = {"llama2-7b": 6_738_415_616, "llama2-13b": 13_015_864_320, "llama3-8b": 8_030_261_248,
             "llama3.2-1b": 1_235_814_400, "llama3.2-3b": 3_212_749_824}
"""Parameter counts of the released checkpoints (the sum of their safetensors' sizes; Llama 3.2 ties the head)."""


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_have_the_published_parameter_counts(name):
    """Within 0.1% of the released models (the GPT-layer stand-in for llama2-7b had 5,182.6M)."""
    assert abs(PRESETS[name].num_params() - PUBLISHED[name]) <= 1e-3 * PUBLISHED[name]


def test_llama3_8b_is_grouped_query_with_untied_head_and_8k_context():
    m = PRESETS["llama3-8b"]
    assert (m.architecture, m.kv_heads, m.vocab_size, m.rope_theta, m.seq_len, m.tie_embeddings) == \
        ("llama", 8, 128256, 500000.0, 8192, False)
    assert PRESETS["llama3.2-1b"].tie_embeddings and PRESETS["llama3.2-3b"].tie_embeddings


def test_units_are_kv_heads_with_their_query_heads():
    """A layer has at most num_kv_heads units: llama3-8b's 32 query heads over 8 KV heads split 1, 2, 4 or 8
    ways, and the tiny Llama's 4 KV heads 1, 2 or 4 ways (3:1 uneven allowed)."""
    assert unit_counts(PRESETS["llama3-8b"]) == [1, 2, 4, 8]
    assert unit_counts(PRESETS["tiny-llama"]) == [1, 2, 4]
    with pytest.raises(BatonError, match="units"):
        plan_of(PRESETS["tiny-llama"], [[4, 4]], [4], 8)
    plan_of(PRESETS["tiny-llama"], [[3, 1]], [4], 4)


def test_operators_and_tensor_sizes_under_gqa():
    """k and v are g/a of q's width; the layer's operators are Llama's, in order."""
    spec = PRESETS["tiny-llama"]
    assert operator_names(spec) == ["rms1", "qkv", "rope", "attn_core", "out_proj", "resid1", "rms2", "gate_up", "swiglu", "down",
                                    "resid2"]
    sizes = tensor_sizes(spec, 2)
    assert sizes["k"].bytes(1.0) == sizes["q"].bytes(1.0) * spec.kv_heads / spec.num_heads
    assert sizes["rms1_stats"].bytes(1.0) == 2 * spec.seq_len * 4


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-llama-tied", "llama3-8b"])
def test_derived_table_holds_exactly_the_model(name):
    """A derived table's parameter bytes (layers at share 1, embedding and head) add up to the model's
    parameters (padded vocabulary rows included); the cost model's analytic counts agree."""
    spec = PRESETS[name]
    df = derive_table(spec, CATALOG["a100-80gb"], micro_batches=(1,), shares=(1.0,))
    layer = df[df["op"].isin(operator_names(spec))]["param_bytes"].sum()
    edges = df[df["op"].isin(["embedding", "head"])]["param_bytes"].sum()
    extra_rows = (padded_vocab(spec) - spec.vocab_size) * spec.hidden_dim * (1 if spec.tie_embeddings else 2)
    assert spec.num_layers * layer + edges == (spec.num_params() + extra_rows) * spec.dtype_bytes
    assert layer == layer_param_count(spec, 1.0) * spec.dtype_bytes
    assert edges == edge_param_count(spec, 1.0, first=True, last=True) * spec.dtype_bytes


def test_untied_head_is_a_peer_piece_of_its_own_and_needs_no_tied_sync():
    """Two replicas of (first stage, last stage): an untied head's rows form their own peer group with the
    last stages only, the embedding's with the first stages only; no tied-embedding all-reduce is priced.
    A tied Llama keeps GPT's rule (both ends hold the rows; the sum is priced)."""
    untied = plan_of(PRESETS["tiny-llama"], [[1], [1]], [3, 1], 1, replicas=2)
    parts = {b.part: g.holders for g in peer_groups(untied) for b in g.blocks if b.part in ("vocab", "head")}
    assert parts == {"vocab": ("d0:0", "d1:0"), "head": ("d0:1", "d1:1")}
    assert not any(b.part == "positions" for g in peer_groups(untied) for b in g.blocks)
    cluster = load_cluster(ROOT / "clusters" / "cpu4.yaml")
    pipes = [[["local:0"], ["local:1"]]]
    assert embedding_sync_ms(cluster, PRESETS["tiny-llama"], pipes) == 0.0
    assert embedding_sync_ms(cluster, PRESETS["tiny-llama-tied"], pipes) > 0.0
    total = sum(g.num_params for g in peer_groups(untied))
    assert total == PRESETS["tiny-llama"].num_params()  # 256 rows: nothing padded


def test_model_yaml_fields_and_their_errors(tmp_path):
    spec = from_mapping({"base": "llama3-8b", "num_layers": 2}, source="x.yaml")
    assert spec.kv_heads == 8 and spec.architecture == "llama"
    full = from_mapping({"architecture": "llama", "num_layers": 2, "hidden_dim": 64, "num_heads": 8, "num_kv_heads": 2,
                         "ffn_dim": 128, "seq_len": 16, "vocab_size": 100}, source="x.yaml")
    assert (full.dropout, full.attention, full.tie_embeddings) == (0.0, "fused", False)
    bad = [({"base": "tiny-llama", "num_kv_heads": 3}, "num_kv_heads"),
           ({"base": "tiny", "num_kv_heads": 2}, "num_kv_heads"),
           ({"base": "tiny-llama", "attention": "eager"}, "attention"),
           ({"base": "tiny", "architecture": "mamba"}, "architecture")]
    for data, field in bad:
        with pytest.raises(BatonError) as e:
            from_mapping(data, source="x.yaml")
        assert e.value.field == field, data


def _hf_dir(tmp_path, **changes):
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 192,
              "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 32,
              "vocab_size": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
              "torch_dtype": "float32", "hidden_act": "silu"}
    config.update(changes)
    d = tmp_path / "my-llama"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(config))
    return d


def test_hf_config_directory_is_a_model(tmp_path):
    """``--model DIR``: the config's sizes, KV heads, theta, epsilon and tying, named after the directory."""
    spec = load_model(str(_hf_dir(tmp_path)))
    want = PRESETS["tiny-llama"]
    for field in ("architecture", "num_layers", "hidden_dim", "num_heads", "kv_heads", "ffn_dim", "seq_len", "vocab_size",
                  "dtype", "rope_theta", "norm_eps", "tie_embeddings"):
        assert getattr(spec, field) == getattr(want, field), field
    assert spec.name == "my-llama"


@pytest.mark.parametrize("change,field", [
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_parameters"),
    ({"sliding_window": 4096}, "sliding_window"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"num_key_value_heads": 3}, "num_kv_heads"),
    ({"model_type": "mistral"}, "model_type"),
])
def test_unsupported_hf_configs_get_one_line_naming_the_field(tmp_path, change, field):
    d = _hf_dir(tmp_path, **change)
    with pytest.raises(BatonError) as e:
        load_model(str(d))
    assert e.value.field == field
    code, _, err = run_cli("show", d)
    assert code == 2 and field in err and len(err.strip().splitlines()) == 1


def test_show_models_lists_architecture_and_kv_heads():
    code, out, err = run_cli("show", "models")
    assert code == 0, err
    assert "kv heads" in out and "llama3-8b" in out and "untied" in out


def test_solve_and_evaluate_a_hf_directory_and_tiny_llama(tmp_path, monkeypatch):
    """The planner takes a Hugging Face directory as the model (after deriving its tables), and its plan for a
    Llama re-evaluates to the objective; the tiny Llama is planned with uneven shares where they pay."""
    monkeypatch.setenv("BATON_PROFILES", str(tmp_path / "profiles"))
    d = _hf_dir(tmp_path)
    code, _, err = run_cli("profile", "--analytic", "--gpu", "cpu", "--model", d)
    assert code == 0, err
    out = tmp_path / "plan.json"
    code, stdout, err = run_cli("solve", "--cluster", ROOT / "clusters" / "cpu4.yaml", "--model", d, "--global-batch", "8",
                                "--out", out)
    assert code == 0, err
    plan = load_plan(out)
    assert plan.model.llama and plan.model.kv_heads == 4
    rep = evaluate(plan, load_cluster(ROOT / "clusters" / "cpu4.yaml"), ProfileSet(plan.model))
    assert math.isclose(rep.iteration_time_ms, plan.info["objective_ms"], rel_tol=1e-6)
    code, _, err = run_cli("evaluate", out, "--cluster", ROOT / "clusters" / "cpu4.yaml")
    assert code == 0, err
