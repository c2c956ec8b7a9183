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


def _uniform(base: int, samples: torch.Tensor, rows: torch.Tensor, cols: int, device) -> torch.Tensor:
    """U[0, 1) of shape (len(samples), len(rows), cols): rows index an outer axis (head*T + query pos, or pos)."""
    s = _fmix((samples.to(device=device, dtype=torch.int64) + base) & _M32)  # (B,)
    r = rows.to(device=device, dtype=torch.int64)
    h = _fmix((s[:, None] ^ _fmix(r + 0x68E31DA4)[None, :]) & _M32)  # (B, R)
    c = torch.arange(cols, device=device, dtype=torch.int64)
    h = _fmix((h[:, :, None] + c * 0x27D4EB2F) & _M32)  # (B, R, C)
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


def attention_mask(key: DropoutKey, samples: torch.Tensor, heads: range, seq_len: int, p: float,
                   device=None) -> torch.Tensor:
    """Scaled keep-mask (B, len(heads), T, T) for attention dropout on heads ``heads`` of the layer."""
    rows = (torch.arange(heads.start, heads.stop)[:, None] * seq_len + torch.arange(seq_len)[None, :]).reshape(-1)
    u = _uniform(key.base("attn_dropout"), samples, rows, seq_len, device)
    keep = (u >= p).to(torch.float32) * (1.0 / (1.0 - p))
    return keep.view(len(samples), len(heads), seq_len, seq_len)


def residual_mask(key: DropoutKey, op: str, samples: torch.Tensor, seq_len: int, hidden: int, p: float,
                  device=None) -> torch.Tensor:
    """Scaled keep-mask (B, T, h) for the dropout on a residual branch (``resid1`` or ``resid2``)."""
    u = _uniform(key.base(op), samples, torch.arange(seq_len), hidden, device)
    return (u >= p).to(torch.float32) * (1.0 / (1.0 - p))
