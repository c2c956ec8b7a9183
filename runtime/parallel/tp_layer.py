"""The tensor-parallel transformer layer: ``ParallelBlock``, one rank's heads and FFN columns of a layer.

A ``ParallelBlock`` runs the operators of ``baton.operators.layer_operators`` in order (attention as
the eager operators or one fused ``attn_core``, as the model spec says), holding
``len(heads)`` attention heads and ``len(ffn_cols)`` FFN columns of the layer (any split, not just even
ones). Column-parallel qkv/fc1 take their input through ``copy_to_tp`` (all-reduce in backward), the
row-parallel out_proj/fc2 produce partial sums that one all-reduce completes; the row-parallel biases
are added after that all-reduce, in resid1/resid2. The communication itself is in ``tensor_parallel.py``.

Recomputation: maximal runs of consecutive recomputed operators form segments, each one autograd node
(``_Recompute``): the forward runs its operators without autograd and keeps only the segment's inputs, the
backward replays them in full (what the planner charges for) and back-propagates through the replay. The two
forward all-reduces end a segment and are never inside one (ranks of a TP group recompute different operators;
a collective in a recomputed region would deadlock). ``torch.utils.checkpoint`` did this with Python hooks per
saved tensor, which on a GPU made a forward at small micro-batches host-bound (``_Recompute``'s docstring).

Offload (``offload.py``): a held tensor named in ``offload`` spends the time between the passes in host
memory. Saved by a kept operator, it is caught by saved-tensor hooks around that operator (``OpCapture``);
the input of a recomputed segment, it reaches the segment (``_Recompute``) through a ``SegmentFeed`` instead
of as an input it keeps for the replay (which would hold it on the device), and the replay reads it back from
the host. A layer's backward prefetches the layer below it (a hook on its output).

Compiled (``compile_operators``, ``baton train --compile``): every maximal run of kept operators between two
all-reduces, and every recomputed segment, is one ``torch.compile`` graph (default mode, static shapes); the
program around them stays eager. With tensor-parallel peers a run is also cut where ``copy_to_tp`` takes an
operator's input (qkv, fc1; Llama's gate_up), which is applied between the two graphs: a graph break inside
the operator instead made Dynamo give up on the whole run, which then ran eagerly. So the all-reduces of both
passes run as the uncompiled layer runs them, outside any graph, timed by ``AllReduceClock``; a segment is a
non-reentrant ``torch.utils.checkpoint`` (its forward traced with autograd, as the graphs were compiled) whose
replay runs the same compiled graphs, counted and timed by the meter; and dropout masks take their key as a
tensor (``runtime.model.rng.TensorKey``), so one graph serves every step. The
saved-bytes meter counts what the compiled graphs keep, which may be less than the operators' own (a fused graph
can keep its inputs instead of its intermediates). Offload is refused (``check_compile``): its saved-tensor hooks
name each operator's saved tensors, which a graph replaces.

Shape legend: B micro-batch, T sequence, C hidden, nl local heads, hs head size, fl local FFN width.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from baton.memory import held_tensors
from baton.model_spec import ModelSpec
from baton.operators import ALLREDUCE_OUTPUTS, LAYER_INPUT, layer_operators
from runtime.measure.meters import Meter
from runtime.model.gpt import LN_EPS
from runtime.model.rng import DropoutKey, TensorKey, attention_keep, dropout, residual_keep
from runtime.parallel.offload import (OffloadStash, OpCapture, SegmentFeed, check_offload, offloaded_of, prefetch_hook,
                                      storage_names)
from runtime.parallel.tensor_parallel import copy_to_tp, group_size, reduce_from_tp


FUSED_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
"""Kernels ``attn_core`` may run: the ones that keep no score matrix."""


def _sdp_switches() -> tuple | None:
    """(getter, setter, wanted) of every attention backend flag ``sdpa_kernel(FUSED_ATTENTION)`` sets, wanted
    as it sets them; None if this torch names them otherwise (``fused_attention_only`` then uses ``sdpa_kernel``)."""
    try:
        from torch.nn.attention import _backend_names  # private: the flags sdpa_kernel walks

        return tuple((getattr(torch._C, f"_get_{name}_sdp_enabled"), getattr(torch._C, f"_set_sdp_use_{name}"),
                      getattr(SDPBackend, value) in FUSED_ATTENTION) for name, value in _backend_names.items())
    except (ImportError, AttributeError):
        return None


_SDP_SWITCHES = _sdp_switches()


class _FusedAttentionOnly:
    """What ``sdpa_kernel(FUSED_ATTENTION)`` does (the flags set on entry, the previous ones restored on exit),
    without its cost: two generator-based context managers and a list of backends built per call took a few
    microseconds each, 24 times a step of a 6-layer model of 4 micro-batches."""

    __slots__ = ("previous",)

    def __enter__(self):
        self.previous = [get() for get, _, _ in _SDP_SWITCHES]
        for _, put, wanted in _SDP_SWITCHES:
            put(wanted)

    def __exit__(self, *exc):
        for (_, put, _), was in zip(_SDP_SWITCHES, self.previous):
            put(was)
        return False


def fused_attention_only():
    """A context in which ``F.scaled_dot_product_attention`` runs only ``FUSED_ATTENTION``'s kernels: torch's
    ``sdpa_kernel`` while torch.compile traces (Dynamo knows it) or where this torch's flags are unknown, else the
    same flags set directly (``_FusedAttentionOnly``)."""
    if _SDP_SWITCHES is None or torch.compiler.is_compiling():
        return sdpa_kernel(FUSED_ATTENTION)
    return _FusedAttentionOnly()


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """What a layer's dropout masks depend on besides the layer and operator."""

    seed: int
    step: int
    samples: torch.Tensor
    """Indices of the micro-batch's rows in the step's global batch."""

    def dropout_key(self, layer: int) -> DropoutKey:
        return DropoutKey(self.seed, self.step, layer)


@dataclass(frozen=True, slots=True)
class _CompiledBatch:
    """What a compiled graph of one layer sees of its micro-batch: tensors only, so no step is a new graph."""

    samples: torch.Tensor
    """``MicroBatch.samples``."""
    table: torch.Tensor
    """The layer's dropout bases at this step (``DropoutKey.bases``)."""

    def dropout_key(self, layer: int) -> TensorKey:
        return TensorKey(self.table)  # the table is the layer's own already


@dataclass(frozen=True, slots=True)
class _Segment:
    """A run of consecutive recomputed operators, replayed as one checkpoint."""

    ops: tuple
    """The operators, in order."""
    inputs: tuple[str, ...]
    """Tensors they read that none of them makes."""
    outputs: tuple[str, ...]
    """Tensors they make that are read after them (or are the layer's output)."""


@dataclass(frozen=True, slots=True)
class _Run:
    """A run of consecutive kept operators between all-reduces or segments: one graph when compiled (or a piece of
    a run or segment, cut where ``copy_to_tp`` takes an input)."""

    ops: tuple
    """The operators, in order."""
    inputs: tuple[str, ...]
    """Tensors they read that none of them makes."""
    outputs: tuple[str, ...]
    """Tensors they make that are read after them (or are the layer's output)."""
    copied: str | None = None
    """A piece's input that enters through ``copy_to_tp`` before the graph (its first operator's first input)."""


class _Recompute(torch.autograd.Function):
    """A recomputed segment as one autograd node. Its forward runs the operators without autograd and keeps only
    the segment's inputs; its backward replays the operators with autograd on those inputs and back-propagates
    through the replay (parameters' gradients accumulate there, as in the layer's other operators).

    Why not ``torch.utils.checkpoint``: its non-reentrant form records every operator's graph in the forward and
    runs Python hooks for each tensor saved, packed and unpacked, plus context managers per call. On an H200 that
    host work made a gpt3-350m forward at micro-batch 2 with every operator recomputed 3x the plain forward
    (29.5 ms against 9.7, bench/results/gpu-2026-11-27.md), where the recomputation itself is in the backward.

    ``forward(replay, names, feed, *tensors)``: ``tensors`` are the inputs named ``names`` (kept for the
    replay), then the live tensors of ``feed``'s offloaded inputs, passed only so that autograd links the segment
    to them: the replay reads them back from the host (``SegmentFeed``). Operators recompute exactly what they
    computed: dropout is keyed (``runtime.model.rng``), and no collective runs inside a segment's forward."""

    @staticmethod
    def forward(ctx, replay, names, feed, *tensors):
        kept = tensors[:len(names)]
        ctx.replay, ctx.names, ctx.feed = replay, names, feed
        ctx.save_for_backward(*kept)
        ctx.set_materialize_grads(False)
        outs = replay({**dict(zip(names, kept)), **(feed.take() if feed is not None else {})})
        ctx.mark_non_differentiable(*(o for o in outs if not o.is_floating_point()))
        return outs

    @staticmethod
    def backward(ctx, *grads):
        kept = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        fed = ctx.feed.take() if ctx.feed is not None else {}
        with torch.enable_grad():
            outs = ctx.replay({**dict(zip(ctx.names, kept)), **fed})
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, None, *(t.grad if t.requires_grad else None for t in (*kept, *fed.values())))


class _Params(nn.Module):
    """A bag of parameters named like the reference model's modules (``c_attn.weight``, ...)."""

    def __init__(self, **shapes):
        super().__init__()
        for name, shape in shapes.items():
            self.register_parameter(name, nn.Parameter(torch.empty(shape)))


class ParallelBlock(nn.Module):
    """One transformer layer at this rank's heads and FFN columns (see the module docstring).

    ``offload``: names of ``baton.memory.tensor_roles`` the layer holds under ``recompute`` and keeps in host
    memory between the passes (``check_offload`` says which sets are refused); ``stash``: the stage's
    ``OffloadStash`` (a layer alone makes its own), in whose ``record(key)`` the forward must run."""

    checkpoint_segments = False
    """Replay recomputed segments through ``torch.utils.checkpoint`` instead of ``_Recompute`` (a compiled layer always
    does): the same numbers, more host time; bench/bench_recompute.py sets it to time the two side by side."""

    def __init__(self, spec: ModelSpec, layer: int, *, heads: range, ffn_cols: range, recompute=frozenset(),
                 tp_group=None, meter: Meter | None = None, offload: frozenset[str] = frozenset(),
                 stash: OffloadStash | None = None):
        super().__init__()
        self.spec, self.layer, self.heads, self.tp_group = spec, layer, heads, tp_group
        self.meter = meter or Meter()
        self.offload = frozenset(offload)
        check_offload(spec, frozenset(recompute), self.offload)
        self._held = frozenset(held_tensors(spec, frozenset(recompute)))
        self.stash = stash if stash is not None or not self.offload else OffloadStash()
        # Kept operators that save an offloaded tensor: the only ones run under saved-tensor hooks.
        self._offload_ops = frozenset(o.name for o in layer_operators(spec)
                                      if o.name not in recompute and self.offload & set(o.saves))
        self._own_params: tuple | None = None
        """The layer's parameters, listed at the first offloading forward (their storage may move, they do not)."""
        self._make_parameters(spec, len(heads), len(ffn_cols))
        # Alone in its group a row-parallel product is whole, so its bias goes into the matrix product (one addmm,
        # as nn.Linear does) instead of a separate pass after an all-reduce that does not happen.
        self.bias_in_product = group_size(tp_group) == 1 and hasattr(self.attn.c_proj, "bias")
        self.program = _program(layer_operators(spec), frozenset(recompute))
        self._copy_in = copy_to_tp
        """``copy_to_tp``; compiled, the identity (the copy is made between two graphs, ``_run_compiled``)."""
        self._graphs: dict[tuple[str, ...], list] | None = None
        """(piece, compiled graph) of each run and segment, by its operators' names (None: not compiled)."""
        self._backend = "inductor"
        """torch.compile's backend for them."""
        self._tables: dict = {}
        """Dropout bases by (seed, step, device) while compiled: one host-to-device copy per layer and step."""

    def compile_operators(self, backend: str = "inductor") -> None:
        """Run the operators as compiled graphs from now on (see the module docstring), with torch.compile's
        ``backend``; the caller has checked the combination (``check_compile``)."""
        if self.offload:
            raise ValueError("a compiled layer cannot offload (check_compile refuses the combination)")
        self._copy_in = _no_copy
        self._graphs = {}
        self._backend = backend
        self.program = _compiled_program(self.program)

    @property
    def compiled(self) -> bool:
        return self._graphs is not None

    COPIED_INPUTS = frozenset({"qkv", "fc1"})
    """Operators whose first input enters through ``copy_to_tp`` (the column-parallel products)."""

    def _make_parameters(self, spec: ModelSpec, nl: int, fl: int) -> None:
        """The layer's parameters at ``nl`` local heads and ``fl`` local FFN columns."""
        C, hs = spec.hidden_dim, spec.head_dim
        self.ln_1 = _Params(weight=(C,), bias=(C,))
        self.attn = nn.Module()
        self.attn.c_attn = _Params(weight=(3 * nl * hs, C), bias=(3 * nl * hs,))
        self.attn.c_proj = _Params(weight=(C, nl * hs), bias=(C,))
        self.ln_2 = _Params(weight=(C,), bias=(C,))
        self.mlp = nn.Module()
        self.mlp.c_fc = _Params(weight=(fl, C), bias=(fl,))
        self.mlp.c_proj = _Params(weight=(C, fl), bias=(C,))

    # One method per operator of baton.operators, in order: (mb, *inputs) -> outputs.
    def _ln1(self, mb, x):
        return (F.layer_norm(x, x.shape[-1:], self.ln_1.weight, self.ln_1.bias, LN_EPS),)

    def _qkv(self, mb, a):
        B, T, _ = a.shape
        qkv = F.linear(self._copy_in(a, self.tp_group), self.attn.c_attn.weight, self.attn.c_attn.bias)
        qkv = qkv.view(B, T, 3, len(self.heads), self.spec.head_dim)
        if self.spec.attention == "fused":
            # Views of the qkv output, each (B, nl, T, hs) laid out as (B, T, nl, hs). Only attn_core reads
            # them, so q, k and v are always kept or freed together and their one storage is exactly
            # their bytes; the kernel keeps them as they are and writes its output in the same layout,
            # so out_proj's (B, T, nl * hs) view of it is not a second copy.
            return tuple(t.transpose(1, 2) for t in qkv.unbind(2))
        # Eager: three separate tensors, as the planner counts them: attn_scores keeps q and k, attn_v
        # keeps v, so a view would pin the whole qkv output.
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        return q.contiguous(), k.contiguous(), v.contiguous()  # each (B, nl, T, hs)

    def _attn_scores(self, mb, q, k):
        return ((q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.spec.head_dim)),)  # (B, nl, T, T)

    def _softmax(self, mb, scores):
        T = scores.size(-1)
        # The causal mask as an additive -inf bias: an addition keeps nothing for backward, where
        # masked_fill would keep a (T, T) mask the planner does not count.
        causal = torch.full((T, T), float("-inf"), dtype=scores.dtype, device=scores.device).triu(1)
        return (F.softmax(scores + causal, dim=-1),)

    def _attn_dropout(self, mb, probs):
        if not self.training:  # evaluation (validation loss): no dropout, as the reference model's eval()
            return (probs,)
        keep = attention_keep(mb.dropout_key(self.layer), mb.samples, self.heads, probs.size(-1), self.spec.dropout, probs.device)
        return (dropout(probs, keep, self.spec.dropout),)

    def _attn_v(self, mb, probs, v):
        return (probs @ v,)  # (B, nl, T, hs)

    def _attn_core(self, mb, q, k, v):
        # Fused (flash) attention: the kernel keeps q, k, v as _qkv made them, its (B, nl, T, hs) output
        # and the (B, nl, T) fp32 log-sum-exp, and recomputes the scores in backward. No dropout on the
        # probabilities (the flash kernels keep no mask; see baton.operators). The unfused "math"
        # fallback is excluded: it would silently keep the (B, nl, T, T) matrices the plan does not count.
        # Under grouped-query attention (Llama) k and v have fewer heads, each serving consecutive query
        # heads; the kernel reads them as they are, without expanding them.
        with fused_attention_only():
            return (F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.0, enable_gqa=k.size(1) != q.size(1)),)

    def _out_proj(self, mb, ctx):
        B, nl, T, hs = ctx.shape
        bias = self.attn.c_proj.bias if self.bias_in_product else None
        return (F.linear(ctx.transpose(1, 2).reshape(B, T, nl * hs), self.attn.c_proj.weight, bias),)  # partial (B, T, C)

    def _resid(self, name, bias, mb, branch, x):
        y = branch if bias is None else branch + bias
        if self.spec.dropout > 0.0 and self.training:
            B, T, C = y.shape
            keep = residual_keep(mb.dropout_key(self.layer), name, mb.samples, T, C, self.spec.dropout, y.device)
            y = dropout(y, keep, self.spec.dropout)
        return (x + y,)

    def _resid1(self, mb, attn_out, x):
        return self._resid("resid1", None if self.bias_in_product else self.attn.c_proj.bias, mb, attn_out, x)

    def _ln2(self, mb, x):
        return (F.layer_norm(x, x.shape[-1:], self.ln_2.weight, self.ln_2.bias, LN_EPS),)

    def _fc1(self, mb, a):
        return (F.linear(self._copy_in(a, self.tp_group), self.mlp.c_fc.weight, self.mlp.c_fc.bias),)  # (B, T, fl)

    def _gelu(self, mb, h):
        return (F.gelu(h, approximate="tanh"),)

    def _fc2(self, mb, h):
        return (F.linear(h, self.mlp.c_proj.weight, self.mlp.c_proj.bias if self.bias_in_product else None),)  # partial (B, T, C)

    def _resid2(self, mb, mlp_out, x_mid):
        return self._resid("resid2", None if self.bias_in_product else self.mlp.c_proj.bias, mb, mlp_out, x_mid)

    # Execution.
    def _run_ops(self, ops, mb, env, key=None, params=frozenset()):
        """Run ``ops`` on ``env``; ``key``: the micro-batch whose kept operators' saved tensors are offloaded
        (None: nothing is), ``params``: the storage addresses of the layer's parameters (saved, never offloaded)."""
        meter = self.meter
        for op in ops:
            meter.calls[op.name] += 1
            if meter.in_backward:
                meter.recomputed[op.name] += 1
            fn, args = getattr(self, "_" + op.name), [env[n] for n in op.inputs]
            if key is None or op.name not in self._offload_ops:
                outs = fn(mb, *args)
            else:
                count = self.meter.saved.add if self.meter.saved is not None else None
                with OpCapture(self.stash, key, self.layer, op, env, self.offload, self._held, params,
                               count).hooks() as capture:
                    outs = fn(mb, *args)
                capture.resolve(dict(zip(op.outputs, outs)))
            env.update(zip(op.outputs, outs))

    def _replay(self, seg: _Segment, mb, env: dict) -> tuple:
        """``seg``'s operators on ``env`` (its inputs by name); its outputs in ``seg.outputs``'s order."""
        meter = self.meter
        # Timed on the engine's clock during a step's backward (events on CUDA: no host wait inside the pass).
        clock = meter.clock if meter.in_backward else None
        token = clock.start() if clock is not None else None
        if self.compiled:
            self._run_compiled(seg, mb, env)
        else:
            self._run_ops(seg.ops, mb, env)
        if clock is not None:
            clock.stop(token, ("recompute", meter.backward_mb))
        return tuple(env[n] for n in seg.outputs)

    def _replay_checkpointed(self, seg: _Segment, mb, feed: SegmentFeed | None, *inputs) -> tuple:
        """``_replay`` as ``torch.utils.checkpoint`` calls it: the positional inputs, then the fed ones."""
        env = dict(zip([n for n in seg.inputs if feed is None or n not in feed.parts], inputs))
        if feed is not None:
            env.update(feed.take())
        return self._replay(seg, mb, env)

    def forward(self, x: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        # Without autograd (validation) nothing is held, so nothing is offloaded.
        key = self.stash.begin(self.layer) if self.offload and torch.is_grad_enabled() else None
        env, params = {LAYER_INPUT: x}, frozenset()
        if key is not None:
            if self._own_params is None:  # nn.Module.parameters() walks the module tree: 130 us a call
                self._own_params = tuple(self.parameters())
            # Read at every pass: at ZeRO stage 3 a layer's weights are gathered into new storage each pass.
            params = {p.untyped_storage().data_ptr() for p in self._own_params}
        for item in self.program:
            if isinstance(item, tuple):  # ("allreduce", partial sum, full tensor)
                env[item[2]] = reduce_from_tp(env[item[1]], self.tp_group)
            elif isinstance(item, _Segment):
                fed = [n for n in item.inputs if n in self.offload] if key is not None else []
                inputs = [env[n] for n in item.inputs if n not in fed]
                if self.meter.saved is not None:
                    for t in inputs:
                        self.meter.saved.add(t)
                feed = self._feed(key, fed, env) if fed else None
                if self.compiled or self.checkpoint_segments:  # a compiled graph replays under the checkpoint it was traced for
                    with set_checkpoint_early_stop(False):
                        outs = checkpoint(partial(self._replay_checkpointed, item, mb, feed), *inputs,
                                          use_reentrant=False, preserve_rng_state=False)
                else:
                    names = tuple(n for n in item.inputs if n not in fed)
                    live = tuple(env[n] for n in fed)
                    outs = _Recompute.apply(partial(self._replay, item, mb), names, feed, *inputs, *live)
                env.update(zip(item.outputs, outs))
            elif isinstance(item, _Run):
                self._run_compiled(item, mb, env)
            else:
                self._run_ops((item,), mb, env, key, params)
        y = env["layer_output"]
        if key is not None:
            self.stash.flush()  # the layer's copies to the host start now, all at once
            if y.requires_grad:
                y.register_hook(partial(prefetch_hook, self.stash, key, self.layer))
        return y

    def _run_compiled(self, run: _Segment | _Run, mb: MicroBatch, env: dict) -> None:
        """``run``'s operators as one compiled graph on ``env``, counted on the meter as ``_run_ops`` counts them."""
        meter = self.meter
        for op in run.ops:
            meter.calls[op.name] += 1
            if meter.in_backward:
                meter.recomputed[op.name] += 1
        names = tuple(op.name for op in run.ops)
        pieces = self._graphs.get(names)
        if pieces is None:
            kind = "recomputed" if isinstance(run, _Segment) else "kept"
            copied = self.COPIED_INPUTS if group_size(self.tp_group) > 1 else frozenset()
            pieces = self._graphs[names] = [(piece, _compiled_graph(self, piece, kind, self._backend))
                                            for piece in _pieces(run, copied)]
        table = self._dropout_table(mb)
        for piece, graph in pieces:
            if piece.copied is not None:
                env[piece.copied] = copy_to_tp(env[piece.copied], self.tp_group)
            outs = graph(mb.samples, table, *(env[n] for n in piece.inputs))
            env.update(zip(piece.outputs, outs))

    def _dropout_table(self, mb: MicroBatch) -> torch.Tensor:
        """This layer's dropout bases at ``mb``'s step, on its device; made once per step (micro-batches share it)."""
        device = mb.samples.device
        key = (mb.seed, mb.step, device)
        table = self._tables.get(key)
        if table is None:
            host = mb.dropout_key(self.layer).bases()
            # Through pinned memory without waiting, as the engine moves its batches (a pageable copy waits).
            table = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host
            self._tables = {key: table}
        return table

    def _feed(self, key, names: list[str], env: dict) -> SegmentFeed:
        """Offloaded segment inputs ``names``: copied to the host (once per storage) and fed to the segment."""
        names_of = storage_names(env)
        stored = {}
        for n in names:
            off = offloaded_of(names_of[env[n].untyped_storage().data_ptr()], self.offload, self._held)
            stored[n] = self.stash.store(key, self.layer, "+".join(off), off, env[n])
        return SegmentFeed(self.stash, {n: env[n] for n in names}, stored)


def _no_copy(x: torch.Tensor, group) -> torch.Tensor:
    """``copy_to_tp`` inside a compiled graph: already applied to the graph's input (``_Run.copied``)."""
    return x


def _pieces(run: _Segment | _Run, copied: frozenset[str]) -> list[_Run]:
    """``run`` cut before every operator of ``copied`` (after the first), each piece with the inputs it reads and the
    outputs read after it; the one run whole when ``copied`` is empty."""
    cuts: list[list] = []
    for op in run.ops:
        if not cuts or op.name in copied:
            cuts.append([])
        cuts[-1].append(op)
    pieces = []
    for i, ops in enumerate(cuts):
        made = [n for op in ops for n in op.outputs]
        later = set(run.outputs) | {n for rest in cuts[i + 1:] for op in rest for n in op.inputs}
        first = ops[0]
        copy = first.inputs[0] if first.name in copied else None
        # The copy replaces its tensor for every later reader: only the operator it feeds may read it.
        assert copy is None or all(copy not in op.inputs for op in run.ops if op is not first), f"{copy} has other readers"
        pieces.append(_Run(ops=tuple(ops), inputs=tuple(dict.fromkeys(n for op in ops for n in op.inputs if n not in made)),
                           outputs=tuple(n for n in made if n in later), copied=copy))
    return pieces


_GRAPHS: dict[tuple, Callable] = {}
"""Compiled function of each (layer class, run): shared by the layers of a process, which differ in parameters only."""


def forget_compiled_graphs() -> None:
    """Compile layers made from now on afresh. A rank's layers share their graphs, and a function recompiled for
    more than torch's limit of shapes (8) runs eagerly without a word: the profiler, which times one layer at
    many micro-batch sizes and shares in one process, starts each anew."""
    _GRAPHS.clear()


def _compiled_graph(block: ParallelBlock, run: _Run, kind: str, backend: str) -> Callable:
    """``run``'s operators of ``block`` as one ``torch.compile`` graph: (samples, dropout table, *inputs) -> outputs.

    One function per run, shared by every layer: torch.compile keeps its graphs per code object under a limit of
    recompilations, and takes a layer as an input (its parameters, not its identity), so the layers of a stage
    share one graph per run and compile it once. Each run gets a code object of its own, so that no run's graphs
    count against another's limit."""
    key = (type(block), run, kind, backend)
    shared = _GRAPHS.get(key)
    if shared is None:
        def graph(layer, samples, table, *values):
            mb = _CompiledBatch(samples, table)
            env = dict(zip(run.inputs, values))
            for op in run.ops:
                env.update(zip(op.outputs, getattr(layer, "_" + op.name)(mb, *(env[n] for n in op.inputs))))
            return tuple(env[n] for n in run.outputs)

        graph.__code__ = graph.__code__.replace(co_name=f"{kind}_{run.ops[0].name}_to_{run.ops[-1].name}")
        shared = _GRAPHS[key] = torch.compile(graph, dynamic=False, backend=backend)
    return partial(shared, block)


def _compiled_program(program: list) -> list:
    """``program`` with each maximal run of kept operators as one ``_Run`` (its inputs and outputs as a segment's)."""
    items: list = []
    for item in program:
        if isinstance(item, (tuple, _Segment)):  # all-reduces and segments stay as they are
            items.append(item)
        elif items and isinstance(items[-1], list):
            items[-1].append(item)
        else:
            items.append([item])
    return [_Run(ops=tuple(item), **_boundary(items, i)) if isinstance(item, list) else item
            for i, item in enumerate(items)]


def _program(ops, recompute: frozenset) -> list:
    """Operators, all-reduces and recomputed segments in execution order."""
    items: list = []
    run: list = []

    def flush():
        if run:
            items.append(list(run))
            run.clear()

    for op in ops:
        if op.name in recompute:
            run.append(op)
        else:
            flush()
            items.append(op)
        for out in op.outputs:
            if out in ALLREDUCE_OUTPUTS:
                flush()
                items.append(("allreduce", out, ALLREDUCE_OUTPUTS[out]))
    flush()
    return [_Segment(ops=tuple(item), **_boundary(items, i)) if isinstance(item, list) else item
            for i, item in enumerate(items)]


def _boundary(items: list, i: int) -> dict:
    """The inputs (read, not made inside) and outputs (made inside, read later) of the operators ``items[i]``, a list
    among operators, all-reduces (tuples), segments and other lists."""
    made = [n for op in items[i] for n in op.outputs]
    later = {"layer_output"}
    for nxt in items[i + 1:]:
        if isinstance(nxt, tuple):
            later.add(nxt[1])
        elif isinstance(nxt, _Segment):
            later.update(nxt.inputs)
        else:
            later.update(n for op in (nxt if isinstance(nxt, list) else [nxt]) for n in op.inputs)
    return {"inputs": tuple(dict.fromkeys(n for op in items[i] for n in op.inputs if n not in made)),
            "outputs": tuple(n for n in made if n in later)}
