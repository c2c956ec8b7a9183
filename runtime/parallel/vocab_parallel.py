"""Vocabulary-parallel embedding, LM head loss and tied-gradient sum (Megatron ``cross_entropy.py`` style).

The ranks of the first and last stage each hold rows ``rows`` of the padded vocabulary
(``runtime.parallel.slicing.vocab_range``: the rank's share of the units, uneven like the layers):

* ``vocab_embedding``: each rank looks up the tokens in its rows and writes zeros for the others; one
  all-reduce (sum, ``reduce_from_tp``) of the (B, T, C) result makes the full embedding. No
  communication in backward. It keeps the (B, T) int64 local indices, nothing else.
* ``vocab_parallel_cross_entropy``: the loss from each rank's (B, T, V_d) logits shard without ever
  gathering the full logits: three all-reduces of (B, T) fp32 (max of the row maxima, sum of the
  exp-sums, sum of the target logit). Padding rows of the vocabulary get -inf logits, so they are never
  part of the softmax. It keeps the fp32 softmax of the shard and the (B, T) int64 local targets; its
  backward is local (the all-reduce of the head's input gradient is ``copy_to_tp``'s, in the stage).
* ``sum_tied_gradient``: the embedding gradient of the first stage and the head gradient of the last,
  summed row by row over both stages' ranks, whatever their two splits.

A rank that holds the whole vocabulary (a tensor-parallel group of one, the common case) takes every token
itself: its lookup and its loss skip the masks and the index of the rows it holds, a dozen small operations per
micro-batch whose launches count where the host bounds a step of small micro-batches (bench_reference's host-bound
case, side by side: 0.80 -> 0.85 of the plain loop). The arithmetic is the same, so the numbers are too.

Shape legend: B micro-batch, T sequence, C hidden, V_d rows of the vocabulary this rank holds.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from runtime.parallel.tensor_parallel import all_reduce_max, all_reduce_sum, group_size

OUTSIDE = -1
"""Local index of a token another rank's rows hold."""


def _local_index(tokens: torch.Tensor, first_row: int, num_rows: int) -> torch.Tensor:
    """tokens - first_row where the token lies in this rank's rows, else OUTSIDE (int64)."""
    local = tokens.to(torch.int64) - first_row
    return local.masked_fill_((local < 0) | (local >= num_rows), OUTSIDE)


class _VocabEmbedding(torch.autograd.Function):
    """Rows of the embedding this rank holds; zeros for tokens outside them (another rank adds those).

    A function of its own (not ``F.embedding`` plus a mask) so that backward keeps only the int64 local
    indices, as the cost model counts: a mask would add a (B, T) tensor on every rank but one.
    """

    @staticmethod
    def forward(ctx, weight, tokens, first_row, whole):
        ctx.num_rows, ctx.whole = weight.size(0), whole
        if whole:  # every token is one of this rank's rows
            local = tokens.to(torch.int64, copy=True)  # the indices it keeps, as the masked path's
            ctx.save_for_backward(local)
            return weight.index_select(0, local.reshape(-1)).view(*tokens.shape, weight.size(1))  # (B, T, C)
        local = _local_index(tokens, first_row, weight.size(0))
        inside = local != OUTSIDE
        out = weight.new_zeros((*tokens.shape, weight.size(1)))  # (B, T, C)
        out[inside] = weight[local[inside]]
        ctx.save_for_backward(local)
        return out

    @staticmethod
    def backward(ctx, grad):
        (local,) = ctx.saved_tensors
        grad_weight = grad.new_zeros((ctx.num_rows, grad.size(-1)))
        if ctx.whole:
            grad_weight.index_add_(0, local.reshape(-1), grad.reshape(-1, grad.size(-1)))
        else:
            inside = local != OUTSIDE
            grad_weight.index_add_(0, local[inside], grad[inside])
        return grad_weight, None, None, None


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Sum over tokens of the cross-entropy, from this rank's logits shard (fp32 arithmetic)."""

    @staticmethod
    def forward(ctx, logits, targets, first_row, valid_rows, group, whole):
        # logits: (B, T, V_d) in the compute dtype; rows [valid_rows, V_d) are vocabulary padding.
        x = logits.detach().to(torch.float32, copy=True)  # becomes the softmax kept for backward
        x[..., valid_rows:] = float("-inf")
        row_max = all_reduce_max(x.amax(dim=-1), group)  # (B, T)
        x -= row_max.unsqueeze(-1)
        if whole:
            local = targets.to(torch.int64, copy=True)  # (B, T), kept like the masked path's
            target_logit = x.gather(-1, local.unsqueeze(-1)).squeeze(-1)
        else:
            local = _local_index(targets, first_row, valid_rows)  # (B, T)
            inside = local != OUTSIDE
            target_logit = torch.where(inside, x.gather(-1, local.clamp(min=0).unsqueeze(-1)).squeeze(-1), 0.0)
            target_logit = all_reduce_sum(target_logit, group)
        x.exp_()
        exp_sum = all_reduce_sum(x.sum(dim=-1), group)  # (B, T)
        x /= exp_sum.unsqueeze(-1)
        ctx.save_for_backward(x, local)
        ctx.logits_dtype, ctx.whole = logits.dtype, whole
        return (exp_sum.log() - target_logit).sum()

    @staticmethod
    def backward(ctx, grad):
        softmax, local = ctx.saved_tensors
        # d loss / d logits = softmax - one_hot(target), scaled; computed in the saved softmax's storage
        # (backward runs once), so it needs no second (B, T, V_d) fp32 buffer.
        g = softmax.view(-1, softmax.size(-1))
        if ctx.whole:
            g[torch.arange(g.size(0), device=g.device), local.reshape(-1)] -= 1.0
        else:
            rows = (local.view(-1) != OUTSIDE).nonzero().squeeze(1)
            g[rows, local.view(-1)[rows]] -= 1.0
        g.mul_(grad)
        return softmax.to(ctx.logits_dtype), None, None, None, None, None


def vocab_embedding(weight: torch.Tensor, tokens: torch.Tensor, first_row: int, *, whole: bool = False) -> torch.Tensor:
    """(B, T, C) rows ``first_row + i`` of ``weight`` for the tokens this rank holds, zeros elsewhere
    (the caller all-reduces the sum over the stage). ``whole``: ``weight`` is every row of the vocabulary, so every
    token is this rank's (``holds_every_row``)."""
    return _VocabEmbedding.apply(weight, tokens, first_row, whole)


def holds_every_row(rows: range, padded_rows: int, group) -> bool:
    """Whether a rank holding ``rows`` of the ``padded_rows`` takes every token alone: all of them, and no other
    rank of its ``group`` to sum with. A rank profiled alone may hold only some rows (a share of the units)."""
    return rows.start == 0 and rows.stop >= padded_rows and group_size(group) == 1


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, first_row: int, valid_rows: int,
                                 group, *, whole: bool = False) -> torch.Tensor:
    """Sum of the token losses (fp32 scalar, the same on every rank of ``group``) from this rank's logits
    for vocabulary rows ``first_row .. first_row + V_d``, of which the first ``valid_rows`` are real."""
    return _VocabParallelCrossEntropy.apply(logits, targets, first_row, valid_rows, group, whole)


def sum_tied_gradient(grad: torch.Tensor, rows: range, padded_rows: int, group) -> None:
    """Sum, in place, the tied embedding's gradient over the first and last stage (``group``: both
    stages' ranks, each holding ``rows`` of ``padded_rows``).

    The two stages may split the vocabulary differently, so each rank puts its rows into a zero
    (padded vocabulary, C) buffer, one all-reduce sums them (each row gets the first stage's gradient
    from one rank and the last stage's from one other), and each rank takes its rows back: an
    all-reduce of V_pad x C over both stages, as the cost model prices it.
    """
    full = grad.new_zeros((padded_rows, grad.size(-1)))
    full[rows.start:rows.stop] = grad
    dist.all_reduce(full, group=group)
    grad.copy_(full[rows.start:rows.stop])
