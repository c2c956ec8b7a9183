"""One rank's part of the model: its layers' slices, the embedding on the first stage, the head on the last.

The layers are ``ParallelBlock``s (``tp_layer.py``); the stage adds what only the pipeline's ends hold,
loads its slice of full parameters (``slicing.py``) and shares one ``Meter`` (``meters.py``) among its
layers.

The embedding and the tied LM head are vocabulary-parallel (``vocab_parallel.py``): each rank of the first
and last stage holds the rows ``vocab_range(spec, heads)`` of the padded vocabulary, the share of its
units. The position embedding and the final LayerNorm are replicated. On the first stage the token
embedding takes one all-reduce in forward; on the last the cross-entropy takes three small ones in
forward and the head's input gradient one in backward (``copy_to_tp``).

A Llama stage (``runtime.parallel.llama_layer``) has no position embedding: its layers share one
``RotaryTables``, computed once per sequence length and dtype. Its final norm is
an RMSNorm, and an untied head has rows of its own (``lm_head.weight``, split like the embedding's).

A stage that offloads (``offload``: the tensor names of its device's plan entry, the same for every layer) has one
``OffloadStash`` (``offload.py``) shared by its layers: the engine runs each pass under ``stash.record(key)``.

``baton train --compile`` compiles each layer's operators (``compile_layers``; ``ParallelBlock.compile_operators``
says how); the embedding and the head stay eager. ``check_compile`` refuses, before any rank starts, what does not
compose with it.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from baton.errors import BatonError
from baton.model_spec import ModelSpec
from baton.operators import padded_vocab
from runtime.measure.meters import Meter
from runtime.model.family import parameter_shapes
from runtime.model.gpt import LN_EPS
from runtime.parallel.llama_layer import RotaryTables, parallel_block, rms_norm
from runtime.parallel.offload import OffloadStash
from runtime.parallel.slicing import parameter_slice, take_slice, vocab_range
from runtime.parallel.tensor_parallel import copy_to_tp, reduce_from_tp
from runtime.parallel.tp_layer import MicroBatch, _Params
from runtime.parallel.vocab_parallel import holds_every_row, sum_tied_gradient, vocab_embedding, vocab_parallel_cross_entropy


def check_compile(plan) -> None:
    """Refuse, in one line naming --compile, a plan whose layers cannot run compiled (``ParallelBlock.compile_operators``):
    activation offload, whose saved-tensor hooks must see each operator's own saved tensors."""
    offloading = [d.id for p in plan.pipelines for st in p.stages for d in st.devices if d.offload]
    if offloading:
        raise BatonError(f"not with activation offload (device {offloading[0]} offloads): its saved-tensor hooks name each "
                         "operator's saved tensors, which a compiled graph replaces with its own; run without --compile",
                         field="--compile")


class StageModel(nn.Module):
    """Layers ``layers`` of the model at this rank's share; the embedding if ``first``, the final norm and
    the head if ``last`` (parameter names as in ``runtime.model.gpt.GPT`` or ``runtime.model.llama.Llama``;
    ``wte.weight`` and an untied ``lm_head.weight`` hold this rank's rows of the padded vocabulary).
    ``offload``: tensors every layer keeps in host memory between its passes (``stash`` holds them)."""

    def __init__(self, spec: ModelSpec, *, layers: range, heads: range, ffn_cols: range, first: bool, last: bool,
                 recompute=frozenset(), tp_group=None, offload=frozenset()):
        super().__init__()
        self.spec, self.first, self.last, self.tp_group = spec, first, last, tp_group
        self.heads, self.ffn_cols = heads, ffn_cols
        self.vocab = vocab_range(spec, heads)
        self._whole_vocab = holds_every_row(self.vocab, padded_vocab(spec), tp_group)
        """Every row of the vocabulary is this rank's, with no other rank beside it: its lookup and its loss skip the
        masks."""
        self.meter = Meter()
        self.offload = frozenset(offload)
        self.stash = OffloadStash() if self.offload else None
        """The host copies of every layer's offloaded tensors, by micro-batch in flight (None: nothing offloaded)."""
        if first or (last and spec.tie_embeddings):
            self.wte = nn.Embedding(len(self.vocab), spec.hidden_dim)
        if first and not spec.llama:
            self.wpe = nn.Embedding(spec.seq_len, spec.hidden_dim)
        shared = {"rotary": RotaryTables(spec)} if spec.llama else {}
        self.h = nn.ModuleDict({str(i): parallel_block(spec, i, heads=heads, ffn_cols=ffn_cols, recompute=recompute,
                                                       tp_group=tp_group, meter=self.meter, offload=self.offload,
                                                       stash=self.stash, **shared) for i in layers})
        if last:
            self.ln_f = _Params(weight=(spec.hidden_dim,)) if spec.llama else nn.LayerNorm(spec.hidden_dim, eps=LN_EPS)
        if last and not spec.tie_embeddings:
            self.lm_head = _Params(weight=(len(self.vocab), spec.hidden_dim))

    def compile_layers(self, backend: str = "inductor") -> None:
        """Run every layer's operators as compiled graphs (``baton train --compile``), compiled at their first call
        (``backend``: torch.compile's; tests take a cheaper one than the run's inductor)."""
        for block in self.h.values():
            block.compile_operators(backend)

    def slices(self) -> dict[str, object]:
        """Parameter name -> where its local tensor lies in the full one (see ``parameter_slice``)."""
        return {n: parameter_slice(self.spec, n, self.heads, self.ffn_cols) for n, _ in self.named_parameters()}

    @torch.no_grad()
    def load_full(self, full) -> None:
        """Set every local parameter from ``full(name) -> full tensor``."""
        shapes = parameter_shapes(self.spec)
        for name, p in self.named_parameters():
            t = full(name)
            if tuple(t.shape) != shapes[name]:
                raise ValueError(f"{name}: expected shape {shapes[name]}, got {tuple(t.shape)}")
            p.copy_(take_slice(t, parameter_slice(self.spec, name, self.heads, self.ffn_cols)))

    def forward(self, x: torch.Tensor, mb: MicroBatch, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Tokens (B, T) on the first stage, else the activation (B, T, C). Returns (B, T, C); on the
        last stage the sum over the micro-batch's tokens of the cross-entropy against ``targets`` (B, T)
        (an fp32 scalar, the same on every rank of the stage), or without targets this rank's logits
        (B, T, V_d) for its vocabulary rows."""
        if self.first:
            x = self.embed(x)
        for block in self.h.values():
            x = block(x, mb)
        if not self.last:
            return x
        return self.head(x, targets)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """First stage: tokens (B, T) -> the embedded input (B, T, C) of the first layer."""
        T = tokens.size(1)
        rows = vocab_embedding(self.wte.weight, tokens, self.vocab.start, whole=self._whole_vocab)
        x = reduce_from_tp(rows, self.tp_group)
        if self.spec.llama:
            return x
        # The position rows as a slice of the weight: its backward keeps nothing (a lookup would
        # keep a (T,) index tensor).
        return x + self.wpe.weight[:T]

    def head(self, x: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor:
        """Last stage: the final norm and the head (tied, or Llama's own rows) on (B, T, C); the summed
        cross-entropy against ``targets``, or without them this rank's logits (see ``forward``)."""
        normed = rms_norm(x, self.ln_f.weight, self.spec.norm_eps) if self.spec.llama else self.ln_f(x)
        weight = self.wte.weight if self.spec.tie_embeddings else self.lm_head.weight
        logits = F.linear(copy_to_tp(normed, self.tp_group), weight)  # (B, T, V_d)
        if targets is None:
            return logits
        valid = max(0, min(self.vocab.stop, self.spec.vocab_size) - self.vocab.start)
        return vocab_parallel_cross_entropy(logits, targets, self.vocab.start, valid, self.tp_group,
                                            whole=self._whole_vocab)

    def sum_tied_gradient(self, group) -> None:
        """Add the other end's gradient of the tied embedding to this rank's rows (``group``: the ranks
        of the first and the last stage; every one of them calls this)."""
        sum_tied_gradient(self.wte.weight.grad, self.vocab, padded_vocab(self.spec), group)
