"""Profile tables that no directory has are derived when ``solve``, ``evaluate`` or ``show`` need them.

Catches: a user's own model (or a shipped model at another sequence length) failing for want of a table
that ``baton profile --analytic`` would have written; a derived table that differs from the one that
command writes, or lands anywhere but the user's derived/; a table derived again on every run; a derived
table winning over a measured one; derivation into a ``--profiles`` directory (searched alone, and maybe
the shipped tables); a half-written table.

Every test points $BATON_PROFILES at a temporary directory.
"""
from __future__ import annotations

import json

import pytest

from baton.model_files import load_model
from baton.profile import derive_table, table_filename, write_table
from tests.conftest import ROOT, run_cli

CLUSTER = ROOT / "clusters" / "a100x2_t4x2.yaml"
GPUS = ("a100-40gb", "t4")
MODEL = "base: gpt3-125m\nname: mymodel\nnum_layers: 6\n"
FAST = ("--strategy", "megatron", "--global-batch", "8")
"""The enumeration baseline: the derivation under test happens before any strategy runs."""


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    d = tmp_path / "user-profiles"
    monkeypatch.setenv("BATON_PROFILES", str(d))
    return d


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "mymodel.yaml"
    path.write_text(MODEL)
    return path


def _derived_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("derived the analytic table")]


def _names(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []


def test_solve_derives_the_missing_tables_once_into_the_users_directory(tmp_path, user_dir, model):
    plan = tmp_path / "plan.json"
    code, out, err = run_cli("solve", "--cluster", CLUSTER, "--model", model, *FAST, "--out", plan)
    assert code == 0, err
    wanted = [table_filename(g, "mymodel", 2048) for g in GPUS]
    assert _names(user_dir / "derived") == wanted and _names(user_dir) == ["derived"]
    lines = _derived_lines(err)
    assert lines == [f"derived the analytic table for {g} x mymodel (seq 2048) into {user_dir / 'derived' / n}"
                     for g, n in zip(GPUS, wanted)], err
    assert "Traceback" not in err and plan.is_file()

    # What `baton profile --analytic` writes for the same GPU and model, byte for byte.
    made = tmp_path / "by-hand.csv"
    code, _, err = run_cli("profile", "--analytic", "--gpu", "t4", "--model", model, "--out", made)
    assert code == 0, err
    assert (user_dir / "derived" / wanted[1]).read_bytes() == made.read_bytes()

    # The next runs find them: nothing derived, nothing rewritten, nothing said.
    stamps = {n: (user_dir / "derived" / n).stat().st_mtime_ns for n in wanted}
    for argv in (["solve", "--cluster", CLUSTER, "--model", model, *FAST],
                 ["evaluate", plan, "--cluster", CLUSTER],
                 ["show", plan, "--cluster", CLUSTER]):
        code, _, err = run_cli(*argv)
        assert code == 0 and not _derived_lines(err), (argv, err)
    assert {n: (user_dir / "derived" / n).stat().st_mtime_ns for n in wanted} == stamps
    assert _names(user_dir / "derived") == wanted


def test_a_measured_table_in_the_users_directory_wins(tmp_path, user_dir, model):
    plan = tmp_path / "plan.json"
    assert run_cli("solve", "--cluster", CLUSTER, "--model", model, *FAST, "--out", plan)[0] == 0
    code, out, err = run_cli("evaluate", plan, "--cluster", CLUSTER, "--json")
    assert code == 0, err
    derived_ms = json.loads(out)["iteration_time_ms"]

    # A "measured" A100 three times slower than its derivation: the plan's prediction must follow it.
    assert any(d["id"].startswith("a100") for p in json.loads(plan.read_text())["pipelines"] for s in p["stages"]
               for d in s["devices"])
    spec = load_model(str(model))
    slow = derive_table(spec, "a100-40gb").assign(source="measured")
    slow[["fwd_ms", "bwd_ms"]] *= 3
    write_table(slow, user_dir / "measured" / table_filename("a100-40gb", "mymodel", 2048))
    code, out, err = run_cli("evaluate", plan, "--cluster", CLUSTER, "--json")
    assert code == 0 and not _derived_lines(err), err
    assert json.loads(out)["iteration_time_ms"] > 1.5 * derived_ms
    # With the derived tables gone, only the table that has no measured one is derived again.
    for table in (user_dir / "derived").iterdir():
        table.unlink()
    code, out, err = run_cli("solve", "--cluster", CLUSTER, "--model", model, *FAST)
    assert code == 0, err
    assert [line.split(" x ")[0] for line in _derived_lines(err)] == ["derived the analytic table for t4"]
    assert _names(user_dir / "derived") == [table_filename("t4", "mymodel", 2048)]


def test_show_and_evaluate_derive_for_a_plan_too(tmp_path, user_dir, model):
    plan = tmp_path / "plan.json"
    assert run_cli("solve", "--cluster", CLUSTER, "--model", model, *FAST, "--out", plan)[0] == 0
    from baton.cluster import load_cluster
    from baton.plan import load_plan

    cluster = load_cluster(CLUSTER)
    used = sorted({cluster.device(i).gpu.name for i in load_plan(plan).device_ids()})  # the tables a plan needs
    for argv in (["show", plan, "--cluster", CLUSTER], ["evaluate", plan, "--cluster", CLUSTER, "--json"]):
        for table in (user_dir / "derived").iterdir():
            table.unlink()
        code, out, err = run_cli(*argv)
        assert code == 0, err
        assert len(_derived_lines(err)) == len(used) and _names(user_dir / "derived") == [table_filename(g, "mymodel", 2048) for g in used]
        if "--json" in argv:
            json.loads(out)  # the line went to stderr: stdout is still one JSON object


def test_a_shipped_model_at_another_sequence_length(user_dir):
    code, out, err = run_cli("solve", "--cluster", CLUSTER, "--model", "gpt3-125m", "--seq-len", "1024", *FAST)
    assert code == 0, err
    assert _names(user_dir / "derived") == [table_filename(g, "gpt3-125m", 1024) for g in GPUS]


def test_nothing_is_derived_into_a_profiles_directory(tmp_path, user_dir, model):
    given = tmp_path / "given"
    given.mkdir()
    code, out, err = run_cli("solve", "--cluster", CLUSTER, "--model", model, *FAST, "--profiles", given)
    assert code == 2 and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "no profile for GPU 'a100-40gb', model 'mymodel'" in lines[0], err
    assert f"--out {given / 'derived' / table_filename('a100-40gb', 'mymodel', 2048)}" in lines[0]
    assert "searched alone" in lines[0]
    assert _names(given) == [] and not user_dir.exists()


def test_a_profile_directory_that_cannot_be_written_is_one_line(tmp_path, monkeypatch, model):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    monkeypatch.setenv("BATON_PROFILES", str(blocker / "profiles"))
    out = tmp_path / "plan.json"
    code, _, err = run_cli("solve", "--cluster", CLUSTER, "--model", model, *FAST, "--out", out)
    assert code == 2 and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {blocker / 'profiles' / 'derived'}"), err
    assert "BATON_PROFILES" in lines[0]
    assert not out.exists() and blocker.read_text() == "x"
