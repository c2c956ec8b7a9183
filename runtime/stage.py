"""One rank's part of the model: its layers' slices, the embedding on the first stage, the head on the last.

The layers are ``ParallelBlock``s (``tp_layer.py``); the stage adds what only the pipeline's ends hold,
loads its slice of full parameters (``slicing.py``) and shares one ``Meter`` (``meters.py``) among its
layers.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from baton.model_spec import ModelSpec
from runtime.meters import Meter
from runtime.model import LN_EPS, parameter_shapes
from runtime.slicing import parameter_slice, take_slice
from runtime.tp_layer import MicroBatch, ParallelBlock


class StageModel(nn.Module):
    """Layers ``layers`` of the model at this rank's share; the embedding if ``first``, the final
    LayerNorm and tied head if ``last`` (parameter names as in ``runtime.model.GPT``)."""

    def __init__(self, spec: ModelSpec, *, layers: range, heads: range, ffn_cols: range, first: bool, last: bool,
                 recompute=frozenset(), tp_group=None):
        super().__init__()
        self.spec, self.first, self.last = spec, first, last
        self.heads, self.ffn_cols = heads, ffn_cols
        self.meter = Meter()
        if first or last:
            self.wte = nn.Embedding(spec.vocab_size, spec.hidden_dim)
        if first:
            self.wpe = nn.Embedding(spec.seq_len, spec.hidden_dim)
        self.h = nn.ModuleDict({str(i): ParallelBlock(spec, i, heads=heads, ffn_cols=ffn_cols, recompute=recompute,
                                                      tp_group=tp_group, meter=self.meter) for i in layers})
        if last:
            self.ln_f = nn.LayerNorm(spec.hidden_dim, eps=LN_EPS)

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

    def forward(self, x: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        """Tokens (B, T) on the first stage, else the activation (B, T, C); returns (B, T, C), or the
        logits (B, T, V) on the last stage."""
        if self.first:
            x = self.wte(x) + self.wpe(torch.arange(x.size(1), device=x.device))
        for block in self.h.values():
            x = block(x, mb)
        if self.last:
            x = self.ln_f(x) @ self.wte.weight.t()
        return x
