"""Which slice of each full parameter a rank holds, and moving tensors between the two.

A tensor-parallel rank holds heads ``heads`` and FFN columns ``ffn_cols`` of every layer, and on the first
and last stage the rows of the (padded) vocabulary in the same proportion (``vocab_range``), while
checkpoints, initialisation (``StageModel.load_full``) and the parity tests deal in full tensors; all of
them use this one map between a rank's local tensor and the rows or columns of the full one, so a
checkpoint written under one split loads under any other. ``where`` below is what
``parameter_slice`` returns: ``(dim, [(start, stop), ...])``, or None for a replicated parameter.

The embedding is the one tensor whose local rows can lie past the end of the full one: the runtime pads
the vocabulary to ``baton.operators.padded_vocab`` rows so every share is a whole number of rows, and
full tensors (checkpoints, a Hugging Face import) keep the true ``vocab_size`` rows. ``take_slice`` fills
rows past the end with zeros and ``put_slice`` drops them.
"""
from __future__ import annotations

import torch

from baton.model_spec import ModelSpec
from baton.operators import padded_vocab


def vocab_range(spec: ModelSpec, heads: range) -> range:
    """Rows of the padded vocabulary held by the rank that holds ``heads`` of its stage's layers.

    The vocabulary is split in the proportion of the units, like the layers: a rank with ``u`` of ``U``
    units after ``u0`` units of its peers holds ``baton.operators.vocab_rows(spec, u0, u, U)``. Those
    units are ``heads / (num_heads / U)``, so the rows follow from the heads alone (exact integers,
    since ``U`` divides the padded vocabulary).
    """
    vp, a = padded_vocab(spec), spec.num_heads
    return range(vp * heads.start // a, vp * heads.stop // a)


def parameter_slice(spec: ModelSpec, name: str, heads: range, ffn_cols: range):
    """(dim, [(start, stop), ...]) of the full tensor that make up this rank's local tensor, or None
    when the parameter is replicated on every rank of the stage."""
    C, hs = spec.hidden_dim, spec.head_dim
    q0, q1 = heads.start * hs, heads.stop * hs
    if name == "wte.weight":
        rows = vocab_range(spec, heads)
        return 0, [(rows.start, rows.stop)]  # may run past vocab_size: padding rows
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
    """This rank's local tensor, cut out of the full one (zeros for rows past its end)."""
    if where is None:
        return full
    dim, pieces = where
    parts = []
    for a, b in pieces:
        stop = max(min(b, full.size(dim)), a)
        if stop > a:
            parts.append(full.narrow(dim, a, stop - a))
        if b > stop:
            shape = list(full.shape)
            shape[dim] = b - stop
            parts.append(full.new_zeros(shape))
    return torch.cat(parts, dim)


def put_slice(full: torch.Tensor, local: torch.Tensor, where) -> None:
    """Write this rank's local tensor back into its place in the full one (in place; rows past the
    full tensor's end are dropped)."""
    if where is None:
        full.copy_(local)
        return
    dim, pieces = where
    offset = 0
    for a, b in pieces:
        n = min(b, full.size(dim)) - a
        if n > 0:
            full.narrow(dim, a, n).copy_(local.narrow(dim, offset, n))
        offset += b - a
