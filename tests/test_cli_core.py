"""`baton evaluate`, `baton profile --analytic` and `baton show` from the command line, bad input included.

Every bad input must give exactly one line on stderr naming the file and the field, exit code 2, and
no traceback.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, run_cli

PLAN = ROOT / "examples" / "a100x2_t4x2_gpt3-1.3b_hand.json"
CLUSTER = ROOT / "clusters" / "a100x2_t4x2.yaml"


def test_evaluate_json_has_the_promised_fields():
    code, out, err = run_cli("evaluate", PLAN, "--cluster", CLUSTER, "--json")
    assert code == 0, err
    data = json.loads(out)
    for key in ("iteration_time_ms", "tokens_per_s", "efficiency_vs_ideal", "devices"):
        assert key in data
    assert [d["id"] for d in data["devices"]] == ["a100:0", "a100:1", "t4:0", "t4:1"]
    for d in data["devices"]:
        assert {"id", "gpu", "peak_memory_bytes", "capacity_bytes", "fits"} <= set(d)
        assert d["fits"] is True


def test_evaluate_prints_tables(tmp_path):
    model = tmp_path / "m.yaml"  # the example plan trains gpt3-1.3b with eager attention
    model.write_text("base: gpt3-1.3b\nattention: eager\n")
    code, out, err = run_cli("evaluate", PLAN, "--cluster", CLUSTER, "--model", model)
    assert code == 0, err
    assert "tokens/s" in out and "t4:1" in out


def test_profile_analytic_writes_a_table(tmp_path):
    out = tmp_path / "t4.csv"
    code, _, err = run_cli("profile", "--analytic", "--gpu", "t4", "--model", "tiny", "--micro-batch", "1", "--out", out)
    assert code == 0, err
    from baton.profile import read_table
    assert set(read_table(out)["gpu"]) == {"t4"}


def test_show_lists_catalog_and_models():
    assert "rtx4090" in run_cli("show", "gpus")[1]
    assert "gpt3-6.7b" in run_cli("show", "models")[1]
    assert "t4:1" in run_cli("show", CLUSTER)[1]


def _plan_dict():
    return json.loads(PLAN.read_text())


def _write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def _bad_plans():
    def uncovered(d):
        d["pipelines"][0]["stages"][1]["num_layers"] = 7
    def duplicate(d):
        d["pipelines"][0]["stages"][1]["devices"][0]["id"] = "a100:0"
    def units(d):
        d["pipelines"][0]["stages"][0]["units_per_layer"] = 6
    def unknown_device(d):
        d["pipelines"][0]["stages"][1]["devices"][1]["id"] = "t4:9"
    def bad_units_sum(d):
        d["pipelines"][0]["stages"][0]["devices"][0]["units"] = 9
    def unknown_op(d):
        d["pipelines"][0]["stages"][1]["devices"][0]["recompute"] = ["flash"]
    def negative(d):
        d["micro_batch_size"] = -1
    return [
        (uncovered, "pipelines[0].stages", "cover 23 layers"),
        (duplicate, "pipelines[0].stages[1].devices[0].id", "used more than once"),
        (units, "pipelines[0].stages[0].units_per_layer", "do not divide"),
        (unknown_device, "pipelines[0].stages[1].devices[1].id", "not in cluster"),
        (bad_units_sum, "pipelines[0].stages[0].devices", "add up to 17"),
        (unknown_op, "pipelines[0].stages[1].devices[0].recompute", "unknown operator"),
        (negative, "micro_batch_size", "must be >= 1"),
    ]


@pytest.mark.parametrize("mutate,field,words", _bad_plans())
def test_bad_plans_give_one_line_with_file_and_field(tmp_path, mutate, field, words):
    d = _plan_dict()
    mutate(d)
    path = _write(tmp_path, "plan.json", json.dumps(d))
    code, out, err = run_cli("evaluate", path, "--cluster", CLUSTER)
    assert code == 2
    line = err.strip()
    assert "\n" not in line and "Traceback" not in err
    assert str(path) in line and f"'{field}'" in line and words in line


@pytest.mark.parametrize("text,field", [
    ("nodes: [\n  {gpus: [type: t4}\n", None),
    ("nodes:\n  - gpus:\n      - type: b200\n", "nodes[0].gpus[0].type"),
    ("nodes:\n  - gpus:\n      - count: 2\n", "nodes[0].gpus[0].type"),
    ("nodes:\n  - gpus:\n      - {type: t4, count: -2}\n", "nodes[0].gpus[0].count"),
    ("- just\n- a list\n", None),
])
def test_bad_cluster_files(tmp_path, text, field):
    path = _write(tmp_path, "cluster.yaml", text)
    code, out, err = run_cli("evaluate", PLAN, "--cluster", path)
    assert code == 2 and "Traceback" not in err
    line = err.strip()
    assert "\n" not in line and str(path) in line
    if field:
        assert f"'{field}'" in line


def test_bad_model_file_names_field(tmp_path):
    path = _write(tmp_path, "m.yaml", "num_layers: 24\nhidden_dim: 2048\nnum_heads: 0\nseq_len: 2048\nvocab_size: 50257\n")
    code, _, err = run_cli("evaluate", PLAN, "--cluster", CLUSTER, "--model", path)
    assert code == 2 and f"{path}: field 'num_heads'" in err


def test_model_mismatch_and_missing_plan(tmp_path):
    code, _, err = run_cli("evaluate", PLAN, "--cluster", CLUSTER, "--model", "gpt3-350m")
    assert code == 2 and "made for model 'gpt3-1.3b'" in err
    code, _, err = run_cli("evaluate", tmp_path / "none.json", "--cluster", CLUSTER)
    assert code == 2 and "file not found" in err
    code, _, err = run_cli("evaluate", _write(tmp_path, "p.json", "{not json"), "--cluster", CLUSTER)
    assert code == 2 and "malformed JSON" in err


def test_missing_profile_is_one_line(tmp_path):
    code, _, err = run_cli("evaluate", PLAN, "--cluster", CLUSTER, "--profiles", tmp_path)
    assert code == 2 and "no profile for GPU" in err and "baton profile --analytic" in err


def test_plan_over_capacity_exits_nonzero(tmp_path):
    d = _plan_dict()
    d["pipelines"][0]["stages"][0]["num_layers"] = 0
    d["pipelines"][0]["stages"][1]["first_layer"] = 0
    d["pipelines"][0]["stages"][1]["num_layers"] = 24
    d["pipelines"][0]["stages"][1]["devices"][0]["recompute"] = []
    path = _write(tmp_path, "plan.json", json.dumps(d))
    code, out, err = run_cli("evaluate", path, "--cluster", CLUSTER, "--json")
    assert code == 1
    assert json.loads(out)["fits"] is False


def test_installed_console_script_runs():
    """The `baton` entry point itself (not just the in-process app) starts and lists its commands."""
    exe = Path(sys.executable).parent / "baton"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "cli"]
    res = subprocess.run(cmd + ["--help"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert res.returncode == 0 and "evaluate" in res.stdout
