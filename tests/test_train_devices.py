"""Which devices ``baton train`` uses, the pre-flight memory check, and the throughput it reports.

No GPU is needed: CUDA choices are checked against a stated number of GPUs, and the check against the
machine's RAM runs on this one.
"""
from __future__ import annotations

import pytest
import torch

from baton.errors import BatonError
from baton.plan import load_plan, simple_plan
from runtime.launch.devices import (CPU_MEMORY_SHARE, RunDevices, capacities, catalog_gpu, choose_devices, parse_gpus, preflight,
                             resolve_cluster)
from tests.conftest import ROOT, run_cli
from tests.runtime_helpers import tiny

HAND_PLAN = ROOT / "examples" / "a100x2_t4x2_gpt3-1.3b_hand.json"


# --- choosing devices -------------------------------------------------------------------------------


@pytest.mark.parametrize("requested,gpus,world,available,want", [
    ("auto", None, 2, 4, RunDevices(kind="cuda", gpus=(0, 1))),
    ("auto", None, 4, 2, RunDevices(kind="cpu")),  # auto may run CPU processes when GPUs are too few
    ("cpu", None, 2, 4, RunDevices(kind="cpu")),
    ("cuda", None, 2, 2, RunDevices(kind="cuda", gpus=(0, 1))),
    ("auto", (3, 1), 2, 4, RunDevices(kind="cuda", gpus=(3, 1))),
    ("cuda", (2,), 1, 4, RunDevices(kind="cuda", gpus=(2,))),
])
def test_devices_of_a_run(requested, gpus, world, available, want):
    assert choose_devices(requested, gpus, world, available=available) == want


@pytest.mark.parametrize("requested,gpus,world,available,field,words", [
    ("cuda", None, 4, 2, "--device", "this machine has 2 CUDA GPU"),  # never a silent fall-back to CPU
    ("cuda", None, 1, 0, "--device", "0 CUDA GPU"),
    ("cpu", (0,), 1, 1, "--gpus", "cannot go with --device cpu"),
    ("auto", (0,), 2, 2, "--gpus", "one GPU per plan device"),
    ("auto", (0, 5), 2, 2, "--gpus", "GPU 5 does not exist"),
])
def test_impossible_device_choices_are_errors(requested, gpus, world, available, field, words):
    with pytest.raises(BatonError) as err:
        choose_devices(requested, gpus, world, available=available)
    assert err.value.field == field and words in err.value.message


def test_gpus_option_is_parsed_strictly():
    assert parse_gpus("0,2,1") == (0, 2, 1) and parse_gpus(None) is None
    for bad, words in [("0,0", "twice"), ("a", "comma-separated"), ("-1", ">= 0"), ("0,,1", "comma-separated")]:
        with pytest.raises(BatonError) as err:
            parse_gpus(bad)
        assert err.value.field == "--gpus" and words in err.value.message


def test_torchrun_rank_device_is_never_a_silent_cpu_fallback():
    """Under torchrun each rank picks its own device: CUDA asked for without a GPU is an error."""
    from runtime.launch.launcher import TrainConfig, _torchrun_device

    plan = simple_plan(tiny(), cluster="cpu2", stages=[[("local:0", 1)]], layers=[4], units_per_layer=1)
    assert _torchrun_device(TrainConfig(plan=plan, device="cpu"), 0, 1) == torch.device("cpu")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert _torchrun_device(TrainConfig(plan=plan, device="auto"), 0, 1) == torch.device("cpu")
    for cfg, field in [(TrainConfig(plan=plan, device="cuda"), "--device"), (TrainConfig(plan=plan, gpus=(0,)), "--gpus"),
                       (TrainConfig(plan=plan, device="cpu", gpus=(0,)), "--gpus")]:
        with pytest.raises(BatonError) as err:
            _torchrun_device(cfg, 0, 1)
        assert err.value.field == field


@pytest.mark.parametrize("name,gib,want", [
    ("NVIDIA H100 80GB HBM3", 79.6, "h100"), ("NVIDIA H200", 139.8, "h200"), ("NVIDIA A100-SXM4-40GB", 39.4, "a100-40gb"),
    ("NVIDIA A100 80GB PCIe", 79.2, "a100-80gb"), ("Tesla T4", 14.7, "t4"), ("NVIDIA A10G", 22.0, "a10g"),
    ("Tesla V100-SXM2-32GB", 31.7, "v100-32gb"), ("Tesla V100-PCIE-16GB", 15.8, "v100-16gb"), ("NVIDIA L4", 22.0, "l4"),
    ("NVIDIA GeForce RTX 4090", 23.6, "rtx4090"), ("NVIDIA RTX A6000", 47.5, "a6000"), ("AMD Instinct MI250X", 64.0, None),
])
def test_local_gpu_names_map_to_the_catalog(name, gib, want):
    assert catalog_gpu(name, int(gib * 1024**3)) == want


# --- the pre-flight check ---------------------------------------------------------------------------


def test_a_plan_that_cannot_fit_is_refused_before_any_rank_starts(monkeypatch):
    """GPT-3 1.3B planned for A100s and T4s, on CPU processes: refused in the parent, naming the device,
    its need and the capacity. Catches a check that runs inside the ranks (after they started) or not
    at all."""
    from runtime.launch import launcher as launch

    def no_ranks(*args, **kwargs):
        raise AssertionError("ranks were started")

    monkeypatch.setattr(launch, "_train_spawned", no_ranks)
    with pytest.raises(BatonError) as err:
        launch.train(launch.TrainConfig(plan=load_plan(HAND_PLAN), steps=1, device="cpu"))
    msg = err.value.message
    assert err.value.field == "--plan" and "needs" in msg and "GiB at its peak" in msg and "this machine's CPU" in msg
    assert any(f"plan device {d}" in msg for d in ("a100:0", "a100:1", "t4:0", "t4:1"))


def test_refusal_is_one_line_on_the_command_line():
    # In this process (the command line's own parser and error handling): an interpreter start costs more than the check.
    code, _, stderr = run_cli("train", "--plan", HAND_PLAN, "--device", "cpu", "--steps", "1")
    assert code == 2 and "Traceback" not in stderr
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "needs" in lines[0] and "GiB" in lines[0], stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_gpus_is_an_error_on_the_command_line():
    code, _, stderr = run_cli("train", "--plan", HAND_PLAN, "--device", "cuda", "--steps", "1")
    assert code == 2 and "--device" in stderr and "0 CUDA GPU" in stderr and "Traceback" not in stderr
    code, _, stderr = run_cli("train", "--plan", HAND_PLAN, "--gpus", "0,1,2,3", "--steps", "1")
    assert code == 2 and "--gpus" in stderr and "Traceback" not in stderr


def test_cpu_capacity_is_a_share_of_ram(monkeypatch):
    """Every CPU rank gets CPU_MEMORY_SHARE of the RAM divided by the ranks; a tiny plan fits a normal
    machine and is refused on one with 1 MiB."""
    from runtime.launch import devices

    plan = simple_plan(tiny(), cluster="cpu2", stages=[[("local:0", 1)], [("local:1", 1)]], layers=[3, 1], units_per_layer=1)
    caps = capacities(RunDevices(kind="cpu"), 2)
    assert caps[0][1] == int(CPU_MEMORY_SHARE * devices.machine_ram_bytes() / 2)
    checked = preflight(plan, caps)
    assert all(d.peak_memory_bytes < caps[0][1] for d in checked.prediction.devices)
    monkeypatch.setattr(devices, "machine_ram_bytes", lambda: 1 << 20)
    with pytest.raises(BatonError, match="has 0.00 GiB"):
        preflight(plan, capacities(RunDevices(kind="cpu"), 2))


def test_the_plans_cluster_is_found_by_name_or_stood_in_for():
    """A plan for a shipped cluster is priced on it (reserves, GPU types); one for an unknown cluster
    on 'cpu' stand-ins, with a note; --cluster for another cluster is the user's error."""
    ours = simple_plan(tiny(), cluster="cpu2", stages=[[("local:0", 1)]], layers=[4], units_per_layer=1)
    cluster, note = resolve_cluster(ours, None)
    assert note is None and cluster.source.endswith("cpu2.yaml")
    stranger = simple_plan(tiny(), cluster="elsewhere", stages=[[("n0:0", 1)], [("n1:3", 1)]], layers=[2, 2], units_per_layer=1)
    cluster, note = resolve_cluster(stranger, None)
    assert "not found" in note and [d.gpu.name for d in cluster.devices] == ["cpu", "cpu"]
    checked = preflight(stranger, [("here", 1 << 40)] * 2)
    assert checked.cluster_note == note and checked.peak_flops == pytest.approx(2 * 0.2e12)
    with pytest.raises(BatonError, match="made for cluster"):
        preflight(ours, [("here", 1 << 40)], cluster_path=ROOT / "clusters" / "cpu4.yaml")


# --- throughput -------------------------------------------------------------------------------------


def test_measured_mfu_is_the_evaluators_formula():
    """A run whose steps take exactly the predicted iteration time has the evaluator's tokens/s and MFU:
    the two share the FLOP count (baton.costmodel.model_flops_per_sample) and the catalog peaks."""
    from baton.cluster import load_cluster
    from baton.evaluate import evaluate
    from baton.profile import ProfileSet
    from runtime.train.engine import StepStats
    from runtime.measure.meters import throughput

    plan = load_plan(HAND_PLAN)
    cluster = load_cluster(ROOT / "clusters" / "a100x2_t4x2.yaml")
    pred = evaluate(plan, cluster, ProfileSet(plan.model))
    checked = preflight(plan, [("big", 1 << 50)] * 4, cluster_path=ROOT / "clusters" / "a100x2_t4x2.yaml")
    tokens = plan.global_batch * plan.model.seq_len
    history = [StepStats(step=0, loss=1.0, iteration_ms=10 * pred.iteration_time_ms, tokens=tokens)] + \
              [StepStats(step=i, loss=1.0, iteration_ms=pred.iteration_time_ms, tokens=tokens, skipped=i == 2) for i in (1, 2, 3)]
    speed = throughput(history, plan.model, plan.global_batch, checked.peak_flops)
    assert speed.steps == 3 and speed.skipped_steps == 1  # the first step (warm-up) is left out
    assert speed.tokens_per_s == pytest.approx(pred.tokens_per_s) and speed.mfu == pytest.approx(pred.mfu)


@pytest.mark.long  # a real run for one printed line: its figures are the formula above; test_train_metrics.py's run prints tok/s
def test_train_prints_tokens_per_second_and_mfu(tmp_path):
    """Two CPU processes on the shipped cpu2 cluster (found by the plan's cluster name)."""
    from baton.plan import save_plan

    plan = simple_plan(tiny(), cluster="cpu2", stages=[[("local:0", 1)], [("local:1", 1)]], layers=[3, 1], units_per_layer=1,
                       micro_batch_size=2, num_microbatches=2)
    save_plan(plan, tmp_path / "plan.json")
    # The launcher in this process (its ranks are processes either way): one interpreter start less.
    code, stdout, stderr = run_cli("train", "--plan", tmp_path / "plan.json", "--steps", "3", "--timeout", "120")
    assert code == 0, stderr
    line = next(ln for ln in stdout.splitlines() if ln.startswith("throughput:"))
    assert "tokens/s averaged over 2 step(s)" in line and "MFU" in line and "0.4 TFLOP/s" in line
    assert "Traceback" not in stderr
