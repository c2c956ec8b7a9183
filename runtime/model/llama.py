"""The single-device Llama every parallel Llama run is compared against (nanoGPT style).

Pre-RMSNorm decoder, rotary positions, grouped-query attention (``num_kv_heads`` key/value heads, each
serving ``num_heads / num_kv_heads`` consecutive query heads), SwiGLU MLP, no biases, the LM head tied to
the token embedding or not (``tie_embeddings``). Parameter names follow ``runtime.model.gpt`` where the role
is the same (``wte.weight``, ``h.3.ln_1.weight``, ``h.3.attn.c_proj.weight``, ``ln_f.weight``) and Hugging
Face's Llama where it is Llama's own (``attn.q_proj``, ``mlp.gate_proj``, ``lm_head.weight``), so the
runtime's slicing, sync and checkpoints treat both families alike; ``runtime.model.hf_import`` maps them to
``LlamaForCausalLM``'s.

Each layer is the operators of ``baton.operators.llama_operators`` in that order (rms1, qkv, rope,
attn_core, out_proj, resid1, rms2, gate_up, swiglu, down, resid2). The rotary tables are computed once per
forward and shared by every layer. Dropout (none in the presets) is GPT's residual dropout.

Shape legend: B batch, T sequence, C hidden, nh query heads, nkv key/value heads, hs head size, F FFN width.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from baton.model_spec import ModelSpec
from runtime.model.gpt import ReferenceModel, init_value, residual_dropout
from runtime.model.rng import DropoutKey


def parameter_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every parameter's full shape, in model order (``lm_head.weight`` only when the head is untied)."""
    C, F_, V, hs = spec.hidden_dim, spec.ffn_dim, spec.vocab_size, spec.head_dim
    shapes = {"wte.weight": (V, C)}
    for i in range(spec.num_layers):
        p = f"h.{i}."
        shapes.update({
            p + "ln_1.weight": (C,),
            p + "attn.q_proj.weight": (spec.num_heads * hs, C),
            p + "attn.k_proj.weight": (spec.kv_heads * hs, C),
            p + "attn.v_proj.weight": (spec.kv_heads * hs, C),
            p + "attn.c_proj.weight": (C, spec.num_heads * hs),
            p + "ln_2.weight": (C,),
            p + "mlp.gate_proj.weight": (F_, C),
            p + "mlp.up_proj.weight": (F_, C),
            p + "mlp.c_proj.weight": (C, F_),
        })
    shapes["ln_f.weight"] = (C,)
    if not spec.tie_embeddings:
        shapes["lm_head.weight"] = (V, C)
    return shapes


def rotary_tables(spec: ModelSpec, seq_len: int, *, device=None, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each (T, hs): position t rotates channel pair (i, i + hs/2) by t * theta^(-2i/hs).
    Angles in fp32, then cast to the activations' dtype, as Hugging Face's Llama does."""
    hs = spec.head_dim
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, hs, 2, dtype=torch.int64, device=device).float() / hs))
    angles = torch.arange(seq_len, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]  # (T, hs/2)
    angles = torch.cat((angles, angles), dim=-1)  # (T, hs)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the last dimension's halves."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        C, hs = spec.hidden_dim, spec.head_dim
        self.q_proj = nn.Linear(C, spec.num_heads * hs, bias=False)
        self.k_proj = nn.Linear(C, spec.kv_heads * hs, bias=False)
        self.v_proj = nn.Linear(C, spec.kv_heads * hs, bias=False)
        self.c_proj = nn.Linear(spec.num_heads * hs, C, bias=False)


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_dim, spec.ffn_dim, bias=False)
        self.up_proj = nn.Linear(spec.hidden_dim, spec.ffn_dim, bias=False)
        self.c_proj = nn.Linear(spec.ffn_dim, spec.hidden_dim, bias=False)


class Block(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int):
        super().__init__()
        self.spec, self.layer = spec, layer
        self.ln_1 = RMSNorm(spec.hidden_dim, spec.norm_eps)
        self.attn = Attention(spec)
        self.ln_2 = RMSNorm(spec.hidden_dim, spec.norm_eps)
        self.mlp = MLP(spec)

    def forward(self, x, rope, key: DropoutKey, samples: torch.Tensor):
        spec = self.spec
        B, T, C = x.shape
        nh, nkv, hs = spec.num_heads, spec.kv_heads, spec.head_dim
        cos, sin = rope  # (T, hs) each
        # rms1, qkv: (B, nh, T, hs) queries, (B, nkv, T, hs) keys and values
        a = self.ln_1(x)
        q = self.attn.q_proj(a).view(B, T, nh, hs).transpose(1, 2)
        k = self.attn.k_proj(a).view(B, T, nkv, hs).transpose(1, 2)
        v = self.attn.v_proj(a).view(B, T, nkv, hs).transpose(1, 2)
        # rope
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        # attn_core: each key/value head serves nh / nkv consecutive query heads
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=nkv != nh)
        y = y.transpose(1, 2).reshape(B, T, C)
        # out_proj, resid1
        x = x + residual_dropout(self.attn.c_proj(y), key, "resid1", samples, spec.dropout, self.training)
        # rms2, gate_up, swiglu, down, resid2
        h = self.ln_2(x)
        y = self.mlp.c_proj(F.silu(self.mlp.gate_proj(h)) * self.mlp.up_proj(h))
        return x + residual_dropout(y, key, "resid2", samples, spec.dropout, self.training)


class Llama(ReferenceModel):
    """The whole model on one device; ``forward`` returns (logits, mean cross-entropy or None)."""

    def __init__(self, spec: ModelSpec, *, seed: int = 0):
        super().__init__()
        self.spec, self.seed = spec, seed
        self.wte = nn.Embedding(spec.vocab_size, spec.hidden_dim)
        self.h = nn.ModuleList(Block(spec, i) for i in range(spec.num_layers))
        self.ln_f = RMSNorm(spec.hidden_dim, spec.norm_eps)
        if not spec.tie_embeddings:
            self.lm_head = nn.Linear(spec.hidden_dim, spec.vocab_size, bias=False)
        shapes = parameter_shapes(spec)
        self.load_full(lambda name: init_value(name, shapes[name], spec.num_layers, seed))

    def embed(self, idx):
        x = self.wte(idx)  # (B, T, C); the rotary tables once for every block
        return x, (rotary_tables(self.spec, idx.size(1), device=idx.device, dtype=x.dtype),)

    def head_weight(self):
        return self.wte.weight if self.spec.tie_embeddings else self.lm_head.weight
