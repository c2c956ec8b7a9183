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

SOURCE_SET = {"issue14": "fit", "lambda": "fit", "metis": "held_out", "aceso": "held_out", "nvidia": "held_out"}
"""The split rule of profiles/reference/README.md, by the source a group's name starts with: the catalog's fractions
were chosen on the issue-14 and Lambda figures; every other source is held out."""

HELD_OUT_GEOMEAN, HELD_OUT_WORST = 1.18, 1.51
"""What the derivation reaches on the held-out set now (1.18x / 1.50x, bench/results/profiles.md), rounded up: a
change to the catalog's fractions or to the derivation that does worse on figures it was not fitted to fails
here. Lower these when the derivation improves; the issue-27 targets are bench_profiles.TARGET_GEOMEAN/WORST."""


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
    assert fit["count"] >= 18 and held["count"] >= 20
    assert fit["geomean"] <= bench_profiles.TARGET_GEOMEAN and fit["worst"] <= bench_profiles.TARGET_WORST, fit
    assert held["geomean"] <= HELD_OUT_GEOMEAN and held["worst"] <= HELD_OUT_WORST, held


@pytest.mark.xfail(strict=True, reason="issue 27: the held-out set misses the targets (1.18x / 1.50x): Aceso's fp16 "
                                        "operators timed alone at micro-batch 1 (host dispatch) and Transformer-XL's "
                                        "relative attention, which a GPT layer of its segment length does not model")
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
