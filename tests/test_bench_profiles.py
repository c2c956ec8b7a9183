"""bench/bench_profiles.py's rows: published figures derived as they were measured, measured tables against
their own model (read from the command file beside them), each table counted once; the fitting and held-out
sets of the reference figures and how the derivation scores on each."""
from __future__ import annotations

import dataclasses
import shutil
import sys

import pandas as pd
import pytest

from baton import catalog
from baton.model_spec import PRESETS
from baton.operators import layer_operators
from baton.profile import derive_table
from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import bench_profiles  # noqa: E402

H200_TABLE = ROOT / "profiles" / "measured" / "h200__gpt3-350m-bf16-s1024__s1024.csv"
REFERENCE = ROOT / "profiles" / "reference" / "layers.csv"

SOURCE_SET = {"issue14": "fit", "lambda": "fit", "metis": "held_out", "aceso": "held_out", "nvidia": "held_out",
              "nvidiatf": "held_out", "sia": "held_out", "amp": "held_out"}
"""The split rule of profiles/reference/README.md, by the source a group's name starts with: the catalog's fractions
were chosen on the issue-14 and Lambda figures; every other source is held out."""

HELD_OUT_GEOMEAN, HELD_OUT_WORST = 1.17, 1.72
"""What the derivation reaches on the held-out set now (1.166x / 1.714x over 45 figures: 1.145x / 1.335x on the 22
added on 2026-11-26, 1.19x / 1.71x on the 23 added, and first scored, on 2026-11-28; bench/results/profiles.md),
rounded up: a change to the catalog's fractions or to the derivation that does worse on figures it was not fitted to
fails here. Lower these when the derivation improves; the issue-27 targets are bench_profiles.TARGET_GEOMEAN/WORST."""


def _layer_ms(spec, gpu, mb):
    df = derive_table(spec, gpu, micro_batches=(mb,), shares=(1.0,))
    return bench_profiles.layer_ms_of(df, [o.name for o in layer_operators(spec)], mb)


def test_reference_figures_are_derived_with_the_attention_they_ran():
    """The published figures predate fused attention: each is derived with the eager operators its row names,
    whatever the presets' default."""
    rows = bench_profiles.reference_rows(ROOT / "profiles" / "reference" / "layers.csv")
    v100 = next(r for r in rows if r["group"].startswith("issue14") and r["gpu"] == "v100-16gb")
    spec = PRESETS["gpt3-1.3b"].with_overrides(seq_len=v100["seq_len"], dtype="fp32")
    assert spec.attention == "fused"  # the default, which the row must not take
    eager = _layer_ms(spec.with_overrides(attention="eager"), "v100-16gb", v100["micro_batch"])
    assert v100["derived_ms"] == pytest.approx(eager)
    assert v100["derived_ms"] != pytest.approx(_layer_ms(spec, "v100-16gb", v100["micro_batch"]))


def test_a_measured_table_is_compared_with_its_own_model_once(tmp_path):
    """bench_gpu's table names a model no preset has; the command file beside it holds the model. The same
    table in the shipped and the user's directory is one row."""
    user = tmp_path / "measured"
    user.mkdir()
    for suffix in (".csv", ".command.json"):
        shutil.copy(H200_TABLE.with_suffix(suffix), user)
    rows = bench_profiles.measured_table_rows(H200_TABLE.parent, user)
    assert len([r for r in rows if r["device_as_named"] == H200_TABLE.name]) == 1
    row = next(r for r in rows if r["device_as_named"] == H200_TABLE.name)
    spec = PRESETS["gpt3-350m"].with_overrides(dtype="bf16", attention="fused", dropout=0.0, seq_len=1024,
                                               name="gpt3-350m-bf16-s1024")
    smallest = int(min(pd.read_csv(H200_TABLE).micro_batch))  # the row is the table's smallest micro-batch
    assert (row["gpu"], row["dtype"], row["micro_batch"]) == ("h200", "bf16", smallest)
    assert row["derived_ms"] == pytest.approx(_layer_ms(spec, "h200", smallest))
    assert row["measured_value"] > 0


def _summary():
    return bench_profiles.score(bench_profiles.reference_rows(REFERENCE))


def test_every_reference_figure_is_in_the_set_its_source_belongs_to():
    rows = bench_profiles.reference_rows(REFERENCE)
    assert {r["set"] for r in rows} == {"fit", "held_out"}
    wrong = [(r["group"], r["gpu"], r["set"]) for r in rows if SOURCE_SET[r["group"].split("-")[0]] != r["set"]]
    assert not wrong
    for name in ("fit", "held_out"):  # each set has relative figures in fp32 (TF32 included) and in fp16
        scored = {r["dtype"] for r in rows if r["set"] == name and r["gpu"] != r["reference_gpu"]}
        assert {"fp32", "fp16"} <= scored, name


def test_the_fitting_set_meets_the_targets_and_the_held_out_set_stays_within_its_bounds():
    """The fitting set is what the fractions were chosen on (issue 14's targets); the held-out set is scored
    apart, from the committed reference file, and must not get worse."""
    summary = _summary()
    fit, held = summary["fit"], summary["held_out"]
    assert fit["count"] >= 18 and held["count"] >= 45
    assert fit["geomean"] <= bench_profiles.TARGET_GEOMEAN and fit["worst"] <= bench_profiles.TARGET_WORST, fit
    assert held["geomean"] <= HELD_OUT_GEOMEAN and held["worst"] <= HELD_OUT_WORST, held
    assert set(summary["held_out_by_added"]) == {"2026-11-26", "2026-11-28"}


@pytest.mark.xfail(strict=True, reason="issue 27: the held-out set misses the targets (1.17x / 1.71x over 45 figures): "
                                        "the figures added on 2026-11-28, scored once against the derivation as it stood, "
                                        "show small micro-batches slower than derived (TF1 BERT SQuAD at 2-4 sequences, a "
                                        "GPT-2 layer's forward at micro-batch 1 on a T4)")
def test_the_held_out_set_meets_the_targets():
    """Strict: the day the derivation meets the targets on the held-out set this passes, and the bounds above
    are to be tightened to it."""
    held = _summary()["held_out"]
    assert held["geomean"] <= bench_profiles.TARGET_GEOMEAN and held["worst"] <= bench_profiles.TARGET_WORST, held


@pytest.mark.parametrize(("arch", "field", "value"), [("ampere-ga100", "gemm_tf32", 0.8), ("volta", "gemm_fp32", 0.6),
                                                      ("ampere-ga100", "bandwidth", 1.0)])
def test_a_fraction_set_far_off_breaks_the_held_out_bounds(monkeypatch, arch, field, value):
    """The held-out check reads the catalog as the derivation does: A100 TF32 GEMMs credited with 80% of the
    peak, V100 SGEMM with 60%, or A100 streaming at the full datasheet bandwidth each push it past its bounds."""
    monkeypatch.setitem(catalog.ARCHITECTURES, arch, dataclasses.replace(catalog.ARCHITECTURES[arch], **{field: value}))
    held = _summary()["held_out"]
    assert held["geomean"] > HELD_OUT_GEOMEAN or held["worst"] > HELD_OUT_WORST, held


def _row(rows, group, gpu):
    return next(r for r in rows if r["group"] == group and r["gpu"] == gpu)


def test_transformer_xl_figures_are_derived_as_its_layer_over_memory_and_segment():
    """Transformer-XL attends over its cached memory and the segment and adds a relative-position score term: its
    rows are derived from that layer (bench/reference_layers.py), which costs more than a GPT layer of the segment,
    with the attention dropout its config has (wt103_large.yaml: dropatt 0.2)."""
    import reference_layers

    rows = bench_profiles.reference_rows(REFERENCE)
    row = _row(rows, "nvidia-txl-large-fp16", "a100-40gb")
    assert row["layer"] == reference_layers.TRANSFORMER_XL
    ref = pd.read_csv(REFERENCE)
    cells = ref[(ref.group == row["group"]) & (ref.gpu == "a100-40gb")].iloc[0]
    assert (int(cells.memory_len), float(cells.attention_dropout)) == (384, 0.2)
    gpu = catalog.gpu_type("a100-40gb")
    shape = dict(d=1024, n=16, f=4096, q=384, b=16, dtype="fp16", e=2, tf32=False)
    expected = reference_layers.transformer_xl_layer_ms(gpu, memory=384, attention_dropout=True, **shape)
    assert row["derived_ms"] == pytest.approx(expected)
    gpt = bench_profiles.derived_layer_ms("gpt3-350m", "a100-40gb", seq_len=384, micro_batch=16, dtype="fp16", tf32=False,
                                          attention="eager", score_passes="scale_fill_mask")
    assert expected > 1.2 * gpt
    assert reference_layers.transformer_xl_layer_ms(gpu, memory=0, attention_dropout=True, **shape) < expected
    assert reference_layers.transformer_xl_layer_ms(gpu, memory=384, attention_dropout=False, **shape) < expected


def test_the_transformer_xl_kernels_hold_the_layers_flops_and_passes():
    """Counted apart: the projections over memory and segment (q, k, v), the relative positions' projection, the
    output projection and the feed-forward, and the three products over the (q, k) scores; then the passes that read
    and write every score: the shift, the fused sum and scale, the mask and the softmax, and the attention dropout
    only where the config has one."""
    import reference_layers

    d, n, f, q, m, b = 512, 8, 2048, 192, 192, 3
    k = q + m
    sc = q * k * b * n * 2
    for dropout, passes in ((False, 4), (True, 5)):
        kernels = reference_layers.transformer_xl_kernels(d=d, n=n, f=f, q=q, memory=m, b=b, e=2, attention_dropout=dropout)
        matmul = sum(fl for kind, fl, _ in kernels if kind in ("matmul", "bmm"))
        assert matmul == 2 * k * b * d * 3 * d + 2 * k * d * d + 2 * q * b * d * d + 2 * 2 * q * b * d * f + 3 * 2 * q * k * b * d
        assert sum(1 for _, _, by in kernels if by >= 2 * sc) == passes
        assert sum(1 for kind, _, by in kernels if kind == "bmm" and sc <= by < 2 * sc) == 3


def test_figures_timed_one_operator_at_a_time_take_at_least_the_hosts_dispatch():
    """Aceso times each operator alone from Python: every operator's forward takes at least the host's time to
    launch it (the named measured tables' host columns); a kernel longer than that is unchanged."""
    floor = bench_profiles.host_dispatch_ms()
    assert floor.any_fwd_ms > 0 and floor.fwd_ms["ln1"] > 0 and "head" not in floor.fwd_ms
    rows = bench_profiles.reference_rows(REFERENCE)
    row = _row(rows, "aceso-opt350-fp16-fwd-mb1", "a100-40gb")
    assert row["timing"] == "op_alone"
    spec = PRESETS["gpt3-350m"].with_overrides(seq_len=2048, dtype="fp16", attention="eager")
    df = derive_table(spec, "a100-40gb", micro_batches=(1,), shares=(1.0,), score_pass_impl="fused_softmax")
    ops = df[df.op.isin([o.name for o in layer_operators(spec)]) & (df.tp_share == 1.0)]
    plain = float(ops.fwd_ms.sum())
    floored = sum(max(t, floor.fwd_ms.get(op, floor.any_fwd_ms)) for op, t in zip(ops.op, ops.fwd_ms))
    assert row["derived_ms"] == pytest.approx(floored)
    assert floored > 1.1 * plain  # at micro-batch 1 an A100's small operators are shorter than their dispatch


def test_throughput_figures_with_an_optimizer_cadence_are_derived_as_whole_steps():
    """A group whose rows state layers, parameters and micro-batches per optimizer step is derived as a step: its
    layers and the optimizer step of eq. 10, once per update (BERT pre-training accumulates 64 micro-batches of 128 on
    the A100)."""
    from baton.costmodel import optimizer_step_ms

    rows = bench_profiles.reference_rows(REFERENCE)
    for group, gpu, params, every in (("lambda-bert-large-tf32", "v100-16gb", 335.15e6, 1),
                                      ("nvidia-bert-large-pretrain-s128-tf32", "a100-80gb", 336.23e6, 64)):
        row = _row(rows, group, gpu)
        assert row["whole_step"]
        spec = PRESETS["gpt3-350m"].with_overrides(dtype="fp32")
        step = optimizer_step_ms(params * 4, spec, catalog.gpu_type(gpu).memory_bandwidth_gb_per_s)
        assert row["derived_per_sample"] == pytest.approx((24 * row["derived_ms"] + step / every) / (24 * row["micro_batch"]))


@pytest.mark.parametrize(("edit", "message"), [
    ({"params_m": None}, "on some rows"),
    ({"optimizer_every": 0}, "must be >= 1"),
    ({"memory_len": 0}, "memory_len >= 1"),
    ({"timing": "op_alone"}, "timing step"),
])
def test_reference_rows_that_cannot_be_derived_as_stated_are_refused(tmp_path, edit, message):
    """A cadence on some rows of a group only (its GPUs would be compared on different terms), an update every 0
    micro-batches, a Transformer-XL row without memory or timed as a Python loop over operators (its kernels are its
    own; no host floor applies to them): each names the file and the group instead of scoring something else."""
    ref = pd.read_csv(REFERENCE)
    at = (ref.group == "nvidia-txl-base-tf32") & (ref.gpu == "a100-40gb")
    for column, value in edit.items():
        ref.loc[at, column] = value
    edited = tmp_path / "layers.csv"
    ref.to_csv(edited, index=False)
    with pytest.raises(ValueError, match=message) as info:
        bench_profiles.reference_rows(edited)
    assert str(edited) in str(info.value) and "nvidia-txl-base-tf32" in str(info.value)


def test_the_command_refuses_a_bad_reference_file_in_one_line_and_writes_nothing(tmp_path):
    """From the command line, a refused reference file gives one line naming it, exit 2, and no results."""
    import subprocess

    ref = pd.read_csv(REFERENCE)
    ref.loc[(ref.group == "nvidia-txl-base-tf32") & (ref.gpu == "a100-40gb"), "optimizer_every"] = 0
    edited = tmp_path / "layers.csv"
    ref.to_csv(edited, index=False)
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_profiles.py"), "--reference", str(edited), "--no-cpu",
                          "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and str(edited) in lines[0] and "must be >= 1" in lines[0], res.stderr
    assert not out.exists()
