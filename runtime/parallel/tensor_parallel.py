"""Non-uniform tensor-parallel communication (Megatron ``mappings.py`` style, explicit split sizes).

Column-parallel -> row-parallel needs only full-size all-reduces, so the layer itself uses just the dual
pair ``copy_to_tp`` (identity forward, all-reduce backward) and ``reduce_from_tp`` (all-reduce forward,
identity backward); the vocabulary-parallel embedding and cross-entropy use the same pair plus two
forward-only all-reduces (``all_reduce_max``, ``all_reduce_sum``). ``gather_uneven`` assembles shards of
different sizes; gloo has no uneven all_gather, so there shards are padded to the largest one.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist


class AllReduceClock:
    """Wall time this process spent in tensor-parallel all-reduces, waits for slower peers included.

    Meaningful for synchronous backends (gloo); on NCCL the call returns before the GPU has run it.
    """

    seconds: float = 0.0
    calls: int = 0
    spans: list | None = None
    """When a list (``--trace``): every all-reduce's (start, end) perf_counter seconds."""

    @classmethod
    def reset(cls) -> None:
        cls.seconds, cls.calls = 0.0, 0


def _world(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_size(group) -> int:
    """Ranks of a tensor-parallel group (None: this rank alone)."""
    return _world(group)


def _reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """All-reduce (sum, or ``op``) across the group; bypassed for one rank."""
    if _world(group) == 1:
        return x
    x = x.contiguous()
    t0 = time.perf_counter()
    dist.all_reduce(x, op=op, group=group)
    t1 = time.perf_counter()
    AllReduceClock.seconds += t1 - t0
    if AllReduceClock.spans is not None:
        AllReduceClock.spans.append((t0, t1))
    AllReduceClock.calls += 1
    return x


def _gather_uneven(x: torch.Tensor, sizes: list[int], dim: int, group) -> torch.Tensor:
    """Concatenate every rank's shard along ``dim``; shard i has ``sizes[i]`` rows there."""
    if _world(group) == 1:
        return x
    assert x.size(dim) == sizes[dist.get_rank(group)], "shard size does not match its split size"
    x = x.movedim(dim, 0).contiguous()
    if dist.get_backend(group) == "nccl":
        parts = [x.new_empty((n, *x.shape[1:])) for n in sizes]
        dist.all_gather(parts, x, group=group)
    else:  # gloo: pad to the largest shard, gather equal sizes, slice the padding off
        top = max(sizes)
        padded = x.new_zeros((top, *x.shape[1:]))
        padded[: x.size(0)] = x
        out = x.new_empty((len(sizes) * top, *x.shape[1:]))
        dist.all_gather_into_tensor(out, padded, group=group)
        parts = [out[i * top: i * top + n] for i, n in enumerate(sizes)]
    return torch.cat(parts, 0).movedim(0, dim)


class _CopyToTP(torch.autograd.Function):
    """Identity forward, all-reduce backward: the input of a column-parallel linear."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _reduce(grad.clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward, identity backward: the output of a row-parallel linear."""

    @staticmethod
    def forward(ctx, x, group):
        return _reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if _world(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if _world(group) == 1 else _ReduceFromTP.apply(x, group)


def all_reduce_max(x: torch.Tensor, group) -> torch.Tensor:
    """Forward-only all-reduce (max), e.g. the row maxima of a vocabulary-parallel softmax."""
    return _reduce(x, group, dist.ReduceOp.MAX)


def all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    """Forward-only all-reduce (sum), outside autograd (inside a custom autograd function)."""
    return _reduce(x, group)


def gather_uneven(x: torch.Tensor, sizes: list[int], dim: int, group) -> torch.Tensor:
    """Forward-only uneven all-gather (checkpointing, tests)."""
    return _gather_uneven(x, sizes, dim, group)
