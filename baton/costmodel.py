"""The cost model as pure functions: every equation of docs/cost-model.md, in the same order.

This module is the only place a number of the model is computed. The evaluator (``baton.evaluate``),
the MILP instance, the cheap bounds, the least-memory plan and the baselines (``solver/``) all read
these functions; none of them prices a layer, a stage, a transfer or a byte of memory by itself.

Two levels:
  * the layer: ``layer_prices`` gives eq. 2-4 (with the host's launch time, eq. 2h) for one device type,
    micro-batch and share over a whole ``RecomputeSpace`` at once (the planner's view); ``layer_cost`` is
    the same numbers for one set (the evaluator's view), taken from a one-set space, so the two cannot
    drift apart;
  * the position in a skeleton: ``device_slot`` (what a device's place adds: embedding/head, in-flight
    micro-batches, capacity), ``device_memory`` (eq. 7-8, element-wise so it also runs over arrays of
    recompute sets), ``stage_constants`` (eq. 5, 9 terms fixed by the group), ``pipeline_transfers``
    (eq. 6), ``embedding_sync_ms`` and ``allreduce_ms`` (eq. 11), ``optimizer_step_ms`` (eq. 10) and
    ``layer_limits``; a pipeline's schedule (``baton.schedules``) read as stage times and activations:
    ``group_passes``, ``interleaved_timing`` and ``scheduled_activation_bytes`` (docs/schedules.md, eq. 6i, 8i, 9i);
  * data parallelism: ``group_sync_ms``, ``sync_buffer_bytes`` and ``data_parallel_sync_ms`` over peer
    groups (eq. 13-15), and for sharded gradients and weights run layer by layer ``unit_pass_ms``,
    ``layered_parts`` and ``layered_iteration_ms`` (eq. 16, 17; their memory is ``device_memory``'s, eq. 18).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from baton.cluster import ClusterSpec, Link
from baton.memory import RecomputeSpace, choice_space, recompute_space, tensor_blocks, tensor_bytes
from baton.model_spec import ModelSpec
from baton.operators import ALLREDUCE_OUTPUTS, EMBEDDING, HEAD, layer_operators, operator_flops, padded_vocab
from baton.peers import (EDGES, final_norm_param_count, held_params, owned_fractions, owned_params, peer_groups,
                         position_param_count, replicated_param_count, split_param_count, unit_groups, whole_groups)
from baton.profile import OpCost, Profile, ProfileSet
from baton.pipeline import PipelineTiming
from baton.schedules import (Backward, Forward, Gather, OptimizerStep, ReduceScatter, Schedule, device_live_counts,
                             layer_by_layer, live_counts, one_f_one_b_order, peak_in_flight)
from baton.waits import last_arrival_ms

BLOCKS = ("attn", "mlp")
ALLREDUCES_PER_LAYER = 2
"""All-reduces per layer in each direction: after out_proj and fc2 forward, at qkv and fc1 inputs backward."""

ADAM_STATE_BYTES_PER_PARAM = 8
"""Two fp32 Adam moments."""
MASTER_WEIGHT_BYTES_PER_PARAM = 4
"""fp32 master copy kept when training in fp16/bf16 (none for fp32 training)."""
OPTIMIZER_TRAFFIC_BYTES_PER_PARAM = 36
"""DRAM bytes one Adam step moves per parameter (read grad, weight, master, two moments; write back)."""


# -- the layer (eq. 2-4) -----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerPrices:
    """One device type's per-layer, per-micro-batch costs at one share, for every row (recompute set and what it
    offloads) of a RecomputeSpace."""

    fwd_ms: tuple[float, float]
    """Forward ms per block (attn, mlp): the larger of device and host time; the recompute set does not change it (eq. 2h)."""
    bwd_ms: tuple[float, float]
    """Backward ms per block without recomputation, the larger of device and host time (eq. 2h)."""
    rec_attn_ms: np.ndarray
    """What recomputing the set adds to the attn block's backward, per set (eq. 2h): the forward ms of its recomputed
    operators where the table has no host times (eq. 2)."""
    rec_mlp_ms: np.ndarray
    """The same for the mlp block."""
    held_bytes: np.ndarray
    """Activation bytes kept in device memory per in-flight micro-batch, per row (eq. 3, 3o)."""
    transient_bytes: np.ndarray
    """Bytes re-created while the layer runs its backward, and the offloaded bytes of it and the layer fetched
    ahead, per row (eq. 4, 4o)."""
    param_bytes: float
    """Parameter bytes of the layer at this share."""
    host_bytes: np.ndarray
    """Activation bytes kept in host memory per in-flight micro-batch, per row (eq. 3o; 0 without offload)."""
    offload_fwd_ms: np.ndarray
    """(rows, 2): what each block's copies to the host add to its forward (eq. 2o); infinite for a row that
    offloads on a device without a host link rate."""
    offload_bwd_ms: np.ndarray
    """(rows, 2): what each block's copies back add to its backward (eq. 2o)."""

    def block_fwd_ms(self) -> np.ndarray:
        """(rows, 2): forward per block and row, as eq. 9 takes the max over a group."""
        return np.asarray(self.fwd_ms)[None, :] + self.offload_fwd_ms

    def block_bwd_ms(self) -> np.ndarray:
        """(rows, 2): backward plus recomputation plus exposed copies per block and row."""
        return (np.asarray(self.bwd_ms)[None, :] + np.stack([self.rec_attn_ms, self.rec_mlp_ms], axis=1)
                + self.offload_bwd_ms)


@functools.lru_cache(maxsize=8192)
def layer_prices(profile: Profile, spec: ModelSpec, micro_batch: int, share: float, space: RecomputeSpace,
                 host_link_gb_per_s: float = 0.0) -> LayerPrices:
    """Eq. 2 (block times), eq. 3 (held activations) and eq. 4 (recompute buffer) over ``space``, with its rows'
    offloaded tensors over a host link of ``host_link_gb_per_s`` (eq. 2o-4o).

    A TP-split operator is looked up at ``share``, a replicated one at share 1. Memoised and shared
    between callers: the arrays must not be modified.
    """
    ops = layer_operators(spec)
    costs = _op_costs(profile, spec, micro_batch, share)
    sizes = layer_tensor_bytes(profile, spec, micro_batch, share)
    sz = np.array([sizes[t] for t in space.tensors])
    attn = np.array([b == "attn" for b in space.blocks])

    def block_sums(column: str) -> tuple[tuple[float, float], np.ndarray, np.ndarray]:
        """(per block sum over the layer's operators, per set sum over the recomputed ones of attn, of mlp)."""
        per_op = np.array([getattr(costs[o], column) for o in space.ops])
        # Row sums rather than matrix products: a row's sum is then the same whichever rows share the
        # array, so one set priced alone (the evaluator) equals its row in the whole space (the planner).
        return (tuple(sum(getattr(costs[o.name], column) for o in ops if o.block == b) for b in BLOCKS),
                (space.op_bits * (per_op * attn)).sum(axis=1), (space.op_bits * (per_op * ~attn)).sum(axis=1))

    fwd, rec_attn, rec_mlp = block_sums("fwd_ms")
    bwd = block_sums("bwd_ms")[0]
    host_f, host_b = (0.0, 0.0), np.zeros((len(space), 2))  # each block's host time, per row for the backward
    if profile.has_host:  # eq. 2h; without host times eq. 2 exactly, as before them
        fwd_host, rec_attn_host, rec_mlp_host = block_sums("fwd_host_ms")
        bwd_host = block_sums("bwd_host_ms")[0]
        seg = np.array([costs[o].seg_host_ms for o in space.ops])
        ends = segment_ends(spec, space)
        seg_attn, seg_mlp = (ends * (seg * attn)).sum(axis=1), (ends * (seg * ~attn)).sum(axis=1)
        host_f = fwd_host
        host_b = np.stack([bwd_host[0] + rec_attn_host + seg_attn, bwd_host[1] + rec_mlp_host + seg_mlp], axis=1)
        plain = tuple(max(d, h) for d, h in zip(bwd, bwd_host))
        rec_attn = np.maximum(bwd[0] + rec_attn, host_b[:, 0]) - plain[0]
        rec_mlp = np.maximum(bwd[1] + rec_mlp, host_b[:, 1]) - plain[1]
        fwd, bwd = tuple(max(d, h) for d, h in zip(fwd, fwd_host)), plain
    host = (space.off * sz).sum(axis=1)
    per_tensor = costs[ops[0].name]  # the same on every operator's row (op_profiler.offload_host_ms)
    off_fwd, off_bwd = _offload_ms(profile, spec, space, sz, fwd, np.asarray(bwd)[None, :] + np.stack([rec_attn, rec_mlp], axis=1),
                                   host_f, host_b, (per_tensor.off_fwd_host_ms, per_tensor.off_bwd_host_ms), host_link_gb_per_s)
    return LayerPrices(
        fwd_ms=fwd, bwd_ms=bwd, rec_attn_ms=rec_attn, rec_mlp_ms=rec_mlp,
        held_bytes=((space.held - space.off) * sz).sum(axis=1),
        transient_bytes=(space.remat * sz).sum(axis=1) + 2 * host,
        param_bytes=sum(c.param_bytes for c in costs.values()), host_bytes=host,
        offload_fwd_ms=off_fwd, offload_bwd_ms=off_bwd)


def _offload_ms(profile: Profile, spec: ModelSpec, space: RecomputeSpace, sz: np.ndarray, fwd, bwd_rows: np.ndarray,
                host_f, host_b: np.ndarray, per_tensor_host_ms: tuple[float, float],
                host_link_gb_per_s: float) -> tuple[np.ndarray, np.ndarray]:
    """Eq. 2o per row and block: a block's copies over the host link overlap its own pass, and its host time grows by
    the host's cost per offloaded tensor; only what the longer of the two takes beyond the pass as eq. 2h prices it
    (``fwd``; ``bwd_rows`` per row, recomputation included) is added. ``host_f``, ``host_b``: the blocks' host times
    (eq. 2h; 0 without host columns). On a ``Profile.SYNCHRONOUS`` device (a CPU process copying by itself) the
    copies add, and the measured cost per tensor, which includes its copying, stands for them where it is longer."""
    n = len(space)
    if not space.offloads.any():
        return np.zeros((n, 2)), np.zeros((n, 2))
    blocks = tensor_blocks(spec)
    in_block = {b: np.array([blocks[t] == b for t in space.tensors]) for b in BLOCKS}
    moved = np.stack([(space.off * (sz * in_block[b])).sum(axis=1) for b in BLOCKS], axis=1)
    count = np.stack([(space.off * in_block[b]).sum(axis=1) for b in BLOCKS], axis=1).astype(float)
    if host_link_gb_per_s <= 0:  # nowhere to copy to: a row that offloads cannot run
        copy = np.where(moved > 0, np.inf, 0.0)
    else:
        copy = moved / (host_link_gb_per_s * 1e9) * 1e3
    off_f, off_b = count * per_tensor_host_ms[0], count * per_tensor_host_ms[1]
    if profile.gpu in Profile.SYNCHRONOUS:
        return np.maximum(copy, off_f), np.maximum(copy, off_b)
    with np.errstate(invalid="ignore"):
        f = np.maximum(0.0, np.maximum(copy, np.asarray(host_f)[None, :] + off_f) - np.asarray(fwd)[None, :])
        b = np.maximum(0.0, np.maximum(copy, host_b + off_b) - bwd_rows)
    return f, b


def _op_costs(profile: Profile, spec: ModelSpec, micro_batch: int, share: float) -> dict[str, OpCost]:
    """Every operator's table row: a TP-split one at ``share``, a replicated one at share 1."""
    return {o.name: profile.cost(o.name, micro_batch, share if o.tp_split else 1.0) for o in layer_operators(spec)}


@functools.lru_cache(maxsize=8192)
def layer_tensor_bytes(profile: Profile, spec: ModelSpec, micro_batch: int, share: float) -> dict[str, float]:
    """bytes_d(t) of eq. 3 for every tensor of a layer, scaled to the table's saved and output bytes
    (``baton.memory.tensor_bytes``). Memoised and shared: the mapping must not be modified."""
    costs = _op_costs(profile, spec, micro_batch, share)
    return tensor_bytes(spec, micro_batch, share, {k: v.saved_bytes for k, v in costs.items()},
                        {k: v.output_bytes for k, v in costs.items()}, profile.seq_len)


def segment_ends(spec: ModelSpec, space: RecomputeSpace) -> np.ndarray:
    """ends[i, k] = 1 when operator k ends a recomputed segment of set i (eq. 2h): a maximal run of recomputed
    operators that no kept operator or all-reduce interrupts (the runtime's checkpoints,
    ``runtime/parallel/tp_layer.py``). The backward pass reaches a segment at its last operator and replays it
    there, so its cost goes to that operator's block."""
    before_allreduce = np.array([any(t in ALLREDUCE_OUTPUTS for t in o.outputs) for o in layer_operators(spec)])
    nxt = np.zeros_like(space.op_bits)
    nxt[:, :-1] = space.op_bits[:, 1:]
    nxt[:, before_allreduce] = 0.0
    return space.op_bits * (1.0 - nxt)


def segments_per_block(spec: ModelSpec, space: RecomputeSpace) -> tuple[np.ndarray, np.ndarray]:
    """Recomputed segments per set ending in the attn block, in the mlp block (``segment_ends``)."""
    ends = segment_ends(spec, space)
    attn = np.array([b == "attn" for b in space.blocks])
    return (ends * attn).sum(axis=1), (ends * ~attn).sum(axis=1)


def launched_ms(cost: OpCost) -> tuple[float, float]:
    """(forward, backward) of one table row as a step runs it: each pass the larger of device and host time (eq. 2h)."""
    return max(cost.fwd_ms, cost.fwd_host_ms), max(cost.bwd_ms, cost.bwd_host_ms)


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerCost:
    """One device's cost for one layer and one micro-batch under one recompute set and offload set (eq. 2-4, 2o-4o)."""

    fwd_ms: dict
    """Block ('attn', 'mlp') -> forward ms (the larger of device and host time, eq. 2h)."""
    bwd_ms: dict
    """Block -> backward ms, without recomputation."""
    recompute_ms: dict
    """Block -> what recomputation adds to the block's backward: the forward ms of its recomputed operators
    (eq. 2), or with host times what they and their segments add to the larger of device and host time (eq. 2h)."""
    held_bytes: float
    """Activation bytes kept in device memory per in-flight micro-batch (eq. 3o: the offloaded ones are not)."""
    transient_bytes: float
    """Bytes re-created while this layer runs its backward, and the offloaded tensors of the layer it runs and of the
    one it fetches ahead (eq. 4o)."""
    param_bytes: float
    """Parameter bytes this device holds for the layer."""
    host_bytes: float = 0.0
    """Activation bytes kept in host memory per in-flight micro-batch (eq. 3o)."""
    offload_fwd_ms: dict = field(default_factory=lambda: dict.fromkeys(BLOCKS, 0.0))
    """Block -> what copying its offloaded tensors to the host adds to its forward (eq. 2o)."""
    offload_bwd_ms: dict = field(default_factory=lambda: dict.fromkeys(BLOCKS, 0.0))
    """Block -> what copying them back adds to its backward (eq. 2o)."""

    def block_fwd_ms(self) -> tuple[float, float]:
        """Forward per block, as eq. 9 takes the max over a group."""
        return tuple(self.fwd_ms[b] + self.offload_fwd_ms[b] for b in BLOCKS)

    def block_bwd_ms(self) -> tuple[float, float]:
        """Backward plus recomputation per block, as eq. 9 takes the max over a group."""
        return tuple(self.bwd_ms[b] + self.recompute_ms[b] + self.offload_bwd_ms[b] for b in BLOCKS)


def layer_cost(profile: Profile, spec: ModelSpec, micro_batch: int, share: float,
               recompute: frozenset[str] | set[str] | Sequence[str] = frozenset(),
               offload: frozenset[str] | set[str] | Sequence[str] = frozenset(), host_link_gb_per_s: float = 0.0) -> LayerCost:
    """The row of ``layer_prices`` for one (``recompute``, ``offload``) choice: the evaluator's view of eq. 2-4 for one
    device, with tensors to ``offload`` over a host link of ``host_link_gb_per_s`` (eq. 2o-4o)."""
    offload = frozenset(offload)
    if offload and host_link_gb_per_s <= 0:
        raise ValueError("offloading needs the device's host link rate (host_link_gb_per_s)")
    return _layer_cost(profile, spec, micro_batch, share, frozenset(recompute), offload,
                       host_link_gb_per_s if offload else 0.0)


@functools.lru_cache(maxsize=1 << 16)
def _layer_cost(profile: Profile, spec: ModelSpec, micro_batch: int, share: float, recompute: frozenset[str],
                offload: frozenset[str], host_link_gb_per_s: float) -> LayerCost:
    space = choice_space(spec, recompute, offload) if offload else recompute_space(spec, (recompute,))
    return layer_cost_of(layer_prices(profile, spec, micro_batch, share, space, host_link_gb_per_s), 0)


def layer_cost_of(prices: LayerPrices, i: int) -> LayerCost:
    """The scalar view of row ``i`` of ``prices``."""
    return LayerCost(fwd_ms=dict(zip(BLOCKS, prices.fwd_ms)), bwd_ms=dict(zip(BLOCKS, prices.bwd_ms)),
                     recompute_ms={"attn": float(prices.rec_attn_ms[i]), "mlp": float(prices.rec_mlp_ms[i])},
                     held_bytes=float(prices.held_bytes[i]), transient_bytes=float(prices.transient_bytes[i]),
                     param_bytes=prices.param_bytes, host_bytes=float(prices.host_bytes[i]),
                     offload_fwd_ms=dict(zip(BLOCKS, map(float, prices.offload_fwd_ms[i]))),
                     offload_bwd_ms=dict(zip(BLOCKS, map(float, prices.offload_bwd_ms[i]))))


def layer_train_ms(profile: Profile, spec: ModelSpec, micro_batch: int, share: float) -> float:
    """Forward + backward of one layer at ``share`` with nothing recomputed (bounds, eq. 12, HAP)."""
    lc = layer_cost(profile, spec, micro_batch, share)
    return sum(lc.fwd_ms.values()) + sum(lc.bwd_ms.values())


def layer_backward_ms(profile: Profile, spec: ModelSpec, micro_batch: int, share: float) -> float:
    """The backward of one layer at ``share`` with nothing recomputed (eq. 12c's round trip)."""
    return sum(layer_cost(profile, spec, micro_batch, share).bwd_ms.values())


# -- collectives and transfers (eq. 5, 6) ------------------------------------------------------------


def _ring_ms(num_bytes: float, n: int, bandwidth_gb_per_s: float, latency_us: float) -> float:
    return 2 * (n - 1) / n * num_bytes / (bandwidth_gb_per_s * 1e9) * 1e3 + 2 * (n - 1) * latency_us * 1e-3


def allreduce_ms(num_bytes: float, num_devices: int, link: Link | None) -> float:
    """Eq. 5: ring all-reduce, 2(n-1)/n * bytes / bandwidth + 2(n-1) * latency (0 for one device),
    with the link's collective figures (its all-reduce fit where one was measured): gradient
    synchronisation, which runs between ranks done computing."""
    if num_devices <= 1 or link is None:
        return 0.0
    return _ring_ms(num_bytes, num_devices, link.collective_bandwidth_gb_per_s, link.collective_latency_us)


def tp_allreduce_ms(num_bytes: float, num_devices: int, link: Link | None) -> float:
    """Eq. 5 for the all-reduces inside a tensor-parallel layer, with the link's in-layer figures
    where they were measured (ranks arrive from their own compute and communication competes with it)."""
    if num_devices <= 1 or link is None:
        return 0.0
    return _ring_ms(num_bytes, num_devices, link.tp_collective_bandwidth_gb_per_s, link.tp_collective_latency_us)


def activation_bytes(spec: ModelSpec, micro_batch: int, seq_len: int | None = None) -> float:
    """Bytes of one layer boundary activation (b * s * h elements)."""
    return micro_batch * (seq_len or spec.seq_len) * spec.hidden_dim * spec.dtype_bytes


def p2p_ms(cluster: ClusterSpec, senders: Sequence[str], receivers: Sequence[str], num_bytes: float) -> float:
    """Eq. 6: receiver j takes the full tensor from sender j mod n_senders; a sender's sends are serial."""
    per_sender = [0.0] * len(senders)
    for j, r in enumerate(receivers):
        i = j % len(senders)
        if senders[i] != r:
            per_sender[i] += cluster.link(senders[i], r).transfer_ms(num_bytes)
    return max(per_sender)


def pipeline_transfers(cluster: ClusterSpec, spec: ModelSpec, micro_batch: int, stage_ids: Sequence[str],
                       next_ids: Sequence[str] | None) -> tuple[float, float]:
    """Eq. 6 both ways between a stage and the next: (activation forward, gradient back); (0, 0) for the last."""
    if next_ids is None:
        return 0.0, 0.0
    act = activation_bytes(spec, micro_batch)
    return p2p_ms(cluster, stage_ids, next_ids, act), p2p_ms(cluster, next_ids, stage_ids, act)


# -- a device's place in a skeleton, and its memory (eq. 7, 8) ---------------------------------------


@functools.lru_cache(maxsize=1 << 14)
def in_flight_microbatches(stage: int, num_stages: int, num_microbatches: int, *, layered: bool = False) -> int:
    """The micro-batches whose activations a device holds at its peak, read from its schedule: under 1F1B stage
    s holds min(p - s, m) (``baton.schedules.peak_in_flight``); run layer by layer (stages 2 and 3, eq. 18) a
    replica holds all m at the end of its forward."""
    if layered:
        return num_microbatches
    counts = device_live_counts(one_f_one_b_order(num_stages, num_microbatches, stage), 1)
    return max((n for n, in counts), default=0)


@dataclass(frozen=True, kw_only=True, slots=True)
class EdgeCost:
    """What the embedding (first stage) and the final LayerNorm, LM head and loss (last stage) cost one
    device whose vocabulary share is ``share`` (docs/cost-model.md, section 6): the vocabulary is split
    across a stage's ranks like its layers' units."""

    fwd_ms: float
    """Embedding/head forward per micro-batch, compute only (the stage's all-reduces are StageConstants)."""
    bwd_ms: float
    """Embedding/head backward per micro-batch, compute only."""
    saved_bytes: float
    """Activations the edge operators keep per in-flight micro-batch."""
    head_saved_bytes: float = 0.0
    """The head's part of ``saved_bytes`` (run layer by layer, only one micro-batch's is alive: eq. 18)."""
    param_bytes: float
    """Embedding rows (and positions), final norm, and the head's rows: an untied head's always (the head row
    of the table holds them), a tied head's own copy on a last stage that is not the first."""


NO_EDGE = EdgeCost(fwd_ms=0.0, bwd_ms=0.0, saved_bytes=0.0, param_bytes=0.0)
"""A middle stage's devices hold neither embedding nor head."""


def edge_cost(slot: "DeviceSlot", spec: ModelSpec, micro_batch: int, share: float) -> EdgeCost:
    if not (slot.first or slot.last):
        return NO_EDGE
    return _edge_cost(slot.profile, spec, micro_batch, share, slot.first, slot.last)


@functools.lru_cache(maxsize=1 << 14)
def _edge_cost(profile: Profile, spec: ModelSpec, micro_batch: int, share: float, first: bool, last: bool) -> EdgeCost:
    emb, head = profile.cost(EMBEDDING, micro_batch, share), profile.cost(HEAD, micro_batch, share)
    params = (emb.param_bytes if first else 0.0) + (head.param_bytes if last else 0.0)
    if last and not first and spec.tie_embeddings:
        params += tied_embedding_bytes(spec) * share
    (emb_f, emb_b), (head_f, head_b) = launched_ms(emb), launched_ms(head)
    return EdgeCost(fwd_ms=(emb_f if first else 0.0) + (head_f if last else 0.0),
                    bwd_ms=(emb_b if first else 0.0) + (head_b if last else 0.0),
                    saved_bytes=(emb.saved_bytes if first else 0.0) + (head.saved_bytes if last else 0.0),
                    head_saved_bytes=head.saved_bytes if last else 0.0,
                    param_bytes=params)


def edge_train_ms(profile: Profile, spec: ModelSpec, micro_batch: int, share: float, *, first: bool, last: bool) -> float:
    """Forward + backward of the embedding (``first``) and of the final norm, head and loss (``last``) at ``share``,
    compute only, as ``edge_cost`` prices them (eq. 12c's edges)."""
    edge = _edge_cost(profile, spec, micro_batch, share, first, last)
    return edge.fwd_ms + edge.bwd_ms


def tied_embedding_bytes(spec: ModelSpec) -> float:
    """The token embedding (padded V x h), which the LM head shares: a last stage that is not the first
    keeps its own copy of its rows, and the two copies' gradients are summed once per iteration."""
    return padded_vocab(spec) * spec.hidden_dim * spec.dtype_bytes


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceSlot:
    """What a device's position in a skeleton adds to its own layer costs (eq. 8-10); what it pays for the
    embedding and head depends on its share too (``edge_cost``)."""

    device_id: str = field(compare=False)
    """Cluster device id (not part of equality: devices alike in every other field are priced alike)."""
    profile: Profile
    """The table of its GPU type."""
    memory_bytes: int
    """Capacity C_d."""
    reserve_bytes: int
    """Reserve Res_d held back by the cluster spec."""
    in_flight: int
    """min(p - s, m) micro-batches whose activations it holds at its peak (1F1B)."""
    first: bool
    """Its stage is the first (holds the embedding)."""
    last: bool
    """Its stage is the last (holds the final LN, LM head and loss)."""
    optimizer_ms_per_byte: float
    """Eq. 10's slope: Adam step ms per byte of weights held."""
    host_link_gb_per_s: float = 0.0
    """BWh_d of eq. 2o: its pinned copy rate to and from host memory, each way."""
    host_optimizer_ms_per_byte: float = 0.0
    """Eq. 10h's slope: ms per byte of weights held of an Adam step run on the host (gradients out and weights back
    over the host link, the step on the host's memory)."""


def device_slot(cluster: ClusterSpec, profiles: ProfileSet, spec: ModelSpec, micro_batch: int, device_id: str, *,
                stage: int, num_stages: int, num_microbatches: int, layered: bool = False) -> DeviceSlot:
    dev = cluster.device(device_id)
    return _device_slot(device_id, profiles[dev.gpu.name], spec, dev.memory_bytes, dev.reserve_bytes,
                        dev.gpu.memory_bandwidth_gb_per_s, stage == 0, stage == num_stages - 1,
                        in_flight_microbatches(stage, num_stages, num_microbatches, layered=layered), dev.host_link_gb_per_s,
                        dev.host_optimizer_gb_per_s)


@functools.lru_cache(maxsize=1 << 18)  # one per device, position and in-flight count: 1,024-GPU clusters need many
def _device_slot(device_id, profile, spec, memory_bytes, reserve_bytes, bandwidth, first, last, in_flight, host_link,
                 host_adam):
    on_device = optimizer_step_ms(1.0, spec, bandwidth, profile.optimizer_sample())
    return DeviceSlot(
        device_id=device_id, profile=profile, memory_bytes=memory_bytes, reserve_bytes=reserve_bytes,
        in_flight=in_flight, first=first, last=last, optimizer_ms_per_byte=on_device,
        host_link_gb_per_s=host_link, host_optimizer_ms_per_byte=host_optimizer_ms_per_byte(profile, spec, on_device,
                                                                                            host_link, host_adam))


def host_optimizer_ms_per_byte(profile: Profile, spec: ModelSpec, on_device_ms_per_byte: float, host_link_gb_per_s: float,
                               host_optimizer_gb_per_s: float) -> float:
    """Eq. 10h: an Adam step kept on the host, per byte of weights: the gradients (one weight's bytes) to the host and
    the updated weights back, one after the other over the host link, and between them the step on the host's memory
    at eq. 10's traffic (``host_optimizer_gb_per_s``). A CPU process's host is itself: its own measured step.
    Infinite without a host link."""
    if host_link_gb_per_s <= 0:
        return float("inf")
    copies = 2.0 / (host_link_gb_per_s * 1e9) * 1e3
    if profile.gpu in Profile.SYNCHRONOUS:
        return copies + on_device_ms_per_byte
    return copies + optimizer_step_ms(1.0, spec, host_optimizer_gb_per_s)


HOST_STAGING_PER_PARAM = 1
"""Host buffers per parameter besides the fp32 master and moments: the gradients land in one of the training dtype
(``runtime/train/host_optimizer.py``)."""


def host_optimizer_bytes(param_bytes, spec: ModelSpec):
    """Eq. 7h: what a device that keeps its optimizer state in host memory puts there for ``param_bytes`` of owned
    weights: the fp32 master (in fp32 training too: the host steps its own copy), both Adam moments, and a buffer the
    gradients land in, in the training dtype."""
    params = param_bytes / spec.dtype_bytes
    return params * (MASTER_WEIGHT_BYTES_PER_PARAM + ADAM_STATE_BYTES_PER_PARAM + HOST_STAGING_PER_PARAM * spec.dtype_bytes)


def optimizer_bytes(param_bytes, spec: ModelSpec):
    """Eq. 7: Adam moments and (for fp16/bf16) fp32 master weights for ``param_bytes`` of weights."""
    params = param_bytes / spec.dtype_bytes
    master = MASTER_WEIGHT_BYTES_PER_PARAM if spec.dtype_bytes < 4 else 0
    return params * (ADAM_STATE_BYTES_PER_PARAM + master)


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceMemory:
    """Eq. 8, term by term (floats, or arrays over recompute sets)."""

    weights_bytes: object
    """Weights kept: all held (W_d), at stage 3 the owned shards, the edges and one gathered layer."""
    grads_bytes: object
    optimizer_bytes: object
    held_weights_bytes: object
    """W_d: the weights of every part the device holds (stage 3 included), what its Adam step's share is of."""
    activation_bytes: object
    """Activations of the in-flight micro-batches."""
    transient_bytes: object
    """Recompute buffer of one layer (none without layers)."""
    reserve_bytes: object
    peak_bytes: object
    """The sum; the device fits when it is at most its capacity."""


def state_bytes(weight_bytes, spec: ModelSpec, *, offload_optimizer: bool = False):
    """Eq. 7 for weights held whole: the weights, their gradients (one weight's bytes each) and, on the device unless
    ``offload_optimizer`` (eq. 7h), their optimizer state."""
    return 2 * weight_bytes + optimizer_bytes(weight_bytes, spec) * (not offload_optimizer)


def device_memory(slot: DeviceSlot, spec: ModelSpec, num_layers, *, param_bytes, held_bytes, transient_bytes,
                  edge: EdgeCost, owned_fraction=1.0, sync_buffer_bytes=0.0, zero_stage: int = 0,
                  owned_layer_fraction=None, activation_bytes=None, offload_optimizer: bool = False) -> DeviceMemory:
    """Eq. 7 and 8 for a device holding ``num_layers`` layers with the given per-layer figures; with
    sharded optimizer state (eq. 14) it keeps the state of ``owned_fraction`` of its weights, and the
    gradient sync after the backward pass stages ``sync_buffer_bytes`` while no activation is alive.
    At ``zero_stage`` 2 and 3 (eq. 18) it keeps the owned shards of its gradients (and at 3 of its layers'
    weights: ``owned_layer_fraction`` of them, ``owned_fraction`` when not given), the edges whole and one
    layer whole, and the staging of one unit's collective beside the activations. ``activation_bytes``, when
    given, replaces the 1F1B in-flight term by a schedule's own peak (``scheduled_activation_bytes``). With
    ``offload_optimizer`` (stages 0 and 1) its optimizer state lives in host memory (eq. 7h): none on the device.

    Plain arithmetic, so it runs element-wise on numpy arrays (every recompute set at once, or every
    layer count) with bit-for-bit the numbers it gives for one float: the planner's memory limits and
    the evaluator's "fits" are the same comparisons.
    """
    weights = held_weights_bytes(num_layers, param_bytes, edge)
    opt = optimizer_bytes(weights * owned_fraction, spec) * (not offload_optimizer)
    activ = activation_bytes
    if activ is None:
        activ = slot.in_flight * (num_layers * held_bytes + edge.saved_bytes)
    any_layer = np.asarray(num_layers) > 0
    transient = transient_bytes * any_layer  # one layer's buffer, once any layer is held
    if zero_stage < 2:
        peak = 2 * weights + opt + np.maximum(activ + transient, sync_buffer_bytes) + slot.reserve_bytes
        return DeviceMemory(weights_bytes=weights, grads_bytes=weights, optimizer_bytes=opt, held_weights_bytes=weights,
                            activation_bytes=activ, transient_bytes=transient, reserve_bytes=slot.reserve_bytes, peak_bytes=peak)
    # Run layer by layer, each micro-batch's head runs its backward right after its forward: one head's
    # activations alive beside every micro-batch's layers and embedding.
    activ = slot.in_flight * (num_layers * held_bytes + edge.saved_bytes - edge.head_saved_bytes) + edge.head_saved_bytes
    whole_layer = param_bytes * any_layer  # one layer gathered (stage 3) and one layer's full gradient
    # The edges' gradients live through the backward, but the position embedding's only from the embedding's
    # backward on, when no layer's full gradient is left.
    positions = position_param_count(spec) * spec.dtype_bytes * slot.first
    grads = weights * owned_fraction + edge.param_bytes + np.maximum(whole_layer - positions, 0.0)
    kept = weights
    if zero_stage >= 3:
        own_layers = owned_fraction if owned_layer_fraction is None else owned_layer_fraction
        kept = num_layers * param_bytes * own_layers + edge.param_bytes + whole_layer
    peak = kept + grads + opt + activ + transient + sync_buffer_bytes + slot.reserve_bytes
    return DeviceMemory(weights_bytes=kept, grads_bytes=grads, optimizer_bytes=opt, held_weights_bytes=weights,
                        activation_bytes=activ, transient_bytes=transient, reserve_bytes=slot.reserve_bytes, peak_bytes=peak)


def host_activation_bytes(slot: DeviceSlot, num_layers, host_bytes, *, schedule: Schedule | None = None, group: int = 0,
                          layers: Sequence[int] = ()) -> float:
    """Eq. 8o: what a device keeps in host memory at its peak, ``host_bytes`` per layer and micro-batch in flight,
    counted like eq. 8's activations (under an interleaved ``schedule``, its own peak over the ``layers`` of its
    virtual stages)."""
    if schedule is not None:
        return scheduled_activation_bytes(schedule, group, layers, host_bytes, NO_EDGE)
    return slot.in_flight * num_layers * host_bytes


def held_weights_bytes(num_layers, param_bytes, edge: EdgeCost):
    """W_d (section 6): the weights of ``num_layers`` layers at ``param_bytes`` each and of the edges."""
    return num_layers * param_bytes + edge.param_bytes


def device_optimizer_ms(slot: DeviceSlot, held_bytes, owned_fraction, offload_optimizer: bool = False) -> float:
    """Eq. 10 for one device: its Adam step over the owned share of the weights it holds; on the host with
    ``offload_optimizer`` (eq. 10h)."""
    slope = slot.host_optimizer_ms_per_byte if offload_optimizer else slot.optimizer_ms_per_byte
    return slope * held_bytes * owned_fraction


@functools.lru_cache(maxsize=1 << 14)
def fitting_layers(slot: DeviceSlot, spec: ModelSpec, micro_batch: int, share: float, space: RecomputeSpace, cap: int,
                   owned_fraction: float = 1.0) -> np.ndarray:
    """``max_layers_that_fit`` for the prices of (slot's GPU, micro_batch, share) over ``space``, memoised
    (read-only result): many skeletons put alike devices at alike positions."""
    return max_layers_that_fit(slot, spec, slot_prices(slot, spec, micro_batch, share, space),
                               edge_cost(slot, spec, micro_batch, share), cap, owned_fraction=owned_fraction)


def slot_prices(slot: DeviceSlot, spec: ModelSpec, micro_batch: int, share: float, space: RecomputeSpace) -> LayerPrices:
    """``layer_prices`` of the device at ``slot`` (its table and its host link)."""
    return layer_prices(slot.profile, spec, micro_batch, share, space, slot.host_link_gb_per_s)


def max_layers_that_fit(slot: DeviceSlot, spec: ModelSpec, prices: LayerPrices, edge: EdgeCost, cap: int, *,
                        owned_fraction: float = 1.0) -> np.ndarray:
    """Per recompute set of ``prices``: the largest L in [0, cap] with ``device_memory(L)`` within capacity
    (memory grows with L), or -1 when not even L = 0 fits. Exact: every answer is checked with
    ``device_memory`` itself, the comparison the evaluator makes. The sharded sync's staging buffer (eq. 14)
    is not counted here: it never coexists with activations, and its own limit depends on the peers."""
    def peak(L):
        return device_memory(slot, spec, L, param_bytes=prices.param_bytes, held_bytes=prices.held_bytes,
                             transient_bytes=prices.transient_bytes, edge=edge, owned_fraction=owned_fraction).peak_bytes

    cap_arr = np.full(len(prices.held_bytes), cap, dtype=np.int64)
    p0, p1 = peak(np.zeros_like(cap_arr)), peak(np.ones_like(cap_arr))
    p2 = peak(np.full_like(cap_arr, 2))
    slope = p2 - p1
    with np.errstate(divide="ignore", invalid="ignore"):
        guess = np.where(slope > 0, np.floor(1 + (slot.memory_bytes - p1) / np.where(slope > 0, slope, 1.0)), cap)
    L = np.clip(np.nan_to_num(guess, nan=0.0, posinf=cap, neginf=0), 0, cap).astype(np.int64)
    for _ in range(64):  # the line is exact up to rounding: at most a step or two to settle
        over = (peak(L) > slot.memory_bytes) & (L > 0)
        more = (L < cap) & (peak(np.minimum(L + 1, cap)) <= slot.memory_bytes)
        if not over.any() and not more.any():
            break
        L = L - over + (more & ~over)
    return np.where(p0 <= slot.memory_bytes, L, -1)


def optimizer_step_ms(param_bytes: float, spec: ModelSpec, bandwidth_gb_per_s: float,
                      measured: tuple[float, float] | None = None) -> float:
    """Eq. 10: the Adam step scales with the weights it updates: from a timed step of ``measured =
    (param_bytes, ms)`` when the device's table has one, else bandwidth-bound (traffic per parameter
    over DRAM bandwidth)."""
    if measured is not None:
        return param_bytes * measured[1] / measured[0]
    return param_bytes / spec.dtype_bytes * OPTIMIZER_TRAFFIC_BYTES_PER_PARAM / (bandwidth_gb_per_s * 1e9) * 1e3


# -- a stage (eq. 9) and the iteration's extra terms (eq. 11) ----------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class StageConstants:
    """The parts of eq. 9 fixed by a stage's group and position, not by its decisions."""

    allreduce_ms: float
    """TP all-reduce time per layer in each direction (both all-reduces, eq. 5); 0 for one device."""
    edge_fwd_comm_ms: float
    """All-reduces of the vocabulary-parallel edges in the forward pass: the embedding's (b, s, h) sum on
    the first stage; the loss's three (b, s) fp32 reductions (max, sum of exponentials, target logit) on
    the last."""
    edge_bwd_comm_ms: float
    """The head's (b, s, h) input-gradient sum on the last stage, in the backward pass."""


def layer_allreduce_ms(cluster: ClusterSpec, spec: ModelSpec, micro_batch: int, ids: Sequence[str]) -> float:
    """Eq. 9's all-reduce term: both in-layer all-reduces of one direction, on the group's slowest link."""
    return layer_allreduce_on_ms(spec, micro_batch, len(ids), cluster.slowest_link(list(ids)))


def layer_allreduce_on_ms(spec: ModelSpec, micro_batch: int, num_devices: int, link: Link | None) -> float:
    """Eq. 9's all-reduce term for a group of ``num_devices`` whose slowest link is ``link`` (bounds ask it of the
    fastest link a group could have)."""
    return tp_allreduce_ms(activation_bytes(spec, micro_batch), num_devices, link) * ALLREDUCES_PER_LAYER


LOSS_REDUCTIONS = 3
"""All-reduces of the vocabulary-parallel cross-entropy's forward: row max, sum of exponentials, target logit."""


def edge_comms_ms(cluster: ClusterSpec, spec: ModelSpec, micro_batch: int, ids: Sequence[str]) -> tuple[float, float]:
    """The vocabulary-parallel edges' all-reduces in a group: (one (b, s, h) sum, the loss's reductions):
    the embedding's forward and the head's backward each take the first, the loss's forward the second."""
    return edge_comms_on_ms(spec, micro_batch, len(ids), cluster.slowest_link(list(ids)))


def edge_comms_on_ms(spec: ModelSpec, micro_batch: int, num_devices: int, link: Link | None) -> tuple[float, float]:
    """``edge_comms_ms`` for a group of ``num_devices`` whose slowest link is ``link`` (bounds ask it of the fastest
    link a group could have)."""
    x = tp_allreduce_ms(activation_bytes(spec, micro_batch), num_devices, link)
    rows = tp_allreduce_ms(micro_batch * spec.seq_len * 4, num_devices, link)
    return x, LOSS_REDUCTIONS * rows


def edge_comm_passes_on_ms(spec: ModelSpec, micro_batch: int, num_devices: int, link: Link | None, *, first: bool,
                           last: bool) -> tuple[float, float]:
    """(forward, backward) edge all-reduces of a stage holding the embedding (``first``) and/or the head (``last``):
    the embedding's sum in the forward, the loss's reductions in the forward and the head's sum in the backward."""
    x, loss = edge_comms_on_ms(spec, micro_batch, num_devices, link)
    return (x if first else 0.0) + (loss if last else 0.0), x if last else 0.0


def stage_constants(cluster: ClusterSpec, spec: ModelSpec, micro_batch: int, ids: Sequence[str], *, first: bool,
                    last: bool) -> StageConstants:
    fwd, bwd = edge_comm_passes_on_ms(spec, micro_batch, len(ids), cluster.slowest_link(list(ids)), first=first, last=last)
    return StageConstants(allreduce_ms=layer_allreduce_ms(cluster, spec, micro_batch, ids),
                          edge_fwd_comm_ms=fwd, edge_bwd_comm_ms=bwd)


def stage_time_ms(num_layers: int, per_layer_ms: float, allreduce_ms_per_layer: float, edge_ms: float) -> float:
    """Eq. 9 for one direction: L * (sum over blocks of the slowest device + all-reduces) + slowest edge."""
    return num_layers * (per_layer_ms + allreduce_ms_per_layer) + edge_ms


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupPasses:
    """A stage's group (its TP ranks) in eq. 9's terms, whatever layers it runs: what a pass costs per micro-batch."""

    layer_fwd_ms: float
    """One layer's forward: the blocks at their slowest rank (``group_layer_ms``), all-reduces excluded."""
    layer_bwd_ms: float
    """One layer's backward, recomputation included, all-reduces excluded."""
    allreduce_ms: float
    """The in-layer all-reduces of one direction (``StageConstants.allreduce_ms``)."""
    edge_fwd_ms: float
    """The embedding's (first group) or the head and loss's (last group) forward at the slowest rank, with their
    all-reduces; 0 in between."""
    edge_bwd_ms: float
    """Their backward."""
    send_fwd_ms: float
    """Eq. 6: the activation to the next group (the last group: back to the first, for interleaving)."""
    send_bwd_ms: float
    """Eq. 6: the gradient coming back from the next group (the last group: from the first)."""


def group_passes(cluster: ClusterSpec, spec: ModelSpec, micro_batch: int, ids: Sequence[str], costs: Sequence[LayerCost],
                 edges: Sequence[EdgeCost], const: StageConstants, next_ids: Sequence[str] | None) -> GroupPasses:
    """``GroupPasses`` of the group ``ids`` (TP rank order) with its ranks' layer ``costs`` and ``edges``, its
    ``stage_constants`` and the group its activations go to (None: none)."""
    f_layer, b_layer = group_layer_ms([c.block_fwd_ms() for c in costs], [c.block_bwd_ms() for c in costs])
    send_f, send_b = pipeline_transfers(cluster, spec, micro_batch, ids, next_ids)
    return GroupPasses(layer_fwd_ms=f_layer, layer_bwd_ms=b_layer, allreduce_ms=const.allreduce_ms,
                       edge_fwd_ms=max(e.fwd_ms for e in edges) + const.edge_fwd_comm_ms,
                       edge_bwd_ms=max(e.bwd_ms for e in edges) + const.edge_bwd_comm_ms,
                       send_fwd_ms=send_f, send_bwd_ms=send_b)


def interleaved_timing(groups: Sequence[GroupPasses], layers: Sequence[int]) -> PipelineTiming:
    """Eq. 9 and 6 per virtual stage of an interleaved replica (docs/schedules.md): ``layers[k]`` layers on virtual
    stage k of p v in model order, which runs on group k mod p; the embedding belongs to virtual stage 0 (chunk 0 of
    the first group), the head to the last (the last chunk of the last group). A boundary k -> k + 1 is a transfer
    from group k mod p to the next, the last group's to the first (``GroupPasses.send_*``). With one chunk per
    group this is the 1F1B stages' eq. 9."""
    p, K = len(groups), len(layers)
    fwd, bwd = [], []
    for k, L in enumerate(layers):
        g = groups[k % p]
        edge = k == 0 or k == K - 1
        fwd.append(stage_time_ms(L, g.layer_fwd_ms, g.allreduce_ms, g.edge_fwd_ms if edge else 0.0))
        bwd.append(stage_time_ms(L, g.layer_bwd_ms, g.allreduce_ms, g.edge_bwd_ms if edge else 0.0))
    return PipelineTiming(fwd_ms=tuple(fwd), bwd_ms=tuple(bwd),
                          send_fwd_ms=tuple(groups[k % p].send_fwd_ms for k in range(K - 1)),
                          send_bwd_ms=tuple(groups[k % p].send_bwd_ms for k in range(K - 1)))


def virtual_stage_saved_bytes(stage: int, num_stages: int, layers: int, held_bytes: float, edge: EdgeCost) -> float:
    """What a virtual stage's forward keeps per micro-batch until its backward: ``layers`` layers of ``held_bytes``
    each, and the embedding's saved bytes on the first virtual stage and the head's on the last."""
    first, last = stage == 0, stage == num_stages - 1
    own = (edge.saved_bytes if first and last else edge.saved_bytes - edge.head_saved_bytes if first
           else edge.head_saved_bytes if last else 0.0)
    return layers * held_bytes + own


def scheduled_activation_bytes(schedule: Schedule, group: int, layers: Sequence[int], held_bytes: float,
                               edge: EdgeCost) -> float:
    """Eq. 8's activations of a device of ``group`` at its peak under ``schedule`` (``baton.schedules.peak_in_flight``)
    with ``layers[k]`` layers on virtual stage k (``virtual_stage_saved_bytes``). Under 1F1B, stage s keeps
    min(p - s, m) micro-batches of its L_s layers: eq. 8's in-flight term."""
    K = len(layers)
    return peak_in_flight(schedule, group, lambda k: virtual_stage_saved_bytes(k, K, layers[k], held_bytes, edge))


@dataclass(frozen=True, kw_only=True, slots=True)
class ChunkMemoryRow:
    """Eq. 8 (first branch) of a device of an interleaved group at one moment its schedule may peak at, as a line
    in the layer counts of its chunks: peak = fixed_bytes + sum_c per_layer_bytes[c] L_c, for any layer counts
    holding at least one layer in all (a device of an interleaved group always holds one: every group has a
    virtual stage in the middle)."""

    per_layer_bytes: tuple[float, ...]
    """Per chunk: a layer's weights, gradients and optimizer state, and its activations times the micro-batches
    the chunk holds at that moment."""
    fixed_bytes: float
    """The edges' weights, gradients and state, one layer's recompute buffer, the reserve and the edges'
    activations held at that moment."""


def interleaved_memory_rows(slot: DeviceSlot, spec: ModelSpec, schedule: Schedule, group: int, *, param_bytes: float,
                            held_bytes: float, transient_bytes: float, edge: EdgeCost,
                            owned_fraction: float = 1.0) -> list[ChunkMemoryRow]:
    """Eq. 8 of a device of ``group`` under an interleaved ``schedule`` as one line per moment of
    ``baton.schedules.live_counts``: the device fits iff every line stays within its capacity. The lines are
    ``device_memory``'s own terms (its value at one and two layers without activations gives the weights' slope
    and the fixed part), so the planner's rows and the evaluator's peak are the same sums."""
    def base(L):
        return device_memory(slot, spec, L, param_bytes=param_bytes, held_bytes=held_bytes,
                             transient_bytes=transient_bytes, edge=edge, owned_fraction=owned_fraction,
                             activation_bytes=0.0).peak_bytes

    per_layer = float(base(2) - base(1))
    fixed = float(base(1)) - per_layer
    p, K = schedule.num_devices, schedule.num_stages
    rows = []
    for counts in live_counts(schedule, group):
        stages = [c * p + group for c in range(len(counts))]
        rows.append(ChunkMemoryRow(
            per_layer_bytes=tuple(per_layer + n * held_bytes for n in counts),
            fixed_bytes=fixed + sum(n * virtual_stage_saved_bytes(k, K, 0, held_bytes, edge) for n, k in zip(counts, stages))))
    return rows


def layer_limits(num_layers: int, num_stages: int) -> tuple[list[int], list[int]]:
    """Fewest and most layers each stage may hold: every middle stage at least one (an empty middle stage
    would only forward activations); the first and last may hold none (embedding or head alone)."""
    if num_stages == 1:
        return [num_layers], [num_layers]
    lo = [0] + [1] * (num_stages - 2) + [0]
    hi = [num_layers - (sum(lo) - lo[s]) for s in range(num_stages)]
    return lo, hi


def embedding_sync_ms(cluster: ClusterSpec, spec: ModelSpec, pipelines: Sequence[Sequence[Sequence[str]]]) -> float:
    """Eq. 11's T_emb: the tied embedding's gradient is all-reduced between the first and last stage of
    every replica of more than one stage once per iteration (``runtime.parallel.topology``'s tied groups;
    nothing for a replica of one stage, or when the head is untied)."""
    if not spec.tie_embeddings:
        return 0.0
    return max((allreduce_ms(tied_embedding_bytes(spec), len(pipe[0]) + len(pipe[-1]),
                             cluster.slowest_link(list(pipe[0]) + list(pipe[-1]))) for pipe in pipelines if len(pipe) > 1),
               default=0.0)


# -- data parallelism over peer groups (eq. 13-15) ---------------------------------------------------


def layer_param_count(spec: ModelSpec, share: float) -> float:
    """Parameters of one layer a rank at ``share`` holds: the split ones times the share, the replicated
    ones whole (``baton.peers`` cuts the same counts into pieces)."""
    return split_param_count(spec) * share + replicated_param_count(spec)


def edge_param_count(spec: ModelSpec, share: float, *, first: bool, last: bool) -> float:
    """Embedding-side parameters a rank at vocabulary ``share`` holds: its token-embedding rows and the
    position embedding on the first stage, its head rows (of a tied head a separate copy when the last stage
    is not the first; of an untied head always) and the final norm on the last."""
    rows = padded_vocab(spec) * spec.hidden_dim * share
    n = 0.0
    if first:
        n += rows + position_param_count(spec)
    if last:
        n += (0.0 if first and spec.tie_embeddings else rows) + final_norm_param_count(spec)
    return n


RING_PASSES = ("reduce_scatter", "all_gather")
"""The two halves of a ring all-reduce, which sharded state runs apart (eq. 13, 16)."""


def ring_step_ms(chunk_bytes: float, n: int, link: Link | None, kind: str) -> float:
    """A ring reduce-scatter or all-gather (``kind``) of ``n`` chunks of ``chunk_bytes`` each (eq. 13): n - 1
    steps, each moving one chunk over the group's slowest link with that pass's figures
    (``Link.ring_pass_figures``: measured ones where the link has them, else the all-reduce's)."""
    if n <= 1 or link is None:
        return 0.0
    bw, lat = link.ring_pass_figures(kind)
    return (n - 1) * (chunk_bytes / (bw * 1e9) * 1e3 + lat * 1e-3)


def group_sync_ms(cluster: ClusterSpec, spec: ModelSpec, holders: Sequence[str], num_params: float, largest_shard: float,
                  zero_stage: int) -> float:
    """Eq. 13: one peer group's collectives after the backward pass. Stage 0: an all-reduce of the group's
    gradients (eq. 5). Stage 1: a reduce-scatter of the gradients to their owners and an all-gather of the
    updated weights, both with every chunk padded to the largest shard (collectives take equal chunks; for
    equal shards the two cost exactly the all-reduce)."""
    link = cluster.slowest_link(list(holders)) if len(holders) > 1 else None
    if zero_stage == 0:
        return allreduce_ms(num_params * spec.dtype_bytes, len(holders), link)
    return sum(ring_step_ms(largest_shard * spec.dtype_bytes, len(holders), link, kind) for kind in RING_PASSES)


def sync_buffer_bytes(spec: ModelSpec, group_size: int, largest_shard: float, zero_stage: int, *, num_params: float = 0.0,
                      whole: bool = True) -> float:
    """Eq. 14: what one group's sync stages, alive only while the group syncs (after the backward pass).
    Stage 0: nothing when the group is everything its holders hold (the all-reduce runs on the gradient
    buffer itself), else a copy of the group's ``num_params`` gradients. Stage 1: the n chunks padded to the
    largest shard and the owner's reduced chunk. Nothing for a group of one."""
    if group_size <= 1:
        return 0.0
    if zero_stage == 0:
        return 0.0 if whole else num_params * spec.dtype_bytes
    return (group_size + 1) * largest_shard * spec.dtype_bytes


def data_parallel_sync_ms(cluster: ClusterSpec, spec: ModelSpec, groups: Sequence[tuple[Sequence[str], float, float]],
                          zero_stage: int) -> float:
    """Eq. 15: T_dp of ``groups`` = (holders, parameters, largest shard) in the runtime's order. Stage 0: the
    groups' all-reduces scheduled as ``sync_schedule_ms`` does. Stage 1: every group's reduce-scatter in
    order, then (after the owners' step) every group's all-gather in order: two schedules of one ring pass
    each, as clipping and the fp16 overflow check need every reduced gradient before any update."""
    if zero_stage == 0:
        return sync_schedule_ms([(h, group_sync_ms(cluster, spec, h, n, big, 0)) for h, n, big in groups])
    return sum(unit_pass_ms(cluster, spec, [(h, big) for h, _, big in groups], kind) for kind in RING_PASSES)


@dataclass(frozen=True, kw_only=True, slots=True)
class SyncTerms:
    """What data parallelism adds to a plan whose shapes are fixed (eq. 13-16), for the evaluator and for
    planners that price a fixed structure."""

    dp_sync_ms: float
    """Stages 0 and 1: T_dp, eq. 15 (stages 2 and 3 price their collectives per unit: ``unit_ms``)."""
    dp_reduce_ms: float
    """The part of ``dp_sync_ms`` before the step: all of it at stage 0, the reduce-scatters at stage 1
    (the all-gathers follow the owners' update)."""
    owned_fraction: dict
    """Device -> share of its weights whose optimizer state (and at stages 2-3 gradients) it keeps."""
    buffer_bytes: dict
    """Device -> staging of its largest group's sync (eq. 14; stages 2 and 3: of its largest unit group)."""
    unit_reduce_ms: dict
    """Stages 2 and 3: unit (``peers.EDGES`` or a layer) -> its groups' reduce-scatter (eq. 16)."""
    unit_gather_ms: dict
    """Stages 2 and 3: unit -> its groups' all-gather (eq. 16)."""
    owned_layer_fraction: dict
    """Stages 2 and 3: device -> owned share of its layers' weights (stage 3 keeps these, eq. 18)."""


def sync_terms(cluster: ClusterSpec, plan) -> SyncTerms:
    """``SyncTerms`` of ``plan`` from its peer groups (``baton.peers``)."""
    spec = plan.model
    held, owned = held_params(plan), owned_params(plan)
    buffer = {i: 0.0 for i in held}
    reduce_ms, gather_ms, layer_held, layer_owned = {}, {}, {i: 0.0 for i in held}, {i: 0.0 for i in held}
    dp = reduce = 0.0
    if plan.zero_stage < 2:
        groups = peer_groups(plan)
        largest = [max(owned_fractions(plan, g)) * g.num_params for g in groups]
        for g, big, whole in zip(groups, largest, whole_groups(plan)):
            for h in g.holders:
                buffer[h] = max(buffer[h], sync_buffer_bytes(spec, g.size, big, plan.zero_stage, num_params=g.num_params,
                                                             whole=whole))
        dp = data_parallel_sync_ms(cluster, spec, [(g.holders, g.num_params, big) for g, big in zip(groups, largest)],
                                   plan.zero_stage)
        reduce = dp if plan.zero_stage == 0 else unit_pass_ms(cluster, spec, [(g.holders, big) for g, big in zip(groups, largest)])
    else:
        for unit, gs in unit_groups(plan):
            shards = [(g.holders, max(owned_fractions(plan, g)) * g.num_params) for g in gs]
            reduce_ms[unit] = unit_pass_ms(cluster, spec, shards, "reduce_scatter")
            gather_ms[unit] = unit_pass_ms(cluster, spec, shards, "all_gather")
            for g in gs:
                fr = owned_fractions(plan, g)
                for h, f in zip(g.holders, fr):
                    buffer[h] = max(buffer[h], sync_buffer_bytes(spec, g.size, max(fr) * g.num_params, 1))
                    if unit is not EDGES:
                        layer_held[h] += g.num_params
                        layer_owned[h] += f * g.num_params
    return SyncTerms(dp_sync_ms=dp, dp_reduce_ms=reduce, owned_fraction={i: owned[i] / held[i] for i in held}, buffer_bytes=buffer, unit_reduce_ms=reduce_ms, unit_gather_ms=gather_ms,
                     owned_layer_fraction={i: layer_owned[i] / layer_held[i] for i in held if layer_held[i]})


def max_layers_with_sync_buffer(slot: DeviceSlot, spec: ModelSpec, param_bytes: float, edge: EdgeCost, cap: int, *,
                                owned_fraction, group_size: int, shard_params_per_layer, shard_params_fixed) -> np.ndarray:
    """Eq. 8's second branch with eq. 14: the largest L in [0, cap] at which the device still fits while its
    group syncs at stage 1, 2 W + O(owned_fraction) + sync buffer + reserve <= C, when the group's largest
    shard holds ``shard_params_per_layer * L + shard_params_fixed`` parameters; -1 when not even L = 0 fits.
    (The first branch, activations and recompute buffer, is ``max_layers_that_fit``'s: the evaluator's peak
    is the larger of the two, so a device fits iff both do.) ``owned_fraction`` and the shard figures may be
    numpy arrays; they broadcast together and the answer has their shape. Exact: every L is checked with
    ``device_memory`` itself, the comparison the evaluator makes."""
    shape = np.broadcast(np.asarray(owned_fraction), np.asarray(shard_params_per_layer), np.asarray(shard_params_fixed)).shape
    L = np.arange(cap + 1, dtype=np.int64).reshape((1,) * len(shape) + (cap + 1,))
    own = np.asarray(owned_fraction, dtype=float)[..., None]
    shard = np.asarray(shard_params_per_layer, dtype=float)[..., None] * L + np.asarray(shard_params_fixed, dtype=float)[..., None]
    no_activations = EdgeCost(fwd_ms=edge.fwd_ms, bwd_ms=edge.bwd_ms, saved_bytes=0.0, head_saved_bytes=0.0,
                              param_bytes=edge.param_bytes)
    peak = device_memory(slot, spec, L, param_bytes=param_bytes, held_bytes=0.0, transient_bytes=0.0, edge=no_activations,
                         owned_fraction=own, sync_buffer_bytes=sync_buffer_bytes(spec, group_size, shard, 1)).peak_bytes
    fits = np.broadcast_to(peak <= slot.memory_bytes, shape + (cap + 1,))
    count = np.where(fits.all(axis=-1), cap + 1, np.argmin(fits, axis=-1))  # memory grows with L: a prefix fits
    return count - 1


def sync_schedule_ms(groups: Sequence[tuple[Sequence[str], float]]) -> float:
    """Eq. 15: T_dp when every device runs its groups' blocking collectives in the given order: a group
    starts when all its holders are free and holds them for its time; the last to finish ends the sync.
    Groups of disjoint holders run side by side (for replicas of one shape: the slowest position)."""
    free: dict[str, float] = {}
    end = 0.0
    for holders, ms in groups:
        if len(holders) <= 1:
            continue
        t = max(free.get(h, 0.0) for h in holders) + ms
        for h in holders:
            free[h] = t
        end = max(end, t)
    return end


# -- stages 2 and 3: layered accumulation (eq. 16-18) -------------------------------------------------


def unit_pass_ms(cluster: ClusterSpec, spec: ModelSpec, groups: Sequence[tuple[Sequence[str], float]],
                 kind: str = "reduce_scatter") -> float:
    """Eq. 16: one ring pass (``kind``: a reduce-scatter or an all-gather) over groups = (holders, largest
    shard in parameters), padded to the largest shard, the groups scheduled as ``sync_schedule_ms`` does
    (a unit's groups at stages 2-3; every group at stage 1, eq. 15)."""
    def one(holders, big):
        link = cluster.slowest_link(list(holders)) if len(holders) > 1 else None
        return ring_step_ms(big * spec.dtype_bytes, len(holders), link, kind)
    return sync_schedule_ms([(h, one(h, big)) for h, big in groups])


@dataclass(frozen=True, kw_only=True, slots=True)
class LayeredParts:
    """A one-stage replica's compute per micro-batch between the collectives of stages 2 and 3 (eq. 17):
    eq. 9's forward and backward cut where the collectives fall; each part is the slowest TP rank's,
    with the group's all-reduces."""

    emb_fwd_ms: float
    """Embedding forward (and its vocabulary-parallel sum)."""
    layer_fwd_ms: float
    """One layer's forward: blocks at their slowest rank plus both in-layer all-reduces."""
    head_fwd_ms: float
    """Final LayerNorm, LM head and loss forward (and the loss's reductions)."""
    head_bwd_ms: float
    """Their backward (and the head's input-gradient sum)."""
    layer_bwd_ms: float
    """One layer's backward, recomputation and all-reduces included."""
    emb_bwd_ms: float
    """Embedding backward."""


def group_layer_ms(fwd_blocks: Sequence[Sequence[float]], bwd_blocks: Sequence[Sequence[float]]) -> tuple[float, float]:
    """Eq. 9's layer of a tensor-parallel group: every block runs at its slowest rank (the all-reduce after it
    waits for all), so (forward, backward) = sum over blocks of the max over ranks; ``*_blocks[rank][block]``."""
    return (sum(max(f[k] for f in fwd_blocks) for k in range(len(BLOCKS))),
            sum(max(b[k] for b in bwd_blocks) for k in range(len(BLOCKS))))


def layered_parts(cluster: ClusterSpec, spec: ModelSpec, micro_batch: int, ids: Sequence[str], profiles: Sequence[Profile],
                  shares: Sequence[float], costs: Sequence[LayerCost]) -> LayeredParts:
    """``LayeredParts`` of a one-stage group: device ``ids`` with their tables, shares and layer costs."""
    ar = layer_allreduce_ms(cluster, spec, micro_batch, ids)
    x, loss = edge_comms_ms(cluster, spec, micro_batch, ids)
    emb = [launched_ms(pr.cost(EMBEDDING, micro_batch, r)) for pr, r in zip(profiles, shares)]
    head = [launched_ms(pr.cost(HEAD, micro_batch, r)) for pr, r in zip(profiles, shares)]
    f_layer, b_layer = group_layer_ms([c.block_fwd_ms() for c in costs], [c.block_bwd_ms() for c in costs])
    return LayeredParts(
        emb_fwd_ms=max(f for f, _ in emb) + x, layer_fwd_ms=f_layer + ar,
        head_fwd_ms=max(f for f, _ in head) + loss, head_bwd_ms=max(b for _, b in head) + x,
        layer_bwd_ms=b_layer + ar, emb_bwd_ms=max(b for _, b in emb))


@dataclass(frozen=True, kw_only=True, slots=True)
class LayeredIteration:
    """Eq. 17's answer."""

    iteration_ms: float
    """The chain of segments, each as long as its slowest replica, and the collectives between them."""
    collectives_ms: float
    """The collectives' part (every ring pass of eq. 16 the iteration runs)."""
    replica_compute_ms: tuple[float, ...]
    """Each replica's own compute (no waits), its optimizer step excluded."""
    noise_wait_ms: float = 0.0
    """What noise in the replicas' times adds to the segments over their predicted maxima (eq. 19)."""


_PART_FIELDS = {("F", EMBEDDING): "emb_fwd_ms", ("F", HEAD): "head_fwd_ms", ("B", HEAD): "head_bwd_ms",
                ("B", EMBEDDING): "emb_bwd_ms", ("F", "layer"): "layer_fwd_ms", ("B", "layer"): "layer_bwd_ms"}
"""The ``LayeredParts`` field that prices a pass of the layered schedule, by (direction, part)."""


@functools.lru_cache(maxsize=256)
def layered_chain(zero_stage: int, num_layers: int) -> tuple[tuple[str, object], ...]:
    """Eq. 17's order of one iteration at stage 2 or 3, read from ``baton.schedules.layer_by_layer`` with one
    micro-batch (each pass of a part runs once per micro-batch, back to back): ("compute", the LayeredParts
    fields of one pass over a part, the head's forward and backward together), ("gather", unit), ("reduce",
    unit) (eq. 16's passes of a unit: ``EDGES`` or a layer index) and ("optimizer", None). The evaluator prices
    it (``layered_iteration_ms``); the runtime's report counts each unit's gathers from it."""
    chain: list[tuple[str, object]] = []
    last_part = object()
    for a in layer_by_layer(zero_stage, num_layers, 1).devices[0]:
        if isinstance(a, (Forward, Backward)):
            name = _PART_FIELDS[("F" if isinstance(a, Forward) else "B", "layer" if isinstance(a.part, int) else a.part)]
            if chain and chain[-1][0] == "compute" and a.part == last_part:
                chain[-1] = ("compute", chain[-1][1] + (name,))
            else:
                chain.append(("compute", (name,)))
            last_part = a.part
            continue
        last_part = object()
        if isinstance(a, Gather):
            chain.append(("gather", a.unit))
        elif isinstance(a, ReduceScatter):
            chain.append(("reduce", a.unit))
        elif isinstance(a, OptimizerStep):
            chain.append(("optimizer", None))
    return tuple(chain)


def layered_iteration_ms(zero_stage: int, num_layers: int, replicas: Sequence[tuple[int, LayeredParts]],
                         edge_pass_ms: float, layer_pass_ms: Sequence[float], optimizer_ms: float, *,
                         edge_gather_ms: float | None = None, layer_gather_ms: Sequence[float] | None = None,
                         replica_time_cv: float = 0.0) -> LayeredIteration:
    """Eq. 17 for stage 2 or 3 over ``layered_chain``: ``replicas`` = (micro-batches, parts); ``edge_pass_ms``
    and ``layer_pass_ms[l]`` the unit's reduce-scatter, ``edge_gather_ms`` and ``layer_gather_ms[l]`` its
    all-gather (eq. 16; the reduce-scatter's when not given); ``optimizer_ms`` the slowest device's Adam
    step. Every replica holds every unit, so each collective waits for the last replica to reach it
    (eq. 19 with the cluster's ``replica_time_cv``: by linearity of expectation, one speed factor per
    replica and step or one per segment give the same expected sum of segments)."""
    L = num_layers
    passes = {"reduce": {EDGES: edge_pass_ms, **dict(enumerate(layer_pass_ms))},
              "gather": {EDGES: edge_pass_ms if edge_gather_ms is None else edge_gather_ms,
                         **dict(enumerate(layer_pass_ms if layer_gather_ms is None else layer_gather_ms))}}
    total, pending, syncs, noise = 0.0, [0.0] * len(replicas), 0.0, 0.0
    for kind, what in layered_chain(zero_stage, L):
        if kind == "compute":
            pending = [a + m * sum(getattr(pt, name) for name in what) for a, (m, pt) in zip(pending, replicas)]
        elif kind == "optimizer":
            pending = [a + optimizer_ms for a in pending]
        else:
            last = last_arrival_ms(pending, replica_time_cv)
            ms = passes[kind][what]
            total, noise, syncs = total + last + ms, noise + last - max(pending), syncs + ms
            pending = [0.0] * len(replicas)
    last = last_arrival_ms(pending, replica_time_cv)
    total, noise = total + last, noise + last - max(pending)
    own = tuple(m * (pt.emb_fwd_ms + L * pt.layer_fwd_ms + pt.head_fwd_ms + pt.head_bwd_ms + L * pt.layer_bwd_ms + pt.emb_bwd_ms)
                for m, pt in replicas)
    return LayeredIteration(iteration_ms=total, collectives_ms=syncs, replica_compute_ms=own, noise_wait_ms=noise)


def layered_iteration_of(sync: "SyncTerms", zero_stage: int, num_layers: int, replicas: Sequence[tuple[int, LayeredParts]],
                         optimizer_ms: float, replica_time_cv: float) -> LayeredIteration:
    """Eq. 17 with the units' reduce-scatters and all-gathers of ``sync`` (``sync_terms`` of the plan) and the
    cluster's ``replica_time_cv``: what the evaluator and the planner both call."""
    layers = range(num_layers)
    return layered_iteration_ms(zero_stage, num_layers, replicas, sync.unit_reduce_ms[EDGES],
                                [sync.unit_reduce_ms[layer] for layer in layers], optimizer_ms,
                                edge_gather_ms=sync.unit_gather_ms[EDGES],
                                layer_gather_ms=[sync.unit_gather_ms[layer] for layer in layers],
                                replica_time_cv=replica_time_cv)


@functools.lru_cache(maxsize=64)
def model_flops_per_sample(spec: ModelSpec, seq_len: int | None = None) -> float:
    """Training FLOPs of one sample: 3x the forward of every layer plus the LM head (no recompute)."""
    s = seq_len or spec.seq_len
    per_layer = sum(operator_flops(spec, o, 1, s) for o in layer_operators(spec))
    head = 2 * s * spec.hidden_dim * spec.vocab_size
    return 3 * (spec.num_layers * per_layer + head)


def model_flops_per_s(spec: ModelSpec, global_batch: int, iteration_ms: float) -> float:
    """Model FLOPs per second of an iteration (recomputation not counted): MFU's numerator."""
    return global_batch * model_flops_per_sample(spec) / (iteration_ms / 1e3) if iteration_ms > 0 else 0.0


def peak_flops(gpus, spec: ModelSpec) -> float:
    """MFU's denominator: the sum of the catalog peaks of ``gpus`` (GpuType) for the model's dtype, FLOP/s."""
    return sum(g.peak_tflops(spec.dtype) for g in gpus) * 1e12
