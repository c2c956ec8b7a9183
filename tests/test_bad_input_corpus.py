"""A corpus of bad input, one case per way a user can get it wrong: every case must end with exit code 2,
exactly one line on stderr naming the file or flag, no traceback, no output file, in bounded time.

Catches: error text read as rich markup (a file named ``run[red].yaml`` reported as ``run.yaml``),
UnicodeDecodeError on binary files, YAML alias bombs that take gigabytes or print megabytes, duplicate
keys silently resolved, sizes that exhaust the machine, NaN options accepted, a bad ``--out`` found
only after the solve, a plan evaluated on another cluster, train options found bad inside the ranks."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, run_cli

CLUSTER = ROOT / "clusters" / "a100x2_t4x2.yaml"
PLAN = ROOT / "examples" / "a100x2_t4x2_gpt3-1.3b_hand.json"
SECONDS = 20.0  # every case, including the bombs, ends well within this on a loaded 2-core box

BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{n}: &{n} [{', '.join([f'*{p}'] * 9)}]\n" for p, n in zip("abcdefgh", "bcdefghi"))


def _tiny_plan(tmp_path: Path, *, device: str | None = None, **changes) -> Path:
    from baton.model_spec import PRESETS
    from baton.plan import save_plan, simple_plan

    plan = simple_plan(PRESETS["tiny"], cluster="cpu2", stages=[[("local:0", 1)], [("local:1", 1)]], layers=[2, 2],
                       units_per_layer=[1, 1])
    path = tmp_path / "tiny.json"
    save_plan(plan, path)
    if changes or device:
        d = json.loads(path.read_text())
        d.update(changes)
        if device:
            d["pipelines"][0]["stages"][0]["devices"][0]["id"] = device
        path.write_text(json.dumps(d))
    return path


def _tf32_table_as_plain(tmp_path: Path) -> Path:
    """A profiles directory whose cpu table for 'tiny' was derived with TF32 but carries the plain name."""
    from baton.model_spec import PRESETS
    from baton.profile import derive_table, table_filename, write_table

    root = tmp_path / "profiles"
    spec = PRESETS["tiny"].with_overrides(tf32=True)
    write_table(derive_table(spec, "cpu", micro_batches=(1,)), root / "derived" / table_filename("cpu", "tiny", 32))
    return root


def _plan_dict() -> dict:
    return json.loads(PLAN.read_text())


def _offloading_plan(offload) -> dict:
    """The hand plan with its first device offloading ``offload`` (recomputing nothing)."""
    d = _plan_dict()
    dev = d["pipelines"][0]["stages"][0]["devices"][0]
    dev["recompute"], dev["offload"] = [], offload
    return d


def _offloading_optimizer_plan(value, **changes) -> dict:
    """The hand plan with its first device's ``offload_optimizer`` set to ``value`` (and top-level ``changes``)."""
    d = {**_plan_dict(), **changes}
    d["pipelines"][0]["stages"][0]["devices"][0]["offload_optimizer"] = value
    return d


def _write(tmp_path: Path, name: str, content: str | bytes) -> Path:
    path = tmp_path / name
    (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    return path


def _cluster(**gpu) -> str:
    entry = {"type": "t4", "count": 2, **gpu}
    return json.dumps({"nodes": [{"name": "n", "gpus": [entry],
                                  "intra_node_link": {"bandwidth_gb_per_s": 10, "latency_us": 5}}]})


# Each case: (name, build(tmp_path) -> (argv, words the line must hold)). An output file, where the
# command would write one, is always tmp_path / "out.json".
CASES = {
    # --- error text printed literally -----------------------------------------------------------
    "markup in a file name": lambda t: (["evaluate", PLAN, "--cluster", _write(t, "run[red].yaml", "nodes: [\n")],
                                        ["run[red].yaml", "malformed YAML"]),
    "markup style in a file name": lambda t: (["show", _write(t, "x[bold].yaml", "a: [")], ["x[bold].yaml"]),
    "markup in a device id": lambda t: (["evaluate", _tiny_plan(t, device="[/x]:7"), "--cluster", ROOT / "clusters" / "cpu2.yaml"],
                                        ["tiny.json", "'[/x]:7'"]),
    "markup in a cluster name": lambda t: (["evaluate", _write(t, "p.json", json.dumps({**_plan_dict(), "cluster": "[red]c[/red]"})),
                                            "--cluster", CLUSTER], ["p.json", "'[red]c[/red]'"]),
    "markup in a model name": lambda t: (["evaluate", PLAN, "--cluster", CLUSTER, "--model",
                                          _write(t, "m.yaml", "base: gpt3-1.3b\nname: '[red]m[bold]'\n")], ["made for model", "'[red]m[bold]'"]),
    # --- non-UTF-8 and binary files -------------------------------------------------------------
    "binary cluster": lambda t: (["evaluate", PLAN, "--cluster", _write(t, "c.yaml", b"\x89PNG\r\n\x1a\n\xff\xfe")],
                                 ["c.yaml", "not UTF-8"]),
    "latin-1 model": lambda t: (["evaluate", PLAN, "--cluster", CLUSTER, "--model", _write(t, "m.yaml", "name: caf\xe9\n".encode("latin-1"))],
                                ["m.yaml", "not UTF-8"]),
    "binary file shown": lambda t: (["show", _write(t, "b.bin", b"\x89PNG\r\n\x1a\n\xff\xfe")], ["b.bin", "not UTF-8"]),
    "binary YAML shown": lambda t: (["show", _write(t, "b.yaml", b"\xff\xfenodes\x00")], ["b.yaml", "not UTF-8"]),
    "binary plan": lambda t: (["evaluate", _write(t, "p.json", bytes(range(256))), "--cluster", CLUSTER], ["p.json", "not UTF-8"]),
    "NUL bytes in YAML": lambda t: (["evaluate", PLAN, "--cluster", _write(t, "c.yaml", "nodes: \x00\x00\n")], ["c.yaml"]),
    # --- YAML that expands or refers to itself ---------------------------------------------------
    "alias bomb (cluster)": lambda t: (["evaluate", PLAN, "--cluster", _write(t, "bomb.yaml", BOMB + "nodes: *i\n")],
                                       ["bomb.yaml", "aliases expand"]),
    "alias bomb (model)": lambda t: (["evaluate", PLAN, "--cluster", CLUSTER, "--model", _write(t, "m.yaml", BOMB + "name: *i\n")],
                                     ["m.yaml", "aliases expand"]),
    "self-referring alias": lambda t: (["evaluate", PLAN, "--cluster", _write(t, "c.yaml", "a: &a [*a]\n")], ["c.yaml", "alias"]),
    "deep nesting": lambda t: (["evaluate", PLAN, "--cluster", _write(t, "c.yaml", "a: " + "[" * 5000 + "]" * 5000 + "\n")],
                               ["c.yaml"]),
    "deep JSON nesting": lambda t: (["evaluate", _write(t, "p.json", "[" * 100000 + "]" * 100000), "--cluster", CLUSTER],
                                    ["p.json", "nested"]),
    "huge integer": lambda t: (["evaluate", _write(t, "p.json", '{"micro_batch_size": ' + "9" * 10000 + "}"), "--cluster", CLUSTER],
                               ["p.json"]),
    # --- duplicate keys -----------------------------------------------------------------------------
    "duplicate YAML key": lambda t: (["evaluate", PLAN, "--cluster", _write(t, "c.yaml", "name: a\nname: b\nnodes: []\n")],
                                     ["c.yaml", "duplicate key 'name'"]),
    "duplicate JSON key": lambda t: (["evaluate", _write(t, "p.json", '{"cluster": "a", "cluster": "b"}'), "--cluster", CLUSTER],
                                     ["p.json", "duplicate key 'cluster'"]),
    # --- sizes beyond the documented bounds ------------------------------------------------------------
    "global batch 10^12": lambda t: (["solve", "--cluster", CLUSTER, "--model", "tiny", "--global-batch", 10**12,
                                      "--out", t / "out.json"], ["--global-batch", "1048576"]),
    "10^12 micro-batches": lambda t: (["evaluate", _write(t, "p.json", json.dumps({**_plan_dict(), "num_microbatches": 10**12})),
                                       "--cluster", CLUSTER], ["p.json", "num_microbatches"]),
    "10^9 layers": lambda t: (["evaluate", PLAN, "--cluster", CLUSTER, "--model",
                               _write(t, "m.yaml", "base: gpt3-1.3b\nnum_layers: 1000000000\n")], ["m.yaml", "num_layers", "1024"]),
    "10^6 GPUs": lambda t: (["solve", "--cluster", _write(t, "c.yaml", _cluster(count=10**6)), "--model", "tiny",
                             "--out", t / "out.json"], ["c.yaml", "count"]),
    "more devices than a cluster may have": lambda t: (
        ["solve", "--cluster", _write(t, "c.yaml", json.dumps({"nodes": [{"name": "n", "count": 5, "gpus": [{"type": "t4", "count": 1024}],
                                                                         "intra_node_link": {"bandwidth_gb_per_s": 10}}]})),
         "--model", "tiny", "--out", t / "out.json"], ["c.yaml", "nodes[0].count", "4096"]),
    "memory_gib 1e300": lambda t: (["evaluate", PLAN, "--cluster", _write(t, "c.yaml", _cluster(memory_gib=1e300))],
                                   ["c.yaml", "memory_gib"]),
    "host_memory_gib 1e300": lambda t: (["evaluate", PLAN, "--cluster", _write(t, "c.yaml", _cluster().replace(
        '"name": "n",', '"name": "n", "host_memory_gib": 1e300,'))], ["c.yaml", "nodes[0].host_memory_gib"]),
    "host_link_gb_per_s 0": lambda t: (["evaluate", PLAN, "--cluster", _write(t, "c.yaml", _cluster().replace(
        '"name": "n",', '"name": "n", "host_link_gb_per_s": 0,'))], ["c.yaml", "nodes[0].host_link_gb_per_s"]),
    "host_optimizer_gb_per_s -5": lambda t: (["evaluate", PLAN, "--cluster", _write(t, "c.yaml", _cluster().replace(
        '"name": "n",', '"name": "n", "host_optimizer_gb_per_s": -5,'))], ["c.yaml", "nodes[0].host_optimizer_gb_per_s"]),
    "offload of a tensor the device does not hold": lambda t: (
        ["evaluate", _write(t, "p.json", json.dumps(_offloading_plan(["attn_partial"]))), "--cluster", CLUSTER],
        ["p.json", "offload", "attn_partial"]),  # completed by the all-reduce at once: nobody keeps it
    "offload not a list": lambda t: (
        ["evaluate", _write(t, "p.json", json.dumps(_offloading_plan("layer_input"))), "--cluster", CLUSTER],
        ["p.json", "offload", "list of tensor names"]),
    "offload_optimizer not a boolean": lambda t: (
        ["evaluate", _write(t, "p.json", json.dumps(_offloading_optimizer_plan("yes"))), "--cluster", CLUSTER],
        ["p.json", "devices[0].offload_optimizer", "true or false"]),
    "offload_optimizer at zero_stage 2": lambda t: (
        ["evaluate", _write(t, "p.json", json.dumps(_offloading_optimizer_plan(True, zero_stage=2))), "--cluster", CLUSTER],
        ["p.json", "devices[0].offload_optimizer", "zero_stage 0 or 1"]),
    "bandwidth 1e300": lambda t: (["evaluate", PLAN, "--cluster",
                                   _write(t, "c.yaml", _cluster().replace('"bandwidth_gb_per_s": 10', '"bandwidth_gb_per_s": 1e300'))],
                                  ["c.yaml", "bandwidth_gb_per_s"]),
    # --- options -------------------------------------------------------------------------------------------
    "--time-limit nan": lambda t: (["solve", "--cluster", CLUSTER, "--model", "tiny", "--time-limit", "nan", "--out", t / "out.json"],
                                   ["--time-limit", "nan"]),
    "--out in a missing parent that is a file": lambda t: (
        ["solve", "--cluster", CLUSTER, "--model", "gpt3-1.3b", "--out", _write(t, "afile", "x") / "out.json"], ["--out", "afile"]),
    "--out is a directory": lambda t: (["solve", "--cluster", CLUSTER, "--model", "gpt3-1.3b", "--out", t], ["--out", "directory"]),
    "--out in missing directories under a file": lambda t: (
        ["solve", "--cluster", CLUSTER, "--model", "gpt3-1.3b", "--out", _write(t, "afile", "x") / "new" / "out.json"],
        ["afile/new/out.json: field '--out'", "afile is not a directory"]),
    # --- a file of one kind read as another, a preset's name on other sizes ----------------------------------
    "cluster file with 'node:' shown": lambda t: (["show", _write(t, "c.yaml", "name: c\nnode: []\n")],
                                                 ["c.yaml: field 'node'", "a cluster file has", "did you mean 'nodes'?"]),
    "a preset's name on other sizes": lambda t: (["solve", "--cluster", CLUSTER, "--model",
                                                  _write(t, "m.yaml", "name: gpt3-1.3b\nbase: gpt3-1.3b\nnum_layers: 10\n"),
                                                  "--out", t / "out.json"],
                                                 ["m.yaml: field 'name'", "preset with other sizes (num_layers 24 vs 10)",
                                                  "a name of its own"]),
    "not a number": lambda t: (["solve", "--cluster", CLUSTER, "--model", "tiny", "--global-batch", "lots"], ["--global-batch"]),
    "unknown option": lambda t: (["evaluate", PLAN, "--cluster", CLUSTER, "--jsn"], ["--jsn"]),
    # --- plans -------------------------------------------------------------------------------------------------
    "plan for another cluster": lambda t: (["evaluate", _write(t, "p.json", json.dumps({**_plan_dict(), "cluster": "elsewhere"})),
                                            "--cluster", CLUSTER], ["p.json", "cluster", "elsewhere"]),
    # --- the TF32 setting and its tables ------------------------------------------------------------------
    "tf32 not a boolean": lambda t: (["evaluate", PLAN, "--cluster", CLUSTER, "--model", _write(t, "m.yaml", "base: gpt3-1.3b\ntf32: 'yes'\n")],
                                     ["m.yaml", "tf32", "true or false"]),
    "a TF32 table under a plain name": lambda t: (["evaluate", _tiny_plan(t), "--cluster", ROOT / "clusters" / "cpu2.yaml",
                                                   "--profiles", _tf32_table_as_plain(t)], ["cpu__tiny__s32.csv", "tf32: true"]),
    "measuring a TF32 model": lambda t: (["profile", "--device", "cpu", "--model", _write(t, "m.yaml", "base: tiny\ntf32: true\n"),
                                          "--out", t / "out.json"], ["--model", "tf32"]),
    # --- train options, refused before any rank starts ---------------------------------------------------------
    "--save-every -1": lambda t: (["train", "--plan", _tiny_plan(t), "--save-dir", t / "ck", "--save-every", -1], ["--save-every"]),
    "--lr nan": lambda t: (["train", "--plan", _tiny_plan(t), "--lr", "nan"], ["--lr", "nan"]),
    "--timeout 0": lambda t: (["train", "--plan", _tiny_plan(t), "--timeout", 0], ["--timeout"]),
    "--keep -2": lambda t: (["train", "--plan", _tiny_plan(t), "--save-dir", t / "ck", "--keep", -2], ["--keep"]),
    "--save-dir is a file": lambda t: (["train", "--plan", _tiny_plan(t), "--save-dir", _write(t, "ck", "x")], ["--save-dir", "not a directory"]),
    "--resume of an empty directory": lambda t: (["train", "--plan", _tiny_plan(t), "--save-dir", t, "--resume"], ["no checkpoint"]),
    "--steps 0": lambda t: (["train", "--plan", _tiny_plan(t), "--steps", 0], ["--steps"]),
    "--report into a directory": lambda t: (["train", "--plan", _tiny_plan(t), "--report", t, "--cluster", ROOT / "clusters" / "cpu2.yaml"],
                                            ["--report", "directory"]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_gives_one_line_and_exit_2(tmp_path, name):
    argv, words = CASES[name](tmp_path)
    before = set(tmp_path.rglob("*"))
    t0 = time.monotonic()
    code, out, err = run_cli(*argv)
    elapsed = time.monotonic() - t0
    assert code == 2, (code, out, err)
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err + out
    assert lines[0].startswith("error: ") and len(lines[0]) < 700, lines[0][:1000]
    for w in words:
        assert str(w) in lines[0], (w, lines[0])
    assert set(tmp_path.rglob("*")) == before, "an output file was written"
    assert not (tmp_path / "out.json").exists()
    assert elapsed < SECONDS, elapsed


def test_library_text_with_brackets_is_printed_literally(capsys):
    """gloo's messages hold '[/path/file.cc:78]'; rich read that as a closing tag and crashed."""
    import typer

    from baton.cli_support import guarded
    from baton.errors import BatonError

    @guarded
    def boom():
        raise BatonError("rank 1 failed: [/pytorch/third_party/gloo/pair.cc:553] Connection closed [bold]x[/bold]")

    with pytest.raises(typer.Exit) as exc:
        boom()
    assert exc.value.exit_code == 2
    err = capsys.readouterr().err
    assert "[/pytorch/third_party/gloo/pair.cc:553]" in err and "[bold]x[/bold]" in err


def test_version_and_short_help():
    code, out, _ = run_cli("--version")
    assert code == 0 and out.startswith("baton")
    code, out, _ = run_cli("-h")
    assert code == 0 and "solve" in out
    code, out, _ = run_cli("evaluate", "-h")
    assert code == 0 and "--json" in out and "<bool>" not in out  # a flag takes no value


def test_device_and_cluster_names_are_shown_literally(tmp_path, monkeypatch):
    """Tables of ``solve``, ``evaluate`` and ``show`` print the user's names: a node called 'n[red]' was
    shown as 'n' and one called '[/x]' crashed rich with a MarkupError."""
    monkeypatch.setenv("BATON_PROFILES", str(tmp_path / "user-profiles"))
    cluster = _write(tmp_path, "c.yaml", json.dumps({"name": "c[/x]", "nodes": [
        {"name": "n[red]", "gpus": [{"type": "cpu", "count": 1}]},
        {"name": "[/x]", "gpus": [{"type": "cpu", "count": 1}]}],
        "inter_node_link": {"bandwidth_gb_per_s": 3, "latency_us": 50}}))
    plan = tmp_path / "plan.json"
    code, out, err = run_cli("solve", "--cluster", cluster, "--model", "tiny", "--global-batch", 4, "--time-limit", 30, "--out", plan)
    assert code == 0, err
    for command in (["evaluate", plan, "--cluster", cluster], ["show", cluster]):
        code, out, err = run_cli(*command)
        assert code == 0 and "Traceback" not in out + err, (command, out, err)
        assert "c[/x]" in out and ("n[red]:0" in out or "[/x]:0" in out), (command, out)
