"""The tensor-parallel Llama layer: ``ParallelLlamaBlock``, one rank's KV heads (with their query heads) and
FFN columns of a layer.

It is a ``ParallelBlock`` (``tp_layer.py``): the same program of operators, all-reduces and recomputed
segments, the same fused attention, output projection and residuals; only Llama's own operators and
parameters are written here (``baton.operators.llama_operators``). A rank holds query heads ``heads``,
whole groups of ``num_heads / num_kv_heads`` (a unit is one KV head with its query heads), so its key and
value heads are ``heads / group``.

Three operators are autograd functions of their own so that what they keep is what the cost model counts:

* ``rms_norm`` keeps its input and one fp32 reciprocal root-mean-square per token (composed of torch ops
  it would keep the fp32 copy and the normalised tensor too);
* ``rotate`` keeps nothing: its backward is the inverse rotation by the tables, which ``RotaryTables``
  computes once per stage (and sequence length) and every layer shares;
* ``swiglu`` keeps gate and up and recomputes the sigmoid in its backward (``F.silu(g) * u`` would keep
  the SiLU output as well).

Shape legend: B micro-batch, T sequence, C hidden, nl local query heads, nkl local KV heads, hs head size,
fl local FFN width.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from baton.model_spec import ModelSpec
from runtime.model.llama import rotary_tables, rotate_half
from runtime.parallel.tp_layer import ParallelBlock, _Params


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # (..., 1) fp32
        ctx.save_for_backward(x, weight, rstd)
        return weight * (xf * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        xhat = x.float() * rstd
        g = grad.float()
        grad_weight = (g * xhat.to(x.dtype).float()).reshape(-1, x.size(-1)).sum(0)
        gx = g * weight.float()
        grad_x = rstd * (gx - xhat * (gx * xhat).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_weight.to(weight.dtype), None


class _Rotate(torch.autograd.Function):
    """x * cos + rotate_half(x) * sin; the tables are the stage's, not this layer's, so nothing is saved."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.tables = (cos, sin)
        return x * cos + rotate_half(x) * sin

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.tables
        # rotate_half is antisymmetric (its transpose is its negation).
        return grad * cos - rotate_half(grad * sin), None, None


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        sig = torch.sigmoid(gate)
        silu = gate * sig
        return grad * up * (sig * (1 + gate * (1 - sig))), grad * silu


class RotaryTables:
    """A stage's (cos, sin) tables, each (T, 1, hs) to broadcast over (B, T, heads, hs): made on first use for
    each sequence length, dtype and device, then shared by every layer and micro-batch of the stage."""

    def __init__(self, spec: ModelSpec):
        self.spec = spec
        self._tables: dict = {}

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables for activations like ``x`` (B, T, ...)."""
        key = (x.size(1), x.dtype, x.device)
        if key not in self._tables:
            cos, sin = rotary_tables(self.spec, x.size(1), device=x.device, dtype=x.dtype)
            self._tables[key] = (cos.unsqueeze(1), sin.unsqueeze(1))
        return self._tables[key]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm (statistics in fp32, the product in the input's dtype)."""
    return _RMSNorm.apply(x, weight, eps)


class ParallelLlamaBlock(ParallelBlock):
    """One Llama layer at this rank's heads and FFN columns (see the module docstring); ``rotary``: the stage's
    shared tables (a layer alone makes its own)."""

    def __init__(self, spec: ModelSpec, layer: int, *, rotary: RotaryTables | None = None, **kwargs):
        super().__init__(spec, layer, **kwargs)
        self.rotary = rotary or RotaryTables(spec)

    COPIED_INPUTS = frozenset({"qkv", "gate_up"})

    def forward(self, x: torch.Tensor, mb) -> torch.Tensor:
        if self.compiled:
            # The tables made here, eagerly: a graph that made them itself would be traced again once they exist.
            self.rotary(x)
        return super().forward(x, mb)

    def _make_parameters(self, spec: ModelSpec, nl: int, fl: int) -> None:
        C, hs = spec.hidden_dim, spec.head_dim
        nkl = nl * spec.kv_heads // spec.num_heads
        self.ln_1 = _Params(weight=(C,))
        self.attn = nn.Module()
        self.attn.q_proj = _Params(weight=(nl * hs, C))
        self.attn.k_proj = _Params(weight=(nkl * hs, C))
        self.attn.v_proj = _Params(weight=(nkl * hs, C))
        self.attn.c_proj = _Params(weight=(C, nl * hs))
        self.ln_2 = _Params(weight=(C,))
        self.mlp = nn.Module()
        self.mlp.gate_proj = _Params(weight=(fl, C))
        self.mlp.up_proj = _Params(weight=(fl, C))
        self.mlp.c_proj = _Params(weight=(C, fl))

    def _rms1(self, mb, x):
        return (rms_norm(x, self.ln_1.weight, self.spec.norm_eps),)

    def _qkv(self, mb, a):
        # Three products of one input (kept once): q (B, T, nl, hs), k and v (B, T, nkl, hs), each its own
        # storage, so attention keeps v without pinning q and k. Left in (B, T, heads, hs) layout: rope
        # writes q and k in it, the fused kernel keeps them and writes its output in it, and out_proj's
        # (B, T, nl * hs) view of that output is then not a copy.
        B, T, _ = a.shape
        a = self._copy_in(a, self.tp_group)
        hs = self.spec.head_dim
        q = F.linear(a, self.attn.q_proj.weight).view(B, T, -1, hs)
        k = F.linear(a, self.attn.k_proj.weight).view(B, T, -1, hs)
        v = F.linear(a, self.attn.v_proj.weight).view(B, T, -1, hs)
        return q, k, v.transpose(1, 2)

    def _rope(self, mb, q, k):
        cos, sin = self.rotary(q)
        return _Rotate.apply(q, cos, sin).transpose(1, 2), _Rotate.apply(k, cos, sin).transpose(1, 2)

    def _resid1(self, mb, attn_out, x):
        return self._resid("resid1", None, mb, attn_out, x)

    def _rms2(self, mb, x):
        return (rms_norm(x, self.ln_2.weight, self.spec.norm_eps),)

    def _gate_up(self, mb, a):
        a = self._copy_in(a, self.tp_group)
        return F.linear(a, self.mlp.gate_proj.weight), F.linear(a, self.mlp.up_proj.weight)  # (B, T, fl) each

    def _swiglu(self, mb, gate, up):
        return (_SwiGLU.apply(gate, up),)

    def _down(self, mb, h):
        return (F.linear(h, self.mlp.c_proj.weight),)  # partial (B, T, C)

    def _resid2(self, mb, mlp_out, x_mid):
        return self._resid("resid2", None, mb, mlp_out, x_mid)


def parallel_block(spec: ModelSpec, layer: int, **kwargs) -> ParallelBlock:
    """The tensor-parallel layer of ``spec``'s architecture (``kwargs`` as ``ParallelBlock`` takes them)."""
    return ParallelLlamaBlock(spec, layer, **kwargs) if spec.llama else ParallelBlock(spec, layer, **kwargs)
