"""Models out of Baton (``baton export --to hf``, ``baton generate``) and into it (runtime/model/hf_import.py's importer).

One tiny model is trained for two steps on the bytes of a small corpus (about 10 s, shared by the
module); the Hugging Face models are random tiny GPT2LMHeadModels."""
from __future__ import annotations

import json
import random

import pytest
import torch

from baton.errors import BatonError
from baton.model_spec import PRESETS
from baton.plan import save_plan
from tests.conftest import run_cli
from tests.runtime_helpers import plan_of

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A checkpoint of `tiny` (dropout 0.1, 260 tokens) trained 2 steps on the bytes of a text file."""
    root = tmp_path_factory.mktemp("trained")
    rng = random.Random(0)
    words = "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega pipeline stage".split()
    (root / "text.txt").write_text("\n".join(" ".join(rng.choice(words) for _ in range(8)) for _ in range(200)))
    save_plan(plan_of(PRESETS["tiny"].with_overrides(vocab_size=260), [[1]], [4], 1, m=2, mbs=2), root / "one.json")
    code, out, err = run_cli("train", "--plan", root / "one.json", "--steps", 2, "--data", root / "text.txt",
                             "--save-dir", root / "ck", "--timeout", 60)
    assert code == 0, err
    return root


def _model_of(ckpt):
    from runtime.model.hf_export import full_tensors, open_checkpoint
    from runtime.model.gpt import GPT

    reader, spec = open_checkpoint(ckpt)
    model = GPT(spec).eval()
    model.load_full(full_tensors(reader, spec).__getitem__)
    return model, spec


def test_export_loads_in_transformers_with_equal_logits_and_the_byte_tokenizer(trained, tmp_path):
    """Catches Conv1D weights left untransposed, a missing `transformer.` prefix, an untied head, a wrong
    GELU or epsilon in config.json, and a tokenizer that does not map bytes to their values."""
    code, out, err = run_cli("export", trained / "ck", tmp_path / "hf", "--to", "hf")
    assert code == 0, err
    assert "byte-level" in out
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    ours, spec = _model_of(trained / "ck" / "step-000002")
    idx = torch.randint(0, 260, (2, spec.seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, _ = ours(idx)
        got = hf(idx).logits
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["resid_pdrop"] == 0.1 and config["embd_pdrop"] == 0.0 and config["eos_token_id"] is None
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tok("héllo\n").input_ids == list("héllo\n".encode()) and tok.decode(list(b"caf\xc3\xa9")) == "café"
    # and back in: the importer reads what the exporter wrote
    from runtime.model.hf_import import load_gpt2

    back = load_gpt2(tmp_path / "hf", spec)
    assert all(torch.equal(back[k], v) for k, v in ours.state_dict().items() if k in back)


def test_export_ships_a_given_tokenizer_and_refuses_bad_targets(trained, tmp_path):
    """--tokenizer is copied and read back by AutoTokenizer; a tokenizer too large for the model, an
    unknown format, a target holding other files and a path that is no checkpoint are one-line errors."""
    from runtime.data.tokens import TokenizerChoice, prepare

    prepare([trained / "text.txt"], tmp_path / "ds", TokenizerChoice(train_vocab_size=257))
    prepare([trained / "text.txt"], tmp_path / "big", TokenizerChoice(train_vocab_size=300))
    code, out, err = run_cli("export", trained / "ck", tmp_path / "hf", "--tokenizer", tmp_path / "ds")
    assert code == 0, err
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tok.eos_token == "<|endoftext|>" and tok.decode(tok("gamma delta").input_ids) == "gamma delta"
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"] == 0
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    for args, needle in (
        ([trained / "ck", tmp_path / "x", "--tokenizer", tmp_path / "big"], "more than the model's 260"),
        ([trained / "ck", tmp_path / "x", "--to", "onnx"], "unknown format"),
        ([trained / "ck", tmp_path / "mine"], "not a Hugging Face model directory"),
        ([tmp_path, tmp_path / "x"], "not a checkpoint"),
    ):
        code, out, err = run_cli("export", *args)
        assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, (args, err)
        assert not (tmp_path / "x").exists()
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"


def test_generate_is_seeded_and_greedy_matches_transformers(trained, tmp_path):
    """The same seed gives the same text and another seed other text; temperature 0 gives the greedy
    continuation transformers' generate() finds with the exported model."""
    args = ("generate", trained / "ck", "--prompt", "alpha beta", "--max-new-tokens", 12)
    first, again, other = (run_cli(*args, "--seed", s) for s in (1, 1, 2))
    assert first[0] == 0, first[2]
    assert first[1] == again[1] != other[1] and first[1].startswith("alpha beta")
    code, greedy, err = run_cli(*args, "--temperature", 0)
    assert code == 0, err
    assert run_cli("export", trained / "ck", tmp_path / "hf")[0] == 0
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    prompt = torch.tensor([list(b"alpha beta")])
    out = hf.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert greedy.rstrip("\n") == bytes(out[0].tolist()).decode("utf-8", errors="replace")
    for bad, needle in ((["--temperature", -1], "--temperature"), (["--max-new-tokens", 0], "--max-new-tokens"),
                        (["--top-k", 0], "--top-k"), (["--device", "tpu"], "--device")):
        code, _, err = run_cli(*args, *bad)
        assert code == 2 and needle in err, (bad, err)


def test_top_k_one_is_greedy():
    from runtime.model.generate import sample
    from runtime.model.gpt import GPT

    spec = PRESETS["tiny"].with_overrides(dropout=0.0)
    model = GPT(spec, seed=5)
    greedy = sample(model, spec, [1, 2, 3], max_new_tokens=8, temperature=0.0)
    assert sample(model, spec, [1, 2, 3], max_new_tokens=8, temperature=1.5, top_k=1, seed=9) == greedy
    assert len(greedy) == 11
    with pytest.raises(BatonError, match="beyond the model's vocabulary"):
        sample(model, spec, [999], max_new_tokens=1)


# --- the importer --------------------------------------------------------------------------------


def _hf_dir(tmp_path, name, **config):
    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=24, vocab_size=256, **config)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.3)
    return hf, cfg


SPEC = PRESETS["tiny"].with_overrides(dropout=0.0, num_layers=2, hidden_dim=32, num_heads=4, ffn_dim=128, seq_len=16)


def _logits_match(hf, path):
    from runtime.model.hf_import import load_gpt2
    from runtime.model.gpt import GPT

    model = GPT(SPEC).eval()
    model.load_full(load_gpt2(path, SPEC).__getitem__)
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return torch.allclose(model(idx)[0], hf(idx).logits, atol=1e-4, rtol=1e-4)


def test_importer_takes_gelu_pytorch_tanh_sharded_weights_and_dropout_settings(tmp_path):
    """gelu_pytorch_tanh is the tanh GELU; sharded safetensors (model.safetensors.index.json) are read
    whole; GPT-2's dropout probabilities (training settings, not weights) do not stop an import."""
    hf, _ = _hf_dir(tmp_path, "tanh", activation_function="gelu_pytorch_tanh", resid_pdrop=0.2, embd_pdrop=0.3, attn_pdrop=0.1)
    hf.save_pretrained(tmp_path / "tanh")
    assert _logits_match(hf, tmp_path / "tanh")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="30KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 1
    assert _logits_match(hf, tmp_path / "sharded")
    from runtime.model.hf_import import load_gpt2

    shard = sorted((tmp_path / "sharded").glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(BatonError, match=f"shard '{shard.name}' is missing"):
        load_gpt2(tmp_path / "sharded", SPEC)
    hf2, _ = _hf_dir(tmp_path, "relu", activation_function="relu")
    hf2.save_pretrained(tmp_path / "relu")
    with pytest.raises(BatonError, match="activation_function"):
        load_gpt2(tmp_path / "relu", SPEC)


def test_importer_refuses_an_untied_head(tmp_path):
    """An lm_head.weight of its own gave logits off by up to 4.5 when silently dropped: now refused."""
    from runtime.model.hf_import import load_gpt2

    hf, _ = _hf_dir(tmp_path, "untied", tie_word_embeddings=False)
    assert not torch.equal(hf.lm_head.weight, hf.transformer.wte.weight)
    hf.save_pretrained(tmp_path / "untied")
    with pytest.raises(BatonError, match="lm_head.weight"):
        load_gpt2(tmp_path / "untied", SPEC)
    tied, _ = _hf_dir(tmp_path, "tied")
    (tmp_path / "bin").mkdir()
    tied.config.save_pretrained(tmp_path / "bin")
    torch.save(tied.state_dict(), tmp_path / "bin" / "pytorch_model.bin")  # holds lm_head.weight == wte
    assert _logits_match(tied, tmp_path / "bin")
