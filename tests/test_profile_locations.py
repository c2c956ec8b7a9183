"""Where profile tables are written and found, and the TF32 setting they follow.

Catches: ``baton profile --analytic`` writing into the package (or checkout) and overwriting a shipped
table; a user's table not found ahead of the shipped one; a TF32 and a non-TF32 table of one model
sharing a file, or a table of the other setting used without a word; the derivation ignoring the
model's setting; the two statements of the partition-granularity rule drifting apart.

Every test points $BATON_PROFILES at a temporary directory: none writes into the user's home.
"""
from __future__ import annotations

import hashlib
import sys
from dataclasses import replace

import pytest

from baton.errors import BatonError
from baton.model_spec import PRESETS, from_mapping, split_profile_name, splits_into, unit_counts
from baton.operators import layer_operators
from baton.plan import DeviceShare, Pipeline, Plan, Stage, from_dict, validate
from baton.profile import derive_table, load_profile, profiles_dir, shipped_profiles_dir, table_filename, write_table
from solver.options import valid_unit_counts
from tests.conftest import ROOT, run_cli

TINY = PRESETS["tiny"]
LAYER_FP32 = PRESETS["gpt3-1.3b"].with_overrides(seq_len=512, dtype="fp32")


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    d = tmp_path / "user-profiles"
    monkeypatch.setenv("BATON_PROFILES", str(d))
    return d


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _layer_ms(df, spec) -> float:
    rows = df[df.op.isin([o.name for o in layer_operators(spec)])]
    return float(rows.fwd_ms.sum() + rows.bwd_ms.sum())


# --- where tables go and where they are found -------------------------------------------------------


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the XDG layout is the Linux default")
def test_the_default_user_directory_is_the_platforms_data_directory(tmp_path, monkeypatch):
    monkeypatch.delenv("BATON_PROFILES", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert profiles_dir() == tmp_path / "data" / "baton" / "profiles"
    monkeypatch.delenv("XDG_DATA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert profiles_dir() == tmp_path / "home" / ".local" / "share" / "baton" / "profiles"
    assert ROOT not in profiles_dir().parents


def test_analytic_profile_writes_to_the_user_directory_and_leaves_shipped_tables_alone(user_dir):
    shipped = shipped_profiles_dir() / "derived" / table_filename("t4", "tiny", 32)
    assert shipped.is_file()
    before = _digest(shipped)
    code, out, err = run_cli("profile", "--analytic", "--gpu", "t4", "--model", "tiny", "--micro-batch", "1")
    assert code == 0, err
    written = user_dir / "derived" / table_filename("t4", "tiny", 32)
    assert written.is_file() and str(written) in out.replace("\n", "")
    assert _digest(shipped) == before


def test_user_tables_are_found_ahead_of_shipped_ones_and_measured_ahead_of_derived(user_dir):
    assert load_profile("t4", TINY).source.startswith(str(shipped_profiles_dir()))
    write_table(derive_table(TINY, "t4", micro_batches=(3,)), user_dir / "derived" / table_filename("t4", "tiny", 32))
    found = load_profile("t4", TINY)
    assert found.source.startswith(str(user_dir)) and found.micro_batches("qkv") == [3]
    measured = derive_table(TINY, "t4", micro_batches=(5,)).assign(source="measured")
    write_table(measured, user_dir / "measured" / table_filename("t4", "tiny", 32))
    assert load_profile("t4", TINY).micro_batches("qkv") == [5]
    # --profiles names one directory, searched alone.
    with pytest.raises(BatonError, match="no profile"):
        load_profile("t4", TINY, directory=user_dir / "elsewhere")


# --- the TF32 setting ------------------------------------------------------------------------------------


def test_tf32_is_a_model_setting_read_from_yaml_checked_and_carried_by_plans():
    spec = from_mapping({"base": "tiny", "tf32": True}, source="m.yaml")
    assert spec.tf32 and not TINY.tf32 and spec.to_dict()["tf32"] is True
    assert spec.profile_name == "tiny+tf32" and TINY.profile_name == "tiny"
    assert split_profile_name(spec.profile_name) == ("tiny", True) and split_profile_name("tiny") == ("tiny", False)
    for bad in ("yes", 1, "false"):
        with pytest.raises(BatonError, match="m.yaml: field 'tf32'"):
            from_mapping({"base": "tiny", "tf32": bad}, source="m.yaml")
    with pytest.raises(BatonError, match="field 'name'"):
        from_mapping({"base": "tiny", "name": "tiny+tf32"}, source="m.yaml")  # would take tiny's TF32 tables
    stage = Stage(first_layer=0, num_layers=4, units_per_layer=1, devices=(DeviceShare(id="local:0", units=1),))
    plan = validate(Plan(model=spec, cluster="cpu2", micro_batch_size=1, num_microbatches=1, pipelines=(Pipeline(stages=(stage,)),)))
    assert from_dict(plan.to_dict()).model.tf32 is True


def test_the_derivation_follows_the_models_tf32_setting():
    on = replace(LAYER_FP32, tf32=True)
    plain = derive_table(LAYER_FP32, "a100-40gb", micro_batches=(1,), shares=(1.0,))
    tf32 = derive_table(on, "a100-40gb", micro_batches=(1,), shares=(1.0,))
    assert _layer_ms(tf32, on) < 0.5 * _layer_ms(plain, LAYER_FP32)  # A100: TF32 tensor cores vs fp32 lanes
    assert set(tf32["model"]) == {on.profile_name} and set(plain["model"]) == {LAYER_FP32.name}
    # The keyword derives for the spec with that setting; the table says which.
    assert derive_table(LAYER_FP32, "a100-40gb", micro_batches=(1,), shares=(1.0,), tf32=True).equals(tf32)
    # A GPU without TF32 runs fp32 matmuls alike either way.
    assert _layer_ms(derive_table(on, "v100-16gb", micro_batches=(1,), shares=(1.0,)), on) == \
        _layer_ms(derive_table(LAYER_FP32, "v100-16gb", micro_batches=(1,), shares=(1.0,)), LAYER_FP32)


def test_tf32_tables_have_their_own_file_and_a_table_of_the_other_setting_is_refused(tmp_path, user_dir):
    model = tmp_path / "tiny-tf32.yaml"
    model.write_text("base: tiny\ntf32: true\n")
    code, _, err = run_cli("profile", "--analytic", "--gpu", "a100-40gb", "--model", model, "--micro-batch", "1")
    assert code == 0, err
    assert [p.name for p in (user_dir / "derived").iterdir()] == ["a100-40gb__tiny+tf32__s32.csv"]
    on = from_mapping({"base": "tiny", "tf32": True}, source="x")
    assert load_profile("a100-40gb", on).source.startswith(str(user_dir))
    assert load_profile("a100-40gb", TINY).source.startswith(str(shipped_profiles_dir()))  # the plain table, untouched

    # A TF32 table filed under the plain name (by hand, or with --out) is refused, not used.
    renamed = tmp_path / "p"
    write_table(derive_table(on, "t4", micro_batches=(1,)), renamed / "derived" / table_filename("t4", "tiny", 32))
    with pytest.raises(BatonError, match=r"made for tf32: true .* model 'tiny' has tf32: false") as exc:
        load_profile("t4", TINY, directory=renamed)
    assert "t4__tiny__s32.csv" in str(exc.value)


def test_a_missing_tf32_table_says_how_to_make_it():
    on = replace(TINY, tf32=True)
    with pytest.raises(BatonError, match=r"tiny\+tf32.*--model <model YAML>"):
        load_profile("t4", on, directory=ROOT / "profiles")


# --- one rule for partition granularities ------------------------------------------------------------------


@pytest.mark.parametrize("heads,ffn", [(16, 8192), (12, 3072), (32, 11008), (40, 13824), (8, 1000)])
def test_solver_granularities_and_plan_validation_state_one_rule(heads, ffn):
    spec = replace(PRESETS["gpt3-1.3b"], num_heads=heads, hidden_dim=heads * 64, ffn_dim=ffn, num_layers=1)
    assert list(valid_unit_counts(spec)) == unit_counts(spec)
    for U in range(1, heads + 1):
        stage = Stage(first_layer=0, num_layers=1, units_per_layer=U, devices=(DeviceShare(id="d:0", units=U),))
        plan = Plan(model=spec, cluster="c", micro_batch_size=1, num_microbatches=1, pipelines=(Pipeline(stages=(stage,)),))
        try:
            validate(plan)
            accepted = True
        except BatonError as exc:
            assert "units_per_layer" in str(exc)
            accepted = False
        assert accepted == splits_into(spec, U) == (U in valid_unit_counts(spec)), U
