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
    """The table measured by ``baton profile --device cpu``, in this process (an interpreter start less); the
    command's --threads is set back afterwards."""
    import torch

    from tests.conftest import run_cli

    d = tmp_path_factory.mktemp("profiles")
    threads = torch.get_num_threads()
    try:
        code, _, stderr = run_cli("profile", "--device", "cpu", "--model", "tiny", "--micro-batch", "2", "--tp-shares",
                                  "0.25,0.75,1", "--reps", "1", "--warmup", "0", "--threads", "1",
                                  "--out", d / "measured" / "cpu__tiny__s32.csv")
    finally:
        torch.set_num_threads(threads)
    assert code == 0, stderr
    return d


def train_with_report(plan, tmp_path, steps: int, profiles):
    """``baton train PLAN --report`` on clusters/cpu2.yaml with ``profiles``: (the report it wrote, the run). The
    launcher runs in this process (its ranks are processes all the same): one interpreter start less."""
    from types import SimpleNamespace

    from tests.conftest import run_cli

    save_plan(plan, tmp_path / "plan.json")
    out = tmp_path / "report.json"
    code, stdout, stderr = run_cli("train", "--plan", tmp_path / "plan.json", "--steps", str(steps), "--report", out,
                                   "--cluster", ROOT / "clusters" / "cpu2.yaml", "--profiles", profiles, "--timeout", "120")
    assert code == 0, stderr
    return json.loads(out.read_text()), SimpleNamespace(returncode=code, stdout=stdout, stderr=stderr)


@pytest.mark.parametrize("name,stages,layers,units,recompute", [
    # Long: the uneven TP case below keeps recomputation segments too.
    pytest.param("pipeline with recompute", [[("local:0", 1)], [("local:1", 1)]], [3, 1], 1,
                 {"local:0": ["attn_scores", "softmax", "attn_dropout", "attn_v"]}, marks=pytest.mark.long),
    ("uneven TP, one rank recomputes all", [[("local:0", 3), ("local:1", 1)]], [4], 4, {"local:1": ALL_OPS, "local:0": ["gelu", "fc2"]}),
])
def test_report_predicts_activation_memory_exactly(tmp_path, measured_profiles, name, stages, layers, units, recompute):
    plan = simple_plan(TINY, cluster="cpu2", stages=stages, layers=layers, units_per_layer=units,
                       micro_batch_size=2, num_microbatches=3, recompute=recompute)
    rep, res = train_with_report(plan, tmp_path, 2, measured_profiles)
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


@pytest.mark.parametrize("flag, name", [("--report", "r.json"), ("--report-timeline", "t.png")])
def test_report_needs_a_cluster(tmp_path, flag, name):
    from tests.conftest import run_cli  # in this process: refused before any rank starts, no interpreter to start

    plan = simple_plan(TINY, cluster="cpu2", stages=[[("local:0", 1)]], layers=[4], units_per_layer=1)
    save_plan(plan, tmp_path / "plan.json")
    code, _, stderr = run_cli("train", "--plan", tmp_path / "plan.json", "--steps", "1", flag, tmp_path / name)
    assert code == 2 and f"{flag} needs --cluster" in stderr and "Traceback" not in stderr
    assert not (tmp_path / name).exists()


@pytest.mark.long  # each step runs quick on its own: the table (fixture), solving, train --report (tests above and below)
def test_profile_solve_train_report_end_to_end(tmp_path, measured_profiles):
    """The loop the fidelity benchmark runs, at test size: a table measured here, a plan solved from
    it, that plan trained over gloo, and the report comparing the two."""
    from tests.conftest import run_cli  # the solve in this process: one interpreter start less

    plan_path = tmp_path / "plan.json"
    code, _, stderr = run_cli("solve", "--cluster", ROOT / "clusters" / "cpu2.yaml", "--model", "tiny", "--global-batch", "4",
                              "--profiles", measured_profiles, "--out", plan_path, "--time-limit", "60")
    assert code == 0, stderr
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
    from runtime.measure.report import _gradient_sync_sets

    three = simple_plan(TINY, cluster="cpu4", stages=[[("local:0", 1)], [("local:1", 1)], [("local:2", 1)]], layers=[2, 1, 1],
                        units_per_layer=1)
    assert _gradient_sync_sets(three) == [[0, 2]]  # the middle stage takes part in none
    one = simple_plan(TINY, cluster="cpu4", stages=[[("local:0", 2), ("local:1", 2)]], layers=[4], units_per_layer=4)
    assert _gradient_sync_sets(one) == []


@pytest.mark.long  # every rank's measured spans on one clock: test_train_metrics.py's trace; the predicted timeline: test_pictures.py
def test_report_timeline_draws_every_ranks_measured_step_beside_the_prediction(tmp_path, measured_profiles, monkeypatch):
    """`baton train --report-timeline` from a real 2-process run, checked on the data handed to matplotlib.

    Catches: a rank's spans drawn on another device's row (the two stages run different 1F1B orders), spans
    of another step or out of order, recomputation or syncs on the wrong rows, per-rank clocks that do not
    line up (stage 1's first forward waits for stage 0's), rows that differ between the panels, a step
    other than the median one after the first, and a trace file left behind that the user did not ask for."""
    import tempfile

    from baton import pictures
    from baton.pipeline import schedule_1f1b
    from tests.conftest import run_cli

    plan = simple_plan(TINY, cluster="cpu2", stages=[[("local:0", 1)], [("local:1", 1)]], layers=[3, 1], units_per_layer=1,
                       micro_batch_size=2, num_microbatches=3, recompute={"local:0": ["attn_scores", "softmax", "attn_dropout", "attn_v"]})
    save_plan(plan, tmp_path / "plan.json")
    drawn = []
    draw = pictures.comparison_figure

    def spy(predicted, measured, **titles):
        drawn.append((predicted, measured, titles, draw(predicted, measured, **titles)))
        return drawn[-1][-1]

    monkeypatch.setattr(pictures, "comparison_figure", spy)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # where an unrequested trace would be left
    png = tmp_path / "timeline.png"
    code, out, err = run_cli("train", "--plan", tmp_path / "plan.json", "--steps", 3, "--report-timeline", png,
                             "--cluster", ROOT / "clusters" / "cpu2.yaml", "--profiles", measured_profiles,
                             "--run-dir", tmp_path / "run", "--timeout", 120)
    assert code == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p for p in scratch.iterdir() if p.name.startswith("baton-timeline-")]
    assert not [p for p in (tmp_path / "run").iterdir() if p.suffix == ".json"]  # no trace in the run directory
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    chosen = min(records[1:], key=lambda r: r["step_ms"])["step"]  # the lower median of steps 2 and 3
    assert f"(step {chosen}, predicted and measured)" in out

    (predicted, measured, titles, fig), = drawn
    ids = plan.device_ids()
    assert [r.label for r in predicted.rows] == [r.label for r in measured.rows]
    assert [ids[i] in r.label for i, r in enumerate(measured.rows)] == [True, True]  # one row per device, in rank order
    assert [len(ax.get_yticks()) for ax in fig.axes[:2]] == [2, 2] and f"step {chosen} " in titles["measured_title"]
    blocks = measured.blocks
    assert min(b.start_ms for b in blocks) == 0.0 and max(b.end_ms for b in blocks) == measured.end_ms
    assert all(b.end_ms >= b.start_ms for b in blocks)

    def of(row, *kinds):
        return sorted((b for b in blocks if b.row == row and b.kind in kinds), key=lambda b: b.start_ms)

    for row in (0, 1):
        # This stage's passes, in time order, are exactly its own 1F1B order (stage 0 runs F0 F1 B0 F2 B1 B2,
        # stage 1 F0 B0 F1 B1 F2 B2), so no pass is on another row, missing, repeated or from another step.
        assert [b.label for b in of(row, "forward", "backward")] == [f"{k}{i}" for k, i in schedule_1f1b(2, 3, row)]
        passes = of(row, "forward", "backward")
        assert all(a.end_ms <= b.start_ms + 1e-6 for a, b in zip(passes, passes[1:]))  # one rank runs one pass at a time
        sync, norm, opt = of(row, "embedding sync"), of(row, "step all-reduce"), of(row, "optimizer")
        assert len(sync) == len(norm) == len(opt) == 1  # the tied embedding joins the two stages
        assert passes[-1].end_ms <= sync[0].start_ms <= norm[0].start_ms <= opt[0].start_ms
        assert of(row, "wait") and of(row, "send activations" if row == 0 else "send gradients")
    backward0 = of(0, "backward")
    assert of(0, "recompute") and not of(1, "recompute")
    assert all(any(b.start_ms <= r.start_ms and r.end_ms <= b.end_ms for b in backward0) for r in of(0, "recompute"))
    assert of(1, "forward")[0].start_ms >= of(0, "forward")[0].end_ms  # one clock for both ranks
    # The predicted panel: the evaluator's step on the same rows.
    from baton.cluster import load_cluster
    from baton.evaluate import evaluate
    from baton.profile import ProfileSet

    pred = evaluate(plan, load_cluster(ROOT / "clusters" / "cpu2.yaml"), ProfileSet(TINY, directory=measured_profiles))
    assert predicted.end_ms == pytest.approx(pred.iteration_time_ms)
    assert [b.label for b in sorted((b for b in predicted.blocks if b.row == 1 and b.kind in ("forward", "backward")),
                                    key=lambda b: b.start_ms)] == [f"{k}{i}" for k, i in schedule_1f1b(2, 3, 1)]


def test_timeline_step_is_the_median_step_after_the_first_without_validation():
    from runtime.train.engine import StepStats
    from runtime.measure.report import timeline_step

    def steps(*ms, val=()):
        return [StepStats(step=i, loss=1.0, iteration_ms=t, val_loss=1.0 if i in val else None) for i, t in enumerate(ms)]

    assert timeline_step(steps(100.0)) == 0  # alone: the first step
    assert timeline_step(steps(100.0, 9.0)) == 1
    assert timeline_step(steps(100.0, 9.0, 5.0, 7.0)) == 3  # the first step's warm-up never counts
    assert timeline_step(steps(100.0, 9.0, 5.0, 7.0, val=(3,))) == 2  # a validation step draws validation too
    assert timeline_step(steps(100.0, 9.0, val=(1,))) == 1  # unless every later step ran one


@pytest.mark.long  # the report of uneven replicas with sharded state runs quick in test_zero_stages.py (stage 3, gathers)
def test_report_of_uneven_replicas_with_sharded_state(tmp_path, measured_profiles):
    """Two single-device replicas with their own batches (2 x 2 and 1 x 2) and the optimizer state split
    0.7/0.3: the report has a row per replica, the stages of both, the reduce-scatter and all-gather phases
    of eq. 15, and each device's state bytes as predicted for its owned share."""
    from dataclasses import replace

    from baton.plan import validate

    a = simple_plan(TINY, cluster="cpu2", stages=[[("local:0", 1)]], layers=[4], units_per_layer=1)
    b = simple_plan(TINY, cluster="cpu2", stages=[[("local:1", 1)]], layers=[4], units_per_layer=1)
    pipes = (replace(a.pipelines[0], micro_batch_size=2, num_microbatches=2), replace(b.pipelines[0], micro_batch_size=1, num_microbatches=2))
    pipes = tuple(replace(p, stages=(replace(p.stages[0], devices=(replace(p.stages[0].devices[0], shard_ratio=r),)),))
                  for p, r in zip(pipes, (0.7, 0.3)))
    plan = validate(replace(a, pipelines=pipes, zero_stage=1))
    rep, res = train_with_report(plan, tmp_path, 3, measured_profiles)
    assert [(r["samples"], r["micro_batch_size"]) for r in rep["replicas"]] == [(4, 2), (2, 1)]
    assert rep["replicas"][0]["pipeline_ms"]["predicted"] > rep["replicas"][1]["pipeline_ms"]["predicted"]
    assert all(r["pipeline_ms"]["measured"] > 0 for r in rep["replicas"])
    assert [(s["pipeline"], s["index"]) for s in rep["stages"]] == [(0, 0), (1, 0)]
    phases = rep["phases"]
    assert set(phases) == {"pipeline_ms", "grad_sync_ms", "gather_ms", "optimizer_ms"}
    assert phases["gather_ms"]["measured"] > 0 and phases["gather_ms"]["predicted"] == pytest.approx(phases["grad_sync_ms"]["predicted"])
    assert sum(v["measured"] for v in phases.values()) == pytest.approx(rep["iteration_time_ms"]["measured"])
    assert sum(v["predicted"] for v in phases.values()) == pytest.approx(rep["iteration_time_ms"]["predicted"])
    for d, share in zip(rep["devices"], (0.7, 0.3)):
        # fp32: no master copy, two moments of the owned share (whole parameters: a few bytes per group off)
        assert d["measured"]["optimizer_bytes"] == pytest.approx(d["predicted"]["optimizer_bytes"], abs=64)
        assert d["predicted"]["optimizer_bytes"] == pytest.approx(share * d["predicted"]["weights_bytes"] * 2, rel=1e-9)
    assert "replica 1 pipeline ms" in res.stdout and "gather ms" in res.stdout
