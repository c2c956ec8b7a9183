"""Optimizer-state offload under real plans: ``DeviceShare.offload_optimizer`` run by ``runtime/train/engine.py`` over
gloo (``runtime/train/host_optimizer.py``; sharded at ZeRO 1 by ``runtime/train/sharded_optimizer.py``).

A device's plan may keep its fp32 masters and Adam moments in host memory and step AdamW there. On CPU processes the
host step is the device step (the same fused kernel on the same fp32 values), so whatever the plan (one device, a
1F1B pipeline, uneven tensor parallelism, replicas sharding the state by uneven ratios at ZeRO 1; fp32, bf16, fp16;
weight decay and clipping) the losses and final weights of an offloading plan are those of the same plan without it,
bit for bit, and fp32 plans match the single-device reference. Each offloading rank holds exactly its state's bytes
on the host (4 + 8 + e per parameter whose state it keeps), none on the device, and moves e bytes a parameter each way
per step; the others hold and move nothing. A checkpoint saved under one plan resumes under the other, in both
directions and across sharding stages, with the same logical state.
"""
from __future__ import annotations

import math

import json
from dataclasses import replace

import pytest
import torch

from baton.errors import BatonError
from baton.plan import Plan, from_dict, validate
from tests.runtime_helpers import plan_of, reference_run, replicas_plan, run_ranks, tiny

SEED, LR, STEPS = 0, 1e-3, 3
ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def offloading(plan: Plan, ranks) -> Plan:
    """``plan`` with the devices of ``ranks`` (rank order) keeping their optimizer state in host memory."""
    ids = set(plan.device_ids()[r] for r in ranks)
    pipes = tuple(replace(p, stages=tuple(replace(s, devices=tuple(replace(d, offload_optimizer=d.id in ids)
                                                                   for d in s.devices)) for s in p.stages))
                  for p in plan.pipelines)
    return validate(replace(plan, pipelines=pipes))


def _worker(rank, world, plans, steps, options, kernel=None):
    """Each plan in turn in the same processes: every step's stats, the final weights, and the state each rank keeps.
    ``kernel``: AdamW's CPU kernel for every CPU tensor (``precision.CPU_ADAMW_KERNEL``), None: the default."""
    from runtime.data.source import TokenSource
    from runtime.train import precision
    from runtime.train.engine import Engine

    if kernel is not None:
        precision.CPU_ADAMW_KERNEL.clear()
        precision.CPU_ADAMW_KERNEL.update(kernel)
    out = []
    for plan in plans:
        engine = Engine(plan, rank, seed=SEED, lr=LR, **options)
        data = TokenSource(plan.model, seed=SEED, global_batch=plan.global_batch)
        history = [engine.train_step(step, data) for step in range(steps)]
        owned = engine.precision.owned_params() if engine.sharded else sum(p.numel() for p in engine.model.parameters())
        out.append({"history": history, "owned": owned,
                    "weights": {n: p.detach().clone() for n, p in engine.model.named_parameters()}})
    return out


def run_case(plain: Plan, ranks, *, reference: bool = True, steps: int = STEPS, kernel: dict | None = None,
             **options) -> list:
    """``plain`` and the same plan offloading the optimizer state of ``ranks``, in the same processes (AdamW's CPU
    ``kernel`` as ``_worker``'s); the checks of the module docstring on every rank. Returns the offloading plan's results
    by rank."""
    plan = offloading(plain, ranks)
    results = run_ranks(_worker, len(plan.device_ids()), [plain, plan], steps, options, kernel, timeout=240.0)
    ref = reference_run(plain.model, global_batch=plain.global_batch, steps=steps, seed=SEED, lr=LR)[0] if reference else []
    e = ELEMENT_BYTES[plain.model.dtype]
    for rank, (base, off) in enumerate(results):
        losses = [s.loss for s in off["history"]]
        assert losses == [s.loss for s in base["history"]], f"rank {rank}: offloading changed the losses"
        for step, (got, want) in enumerate(zip(losses, ref)):
            assert abs(got - want) <= 1e-5 * abs(want), f"step {step} loss {got} != reference {want}"
        for name, w in off["weights"].items():
            assert torch.equal(w, base["weights"][name]), f"rank {rank}: {name} differs after offloading"
        n = off["owned"]
        assert n == base["owned"] and n > 0
        for s, s0 in zip(off["history"], base["history"]):
            if rank in ranks:
                assert s.host_optimizer_bytes == (12 + e) * n, (rank, s.host_optimizer_bytes, n)
                assert s.master_bytes == s.moments_bytes == 0
                assert s.host_optimizer_out_bytes == s.host_optimizer_in_bytes == e * n
                assert s.host_optimizer_ms > 0 and s.host_optimizer_wait_ms == 0.0  # a CPU process copies at once
                assert s0.moments_bytes == 8 * n and s0.master_bytes == (4 * n if e < 4 else 0)
            else:
                assert (s.host_optimizer_bytes, s.host_optimizer_out_bytes, s.host_optimizer_ms) == (0, 0, 0.0)
                assert (s.master_bytes, s.moments_bytes) == (s0.master_bytes, s0.moments_bytes)
            assert s0.host_optimizer_bytes == 0 and s.weights_bytes == s0.weights_bytes
    return [off for _, off in results]


# --- the plan field ----------------------------------------------------------------------------------------


def test_the_field_round_trips_and_is_left_out_when_false():
    """Written only when true (an old plan file is written byte for byte as before), read back as written."""
    plain = plan_of(tiny(0.1), [[1], [1]], [2, 2], 1)
    assert "offload_optimizer" not in plain.to_json()
    plan = offloading(plain, [1])
    data = json.loads(plan.to_json())
    assert [d.get("offload_optimizer") for s in data["pipelines"][0]["stages"] for d in s["devices"]] == [None, True]
    back = from_dict(data)
    assert back == plan and back.to_json() == plan.to_json()
    assert from_dict(json.loads(plain.to_json())).to_json() == plain.to_json()


def test_a_bad_value_and_stages_2_and_3_are_refused_with_one_line():
    """Not a boolean ('yes', 1): the file and field named. ZeRO 2 and 3 shard the gradients and step unit by unit on
    the device: refused naming the device and the field."""
    plain = plan_of(tiny(0.1), [[1]], [4], 1)
    for bad in ("yes", 1, "false"):  # null reads as absent, as for every field
        data = json.loads(plain.to_json())
        data["pipelines"][0]["stages"][0]["devices"][0]["offload_optimizer"] = bad
        with pytest.raises(BatonError) as exc:
            from_dict(data, source="p.json")
        line = str(exc.value)
        assert "\n" not in line and "p.json" in line and "pipelines[0].stages[0].devices[0].offload_optimizer" in line
        assert "true or false" in line
    for stage in (2, 3):
        layered = replicas_plan(tiny(0.1), [dict(stages=[[1]], layers=[4], units=1)] * 2, zero_stage=stage)
        with pytest.raises(BatonError) as exc:
            offloading(layered, [1])
        line = str(exc.value)
        assert "pipelines[1].stages[0].devices[0].offload_optimizer" in line and "'local:1'" in line
        assert "zero_stage 0 or 1" in line and "\n" not in line
    for stage in (0, 1):
        offloading(replicas_plan(tiny(0.1), [dict(stages=[[1]], layers=[4], units=1)] * 2, zero_stage=stage), [0, 1])


# --- parity under plans ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_one_device(dtype):
    """One device, four layers, with weight decay and clipping (the clip factor and fp16's loss scale applied on the
    host on the gradients' way in). fp32 also against the single-device reference without them. Catches: host masters
    not taking the initial values, the clip factor or loss scale lost, weights not copied back (the next step's loss
    would be the first's), decay applied to biases on the host."""
    plain = plan_of(tiny(0.1, dtype=dtype), [[1]], [4], 1, m=2, mbs=2)
    run_case(plain, [0], reference=False, weight_decay=0.1, clip_grad=0.05)
    if dtype == "fp32":
        run_case(plain, [0], steps=2)


def test_pipeline_of_two_stages_one_offloading():
    """A 1F1B pipeline of two stages, bf16, over three micro-batches: only stage 1 (the head, the tied embedding's
    second copy) offloads. Catches: one rank's choice applied to the other, the tied gradient's sum not in the copy."""
    run_case(plan_of(tiny(0.1, dtype="bf16"), [[1], [1]], [2, 2], 1, m=3, mbs=1), [1], reference=False)


def test_pipeline_of_two_stages_fp32_against_the_reference():
    run_case(plan_of(tiny(0.1), [[1], [1]], [2, 2], 1, m=2, mbs=1), [0, 1], steps=2)


def test_uneven_tensor_parallel_ranks():
    """TP 3:1 on one stage: the three-unit rank offloads, the one-unit rank does not; fp32 against the reference.
    Catches: a rank's masters cut from the wrong slice, the replicated LayerNorms stepped differently on the two."""
    run_case(plan_of(tiny(0.1), [[3, 1]], [4], 4, m=2, mbs=2), [0], steps=2)


@pytest.mark.parametrize("dtype, ratios, ranks", [("fp32", None, [0, 1]), ("bf16", [0.7, 0.3], [0]),
                                                  ("fp16", [0.25, 0.75], [1])])
def test_replicas_at_zero_1_shard_the_host_state(dtype, ratios, ranks):
    """Two one-device replicas of different batches at ZeRO 1: each offloading rank keeps only its owned shard on the
    host (its ratio of the flat vector), steps it there and its updated weights are all-gathered as before. Uneven
    ratios with only one of the two offloading. Catches: the whole state kept on the host, the owned range's gradients
    taken from the wrong offsets, the weights copied back after the all-gather (a peer would get stale ones)."""
    plain = replicas_plan(tiny(0.1, dtype=dtype), [dict(stages=[[1]], layers=[4], units=1, m=2, mbs=2),
                                                   dict(stages=[[1]], layers=[4], units=1, m=1, mbs=2)],
                          zero_stage=1, ratios=ratios)
    results = run_case(plain, ranks, reference=dtype == "fp32", steps=2 if dtype == "fp32" else STEPS)
    if ratios is not None:
        total = sum(r["owned"] for r in results)
        assert [r["owned"] for r in results] == pytest.approx([total * x for x in ratios], abs=64)


def test_replicas_at_zero_1_with_a_pipeline_and_tensor_parallelism():
    """Replica 0 a two-stage pipeline with TP 3:1 on its first stage, replica 1 one device; ZeRO 1 with ratios, fp32:
    peer groups of unlike shapes whose owned ranges cut column ranges of matrices (strided pieces); offloading on
    the TP rank and on the single device.

    On the device a strided piece takes torch's per-tensor AdamW loop (the fused CPU kernel cannot walk it,
    ``precision.adamw_kernel``); on the host the same piece is a contiguous slice of the shard and takes the fused
    kernel, which agrees with the loop to an ulp or two of fp32 (the losses to 1e-7 here), and Adam's normalised step
    amplifies that over steps. So the bookkeeping is checked bit for bit with the loop everywhere, and the default
    kernels against the reference."""
    plain = replicas_plan(tiny(0.1), [dict(stages=[[3, 1], [1]], layers=[2, 2], units=[4, 1], m=2, mbs=1),
                                      dict(stages=[[1]], layers=[4], units=1, m=1, mbs=2)],
                          zero_stage=1, ratios=[0.5, 0.5, 0.6, 0.5])
    run_case(plain, [1, 3], steps=2, kernel={"foreach": False})
    plan = offloading(plain, [1, 3])
    ref = reference_run(plan.model, global_batch=plan.global_batch, steps=2, seed=SEED, lr=LR)[0]
    for res in run_ranks(_worker, 4, [plan], 2, {}, timeout=240.0):
        assert [s.loss for s in res[0]["history"]] == pytest.approx(ref, rel=1e-5)


def test_an_overflowing_fp16_step_moves_nothing_and_skips_as_without(one_rank_group):
    """fp16 with an inf gradient at step 0: the offloading rank skips it as the plain one does (nothing crosses the
    link, the host state stays), and the next steps equal the plain plan's. Catches: the host stepping on inf
    gradients, a skipped step still copying weights back."""
    import math

    from runtime.data.source import TokenSource
    from runtime.train.engine import Engine
    from runtime.train.precision import LossScaleSettings

    plain = plan_of(tiny(0.1, dtype="fp16"), [[1]], [4], 1, m=2, mbs=1)
    runs = []
    for plan in (plain, offloading(plain, [0])):
        engine = Engine(plan, 0, seed=SEED, lr=LR, loss_scale=LossScaleSettings(initial_scale=2.0**10))
        data = TokenSource(plan.model, seed=SEED, global_batch=plan.global_batch)
        hook = engine.model.ln_f.weight.register_hook(lambda g: torch.full_like(g, math.inf))
        stats = [engine.train_step(0, data)]
        hook.remove()
        stats += [engine.train_step(step, data) for step in (1, 2)]
        runs.append((stats, {n: p.detach().clone() for n, p in engine.model.named_parameters()}))
    (base, w0), (off, w1) = runs
    assert [s.skipped for s in off] == [s.skipped for s in base] == [True, False, False]
    assert [s.loss for s in off] == [s.loss for s in base] and [s.loss_scale for s in off] == [s.loss_scale for s in base]
    assert off[0].host_optimizer_out_bytes == off[0].host_optimizer_in_bytes == 0 < off[1].host_optimizer_out_bytes
    assert all(torch.equal(w1[n], w0[n]) for n in w0)


# --- checkpoints ---------------------------------------------------------------------------------------------


def _resume_worker(rank, world, first, second, before, after, save_dir):
    """``first`` for ``before`` steps and saved; a fresh engine under ``second`` loads it and runs ``after`` steps;
    and ``second`` run from the start for ``before + after`` steps: its losses, and the saved and restored states."""
    from runtime.data.source import TokenSource
    from runtime.train.checkpoint import CheckpointReader, _gather_full_state, save_checkpoint
    from runtime.train.engine import Engine

    options = dict(seed=SEED, lr=LR, weight_decay=0.1)
    data = TokenSource(first.model, seed=SEED, global_batch=first.global_batch)
    engine = Engine(first, rank, **options)
    for step in range(before):
        engine.train_step(step, data)
    path = save_checkpoint(engine, save_dir, step=before, samples_seen=data.samples_before(before), extra={})
    saved = _gather_full_state(engine)
    resumed = Engine(second, rank, **options)
    CheckpointReader(path, second.model).load_into(resumed)
    restored = _gather_full_state(resumed)
    steps = (engine.optimizer_steps(), resumed.optimizer_steps())
    tail = [resumed.train_step(step, data).loss for step in range(before, before + after)]
    whole = Engine(second, rank, **options)
    straight = [whole.train_step(step, data).loss for step in range(before + after)]
    return {"saved": saved, "restored": restored, "steps": steps, "tail": tail, "straight": straight[before:]}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_checkpoint_saved_with_offload_resumes_without_and_back(tmp_path, dtype):
    """Two replicas: saved at ZeRO 1 (ratios 0.7/0.3) with rank 0 offloading, resumed at ZeRO 0 with nobody offloading,
    and saved at ZeRO 0 with both offloading, resumed at ZeRO 1 with rank 1 offloading. The state saved is the state
    restored (full fp32 masters and moments, bit for bit), the step count carries over, and the resumed losses are the
    uninterrupted run's. Catches: host masters or moments missing from a checkpoint (zeros), moments loaded onto the
    device for a host optimizer, fp32 host masters not set on load (the module's weights alone were before)."""
    shape = [dict(stages=[[1]], layers=[4], units=1, m=2, mbs=2), dict(stages=[[1]], layers=[4], units=1, m=1, mbs=2)]
    spec = tiny(0.1, dtype=dtype)
    zero1 = replicas_plan(spec, shape, zero_stage=1, ratios=[0.7, 0.3])
    zero0 = replicas_plan(spec, shape, zero_stage=0)
    for k, (first, second) in enumerate([(offloading(zero1, [0]), zero0), (offloading(zero0, [0, 1]), offloading(zero1, [1]))]):
        results = run_ranks(_resume_worker, 2, first, second, 2, 2, str(tmp_path / f"ck{k}"), timeout=240.0)
        res = results[0]
        for name, t in res["saved"].items():
            assert torch.equal(t, res["restored"][name]), f"{name}: restored state differs from the saved state"
            assert t[1].abs().sum() > 0, f"{name}: no moments saved"
        for r in results:
            assert r["steps"] == (2, 2)
            for got, want in zip(r["tail"], r["straight"]):
                assert abs(got - want) <= 1e-6 * abs(want), (k, r["tail"], r["straight"])


# --- the step's reads ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_an_offloading_step_reads_the_device_once(one_rank_group, monkeypatch, zero_stage):
    """The copies to and from the host add no read to a step on CPU (tests/test_step_sync.py's counting; on CUDA the
    one wait for the gradient copies is ``HostLink.wait``'s, after the step's read)."""
    from tests.test_step_sync import HostReads, _assert_one_read, _engine

    counter = HostReads(monkeypatch)
    plain = replicas_plan(tiny(0.1, dtype="bf16"), [dict(stages=[[1]], layers=[4], units=1, m=2, mbs=1)],
                          zero_stage=zero_stage)
    engine, data = _engine(offloading(plain, [0]), clip_grad=0.5)
    for step in range(2):
        stats, reads = counter.step(engine, step, data)
        _assert_one_read(reads)
    assert stats.host_optimizer_bytes > 0 and stats.host_optimizer_in_bytes > 0


def test_measured_figures_in_the_report():
    """``build_report`` puts each device's host optimizer bytes and step time beside its other measured figures."""
    from runtime.measure.report import build_report, summary_rows
    from tests.test_zero_stages import _prediction

    plan = offloading(replicas_plan(tiny(0.1), [dict(stages=[[1]], layers=[4], units=1, m=2, mbs=2),
                                                dict(stages=[[1]], layers=[4], units=1, m=1, mbs=2)], zero_stage=1), [1])
    results = run_ranks(_worker, 2, [plan], 2, {}, timeout=240.0)
    cluster, profiles, _ = _prediction(plan)
    report = build_report(plan, cluster, profiles, {r: res[0]["history"] for r, res in enumerate(results)})
    got = [d["measured"]["host_optimizer_bytes"] for d in report["devices"]]
    assert got[0] == 0 and got[1] == 16 * results[1][0]["owned"]
    assert report["devices"][1]["measured"]["host_optimizer_ms"] > 0
    want = [d["predicted"]["host_optimizer_bytes"] for d in report["devices"]]
    print("host optimizer bytes measured", got, "predicted (eq. 7h)", want)
    assert want[0] == 0 and math.isclose(got[1], want[1], rel_tol=1e-6), (got, want)
    rows = [r[0] for r in summary_rows(report)]
    assert f"{plan.device_ids()[1]} host optimizer MiB" in rows and f"{plan.device_ids()[0]} host optimizer MiB" not in rows
