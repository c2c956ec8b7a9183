"""bench/bench_profiles.py's rows: published figures derived as they were measured, measured tables against
their own model (read from the command file beside them), each table counted once."""
from __future__ import annotations

import shutil
import sys

import pytest

from baton.model_spec import PRESETS
from baton.operators import layer_operators
from baton.profile import derive_table
from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import bench_profiles  # noqa: E402

H200_TABLE = ROOT / "profiles" / "measured" / "h200__gpt3-350m-bf16-s1024__s1024.csv"


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
    assert (row["gpu"], row["dtype"], row["micro_batch"]) == ("h200", "bf16", 1)
    assert row["derived_ms"] == pytest.approx(_layer_ms(spec, "h200", 1))
    assert row["measured_value"] > 0
