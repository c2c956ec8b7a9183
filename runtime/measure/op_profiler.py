"""Measured operator tables: time and saved bytes of each operator of the runtime's own layer.

Each operator of ``runtime.parallel.tp_layer.ParallelBlock`` (the code ``baton train`` runs) is called on its
own, with inputs made by running the layer's earlier operators once, at every requested micro-batch
size and tensor-parallel share. Forward and backward are timed after warm-up over several
repetitions and the median is kept; on CUDA with events, on CPU with a monotonic clock. The operators' times
are then scaled to add up to the layer timed as a step runs it (``in_step``: every layer of a small stack
forward, then backward, each layer's passes between CUDA events), and the host's time to launch each pass
is timed beside the device's (eq. 2h). Saved bytes
are what autograd keeps for the operator's backward (storages counted once, parameters excluded).
Every measurement seeds its own inputs, so the table does not depend on the order of the runs.
The table also holds one timed step after the passes (gradient norm and AdamW update, row ``optimizer``),
which eq. 10 scales by the weights held.

With ``compile`` (``baton profile --device ... --compile``) the layers timed in a step are compiled as
``baton train --compile`` compiles them (``ParallelBlock.compile_operators``), their compilation in an untimed
warm-up; the operators alone stay eager, so their shares of the layer and their saved bytes are the uncompiled
operators' (a compiled graph keeps at most what its operators keep).
"""
from __future__ import annotations

import math
import os
import statistics
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Callable

import pandas as pd
import torch

from baton.errors import BatonError
from baton.model_spec import ModelSpec
from baton.operators import ALLREDUCE_OUTPUTS, EMBEDDING, HEAD, LAYER_INPUT, layer_operators, operator_param_bytes
from baton.costmodel import segments_per_block
from baton.memory import held_tensors, recompute_space
from baton.profile import COLUMNS, HOST_COLUMNS, OPTIMIZER, validate_table
from runtime.launch.affinity import pin_rank
from runtime.launch.host_memory import keep_freed_memory
from runtime.measure.meters import Meter, SavedBytes
from runtime.train.precision import MasterWeights, compute_dtype
from runtime.train.optim_settings import grad_square_sum
from runtime.launch.processes import die_with_parent, stop_processes
from runtime.parallel.stage import StageModel
from runtime.parallel.llama_layer import parallel_block
from runtime.parallel.offload import OffloadStash
from runtime.parallel.tp_layer import MicroBatch, ParallelBlock, forget_compiled_graphs



@dataclass(frozen=True, kw_only=True, slots=True)
class Measurement:
    """One operator at one (micro-batch, share)."""

    fwd_ms: float
    """Median forward time."""
    bwd_ms: float
    """Median backward time."""
    saved_bytes: int
    """Bytes autograd keeps for this operator's backward."""
    output_bytes: int
    """Bytes of the operator's outputs."""
    fwd_host_ms: float = 0.0
    """Median host time of the forward call, not waiting for the device (on a CPU the forward time itself)."""
    bwd_host_ms: float = 0.0
    """The same for the backward."""
    seg_host_ms: float = 0.0
    """Host cost of a recomputed segment ending at this operator, beyond its operators' launches (eq. 2h)."""
    off_fwd_host_ms: float = 0.0
    """Host cost per offloaded tensor of a layer in its forward (eq. 2o), the same on every operator's row."""
    off_bwd_host_ms: float = 0.0
    """The same in its backward."""


class _Timer:
    """Wall time on CPU, CUDA events on GPUs (they time the device, not the launch)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn: Callable[[], object]) -> float:
        return self.both(fn)[0]

    def both(self, fn: Callable[[], object]) -> tuple[float, float]:
        """(device ms, host ms) of ``fn`` from an idle device. The host's is the wall time of the call, which
        returns once its kernels are launched; on a CPU, whose operators run in the call, the two are one reading."""
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            start.record()
            fn()
            end.record()
            host = (time.perf_counter() - t0) * 1e3
            torch.cuda.synchronize()
            return start.elapsed_time(end), host
        t0 = time.perf_counter()
        fn()
        t = (time.perf_counter() - t0) * 1e3
        return t, t

    def behind(self, fn: Callable[[], object], backlog: Callable[[], object]) -> float:
        """Device ms of ``fn`` launched while the device still works through ``backlog()``'s kernels, as a step's
        optimizer follows the passes it queued: the host's launches overlap the queue, so only the device's time
        is counted. From an idle device a launch-bound call reads as its launches: the AdamW step of gpt3-350m read
        19.6 ms there, where training measured 8.7 ms on the same H200 (bench/results/gpu-2026-11-27.md). On a CPU,
        whose operators run in the call, the wall time."""
        if not self.cuda:
            backlog()
            return self(fn)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        backlog()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)


def _saved_bytes(fn: Callable[[], object], params: list[torch.Tensor]) -> tuple[int, object]:
    """Run ``fn`` under a saved-tensors hook; sum the storages autograd keeps (not parameters)."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    kept: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in param_ptrs:
            kept[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(kept.values()), out


def _as_tuple(x) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def backward_call_overhead_ms(device: torch.device, *, warmup: int = 3, reps: int = 25, back_to_back: bool = False) -> float:
    """Time of ``autograd.backward`` on a one-element graph: the fixed cost of starting a backward pass.

    Timing one operator's backward alone pays it once per operator; inside a layer the whole stage's
    backward is one call, so the profiler subtracts it from every operator's backward time. With
    ``back_to_back`` it is timed as ``measure`` then times backwards: ``reps`` calls in one timed piece.
    """
    timer = _Timer(device)
    x = torch.ones(1, device=device, requires_grad=True)
    times = []
    for i in range(warmup + (0 if back_to_back else reps)):
        y = x * 2.0
        t = timer(lambda: y.backward())
        if i >= warmup:
            times.append(t)
    if not back_to_back:
        return statistics.median(times)
    graphs = [x * 2.0 for _ in range(reps)]

    def backwards():
        for y in graphs:
            y.backward()

    return timer(backwards) / reps


BACK_TO_BACK_CPU_BYTES = 1 << 30
"""Most bytes of graphs (saved activations, outputs, their gradients) a back-to-back CPU measurement keeps at once."""


def reps_at_once(device: torch.device, per_rep_bytes: int, reps: int) -> int:
    """Repetitions a back-to-back measurement runs in one timed piece: all ``reps``, unless their graphs
    would take more than a quarter of the GPU's free memory, counting what PyTorch holds cached for reuse
    (``BACK_TO_BACK_CPU_BYTES`` on a CPU)."""
    if device.type == "cuda":
        budget = (torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)) // 4
    else:
        budget = BACK_TO_BACK_CPU_BYTES
    return max(1, min(reps, budget // max(per_rep_bytes, 1)))


def measure(fn: Callable[[list[torch.Tensor]], tuple], make_inputs: Callable[[], list[torch.Tensor]], params: list[torch.Tensor],
            device: torch.device, *, warmup: int, reps: int, backward_overhead_ms: float = 0.0,
            as_trained: bool = False, back_to_back: bool = False) -> Measurement:
    """Time forward and backward of ``fn(inputs)``; inputs are rebuilt for every repetition.

    With ``as_trained`` the passes run as a training step runs them (``runtime.train.engine``): the forward
    under the saved-activation meter (``runtime.measure.meters.SavedBytes``: a Python hook per kept tensor the
    first time a key runs, its bytes held without hooks after, as the engine's steps after the first) and the
    backward adding into gradients that already exist (the engine's gradient buffer, as every micro-batch but a
    step's first), where otherwise every backward writes fresh gradients and no hook runs.

    Each repetition is timed alone by default: the device is idle when it starts and synchronised when
    it ends. With ``back_to_back`` the repetitions after warm-up run in timed pieces of several
    (``reps_at_once``): forwards one after another, then the backwards of as many graphs, with no
    synchronisation between them. On a GPU the host then launches one repetition's kernels while the
    previous one's run, as a training step launches its next layer; a repetition's time is its piece's
    over its count, the median over pieces (at least three when ``reps`` allows). The backward-call cost
    subtracted is then the back-to-back one: exact while the host is the bottleneck, and up to that cost
    too much while the kernels are, since there a call's start hides behind the previous kernels.
    """
    timer = _Timer(device)
    saved, outs = _saved_bytes(lambda: _as_tuple(fn(make_inputs())), params)
    storages = {o.untyped_storage().data_ptr(): o.untyped_storage().nbytes() for o in outs if isinstance(o, torch.Tensor)}
    output_bytes = sum(storages.values())
    meter = SavedBytes(params) if as_trained else None
    if meter is not None:  # hooks on a key's first pass only, as the engine measures a pass once and holds its bytes
        meter.known = meter.measured

    def forward(inputs, key=0):
        if meter is None:
            return fn(inputs)
        with meter.record(key):
            return fn(inputs)

    def graph(inputs, key=0):
        outs = [o for o in _as_tuple(forward(inputs, key)) if isinstance(o, torch.Tensor) and o.requires_grad]
        return outs, [torch.ones_like(o) for o in outs]

    def fresh_gradients():
        if not as_trained:
            for p in params:
                p.grad = None

    for p in params:
        p.grad = torch.zeros_like(p) if as_trained else None
    fwd, bwd, fwd_host, bwd_host = [], [], [], []
    for i in range(warmup + (0 if back_to_back else reps)):
        inputs = make_inputs()
        t_f, h_f = timer.both(lambda: forward(inputs))
        outs, grads = graph(inputs)
        fresh_gradients()
        t_b, h_b = timer.both(lambda: torch.autograd.backward(outs, grads)) if outs else (0.0, 0.0)
        if meter is not None:
            meter.release(0)
        if i >= warmup:
            fwd.append(t_f)
            bwd.append(t_b)
            fwd_host.append(h_f)
            bwd_host.append(h_b)
    if back_to_back:
        # At least three pieces where there are repetitions enough, so one stall cannot make the figure.
        at_once = min(reps_at_once(device, saved + 3 * output_bytes, reps), max(1, -(-reps // 3)))
        for start in range(0, reps, at_once):
            keys = range(min(at_once, reps - start))
            batch = [make_inputs() for _ in keys]

            def forwards():  # each output dropped at once, as a layer's is once the next layer has read it
                for k, x in zip(keys, batch):
                    forward(x, k)

            t_f, h_f = timer.both(forwards)
            fwd.append(t_f / len(keys))
            fwd_host.append(h_f / len(keys))
            graphs = [graph(x, k) for k, x in zip(keys, batch)]

            def backwards():
                for outs, grads in graphs:
                    fresh_gradients()
                    torch.autograd.backward(outs, grads)

            t_b, h_b = timer.both(backwards) if graphs[0][0] else (0.0, 0.0)
            bwd.append(t_b / len(keys))
            bwd_host.append(h_b / len(keys))
            del graphs
            if meter is not None:
                for k in keys:
                    meter.release(k)
    for p in params:
        p.grad = None
    bwd_ms = max(statistics.median(bwd) - backward_overhead_ms, 0.0) if any(bwd) else 0.0
    bwd_host_ms = max(statistics.median(bwd_host) - backward_overhead_ms, 0.0) if any(bwd) else 0.0
    return Measurement(fwd_ms=statistics.median(fwd), bwd_ms=bwd_ms, saved_bytes=saved, output_bytes=output_bytes,
                       fwd_host_ms=statistics.median(fwd_host), bwd_host_ms=bwd_host_ms)


def local_sizes(spec: ModelSpec, share: float) -> tuple[int, int]:
    """(heads, FFN columns) a device with ``share`` holds; the share must cut whole heads (under grouped-query
    attention whole KV heads, each with its query heads)."""
    kv = share * spec.kv_heads
    if abs(kv - round(kv)) > 1e-9 or round(kv) < 1:
        what = "KV heads" if spec.kv_heads != spec.num_heads else "heads"
        raise BatonError(f"share {share:g} of {spec.kv_heads} {what} is not a whole number of {what}", field="--tp-shares")
    heads = share * spec.num_heads
    return int(round(heads)), int(round(share * spec.ffn_dim))


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@torch.no_grad()
def _init(module: torch.nn.Module, seed: int) -> None:
    g = _seeded(seed)
    for name, p in module.named_parameters():
        if name.endswith("bias"):
            p.zero_()
        elif p.dim() == 1:
            p.fill_(1.0)
        else:
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)


def profile_layer(spec: ModelSpec, device: torch.device, micro_batch: int, share: float, *, warmup: int, reps: int,
                  seed: int = 0, backward_overhead_ms: float = 0.0,
                  back_to_back_overhead_ms: float | None = None, in_step: bool = False,
                  segment: bool = False, compile: bool = False) -> dict[str, Measurement]:
    """Measure every operator of one layer at one (micro-batch, share), then scale the operators to the whole
    layer: with ``in_step`` timed as a step runs it (``in_step``), device and host apart; otherwise from an idle
    device (``measure``), back to back in pieces given ``back_to_back_overhead_ms``, its backward less that.
    Each operator alone gives its share. With ``in_step`` and ``segment``, every operator's ``seg_host_ms`` is
    the host cost of one recomputed segment (``segment_host_ms``), the same wherever a segment ends, and its
    ``off_fwd_host_ms``/``off_bwd_host_ms`` the host cost per offloaded tensor (``offload_host_ms``). With ``compile``
    (``in_step`` only) the layers timed in a step run compiled."""
    if compile and not in_step:
        raise ValueError("compiled layers are timed in a step only (in_step=True)")
    dtype = compute_dtype(spec.dtype)
    nh, nf = local_sizes(spec, share)
    if compile:
        forget_compiled_graphs()

    def make_block(layer: int, recompute=frozenset(), compiled: bool = False, offload=frozenset(), stash=None) -> ParallelBlock:
        blk = parallel_block(spec, layer, heads=range(nh), ffn_cols=range(nf), recompute=recompute, offload=offload,
                             stash=stash)
        _init(blk, seed + layer)
        blk = blk.to(device=device, dtype=dtype)
        blk.train()
        if compiled:
            blk.compile_operators()
        return blk

    block = make_block(0)
    params = list(block.parameters())
    mb = MicroBatch(seed=seed, step=0, samples=torch.arange(micro_batch).to(device))  # on the device, as the engine's
    g = _seeded(seed + 1)
    env = {LAYER_INPUT: torch.randn(micro_batch, spec.seq_len, spec.hidden_dim, generator=g).to(device=device, dtype=dtype)}
    results = {}
    for op in layer_operators(spec):
        fn_op = getattr(block, "_" + op.name)
        with torch.no_grad():
            outs = fn_op(mb, *(env[n] for n in op.inputs))
        values = {n: env[n] for n in op.inputs}

        def make_inputs(values=values):
            return [v.detach().requires_grad_(v.is_floating_point()) for v in values.values()]

        results[op.name] = measure(lambda xs, f=fn_op: f(mb, *xs), make_inputs, params, device, warmup=warmup, reps=reps,
                                   backward_overhead_ms=backward_overhead_ms)
        env.update(zip(op.outputs, outs))
        for partial_name, full_name in ALLREDUCE_OUTPUTS.items():
            if partial_name in env:
                env[full_name] = env[partial_name]  # one device: the all-reduce is the identity
    if not in_step:
        return _in_context(results, block, mb, env[LAYER_INPUT], device, warmup=warmup, reps=reps,
                           **_whole_timing(backward_overhead_ms, back_to_back_overhead_ms))
    whole = time_in_step(lambda i: make_block(i, compiled=compile), mb, env[LAYER_INPUT], device, warmup=warmup, reps=reps)
    scaled = _scaled(results, whole)
    if segment:
        everything = frozenset(o.name for o in layer_operators(spec))
        rec = time_in_step(lambda i: make_block(i, everything, compile), mb, env[LAYER_INPUT], device, warmup=warmup, reps=reps)
        ms = segment_host_ms(spec, whole, rec)
        off_f = off_b = 0.0  # compiled layers cannot offload (check_compile): no plan reads the cost then
        if not compile:
            held, stash = held_tensors(spec, frozenset()), OffloadStash()
            off = time_in_step(lambda i: make_block(i, offload=frozenset(held), stash=stash), mb, env[LAYER_INPUT], device,
                               warmup=warmup, reps=reps)
            off_f, off_b = offload_host_ms(held, whole, off)
        scaled = {name: replace(m, seg_host_ms=ms, off_fwd_host_ms=off_f, off_bwd_host_ms=off_b) for name, m in scaled.items()}
    return scaled


STACK_LAYERS = 4
"""Layers of the stack ``time_in_step`` runs. Its first layer's forward starts from an idle device and its last
layer's backward starts the backward pass, which a stage of many layers pays once; each pass's figure is the
median over the other layers, each of which follows another layer's pass as in a step."""


def time_in_step(make_block: Callable[..., ParallelBlock], mb: MicroBatch, x: torch.Tensor, device: torch.device, *,
                 warmup: int, reps: int) -> Measurement:
    """One layer's passes timed as a training iteration runs them: ``STACK_LAYERS`` layers (``make_block(i)``)
    forward one after another, then one backward through them all, adding into gradients that exist, with
    the saved-activation meter on (``runtime.train.engine``), and no synchronisation inside the iteration.
    Each layer's forward and backward lies between two marks: a host clock reading and, on a GPU, a CUDA
    event recorded there (in the backward, in a hook on the gradient of each layer's input, which autograd
    calls once that layer's backward is done).

    Device time is the events' difference: how long the layer holds the device's stream in a step, its
    kernels back to back where the host has run ahead, with the waits for launches where it has not. Host
    time is the clock's difference: the Python calls, which return once their kernels are queued (plus
    whatever the layer's own code waits for, as a step waits for it too). On a CPU the operators run inside
    the calls, so both are the clock's one reading. The result has each pass's median over repetitions and
    layers, and no bytes (the operators' own give them).
    """
    cuda = device.type == "cuda"
    blocks = [make_block(i) for i in range(STACK_LAYERS)]
    stash = blocks[0].stash if blocks[0].offload else None  # offloading blocks share one, as a stage's do
    if any(blk.compiled for blk in blocks):
        warmup = max(warmup, 1)  # the first iteration compiles the graphs: never a timed one
    params = [p for blk in blocks for p in blk.parameters()]
    saved = SavedBytes(params)
    saved.known = saved.measured  # hooks in the first iteration only (a warm-up one), as the engine's steps after its first
    for blk in blocks:
        blk.meter = Meter(saved=saved)
    for p in params:
        p.grad = torch.zeros_like(p)  # the engine's gradient buffer: backward adds into it
    fwd, bwd, fwd_host, bwd_host = [], [], [], []

    def mark(events: list, clocks: list) -> None:
        if cuda:
            events[len(clocks)].record()
        clocks.append(time.perf_counter())

    for i in range(warmup + reps):
        f_ev = [torch.cuda.Event(enable_timing=True) for _ in range(STACK_LAYERS + 1)] if cuda else []
        b_ev = [torch.cuda.Event(enable_timing=True) for _ in range(STACK_LAYERS + 1)] if cuda else []
        f_clock: list[float] = []
        b_clock: list[float] = []
        xs = [x.detach().requires_grad_()]
        if cuda:
            torch.cuda.synchronize()
        with saved.record(0), stash.record(0) if stash is not None else nullcontext():
            mark(f_ev, f_clock)
            for blk in blocks:
                xs.append(blk(xs[-1], mb))
                mark(f_ev, f_clock)
        # Gradients of the layers' inputs, last layer first: b_clock[k + 1] closes layer STACK_LAYERS - 1 - k.
        for k in reversed(range(STACK_LAYERS)):
            xs[k].register_hook(lambda g: mark(b_ev, b_clock))
        grad = torch.ones_like(xs[-1])
        mark(b_ev, b_clock)
        torch.autograd.backward(xs[-1], grad)
        saved.release(0)
        if stash is not None:
            stash.release(0)
        if cuda:
            torch.cuda.synchronize()
        # Not the first layer's forward (from an idle device) nor the last layer's backward (starting the pass).
        f_host = [(b - a) * 1e3 for a, b in zip(f_clock, f_clock[1:])][1:]
        b_host = [(b - a) * 1e3 for a, b in zip(b_clock, b_clock[1:])][1:]
        f_dev = [a.elapsed_time(b) for a, b in zip(f_ev, f_ev[1:])][1:] if cuda else f_host
        b_dev = [a.elapsed_time(b) for a, b in zip(b_ev, b_ev[1:])][1:] if cuda else b_host
        if i >= warmup:
            fwd += f_dev
            bwd += b_dev
            fwd_host += f_host
            bwd_host += b_host
    for p in params:
        p.grad = None
    return Measurement(fwd_ms=statistics.median(fwd), bwd_ms=statistics.median(bwd), saved_bytes=0, output_bytes=0,
                       fwd_host_ms=statistics.median(fwd_host), bwd_host_ms=statistics.median(bwd_host))


def segment_host_ms(spec: ModelSpec, plain: Measurement, recomputed: Measurement) -> float:
    """Host cost of one recomputed segment beyond its operators' launches, from a layer timed in a step with
    nothing and with every operator recomputed (``time_in_step``). Eq. 2h charges the second layer
    fwd_host + bwd_host + fwd_host (the replay) + segments x this, all of the segments' cost in the backward,
    so this is what makes eq. 2h give the measured host time of the whole layer; 0 where noise makes it less."""
    everything = frozenset(o.name for o in layer_operators(spec))
    attn, mlp = segments_per_block(spec, recompute_space(spec, (everything,)))
    segments = float(attn[0] + mlp[0])
    extra = (recomputed.fwd_host_ms + recomputed.bwd_host_ms) - (2 * plain.fwd_host_ms + plain.bwd_host_ms)
    return max(extra / segments, 0.0)


def offload_host_ms(offloaded: tuple[str, ...], plain: Measurement, offloading: Measurement) -> tuple[float, float]:
    """Host cost per offloaded tensor in a layer's forward and in its backward, from a layer timed in a step with
    nothing offloaded and with every tensor it holds offloaded (``offloaded``; ``time_in_step``): eq. 2o charges
    a block's host time this for each tensor it offloads. Per tensor name, as eq. 2o counts them (fused attention's
    q, k and v are one storage and three names); 0 where noise makes it less."""
    n = max(len(offloaded), 1)
    return (max((offloading.fwd_host_ms - plain.fwd_host_ms) / n, 0.0),
            max((offloading.bwd_host_ms - plain.bwd_host_ms) / n, 0.0))


def _scaled(results: dict[str, Measurement], whole: Measurement) -> dict[str, Measurement]:
    """Operators scaled to add up to ``whole``, device and host times each to their own total."""
    def factor(total: float, parts: float) -> float:
        return total / parts if parts > 0 else 1.0

    kf = factor(whole.fwd_ms, sum(m.fwd_ms for m in results.values()))
    kb = factor(whole.bwd_ms, sum(m.bwd_ms for m in results.values()))
    kfh = factor(whole.fwd_host_ms, sum(m.fwd_host_ms for m in results.values()))
    kbh = factor(whole.bwd_host_ms, sum(m.bwd_host_ms for m in results.values()))
    return {name: Measurement(fwd_ms=m.fwd_ms * kf, bwd_ms=m.bwd_ms * kb, saved_bytes=m.saved_bytes, output_bytes=m.output_bytes,
                              fwd_host_ms=m.fwd_host_ms * kfh, bwd_host_ms=m.bwd_host_ms * kbh)
            for name, m in results.items()}


def _whole_timing(backward_overhead_ms: float, back_to_back_overhead_ms: float | None) -> dict:
    """``measure``'s timing arguments for a whole layer, embedding or head: back to back, less the back-to-back
    backward-call cost, when that cost is given; else one repetition at a time."""
    if back_to_back_overhead_ms is None:
        return {"backward_overhead_ms": backward_overhead_ms, "back_to_back": False}
    return {"backward_overhead_ms": back_to_back_overhead_ms, "back_to_back": True}


def _in_context(results: dict[str, Measurement], block: ParallelBlock, mb: MicroBatch, x: torch.Tensor, device, *,
                warmup: int, reps: int, backward_overhead_ms: float, back_to_back: bool = False) -> dict[str, Measurement]:
    """Rescale isolated operator times so they add up to the whole layer timed as the runtime runs it.

    Timed alone, an operator finds its weights and inputs hot in cache and pays for its own call into
    autograd; inside a layer neither holds. The layer's forward and backward are timed as one piece,
    as a training step runs them (``measure(as_trained=True)``: the saved-activation meter on, the
    gradients accumulated), and each operator keeps its share of the isolated sum, so the relative
    costs that recomputation choices depend on are the isolated ones and the totals are the real ones.
    """
    whole = measure(lambda xs: block(xs[0], mb), lambda: [x.detach().requires_grad_()], list(block.parameters()), device,
                    warmup=warmup, reps=reps, backward_overhead_ms=backward_overhead_ms, as_trained=True, back_to_back=back_to_back)
    fwd_sum = sum(m.fwd_ms for m in results.values())
    bwd_sum = sum(m.bwd_ms for m in results.values())
    kf = whole.fwd_ms / fwd_sum if fwd_sum > 0 else 1.0
    kb = whole.bwd_ms / bwd_sum if bwd_sum > 0 else 1.0
    return {name: Measurement(fwd_ms=m.fwd_ms * kf, bwd_ms=m.bwd_ms * kb, saved_bytes=m.saved_bytes, output_bytes=m.output_bytes)
            for name, m in results.items()}


def profile_edges(spec: ModelSpec, device: torch.device, micro_batch: int, share: float = 1.0, *, warmup: int, reps: int,
                  seed: int = 0, backward_overhead_ms: float = 0.0,
                  back_to_back_overhead_ms: float | None = None) -> dict[str, tuple[Measurement, int]]:
    """The embedding of the first stage and the head (final LayerNorm, tied LM head, loss) of the last, at a
    rank's ``share`` of the (vocabulary-parallel) rows, each with the parameter bytes it holds (the head's
    without the tied embedding, which the cost model charges apart); timed back to back when
    ``back_to_back_overhead_ms`` is given (``profile_layer``)."""
    timing = _whole_timing(backward_overhead_ms, back_to_back_overhead_ms)
    dtype = compute_dtype(spec.dtype)
    g = _seeded(seed + 2)
    tokens = torch.randint(spec.vocab_size, (micro_batch, spec.seq_len), generator=g).to(device)
    nh, nf = local_sizes(spec, share)
    first = StageModel(spec, layers=range(0), heads=range(nh), ffn_cols=range(nf), first=True, last=False)
    last = StageModel(spec, layers=range(0), heads=range(nh), ffn_cols=range(nf), first=False, last=True)
    for m in (first, last):
        _init(m, seed)
        m.to(device=device, dtype=dtype).train()
    mb = MicroBatch(seed=seed, step=0, samples=torch.arange(micro_batch))
    x = torch.randn(micro_batch, spec.seq_len, spec.hidden_dim, generator=g).to(device=device, dtype=dtype)
    e = spec.dtype_bytes
    head_params = sum(p.numel() for n, p in last.named_parameters() if not n.startswith("wte.")) * e
    return {
        EMBEDDING: (measure(lambda xs: first(tokens, mb), lambda: [], list(first.parameters()), device, warmup=warmup, reps=reps,
                            as_trained=True, **timing),
                    sum(p.numel() for p in first.parameters()) * e),
        HEAD: (measure(lambda xs: last(xs[0], mb, targets=tokens), lambda: [x.detach().requires_grad_()], list(last.parameters()),
                       device, warmup=warmup, reps=reps, as_trained=True, **timing), head_params),
    }


OPTIMIZER_MAX_BYTES = 1 << 30
"""Cap on the weights the timed optimizer step updates."""
EVICT_BYTES = {"cpu": 128 << 20, "cuda": 512 << 20}
"""Bytes written before each timed optimizer step (and sync pass, ``runtime.measure.comm_profiler``): several times
the largest last-level cache of the kind (CPU L3, GPU L2), so every repetition starts from memory as it
does in training. Back to back, the step found part of its state in cache and ran 6-22% faster than
the same step after a training step's passes (small preset, this CPU)."""


def cache_evictor(device: torch.device) -> Callable[[], None]:
    """A call that writes ``EVICT_BYTES`` of the device's memory: before a timed repetition it leaves the caches
    as a training step's passes leave them, holding nothing of what the timed code reads."""
    buf = torch.empty(EVICT_BYTES[device.type] // 4, dtype=torch.float32, device=device)
    return lambda: buf.add_(1.0)


def profile_optimizer(spec: ModelSpec, device: torch.device, *, warmup: int, reps: int, seed: int = 0) -> tuple[int, float]:
    """(parameter bytes, median ms) of the step ``baton train`` takes after the passes, over the weights of
    every layer of the model (up to ``OPTIMIZER_MAX_BYTES``): the sum of squares of the gradients for the
    global norm (``runtime.train.optim_settings.grad_square_sum``), then the AdamW update.

    The step streams every weight, gradient and moment once, so its time scales with the bytes held
    (eq. 10); timing it over many layers' tensors, not one layer's, keeps the state out of cache and
    counts the per-tensor cost of the unfused CPU implementation as a stage pays them. The step is the
    runtime's own (``runtime.train.precision.MasterWeights``): in fp32 AdamW over the weights; in fp16/bf16
    the gradients in the model's dtype unscaled into fp32 a chunk at a time, AdamW over the fp32 master
    weights, and the weights rounded back from them. The bytes returned are counted in the model's
    dtype, as eq. 10's W_d is. On a GPU the step is launched behind a queue of device work (``_Timer.behind``),
    as it follows the passes in training, so the time is the device's, not the host's launches.
    """
    from runtime.train.engine import ADAM_BETAS, ADAM_EPS

    block = parallel_block(spec, 0, heads=range(spec.num_heads), ffn_cols=range(spec.ffn_dim))
    _init(block, seed)
    shapes = [p.shape for p in block.parameters()]
    layer_bytes = sum(p.numel() for p in block.parameters()) * spec.dtype_bytes
    copies = max(1, min(spec.num_layers, OPTIMIZER_MAX_BYTES // max(layer_bytes, 1)))
    g = _seeded(seed + 3)
    weights = torch.nn.ParameterList()
    for _ in range(copies):
        for shape in shapes:
            weights.append(torch.nn.Parameter((torch.randn(shape, generator=g) * 0.02).to(device=device)))
    step = MasterWeights(weights.to(device), spec.dtype, lr=3e-4, betas=ADAM_BETAS, eps=ADAM_EPS, weight_decay=0.0)
    for p in step.params:
        p.grad = (torch.randn(p.shape, generator=g) * 1e-3).to(device=device, dtype=compute_dtype(spec.dtype))
    timer = _Timer(device)
    evict = cache_evictor(device)
    grads = [p.grad for p in step.params]

    def norm_and_step():  # as ``runtime.train.engine`` runs them: the rank's part of the global norm, then the update
        grad_square_sum(grads)
        step.step()

    count = 1
    if device.type == "cuda":  # enough evictions queued to outlast the step's launches (``_Timer.behind``)
        norm_and_step()
        host_ms = max(timer.both(norm_and_step)[1], timer.both(norm_and_step)[1])
        count += math.ceil(2.0 * host_ms / max(timer(evict), 1e-3))

    def backlog():  # a step follows a whole forward and backward: nothing of its state is in cache then
        for _ in range(count):
            evict()

    times = [timer.behind(norm_and_step, backlog) for _ in range(warmup + reps)]
    return sum(p.numel() for p in step.params) * spec.dtype_bytes, statistics.median(times[warmup:])


def profile_table(spec: ModelSpec, *, device: str = "cpu", micro_batches=(1, 2), shares=(1.0,), warmup: int = 2, reps: int = 5,
                  gpu_name: str | None = None, progress=None, concurrent: int = 1, timeout_s: float | None = None,
                  back_to_back: bool = False, in_step: bool = True, compile: bool = False) -> pd.DataFrame:
    """The measured table (schema of ``baton.profile``) for the local device.

    With ``in_step`` (the default) each layer is timed as a training iteration runs it (``time_in_step``) and
    the table has the host columns (``baton.profile.HOST_COLUMNS``: each operator's, embedding's and head's
    launch time, and a recomputed segment's host cost), which eq. 2h compares with the device times. Timed
    instead from an idle device, a layer whose kernels are shorter than their launches counts the launches
    as device time, which a step hides behind the previous layer's kernels (19% off on average, 48% at
    worst, against steps on an H200, bench/results/gpu-2026-11-26.md); without ``in_step`` the table is
    the one made before host times were, with no host columns.

    With ``back_to_back`` each embedding and head (and without ``in_step`` each layer) is timed in pieces of
    several repetitions run one after another (``measure``), not one repetition from an idle device: on a
    GPU whose kernels are short, the host's launches then overlap the kernels as they do in a training step.

    With ``concurrent`` > 1, that many profilers run at once, one per core (``BATON_PIN_CPUS=1``) or one
    per GPU (``cuda``: devices 0..n-1), in step with each other, and each time in the table is the
    median over them. Training keeps every device of a machine busy at once and devices that share
    caches, memory bandwidth or a host run slower then: one layer on this 2-core machine took a
    median 14% longer while the other core ran the same layer than while it was idle.

    With ``compile`` (needs ``in_step``) the layers timed in a step run compiled, as ``baton train --compile`` runs them.
    """
    if compile and not in_step:
        raise BatonError("compiled layers are timed as a step runs them; not without in-step timing", field="--compile")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise BatonError("CUDA is not available on this machine", field="--device")
    if dev.type == "cuda" and dev.index is None:  # plain "cuda" is the current device; set_device needs its number
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev.type == "cpu" and spec.dtype == "fp16":
        raise BatonError(f"model '{spec.name}' is fp16, which CPUs do not train in; give a model with dtype fp32 or bf16", field="--model")
    for s in shares:
        local_sizes(spec, s)
    if concurrent < 1:
        raise BatonError("needs at least 1 profiler", field="--concurrent")
    if concurrent > 1 and dev.type == "cuda" and torch.cuda.device_count() < concurrent:
        raise BatonError(f"{concurrent} concurrent profilers need {concurrent} GPUs, this machine has {torch.cuda.device_count()}",
                         field="--concurrent")
    name = gpu_name or ("cpu" if dev.type == "cpu" else torch.cuda.get_device_name(dev).lower().replace(" ", "-"))
    if dev.type == "cuda":
        torch.cuda.set_device(dev)  # events and synchronisation below go to the measured device
        kinds = {torch.cuda.get_device_name(i) for i in range(concurrent)} if concurrent > 1 else set()
        if len(kinds) > 1:
            raise BatonError(f"GPUs 0..{concurrent - 1} are of different types ({', '.join(sorted(kinds))}): one table is one "
                             "type; profile each type on its own", field="--concurrent")
    if concurrent == 1:
        return _table(spec, dev, name, micro_batches, shares, warmup, reps, progress, lambda: None, back_to_back, in_step,
                      compile)
    return _concurrent_table(spec, dev, name, micro_batches, shares, warmup, reps, progress, concurrent, timeout_s, back_to_back,
                             in_step, compile)


def _table(spec, dev, name, micro_batches, shares, warmup, reps, progress, sync, back_to_back=False, in_step=True,
           compile=False) -> pd.DataFrame:
    if dev.type == "cpu":
        keep_freed_memory()  # host memory in the state training runs in (runtime.train.engine, runtime.launch.host_memory)
    ops = {o.name: o for o in layer_operators(spec)}
    # One table serves a model whichever attention it uses (as derived tables do): the other
    # implementation's attention operators are measured in a layer of their own, in context there.
    other = replace(spec, attention="fused" if spec.attention == "eager" else "eager")
    other_ops = {o.name: o for o in layer_operators(other) if o.name not in ops}
    sync()
    overhead = backward_call_overhead_ms(dev)
    timing = {"backward_overhead_ms": overhead,
              "back_to_back_overhead_ms": backward_call_overhead_ms(dev, back_to_back=True) if back_to_back else None}
    opt_bytes, opt_ms = profile_optimizer(spec, dev, warmup=warmup, reps=reps)
    rows = []
    segment_ms: dict[int, tuple[float, float, float]] = {}
    total = len(micro_batches) * (len(shares) + 1)
    done = 0
    for b in sorted(micro_batches):
        for share in sorted(shares):
            sync()
            measured = profile_layer(spec, dev, b, share, warmup=warmup, reps=reps, in_step=in_step,
                                     segment=in_step and share == max(shares), compile=compile, **timing)
            if in_step and share == max(shares):
                m0 = next(iter(measured.values()))
                segment_ms[b] = (m0.seg_host_ms, m0.off_fwd_host_ms, m0.off_bwd_host_ms)
            if other_ops:
                layer = profile_layer(other, dev, b, share, warmup=warmup, reps=reps, in_step=in_step, compile=compile, **timing)
                measured.update({n: layer[n] for n in other_ops})
            for op_name, m in measured.items():
                op = ops.get(op_name) or other_ops[op_name]
                if not op.tp_split and share != max(shares):
                    continue  # replicated operators are the same at every share: one row at share 1
                row_share = share if op.tp_split else 1.0
                params = operator_param_bytes(spec, op, share)
                rows.append((name, spec.name, op_name, b, spec.seq_len, row_share, m.fwd_ms, m.bwd_ms, m.saved_bytes, m.output_bytes, params,
                             "measured", m.fwd_host_ms, m.bwd_host_ms, 0.0, 0.0, 0.0))
            done += 1
            if progress:
                progress(done, total)
        sync()
        for share in sorted(shares):  # the vocabulary is split like the units
            for op_name, (m, params) in profile_edges(spec, dev, b, share, warmup=warmup, reps=reps, **timing).items():
                rows.append((name, spec.name, op_name, b, spec.seq_len, share, m.fwd_ms, m.bwd_ms, m.saved_bytes, m.output_bytes,
                             params, "measured", m.fwd_host_ms, m.bwd_host_ms, 0.0, 0.0, 0.0))
        rows.append((name, spec.name, OPTIMIZER, b, spec.seq_len, 1.0, opt_ms, 0.0, 0, 0, opt_bytes, "measured", 0.0, 0.0, 0.0, 0.0, 0.0))
        done += 1
        if progress:
            progress(done, total)
    table = pd.DataFrame(rows, columns=COLUMNS + HOST_COLUMNS)
    # A segment's and an offloaded tensor's costs, measured at the largest share, at every share of the layer's
    # operators (either attention's).
    layer_rows = table["op"].isin(list(ops) + list(other_ops))
    for b, costs in segment_ms.items():
        table.loc[layer_rows & (table["micro_batch"] == b), ["seg_host_ms", "off_fwd_host_ms", "off_bwd_host_ms"]] = costs
    if not in_step:  # the table as it was before host times: their columns absent, so eq. 2h is eq. 2
        table = table[COLUMNS]
    return validate_table(table, source=f"<measured {name}/{spec.name}>")


def _concurrent_worker(rank, spec, device_type, name, micro_batches, shares, warmup, reps, barrier, results, progress_q,
                       parent_pid, back_to_back=False, in_step=True, compile=False) -> None:
    die_with_parent(parent_pid)  # a killed `baton profile` must not leave profilers holding the cores
    try:
        torch.set_num_threads(1)
        pin_rank(rank)
        dev = torch.device(f"cuda:{rank}") if device_type == "cuda" else torch.device("cpu")
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        report = (lambda done, total: progress_q.put((done, total))) if rank == 0 else None
        df = _table(spec, dev, name, micro_batches, shares, warmup, reps, report, lambda: barrier.wait(timeout=600), back_to_back,
                    in_step, compile)
        results.put((rank, df.to_dict("list")))
    except threading.BrokenBarrierError:
        results.put((rank, None))  # a peer failed and says why
    except Exception as exc:  # reported to the parent as one line, before the peers are released
        results.put((rank, f"{type(exc).__name__}: {exc}"))
        barrier.abort()


def _concurrent_table(spec, dev, name, micro_batches, shares, warmup, reps, progress, n, timeout_s, back_to_back=False,
                      in_step=True, compile=False) -> pd.DataFrame:
    import queue

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier, results, progress_q = ctx.Barrier(n), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_concurrent_worker, args=(r, spec, dev.type, name, tuple(micro_batches), tuple(shares), warmup, reps,
                                                          barrier, results, progress_q, os.getpid(), back_to_back, in_step, compile),
                          daemon=True)
             for r in range(n)]
    for p in procs:
        p.start()
    tables: dict[int, pd.DataFrame] = {}
    deadline = time.monotonic() + timeout_s if timeout_s else float("inf")
    try:
        while len(tables) < n:
            if time.monotonic() > deadline:
                raise BatonError(f"concurrent profiling did not finish in {timeout_s:.0f} s", field="--concurrent")
            while progress and not progress_q.empty():
                progress(*progress_q.get())
            try:
                rank, got = results.get(timeout=0.5)
            except queue.Empty:
                if any(not p.is_alive() and p.exitcode not in (0, None) for p in procs):
                    raise BatonError("a concurrent profiler died", field="--concurrent") from None
                continue
            if got is None:
                continue  # released by a failing peer, whose message follows
            if isinstance(got, str):
                raise BatonError(f"profiler {rank} failed: {got}", field="--concurrent")
            tables[rank] = pd.DataFrame(got)
    finally:
        stop_processes(procs, grace_s=5)  # finished workers may still be flushing their queue
    return median_of_tables(list(tables.values()))


def median_of_tables(tables: list[pd.DataFrame]) -> pd.DataFrame:
    """One table from several measurements of the same structure: times are medians, bytes the first's."""
    key = ["op", "micro_batch", "tp_share"]
    first = tables[0].set_index(key)
    for col in ("fwd_ms", "bwd_ms", *(c for c in HOST_COLUMNS if c in first.columns)):
        stacked = pd.concat([t.set_index(key)[col] for t in tables], axis=1)
        first[col] = stacked.median(axis=1)
    return validate_table(first.reset_index(), source="<measured>")
