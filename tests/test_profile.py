"""Profile tables: schema validation, CSV round trips, interpolation and the analytic derivation."""
from __future__ import annotations

import pandas as pd
import pytest

from baton.catalog import CATALOG
from baton.errors import BatonError
from baton.model_spec import PRESETS
from baton.operators import layer_operators, tensor_sizes
from baton.profile import COLUMNS, Profile, derive_table, load_profile, read_table, write_table

TINY = PRESETS["tiny"]


def test_round_trip_keeps_every_value(tmp_path):
    df = derive_table(TINY, "t4", micro_batches=(1, 2))
    path = tmp_path / "t.csv"
    write_table(df, path)
    back = read_table(path)
    assert list(back.columns) == COLUMNS
    key = ["op", "micro_batch", "tp_share"]
    a = df.sort_values(key).reset_index(drop=True)
    b = back.sort_values(key).reset_index(drop=True)
    pd.testing.assert_frame_equal(a, b, check_exact=False, rtol=1e-11)


def test_interpolation_is_exact_on_grid_and_linear_between():
    df = derive_table(TINY, "a100-40gb", micro_batches=(1, 4), shares=(0.25, 0.5, 1.0))
    prof = Profile(df)
    on = prof.cost("qkv", 4, 0.5)
    row = df[(df.op == "qkv") & (df.micro_batch == 4) & (df.tp_share == 0.5)].iloc[0]
    assert on.fwd_ms == row.fwd_ms and on.saved_bytes == row.saved_bytes
    lo, hi = prof.cost("qkv", 4, 0.25), prof.cost("qkv", 4, 0.5)
    mid = prof.cost("qkv", 4, 0.375)
    assert mid.fwd_ms == pytest.approx((lo.fwd_ms + hi.fwd_ms) / 2)
    # Between micro-batch sizes 1 and 4 the saved bytes, being linear in b, interpolate exactly.
    assert prof.cost("fc1", 2, 1.0).saved_bytes == pytest.approx(2 * prof.cost("fc1", 1, 1.0).saved_bytes)


def test_derived_saved_bytes_match_the_tensor_sizes():
    df = derive_table(TINY, "t4", micro_batches=(2,))
    prof = Profile(df)
    sizes = tensor_sizes(TINY, 2)
    for op in layer_operators(TINY):
        share = 0.5 if op.tp_split else 1.0
        expect = sum(sizes[t].bytes(share) for t in op.saves)
        assert prof.cost(op.name, 2, share).saved_bytes == pytest.approx(expect)


def test_faster_gpu_derives_faster_matmuls():
    spec = PRESETS["gpt3-1.3b"]
    a100 = Profile(derive_table(spec, CATALOG["a100-40gb"], micro_batches=(1,)))
    t4 = Profile(derive_table(spec, CATALOG["t4"], micro_batches=(1,)))
    # compute-bound GEMMs scale with what each GPU sustains (datasheet peak x generation fraction x clock)
    sustained = CATALOG["a100-40gb"].matmul_tflops("fp16") / CATALOG["t4"].matmul_tflops("fp16")
    assert t4.cost("fc1", 1, 1.0).fwd_ms / a100.cost("fc1", 1, 1.0).fwd_ms == pytest.approx(sustained, rel=0.05)
    assert t4.cost("fc1", 1, 0.5).fwd_ms < t4.cost("fc1", 1, 1.0).fwd_ms


@pytest.mark.parametrize("mutate,field", [
    (lambda df: df.drop(columns=["bwd_ms"]), "bwd_ms"),
    (lambda df: df.assign(fwd_ms=-1.0), "fwd_ms"),
    (lambda df: df.assign(tp_share=1.5), "tp_share"),
    (lambda df: df.assign(micro_batch=0), "micro_batch"),
    (lambda df: df.assign(source="guessed"), "source"),
    (lambda df: pd.concat([df, df.iloc[:1]]), "op"),
    (lambda df: df.assign(saved_bytes="lots"), "saved_bytes"),
])
def test_bad_tables_are_rejected_with_file_and_field(tmp_path, mutate, field):
    path = tmp_path / "bad.csv"
    mutate(derive_table(TINY, "t4", micro_batches=(1,))).to_csv(path, index=False)
    with pytest.raises(BatonError) as exc:
        read_table(path)
    assert str(path) in str(exc.value) and f"'{field}'" in str(exc.value)


def test_missing_profile_says_how_to_make_it(tmp_path):
    with pytest.raises(BatonError, match="baton profile --analytic --gpu t4 --model tiny"):
        load_profile("t4", TINY, directory=tmp_path)


def test_table_for_another_model_is_refused(tmp_path):
    other = PRESETS["tiny"].with_overrides(hidden_dim=128)
    df = derive_table(other, "t4", micro_batches=(1,))
    df["model"] = "tiny"
    (tmp_path / "derived").mkdir()
    write_table(df, tmp_path / "derived" / "t4__tiny__s32.csv")
    with pytest.raises(BatonError, match="different model"):
        load_profile("t4", TINY, directory=tmp_path)


def test_shipped_tables_cover_catalog_and_presets(root):
    files = list((root / "profiles" / "derived").glob("*.csv"))
    names = {f.name for f in files}
    for gpu in ("a100-40gb", "t4", "a10g", "v100-16gb", "h100"):
        for model in ("gpt3-1.3b", "gpt3-6.7b", "llama2-7b"):
            s = PRESETS[model].seq_len
            assert f"{gpu}__{model}__s{s}.csv" in names


def test_parameter_bytes_do_not_follow_the_micro_batch():
    """A table of one micro-batch size extends times and activations proportionally to other sizes, but
    a layer holds the same parameters whatever the batch (a replica with its own micro-batch size read half
    the weights from a table measured at twice its size)."""
    df = derive_table(TINY, "t4", micro_batches=(2,))
    prof = Profile(df)
    for op in ("qkv", "fc1", "ln1", "embedding", "head"):
        at2, at1, at5 = prof.cost(op, 2), prof.cost(op, 1), prof.cost(op, 5)
        assert at1.param_bytes == at2.param_bytes == at5.param_bytes
        assert at1.fwd_ms == pytest.approx(at2.fwd_ms / 2) and at5.saved_bytes == pytest.approx(at2.saved_bytes * 2.5)
