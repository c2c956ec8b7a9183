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
    if name in ("wte.weight", "lm_head.weight"):
        rows = vocab_range(spec, heads)
        return 0, [(rows.start, rows.stop)]  # may run past vocab_size: padding rows
    if name.endswith("attn.q_proj.weight"):
        return 0, [(q0, q1)]
    if name.endswith(("attn.k_proj.weight", "attn.v_proj.weight")):
        return 0, [_kv_rows(spec, heads.start, heads.stop)]
    if name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
        return 0, [(ffn_cols.start, ffn_cols.stop)]
    if name.endswith("attn.c_attn.weight") or name.endswith("attn.c_attn.bias"):
        return 0, [(k * C + q0, k * C + q1) for k in range(3)]  # this rank's q, k and v rows
    if name.endswith("attn.c_proj.weight"):
        return 1, [(q0, q1)]
    if name.endswith("mlp.c_fc.weight") or name.endswith("mlp.c_fc.bias"):
        return 0, [(ffn_cols.start, ffn_cols.stop)]
    if name.endswith("mlp.c_proj.weight"):
        return 1, [(ffn_cols.start, ffn_cols.stop)]
    return None


def _kv_rows(spec: ModelSpec, first_head: int, end_head: int) -> tuple[int, int]:
    """Rows of a Llama k or v projection serving query heads [first_head, end_head): whole KV groups."""
    group = spec.num_heads // spec.kv_heads
    return first_head // group * spec.head_dim, end_head // group * spec.head_dim


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


# --- peer-group pieces (baton.peers.Block): which regions of which tensors -------------------------------

_REPLICATED_PARAMS = ("ln_1.weight", "ln_1.bias", "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_proj.bias")
"""A layer's parameters every TP rank holds whole (LayerNorms, row-parallel biases), as a 'replicated' piece lists them."""
_LLAMA_REPLICATED_PARAMS = ("ln_1.weight", "ln_2.weight")
"""A Llama layer's: its two RMSNorm gains (no biases)."""


def _whole(total: int, fraction) -> int:
    n = fraction * total
    if n != int(n):
        raise ValueError(f"{fraction} of {total} is not a whole number")
    return int(n)


def block_slices(spec: ModelSpec, block) -> list[tuple[str, object]]:
    """The regions of full tensors that make up a piece of the parameters (``baton.peers.Block``), in a
    fixed order every holder agrees on: (parameter name, where) with ``where`` one range ``(dim, [(start,
    stop)])`` of the full tensor, or None for the whole tensor. A holder's copy of the piece is these
    regions of its local tensors (``local_region``), flattened row-major one after another.

    A 'units' piece of heads and FFN columns [lo, hi) of a layer is its q, k and v rows of ``c_attn`` (weight,
    then bias), its input columns of the attention's ``c_proj``, its rows of ``c_fc`` (weight, bias) and its
    input columns of the MLP's ``c_proj``; of a Llama layer its q rows, the rows of the KV heads those
    query heads use in k and v, its ``c_proj`` columns, its gate and up rows and its down (``c_proj``)
    columns."""
    C, hs, a, F_ = spec.hidden_dim, spec.head_dim, spec.num_heads, spec.ffn_dim
    if block.part in ("vocab", "head"):
        vp = padded_vocab(spec)
        return [("wte.weight" if block.part == "vocab" else "lm_head.weight", (0, [(_whole(vp, block.lo), _whole(vp, block.hi))]))]
    if block.part == "positions":
        return [("wpe.weight", None)]
    if block.part == "final_norm":
        return [("ln_f.weight", None)] + ([] if spec.llama else [("ln_f.bias", None)])
    p = f"h.{block.layer}."
    if block.part == "replicated":
        return [(p + n, None) for n in (_LLAMA_REPLICATED_PARAMS if spec.llama else _REPLICATED_PARAMS)]
    if block.part != "units":
        raise ValueError(f"unknown piece {block.part!r}")
    q0, q1 = _whole(a, block.lo) * hs, _whole(a, block.hi) * hs
    f0, f1 = _whole(F_, block.lo), _whole(F_, block.hi)
    if spec.llama:
        kv = _kv_rows(spec, _whole(a, block.lo), _whole(a, block.hi))
        return ([(p + "attn.q_proj.weight", (0, [(q0, q1)])), (p + "attn.k_proj.weight", (0, [kv])),
                 (p + "attn.v_proj.weight", (0, [kv])), (p + "attn.c_proj.weight", (1, [(q0, q1)])),
                 (p + "mlp.gate_proj.weight", (0, [(f0, f1)])), (p + "mlp.up_proj.weight", (0, [(f0, f1)])),
                 (p + "mlp.c_proj.weight", (1, [(f0, f1)]))])
    qkv = [(k * C + q0, k * C + q1) for k in range(3)]
    return ([(p + "attn.c_attn.weight", (0, [r])) for r in qkv] + [(p + "attn.c_attn.bias", (0, [r])) for r in qkv]
            + [(p + "attn.c_proj.weight", (1, [(q0, q1)])), (p + "mlp.c_fc.weight", (0, [(f0, f1)])),
               (p + "mlp.c_fc.bias", (0, [(f0, f1)])), (p + "mlp.c_proj.weight", (1, [(f0, f1)]))])


def local_region(local_where, piece_where):
    """Where the region ``piece_where`` of a full tensor lies in a rank's local tensor, whose own place in
    the full one is ``local_where`` (``parameter_slice``'s answer): None when it is the whole local tensor,
    else ``(dim, start, length)`` to ``narrow`` it by."""
    if piece_where == local_where:
        return None
    if piece_where is None or local_where is None:
        raise ValueError(f"a region {piece_where} of a tensor held as {local_where}")
    (dim, [(x, y)]), (local_dim, pieces) = piece_where, local_where
    if dim != local_dim:
        raise ValueError(f"a region along dim {dim} of a tensor split along dim {local_dim}")
    before = 0
    for a, b in pieces:
        if a <= x and y <= b:
            return dim, before + x - a, y - x
        before += b - a
    raise ValueError(f"rows/columns {x}..{y} are not held by this rank ({pieces})")


def region_shape(full_shape, where) -> tuple[int, ...]:
    """Shape of the region ``where`` (``parameter_slice`` format) of a tensor of ``full_shape``
    (rows past the end of the embedding included)."""
    if where is None:
        return tuple(full_shape)
    dim, pieces = where
    s = list(full_shape)
    s[dim] = sum(b - a for a, b in pieces)
    return tuple(s)
