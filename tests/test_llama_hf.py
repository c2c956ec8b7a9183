"""Hugging Face Llama in and out (issue 24): random tiny ``LlamaForCausalLM``s built here (8 query heads over
4 KV heads, tied and untied heads), never downloaded.

Checked: the importer (one file and sharded safetensors) gives the single-device Llama Hugging Face's
logits; plans with uneven TP, pipelines, recomputation and replicas start from the import with Hugging
Face's step-0 loss on the same tokens; ``baton train --init-from`` a Llama directory trains, ``baton export
--to hf`` writes a ``LlamaForCausalLM`` that transformers loads with the runtime's logits and that imports
back to the same tensors, and ``baton generate`` samples from the checkpoint. fp32 throughout; logits agree
to 1e-5 (absolute and relative), losses to 1e-5 relative.
"""
from __future__ import annotations

import json

import pytest
import torch

from baton.model_spec import PRESETS
from baton.plan import save_plan
from tests.conftest import run_cli
from tests.runtime_helpers import plan_of, run_ranks

transformers = pytest.importorskip("transformers")

SPECS = {"untied": PRESETS["tiny-llama"], "tied": PRESETS["tiny-llama-tied"]}


def _hf_model(spec, seed=0):
    config = transformers.LlamaConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_dim, intermediate_size=spec.ffn_dim,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads, num_key_value_heads=spec.kv_heads,
        max_position_embeddings=spec.seq_len, rms_norm_eps=spec.norm_eps, rope_theta=spec.rope_theta,
        tie_word_embeddings=spec.tie_embeddings, attention_bias=False, mlp_bias=False)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # a trained model's norms are not all ones: make theirs count
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module", params=sorted(SPECS))
def hf_dir(request, tmp_path_factory):
    spec = SPECS[request.param]
    d = tmp_path_factory.mktemp(f"hf-{request.param}")
    model = _hf_model(spec)
    # Sharded for the untied model (several safetensors files and an index), one file for the tied one.
    model.save_pretrained(d, max_shard_size="100KB" if request.param == "untied" else "50MB")
    return spec, d, model


def _tokens(spec, n=2, seed=0):
    return torch.randint(spec.vocab_size, (n, spec.seq_len), generator=torch.Generator().manual_seed(seed))


def test_import_gives_the_reference_model_hugging_faces_logits(hf_dir):
    """Catches q/k/v or gate/up swapped, o_proj/down_proj misnamed, the rotary halves in the wrong order, a
    KV head serving the wrong query heads, the RMSNorm epsilon or gain ignored, and a tied head read as untied."""
    from runtime.model.hf_import import load_hf
    from runtime.model.llama import Llama

    spec, d, hf = hf_dir
    if spec.tie_embeddings:
        assert not list(d.glob("*.index.json"))
    else:
        assert list(d.glob("*.index.json")), "the untied model should have been saved sharded"
    ours = Llama(spec).eval()
    ours.load_full(load_hf(d, spec).__getitem__)
    idx = _tokens(spec)
    with torch.no_grad():
        want = hf(idx).logits
        got, _ = ours(idx)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()


def test_a_config_for_another_model_is_refused_naming_the_field(hf_dir):
    from baton.errors import BatonError
    from runtime.model.hf_import import load_hf

    spec, d, _ = hf_dir
    with pytest.raises(BatonError) as e:
        load_hf(d, spec.with_overrides(num_kv_heads=2))
    assert e.value.field == "num_key_value_heads"
    with pytest.raises(BatonError) as e:
        load_hf(d, spec.with_overrides(tie_embeddings=not spec.tie_embeddings))
    assert e.value.field == "tie_word_embeddings"


def _step0_worker(rank, world, plan, hf_path):
    from runtime.data.source import TokenSource
    from runtime.model.hf_import import load_hf
    from runtime.train.engine import Engine

    engine = Engine(plan, rank, full=load_hf(hf_path, plan.model).__getitem__)
    stats = engine.forward_backward(0, TokenSource(plan.model, seed=0, global_batch=plan.global_batch))
    return stats.loss


PLANS = {
    "tp_3_1_recompute": lambda s: plan_of(s, [[3, 1]], [4], 4, m=2, recompute={0: ["rope", "attn_core"], 1: ["swiglu", "down"]}),
    "pipeline_2_1_1_then_1": lambda s: plan_of(s, [[2, 1, 1], [1]], [3, 1], [4, 1], m=2, recompute={3: ["rms1", "qkv"]}),
    "replicas": lambda s: plan_of(s, [[1], [1]], [2, 2], 1, m=1, replicas=2),
}


# TP 3:1 on the untied model (KV heads, the untied head's rows by share) runs by default; the tied model, the pipeline
# and the replicas under -m long.
@pytest.mark.parametrize("hf_dir", [pytest.param("tied", marks=pytest.mark.long), "untied"], indirect=True)
@pytest.mark.parametrize("plan_name", [p if p == "tp_3_1_recompute" else pytest.param(p, marks=pytest.mark.long) for p in sorted(PLANS)])
def test_step0_loss_equals_hugging_faces_on_the_same_tokens(hf_dir, plan_name):
    """Catches a rank's slice of an imported tensor taken from the wrong rows (k/v by KV head, the untied
    head's rows by vocabulary share), and an untied head replaced by the embedding on the last stage."""
    from runtime.data.source import TokenSource

    spec, d, hf = hf_dir
    plan = PLANS[plan_name](spec)
    losses = run_ranks(_step0_worker, len(plan.device_ids()), plan, str(d))
    x, y = TokenSource(spec, seed=0, global_batch=plan.global_batch).batch(0, torch.arange(plan.global_batch))
    with torch.no_grad():
        want = hf(x, labels=None).logits
        want = torch.nn.functional.cross_entropy(want.reshape(-1, spec.vocab_size), y.reshape(-1)).item()
    for got in losses:
        assert got == pytest.approx(want, rel=1e-5)


@pytest.mark.long  # a run, an export and generate: GPT-2's export runs quick in test_hf_export.py, Llama's import above
def test_train_from_hf_export_round_trip_and_generate(hf_dir, tmp_path):
    """``--init-from`` a Llama directory, two steps on a TP 3:1 + pipeline plan, export: transformers loads
    the export with the runtime's logits; the importer reads back exactly the checkpoint's tensors;
    ``baton generate`` samples from the checkpoint. Catches an export under GPT-2's names or layouts, a
    config without the KV head count or rope theta, and a tied head exported as a separate tensor."""
    from runtime.model.hf_export import full_tensors, open_checkpoint
    from runtime.model.hf_import import load_hf
    from runtime.model.llama import Llama

    spec, d, _ = hf_dir
    save_plan(plan_of(spec, [[3, 1], [1]], [3, 1], [4, 1], m=2), tmp_path / "p.json")
    (tmp_path / "text.txt").write_text("Baton plans Llama models on mixed clusters.\n" * 40)
    code, _, err = run_cli("train", "--plan", tmp_path / "p.json", "--steps", 2, "--init-from", d, "--data", tmp_path / "text.txt",
                           "--save-dir", tmp_path / "ck", "--timeout", 60)
    assert code == 0, err
    code, out, err = run_cli("export", tmp_path / "ck", tmp_path / "out", "--to", "hf")
    assert code == 0 and "byte-level" in out, err
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_key_value_heads"] == 4
    reader, ck_spec = open_checkpoint(tmp_path / "ck")
    weights = full_tensors(reader, ck_spec)
    ours = Llama(ck_spec).eval()
    ours.load_full(weights.__getitem__)
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    idx = _tokens(spec, seed=1)
    with torch.no_grad():
        want, _ = ours(idx)
        got = theirs(idx).logits
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
    back = load_hf(tmp_path / "out", ck_spec)
    assert back.keys() == weights.keys() and all(torch.equal(back[k], weights[k]) for k in weights)
    code, out, err = run_cli("generate", tmp_path / "ck", "--prompt", "Baton", "--max-new-tokens", 5, "--seed", 0)
    assert code == 0 and out.startswith("Baton"), err
