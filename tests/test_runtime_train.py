"""``baton train`` end to end: resume under the same and another plan, bad input, Hugging Face init."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
import typer
from safetensors.torch import load_file
from typer.testing import CliRunner

from baton.errors import BatonError
from baton.plan import save_plan
from runtime.launch.launcher import TrainConfig, train
from tests.runtime_helpers import plan_of, tiny


def _app() -> typer.Typer:
    from runtime.commands.train import register

    app = typer.Typer(pretty_exceptions_enable=False)

    @app.callback()
    def main() -> None:
        """test app"""

    register(app)
    return app


def _cli(*args, env=None):
    result = CliRunner().invoke(_app(), [str(a) for a in args], env=env)
    return result.exit_code, result.stdout, result.stderr


def _assert_one_line_error(code, out, err, *needles):
    assert code == 2, (code, out, err)
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err + out
    for n in needles:
        assert n in err, err


PLAN_A = dict(stages=[[1], [1, 1]], layers=[2, 2], units=[1, 2], m=2, mbs=2)   # PP=2, G=4
PLAN_B = dict(stages=[[3, 1]], layers=[4], units=4, m=4, mbs=1)               # TP 3:1, G=4


def _plan(kind, spec=None):
    k = dict(kind)
    return plan_of(spec or tiny(0.1), k.pop("stages"), k.pop("layers"), k.pop("units"), **k)


def test_resume_continues_the_same_loss_curve_under_any_plan(tmp_path):
    """Stop after 3 steps, resume to 5 under the same plan (through the CLI) and under another plan.

    Catches: checkpoints that depend on the split (slices saved instead of full tensors), lost AdamW
    moments or step count, a data position or dropout stream that restarts on resume."""
    plan_a, plan_b = _plan(PLAN_A), _plan(PLAN_B)
    full = train(TrainConfig(plan=plan_a, steps=5, save_dir=str(tmp_path / "a"), save_every=3, lr=3e-3, timeout_s=60))
    losses = [s.loss for s in full]
    assert len(losses) == 5 and losses[-1] < losses[0]
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["step-000003", "step-000005"]

    # Same plan, through the CLI: the final weights equal the uninterrupted run's.
    shutil.copytree(tmp_path / "a" / "step-000003", tmp_path / "b" / "step-000003")
    save_plan(plan_a, tmp_path / "plan_a.json")
    code, out, err = _cli("train", "--plan", tmp_path / "plan_a.json", "--steps", 5, "--save-dir", tmp_path / "b",
                          "--resume", "--lr", 3e-3, "--timeout", 60)
    assert code == 0, err
    assert "step 5: loss" in out
    want, got = load_file(tmp_path / "a" / "step-000005" / "model.safetensors"), load_file(tmp_path / "b" / "step-000005" / "model.safetensors")
    for name in want:
        assert torch.allclose(got[name], want[name], rtol=1e-5, atol=1e-7), name

    # Another plan (TP 3:1, one stage, 4 micro-batches of 1): the same losses.
    shutil.copytree(tmp_path / "a" / "step-000003", tmp_path / "c" / "step-000003")
    resumed = train(TrainConfig(plan=plan_b, steps=5, save_dir=str(tmp_path / "c"), resume=True, lr=3e-3, timeout_s=60))
    assert [s.step for s in resumed] == [3, 4]
    for got_loss, want_loss in zip([s.loss for s in resumed], losses[3:]):
        assert abs(got_loss - want_loss) <= 1e-5 * abs(want_loss)


def test_plan_that_does_not_match_the_processes(tmp_path):
    """Catches a torchrun launch with another process count than the plan has devices (would hang)."""
    save_plan(_plan(PLAN_A), tmp_path / "p.json")
    code, out, err = _cli("train", "--plan", tmp_path / "p.json", env={"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    _assert_one_line_error(code, out, err, "3 devices", "2 processes")


def test_checkpoint_of_another_model_is_refused(tmp_path):
    """Catches resuming a tiny-8l checkpoint into a tiny plan (shapes would fail deep in a rank)."""
    from baton.model_spec import PRESETS

    ck = tmp_path / "ck" / "step-000002"
    ck.mkdir(parents=True)
    (ck / "meta.json").write_text(json.dumps({"format": "baton-checkpoint/1", "model": PRESETS["tiny-8l"].to_dict(), "step": 2}))
    save_plan(_plan(PLAN_A), tmp_path / "p.json")
    code, out, err = _cli("train", "--plan", tmp_path / "p.json", "--save-dir", tmp_path / "ck", "--resume")
    _assert_one_line_error(code, out, err, "another model", "tiny-8l")


def test_missing_data_file(tmp_path):
    """Catches a missing --data file found only inside the ranks (or a traceback)."""
    save_plan(_plan(PLAN_A), tmp_path / "p.json")
    code, out, err = _cli("train", "--plan", tmp_path / "p.json", "--data", tmp_path / "nope.txt", "--save-dir", tmp_path / "ck")
    _assert_one_line_error(code, out, err, "nope.txt", "not found")
    assert not (tmp_path / "ck").exists()


def test_failing_ranks_report_one_line_and_leave_no_checkpoint(tmp_path):
    """A checkpoint whose tensors are corrupt fails inside every rank: the parent prints one rank's
    error line, stops the others and writes nothing. Catches hangs and tracebacks on rank failure."""
    ck = tmp_path / "ck" / "step-000002"
    ck.mkdir(parents=True)
    (ck / "meta.json").write_text(json.dumps({"format": "baton-checkpoint/1", "model": tiny(0.1).to_dict(), "step": 2,
                                              "samples_seen": 8, "seed": 0, "optimizer": {"step": 2}}))
    (ck / "model.safetensors").write_bytes(b"\x00" * 64)
    (ck / "optimizer.safetensors").write_bytes(b"\x00" * 64)
    save_plan(_plan(PLAN_A), tmp_path / "p.json")
    code, out, err = _cli("train", "--plan", tmp_path / "p.json", "--save-dir", tmp_path / "ck", "--resume",
                          "--steps", 4, "--timeout", 30)
    _assert_one_line_error(code, out, err, "corrupt checkpoint", "model.safetensors")
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step-000002"]


def test_init_from_hugging_face_gpt2_gives_the_same_logits(tmp_path):
    """Loads a random tiny GPT2LMHeadModel saved by save_pretrained (safetensors) and as a .bin.

    Catches Conv1D weights not transposed, a wrong q/k/v order, a GELU other than gelu_new, a
    missing attention scale or bias, and an untied head."""
    transformers = pytest.importorskip("transformers")
    from runtime.model.hf_import import load_gpt2
    from runtime.model.gpt import GPT

    spec = tiny(0.0, num_layers=2, hidden_dim=32, num_heads=4, ffn_dim=128, seq_len=16)
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=24, vocab_size=256,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.3)  # large random weights so every mapping mistake shows
    hf.save_pretrained(tmp_path / "st")
    (tmp_path / "bin").mkdir()
    shutil.copy(tmp_path / "st" / "config.json", tmp_path / "bin" / "config.json")
    torch.save(hf.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf(idx).logits
        for d in ("st", "bin"):
            model = GPT(spec).eval()
            model.load_full(load_gpt2(tmp_path / d, spec).__getitem__)
            got, _ = model(idx)
            assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), (d, (got - want).abs().max())

    with pytest.raises(BatonError, match="n_layer"):
        load_gpt2(tmp_path / "st", tiny(0.0))
