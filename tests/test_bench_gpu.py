"""bench/bench_gpu.py without a GPU: it skips cleanly, and its CPU-independent parts (the local GPU as a
cluster, the plans it tries and keeps, the result rows and table) work on the cost model alone."""
from __future__ import annotations

import os
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


def test_the_measured_host_link_prices_the_offloading_plans():
    """The machine's pinned-copy rate goes on the node (the slower direction), and a faster link shortens what an
    offloading plan exposes (eq. 2o); without a measurement the catalog's figure stays."""
    from runtime.measure.host_link import HostLink, measure_host_link

    link = measure_host_link(torch.device("cpu"), copy_bytes=4 << 20, reps=2, warmup=1)
    assert 0 < link.gb_per_s == min(link.to_host_gb_per_s, link.to_device_gb_per_s)
    assert HostLink(to_host_gb_per_s=54.6, to_device_gb_per_s=51.8, copy_bytes=1).gb_per_s == 51.8
    catalog = _h100()
    measured = from_mapping(bench_gpu.cluster_mapping("h100", int(79.6 * 1024**3), 96.0), source="<h100>")
    assert measured.devices[0].host_link_gb_per_s == 96.0 != catalog.devices[0].host_link_gb_per_s
    from baton.memory import held_tensors, tensor_blocks
    from bench_reference import one_device_plan
    from runtime.launch.devices import prediction_profiles

    spec = bench_gpu.bench_model("gpt3-350m", 1024)
    offload = [t for t in held_tensors(spec, frozenset()) if tensor_blocks(spec)[t] == "attn"]
    plan = one_device_plan(spec, micro_batch_size=8, num_microbatches=2, offload=offload)
    profiles = prediction_profiles(plan, catalog, None)
    slow, fast = evaluate(plan, catalog, profiles), evaluate(plan, measured, profiles)
    assert slow.devices[0].offload_ms > fast.devices[0].offload_ms >= 0


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


def test_offloading_labels_follow_their_base_and_carry_the_offload():
    """``+offload`` labels: each runs right after the same plan without offload (added where not named), and its plan
    keeps the tensors ``bench_reference.plan_choices`` names in host memory: Cephalo's layer boundary under full
    recomputation, the attention block's held tensors without it."""
    from baton.memory import held_tensors, tensor_blocks
    from solver.baselines import cephalo_offload

    assert bench_gpu.with_bases(("none", "all", "none+offload", "all+offload")) == ("none", "none+offload", "all", "all+offload")
    assert bench_gpu.with_bases(("all+offload",)) == ("all", "all+offload")
    spec = bench_gpu.bench_model("gpt3-350m", 1024)
    plans = dict(bench_gpu.candidate_plans(spec, global_batch=16, micro_batches=(4,), recompute=("all+offload", "none+offload")))
    assert list(plans) == [f"mb 4 x 4, recompute {label}" for label in ("all", "all+offload", "none", "none+offload")]
    device = {name: plan.pipelines[0].stages[0].devices[0] for name, plan in plans.items()}
    assert device["mb 4 x 4, recompute all+offload"].offload == cephalo_offload(spec)
    attention = device["mb 4 x 4, recompute none+offload"].offload
    assert attention and set(attention) < set(held_tensors(spec, frozenset()))
    assert {tensor_blocks(spec)[t] for t in attention} == {"attn"} and {"q", "k", "v"} <= set(attention)
    assert not device["mb 4 x 4, recompute all"].offload and not device["mb 4 x 4, recompute none"].offload
    with pytest.raises(ValueError, match="unknown plan labels"):
        bench_gpu.candidate_plans(spec, global_batch=16, recompute=("most+offload",))
    # The cost model prices the offload (eq. 2o, 8o): host bytes, and without recomputation an exposed transfer on an H100.
    from baton.profile import Profile, ProfileSet, derive_table

    profiles = ProfileSet(spec, tables={"h100": Profile(derive_table(spec, "h100", micro_batches=(4,)), source="<derived>")})
    reports = {name: evaluate(plan, _h100(), profiles) for name, plan in plans.items()}
    off = reports["mb 4 x 4, recompute none+offload"].devices[0]
    assert off.host_activation_bytes > 0 and off.offload_ms > 0
    assert reports["mb 4 x 4, recompute none+offload"].iteration_time_ms > reports["mb 4 x 4, recompute none"].iteration_time_ms


def test_exposed_transfer_pairs_an_offloading_row_with_its_base():
    """The exposed transfer of an offloading row: its step less its base's, against offload_ms x micro-batches; a row
    whose base did not run has none, and the table says so with dashes."""
    def row(label, ms, predicted, *, offload=(), host=(None, 0.0), offload_ms=0.0, mb=2, model="m"):
        return {"plan": f"{model} mb {mb} x 4, recompute {label}", "model": model, "label": label, "micro_batch_size": mb,
                "num_microbatches": 4, "offload": list(offload), "iteration_ms": ms, "iteration_ms_predicted": predicted,
                "baton_median_ms": ms + 1.0, "offload_ms_predicted": offload_ms, "offload_late_bytes": 0 if offload else None,
                "host_activation_bytes": {"measured": host[0], "predicted": host[1]}}

    rows = [row("none", 100.0, 90.0), row("none+offload", 130.0, 110.0, offload=("q", "k", "v"), host=(4096, 4096.0),
                                          offload_ms=5.0),
            row("all+offload", 150.0, 140.0, offload=("layer_input",), host=(1024, 1000.0), offload_ms=1.0)]
    bench_gpu.attach_exposed(rows)
    e = rows[1]["exposed_transfer"]
    assert e["against"] == rows[0]["plan"] and e["measured_ms"] == 30.0 and e["measured_wall_ms"] == 30.0
    assert e["predicted_ms"] == 20.0 and e["predicted_iteration_difference_ms"] == 20.0 and e["error_ms"] == -10.0
    assert e["host_bytes_measured"] == 4096 and e["host_rel_error"] == 0.0
    assert rows[2]["exposed_transfer"] is None and "exposed_transfer" not in rows[0]
    lines = bench_gpu.exposed_markdown(rows)
    assert "## Exposed transfer of offloaded activations" in lines
    assert any(line.startswith("| m mb 2 x 4, recompute none+offload | q, k, v | 100.0 | 130.0 | +30.0 | +20.0 | +20.0 | -10.0 |")
               for line in lines)
    assert any(line.startswith("| m mb 2 x 4, recompute all+offload | layer_input | - | 150.0 | - | 4.0 |") for line in lines)
    assert bench_gpu.exposed_markdown(rows[:1]) == []


def test_cpu_mode_runs_the_whole_benchmark_end_to_end(tmp_path):
    """``--device cpu`` runs what a lent GPU runs, at tiny sizes: both tables, the plans (the offloading ones too),
    Baton against the reference loop, the cost model's report of every plan, the exposed transfer of the offloading
    ones, the files. So a GPU run can fail only on the GPU."""
    import json

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_gpu.py"), "--device", "cpu", "--out", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "TMPDIR": str(scratch)})
    assert res.returncode == 0, (res.stdout, res.stderr)
    assert not [p.name for p in scratch.iterdir() if p.name.startswith("baton-bench-gpu-")]  # its scratch is gone
    data = json.loads((tmp_path / "gpu.json").read_text())
    env, rows = data["environment"], data["plans"]
    assert "failed" not in env, env.get("failed")
    # The only model is the smallest: it gets the offloading plans, each right after its plan without offload.
    labels = ("none", "none+offload", "all", "all+offload")
    assert [r["plan"] for r in rows] == [f"tiny mb {mb} x {4 // mb}, recompute {label}" for mb in (1, 2) for label in labels]
    assert env["plans_asked"] == len(rows) and env["models"][0]["model"] == "tiny-bf16-s32"
    for r in rows:
        assert r["iteration_ms"] > 0 and r["iteration_ms_predicted"] > 0 and r["back_to_back"] is not None
        assert r["reference"]["tokens_per_s"] > 0 and r["ratio"] == pytest.approx(r["reference"]["median_ms"] / r["baton_median_ms"])
        assert {"pipeline_ms", "optimizer_ms"} <= set(r["phases_ms"])
        # The same computation: bf16 weights with fp32 masters on both sides, the same first batch.
        assert r["losses"]["baton"] == pytest.approx(r["losses"]["reference"], rel=1e-3)
    # Offloading rows: Baton's side ran the plan's offload (the host held activations; the reference holds none), and
    # the exposed transfer is measured against the row before (same micro-batch size, same recompute set).
    for base, r in zip(rows[::2], rows[1::2]):
        assert r["offload"] and not base["offload"] and r["label"] == base["label"] + "+offload"
        e = r["exposed_transfer"]
        assert e["against"] == base["plan"]
        assert e["measured_ms"] == pytest.approx(r["iteration_ms"] - base["iteration_ms"])
        assert e["measured_wall_ms"] == pytest.approx(r["baton_median_ms"] - base["baton_median_ms"])
        assert e["predicted_ms"] == pytest.approx(r["offload_ms_predicted"] * r["num_microbatches"]) and e["predicted_ms"] >= 0
        assert e["predicted_iteration_difference_ms"] == pytest.approx(r["iteration_ms_predicted"] - base["iteration_ms_predicted"])
        assert e["late_bytes"] == 0 and r["offload_copied_bytes"]["out"] == r["offload_copied_bytes"]["in"] > 0
        # The host bytes the runtime held against eq. 8o. Not to the byte: the CPU table measures a bf16 LayerNorm
        # saving 128-byte statistics per sample where the analytic split has 256, and baton.memory.tensor_bytes
        # spreads that over the LayerNorm's input too (x_mid, layer_input), which the runtime copies whole.
        assert e["host_bytes_measured"] > 0 and base["host_activation_bytes"]["predicted"] == 0
        assert e["host_bytes_predicted"] == pytest.approx(e["host_bytes_measured"], rel=0.02)
    none_off = {r["micro_batch_size"]: r["exposed_transfer"]["host_bytes_measured"] for r in rows if r["label"] == "none+offload"}
    assert none_off[2] == 2 * none_off[1]  # one micro-batch in flight on one stage: its size sets the host's peak
    md = (tmp_path / "gpu.md").read_text()
    assert "| tiny mb 2 x 2, recompute all |" in md and "Baton / reference tokens/s: median" in md
    assert "## Exposed transfer of offloaded activations" in md
    assert "| tiny mb 2 x 2, recompute all+offload | layer_input, attn_out, mlp_out, x_mid |" in md
    assert (tmp_path / "profiles" / "measured" / "h100__tiny-bf16-s32__s32.csv").is_file()
    assert (tmp_path / "profiles" / "measured" / "h100__tiny-bf16-s32__s32.command.json").is_file()
    assert (tmp_path / "gpu_table_back_to_back.csv").is_file()
