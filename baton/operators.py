"""A transformer layer as named operators, each described once: its tensors, FLOPs, parameters and traffic.

Shape legend: b micro-batch, s sequence, h hidden, a heads, f FFN width, e bytes per element, and r the
tensor-parallel share (units held / units in the layer) of the device computing the operator; for Llama's
grouped-query attention g KV heads and hk = h g / a the width of k and v.

Each ``Operator`` states which tensors it reads (``inputs``), creates (``outputs``) and keeps for its
backward pass (``saves``), and how much work it does at share 1 (``flops``, ``param_count``,
``bytes_moved``). Everything else reads these descriptions: the memory model (``baton.memory``), the
analytic tables (``baton.profile``), the cost model's FLOP count and the runtime's profiler. The lists
mirror what ``runtime/`` does, which the runtime tests check byte for byte.

Attention comes in two implementations (``ModelSpec.attention``):
  * ``eager``: scores, softmax, dropout and the product with the values as four operators, keeping the
    (b, a, s, s) score matrices for the backward pass. The scaling and the causal mask are separate passes
    over the scores (``SCORE_PASSES``), which the analytic tables price as kernels of their own;
  * ``fused``: one operator (``torch.nn.functional.scaled_dot_product_attention``, flash-style) that keeps
    q, k, v, its output and the fp32 log-sum-exp of every row (b, a, s), and recomputes the scores in its
    backward pass. It applies no dropout to the attention probabilities (the CPU and GPU flash kernels
    keep no mask; the residual dropouts stay), so it is recomputed, like any operator, as a whole.

Llama's layer (``ModelSpec.architecture == 'llama'``, fused attention only) is ``llama_operators``: RMSNorm,
q/k/v projection (k and v narrower under grouped-query attention), rotary embedding of q and k, fused
attention, output projection, residual, RMSNorm, gate and up projection, SiLU-gated product, down
projection, residual; no biases.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

from baton.model_spec import ModelSpec, unit_counts

# The two all-reduces of a Megatron layer (after the row-parallel out_proj and fc2) are not operators:
# they are never recomputed, so a recomputed consumer of their result always needs it kept.
ALLREDUCE = "allreduce"
LAYER_INPUT = "layer_input"

LSE_BYTES_PER_ROW = 4
"""The fused kernel keeps one fp32 log-sum-exp per (sample, head, query position)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Dims:
    """Sizes of one micro-batch of one layer, at share 1."""

    b: int
    """Samples in the micro-batch."""
    s: int
    """Sequence length."""
    h: int
    """Hidden width."""
    a: int
    """Attention heads."""
    f: int
    """FFN width."""
    e: int
    """Bytes per element of weights and activations."""
    g: int
    """Key/value heads (a without grouped-query attention)."""

    @property
    def tokens(self) -> int:
        return self.b * self.s

    @property
    def hk(self) -> int:
        """Width of k and of v: g heads of h / a channels."""
        return self.h * self.g // self.a


def dims(spec: ModelSpec, micro_batch: int, seq_len: int | None = None) -> Dims:
    return Dims(b=micro_batch, s=seq_len or spec.seq_len, h=spec.hidden_dim, a=spec.num_heads, f=spec.ffn_dim,
                e=spec.dtype_bytes, g=spec.kv_heads)


@dataclass(frozen=True, kw_only=True, slots=True)
class Operator:
    """One step of a transformer layer's forward pass."""

    name: str
    """Unique within the layer; plans name recomputed operators by it."""
    kind: str
    """matmul, bmm, attention, norm, softmax, dropout, elementwise: picks the efficiency of the analytic profile."""
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
    flops: Callable[[Dims], float]
    """Forward FLOPs at share 1 (TP-split operators do share * this)."""
    bytes_moved: Callable[[Dims], float]
    """Forward DRAM traffic at share 1, reads and writes, weights included."""
    param_count: Callable[[Dims], int] = lambda d: 0
    """Parameters at share 1 that a TP-split operator divides by the share (for others: all of them)."""
    replicated_param_count: Callable[[Dims], int] = lambda d: 0
    """Parameters every rank holds whole: the bias of a row-parallel matmul, added once after the all-reduce."""


SCORE_PASSES: dict[str, dict[str, tuple[int, int]]] = {
    # Baton's runtime (runtime/parallel/tp_layer.py): ``(q @ k^T) * scale`` is a second kernel over the scores
    # (forward, and one in backward: the gradient times the scale); ``softmax(scores + causal)`` adds the causal
    # bias in a kernel of its own (forward only: the sum passes its gradient on as it is). NVIDIA's BERT
    # (DeepLearningExamples: ``/ sqrt(d)``, ``+ attention_mask``, ``F.softmax``) runs the same passes.
    "scale_add_mask": {"attn_scores": (1, 1), "softmax": (1, 0)},
    # Scale, then ``masked_fill`` (Baton's single-device reference model, runtime/model/gpt.py; Megatron-LM's
    # unfused softmax path, which it takes for fp32 scores): the fill has a backward pass too (the gradient
    # with the masked entries zeroed).
    "scale_fill_mask": {"attn_scores": (1, 1), "softmax": (1, 1)},
    # Scale, mask and softmax in one kernel (Megatron-LM's FusedScaleMaskSoftmax for fp16/bf16, apex): the
    # scores are written once by the bmm and the softmax reads them once.
    "fused_softmax": {},
}
"""Separate elementwise passes that eager attention makes over its (b, a, s, s) scores besides the bmm that
writes them and the softmax kernel, as (forward, backward) passes per operator, for each way of writing it.
Each pass reads and writes the scores (``score_pass_bytes``) in a kernel of its own, so it is timed apart
from the operator's main kernel (docs/cost-model.md, section 1)."""

RUNTIME_SCORE_PASSES = "scale_add_mask"
"""What Baton's own runtime runs: the default of every derivation."""


def score_passes(op: Operator, implementation: str = RUNTIME_SCORE_PASSES) -> tuple[int, int]:
    """(forward, backward) separate passes over the scores that ``op`` makes in ``implementation``."""
    if implementation not in SCORE_PASSES:
        raise ValueError(f"unknown score-pass implementation {implementation!r}; known: {', '.join(SCORE_PASSES)}")
    return SCORE_PASSES[implementation].get(op.name, (0, 0))


def score_pass_bytes(d: Dims) -> float:
    """DRAM traffic of one elementwise pass over the (b, a, s, s) scores at share 1: read once, written once."""
    return 2 * d.b * d.a * d.s * d.s * d.e


def _attention_ops(spec: ModelSpec, op=Operator) -> list[Operator]:
    if spec.attention == "fused":
        return [op(name="attn_core", kind="attention", block="attn", tp_split=True,
                   inputs=("q", "k", "v"), outputs=("ctx",), saves=("q", "k", "v", "ctx", "attn_lse"),
                   flops=lambda d: 4 * d.b * d.s * d.s * d.h + 5 * d.b * d.a * d.s * d.s,
                   # Scores stay on chip: q, k, v read, the output written, the row statistics written.
                   bytes_moved=lambda d: 4 * d.tokens * d.h * d.e + d.b * d.a * d.s * LSE_BYTES_PER_ROW)]
    drop = spec.dropout > 0.0
    probs = "probs_dropped" if drop else "probs"
    ops = [
        op(name="attn_scores", kind="bmm", block="attn", tp_split=True,
           inputs=("q", "k"), outputs=("scores",), saves=("q", "k"),
           flops=lambda d: 2 * d.b * d.s * d.s * d.h, bytes_moved=lambda d: 2 * d.tokens * d.h * d.e + d.b * d.a * d.s * d.s * d.e),
        op(name="softmax", kind="softmax", block="attn", tp_split=True,
           inputs=("scores",), outputs=("probs",), saves=("probs",),
           flops=lambda d: 5 * d.b * d.a * d.s * d.s, bytes_moved=lambda d: 2 * d.b * d.a * d.s * d.s * d.e),
    ]
    if drop:
        ops.append(op(name="attn_dropout", kind="dropout", block="attn", tp_split=True,
                      inputs=("probs",), outputs=("probs_dropped",), saves=("attn_mask",),
                      flops=lambda d: 2 * d.b * d.a * d.s * d.s,
                      bytes_moved=lambda d: 2 * d.b * d.a * d.s * d.s * d.e + d.b * d.a * d.s * d.s))
    ops.append(op(name="attn_v", kind="bmm", block="attn", tp_split=True,
                  inputs=(probs, "v"), outputs=("ctx",), saves=(probs, "v"),
                  flops=lambda d: 2 * d.b * d.s * d.s * d.h, bytes_moved=lambda d: d.b * d.a * d.s * d.s * d.e + 2 * d.tokens * d.h * d.e))
    return ops


def _residual(name: str, block: str, branch: str, skip: str, out: str, drop: bool) -> Operator:
    """Dropout on the branch (when the model has any) and the residual add: both architectures'."""
    return Operator(name=name, kind="dropout" if drop else "elementwise", block=block, tp_split=False,
                    inputs=(branch, skip), outputs=(out,), saves=(f"{name}_mask",) if drop else (),
                    flops=lambda d: 3 * d.tokens * d.h, bytes_moved=lambda d: 3 * d.tokens * d.h * d.e + d.tokens * d.h)


RMS_STATS_BYTES_PER_ROW = 4
"""An RMSNorm keeps one fp32 reciprocal root-mean-square per token (a LayerNorm two: mean and rstd)."""


def llama_operators(spec: ModelSpec) -> tuple[Operator, ...]:
    """Llama's layer in execution order (docs/cost-model.md, section 1, "The Llama layer").

    ``rope`` rotates q and k by position (the cos/sin tables are computed once per step by the stage and
    shared by its layers, so no layer keeps them) and keeps nothing: its backward is the inverse rotation.
    ``swiglu`` keeps gate and up and recomputes the sigmoid in its backward. The RMSNorms keep their input
    and one fp32 statistic per token."""
    drop = spec.dropout > 0.0
    op = Operator
    norm_moved = lambda d: 2 * d.tokens * d.h * d.e  # noqa: E731
    return (
        op(name="rms1", kind="norm", block="attn", tp_split=False,
           inputs=(LAYER_INPUT,), outputs=("rms1_out",), saves=(LAYER_INPUT, "rms1_stats"),
           flops=lambda d: 4 * d.tokens * d.h, bytes_moved=norm_moved, param_count=lambda d: d.h),
        op(name="qkv", kind="matmul", block="attn", tp_split=True,
           inputs=("rms1_out",), outputs=("q", "k", "v"), saves=("rms1_out",),
           flops=lambda d: 2 * d.tokens * d.h * (d.h + 2 * d.hk),
           bytes_moved=lambda d: d.h * (d.h + 2 * d.hk) * d.e + d.tokens * (2 * d.h + 2 * d.hk) * d.e,
           param_count=lambda d: d.h * (d.h + 2 * d.hk)),
        op(name="rope", kind="elementwise", block="attn", tp_split=True,
           inputs=("q", "k"), outputs=("q_rot", "k_rot"), saves=(),
           flops=lambda d: 3 * d.tokens * (d.h + d.hk),
           bytes_moved=lambda d: 2 * d.tokens * (d.h + d.hk) * d.e + 2 * d.s * (d.h // d.a) * d.e),
        op(name="attn_core", kind="attention", block="attn", tp_split=True,
           inputs=("q_rot", "k_rot", "v"), outputs=("ctx",), saves=("q_rot", "k_rot", "v", "ctx", "attn_lse"),
           flops=lambda d: 4 * d.b * d.s * d.s * d.h + 5 * d.b * d.a * d.s * d.s,
           bytes_moved=lambda d: (2 * d.tokens * d.h + 2 * d.tokens * d.hk) * d.e + d.b * d.a * d.s * LSE_BYTES_PER_ROW),
        op(name="out_proj", kind="matmul", block="attn", tp_split=True,
           inputs=("ctx",), outputs=("attn_partial",), saves=("ctx",),
           flops=lambda d: 2 * d.tokens * d.h * d.h, bytes_moved=lambda d: d.h * d.h * d.e + 2 * d.tokens * d.h * d.e,
           param_count=lambda d: d.h * d.h),
        _residual("resid1", "attn", "attn_out", LAYER_INPUT, "x_mid", drop),
        op(name="rms2", kind="norm", block="mlp", tp_split=False,
           inputs=("x_mid",), outputs=("rms2_out",), saves=("x_mid", "rms2_stats"),
           flops=lambda d: 4 * d.tokens * d.h, bytes_moved=norm_moved, param_count=lambda d: d.h),
        op(name="gate_up", kind="matmul", block="mlp", tp_split=True,
           inputs=("rms2_out",), outputs=("gate", "up"), saves=("rms2_out",),
           flops=lambda d: 4 * d.tokens * d.h * d.f,
           bytes_moved=lambda d: 2 * d.h * d.f * d.e + d.tokens * d.h * d.e + 2 * d.tokens * d.f * d.e,
           param_count=lambda d: 2 * d.h * d.f),
        op(name="swiglu", kind="elementwise", block="mlp", tp_split=True,
           inputs=("gate", "up"), outputs=("swiglu_out",), saves=("gate", "up"),
           flops=lambda d: 6 * d.tokens * d.f, bytes_moved=lambda d: 3 * d.tokens * d.f * d.e),
        op(name="down", kind="matmul", block="mlp", tp_split=True,
           inputs=("swiglu_out",), outputs=("mlp_partial",), saves=("swiglu_out",),
           flops=lambda d: 2 * d.tokens * d.f * d.h, bytes_moved=lambda d: d.f * d.h * d.e + d.tokens * d.h * d.e + d.tokens * d.f * d.e,
           param_count=lambda d: d.f * d.h),
        _residual("resid2", "mlp", "mlp_out", "x_mid", "layer_output", drop),
    )


@functools.lru_cache(maxsize=64)
def layer_operators(spec: ModelSpec) -> tuple[Operator, ...]:
    """The forward pass of one layer, in execution order (cached: the evaluator asks for it on every plan,
    and an exhaustive search prices hundreds of thousands)."""
    if spec.llama:
        return llama_operators(spec)
    drop = spec.dropout > 0.0
    op = Operator
    ops = [
        op(name="ln1", kind="norm", block="attn", tp_split=False,
           inputs=(LAYER_INPUT,), outputs=("ln1_out",), saves=(LAYER_INPUT, "ln1_stats"),
           flops=lambda d: 5 * d.tokens * d.h, bytes_moved=lambda d: 2 * d.tokens * d.h * d.e, param_count=lambda d: 2 * d.h),
        op(name="qkv", kind="matmul", block="attn", tp_split=True,
           inputs=("ln1_out",), outputs=("q", "k", "v"), saves=("ln1_out",),
           flops=lambda d: 2 * d.tokens * d.h * 3 * d.h, bytes_moved=lambda d: 3 * d.h * d.h * d.e + 4 * d.tokens * d.h * d.e,
           param_count=lambda d: 3 * d.h * d.h + 3 * d.h),
        *_attention_ops(spec),
        op(name="out_proj", kind="matmul", block="attn", tp_split=True,
           inputs=("ctx",), outputs=("attn_partial",), saves=("ctx",),
           flops=lambda d: 2 * d.tokens * d.h * d.h, bytes_moved=lambda d: d.h * d.h * d.e + 2 * d.tokens * d.h * d.e,
           param_count=lambda d: d.h * d.h, replicated_param_count=lambda d: d.h),
        _residual("resid1", "attn", "attn_out", LAYER_INPUT, "x_mid", drop),
        op(name="ln2", kind="norm", block="mlp", tp_split=False,
           inputs=("x_mid",), outputs=("ln2_out",), saves=("x_mid", "ln2_stats"),
           flops=lambda d: 5 * d.tokens * d.h, bytes_moved=lambda d: 2 * d.tokens * d.h * d.e, param_count=lambda d: 2 * d.h),
        op(name="fc1", kind="matmul", block="mlp", tp_split=True,
           inputs=("ln2_out",), outputs=("fc1_out",), saves=("ln2_out",),
           flops=lambda d: 2 * d.tokens * d.h * d.f, bytes_moved=lambda d: d.h * d.f * d.e + d.tokens * d.h * d.e + d.tokens * d.f * d.e,
           param_count=lambda d: d.h * d.f + d.f),
        op(name="gelu", kind="elementwise", block="mlp", tp_split=True,
           inputs=("fc1_out",), outputs=("gelu_out",), saves=("fc1_out",),
           flops=lambda d: 8 * d.tokens * d.f, bytes_moved=lambda d: 2 * d.tokens * d.f * d.e),
        op(name="fc2", kind="matmul", block="mlp", tp_split=True,
           inputs=("gelu_out",), outputs=("mlp_partial",), saves=("gelu_out",),
           flops=lambda d: 2 * d.tokens * d.f * d.h, bytes_moved=lambda d: d.f * d.h * d.e + d.tokens * d.h * d.e + d.tokens * d.f * d.e,
           param_count=lambda d: d.f * d.h, replicated_param_count=lambda d: d.h),
        _residual("resid2", "mlp", "mlp_out", "x_mid", "layer_output", drop),
    ]
    return tuple(ops)


def table_operators(spec: ModelSpec) -> tuple[Operator, ...]:
    """Every operator a derived table carries for ``spec``: both attention implementations, so one table
    serves a model whichever it uses (a measured table holds what was measured)."""
    from dataclasses import replace

    seen, out = set(), []
    for attention in (("fused",) if spec.llama else ("eager", "fused")):
        for o in layer_operators(replace(spec, attention=attention)):
            if o.name not in seen:
                seen.add(o.name)
                out.append(o)
    return tuple(out)


# The all-reduce after each row-parallel matmul turns the partial sum into the full tensor.
ALLREDUCE_OUTPUTS = {"attn_partial": "attn_out", "mlp_partial": "mlp_out"}


def operator_names(spec: ModelSpec) -> list[str]:
    return list(_operator_names(spec))


@functools.lru_cache(maxsize=64)
def _operator_names(spec: ModelSpec) -> tuple[str, ...]:
    return tuple(o.name for o in layer_operators(spec))


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


def tensor_sizes(spec: ModelSpec, micro_batch: int, seq_len: int | None = None) -> dict[str, TensorSize]:
    """Analytic sizes of every tensor of one layer for one micro-batch."""
    d = dims(spec, micro_batch, seq_len)
    b, s, h, a, f, e = d.b, d.s, d.h, d.a, d.f, d.e
    bsh = b * s * h * e
    bskv = b * s * d.hk * e
    bass = b * a * s * s * e
    t = TensorSize
    sizes = [
        t(name=LAYER_INPUT, bytes_at_full_share=bsh, tp_split=False),
        t(name="ln1_out", bytes_at_full_share=bsh, tp_split=False),
        t(name="ln1_stats", bytes_at_full_share=b * s * 2 * 4, tp_split=False),
        t(name="q", bytes_at_full_share=bsh, tp_split=True),
        t(name="k", bytes_at_full_share=bskv, tp_split=True),
        t(name="v", bytes_at_full_share=bskv, tp_split=True),
        t(name="scores", bytes_at_full_share=bass, tp_split=True),
        t(name="probs", bytes_at_full_share=bass, tp_split=True),
        t(name="attn_mask", bytes_at_full_share=b * a * s * s, tp_split=True),
        t(name="probs_dropped", bytes_at_full_share=bass, tp_split=True),
        t(name="attn_lse", bytes_at_full_share=b * a * s * LSE_BYTES_PER_ROW, tp_split=True),
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
        # Llama's own tensors.
        t(name="rms1_out", bytes_at_full_share=bsh, tp_split=False),
        t(name="rms1_stats", bytes_at_full_share=b * s * RMS_STATS_BYTES_PER_ROW, tp_split=False),
        t(name="q_rot", bytes_at_full_share=bsh, tp_split=True),
        t(name="k_rot", bytes_at_full_share=bskv, tp_split=True),
        t(name="rms2_out", bytes_at_full_share=bsh, tp_split=False),
        t(name="rms2_stats", bytes_at_full_share=b * s * RMS_STATS_BYTES_PER_ROW, tp_split=False),
        t(name="gate", bytes_at_full_share=b * s * f * e, tp_split=True),
        t(name="up", bytes_at_full_share=b * s * f * e, tp_split=True),
        t(name="swiglu_out", bytes_at_full_share=b * s * f * e, tp_split=True),
    ]
    return {x.name: x for x in sizes}


def operator_flops(spec: ModelSpec, op: Operator, micro_batch: int, seq_len: int | None = None) -> float:
    """Forward FLOPs of one operator at share 1 (multiply by the share for TP-split operators)."""
    return op.flops(dims(spec, micro_batch, seq_len))


def operator_bytes_moved(spec: ModelSpec, op: Operator, micro_batch: int, seq_len: int | None = None) -> float:
    """Forward DRAM traffic of one operator at share 1."""
    return op.bytes_moved(dims(spec, micro_batch, seq_len))


def operator_param_count(spec: ModelSpec, op: Operator) -> int:
    """Parameters of one operator at share 1 (the whole operator)."""
    d = dims(spec, 1)
    return op.param_count(d) + op.replicated_param_count(d)


def operator_param_bytes(spec: ModelSpec, op: Operator, share: float) -> float:
    """Parameter bytes a rank at ``share`` holds of one operator: the split part times the share (all of it
    for an operator that is not split) and the replicated part whole."""
    d = dims(spec, 1)
    r = share if op.tp_split else 1.0
    return (op.param_count(d) * r + op.replicated_param_count(d)) * spec.dtype_bytes


# Operators that belong to one stage only: the token+position embedding on the first stage and the
# final LayerNorm, tied LM head and cross-entropy on the last.
EMBEDDING = "embedding"
HEAD = "head"
EDGE_OPERATORS = (EMBEDDING, HEAD)


def vocab_split_granularity(spec: ModelSpec) -> int:
    """The least common multiple of every partition granularity U the model allows (divisors of both the
    head count and the FFN width): a vocabulary padded to a multiple of it splits into u/U shares of
    whole rows for every (U, u) a plan can choose."""
    lcm = 1
    for u in unit_counts(spec):
        lcm = lcm * u // math.gcd(lcm, u)
    return lcm


@functools.lru_cache(maxsize=256)
def padded_vocab(spec: ModelSpec) -> int:
    """Rows of the embedding and LM head as the runtime holds them: the vocabulary rounded up to a multiple
    of ``vocab_split_granularity``. The extra rows are never looked up and their logits are masked out of
    the loss, so they change no number of the model; they make every rank's vocabulary share exact."""
    g = vocab_split_granularity(spec)
    return -(-spec.vocab_size // g) * g


def vocab_rows(spec: ModelSpec, units_before: int, units: int, units_per_layer: int) -> range:
    """The rows of the padded vocabulary a rank holds: share units / units_per_layer, after the ranks
    holding ``units_before`` units."""
    per_unit = padded_vocab(spec) // units_per_layer
    return range(units_before * per_unit, (units_before + units) * per_unit)
