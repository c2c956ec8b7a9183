"""A transformer layer as named operators and the tensors that flow between them.

Shape legend: b micro-batch, s sequence, h hidden, a heads, f FFN width, r the tensor-parallel share
(units held / units in the layer) of the device computing the operator, e bytes per element.

Each operator states which tensors it reads (``inputs``), creates (``outputs``) and keeps for its
backward pass (``saves``). The memory model in ``baton.memory`` decides from these lists which tensors
stay alive when some operators are recomputed, so the lists mirror what ``runtime/model.py`` does.
"""
from __future__ import annotations

from dataclasses import dataclass

from baton.model_spec import ModelSpec

# The two all-reduces of a Megatron layer (after the row-parallel out_proj and fc2) are not operators:
# they are never recomputed, so a recomputed consumer of their result always needs it kept.
ALLREDUCE = "allreduce"
LAYER_INPUT = "layer_input"


@dataclass(frozen=True, kw_only=True, slots=True)
class Operator:
    """One step of a transformer layer's forward pass."""

    name: str
    """Unique within the layer; plans name recomputed operators by it."""
    kind: str
    """matmul, bmm, norm, softmax, dropout, elementwise: picks the efficiency of the analytic profile."""
    block: str
    """'attn' or 'mlp': the stretch between two all-reduces, where a TP group waits for its slowest rank."""
    tp_split: bool
    """True when the operator's work is divided by tensor-parallel units (weights or heads)."""
    inputs: tuple[str, ...]
    """Tensors read."""
    outputs: tuple[str, ...]
    """Tensors created."""
    saves: tuple[str, ...]
    """Tensors its backward needs (inputs, own outputs, or private ones such as masks)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorSize:
    """Analytic byte size of one activation tensor of a layer."""

    name: str
    """Tensor name as used in Operator lists."""
    bytes_at_full_share: float
    """Bytes when the producing device holds all units (share 1)."""
    tp_split: bool
    """True when the tensor shrinks with the device's share."""

    def bytes(self, share: float) -> float:
        return self.bytes_at_full_share * (share if self.tp_split else 1.0)


def layer_operators(spec: ModelSpec) -> tuple[Operator, ...]:
    """The forward pass of one layer, in execution order."""
    drop = spec.dropout > 0.0
    op = Operator
    attn_probs = "probs_dropped" if drop else "probs"
    ops = [
        op(name="ln1", kind="norm", block="attn", tp_split=False,
           inputs=(LAYER_INPUT,), outputs=("ln1_out",), saves=(LAYER_INPUT, "ln1_stats")),
        op(name="qkv", kind="matmul", block="attn", tp_split=True,
           inputs=("ln1_out",), outputs=("q", "k", "v"), saves=("ln1_out",)),
        op(name="attn_scores", kind="bmm", block="attn", tp_split=True,
           inputs=("q", "k"), outputs=("scores",), saves=("q", "k")),
        op(name="softmax", kind="softmax", block="attn", tp_split=True,
           inputs=("scores",), outputs=("probs",), saves=("probs",)),
    ]
    if drop:
        ops.append(op(name="attn_dropout", kind="dropout", block="attn", tp_split=True,
                      inputs=("probs",), outputs=("probs_dropped",), saves=("attn_mask",)))
    ops += [
        op(name="attn_v", kind="bmm", block="attn", tp_split=True,
           inputs=(attn_probs, "v"), outputs=("ctx",), saves=(attn_probs, "v")),
        op(name="out_proj", kind="matmul", block="attn", tp_split=True,
           inputs=("ctx",), outputs=("attn_partial",), saves=("ctx",)),
        op(name="resid1", kind="dropout" if drop else "elementwise", block="attn", tp_split=False,
           inputs=("attn_out", LAYER_INPUT), outputs=("x_mid",), saves=("resid1_mask",) if drop else ()),
        op(name="ln2", kind="norm", block="mlp", tp_split=False,
           inputs=("x_mid",), outputs=("ln2_out",), saves=("x_mid", "ln2_stats")),
        op(name="fc1", kind="matmul", block="mlp", tp_split=True,
           inputs=("ln2_out",), outputs=("fc1_out",), saves=("ln2_out",)),
        op(name="gelu", kind="elementwise", block="mlp", tp_split=True,
           inputs=("fc1_out",), outputs=("gelu_out",), saves=("fc1_out",)),
        op(name="fc2", kind="matmul", block="mlp", tp_split=True,
           inputs=("gelu_out",), outputs=("mlp_partial",), saves=("gelu_out",)),
        op(name="resid2", kind="dropout" if drop else "elementwise", block="mlp", tp_split=False,
           inputs=("mlp_out", "x_mid"), outputs=("layer_output",), saves=("resid2_mask",) if drop else ()),
    ]
    return tuple(ops)


# The all-reduce after each row-parallel matmul turns the partial sum into the full tensor.
ALLREDUCE_OUTPUTS = {"attn_partial": "attn_out", "mlp_partial": "mlp_out"}


def operator_names(spec: ModelSpec) -> list[str]:
    return [o.name for o in layer_operators(spec)]


def tensor_sizes(spec: ModelSpec, micro_batch: int, seq_len: int | None = None) -> dict[str, TensorSize]:
    """Analytic sizes of every tensor of one layer for one micro-batch."""
    b, s = micro_batch, seq_len or spec.seq_len
    h, a, f, e = spec.hidden_dim, spec.num_heads, spec.ffn_dim, spec.dtype_bytes
    bsh = b * s * h * e
    bass = b * a * s * s * e
    t = TensorSize
    sizes = [
        t(name=LAYER_INPUT, bytes_at_full_share=bsh, tp_split=False),
        t(name="ln1_out", bytes_at_full_share=bsh, tp_split=False),
        t(name="ln1_stats", bytes_at_full_share=b * s * 2 * 4, tp_split=False),
        t(name="q", bytes_at_full_share=bsh, tp_split=True),
        t(name="k", bytes_at_full_share=bsh, tp_split=True),
        t(name="v", bytes_at_full_share=bsh, tp_split=True),
        t(name="scores", bytes_at_full_share=bass, tp_split=True),
        t(name="probs", bytes_at_full_share=bass, tp_split=True),
        t(name="attn_mask", bytes_at_full_share=b * a * s * s, tp_split=True),
        t(name="probs_dropped", bytes_at_full_share=bass, tp_split=True),
        t(name="ctx", bytes_at_full_share=bsh, tp_split=True),
        t(name="attn_partial", bytes_at_full_share=bsh, tp_split=False),
        t(name="attn_out", bytes_at_full_share=bsh, tp_split=False),
        t(name="resid1_mask", bytes_at_full_share=b * s * h, tp_split=False),
        t(name="x_mid", bytes_at_full_share=bsh, tp_split=False),
        t(name="ln2_out", bytes_at_full_share=bsh, tp_split=False),
        t(name="ln2_stats", bytes_at_full_share=b * s * 2 * 4, tp_split=False),
        t(name="fc1_out", bytes_at_full_share=b * s * f * e, tp_split=True),
        t(name="gelu_out", bytes_at_full_share=b * s * f * e, tp_split=True),
        t(name="mlp_partial", bytes_at_full_share=bsh, tp_split=False),
        t(name="mlp_out", bytes_at_full_share=bsh, tp_split=False),
        t(name="resid2_mask", bytes_at_full_share=b * s * h, tp_split=False),
        t(name="layer_output", bytes_at_full_share=bsh, tp_split=False),
    ]
    return {x.name: x for x in sizes}


def operator_flops(spec: ModelSpec, op: Operator, micro_batch: int, seq_len: int | None = None) -> float:
    """Forward FLOPs of one operator at share 1 (multiply by the share for TP-split operators)."""
    b, s = micro_batch, seq_len or spec.seq_len
    h, a, f = spec.hidden_dim, spec.num_heads, spec.ffn_dim
    tokens = b * s
    return {
        "ln1": 5 * tokens * h,
        "qkv": 2 * tokens * h * 3 * h,
        "attn_scores": 2 * b * s * s * h,
        "softmax": 5 * b * a * s * s,
        "attn_dropout": 2 * b * a * s * s,
        "attn_v": 2 * b * s * s * h,
        "out_proj": 2 * tokens * h * h,
        "resid1": 3 * tokens * h,
        "ln2": 5 * tokens * h,
        "fc1": 2 * tokens * h * f,
        "gelu": 8 * tokens * f,
        "fc2": 2 * tokens * f * h,
        "resid2": 3 * tokens * h,
    }[op.name]


def operator_param_count(spec: ModelSpec, op: Operator) -> int:
    """Parameters of one operator at share 1 (TP-split operators hold share * this)."""
    h, f = spec.hidden_dim, spec.ffn_dim
    return {"ln1": 2 * h, "ln2": 2 * h, "qkv": 3 * h * h + 3 * h, "out_proj": h * h + h,
            "fc1": h * f + f, "fc2": f * h + h}.get(op.name, 0)


# Operators that belong to one stage only: the token+position embedding on the first stage and the
# final LayerNorm, tied LM head and cross-entropy on the last.
EMBEDDING = "embedding"
HEAD = "head"
EDGE_OPERATORS = (EMBEDDING, HEAD)
