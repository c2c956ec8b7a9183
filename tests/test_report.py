"""`baton train --report`: measured figures next to the evaluator's, from real gloo processes.

With a table measured on this machine, the activation memory the runtime keeps must match the
prediction to 0.1% (index tensors of a few bytes are all that differ): both count the same tensors (the tensor model of docs/cost-model.md,
section 3, against autograd's saved tensors in the run), including recomputation segments and
uneven tensor-parallel shares. Times are only checked for being present: they are benchmarks.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from baton.model_spec import PRESETS
from baton.plan import save_plan, simple_plan
from tests.conftest import ROOT

TINY = PRESETS["tiny"]
ALL_OPS = ["ln1", "qkv", "attn_scores", "softmax", "attn_dropout", "attn_v", "out_proj", "resid1", "ln2", "fc1", "gelu",
           "fc2", "resid2"]


def baton(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "cli", *map(str, args)], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def measured_profiles(tmp_path_factory):
    d = tmp_path_factory.mktemp("profiles")
    res = baton("profile", "--device", "cpu", "--model", "tiny", "--micro-batch", "2", "--tp-shares", "0.25,0.75,1",
                "--reps", "1", "--warmup", "0", "--threads", "1", "--out", d / "measured" / "cpu__tiny__s32.csv")
    assert res.returncode == 0, res.stderr
    return d


@pytest.mark.parametrize("name,stages,layers,units,recompute", [
    ("pipeline with recompute", [[("local:0", 1)], [("local:1", 1)]], [3, 1], 1, {"local:0": ["attn_scores", "softmax", "attn_dropout", "attn_v"]}),
    ("uneven TP, one rank recomputes all", [[("local:0", 3), ("local:1", 1)]], [4], 4, {"local:1": ALL_OPS, "local:0": ["gelu", "fc2"]}),
])
def test_report_predicts_activation_memory_exactly(tmp_path, measured_profiles, name, stages, layers, units, recompute):
    plan = simple_plan(TINY, cluster="cpu2", stages=stages, layers=layers, units_per_layer=units,
                       micro_batch_size=2, num_microbatches=3, recompute=recompute)
    save_plan(plan, tmp_path / "plan.json")
    out = tmp_path / "report.json"
    res = baton("train", "--plan", tmp_path / "plan.json", "--steps", "2", "--report", out,
                "--cluster", ROOT / "clusters" / "cpu2.yaml", "--profiles", measured_profiles, "--timeout", "120")
    assert res.returncode == 0, res.stderr
    rep = json.loads(out.read_text())
    assert rep["steps_measured"] == 1
    assert rep["iteration_time_ms"]["measured"] > 0 and rep["iteration_time_ms"]["predicted"] > 0
    assert [s["index"] for s in rep["stages"]] == list(range(len(stages)))
    assert [d["id"] for d in rep["devices"]] == plan.device_ids()
    for d in rep["devices"]:
        assert d["measured"]["fwd_ms"] > 0 and d["measured"]["bwd_ms"] > 0
        assert d["measured"]["peak_saved_bytes"] == pytest.approx(d["predicted"]["activation_bytes"], rel=1e-3), d["id"]
        if d["id"] in recompute:
            assert d["measured"]["recompute_ms"] > 0 and d["predicted"]["recompute_ms"] > 0
    # The iteration splits into its phases, measured and predicted, and they add up.
    phases = rep["phases"]
    assert set(phases) == {"pipeline_ms", "grad_sync_ms", "optimizer_ms"}
    assert sum(v["measured"] for v in phases.values()) == pytest.approx(rep["iteration_time_ms"]["measured"])
    assert sum(v["predicted"] for v in phases.values()) == pytest.approx(rep["iteration_time_ms"]["predicted"])
    assert phases["optimizer_ms"]["measured"] > 0 and phases["optimizer_ms"]["predicted"] > 0
    tp = len(stages[0]) > 1
    for st in rep["stages"]:
        # Tensor-parallel all-reduces: 4 per layer and micro-batch, timed on TP rank 0 (none without TP).
        assert (st["allreduce_measured_ms"] > 0) == tp and (st["allreduce_predicted_ms"] > 0) == tp
    assert "measured vs predicted" in res.stdout and "optimizer ms" in res.stdout


def test_report_needs_a_cluster(tmp_path):
    plan = simple_plan(TINY, cluster="cpu2", stages=[[("local:0", 1)]], layers=[4], units_per_layer=1)
    save_plan(plan, tmp_path / "plan.json")
    res = baton("train", "--plan", tmp_path / "plan.json", "--steps", "1", "--report", tmp_path / "r.json")
    assert res.returncode == 2 and "--report needs --cluster" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "r.json").exists()


def test_profile_solve_train_report_end_to_end(tmp_path, measured_profiles):
    """The loop the fidelity benchmark runs, at test size: a table measured here, a plan solved from
    it, that plan trained over gloo, and the report comparing the two."""
    plan_path = tmp_path / "plan.json"
    res = baton("solve", "--cluster", ROOT / "clusters" / "cpu2.yaml", "--model", "tiny", "--global-batch", "4",
                "--profiles", measured_profiles, "--out", plan_path, "--time-limit", "60")
    assert res.returncode == 0, res.stderr
    report = tmp_path / "report.json"
    res = baton("train", "--plan", plan_path, "--steps", "2", "--report", report, "--cluster", ROOT / "clusters" / "cpu2.yaml",
                "--profiles", measured_profiles, "--timeout", "120")
    assert res.returncode == 0, res.stderr
    rep = json.loads(report.read_text())
    assert rep["plan"]["global_batch"] == 4
    for d in rep["devices"]:
        assert abs(d["activation_rel_error"]) < 0.02


def test_gradient_sync_sets_join_tied_stages_and_replicas():
    """The report's gradient-sync phase is taken per set of ranks joined by those all-reduces."""
    from runtime.report import _gradient_sync_sets

    three = simple_plan(TINY, cluster="cpu4", stages=[[("local:0", 1)], [("local:1", 1)], [("local:2", 1)]], layers=[2, 1, 1],
                        units_per_layer=1)
    assert _gradient_sync_sets(three) == [[0, 2]]  # the middle stage takes part in none
    one = simple_plan(TINY, cluster="cpu4", stages=[[("local:0", 2), ("local:1", 2)]], layers=[4], units_per_layer=4)
    assert _gradient_sync_sets(one) == []
