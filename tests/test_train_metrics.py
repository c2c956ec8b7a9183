"""``baton train`` as a user runs it: a config file, a schedule, clipping, validation, the metrics log.

Real ranks over gloo on a tiny model and a byte-level dataset made here.
"""
from __future__ import annotations

import json
import shutil

import pytest
import yaml

from baton.plan import save_plan
from runtime.launch.launcher import TrainConfig, train
from runtime.train.optim_settings import LRSchedule
from tests.conftest import run_cli
from tests.runtime_helpers import plan_of, tiny


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from runtime.data.tokens import TokenizerChoice, prepare

    root = tmp_path_factory.mktemp("train")
    (root / "a.txt").write_text("baton plans uneven pipelines on mixed gpus, then trains them exactly. " * 80)
    prepare([root / "a.txt"], root / "ds", TokenizerChoice(bytes=True), val_fraction=0.2)
    plan = plan_of(tiny(0.0), [[1, 1], [1]], [3, 1], [2, 1], m=2)  # TP 1:1 then one rank: 3 ranks
    save_plan(plan, root / "plan.json")
    return root, plan


def _one_line_error(code, out, err, *needles):
    assert code == 2, (code, out, err)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in out + err, err
    for n in needles:
        assert n in err, err


def test_config_file_schedule_validation_and_metrics_log(setup, tmp_path):
    """Catches: a config value that the command line cannot override, YAML's '3e-3' string refused,
    a metrics log only written to terminals, a learning rate that does not follow the schedule,
    validation losses missing from the log or on the wrong steps, a resolved config that cannot be
    read back."""
    root, _ = setup
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"plan: {root / 'plan.json'}\nsteps: 9\nlr: 3e-3\nwarmup-steps: 2\ndecay: cosine\nlr_min: 3.0e-4\n"
                   f"clip-grad: 0.5\nweight_decay: 0.1\neval-every: 2\ndata: {root / 'ds'}\nlog-every: 2\ntimeout: 60\n")
    code, out, err = run_cli("train", "--config", cfg, "--steps", 5, "--run-dir", tmp_path / "run")
    assert code == 0, err
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    sched = LRSchedule(lr=3e-3, lr_min=3e-4, warmup_steps=2, decay="cosine", decay_steps=5)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]  # --steps 5 beat the file's 9
    assert [r["lr"] for r in records] == pytest.approx([sched.lr_at(i) for i in range(5)])
    assert [("val_loss" in r) for r in records] == [False, True, False, True, True]  # every 2 and at the end
    for r in records:
        assert r["grad_norm"] > 0 and r["tokens_per_s"] > 0 and r["step_ms"] > 0 and r["mfu"] > 0
        assert r["clipped"] == (r["grad_norm"] > 0.5) and r["skipped"] is False
        assert sorted(r["memory_bytes"]) == ["d0:0", "d0:1", "d0:2"] and all(v > 0 for v in r["memory_bytes"].values())
    # Not a terminal: readable lines every 2 steps, with validation and at the end.
    lines = [line for line in out.splitlines() if line.startswith("step ") and "/5" in line]
    assert [line.split()[1] for line in lines] == ["2/5", "4/5", "5/5"], out
    assert "val " in lines[0] and "tok/s" in lines[0] and "ETA" in lines[0]
    resolved = yaml.safe_load((tmp_path / "run" / "resolved.yaml").read_text())
    assert resolved["steps"] == 5 and resolved["lr"] == 3e-3 and resolved["decay"] == "cosine" and "config" not in resolved
    # The resolved file is itself a config: a run from it writes the same options.
    code, out, err = run_cli("train", "--config", tmp_path / "run" / "resolved.yaml", "--run-dir", tmp_path / "again",
                             "--steps", 1, "--eval-every", 0)
    assert code == 0, err
    again = yaml.safe_load((tmp_path / "again" / "resolved.yaml").read_text())
    assert {k: v for k, v in again.items() if k not in ("run-dir", "steps", "eval-every")} == \
           {k: v for k, v in resolved.items() if k not in ("run-dir", "steps", "eval-every")}


@pytest.mark.long  # two runs; tests/test_runtime_train.py resumes in the default run, and the schedule and clipping are checked above
def test_schedule_and_clipping_resume_exactly(setup, tmp_path):
    """Four steps straight, or two then a resume to four, give the same losses and grad norms: the
    schedule and clipping depend on the step only, and the checkpoint records their settings."""
    root, plan = setup
    common = dict(plan=plan, steps=4, lr=3e-3, lr_min=3e-4, warmup_steps=1, decay="linear", clip_grad=0.5,
                  weight_decay=0.1, data=str(root / "ds"), timeout_s=60)
    full = train(TrainConfig(**common, save_dir=str(tmp_path / "a"), save_every=2))
    meta = json.loads((tmp_path / "a" / "step-000002" / "meta.json").read_text())
    assert meta["optimizer"]["clip_grad"] == 0.5 and meta["optimizer"]["weight_decay"] == 0.1
    assert meta["optimizer"]["schedule"] == LRSchedule(lr=3e-3, lr_min=3e-4, warmup_steps=1, decay="linear",
                                                       decay_steps=4).as_dict()
    shutil.copytree(tmp_path / "a" / "step-000002", tmp_path / "b" / "step-000002")
    resumed = train(TrainConfig(**common, save_dir=str(tmp_path / "b"), resume=True))
    for got, want in zip(resumed, full[2:]):
        assert got.lr == want.lr
        assert got.loss == pytest.approx(want.loss, rel=1e-5) and got.grad_norm == pytest.approx(want.grad_norm, rel=1e-5)


@pytest.mark.parametrize("args, config, needles", [
    (["--decay", "step"], None, ["--decay", "step"]),
    (["--lr-min", "1"], None, ["--lr-min"]),
    (["--clip-grad", "-1"], None, ["--clip-grad"]),
    (["--warmup-steps", "-3"], None, ["--warmup-steps"]),
    (["--eval-every", "2"], None, ["--eval-every", "--data"]),
    (["--log-every", "0"], None, ["--log-every"]),
    ([], "stepz: 3\n", ["stepz", "unknown option"]),
    ([], "steps: three\n", ["steps", "three"]),
    ([], "lr: [1, 2]\n", ["lr", "single value"]),
    ([], "- 1\n", ["mapping"]),
    ([], "steps: 1\nsteps: 2\n", ["duplicate"]),
])
def test_bad_options_and_config_files_are_one_line_errors(setup, tmp_path, args, config, needles):
    root, _ = setup
    extra = []
    if config is not None:
        (tmp_path / "c.yaml").write_text(config)
        extra = ["--config", tmp_path / "c.yaml"]
    code, out, err = run_cli("train", "--plan", root / "plan.json", "--run-dir", tmp_path / "run", *args, *extra)
    _one_line_error(code, out, err, *needles)
    assert not (tmp_path / "run").exists()  # refused before any rank started: no run directory


def test_trace_holds_every_ranks_measured_spans_on_one_clock(setup, tmp_path):
    """Catches: ranks missing from the trace, spans of the wrong kind or count, recomputation or
    all-reduces not recorded, and per-rank clocks that do not line up (a stage's forward of micro-batch
    0 must start after the previous stage's has ended: it waits for its activation). The file also keeps
    the rules Perfetto's JSON importer applies (tests/test_trace_format.py)."""
    from runtime.measure.trace import pid_of
    from tests.test_trace_format import perfetto_json_problems

    root, _ = setup
    plan = plan_of(tiny(0.0), [[1, 1], [1]], [3, 1], [2, 1], m=2, recompute={2: ["gelu"]})
    steps = 2
    train(TrainConfig(plan=plan, steps=steps, data=str(root / "ds"), eval_every=2, timeout_s=60,
                      trace=str(tmp_path / "t" / "trace.json")))
    trace = json.loads((tmp_path / "t" / "trace.json").read_text())
    assert perfetto_json_problems(trace) == []
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert sorted(names) == [pid_of(r) for r in range(3)] and "stage 1" in names[pid_of(2)] and "d0:1" in names[pid_of(1)]
    spans = [e for e in events if e["ph"] == "X"]

    def of(rank, cat):
        return [e for e in spans if e["pid"] == pid_of(rank) and e["cat"] == cat]

    for rank in range(3):
        assert len(of(rank, "forward")) == len(of(rank, "backward")) == steps * plan.num_microbatches
        assert len(of(rank, "optimizer")) == steps and len(of(rank, "eval")) == 1
        assert any(e["name"] == "grad norm, step all-reduce" for e in of(rank, "allreduce"))
    assert of(2, "recompute") and not of(0, "recompute")  # only rank 2's plan entry recomputes
    assert any(e["name"] == "tp all-reduce" for e in of(0, "allreduce")) and not any(e["name"] == "tp all-reduce" for e in of(2, "allreduce"))
    assert any(e["name"].startswith("recv from") for e in of(2, "p2p")) and any(e["name"].startswith("send to") for e in of(0, "p2p"))
    f0_stage0 = next(e for e in of(0, "forward") if e["args"] == {"step": 0, "mb": 0})
    f0_stage1 = next(e for e in of(2, "forward") if e["args"] == {"step": 0, "mb": 0})
    assert f0_stage1["ts"] >= f0_stage0["ts"] + f0_stage0["dur"]


def test_metrics_log_writes_null_for_non_finite_counts_skips_and_feeds_tensorboard(setup, tmp_path, monkeypatch):
    """An fp16 overflow step (inf grad norm, NaN loss) must still be valid JSON; TensorBoard, when
    importable, gets the same scalars (a stand-in writer here: tensorboard is an optional dependency)."""
    import math

    import runtime.measure.metrics as metrics
    from runtime.train.engine import StepStats

    _, plan = setup
    scalars = []

    class Board:
        def add_scalar(self, tag, value, step):
            scalars.append((tag, value, step))

        def flush(self):
            pass

        def close(self):
            pass

    monkeypatch.setattr(metrics, "_summary_writer_class", lambda: lambda log_dir: Board())
    log = metrics.MetricsLog(tmp_path / "m", plan, peak_flops=1e12)
    log.write(StepStats(step=0, loss=math.nan, iteration_ms=10.0, tokens=128, grad_norm=math.inf, skipped=True,
                        memory_bytes=[1.0, 2.0, 3.0], lr=1e-3))
    log.write(StepStats(step=1, loss=2.0, iteration_ms=10.0, tokens=128, grad_norm=0.5, memory_bytes=[1.0, 2.0, 3.0],
                        lr=1e-3, val_loss=2.5))
    log.close()
    first, second = [json.loads(line) for line in (tmp_path / "m" / "metrics.jsonl").read_text().splitlines()]
    assert first["loss"] is None and first["grad_norm"] is None and first["skipped_steps"] == 1 and first["skipped"]
    assert second["skipped_steps"] == 1 and second["val_loss"] == 2.5 and second["tokens_per_s"] == pytest.approx(12800)
    assert ("val/loss", 2.5, 2) in scalars and ("train/loss", 2.0, 2) in scalars
    assert not any(tag == "train/loss" and step == 1 for tag, _, step in scalars)  # NaN is not plotted


@pytest.mark.long  # a real run; the scalars handed to TensorBoard are checked by default in the test above
def test_tensorboard_event_files_hold_the_metrics_log_step_by_step(setup, tmp_path):
    """A real run with tensorboard installed, read back by TensorBoard's own reader: every scalar of every
    step equals the metrics.jsonl line of that step (float32, as TensorBoard stores it). Catches: event
    files not written or not flushed, scalars on the wrong step (metrics.jsonl counts steps done, from 1),
    a metric missing, and validation losses on steps that ran no validation."""
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install -e '.[tensorboard]'); "
                                              "the event files are optional")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root, _ = setup
    plan = plan_of(tiny(0.0), [[1], [1]], [3, 1], [1, 1], m=2)
    run = tmp_path / "run"
    train(TrainConfig(plan=plan, steps=3, data=str(root / "ds"), eval_every=2, lr=1e-3, warmup_steps=1, decay="cosine",
                      timeout_s=60, run_dir=str(run)))
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    board = EventAccumulator(str(run), size_guidance={"scalars": 0})  # 0: keep every point
    board.Reload()
    tags = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm", "tokens_per_s": "train/tokens_per_s",
            "mfu": "train/mfu", "step_ms": "train/step_ms", "val_loss": "val/loss"}
    assert set(board.Tags()["scalars"]) == set(tags.values())
    for key, tag in tags.items():
        want = [(r["step"], r[key]) for r in records if r.get(key) is not None]
        got = [(e.step, e.value) for e in board.Scalars(tag)]
        assert [s for s, _ in got] == [s for s, _ in want], tag
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6), tag
    assert [e.step for e in board.Scalars("val/loss")] == [2, 3]  # every 2 steps and at the end
