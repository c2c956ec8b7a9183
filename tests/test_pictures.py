"""``baton show PLAN --timeline/--memory`` (baton/pictures.py): pictures drawn from the evaluator's report."""
from __future__ import annotations

import pytest

from baton.cluster import load_cluster
from baton.evaluate import evaluate
from baton.plan import load_plan, save_plan, simple_plan
from baton.profile import ProfileSet
from baton.model_spec import PRESETS
from tests.conftest import ROOT, run_cli

pytest.importorskip("matplotlib")

HAND = ROOT / "examples" / "a100x2_t4x2_gpt3-1.3b_hand.json"
A100_T4 = ROOT / "clusters" / "a100x2_t4x2.yaml"
CPU4 = ROOT / "clusters" / "cpu4.yaml"


def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def _replicated_plan(tmp_path):
    """Two replicas of a two-stage pipeline on cpu4, one device recomputing: every kind of block."""
    spec = PRESETS["small"]
    one = simple_plan(spec, cluster="cpu4", stages=[[("local:0", 1)], [("local:1", 1)]], layers=[4, 2], units_per_layer=1,
                      micro_batch_size=2, num_microbatches=4, recompute={"local:0": ["attn_scores", "softmax"]})
    two = simple_plan(spec, cluster="cpu4", stages=[[("local:2", 1)], [("local:3", 1)]], layers=[4, 2], units_per_layer=1,
                      micro_batch_size=2, num_microbatches=4)
    from dataclasses import replace

    from baton.plan import validate

    path = tmp_path / "dp.json"
    save_plan(validate(replace(one, pipelines=one.pipelines + two.pipelines)), path)
    return path


def test_show_plan_draws_timeline_and_memory(tmp_path):
    """Both pictures are written (real PNGs, a row per device) and the tables are printed as by evaluate."""
    plan = _replicated_plan(tmp_path)
    code, out, err = run_cli("show", plan, "--cluster", CPU4, "--timeline", tmp_path / "t.png", "--memory", tmp_path / "m.png")
    assert code == 0, err
    assert "iteration" in out and f"wrote {tmp_path / 't.png'}" in out
    (w1, h1), (w2, h2) = _png_size(tmp_path / "t.png"), _png_size(tmp_path / "m.png")
    assert w1 > 1000 and h1 > 200 and w2 > 1000 and h2 > 200
    code, _, err = run_cli("show", HAND, "--cluster", A100_T4, "--timeline", tmp_path / "hand.png")
    assert code == 0, err


def test_timeline_follows_the_evaluated_schedule(tmp_path):
    """The schedule drawn ends where the evaluator's exact 1F1B time ends (catches a picture that places
    passes by its own formula), every stage runs each micro-batch forward and backward once, and the
    figure spans the whole iteration (syncs and optimizer included)."""
    from baton import pictures

    plan = load_plan(_replicated_plan(tmp_path))
    report = evaluate(plan, load_cluster(CPU4), ProfileSet(plan.model))
    schedules = pictures.replica_schedules(report, plan.num_microbatches)
    assert sorted(schedules) == [0, 1]
    ends = [max(b for stage in sched for _, _, _, b in stage) for sched in schedules.values()]
    assert max(ends) == pytest.approx(report.pipeline_ms, rel=1e-9)
    for sched in schedules.values():
        for stage in sched:
            assert sorted((k, i) for k, i, _, _ in stage) == sorted((k, i) for k in "FB" for i in range(plan.num_microbatches))
    fig = pictures.timeline_figure(report, plan.num_microbatches, title="t")
    ax = fig.axes[0]
    assert ax.get_xlim()[1] >= report.iteration_time_ms and len(ax.get_yticks()) == len(report.devices)
    fig = pictures.memory_figure(report, title="m")
    bars = [p for p in fig.axes[0].patches]
    assert len(bars) == len(report.devices) * len(pictures.MEMORY_TERMS)
    # the stacked bar of each device ends at its predicted peak
    d0 = report.devices[0]
    assert sum(p.get_width() for p in bars[0::len(report.devices)]) == pytest.approx(d0.peak_memory_bytes / 1024**3, rel=1e-9)


def test_show_plan_errors_are_one_line_and_write_nothing(tmp_path):
    plan = _replicated_plan(tmp_path)
    cases = [
        (["show", plan, "--timeline", tmp_path / "t.png"], "--cluster"),
        (["show", CPU4, "--timeline", tmp_path / "t.png"], "give a plan JSON"),
        (["show", plan, "--cluster", CPU4, "--timeline", tmp_path], "is a directory"),
        (["show", plan, "--cluster", A100_T4, "--memory", tmp_path / "t.png"], "was made for cluster 'cpu4'"),
    ]
    for args, needle in cases:
        code, out, err = run_cli(*args)
        assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, (args, err)
    assert not (tmp_path / "t.png").exists()
    assert not [p for p in tmp_path.iterdir() if p.suffix == ".tmp"]


def test_predicted_timeline_data_follows_the_schedule_on_every_device_row(tmp_path):
    """The blocks handed to matplotlib: one row per device in plan order, each row with its own stage's
    passes, recomputation only on the device that recomputes (inside its backward passes), transfers only
    where there is a next or previous stage, and every device's optimizer step ending the iteration."""
    from baton import pictures

    plan = load_plan(_replicated_plan(tmp_path))
    report = evaluate(plan, load_cluster(CPU4), ProfileSet(plan.model))
    timeline = pictures.predicted_timeline(report, plan.num_microbatches)
    assert [r.label.split()[2] for r in timeline.rows] == plan.device_ids()
    schedules = pictures.replica_schedules(report, plan.num_microbatches)
    for y, d in enumerate(report.devices):
        mine = [b for b in timeline.blocks if b.row == y]
        passes = [(b.label, b.start_ms, b.end_ms) for b in mine if b.kind in ("forward", "backward")]
        assert passes == [(f"{k}{i}", a, b) for k, i, a, b in schedules[d.pipeline][d.stage]]
        kinds = {b.kind for b in mine}
        assert ("recompute" in kinds) == (d.id == "local:0")
        assert ("send activations" in kinds) == (d.stage == 0) and ("send gradients" in kinds) == (d.stage == 1)
        assert max(b.end_ms for b in mine if b.kind == "optimizer") <= report.iteration_time_ms + 1e-9
    recompute = [b for b in timeline.blocks if b.kind == "recompute"]
    backward = [b for b in timeline.blocks if b.kind == "backward" and b.row == 0]
    assert len(recompute) == plan.num_microbatches
    assert all(any(b.start_ms == r.start_ms and r.end_ms <= b.end_ms for b in backward) for r in recompute)
    with pytest.raises(ValueError, match="same rows"):
        pictures.comparison_figure(timeline, pictures.Timeline(timeline.rows[:1], [], 1.0), title="", predicted_title="",
                                   measured_title="")


def test_the_tied_sync_is_drawn_only_on_replicas_of_more_than_one_stage():
    """A replica of one stage beside a replica of two: the evaluator charges the tied embedding's all-reduce (eq. 11)
    for the second only, and the timeline draws it on that replica's first and last stage, not on the lone stage."""
    from dataclasses import replace

    from baton import pictures
    from baton.plan import validate

    spec = PRESETS["small"]
    alone = simple_plan(spec, cluster="cpu4", stages=[[("local:0", 1)]], layers=[6], units_per_layer=1,
                        micro_batch_size=2, num_microbatches=4)
    two = simple_plan(spec, cluster="cpu4", stages=[[("local:1", 1)], [("local:2", 1)]], layers=[4, 2], units_per_layer=1,
                      micro_batch_size=2, num_microbatches=4)
    plan = validate(replace(alone, pipelines=alone.pipelines + two.pipelines))
    report = evaluate(plan, load_cluster(CPU4), ProfileSet(plan.model))
    assert report.embedding_sync_ms > 0
    timeline = pictures.predicted_timeline(report, plan.num_microbatches)
    drawn = {report.devices[b.row].id for b in timeline.blocks if b.kind == "embedding sync"}
    assert drawn == {"local:1", "local:2"}


def test_timeline_of_a_1024_device_plan_shows_one_device_per_stage_and_says_so():
    """A 1024-GPU plan (32 replicas of 4 stages, 8-way tensor parallel) would need 1024 rows, over 400
    inches of picture: it is drawn as one row per stage of replica 0, with a note, in a picture of
    ordinary size."""
    from dataclasses import replace

    from baton import pictures
    from baton.plan import validate

    spec = PRESETS["gpt3-1.3b"]
    pipes = []
    for r in range(32):
        stages = [[(f"{kind}-node-{r}:{j}", 1) for j in range(8)] for kind in ("h100", "a100-80gb", "v100-32gb", "a10g")]
        one = simple_plan(spec, cluster="scale_1024", stages=stages, layers=[9, 7, 5, 3], units_per_layer=8,
                          micro_batch_size=1, num_microbatches=8)
        pipes.append(one.pipelines[0])
    plan = validate(replace(one, pipelines=tuple(pipes)))
    report = evaluate(plan, load_cluster(ROOT / "clusters" / "scale_1024.yaml"), ProfileSet(plan.model))
    rows = pictures.timeline_rows(report)
    assert len(rows) == 1024
    keep, note = pictures._visible(pictures.predicted_timeline(report, plan.num_microbatches))
    assert [rows[i].label.split()[2] for i in keep] == ["h100-node-0:0", "a100-80gb-node-0:0", "v100-32gb-node-0:0", "a10g-node-0:0"]
    assert note.startswith("showing 4 of 1024 devices")
    fig = pictures.timeline_figure(report, plan.num_microbatches, title="t")
    try:
        assert len(fig.axes[0].get_yticks()) == 4 and fig.get_size_inches()[1] < 6
        assert any(t.get_text() == note for t in fig.texts)
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def test_memory_picture_groups_alike_devices_and_counts_the_sync_staging(tmp_path):
    """64 single-device replicas with sharded state, all of it owned by one device: alike devices share a
    bar, and every bar still ends at its devices' predicted peak, the staging of the sharded sync (eq. 14)
    included where it exceeds the activations it never coexists with."""
    from baton import pictures
    from baton.model_spec import PRESETS
    from baton.plan import DeviceShare, Pipeline, Plan, Stage, validate

    cluster = load_cluster(ROOT / "clusters" / "scale_64.yaml")
    spec = PRESETS["gpt3-350m"]
    pipes = tuple(Pipeline(stages=(Stage(first_layer=0, num_layers=spec.num_layers, units_per_layer=1,
                                         devices=(DeviceShare(id=d.id, units=1, shard_ratio=1.0 if i == 0 else 0.0),)),))
                  for i, d in enumerate(cluster.devices))
    plan = validate(Plan(model=spec, cluster=cluster.name, micro_batch_size=1, num_microbatches=1, pipelines=pipes, zero_stage=1))
    report = evaluate(plan, cluster, ProfileSet(spec))
    assert report.devices[0].sync_buffer_bytes > report.devices[0].activation_bytes
    fig = pictures.memory_figure(report, title="m")
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert len(labels) == 3 and sum("alike" in x for x in labels) == 2  # the owner, then the other A100s and the V100s
    n = len(labels)
    bars = ax.patches
    assert len(bars) == n * len(pictures.MEMORY_TERMS)
    peaks = {d.id: d.peak_memory_bytes for d in report.devices}
    for row, label in enumerate(labels):
        width = sum(p.get_width() for p in bars[row::n])
        dev = next(d for d in report.devices if d.id in label)
        assert width == pytest.approx(peaks[dev.id] / 1024**3, rel=1e-9)
    assert "64 devices in 3 bars" in " ".join(t.get_text() for t in fig.texts)
    # The timeline of so many replicas shows replica 0 and the slowest one (a V100 here), and says so.
    keep, note = pictures._visible(pictures.predicted_timeline(report, 1))
    rows = pictures.timeline_rows(report)
    assert [rows[i].label.split()[2].split("-")[0] for i in keep] == ["a100", "v100"] and "the last to finish" in note
