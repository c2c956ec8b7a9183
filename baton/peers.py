"""Which devices hold the same parameters, across data-parallel replicas of any shapes (docs/cost-model.md,
section 9).

Every replica holds the whole model once, cut its own way: layers over stages, each layer's units over a
stage's tensor-parallel ranks, the vocabulary over the first and last stage's ranks. After the backward
pass each replica has its own gradient; data parallelism sums them. A *piece* of the parameters is held
whole by one or more devices of every replica (TP ranks hold copies of a stage's LayerNorms; the first
and last stage both hold the tied embedding's rows). Pieces are cut at every boundary any replica uses,
so each piece has a list of *copies* per replica.

The sum over replicas needs every replica counted once. When every replica has the same number ``c`` of
copies of a piece, copy ``j`` of each replica forms a peer set (``c`` sets, each holder weighing 1);
otherwise all copies form one set and each holder adds its gradient divided by its replica's copy count.
Pieces with the same holders are one ``PeerGroup``: one collective per group moves all of them. For
replicas of one shape this gives exactly one group per (stage, TP rank) position, the position's peers.

With ``zero_stage`` 1 each holder of a group owns ``shard_sizes`` of the group's parameters: its
``shard_ratio`` over the group's sum (equal parts when no ratios are given). The cost model prices the
groups' collectives and the owned parts' optimizer state; the runtime moves exactly these groups.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from fractions import Fraction
from typing import NamedTuple

from baton.model_spec import ModelSpec
from baton.operators import layer_operators, padded_vocab


@dataclass(frozen=True, kw_only=True, slots=True)
class Block:
    """A piece of the model's parameters that every holder of a group holds whole."""

    part: str
    """'units' (a layer's TP-split weights: heads and FFN columns in [lo, hi)), 'replicated' (a layer's
    LayerNorms and row-parallel biases), 'vocab' (token-embedding rows in [lo, hi) of the padded
    vocabulary), 'head' (an untied LM head's rows in [lo, hi)), 'positions' (position embedding) or
    'final_norm' (final LayerNorm)."""
    layer: int | None
    """Transformer layer for 'units' and 'replicated', None otherwise."""
    lo: Fraction
    """Start of the piece as a fraction of the split dimension (0 for unsplit parts)."""
    hi: Fraction
    """End of the piece (1 for unsplit parts)."""
    num_params: int
    """Parameters in the piece."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PeerGroup:
    """Devices that hold the same pieces and sum their gradients in one collective."""

    holders: tuple[str, ...]
    """Device ids, replica by replica (stage, then TP rank, within one)."""
    replicas: tuple[int, ...]
    """Replica of each holder."""
    copies: tuple[int, ...]
    """Holders in the same replica as each holder (it adds gradient / copies); 1 for matched copies."""
    blocks: tuple[Block, ...]
    """The pieces, in the model's order (vocabulary, positions, layers, final norm)."""
    num_params: int = field(init=False)
    """Parameters of all its pieces (summed once: the sync's terms read it per group and holder)."""

    def __post_init__(self):
        object.__setattr__(self, "num_params", sum(b.num_params for b in self.blocks))

    @property
    def size(self) -> int:
        return len(self.holders)


def split_param_count(spec: ModelSpec) -> int:
    """Parameters of one layer that tensor parallelism splits by units (at share 1)."""
    from baton.operators import dims

    d = dims(spec, 1)
    return sum(o.param_count(d) for o in layer_operators(spec) if o.tp_split)


def replicated_param_count(spec: ModelSpec) -> int:
    """Parameters of one layer every TP rank holds whole (LayerNorms, row-parallel biases)."""
    from baton.operators import dims

    d = dims(spec, 1)
    return sum((0 if o.tp_split else o.param_count(d)) + o.replicated_param_count(d) for o in layer_operators(spec))


def position_param_count(spec: ModelSpec) -> int:
    """Parameters of the learned position embedding (s x h), held whole by every rank of a first stage
    (none for Llama, whose rotary positions have no parameters)."""
    return 0 if spec.llama else spec.seq_len * spec.hidden_dim


def final_norm_param_count(spec: ModelSpec) -> int:
    """Parameters of the final norm, held whole by every rank of a last stage: a LayerNorm's gain and bias,
    an RMSNorm's gain."""
    return spec.hidden_dim if spec.llama else 2 * spec.hidden_dim


def _count(total: int, lo: Fraction, hi: Fraction) -> int:
    n = (hi - lo) * total
    if n.denominator != 1:
        raise ValueError(f"a piece [{lo}, {hi}) of {total} parameters is not whole")
    return int(n)


def _pieces(cuts: list[list[tuple[Fraction, Fraction, str]]]) -> list[tuple[Fraction, Fraction, list[list[str]]]]:
    """Cut [0, 1) at every boundary of every replica's intervals; for each piece, the holders per replica
    (``cuts[r]`` lists (lo, hi, device) of replica r, copies in order)."""
    bounds = sorted({x for rep in cuts for lo, hi, _ in rep for x in (lo, hi)})
    out = []
    for lo, hi in zip(bounds, bounds[1:]):
        holders = [[dev for a, b, dev in rep if a <= lo and hi <= b] for rep in cuts]
        out.append((lo, hi, holders))
    return out


class StageShape(NamedTuple):
    """What the peer sets depend on of a plan's stage (``baton.plan.Stage``): its layers and who holds
    which units. Hashable, so the groups of a shape are worked out once however many plans share it; and
    plain data, so this module needs nothing of ``baton.plan``, whose validation needs the peer sets."""

    first_layer: int
    num_layers: int
    units_per_layer: int
    devices: tuple[tuple[str, int], ...]
    """(device id, units) in tensor-parallel rank order."""

    def holds(self, layer: int) -> bool:
        return self.first_layer <= layer < self.first_layer + self.num_layers


def _stage_intervals(stage: StageShape) -> list[tuple[Fraction, Fraction, str]]:
    out, before = [], 0
    for device, units in stage.devices:
        out.append((Fraction(before, stage.units_per_layer), Fraction(before + units, stage.units_per_layer), device))
        before += units
    return out


def peer_groups(plan) -> tuple[PeerGroup, ...]:
    """The plan's peer groups, in the order the runtime runs their collectives (docs/cost-model.md, sec. 9)."""
    return _peer_groups(plan_shape(plan), plan.model)


def plan_shape(plan) -> tuple[tuple[StageShape, ...], ...]:
    """Every replica's stages as ``StageShape``s: all of a plan (``baton.plan.Plan``) the peer sets depend on."""
    return tuple(tuple(StageShape(s.first_layer, s.num_layers, s.units_per_layer, tuple((d.id, d.units) for d in s.devices))
                       for s in p.stages) for p in plan.pipelines)


@functools.lru_cache(maxsize=256)
def _peer_groups(replicas: tuple[tuple[StageShape, ...], ...], spec: ModelSpec) -> tuple[PeerGroup, ...]:
    h = spec.hidden_dim
    V = padded_vocab(spec)
    whole = (Fraction(0), Fraction(1))
    pieces: list[tuple[Block, list[list[str]]]] = []
    cut_pieces: dict[tuple[int, ...], list] = {}  # layers held by the same stages (one per replica) are cut alike: once

    def add(part, layer, cuts, total, split=True, stages=None):
        if split:
            if stages is None or (cut := cut_pieces.get(stages)) is None:
                cut = [(lo, hi, holders, _count(total, lo, hi)) for lo, hi, holders in _pieces(cuts)]
                if stages is not None:
                    cut_pieces[stages] = cut
            for lo, hi, holders, n in cut:
                pieces.append((Block(part=part, layer=layer, lo=lo, hi=hi, num_params=n), holders))
        else:
            pieces.append((Block(part=part, layer=layer, lo=whole[0], hi=whole[1], num_params=total),
                           [[dev for _, _, dev in rep] for rep in cuts]))

    firsts = [rep[0] for rep in replicas]
    lasts = [rep[-1] for rep in replicas]
    # The tied embedding: the first stage's rows, then (a separate copy) the last stage's when it is another stage.
    # An untied head's rows are a piece of their own, held by the last stage only.
    tied = spec.tie_embeddings
    add("vocab", None, [_stage_intervals(f) + (_stage_intervals(l) if len(rep) > 1 and tied else [])
                        for f, l, rep in zip(firsts, lasts, replicas)], V * h)
    if not tied:
        add("head", None, [_stage_intervals(l) for l in lasts], V * h)
    if position_param_count(spec):
        add("positions", None, [_stage_intervals(f) for f in firsts], position_param_count(spec), split=False)
    split_n, repl_n = split_param_count(spec), replicated_param_count(spec)
    intervals = [[_stage_intervals(s) for s in rep] for rep in replicas]
    for layer in range(spec.num_layers):
        stages = tuple(next(i for i, s in enumerate(rep) if s.holds(layer)) for rep in replicas)
        cuts = [intervals[r][i] for r, i in enumerate(stages)]
        add("units", layer, cuts, split_n, stages=stages)
        add("replicated", layer, cuts, repl_n, split=False)
    add("final_norm", None, [_stage_intervals(l) for l in lasts], final_norm_param_count(spec), split=False)

    groups: dict[tuple, list[Block]] = {}
    for block, holders in pieces:
        counts = {len(hs) for hs in holders}
        if len(counts) == 1:
            c = counts.pop()
            for j in range(c):
                key = (tuple(hs[j] for hs in holders), tuple(range(len(holders))), (1,) * len(holders))
                groups.setdefault(key, []).append(block)
        else:
            ids = tuple(d for hs in holders for d in hs)
            reps = tuple(r for r, hs in enumerate(holders) for _ in hs)
            copies = tuple(len(hs) for hs in holders for _ in hs)
            groups.setdefault((ids, reps, copies), []).append(block)
    return tuple(PeerGroup(holders=k[0], replicas=k[1], copies=k[2], blocks=tuple(v)) for k, v in groups.items())


def shard_sizes(num_params: int, weights) -> tuple[int, ...]:
    """Split ``num_params`` in proportion to ``weights`` (largest remainder, ties to the earlier holder):
    whole parameters, adding up exactly, 0 for a weight of 0."""
    total = sum(weights)
    exact = [Fraction(num_params) * Fraction(w).limit_denominator(1 << 30) / Fraction(total).limit_denominator(1 << 30)
             for w in weights]
    base = [int(x) for x in exact]
    left = num_params - sum(base)
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - base[i]), i))
    for i in order[:left]:
        base[i] += 1
    return tuple(base)


def owned_fractions(plan, group: PeerGroup) -> tuple[float, ...]:
    """Share of ``group``'s parameters each holder keeps the optimizer state of: 1 each at stage 0; at stage
    1 its ``shard_ratio`` over the group's sum (equal parts without ratios). The cost model prices these
    exact shares; the runtime cuts whole parameters with ``shard_sizes``, at most one parameter off."""
    if plan.zero_stage == 0:
        return (1.0,) * group.size
    ratios = {d.id: d.shard_ratio for p in plan.pipelines for s in p.stages for d in s.devices}
    weights = [1.0 if ratios[h] is None else ratios[h] for h in group.holders]
    total = sum(weights)
    return tuple(w / total for w in weights)


def group_shard_sizes(plan, group: PeerGroup) -> tuple[int, ...]:
    """Whole parameters of ``group`` each holder owns at stage 1 (what the runtime moves and updates)."""
    return shard_sizes(group.num_params, owned_fractions(plan, group))


def owned_params(plan) -> dict[str, float]:
    """Parameters whose optimizer state each device keeps: all it holds at stage 0, its shares at stage 1."""
    out = {i: 0.0 for i in plan.device_ids()}
    for g in peer_groups(plan):
        for h, f in zip(g.holders, owned_fractions(plan, g)):
            out[h] += f * g.num_params
    return out


def held_params(plan) -> dict[str, int]:
    """Parameters each device holds (and keeps gradients of)."""
    out = {i: 0 for i in plan.device_ids()}
    for g in peer_groups(plan):
        for h in g.holders:
            out[h] += g.num_params
    return out


def whole_groups(plan) -> tuple[bool, ...]:
    """Per group of ``peer_groups``: it is everything each of its holders holds (replicas of one shape), so
    the runtime syncs the holders' gradient buffers in place and stage 0 stages nothing (eq. 14)."""
    held = held_params(plan)
    return tuple(all(held[h] == g.num_params for h in g.holders) for g in peer_groups(plan))


EDGES = None
"""The unit of the embedding side: token and position embedding rows and the final LayerNorm (the tied
head uses the token rows)."""


def unit_groups(plan) -> tuple[tuple[int | None, tuple[PeerGroup, ...]], ...]:
    """The plan's peer groups cut into units, for stages 2 and 3 (docs/cost-model.md, eq. 16): the edges
    (``EDGES``), then layer 0, 1, ...; each unit's groups in the order of ``peer_groups``. A unit group
    keeps its group's holders, replicas and copies, so ``owned_fractions`` and ``shard_sizes`` apply to it
    as they do to a whole group."""
    units: dict[int | None, list[PeerGroup]] = {EDGES: []}
    units.update({layer: [] for layer in range(plan.model.num_layers)})
    for g in peer_groups(plan):
        by_unit: dict[int | None, list[Block]] = {}
        for b in g.blocks:
            by_unit.setdefault(b.layer, []).append(b)
        for unit, blocks in by_unit.items():
            units[unit].append(PeerGroup(holders=g.holders, replicas=g.replicas, copies=g.copies, blocks=tuple(blocks)))
    return tuple((unit, tuple(gs)) for unit, gs in units.items())
