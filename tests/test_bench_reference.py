"""bench/bench_reference.py: its reference loop and Baton's one-device plan are the same computation (the same
losses step after step from the same weights and data), and the command writes its JSON and Markdown."""
from __future__ import annotations

import json
import sys

import pytest
import torch

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import bench_reference  # noqa: E402


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    """The benchmark sets torch's thread count for its process (as baton train's rank does): give this one its own back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_reference_loop_and_baton_plan_follow_the_same_losses():
    """A timing comparison is only worth making if both train the same model on the same batches: a reference that
    skipped gradient accumulation (one micro-batch per step), averaged the loss over the wrong count, fed other
    samples or started from other weights would drift from Baton's losses by the second step."""
    spec = bench_reference.bench_spec("tiny")
    assert (spec.attention, spec.dropout, spec.dtype) == ("fused", 0.0, "fp32")
    result, stats = bench_reference.run_reference(spec, micro_batch_size=2, global_batch=6, steps=2, rounds=2, warmup=1,
                                                  lr=1e-3, threads=1, log=lambda line: None)
    (pair,) = result["pairs"]
    ref, baton = pair["reference"]["losses"], pair["baton"]["losses"]
    assert len(ref) == len(baton) == 1 + 2 * 2
    assert ref[-1] < ref[0] - 0.05, "the model does not learn: the trajectory proves nothing"
    assert baton == pytest.approx(ref, rel=2e-5)
    # The report's steps: the last warm-up step (build_report drops the first), then the measured ones.
    assert [s.step for s in stats["none"]] == [0, 1, 2, 3, 4]
    assert pair["ratio"] == pytest.approx(pair["reference"]["median_ms"] / pair["baton"]["median_ms"])
    assert result["settings"]["reference_adamw"] in ({"fused": True}, {"foreach": True})


def test_baton_side_runs_the_offload_and_the_reference_stays_plain():
    """An offloading label's plan keeps its tensors in host memory on Baton's side (the engine's stash held them and
    got them back), the losses are those of the plan without offload bit for bit, and the reference, which offloads
    nothing, follows the same losses."""
    spec = bench_reference.bench_spec("tiny")
    choices = bench_reference.plan_choices(spec)
    assert set(choices) == {"none", "attention", "all", "none+offload", "attention+offload", "all+offload"}
    for label, (ops, offload) in choices.items():
        assert bool(offload) == label.endswith("+offload") and ops == choices[bench_reference.base_label(label)][0]
        plan = bench_reference.one_device_plan(spec, micro_batch_size=1, num_microbatches=2, recompute=ops, offload=offload)
        assert plan.pipelines[0].stages[0].devices[0].offload == tuple(offload)
    ops, offload = choices["none+offload"]
    result, stats = bench_reference.run_reference(spec, micro_batch_size=2, global_batch=4, steps=1, rounds=1, warmup=1,
                                                  lr=1e-3, recompute={"none": ops, "none+offload": ops},
                                                  offload={"none+offload": offload}, threads=1, log=lambda line: None)
    plain, off = result["pairs"]
    assert plain["offload"] == [] and off["offload"] == list(offload)
    assert off["baton"]["losses"] == plain["baton"]["losses"]
    assert off["baton"]["losses"] == pytest.approx(off["reference"]["losses"], rel=2e-5)
    assert all(s.peak_host_activation_bytes > 0 and s.offload_in_bytes == s.offload_out_bytes > 0 for s in stats["none+offload"])
    assert all(s.peak_host_activation_bytes == 0 for s in stats["none"])
    with pytest.raises(ValueError, match="without a recompute set"):
        bench_reference.run_reference(spec, micro_batch_size=1, global_batch=2, offload={"all+offload": offload})


def test_bf16_reference_keeps_fp32_masters_like_the_runtime():
    """In bf16 the reference computes in bf16 and steps fp32 masters, as runtime.train.precision does."""
    spec = bench_reference.bench_spec("tiny", dtype="bf16")
    loop = bench_reference.ReferenceLoop(spec, device=torch.device("cpu"), micro_batch_size=1, num_microbatches=2)
    assert {p.dtype for p in loop.params} == {torch.bfloat16} and {m.dtype for m in loop.masters} == {torch.float32}
    assert loop.precision == "masters"


def test_the_command_writes_json_and_markdown(tmp_path):
    code = bench_reference.main(["--model", "tiny", "--micro-batch", "1", "--global-batch", "2", "--steps", "1",
                                 "--rounds", "2", "--warmup", "1", "--threads", "1", "--out", str(tmp_path), "--name", "ref"])
    assert code == 0
    result = json.loads((tmp_path / "ref.json").read_text())
    (pair,) = result["pairs"]
    assert len(pair["baton"]["step_ms"]) == len(pair["reference"]["step_ms"]) == 2
    assert result["environment"]["cpus"] >= 1 and "--model tiny" in result["command"]
    md = (tmp_path / "ref.md").read_text()
    assert "| tiny-fp32-s32 | mb 1 x 2, recompute none |" in md and f"{pair['ratio']:.3f}" in md


def test_the_recompute_bench_times_node_and_checkpoint_side_by_side(tmp_path):
    """bench/bench_recompute.py: the three plans take turns, and the two mechanisms give the same losses."""
    import bench_recompute

    assert bench_recompute.main(["--models", "host", "--rounds", "1", "--steps", "1", "--warmup", "0",
                                 "--out", str(tmp_path)]) == 0
    (r,) = json.loads((tmp_path / "recompute.json").read_text())["models"]
    assert set(r["median_ms"]) == {"none", "node", "checkpoint"} and r["same_losses"]
    assert "| host (24 layers" in (tmp_path / "recompute.md").read_text()
