"""The cost model as pure functions: every equation of docs/cost-model.md, in the same order.

Nothing here knows about solvers. ``baton.evaluate`` assembles a whole plan from these pieces and the
MILP in ``solver/`` encodes the same equations; tests check the two agree.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from baton.cluster import ClusterSpec, Link
from baton.model_spec import ModelSpec
from baton.memory import layer_activation_bytes, layer_order, tensor_bytes, tensor_roles
from baton.operators import EMBEDDING, HEAD, layer_operators
from baton.profile import Profile

BLOCKS = ("attn", "mlp")
ALLREDUCES_PER_LAYER = 2
"""All-reduces per layer in each direction: after out_proj and fc2 forward, at qkv and fc1 inputs backward."""

ADAM_STATE_BYTES_PER_PARAM = 8
"""Two fp32 Adam moments."""
MASTER_WEIGHT_BYTES_PER_PARAM = 4
"""fp32 master copy kept when training in fp16/bf16 (none for fp32 training)."""
OPTIMIZER_TRAFFIC_BYTES_PER_PARAM = 36
"""DRAM bytes one Adam step moves per parameter (read grad, weight, master, two moments; write back)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerCost:
    """One device's cost for one layer and one micro-batch (eq. 2-4)."""

    fwd_ms: dict
    """Block ('attn', 'mlp') -> forward ms."""
    bwd_ms: dict
    """Block -> backward ms, without recomputation."""
    recompute_ms: dict
    """Block -> forward ms of the block's recomputed operators."""
    held_bytes: float
    """Activation bytes kept per in-flight micro-batch."""
    transient_bytes: float
    """Bytes re-created while this layer runs its backward."""
    param_bytes: float
    """Parameter bytes this device holds for the layer."""


def layer_cost(profile: Profile, spec: ModelSpec, micro_batch: int, share: float, recompute: frozenset[str] | set[str] = frozenset()) -> LayerCost:
    """Eq. 2 (block times), eq. 3 (held activations), eq. 4 (recompute buffer) for one device.

    Memoised: planners evaluate the same (device type, micro-batch, share, recompute set) many times.
    The result is shared between callers and must not be modified.
    """
    return _layer_cost(profile, spec, micro_batch, share, frozenset(recompute))


@functools.lru_cache(maxsize=1 << 16)
def _layer_cost(profile: Profile, spec: ModelSpec, micro_batch: int, share: float, recompute: frozenset[str]) -> LayerCost:
    ops = layer_operators(spec)
    costs = {o.name: profile.cost(o.name, micro_batch, share if o.tp_split else 1.0) for o in ops}
    fwd = {b: 0.0 for b in BLOCKS}
    bwd = {b: 0.0 for b in BLOCKS}
    rec = {b: 0.0 for b in BLOCKS}
    for o in ops:
        c = costs[o.name]
        fwd[o.block] += c.fwd_ms
        bwd[o.block] += c.bwd_ms
        if o.name in recompute:
            rec[o.block] += c.fwd_ms
    sizes = tensor_bytes(spec, micro_batch, share, {k: v.saved_bytes for k, v in costs.items()},
                         {k: v.output_bytes for k, v in costs.items()}, profile.seq_len)
    held, transient = layer_activation_bytes(tensor_roles(spec), sizes, recompute, layer_order(spec))
    params = sum(c.param_bytes for c in costs.values())
    return LayerCost(fwd_ms=fwd, bwd_ms=bwd, recompute_ms=rec, held_bytes=held, transient_bytes=transient, param_bytes=params)


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


def p2p_ms(cluster: ClusterSpec, senders: list[str], receivers: list[str], num_bytes: float) -> float:
    """Eq. 6: receiver j takes the full tensor from sender j mod n_senders; a sender's sends are serial."""
    per_sender = [0.0] * len(senders)
    for j, r in enumerate(receivers):
        i = j % len(senders)
        if senders[i] != r:
            per_sender[i] += cluster.link(senders[i], r).transfer_ms(num_bytes)
    return max(per_sender)


def optimizer_bytes(param_bytes: float, spec: ModelSpec) -> float:
    """Eq. 7: Adam moments and (for fp16/bf16) fp32 master weights for ``param_bytes`` of weights."""
    params = param_bytes / spec.dtype_bytes
    master = MASTER_WEIGHT_BYTES_PER_PARAM if spec.dtype_bytes < 4 else 0
    return params * (ADAM_STATE_BYTES_PER_PARAM + master)


def optimizer_step_ms(param_bytes: float, spec: ModelSpec, bandwidth_gb_per_s: float,
                      measured: tuple[float, float] | None = None) -> float:
    """Eq. 10: the Adam step scales with the weights it updates: from a timed step of ``measured =
    (param_bytes, ms)`` when the device's table has one, else bandwidth-bound (traffic per parameter
    over DRAM bandwidth)."""
    if measured is not None:
        return param_bytes * measured[1] / measured[0]
    return param_bytes / spec.dtype_bytes * OPTIMIZER_TRAFFIC_BYTES_PER_PARAM / (bandwidth_gb_per_s * 1e9) * 1e3


def in_flight_microbatches(stage: int, num_stages: int, num_microbatches: int) -> int:
    """Under 1F1B stage s holds activations of min(p - s, m) micro-batches at its peak."""
    return min(num_stages - stage, num_microbatches)


def edge_param_bytes(profile: Profile, spec: ModelSpec, micro_batch: int, *, first: bool, last: bool) -> float:
    """Embedding on the first stage, final LN on the last, and the tied LM head on a last stage that is not also first."""
    total = 0.0
    if first:
        total += profile.cost(EMBEDDING, micro_batch).param_bytes
    if last:
        total += profile.cost(HEAD, micro_batch).param_bytes
        if not first:
            total += spec.vocab_size * spec.hidden_dim * spec.dtype_bytes
    return total


def model_flops_per_sample(spec: ModelSpec, seq_len: int | None = None) -> float:
    """Training FLOPs of one sample: 3x the forward of every layer plus the LM head (no recompute)."""
    from baton.operators import operator_flops

    s = seq_len or spec.seq_len
    per_layer = sum(operator_flops(spec, o, 1, s) for o in layer_operators(spec))
    head = 2 * s * spec.hidden_dim * spec.vocab_size
    return 3 * (spec.num_layers * per_layer + head)
