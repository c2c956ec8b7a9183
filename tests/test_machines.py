"""Runs across machines: each machine starts the plan's devices of its node, checked, whatever order machines
join in; a lost machine stops the run in one line, or with --elastic is re-planned around.

The first part needs nothing: which machine runs what, the checks, the printed commands, re-planning. The second
starts two "machines" on this host, network namespaces of their own joined by a shaped bridge
(``tests.machines_harness``), and skips where namespaces cannot be made. Every run there has a timeout, and
each test checks that nothing is left running in the namespaces it made.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from baton.errors import BatonError
from baton.plan import save_plan, simple_plan
from runtime.launch.machines import (check_devices, find_machine, machine_commands, machines_of, parse_endpoint,
                                     slurm_script)
from runtime.launch.plan_ranks import check_claims, replan
from tests.conftest import ROOT
from tests.runtime_helpers import reference_run, tiny

CLUSTER = ROOT / "clusters" / "cpu2x2.yaml"
GIB = 1024**3


def crossing_plan(steps_spec=None):
    """A pipeline that crosses machines three times, its middle stage split across both, in a device order that
    interleaves them and runs against their GPU order (m1:1 before m1:0)."""
    return simple_plan(steps_spec or tiny(0.1), cluster="cpu2x2", stages=[[("m1:1", 1)], [("m2:0", 1), ("m1:0", 1)], [("m2:1", 1)]],
                       layers=[1, 2, 1], units_per_layer=[1, 2, 1], micro_batch_size=2, num_microbatches=2)


# --- which machine runs what ------------------------------------------------------------------------


def test_every_machine_runs_its_nodes_devices_in_gpu_order_with_plan_ranks():
    m = machines_of(crossing_plan())
    assert list(m) == ["m1", "m2"]
    assert (m["m1"].devices, m["m1"].ranks, m["m1"].gpus) == (("m1:0", "m1:1"), (2, 0), (0, 1))
    assert (m["m2"].devices, m["m2"].ranks, m["m2"].gpus) == (("m2:0", "m2:1"), (1, 3), (0, 1))


def test_the_node_comes_from_the_option_or_the_hostname():
    plan = crossing_plan()
    assert find_machine(plan, "m2").node == "m2"
    assert find_machine(plan, None, hostname="m1.cluster.local").node == "m1"
    for node, host, words in [("m3", None, "node 'm3' runs no device of the plan (its nodes: m1, m2)"),
                              (None, "login7", "hostname 'login7' is no node of the plan (m1, m2); pass --node")]:
        with pytest.raises(BatonError) as err:
            find_machine(plan, node, hostname=host)
        assert err.value.field == "--node" and words in err.value.message


def test_endpoints_are_parsed_strictly():
    assert parse_endpoint("node1:29400") == ("node1", 29400) and parse_endpoint("node1") == ("node1", 29500)
    for bad in ("node1:x", ":29400", "node1:70000"):
        with pytest.raises(BatonError):
            parse_endpoint(bad)


def test_a_machine_whose_gpus_differ_from_the_plan_is_refused_naming_machine_index_expected_and_found():
    """The cephalo case: the A6000's share must not run on an L4 because torchrun's order said so."""
    from baton.cluster import load_cluster

    cluster = load_cluster(ROOT / "clusters" / "cephalo_8gpu.yaml")
    plan = simple_plan(tiny(0.0), cluster=cluster.name, stages=[[("m1:2", 1)], [("m1:0", 1)]], layers=[2, 2],
                       units_per_layer=1, micro_batch_size=1, num_microbatches=2)
    machine = find_machine(plan, "m1")
    l4, a6000 = ("NVIDIA L4", int(22.0 * GIB)), ("NVIDIA RTX A6000", int(47.5 * GIB))
    assert check_devices(plan, machine, device="auto", cluster=cluster, cuda=[l4, l4, a6000]) == "cuda"
    cases = [([l4, l4, l4], "machine m1, GPU 2: the plan expects a6000 for m1:2, found NVIDIA L4 (22.0 GiB, catalog l4)"),
             ([l4, l4], "machine m1, GPU 2: the plan runs m1:2 (a6000) there but this machine has 2 CUDA GPU(s)"),
             ([], "this machine has no CUDA GPU; pass --device cpu")]
    for gpus, words in cases:
        with pytest.raises(BatonError) as err:
            check_devices(plan, machine, device="auto", cluster=cluster, cuda=gpus)
        assert words in err.value.message and "\n" not in str(err.value)
    assert check_devices(plan, machine, device="cpu", cluster=cluster, cuda=[]) == "cpu"  # asked for: CPU stand-ins


def test_claims_catch_two_machines_on_one_node_and_a_missing_node():
    plan = crossing_plan()
    twice = [{"node": "m1", "machine": "a (10.0.0.2)"}, {"node": "m1", "machine": "b (10.0.0.3)"}]
    with pytest.raises(BatonError) as err:
        check_claims(plan, twice, allow_missing=True)
    assert "machines a (10.0.0.2) and b (10.0.0.3) both started as --node m1; no machine started as m2" in err.value.message
    alone = [{"node": "m2", "machine": "b"}]
    with pytest.raises(BatonError) as err:
        check_claims(plan, alone, allow_missing=False)
    assert "no machine started as --node m1 (the plan runs m1:0, m1:1 there)" in err.value.message
    assert check_claims(plan, alone, allow_missing=True) == ["m2"]


def test_a_process_count_the_plan_does_not_have_is_refused_before_the_rendezvous(monkeypatch):
    """Under torchrun with a wrong --nproc-per-node: refused before any store or group is touched."""
    from runtime.launch.plan_ranks import take_seat

    for key, value in {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "3", "RANK": "0", "WORLD_SIZE": "5"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(BatonError) as err:
        take_seat(crossing_plan(), "m1", backend="gloo", timeout_s=5)
    assert "machine m1 started 3 process(es) but the plan runs 2 device(s) there (m1:0, m1:1)" in err.value.message


def test_a_machine_without_its_nodes_interface_is_refused_before_starting(tmp_path):
    """The cluster file says m1 talks through bm1; a machine without it (this host) is not m1."""
    from runtime.launch.launcher import TrainConfig
    from runtime.launch.machine_train import launch_here

    cfg = TrainConfig(plan=crossing_plan(), rdzv_endpoint="127.77.0.2:29400", node="m1", cluster_path=str(CLUSTER), device="cpu")
    with pytest.raises(BatonError) as err:
        launch_here(cfg, tmp_path / "unused.yaml")
    assert "machine m1 has no network interface 'bm1' (the cluster file's interface of node m1)" in err.value.message
    cfg.elastic = True
    with pytest.raises(BatonError) as err:
        launch_here(cfg, tmp_path / "unused.yaml")
    assert err.value.field == "--elastic" and "needs --save-dir" in err.value.message


def test_printed_commands_name_every_machine_once():
    plan = crossing_plan()
    lines = [c for _, c in machine_commands(plan, "plan.json", "m1:29400", ["--steps", "10"])]
    assert lines == ["baton train --plan plan.json --node m1 --rdzv-endpoint m1:29400 --steps 10",
                     "baton train --plan plan.json --node m2 --rdzv-endpoint m1:29400 --steps 10"]
    script = slurm_script(plan, "plan.json", extra=["--save-dir", "/shared/ck"])
    assert "#SBATCH --nodes=2" in script and "NODES=(m1 m2)" in script and "$SLURM_NODEID" in script


def test_launch_print_on_the_command_line(tmp_path):
    save_plan(crossing_plan(), tmp_path / "p.json")
    res = subprocess.run([sys.executable, "-m", "cli", "launch", "--print", tmp_path / "p.json", "--rdzv-endpoint",
                          "m1:29400", "--", "--steps", "10"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    commands = [ln for ln in res.stdout.splitlines() if ln.startswith("baton train")]
    assert len(commands) == 2 and all("--steps 10" in c for c in commands)
    assert "# machine m1: plan devices m1:0, m1:1 (GPUs 0, 1)" in res.stdout


def test_replanning_keeps_the_model_and_global_batch_on_the_machines_left():
    plan = crossing_plan()
    new = replan(plan, ["m1"], cluster_path=CLUSTER, time_limit_s=20)
    assert sorted(new.device_ids()) == ["m1:0", "m1:1"] and new.global_batch == plan.global_batch
    assert new.model == plan.model and new.info["replanned_without"] == ["m2"]


def test_the_cluster_file_names_each_machines_interface():
    from baton.cluster import from_mapping, load_cluster

    assert load_cluster(CLUSTER).interfaces == {"m1": "bm1", "m2": "bm2"}
    with pytest.raises(BatonError) as err:
        from_mapping({"nodes": [{"name": "a", "interface": "eth 0", "gpus": [{"type": "cpu"}]}]}, source="c.yaml")
    assert "c.yaml: field 'nodes[0].interface'" in str(err.value)


# --- two machines on this host ----------------------------------------------------------------------

harness = pytest.importorskip("tests.machines_harness")
WHY_NOT = harness.unavailable()
machines_needed = pytest.mark.skipif(WHY_NOT is not None, reason=f"two machines on one host: {WHY_NOT}")
ENDPOINT = "127.77.0.2:29400"
RUN_S = 240


def _train_on(ms, plan_path: Path, tmp: Path, nodes: list[str], *extra, wait: bool = True, env=None, interface=False,
              only=None):
    """Start `baton train` on machine k as ``nodes[k]``; the first machine holds the rendezvous. Each machine's network
    interface comes from the cluster file's node, or with ``interface`` from --interface (the machine's own);
    ``only``: the machines to start (default all)."""
    import os

    procs = []
    for k, node in enumerate(nodes):
        if only is not None and k not in only:
            continue
        args = [sys.executable, "-m", "cli", "train", "--plan", str(plan_path), "--node", node, "--rdzv-endpoint", ENDPOINT,
                "--cluster", str(CLUSTER), "--device", "cpu", "--timeout", "30", *map(str, extra)]
        if interface:
            args += ["--interface", ms.machines[k].interface]
        procs.append(ms.machines[k].popen(args, cwd=ROOT, log=tmp / f"machine{k + 1}.log",
                                          env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}))
        if k == 0:
            time.sleep(1.0)  # the rendezvous host first: the other machine then finds its store at once
    if wait:
        for p in procs:
            p.wait(RUN_S)
    return procs


def _log(tmp: Path, k: int) -> str:
    """Machine k's output, stdout then stderr."""
    return (tmp / f"machine{k}.log").read_text() + (tmp / f"machine{k}.log.err").read_text()


def _errors(tmp: Path, k: int) -> list[str]:
    """Machine k's lines on stderr, but for its notes and torch's C++ warnings (in these namespaces, with no name
    service, every store client warns that it cannot name its own socket)."""
    return [ln for ln in (tmp / f"machine{k}.log.err").read_text().splitlines()
            if ln.strip() and not ln.startswith(("note:", "[W"))]


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


@machines_needed
@pytest.mark.long
def test_a_pipeline_across_machines_trains_as_one_device(tmp_path):
    """Stages on both machines, a TP stage split across them, ranks against GPU order: losses equal the single
    device's. Catches ranks taken from torchelastic's order (the groups would pair the wrong devices)."""
    plan = crossing_plan()
    save_plan(plan, tmp_path / "p.json")
    with harness.Machines(2, [400, 400]) as ms:
        procs = _train_on(ms, tmp_path / "p.json", tmp_path, ["m1", "m2"], "--steps", 3, "--lr", 1e-3,
                          "--run-dir", tmp_path / "run")
        assert [p.returncode for p in procs] == [0, 0], _log(tmp_path, 1) + _log(tmp_path, 2)
        assert ms.leftovers() == []
    want, _ = reference_run(plan.model, global_batch=plan.global_batch, steps=3, seed=0, lr=1e-3)
    got = _losses(tmp_path / "run")
    assert len(got) == 3 and all(abs(g - w) <= 1e-5 * abs(w) for g, w in zip(got, want)), (got, want)


@machines_needed
@pytest.mark.long  # namespaced machines; the claims' check runs quick in test_claims_catch_two_machines_on_one_node_and_a_missing_node
def test_two_machines_as_one_node_are_refused_in_one_line_before_training(tmp_path):
    save_plan(crossing_plan(), tmp_path / "p.json")
    with harness.Machines(2) as ms:
        procs = _train_on(ms, tmp_path / "p.json", tmp_path, ["m1", "m1"], "--steps", 3, "--run-dir", tmp_path / "run",
                          interface=True)
        assert [p.returncode for p in procs] == [2, 2]
        assert ms.leftovers() == []
    for k in (1, 2):
        lines = _errors(tmp_path, k)
        assert len(lines) == 1 and "both started as --node m1; no machine started as m2" in lines[0], lines
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@machines_needed
@pytest.mark.long  # namespaced machines; link measurement over gloo runs quick in test_measured_profile.py
def test_profile_comm_between_two_machines_recovers_the_shaped_bandwidth(tmp_path):
    """Both machines' interfaces shaped to 400 Mbit/s (0.05 GB/s) both ways. Three rounds of a few messages
    each land within about 10% of the rate on a quiet host (0.049 to 0.0575 GB/s in six runs); the band
    of 20% still fails on a wrong unit (8x, 1000x), an unshaped interface (GB/s) or latency and bandwidth
    mixed up in the fit."""
    import os

    with harness.Machines(2, [400, 400]) as ms:
        procs = []
        for k in (0, 1):
            args = [sys.executable, "-m", "cli", "profile", "--comm", "--peer", "127.77.0.2:29410", "--peer-rank", str(k),
                    "--interface", f"bm{k + 1}", "--out", str(tmp_path / "link.yaml")]
            procs.append(ms.machines[k].popen(args, cwd=ROOT, log=tmp_path / f"machine{k + 1}.log", env=dict(os.environ)))
        for p in procs:
            p.wait(RUN_S)
        assert [p.returncode for p in procs] == [0, 0], _log(tmp_path, 1) + _log(tmp_path, 2)
        assert ms.leftovers() == []
    import yaml

    nic = yaml.safe_load((tmp_path / "link.yaml").read_text())["nic"]
    print(f"shaped 0.050 GB/s, measured {nic['bandwidth_gb_per_s']:.4f} GB/s")
    assert abs(nic["bandwidth_gb_per_s"] - 0.05) <= 0.20 * 0.05, nic


@machines_needed
@pytest.mark.long
def test_the_printed_torchrun_line_runs_the_plan_ranks(tmp_path):
    """`baton launch --print --torchrun`'s line, run by hand on one machine of a one-machine plan whose device order
    runs against the GPU order: it trains, ranks from the plan."""
    import os
    import shlex

    from runtime.launch.machines import torchrun_command

    plan = simple_plan(tiny(0.1), cluster="cpu2x2", stages=[[("m1:1", 1)], [("m1:0", 1)]], layers=[2, 2],
                       units_per_layer=1, micro_batch_size=2, num_microbatches=2)
    save_plan(plan, tmp_path / "p.json")
    # The rendezvous on the machine's own loopback: torchrun recognises its host by name, and in these namespaces the
    # host's name resolves to no address of theirs.
    line = torchrun_command(plan, machines_of(plan)["m1"], str(tmp_path / "p.json"), "localhost:29400",
                            ["--cluster", str(CLUSTER), "--device", "cpu", "--steps", "2", "--timeout", "30",
                             "--run-dir", str(tmp_path / "run")])
    env_part, _, command = line.partition(" torchrun ")
    variables = dict(v.split("=", 1) for v in env_part.split())
    assert variables == {"BATON_MACHINE": "m1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    with harness.Machines(1) as ms:
        p = ms.machines[0].popen([sys.executable, "-m", "torch.distributed.run", *shlex.split(command)],
                                 cwd=ROOT, log=tmp_path / "machine1.log",
                                 env={**os.environ, **variables, "GLOO_SOCKET_IFNAME": "bm1"})
        p.wait(RUN_S)
        assert p.returncode == 0, _log(tmp_path, 1)
        assert ms.leftovers() == []
    want, _ = reference_run(plan.model, global_batch=plan.global_batch, steps=2, seed=0, lr=3e-4)
    got = _losses(tmp_path / "run")
    assert len(got) == 2 and all(abs(g - w) <= 1e-5 * abs(w) for g, w in zip(got, want)), (got, want)


@machines_needed
@pytest.mark.long
def test_a_lost_machine_stops_the_run_in_one_line_and_leaves_nothing(tmp_path):
    save_plan(crossing_plan(), tmp_path / "p.json")
    with harness.Machines(2) as ms:
        procs = _train_on(ms, tmp_path / "p.json", tmp_path, ["m1", "m2"], "--steps", 400, "--save-dir", tmp_path / "ck",
                          "--save-every", 2, wait=False)
        _wait_for(lambda: (tmp_path / "ck" / "step-000002").is_dir(), RUN_S)
        ms.machines[1].kill()
        t0 = time.monotonic()
        procs[0].wait(RUN_S)
        took = time.monotonic() - t0
        assert procs[0].returncode == 2 and took < 30 + 15, took
        print(f"the survivor stopped {took:.1f} s after the loss (--timeout 30)")
        assert ms.leftovers() == []
    lines = _errors(tmp_path, 1)
    assert len(lines) == 1 and "machine m2 (devices m2:0, m2:1 at 127.77.0.3) was lost" in lines[-1], lines


@machines_needed
@pytest.mark.long
def test_elastic_survivors_replan_resume_and_finish(tmp_path):
    """m2 is SIGKILLed after the checkpoint of step 2; m1 re-plans for its own two devices, resumes and finishes:
    the losses after the resume are the uninterrupted curve's."""
    plan = crossing_plan()
    save_plan(plan, tmp_path / "p.json")
    with harness.Machines(2) as ms:
        procs = _train_on(ms, tmp_path / "p.json", tmp_path, ["m1", "m2"], "--steps", 6, "--lr", 1e-3, "--save-dir",
                          tmp_path / "ck", "--save-every", 2, "--elastic", wait=False)
        _wait_for(lambda: (tmp_path / "ck" / "step-000002").is_dir(), RUN_S)
        ms.machines[1].kill()
        procs[0].wait(RUN_S)
        assert procs[0].returncode == 0, _log(tmp_path, 1)
        assert ms.leftovers() == []
    log = _log(tmp_path, 1)
    assert "re-planned without machine(s) m2 (devices m2:0, m2:1)" in log, log
    want, _ = reference_run(plan.model, global_batch=plan.global_batch, steps=6, seed=0, lr=1e-3)
    records = [json.loads(ln) for ln in (tmp_path / "ck" / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    last = {r["step"]: r["loss"] for r in records}  # steps counted from 1; one run twice (lost, resumed): the later
    assert sorted(last) == [1, 2, 3, 4, 5, 6]
    assert all(abs(last[s + 1] - want[s]) <= 1e-5 * abs(want[s]) for s in range(6)), (last, want)
    assert "resuming from step-000002 under the re-solved plan" in log


@machines_needed
@pytest.mark.long
def test_a_machine_that_comes_back_is_taken_in_and_the_run_finishes_under_the_given_plan(tmp_path):
    """m2 is SIGKILLed after the checkpoint of step 2; m1 goes on alone under a re-solved plan; m2, started again with
    its first command, waits at the rendezvous, m1's processes restart with it and both finish under the given plan
    from the newest checkpoint, every step's loss that of the uninterrupted curve. Catches a machine that comes back
    starting from step 1 while the survivors resume (its first command says nothing of resuming)."""
    plan = crossing_plan()
    save_plan(plan, tmp_path / "p.json")
    ck = tmp_path / "ck"
    extra = ["--steps", REJOIN_STEPS, "--lr", 1e-3, "--save-dir", ck, "--save-every", 2, "--elastic"]
    with harness.Machines(2) as ms:
        procs = _train_on(ms, tmp_path / "p.json", tmp_path, ["m1", "m2"], *extra, wait=False)
        _wait_for(lambda: (ck / "step-000002").is_dir(), RUN_S)
        ms.machines[1].kill()
        _wait_for(lambda: "under the re-solved plan" in _log(tmp_path, 1), RUN_S)
        (tmp_path / "machine2.log").rename(tmp_path / "machine2-lost.log")
        (tmp_path / "machine2.log.err").rename(tmp_path / "machine2-lost.log.err")
        again = _train_on(ms, tmp_path / "p.json", tmp_path, ["m1", "m2"], *extra, wait=False, only=[1])
        for p in procs[:1] + again:
            p.wait(RUN_S)
        assert [procs[0].returncode, again[0].returncode] == [0, 0], _log(tmp_path, 1) + _log(tmp_path, 2)
        assert ms.leftovers() == []
    log = _log(tmp_path, 1)
    resumed = [ln for ln in log.splitlines() if "under the given plan" in ln]
    assert resumed and "re-planned without machine(s) m2" in log, log
    records = [json.loads(ln) for ln in (ck / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    last = {r["step"]: r["loss"] for r in records}  # steps trained again after a restart: the later record
    assert sorted(last) == list(range(1, REJOIN_STEPS + 1))
    want, _ = reference_run(plan.model, global_batch=plan.global_batch, steps=REJOIN_STEPS, seed=0, lr=1e-3)
    assert all(abs(last[s + 1] - want[s]) <= 1e-5 * abs(want[s]) for s in range(REJOIN_STEPS)), (last, want)
    print(resumed[-1].strip())


@machines_needed
@pytest.mark.long
def test_ctrl_c_on_one_machine_saves_and_stops_every_machine_in_one_line_each(tmp_path):
    """SIGINT to m1's launcher, which is what a Ctrl-C in its terminal reaches (torchelastic starts the processes in
    sessions of their own): every rank of both machines finishes the step, they save one checkpoint together and
    stop; each machine exits 130 with one line naming the checkpoint, m2 saying the stop came from elsewhere."""
    import signal

    ck = tmp_path / "ck"
    save_plan(crossing_plan(), tmp_path / "p.json")
    with harness.Machines(2) as ms:
        procs = _train_on(ms, tmp_path / "p.json", tmp_path, ["m1", "m2"], "--steps", 400, "--save-dir", ck,
                          "--save-every", 1000, wait=False)
        metrics = ck / "metrics.jsonl"
        _wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 3, RUN_S)
        procs[0].send_signal(signal.SIGINT)
        for p in procs:
            p.wait(RUN_S)
        assert [p.returncode for p in procs] == [130, 130], _log(tmp_path, 1) + _log(tmp_path, 2)
        assert ms.leftovers() == []
    from runtime.train.checkpoint import checkpoints

    step = len([ln for ln in metrics.read_text().splitlines() if ln.strip()])
    assert [c.name for c in checkpoints(ck)] == [f"step-{step:06d}"] and step < 400
    for k, where in ((1, ""), (2, " (asked on another machine)")):
        lines = _errors(tmp_path, k)
        assert len(lines) == 1 and lines[0].startswith(f"interrupted: stopped after step {step}{where}; saved "), lines
        assert lines[0].endswith(f"step-{step:06d}"), lines


REJOIN_STEPS = 160
"""Enough that the survivor is still training alone when the lost machine comes back: it had reached step 63 of 300
when m2 was back, on 2 busy cores."""


def _wait_for(condition, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout_s} s")
        time.sleep(0.2)
