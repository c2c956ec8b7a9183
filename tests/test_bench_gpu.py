"""bench/bench_gpu.py without a GPU: it skips cleanly, and its CPU-independent parts (the local GPU as a
cluster, the plans it tries and keeps, the result rows and table) work on the cost model alone."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from baton.cluster import from_mapping
from baton.evaluate import evaluate
from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import bench_gpu  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_cuda_it_says_skipped_and_succeeds():
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_gpu.py")], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "skipped: no CUDA device", (res.stdout, res.stderr)


def _h100():
    return from_mapping(bench_gpu.cluster_mapping("h100", int(79.6 * 1024**3)), source="<h100>")


def test_plans_that_fit_one_h100():
    """The candidates are valid one-GPU plans of the bf16 fused-attention model; those kept fit by the
    evaluator's eq. 8 against the GPU's real memory, and recomputation makes more of them fit."""
    from runtime.launch.devices import prediction_profiles

    # 2.7B: at micro-batch 8 only full recomputation fits in 80 GB (1.3B fits at every size here).
    spec = bench_gpu.bench_model("gpt3-2.7b", 2048)
    assert (spec.dtype, spec.attention, spec.dropout) == ("bf16", "fused", 0.0)
    cluster = _h100()
    plans = bench_gpu.candidate_plans(spec, global_batch=8)
    assert len(plans) == len(bench_gpu.MICRO_BATCHES) * 3
    profiles = prediction_profiles(plans[0][1], cluster, None)
    kept = bench_gpu.fitting(plans, cluster, profiles)
    assert kept and len(kept) < len(plans)
    for _, plan in kept:
        assert plan.global_batch == 8 and evaluate(plan, cluster, profiles).fits
    assert any("recompute all" in name for name, _ in kept)
    biggest = max(plan.micro_batch_size for name, plan in kept)
    assert any(plan.micro_batch_size == biggest and "recompute all" in name for name, plan in kept)


def test_result_rows_and_table_from_a_report():
    """A report of a one-GPU run (synthetic steps) becomes a row and a Markdown line."""
    from baton.profile import Profile, ProfileSet, derive_table
    from runtime.train.engine import StepStats
    from runtime.measure.report import build_report

    spec = bench_gpu.bench_model("gpt3-125m", 512)
    cluster = _h100()
    name, plan = bench_gpu.candidate_plans(spec, global_batch=4)[0]
    profiles = ProfileSet(spec, tables={"h100": Profile(derive_table(spec, "h100", micro_batches=(1,)), source="<derived>")})
    pred = evaluate(plan, cluster, profiles)
    m = plan.num_microbatches
    steps = [StepStats(step=i, loss=5.0, iteration_ms=2 * pred.iteration_time_ms, forward_ms=[1.0] * m, backward_ms=[2.0] * m,
                       recompute_ms=[0.0] * m, stage_ms=[3.0 * m], tp_allreduce_ms=None, peak_saved_bytes=10**6,
                       peak_allocated_bytes=int(pred.devices[0].peak_memory_bytes / 2), tokens=plan.global_batch * spec.seq_len,
                       weights_bytes=1, grads_bytes=1, master_bytes=2, moments_bytes=4) for i in range(3)]
    report = build_report(plan, cluster, profiles, {0: steps})
    row = bench_gpu.row_of(name, report)
    assert row["back_to_back"] is None
    assert row["iteration_rel_error"] == pytest.approx(-0.5) and row["peak_rel_error"] == pytest.approx(1.0)
    assert row["mfu"] == pytest.approx(pred.mfu / 2) and row["tokens_per_s"] == pytest.approx(pred.tokens_per_s / 2)
    dev = pred.devices[0]
    assert row["passes_ms"]["fwd_ms"] == {"measured": 1.0, "predicted": pytest.approx(dev.fwd_ms)}
    assert row["passes_ms"]["bwd_ms"] == {"measured": 2.0, "predicted": pytest.approx(dev.bwd_ms + dev.recompute_ms)}
    assert set(row["phases_ms"]) >= {"pipeline_ms", "optimizer_ms"}
    env = {"device": "NVIDIA H100 80GB HBM3", "gpu_type": "h100", "torch": "x", "cuda": "y", "model": spec.name,
           "attention": "fused", "steps": 3, "table": "profiles/measured/t.csv"}
    md = bench_gpu.markdown([row], env)
    assert name in md and "-50.0%" in md and "mean absolute error 50.0%" in md
    assert f"1.0 ({dev.fwd_ms:.1f}) / 2.0 ({dev.bwd_ms + dev.recompute_ms:.1f})" in md
    assert "back to back: mean" not in md
    # Priced from a second table (here the same one): its prediction and error sit beside the first's.
    both = bench_gpu.row_of(name, report, report)
    assert both["back_to_back"]["iteration_ms_predicted"] == pytest.approx(pred.iteration_time_ms)
    assert both["back_to_back"]["iteration_rel_error"] == pytest.approx(-0.5)
    md = bench_gpu.markdown([both], env)
    assert md.count("-50.0%") == 2 and "timed back to back: mean absolute error 50.0%" in md
    assert "Cut short" not in md and "Cut short: 1 of 3 plans ran." in bench_gpu.markdown([both], {**env, "plans_asked": 3})


def test_cpu_mode_runs_the_whole_benchmark_end_to_end(tmp_path):
    """``--device cpu`` runs what a lent GPU runs, at tiny sizes: both tables, the plans, Baton against the reference
    loop, the cost model's report of every plan, the files. So a GPU run can fail only on the GPU."""
    import json

    res = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_gpu.py"), "--device", "cpu", "--out", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, (res.stdout, res.stderr)
    data = json.loads((tmp_path / "gpu.json").read_text())
    env, rows = data["environment"], data["plans"]
    assert "failed" not in env, env.get("failed")
    assert [r["plan"] for r in rows] == [f"tiny mb {mb} x {4 // mb}, recompute {label}" for mb in (1, 2) for label in ("none", "all")]
    assert env["plans_asked"] == len(rows) and env["models"][0]["model"] == "tiny-bf16-s32"
    for r in rows:
        assert r["iteration_ms"] > 0 and r["iteration_ms_predicted"] > 0 and r["back_to_back"] is not None
        assert r["reference"]["tokens_per_s"] > 0 and r["ratio"] == pytest.approx(r["reference"]["median_ms"] / r["baton_median_ms"])
        assert {"pipeline_ms", "optimizer_ms"} <= set(r["phases_ms"])
        # The same computation: bf16 weights with fp32 masters on both sides, the same first batch.
        assert r["losses"]["baton"] == pytest.approx(r["losses"]["reference"], rel=1e-3)
    md = (tmp_path / "gpu.md").read_text()
    assert "| tiny mb 2 x 2, recompute all |" in md and "Baton / reference tokens/s: median" in md
    assert (tmp_path / "profiles" / "measured" / "h100__tiny-bf16-s32__s32.csv").is_file()
    assert (tmp_path / "profiles" / "measured" / "h100__tiny-bf16-s32__s32.command.json").is_file()
    assert (tmp_path / "gpu_table_back_to_back.csv").is_file()
