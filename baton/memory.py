"""Which activation tensors of a layer stay alive under a recompute choice (docs/cost-model.md, section 3).

Recomputed operators run in *segments*: maximal runs of consecutive recomputed operators that do not
cross one of the layer's two all-reduces (ranks of a TP group recompute different sets, so a forward
collective can never be replayed). A tensor t (produced by operator p, saved by its "needers", read by
its "consumers") is held from the forward pass to the backward pass when
  (a) some needer of t is not recomputed (it keeps t for its own backward), or
  (b) some consumer of t is recomputed but p is not in the consumer's segment (t is where that
      segment's recomputation starts).
Recomputing an operator therefore frees its output only if every operator that saves that output is
recomputed too, in the same segment. The layer input and the all-reduce results have producers that
are never recomputed.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from baton.model_spec import ModelSpec
from baton.operators import ALLREDUCE, ALLREDUCE_OUTPUTS, LAYER_INPUT, Operator, layer_operators, tensor_sizes


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorRole:
    """Who creates, keeps and reads one tensor of a layer."""

    name: str
    """Tensor name."""
    producer: str
    """Operator that creates it; LAYER_INPUT or ALLREDUCE for tensors never recomputed."""
    needers: tuple[str, ...]
    """Operators whose backward keeps it."""
    consumers: tuple[str, ...]
    """Operators that read it in the forward pass."""


def tensor_roles(spec: ModelSpec) -> dict[str, TensorRole]:
    """Roles of every tensor that one layer keeps or reads (the layer output belongs to the next layer)."""
    ops = layer_operators(spec)
    producer: dict[str, str] = {LAYER_INPUT: LAYER_INPUT}
    for full in ALLREDUCE_OUTPUTS.values():
        producer[full] = ALLREDUCE
    needers: dict[str, list[str]] = {}
    consumers: dict[str, list[str]] = {}
    for op in ops:
        for t in op.outputs:
            producer.setdefault(t, op.name)
        for t in op.saves:
            needers.setdefault(t, []).append(op.name)
            producer.setdefault(t, op.name)  # private tensors (masks, statistics)
        for t in op.inputs:
            consumers.setdefault(t, []).append(op.name)
    names = [t for t in producer if t != "layer_output"]
    return {t: TensorRole(name=t, producer=producer[t], needers=tuple(needers.get(t, ())), consumers=tuple(consumers.get(t, ())))
            for t in names}


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerOrder:
    """Position and all-reduce region of every operator of a layer, for the segment test."""

    position: dict
    """Operator name -> index in execution order."""
    region: dict
    """Operator name -> how many all-reduces precede it within the layer (0, 1 or 2)."""
    names: tuple
    """Operator names in execution order."""


def layer_order(spec: ModelSpec) -> LayerOrder:
    position, region, names = {}, {}, []
    r = 0
    for i, op in enumerate(layer_operators(spec)):
        position[op.name], region[op.name] = i, r
        names.append(op.name)
        if any(t in ALLREDUCE_OUTPUTS for t in op.outputs):
            r += 1
    return LayerOrder(position=position, region=region, names=tuple(names))


def same_segment(producer: str, consumer: str, recompute: frozenset[str], order: LayerOrder) -> bool:
    """True when both operators are recomputed in one segment (no kept operator or all-reduce between)."""
    if producer not in order.position or consumer not in order.position:
        return False  # the layer input and all-reduce results are never recomputed
    if order.region[producer] != order.region[consumer]:
        return False
    lo, hi = order.position[producer], order.position[consumer]
    return all(order.names[i] in recompute for i in range(lo, hi + 1))


def is_held(role: TensorRole, recompute: frozenset[str], order: LayerOrder) -> bool:
    """Rule (a) or (b) above."""
    if any(n not in recompute for n in role.needers):
        return True
    return any(c in recompute and not same_segment(role.producer, c, recompute, order) for c in role.consumers)


def is_rematerialised(role: TensorRole, recompute: frozenset[str], order: LayerOrder) -> bool:
    """True when the backward pass needs t and must recompute it (it was not held)."""
    return bool(role.needers) and not is_held(role, recompute, order)


def tensor_bytes(spec: ModelSpec, micro_batch: int, share: float, op_saved: dict[str, float], op_output: dict[str, float],
                 seq_len: int | None = None) -> dict[str, float]:
    """Bytes of each tensor, scaled so each operator's tensors add up to its profiled saved/output bytes.

    Analytic sizes give the split between the tensors of one operator; the profile table (measured or
    derived) gives the operator's total. For derived tables the scale factors are exactly 1.
    """
    sizes = tensor_sizes(spec, micro_batch, seq_len)
    ops = {o.name: o for o in layer_operators(spec)}
    roles = tensor_roles(spec)
    analytic = {t: sizes[t].bytes(share) for t in roles}

    def scale_saved(op: Operator) -> float:
        total = sum(sizes[t].bytes(share) for t in op.saves)
        return op_saved[op.name] / total if total > 0 else 1.0

    def scale_output(op: Operator) -> float:
        total = sum(sizes[t].bytes(share) for t in op.outputs)
        return op_output[op.name] / total if total > 0 else 1.0

    partial_of = {full: part for part, full in ALLREDUCE_OUTPUTS.items()}
    result = {}
    for t, role in roles.items():
        if role.needers:
            result[t] = analytic[t] * scale_saved(ops[role.needers[0]])
        elif role.producer in ops:
            result[t] = analytic[t] * scale_output(ops[role.producer])
        elif t in partial_of:
            producer = next(o for o in ops.values() if partial_of[t] in o.outputs)
            result[t] = analytic[t] * scale_output(producer)
        else:
            result[t] = analytic[t]
    return result


class RecomputeSpace:
    """The liveness matrix of eq. 3-4 over candidate (recompute set, offload set) pairs of one layer.

    Row i is one recompute set (``recompute_set(i)``) with the tensors it keeps in host memory between the
    passes (``offload_set(i)``, eq. 3o; empty in a space built without offload), column j one tensor
    (``tensors[j]``); ``held[i, j]`` is rule (a)/(b) of ``is_held`` and ``remat[i, j]`` is
    ``is_rematerialised``, the same functions the evaluator uses, so every consumer (the evaluator through
    ``layer_cost``, the planner's pruning and memory limits, the bounds) reads one liveness rule. Sets are bit
    masks over the operators in execution order. Build it with ``recompute_space`` (memoised per model shape).
    """

    def __init__(self, spec: ModelSpec, universe: list[frozenset[str]] | None = None, *, offload: str = "none",
                 offload_sets: list[frozenset[str]] | None = None):
        self._spec = spec
        ops = layer_operators(spec)
        self.ops: list[str] = [o.name for o in ops]
        """Operator names in execution order (bit k of a mask is ops[k])."""
        self.blocks: list[str] = [o.block for o in ops]
        """Block of each operator."""
        bit = {name: 1 << i for i, name in enumerate(self.ops)}
        if universe is None:
            sets = np.arange(1 << len(self.ops), dtype=np.int64)
        else:
            unknown = {op for r in universe for op in r} - set(self.ops)
            if unknown:
                raise ValueError(f"unknown operators in recompute universe: {sorted(unknown)}")
            sets = np.array(sorted({sum(bit[o] for o in r) for r in universe}), dtype=np.int64)
        roles = tensor_roles(spec)
        order = layer_order(spec)
        self.tensors: list[str] = list(roles)
        """Tensor names, the columns of ``held``, ``remat`` and ``off``."""
        held = np.zeros((len(sets), len(self.tensors)), dtype=bool)
        remat = np.zeros_like(held)
        for i, mask in enumerate(sets):
            r = frozenset(name for k, name in enumerate(self.ops) if int(mask) >> k & 1)
            for j, t in enumerate(self.tensors):
                held[i, j] = is_held(roles[t], r, order)
                remat[i, j] = is_rematerialised(roles[t], r, order)
        rows, off = _offload_rows(spec, self.tensors, sets, held, offload, offload_sets)
        masks = sets[rows]
        self.masks: np.ndarray = masks
        """One int64 bit mask per row: its recompute set (a set repeats, once per offload choice)."""
        self.held: np.ndarray = held[rows].astype(float)
        """held[i, j] = 1 when row i keeps tensor j from forward to backward (eq. 3), on the device or the host."""
        self.remat: np.ndarray = remat[rows].astype(float)
        """remat[i, j] = 1 when row i re-creates tensor j in the backward pass (eq. 4)."""
        self.off: np.ndarray = off.astype(float)
        """off[i, j] = 1 when row i keeps the held tensor j in host memory between the passes (eq. 3o)."""
        self.op_bits: np.ndarray = ((masks[:, None] >> np.arange(len(self.ops))) & 1).astype(float)
        """op_bits[i, k] = 1 when row i recomputes ops[k]."""
        self.offload_mode: str = offload
        """'none' (no row offloads), 'blocks' (every recompute set with each block's held tensors on the host or
        not), or 'given' (the rows of ``offload_sets``)."""
        self.universe: tuple | None = None if universe is None else tuple(universe)
        """The recompute sets it was built over (None: every subset of the operators)."""

    def recompute_set(self, i: int) -> frozenset[str]:
        m = int(self.masks[i])
        return frozenset(name for k, name in enumerate(self.ops) if m >> k & 1)

    def offload_set(self, i: int) -> frozenset[str]:
        """The tensors row ``i`` keeps in host memory (``DeviceShare.offload``)."""
        return frozenset(t for j, t in enumerate(self.tensors) if self.off[i, j])

    @functools.cached_property
    def offloads(self) -> np.ndarray:
        """Per row: True when it keeps any tensor in host memory."""
        return self.off.any(axis=1)

    @property
    def plain(self) -> "RecomputeSpace":
        """The same recompute sets without offloading: what the parts of the planner that do not offload search
        (interleaved groups, replicas of different shapes, sharding stages 2 and 3)."""
        return self if self.offload_mode == "none" else recompute_space(self._spec, self.universe)

    def __len__(self) -> int:
        return len(self.masks)


def _offload_rows(spec: ModelSpec, tensors: list[str], sets: np.ndarray, held: np.ndarray, mode: str,
                  offload_sets: list[frozenset[str]] | None) -> tuple[np.ndarray, np.ndarray]:
    """(row -> index into ``sets``, off matrix) of a space. 'blocks': per recompute set, nothing offloaded, and
    every non-empty union of its blocks' held tensors (a block offloads all it holds or none of it: the planner's
    stated offload space, solver/README.md); fused attention's q, k, v are one block's, so they move together.
    'given': set i with ``offload_sets[i]``."""
    n = len(sets)
    if mode == "none":
        return np.arange(n), np.zeros((n, len(tensors)), dtype=bool)
    if mode == "given":
        if offload_sets is None or len(offload_sets) != n:
            raise ValueError("a space of given offload sets needs one offload set per recompute set")
        off = np.array([[t in o for t in tensors] for o in offload_sets], dtype=bool).reshape(n, len(tensors))
        return np.arange(n), off
    if mode != "blocks":
        raise ValueError(f"unknown offload mode {mode!r}")
    block_of = tensor_blocks(spec)
    in_block = {b: np.array([block_of[t] == b for t in tensors]) for b in ("attn", "mlp")}
    rows, off = [], []
    for i in range(n):
        parts = [held[i] & in_block[b] for b in ("attn", "mlp")]
        parts = [p for p in parts if p.any()]
        options = [np.zeros(len(tensors), dtype=bool)] + parts + ([parts[0] | parts[1]] if len(parts) == 2 else [])
        rows += [i] * len(options)
        off += options
    return np.array(rows, dtype=np.int64), np.array(off, dtype=bool)


@functools.lru_cache(maxsize=64)
def recompute_space(spec: ModelSpec, universe: tuple[frozenset[str], ...] | None = None, *,
                    offload: bool = False) -> RecomputeSpace:
    """The liveness matrix for ``spec`` over ``universe`` (default: every subset of the operators), with
    ``offload`` also every block-level offload choice of each set (``_offload_rows``).

    Memoised so that the planner, the bounds and the evaluator share one matrix (and one cache key)
    per model.
    """
    return RecomputeSpace(spec, None if universe is None else list(universe), offload="blocks" if offload else "none")


@functools.lru_cache(maxsize=1 << 12)
def choice_space(spec: ModelSpec, recompute: frozenset[str], offload: frozenset[str]) -> RecomputeSpace:
    """The one-row space of a device's (recompute, offload) choice: the evaluator prices a plan's device with its
    row, so its numbers are those the planner's row of the same choice has."""
    return RecomputeSpace(spec, [recompute], offload="given", offload_sets=[offload])


FUSED_QKV = ("q", "k", "v")
"""Fused GPT attention's q, k and v: views of one qkv storage, offloaded all together or not at all."""


def offload_problem(spec: ModelSpec, recompute: frozenset[str], offload: frozenset[str]) -> str | None:
    """Why a layer of ``spec`` under ``recompute`` cannot keep exactly the tensors ``offload`` in host memory between
    its passes (None: it can). Offloaded tensors must exist and be held (eq. 3): a tensor nobody holds has nothing
    to move; and a storage moves whole, so fused attention's q, k and v go together."""
    roles = tensor_roles(spec)
    unknown = sorted(set(offload) - set(roles))
    if unknown:
        return f"unknown tensors {', '.join(unknown)} of a layer (known: {', '.join(roles)})"
    order = layer_order(spec)
    idle = sorted(n for n in offload if not is_held(roles[n], frozenset(recompute), order))
    if idle:
        return (f"{', '.join(idle)} not held from the forward to the backward pass under recompute "
                f"[{', '.join(sorted(recompute))}]: there is nothing to offload")
    if spec.attention == "fused" and not spec.llama and 0 < len(set(FUSED_QKV) & set(offload)) < 3:
        return (f"{', '.join(sorted(set(FUSED_QKV) & set(offload)))} but not all of q, k, v: in fused attention they are "
                "views of one qkv storage, which stays on the device while any of them is kept")
    return None


def tensor_blocks(spec: ModelSpec) -> dict[str, str]:
    """Block ('attn' or 'mlp') of every tensor of ``tensor_roles``: its producer's, an all-reduce result that of the
    partial sum it completes, the layer input the first block's. Its offload copies run beside that block (eq. 2o)."""
    ops = layer_operators(spec)
    block = {o.name: o.block for o in ops}
    made_in = {t: o.block for o in ops for t in o.outputs}
    full_of = {full: made_in[partial] for partial, full in ALLREDUCE_OUTPUTS.items() if partial in made_in}
    first = ops[0].block
    return {t: first if r.producer == LAYER_INPUT else full_of[t] if r.producer == ALLREDUCE else block[r.producer]
            for t, r in tensor_roles(spec).items()}


def held_tensors(spec: ModelSpec, recompute: frozenset[str]) -> tuple[str, ...]:
    """The tensors a layer holds from its forward to its backward under ``recompute`` (eq. 3), in ``tensor_roles``
    order: under every operator recomputed, its boundary (what Cephalo offloads)."""
    roles, order = tensor_roles(spec), layer_order(spec)
    return tuple(t for t, role in roles.items() if is_held(role, frozenset(recompute), order))

