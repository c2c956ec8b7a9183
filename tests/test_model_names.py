"""A model YAML that changes a preset's sizes never goes by the preset's name: profile tables are found by
name, and would be the preset's, made for other sizes.

Catches: ``name: gpt3-1.3b`` with ``num_layers: 10`` (or ``base: gpt3-1.3b`` plus changes and no name)
failing on, or silently priced by, gpt3-1.3b's table without a word about the name; a made-up name that
differs between two copies of one file (their tables would not be shared) or that two different changes
share; the changes tables already tell apart (sequence length, attention, TF32) costing the preset's name.
"""
from __future__ import annotations

import pytest

from baton.errors import BatonError
from baton.model_files import load_model
from baton.model_spec import PRESETS
from tests.conftest import ROOT, run_cli

CLUSTER = ROOT / "clusters" / "a100x2_t4x2.yaml"


def _model(tmp_path, text, name="m.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_a_preset_name_with_other_sizes_is_refused_naming_the_field(tmp_path):
    path = _model(tmp_path, "name: gpt3-1.3b\nbase: gpt3-1.3b\nnum_layers: 10\n")
    with pytest.raises(BatonError) as exc:
        load_model(path)
    assert str(exc.value) == (f"{path}: field 'name': 'gpt3-1.3b' is a preset with other sizes (num_layers 24 vs 10), and "
                              "profile tables are found by name; give the model a name of its own, or leave out 'name' to "
                              "have it named 'gpt3-1.3b-l10'")
    written_out = _model(tmp_path, "name: gpt3-1.3b\nnum_layers: 24\nhidden_dim: 1024\nnum_heads: 16\nseq_len: 2048\n"
                                   "vocab_size: 50257\ndtype: bf16\n", "full.yaml")
    with pytest.raises(BatonError, match=r"field 'name': .*hidden_dim 2048 vs 1024, ffn_dim 8192 vs 4096, dtype 'fp16' vs 'bf16'"):
        load_model(written_out)


def test_without_a_name_the_model_is_named_after_its_changes(tmp_path):
    assert load_model(_model(tmp_path, "base: gpt3-1.3b\nnum_layers: 10\n")).name == "gpt3-1.3b-l10"
    assert load_model(_model(tmp_path, "base: gpt3-1.3b\nnum_layers: 10\n", "copy.yaml")).name == "gpt3-1.3b-l10"
    assert load_model(_model(tmp_path, "base: gpt3-1.3b\nnum_layers: 12\n")).name == "gpt3-1.3b-l12"
    assert load_model(_model(tmp_path, "base: tiny\ndtype: bf16\ndropout: 0.0\n")).name == "tiny-bf16-drop0"
    # A file named like a preset, written out in full with other sizes, is named the same way.
    tiny = _model(tmp_path, "num_layers: 2\nhidden_dim: 64\nnum_heads: 4\nseq_len: 32\nvocab_size: 256\ndtype: fp32\n"
                            "attention: eager\n", "tiny.yaml")
    assert load_model(tiny).name == "tiny-l2"
    # A name of its own is kept, and so is a preset's name for the preset itself.
    assert load_model(_model(tmp_path, "base: gpt3-1.3b\nname: short\nnum_layers: 10\n")).name == "short"
    assert load_model(_model(tmp_path, "base: gpt3-1.3b\nname: gpt3-1.3b\n")) == PRESETS["gpt3-1.3b"]


@pytest.mark.parametrize("change", ["seq_len: 1024", "attention: eager", "tf32: true"])
def test_changes_the_tables_tell_apart_keep_the_presets_name(tmp_path, change):
    assert load_model(_model(tmp_path, f"base: gpt3-1.3b\n{change}\n")).name == "gpt3-1.3b"
    assert load_model(_model(tmp_path, f"base: gpt3-1.3b\nname: gpt3-1.3b\n{change}\n")).name == "gpt3-1.3b"


def test_a_made_up_name_is_found_by_the_profile_command_and_the_solver(tmp_path, monkeypatch):
    user = tmp_path / "user-profiles"
    monkeypatch.setenv("BATON_PROFILES", str(user))
    model = _model(tmp_path, "base: gpt3-125m\nnum_layers: 4\n")
    code, _, err = run_cli("profile", "--analytic", "--gpu", "t4", "--model", model, "--micro-batch", "1")
    assert code == 0, err
    assert [p.name for p in (user / "derived").iterdir()] == ["t4__gpt3-125m-l4__s2048.csv"]
    code, out, err = run_cli("solve", "--cluster", CLUSTER, "--model", model, "--strategy", "megatron", "--global-batch", "8")
    assert code == 0, err
    assert "gpt3-125m-l4 on a100x2_t4x2" in out.replace("\n", " ")
    # Only the A100's table was missing: the T4's made above is found under the same name.
    assert [line.split(" x ")[0] for line in err.splitlines() if line.startswith("derived")] == ["derived the analytic table for a100-40gb"]
