"""Dropout masks as pure functions of where they are used, so every split of the model draws the same ones.

A mask element is a hash of (seed, step, layer, operator, sample, head, position), computed with
integer tensor ops on the tensor's own device. Consequences:

* a tensor-parallel rank holding heads [i, j) draws exactly the single-device model's masks for those
  heads, whatever the split;
* recomputing an operator in the backward pass replays the same mask without saving any RNG state;
* the masks do not depend on how a step's samples are cut into micro-batches or replicas: ``sample`` is
  the index of the sample within the step's global batch (it determines the micro-batch and replica).

The hash is the 32-bit MurmurHash3 finaliser, evaluated in int64 and masked to 32 bits after each
multiply (int64 multiplication wraps, and the low 32 bits of a wrapped product are exact).

Under ``baton train --compile`` a layer's operators run in compiled graphs, which must not see the step as a
Python integer (every step would be a new graph): there the key's per-operator bases enter as one int64 tensor
(``TensorKey``), and the same integer operations give the same masks.

``dropout`` applies a mask in the activation's dtype and keeps only the boolean mask for backward (one
byte per element, as ``baton.operators`` counts it).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

_M32 = 0xFFFFFFFF
OPS = {"attn_dropout": 1, "resid1": 2, "resid2": 3}
"""Operator codes that enter the hash."""


def _fmix_int(h: int) -> int:
    h &= _M32
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & _M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & _M32
    h ^= h >> 16
    return h


def _fmix(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3 fmix32 on an int64 tensor whose values lie in [0, 2^32)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def _key(*parts: int) -> int:
    h = 0x9E3779B9
    for p in parts:
        h = _fmix_int(h ^ _fmix_int(p & _M32) ^ ((p >> 32) & _M32))
    return h


@dataclass(frozen=True, slots=True)
class DropoutKey:
    """What a layer's masks depend on besides the operator, sample, head and position."""

    seed: int
    step: int
    layer: int

    def base(self, op: str) -> int:
        return _key(self.seed, self.step, self.layer, OPS[op])

    def bases(self, device=None) -> torch.Tensor:
        """Every operator's base, in ``OPS`` order, as an int64 tensor (``TensorKey``'s table)."""
        return torch.tensor([self.base(op) for op in OPS], dtype=torch.int64, device=device)


@dataclass(frozen=True, slots=True)
class TensorKey:
    """A ``DropoutKey`` whose bases are a tensor: what a compiled layer takes instead of the step's integers."""

    table: torch.Tensor
    """``DropoutKey.bases``: int64, one per operator of ``OPS`` in order."""

    def base(self, op: str) -> torch.Tensor:
        return self.table[OPS[op] - 1]


def _uniform(base: int | torch.Tensor, samples: torch.Tensor, rows: torch.Tensor, cols: int, device) -> torch.Tensor:
    """U[0, 1) of shape (len(samples), len(rows), cols): rows index an outer axis (head*T + query pos, or pos)."""
    s = _fmix((samples.to(device=device, dtype=torch.int64) + base) & _M32)  # (B,)
    r = rows.to(device=device, dtype=torch.int64)
    h = _fmix((s[:, None] ^ _fmix(r + 0x68E31DA4)[None, :]) & _M32)  # (B, R)
    c = torch.arange(cols, device=device, dtype=torch.int64)
    h = _fmix((h[:, :, None] + c * 0x27D4EB2F) & _M32)  # (B, R, C)
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


def attention_keep(key: DropoutKey | TensorKey, samples: torch.Tensor, heads: range, seq_len: int, p: float,
                   device=None) -> torch.Tensor:
    """Boolean keep-mask (B, len(heads), T, T) for attention dropout on heads ``heads`` of the layer."""
    # Built on the device: a copy from pageable host memory would make the host wait for the stream at every dropout.
    rows = (torch.arange(heads.start, heads.stop, device=device)[:, None] * seq_len
            + torch.arange(seq_len, device=device)[None, :]).reshape(-1)
    u = _uniform(key.base("attn_dropout"), samples, rows, seq_len, device)
    return (u >= p).view(len(samples), len(heads), seq_len, seq_len)


def residual_keep(key: DropoutKey | TensorKey, op: str, samples: torch.Tensor, seq_len: int, hidden: int, p: float,
                  device=None) -> torch.Tensor:
    """Boolean keep-mask (B, T, h) for the dropout on a residual branch (``resid1`` or ``resid2``)."""
    return _uniform(key.base(op), samples, torch.arange(seq_len, device=device), hidden, device) >= p


def scaled(keep: torch.Tensor, p: float, dtype=torch.float32) -> torch.Tensor:
    """The multiplier a keep-mask stands for: 1 / (1 - p) where kept, 0 elsewhere, in ``dtype`` (the
    activation's, so a bf16 tensor stays bf16)."""
    return keep.to(dtype) * (1.0 / (1.0 - p))


def attention_mask(key: DropoutKey, samples: torch.Tensor, heads: range, seq_len: int, p: float,
                   device=None, dtype=torch.float32) -> torch.Tensor:
    """Scaled keep-mask (B, len(heads), T, T) for attention dropout on heads ``heads`` of the layer."""
    return scaled(attention_keep(key, samples, heads, seq_len, p, device), p, dtype)


def residual_mask(key: DropoutKey, op: str, samples: torch.Tensor, seq_len: int, hidden: int, p: float,
                  device=None, dtype=torch.float32) -> torch.Tensor:
    """Scaled keep-mask (B, T, h) for the dropout on a residual branch (``resid1`` or ``resid2``)."""
    return scaled(residual_keep(key, op, samples, seq_len, hidden, p, device), p, dtype)


class _Dropout(torch.autograd.Function):
    """x * scaled(keep): the product with the scaled mask, keeping only the boolean mask (1 byte per
    element, as baton.operators counts the masks) for backward instead of the scaled one."""

    @staticmethod
    def forward(ctx, x, keep, p):
        ctx.save_for_backward(keep)
        ctx.p = p
        return x * scaled(keep, p, x.dtype)

    @staticmethod
    def backward(ctx, grad):
        (keep,) = ctx.saved_tensors
        return grad * scaled(keep, ctx.p, grad.dtype), None, None


def dropout(x: torch.Tensor, keep: torch.Tensor, p: float) -> torch.Tensor:
    """Dropout with a given keep-mask: the same numbers as ``x * scaled(keep, p, x.dtype)``."""
    return _Dropout.apply(x, keep, p)
