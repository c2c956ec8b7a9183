"""The single-device GPT every parallel run is compared against (nanoGPT style).

Pre-LayerNorm decoder, learned positions, GELU (tanh) MLP, LM head tied to the token embedding,
dropout on both residual branches and (eager attention only) on the attention probabilities. Parameter
names follow GPT-2 (``wte.weight``, ``h.3.attn.c_attn.weight``, ...) with ``nn.Linear`` layouts (out, in);
checkpoints store exactly these full tensors (``wte.weight`` with ``vocab_size`` rows), whatever plan
wrote them.

Each layer is written as the operators of ``baton.operators.layer_operators`` in that order (ln1, qkv,
attention, out_proj, resid1, ln2, fc1, gelu, fc2, resid2), so the planner's per-operator tables describe
this code. Attention follows ``spec.attention``: ``eager`` spells it out (attn_scores, softmax,
attn_dropout, attn_v), ``fused`` is one ``scaled_dot_product_attention`` call (attn_core, no dropout on
the probabilities). Dropout masks come from ``runtime.model.rng`` (functions of seed, step, layer, operator,
sample, head), never from the global RNG.

Shape legend: B batch, T sequence, C hidden, nh heads, hs head size, F FFN width, V vocabulary.
"""
from __future__ import annotations

import math
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from baton.model_spec import ModelSpec
from runtime.model.rng import DropoutKey, attention_mask, residual_mask

LN_EPS = 1e-5


def parameter_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every parameter's full shape, in model order (the tied LM head is ``wte.weight``)."""
    C, F_, V, T = spec.hidden_dim, spec.ffn_dim, spec.vocab_size, spec.seq_len
    shapes = {"wte.weight": (V, C), "wpe.weight": (T, C)}
    for i in range(spec.num_layers):
        p = f"h.{i}."
        shapes.update({
            p + "ln_1.weight": (C,), p + "ln_1.bias": (C,),
            p + "attn.c_attn.weight": (3 * C, C), p + "attn.c_attn.bias": (3 * C,),
            p + "attn.c_proj.weight": (C, C), p + "attn.c_proj.bias": (C,),
            p + "ln_2.weight": (C,), p + "ln_2.bias": (C,),
            p + "mlp.c_fc.weight": (F_, C), p + "mlp.c_fc.bias": (F_,),
            p + "mlp.c_proj.weight": (C, F_), p + "mlp.c_proj.bias": (C,),
        })
    shapes.update({"ln_f.weight": (C,), "ln_f.bias": (C,)})
    return shapes


def init_parameter(spec: ModelSpec, name: str, seed: int) -> torch.Tensor:
    """The full initial value of one parameter: a function of (seed, name) only, so every rank builds
    the same master weight and keeps its own slice (GPT-2 init: N(0, 0.02), residual projections scaled
    by 1/sqrt(2 * layers), zero biases, unit LayerNorm gains)."""
    return init_value(name, parameter_shapes(spec)[name], spec.num_layers, seed)


def init_value(name: str, shape: tuple[int, ...], num_layers: int, seed: int) -> torch.Tensor:
    """``init_parameter`` for a parameter of either family by its name and shape (Llama's take GPT-2's
    rule: its norms are ``ln_*`` gains, its residual projections ``c_proj``)."""
    if name.endswith(".bias"):
        return torch.zeros(shape)
    if ".ln_" in name or name.startswith("ln_f"):
        return torch.ones(shape)
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    std = 0.02 / math.sqrt(2 * num_layers) if name.endswith("c_proj.weight") else 0.02
    return torch.randn(shape, generator=gen) * std


def residual_dropout(y, key: DropoutKey, name: str, samples: torch.Tensor, p: float, training: bool):
    """Dropout on a residual branch (resid1 or resid2) with the mask of ``runtime.model.rng``."""
    if p == 0.0 or not training:
        return y
    B, T, C = y.shape
    return y * residual_mask(key, name, samples, T, C, p, device=y.device, dtype=y.dtype)


class CausalSelfAttention(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.c_attn = nn.Linear(spec.hidden_dim, 3 * spec.hidden_dim)
        self.c_proj = nn.Linear(spec.hidden_dim, spec.hidden_dim)


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.c_fc = nn.Linear(spec.hidden_dim, spec.ffn_dim)
        self.c_proj = nn.Linear(spec.ffn_dim, spec.hidden_dim)


class Block(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int):
        super().__init__()
        self.spec, self.layer = spec, layer
        self.ln_1 = nn.LayerNorm(spec.hidden_dim, eps=LN_EPS)
        self.attn = CausalSelfAttention(spec)
        self.ln_2 = nn.LayerNorm(spec.hidden_dim, eps=LN_EPS)
        self.mlp = MLP(spec)

    def forward(self, x, key: DropoutKey, samples: torch.Tensor):
        spec, p = self.spec, self.spec.dropout
        B, T, C = x.shape
        nh, hs = spec.num_heads, spec.head_dim
        drop = p > 0.0 and self.training
        # ln1
        a = self.ln_1(x)
        # qkv: (B, T, 3C) -> three (B, nh, T, hs)
        q, k, v = self.attn.c_attn(a).split(C, dim=2)
        q, k, v = (t.view(B, T, nh, hs).transpose(1, 2) for t in (q, k, v))
        if spec.attention == "fused":
            # attn_core: the whole causal attention in one kernel, (B, nh, T, hs)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.0)
        else:
            # attn_scores: (B, nh, T, T)
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
            # softmax (causal)
            causal = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
            att = F.softmax(att.masked_fill(causal, float("-inf")), dim=-1)
            # attn_dropout
            if drop:
                att = att * attention_mask(key, samples, range(nh), T, p, device=x.device, dtype=att.dtype)
            # attn_v: (B, nh, T, hs)
            y = att @ v
        y = y.transpose(1, 2).reshape(B, T, C)
        # out_proj, then resid1 (dropout on the branch, add)
        x = x + residual_dropout(self.attn.c_proj(y), key, "resid1", samples, p, self.training)
        # ln2, fc1, gelu, fc2 (B, T, F) -> (B, T, C), resid2
        y = self.mlp.c_proj(F.gelu(self.mlp.c_fc(self.ln_2(x)), approximate="tanh"))
        return x + residual_dropout(y, key, "resid2", samples, p, self.training)


class ReferenceModel(nn.Module):
    """What the single-device models (this GPT, ``runtime.model.llama.Llama``) share: blocks ``h`` between an
    embedding and a final norm ``ln_f`` with the LM head, and full tensors loaded by name."""

    spec: ModelSpec
    seed: int

    @torch.no_grad()
    def load_full(self, full) -> None:
        """Set every parameter from ``full(name) -> tensor`` (an init, a checkpoint, a converted HF model)."""
        for name, p in self.named_parameters():
            p.copy_(full(name))

    def embed(self, idx: torch.Tensor) -> tuple[torch.Tensor, tuple]:
        """The first block's input (B, T, C) for tokens ``idx`` (B, T), and what every block takes besides it."""
        raise NotImplementedError

    def head_weight(self) -> torch.Tensor:
        """The LM head's (V, C) matrix: the token embedding when tied."""
        return self.wte.weight

    def forward(self, idx, targets=None, *, step: int = 0, samples: torch.Tensor | None = None):
        """idx (B, T) tokens; ``samples`` are the indices of these rows in the step's global batch. Returns
        (logits (B, T, V), mean cross-entropy against ``targets`` or None)."""
        B, T = idx.shape
        samples = torch.arange(B) if samples is None else samples
        x, extra = self.embed(idx)
        for block in self.h:
            x = block(x, *extra, DropoutKey(self.seed, step, block.layer), samples)
        logits = self.ln_f(x) @ self.head_weight().t()  # (B, T, V)
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


class GPT(ReferenceModel):
    """The whole model on one device; ``forward`` returns (logits, mean cross-entropy or None)."""

    def __init__(self, spec: ModelSpec, *, seed: int = 0):
        super().__init__()
        self.spec, self.seed = spec, seed
        self.wte = nn.Embedding(spec.vocab_size, spec.hidden_dim)
        self.wpe = nn.Embedding(spec.seq_len, spec.hidden_dim)
        self.h = nn.ModuleList(Block(spec, i) for i in range(spec.num_layers))
        self.ln_f = nn.LayerNorm(spec.hidden_dim, eps=LN_EPS)
        self.load_full(lambda name: init_parameter(spec, name, seed))

    def embed(self, idx):
        return self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device)), ()  # (B, T, C); head tied
