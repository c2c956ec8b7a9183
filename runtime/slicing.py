"""Which slice of each full parameter a rank holds, and moving tensors between the two.

A tensor-parallel rank holds heads ``heads`` and FFN columns ``ffn_cols`` of every layer, while
checkpoints, initialisation (``StageModel.load_full``) and the parity tests deal in full tensors; all of
them use this one map between a rank's local tensor and the rows or columns of the full one, so a
checkpoint written under one split loads under any other. ``where`` below is what
``parameter_slice`` returns: ``(dim, [(start, stop), ...])``, or None for a replicated parameter.
"""
from __future__ import annotations

import torch

from baton.model_spec import ModelSpec


def parameter_slice(spec: ModelSpec, name: str, heads: range, ffn_cols: range):
    """(dim, [(start, stop), ...]) of the full tensor that make up this rank's local tensor, or None
    when the parameter is replicated on every rank of the stage."""
    C, hs = spec.hidden_dim, spec.head_dim
    q0, q1 = heads.start * hs, heads.stop * hs
    if name.endswith("attn.c_attn.weight") or name.endswith("attn.c_attn.bias"):
        return 0, [(k * C + q0, k * C + q1) for k in range(3)]  # this rank's q, k and v rows
    if name.endswith("attn.c_proj.weight"):
        return 1, [(q0, q1)]
    if name.endswith("mlp.c_fc.weight") or name.endswith("mlp.c_fc.bias"):
        return 0, [(ffn_cols.start, ffn_cols.stop)]
    if name.endswith("mlp.c_proj.weight"):
        return 1, [(ffn_cols.start, ffn_cols.stop)]
    return None


def take_slice(full: torch.Tensor, where) -> torch.Tensor:
    """This rank's local tensor, cut out of the full one."""
    if where is None:
        return full
    dim, pieces = where
    return torch.cat([full.narrow(dim, a, b - a) for a, b in pieces], dim)


def put_slice(full: torch.Tensor, local: torch.Tensor, where) -> None:
    """Write this rank's local tensor back into its place in the full one (in place)."""
    if where is None:
        full.copy_(local)
        return
    dim, pieces = where
    offset = 0
    for a, b in pieces:
        full.narrow(dim, a, b - a).copy_(local.narrow(dim, offset, b - a))
        offset += b - a
