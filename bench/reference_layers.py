"""Layers of published reference figures that are not a model Baton plans, priced by the derivation's own roofline.

`bench/bench_profiles.py` compares derived tables with published measurements, each derived as its code ran. Most
published figures ran a GPT- or BERT-shaped layer, which `baton.operators` describes. Transformer-XL does not: its
attention reads keys and values over the cached memory and the segment, adds a second score term for relative
positions and shifts it, so a GPT layer of the segment's length undercounts its attention (bench/results/
profiles-2026-11-26.md). Its layer is written here as the kernels NVIDIA's implementation launches
(DeepLearningExamples `PyTorch/LanguageModeling/Transformer-XL/pytorch/mem_transformer.py`,
`RelPartialLearnableDecoderLayer` with post-norm, as the published runs used; commit 729963d), each priced by
`baton.profile.kernel_passes_ms`, the function every derived operator is priced with. Nothing here is fitted.

Shape legend: q the segment's tokens per sample (`tgt_len`), k = q + memory the keys per sample, b samples, d the
width, n heads, f the feed-forward width, e bytes per element.
"""
from __future__ import annotations

from baton.catalog import GpuType
from baton.profile import kernel_passes_ms

TRANSFORMER_XL = "transformer_xl"
"""The `layer` cell of profiles/reference/layers.csv for Transformer-XL rows (`gpt`, the default, for the rest)."""


def transformer_xl_kernels(*, d: int, n: int, f: int, q: int, memory: int, b: int, e: int,
                           attention_dropout: bool) -> list[tuple[str, float, float]]:
    """The forward kernels of one relative-attention decoder layer as (kind, FLOPs, bytes moved), in launch order.
    ``kind`` picks the roofline's efficiencies, as an operator's kind does in `baton.operators`.
    ``attention_dropout``: the config's ``dropatt`` is above 0 (``nn.Dropout(0.0)`` returns its input, no kernel)."""
    k = q + memory
    tq, tk = q * b, k * b  # tokens of the segment, tokens the keys and values cover
    sc = q * k * b * n  # score elements
    kernels = [
        ("elementwise", 0, 2 * tk * d * e),                               # cat([mems, w])
        ("matmul", 2 * tk * d * 3 * d, 3 * d * d * e + 4 * tk * d * e),   # qkv_net over memory and segment
        ("matmul", 2 * k * d * d, d * d * e + 2 * k * d * e),             # r_net over the k relative positions
        ("elementwise", tq * d, 2 * tq * d * e),                          # q + r_w_bias
        # torch.einsum lays its operands out for one batched product: q + r_w_bias (i, b, n, d) and the strided
        # chunk k of qkv_net's output are copied to (b, n, ., d) first
        ("elementwise", 0, 2 * (tq + tk) * d * e),
        ("bmm", 2 * q * k * b * d, (tq + tk) * d * e + sc * e),           # AC = (q + r_w_bias) k^T
        ("elementwise", tq * d, 2 * tq * d * e),                          # q + r_r_bias
        ("elementwise", 0, 2 * (tq + k) * d * e),                         # einsum's copies of q + r_r_bias and r
        ("bmm", 2 * q * k * b * d, tq * d * e + k * d * e + sc * e),      # BD = (q + r_r_bias) r^T
        ("elementwise", 0, 2 * sc * e),                                   # _rel_shift: BD padded by a zero column
        # add_and_scale is a @torch.jit.script function, which TorchScript's fuser runs as one kernel:
        # AC and BD read, the scaled sum written
        ("elementwise", 2 * sc, 3 * sc * e),
        ("elementwise", 0, 2 * sc * e),                                   # .masked_fill_(mask)
        ("softmax", 5 * sc, 2 * sc * e),                                  # F.softmax
    ]
    if attention_dropout:
        kernels.append(("dropout", 2 * sc, 2 * sc * e + sc))              # dropatt, with its byte mask
    kernels += [
        ("elementwise", 0, 2 * tk * d * e),                               # einsum's copy of the strided chunk v
        ("bmm", 2 * q * k * b * d, sc * e + tk * d * e + tq * d * e),     # attn_prob v
        ("elementwise", 0, 2 * tq * d * e),                               # attn_vec.contiguous()
        ("matmul", 2 * tq * d * d, d * d * e + 2 * tq * d * e),           # o_net
        ("dropout", 2 * tq * d, 2 * tq * d * e + tq * d),
        ("elementwise", tq * d, 3 * tq * d * e),                          # residual
        ("norm", 5 * tq * d, 2 * tq * d * e),                             # post-norm
        ("matmul", 2 * tq * d * f, d * f * e + tq * (d + f) * e),         # CoreNet: Linear(d, f)
        ("elementwise", tq * f, 2 * tq * f * e),                          # ReLU
        ("dropout", 2 * tq * f, 2 * tq * f * e + tq * f),
        ("matmul", 2 * tq * f * d, d * f * e + tq * (d + f) * e),         # Linear(f, d)
        ("dropout", 2 * tq * d, 2 * tq * d * e + tq * d),
        ("elementwise", tq * d, 3 * tq * d * e),                          # residual
        ("norm", 5 * tq * d, 2 * tq * d * e),                             # post-norm
    ]
    return kernels


def transformer_xl_layer_ms(gpu: GpuType, *, d: int, n: int, f: int, q: int, memory: int, b: int, dtype: str, e: int,
                            tf32: bool, attention_dropout: bool, forward_only: bool = False) -> float:
    """Forward + backward (or the forward alone) of one layer: every kernel's passes as `analytic_layer_cost` prices
    an operator's (`baton.profile.kernel_passes_ms`)."""
    total = 0.0
    for kind, flops, moved in transformer_xl_kernels(d=d, n=n, f=f, q=q, memory=memory, b=b, e=e,
                                                     attention_dropout=attention_dropout):
        fwd, bwd = kernel_passes_ms(flops, moved, kind, gpu, dtype, tf32)
        total += fwd if forward_only else fwd + bwd
    return total
