"""Activation offload under real plans: ``DeviceShare.offload`` run by ``runtime/train/engine.py``, over gloo.

A device's plan may keep held tensors of its layers in host memory between the passes (``runtime/parallel/offload.py``,
tested layer by layer in tests/test_offload.py). Whatever the plan (one device with partial recomputation, a 1F1B
pipeline, interleaved chunks, uneven tensor parallelism, replicas at ZeRO 1 and layer by layer at ZeRO 3, bf16),
offloading changes no number: the losses are those of the same plan without offload bit for bit, and the
single-device reference's. At every step each device's host holds at its peak exactly the predicted bytes (the
micro-batches and layers in flight x ``baton.memory.tensor_bytes`` of its offloaded tensors, from the analytic table,
and the evaluator's ``host_activation_bytes``), every byte copied out comes back in, prefetched (none late), the host
buffers of the first step serve the next, and the device-side saved bytes (``SavedBytes``, the report's
``peak_saved_bytes``) drop by exactly the host's.
"""
from __future__ import annotations

import gc
import weakref
from dataclasses import replace

import pytest
import torch

from baton.plan import Plan, validate
from tests.runtime_helpers import plan_of, reference_run, replicas_plan, run_ranks, tiny

SEED, LR, STEPS = 0, 1e-3, 2
ALL_OPS = ["ln1", "qkv", "attn_scores", "softmax", "attn_dropout", "attn_v", "out_proj", "resid1", "ln2", "fc1", "gelu",
           "fc2", "resid2"]


def offloading(plan: Plan, offload: dict[int, list[str]]) -> Plan:
    """``plan`` with the device of rank ``r`` offloading ``offload[r]`` (in every virtual stage it runs)."""
    ids = plan.device_ids()
    names = {ids[r]: tuple(v) for r, v in offload.items()}
    pipes = tuple(replace(p, stages=tuple(replace(s, devices=tuple(replace(d, offload=names.get(d.id, d.offload))
                                                                   for d in s.devices)) for s in p.stages))
                  for p in plan.pipelines)
    return validate(replace(plan, pipelines=pipes))


def _worker(rank, world, plans, steps):
    """Each plan in turn in the same processes: every step's stats and the host buffers allocated so far."""
    from runtime.data.source import TokenSource
    from runtime.train.engine import Engine

    out = []
    for plan in plans:
        engine = Engine(plan, rank, seed=SEED, lr=LR)
        data = TokenSource(plan.model, seed=SEED, global_batch=plan.global_batch)
        history, buffers = [], []
        for step in range(steps):
            history.append(engine.train_step(step, data))
            buffers.append(engine.model.stash.host_buffers_allocated if engine.model.stash is not None else 0)
        out.append({"history": history, "buffers": buffers})
    return out


def offloaded_per_layer(plan: Plan, rank: int) -> int:
    """Bytes one layer of rank ``rank`` offloads per micro-batch: ``tensor_bytes`` (analytic table) of its names."""
    from baton.memory import tensor_bytes
    from baton.operators import layer_operators
    from baton.profile import Profile, derive_table
    from runtime.parallel.topology import Topology

    topo = Topology(plan)
    pos = topo.position(rank)
    stage = topo.stage(pos)
    device = stage.devices[pos.tp_rank]
    if not device.offload:
        return 0
    spec, b = plan.model, plan.batch(pos.pipeline)[0]
    share = device.units / stage.units_per_layer
    table = Profile(derive_table(spec, "cpu", micro_batches=(b,)))
    costs = {o.name: table.cost(o.name, b, share if o.tp_split else 1.0) for o in layer_operators(spec)}
    sizes = tensor_bytes(spec, b, share, {n: c.saved_bytes for n, c in costs.items()},
                         {n: c.output_bytes for n, c in costs.items()})
    return int(sum(sizes[n] for n in device.offload))


def layers_in_flight(plan: Plan, rank: int) -> tuple[int, int]:
    """(the most layer passes whose forward has run and backward not, all forwards of a step) over rank ``rank``'s
    schedule: the 1F1B or interleaved one, or layer by layer at ZeRO 2 and 3."""
    from baton.schedules import WHOLE, Backward, Forward, interleaved_one_f_one_b, layer_by_layer
    from runtime.parallel.topology import Topology

    pos = Topology(plan).position(rank)
    pipe, m = plan.pipelines[pos.pipeline], plan.batch(pos.pipeline)[1]
    schedule = (layer_by_layer(plan.zero_stage, plan.model.num_layers, m) if plan.zero_stage >= 2
                else interleaved_one_f_one_b(len(pipe.device_stages), pipe.chunks, m))
    live = peak = total = 0
    for a in schedule.devices[pos.stage]:
        if isinstance(a, (Forward, Backward)):
            n = pipe.stages[a.stage].num_layers if a.part == WHOLE else int(isinstance(a.part, int))
            live += n if isinstance(a, Forward) else -n
            total += n if isinstance(a, Forward) else 0
            peak = max(peak, live)
    return peak, total


def run_case(plain: Plan, offload: dict[int, list[str]], *, reference: bool = True, steps: int = STEPS) -> list:
    """``plain`` and the same plan offloading ``offload`` in the same processes; every check of the module
    docstring on every rank. Returns the offloading plan's results by rank."""
    plan = offloading(plain, offload)
    results = run_ranks(_worker, len(plan.device_ids()), [plain, plan], steps)
    ref = reference_run(plain.model, global_batch=plain.global_batch, steps=steps, seed=SEED, lr=LR)[0] if reference else []
    for rank, (base, off) in enumerate(results):
        losses = [s.loss for s in off["history"]]
        assert losses == [s.loss for s in base["history"]], f"rank {rank}: offloading changed the losses"
        for step, (got, want) in enumerate(zip(losses, ref)):
            assert abs(got - want) <= 1e-5 * abs(want), f"step {step} loss {got} != reference {want}"
        per_layer = offloaded_per_layer(plan, rank)
        peak, total = layers_in_flight(plan, rank)
        assert (per_layer > 0) == (rank in offload and bool(offload[rank]))
        for s, s0 in zip(off["history"], base["history"]):
            assert s.peak_host_activation_bytes == peak * per_layer, (rank, peak, per_layer)
            assert s.offload_out_bytes == s.offload_in_bytes == total * per_layer, rank
            assert s.offload_late_bytes == 0, f"rank {rank}: {s.offload_late_bytes} bytes copied back late"
            assert s0.peak_saved_bytes - s.peak_saved_bytes == s.peak_host_activation_bytes, rank
            assert s0.peak_host_activation_bytes == s0.offload_out_bytes == 0
            assert s.recomputed_ops == s0.recomputed_ops
        assert off["buffers"][-1] == off["buffers"][0] and (off["buffers"][0] > 0) == (per_layer > 0), off["buffers"]
    return [off for _, off in results]


def test_one_device_offloads_several_tensors_under_partial_recompute():
    """Four layers on one device recomputing the GELU, offloading its input and output, a LayerNorm's statistics,
    the attention probabilities and the layer input (the embedding's output at layer 0). Catches: a pass run outside
    ``OffloadStash.record`` (refused), copies never released (the next step's forward is refused), the meter
    counting offloaded tensors, a prefetch of the top layer that never runs (late bytes)."""
    plain = plan_of(tiny(0.1), [[1]], [4], 1, m=3, mbs=1, recompute={0: ["gelu"]})
    run_case(plain, {0: ["fc1_out", "gelu_out", "ln1_stats", "probs", "layer_input"]})


def test_pipeline_stages_offload_the_layer_input_under_full_recompute():
    """Cephalo's case on both stages of a 1F1B pipeline over three micro-batches: every operator recomputed and the
    layer input in host memory. Stage 0 holds two micro-batches in flight; stage 1's first layer takes the received
    activation (through ``_Boundary``, not as a leaf). Catches: micro-batches in flight mixed up, the receive-time
    prefetch of a stage's top layer keyed wrongly (late bytes), the boundary losing the input's gradient."""
    plain = plan_of(tiny(0.1), [[1], [1]], [2, 2], 1, m=3, mbs=1, recompute={0: ALL_OPS, 1: ALL_OPS})
    run_case(plain, {0: ["layer_input"], 1: ["layer_input"]})


def test_interleaved_chunks_offload_on_every_virtual_stage():
    """Two devices, four chunks of one layer, three micro-batches: each device offloads its layer input and the
    attention probabilities in both its chunks (a received input through ``_Boundary`` in three of the four). The
    host peak follows the interleaved schedule's in-flight count, not 1F1B's."""
    from tests.test_interleaved import _tiny_interleaved

    plain = _tiny_interleaved((1, 1, 1, 1), 3)
    run_case(plain, {0: ["layer_input", "probs"], 1: ["layer_input", "probs"]})


def test_uneven_tensor_parallel_ranks_offload_different_sets():
    """TP 3:1 on one stage: rank 0 (three units) offloads q, k, v and the probabilities, rank 1 (one unit, recomputing
    the MLP's first half) its layer input and the residual between the blocks. Host bytes follow each rank's share.
    Catches: one rank's set applied to the other, a split tensor counted at the full size."""
    plain = plan_of(tiny(0.1), [[3, 1]], [4], 4, m=2, mbs=2, recompute={1: ["fc1", "gelu"]})
    run_case(plain, {0: ["q", "k", "v", "probs"], 1: ["layer_input", "x_mid"]})


def test_data_parallel_replicas_at_zero_1_offload():
    """Two one-device replicas of different batches at ZeRO 1, each offloading its own set (one under
    recomputation)."""
    plain = replicas_plan(tiny(0.1), [dict(stages=[[1]], layers=[4], units=1, m=2, mbs=2,
                                           recompute={0: ["softmax", "attn_dropout"]}),
                                      dict(stages=[[1]], layers=[4], units=1, m=1, mbs=2)], zero_stage=1)
    run_case(plain, {0: ["scores", "q", "x_mid"], 1: ["ln2_out", "gelu_out"]})


def test_zero_3_layer_by_layer_offloads_and_the_report_shows_host_bytes():
    """ZeRO 3 runs every micro-batch layer by layer (one key per layer pass, all of them in flight at the end of the
    forward): replica 0 offloads its layer input (joined through ``_Boundary`` on both sides) and kept tensors under
    partial recomputation, replica 1 others. ``build_report`` puts each device's measured peak host bytes beside the
    evaluator's ``host_activation_bytes`` and its device-side saved bytes, which exclude the offloaded ones.
    Catches: the prefetch of the next layer pass missing (late bytes), a pass's input or the pass before's output
    kept on the device (saved bytes still drop, but see the next test), host bytes missing from the report."""
    from baton.evaluate import DeviceReport
    from runtime.measure.report import build_report, summary_rows
    from tests.test_zero_stages import _prediction

    plain = replicas_plan(tiny(0.1), [dict(stages=[[1]], layers=[4], units=1, m=2, mbs=2, recompute={0: ["fc1", "gelu"]}),
                                      dict(stages=[[1]], layers=[4], units=1, m=1, mbs=2)], zero_stage=3)
    offload = {0: ["layer_input", "ln2_stats", "gelu_out", "ctx"], 1: ["probs", "v"]}
    results = run_case(plain, offload)
    plan = offloading(plain, offload)
    cluster, profiles, _ = _prediction(plan)
    report = build_report(plan, cluster, profiles, {r: res["history"] for r, res in enumerate(results)})
    predicted = "host_activation_bytes" in getattr(DeviceReport, "__dataclass_fields__", {})
    for rank, d in enumerate(report["devices"]):
        want = layers_in_flight(plan, rank)[0] * offloaded_per_layer(plan, rank)
        assert d["measured"]["peak_host_activation_bytes"] == want > 0
        if predicted:  # the evaluator's figure, on the table it predicts with, and device activations without it
            assert d["predicted"]["host_activation_bytes"] == pytest.approx(want, rel=1e-3)
            assert d["measured"]["peak_saved_bytes"] == pytest.approx(d["predicted"]["activation_bytes"], rel=1e-3)
    rows = [r[0] for r in summary_rows(report)]
    assert all(f"{i} host activations MiB" in rows for i in plan.device_ids())


def test_offloaded_layer_inputs_leave_the_device_between_passes(one_rank_group, monkeypatch):
    """Layer by layer (ZeRO 2) each layer pass takes the pass before's output. With the layer input offloaded no
    layer's input storage is alive when the first backward starts; without, every one is (so the check can fail).

    Catches: a pass's input kept as a leaf (its gradient accumulator holds it), the pass before's output kept for
    its backward, a local of the interpreter holding the last one."""
    import runtime.train.engine as engine_module
    from runtime.data.source import TokenSource
    from runtime.parallel.tp_layer import ParallelBlock

    plain = replicas_plan(tiny(0.1), [dict(stages=[[1]], layers=[4], units=1, m=2, mbs=1)], zero_stage=2)

    def alive_at_first_backward(plan) -> tuple[int, int]:
        refs, alive = [], []
        forward, backward = ParallelBlock.forward, engine_module._timed_backward

        def watching(self, x, mb):
            if torch.is_grad_enabled():
                refs.append(weakref.ref(x.untyped_storage()))
            return forward(self, x, mb)

        def first(*args):
            if not alive:
                gc.collect()
                alive.append(sum(r() is not None for r in refs))
            return backward(*args)
        with monkeypatch.context() as m:
            m.setattr(ParallelBlock, "forward", watching)
            m.setattr(engine_module, "_timed_backward", first)
            engine = engine_module.Engine(plan, 0, seed=SEED, lr=LR)
            engine.train_step(0, TokenSource(plan.model, seed=SEED, global_batch=plan.global_batch))
        return alive[0], len(refs)

    assert alive_at_first_backward(offloading(plain, {0: ["layer_input"]})) == (0, 8)
    assert alive_at_first_backward(plain) == (8, 8)


def test_layer_by_layer_prefetches_the_next_layer_pass_before_running_one(one_rank_group, monkeypatch):
    """Layer by layer a key holds one layer, so a layer's backward cannot start the copies of the next pass (another
    key): the engine starts them before running the pass ahead of it. Catches: a pass's copies started only when it
    runs (on CUDA its backward would wait for them: late bytes there, not on CPU)."""
    import runtime.train.engine as engine_module
    from runtime.data.source import TokenSource
    from runtime.parallel.offload import OffloadStash

    plan = offloading(replicas_plan(tiny(0.1), [dict(stages=[[1]], layers=[4], units=1, m=2, mbs=1)], zero_stage=2),
                      {0: ["probs"]})
    events = []
    prefetch, backward = OffloadStash.prefetch, engine_module._timed_backward

    def logged_prefetch(self, key, layer):
        copy = self._groups.get(key, {}).get(layer)
        if copy is not None and copy.restored is None and copy.in_use():
            events.append(("prefetch", key))  # copies started now
        return prefetch(self, key, layer)

    def logged_backward(meter, clock, i, name, y, grad):
        events.append(("backward", name))
        return backward(meter, clock, i, name, y, grad)
    monkeypatch.setattr(OffloadStash, "prefetch", logged_prefetch)
    monkeypatch.setattr(engine_module, "_timed_backward", logged_backward)
    engine = engine_module.Engine(plan, 0, seed=SEED, lr=LR)
    engine.train_step(0, TokenSource(plan.model, seed=SEED, global_batch=plan.global_batch))
    layer_passes = [e for e in events if e[0] == "backward" and "layer" in e[1]]
    assert len(layer_passes) == 8
    for n, (_, name) in enumerate(layer_passes):
        micro, layer = int(name[1:].split()[0]), int(name.split()[-1])
        started = events.index(("prefetch", (0, layer, micro)))
        # Before the backward ahead of it (the head's of the last micro-batch, for the first layer pass).
        assert started < events.index(layer_passes[n - 1] if n else ("backward", "B1 head")), (name, events)


def test_bf16_offload_changes_no_number():
    """bf16 on one device with fused attention: q, k and v (views of one qkv storage, copied once) and the layer
    input offloaded; the host holds their bf16 bytes (2 per element). Parity of bf16 plans with the single-device
    bf16 run is tests/test_mixed_precision.py's; here the offloading plan equals the plain one bit for bit."""
    plain = plan_of(tiny(0.1, dtype="bf16", attention="fused"), [[1]], [4], 1, m=2, mbs=2)
    run_case(plain, {0: ["q", "k", "v", "layer_input"]}, reference=False)


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_an_offloading_step_reads_the_device_once(one_rank_group, monkeypatch, zero_stage):
    """The stash's copies and counters add no host read to a step (tests/test_step_sync.py's counting), 1F1B and
    layer by layer."""
    from tests.test_step_sync import HostReads, _assert_one_read, _engine

    counter = HostReads(monkeypatch)
    plain = replicas_plan(tiny(0.1), [dict(stages=[[1]], layers=[4], units=1, m=2, mbs=1, recompute={0: ["gelu"]})],
                          zero_stage=zero_stage)
    engine, data = _engine(offloading(plain, {0: ["layer_input", "fc1_out", "probs"]}))
    for step in range(2):
        stats, reads = counter.step(engine, step, data)
        _assert_one_read(reads)
    assert stats.peak_host_activation_bytes > 0 and stats.offload_late_bytes == 0
