"""Schedules as data: what every device of a replica runs in one iteration, in order.

A schedule is one list of actions per device (a pipeline stage's tensor-parallel group runs the same list on
every rank). Each schedule is written once, by one function here:

* ``one_f_one_b``: 1F1B (docs/cost-model.md, eq. 1);
* ``interleaved_one_f_one_b``: interleaved 1F1B, each device holding several non-adjacent chunks of layers
  (Megatron's virtual pipeline stages; docs/schedules.md);
* ``layer_by_layer``: a one-stage replica's micro-batches run layer by layer at ``zero_stage`` 2 and 3
  (eq. 17).

and read by everyone else: ``baton.pipeline`` (the exact recurrence and the event simulation of eq. 1, and the
activations a device holds at its peak), ``baton.costmodel.layered_chain`` (eq. 17), ``solver.milp`` (one
finish-time constraint per action) and the runtime's one interpreter (``runtime.train.engine``).

Passes run on *virtual stages*: the model's layers are cut into ``num_stages`` consecutive pieces, and
virtual stage ``k`` lives on device ``k mod p`` (``p`` devices): under 1F1B a device holds one piece
(``k`` is the device), interleaved it holds ``v`` pieces, its chunks ``0 .. v-1`` (chunk ``c`` of device
``d`` is virtual stage ``c p + d``). An activation leaves virtual stage ``k`` for ``k + 1`` and its gradient
comes back; the last virtual stage's loss starts the backward of the same micro-batch.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence, Union

from baton.operators import EMBEDDING, HEAD
from baton.peers import EDGES

WHOLE = "whole"
"""A pass over a whole virtual stage (its layers, and the embedding or head where it holds them)."""

Part = Union[str, int]
"""What a pass runs of its virtual stage: ``WHOLE``; or, run layer by layer, ``EMBEDDING``, a layer index, ``HEAD``
(the final LayerNorm, LM head and loss)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Forward:
    """The forward pass of one micro-batch over (part of) one virtual stage."""

    micro: int
    """Micro-batch index, 0-based."""
    stage: int
    """Virtual stage index (the device's own stage under 1F1B)."""
    part: Part = WHOLE
    """What of the virtual stage it runs (``Part``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Backward:
    """The backward pass (recomputation included) of one micro-batch over (part of) one virtual stage."""

    micro: int
    """Micro-batch index, 0-based."""
    stage: int
    """Virtual stage index."""
    part: Part = WHOLE
    """What of the virtual stage it runs (``Part``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Send:
    """Hand a boundary tensor of one micro-batch to the neighbouring virtual stage's device; it returns at once
    (the transfer runs while the device goes on) and arrives after the link's time (eq. 6)."""

    micro: int
    """Micro-batch index."""
    stage: int
    """The sending virtual stage."""
    grad: bool
    """False: its output activation, to ``stage + 1``; True: the gradient of its input, to ``stage - 1``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Recv:
    """Wait until a boundary tensor of one micro-batch from the neighbouring virtual stage has arrived."""

    micro: int
    """Micro-batch index."""
    stage: int
    """The receiving virtual stage."""
    grad: bool
    """False: its input activation, from ``stage - 1``; True: the gradient of its output, from ``stage + 1``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Gather:
    """All-gather a unit's weights from their owners (eq. 16), blocking; at stage 3 before the unit is used."""

    unit: int | None
    """``baton.peers.EDGES`` or a layer index."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Release:
    """Free a gathered unit's weights again, keeping the owned shards (stage 3; no time in the cost model)."""

    unit: int | None
    """``baton.peers.EDGES`` or a layer index."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ReduceScatter:
    """Reduce-scatter a unit's gradients to their owners and free them (eq. 16), blocking."""

    unit: int | None
    """``baton.peers.EDGES`` or a layer index."""


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerStep:
    """The owners' Adam step (eq. 10); what follows it in a list runs after the update."""


Action = Union[Forward, Backward, Send, Recv, Gather, Release, ReduceScatter, OptimizerStep]
COMPUTE = (Forward, Backward)
"""The actions that take a device's compute time."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Schedule:
    """One iteration of one replica: every device's actions in order."""

    name: str
    """Which schedule function wrote it ('1f1b', 'interleaved', 'layer_by_layer')."""
    num_stages: int
    """Virtual stages (devices times chunks per device)."""
    num_microbatches: int
    """Micro-batches of the replica."""
    devices: tuple[tuple[Action, ...], ...]
    """Per device, its actions in the order it runs them."""

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    @property
    def num_chunks(self) -> int:
        """Virtual stages per device."""
        return self.num_stages // self.num_devices

    def device_of(self, stage: int) -> int:
        """The device that runs virtual stage ``stage``."""
        return stage % self.num_devices

    def passes(self, device: int) -> list[tuple[str, int, int]]:
        """The compute actions of ``device`` as ('F' or 'B', micro-batch, virtual stage), in order."""
        return [("F" if isinstance(a, Forward) else "B", a.micro, a.stage) for a in self.devices[device]
                if isinstance(a, COMPUTE)]


def _with_transfers(order, stage_of, num_stages: int) -> tuple[Action, ...]:
    """A device's passes (kind, micro-batch, chunk) as actions: each forward between the receive of its
    input and the send of its output, each backward between the receive of its output's gradient and the
    send of its input's; nothing crosses the ends of the model (the last virtual stage's backward starts
    from its own loss)."""
    actions: list[Action] = []
    last = num_stages - 1
    for kind, i, chunk in order:
        k = stage_of(chunk)
        if kind == "F":
            if k > 0:
                actions.append(Recv(micro=i, stage=k, grad=False))
            actions.append(Forward(micro=i, stage=k))
            if k < last:
                actions.append(Send(micro=i, stage=k, grad=False))
        else:
            if k < last:
                actions.append(Recv(micro=i, stage=k, grad=True))
            actions.append(Backward(micro=i, stage=k))
            if k > 0:
                actions.append(Send(micro=i, stage=k, grad=True))
    return tuple(actions)


@functools.lru_cache(maxsize=4096)
def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """1F1B (eq. 1): stage s runs min(p - s - 1, m) warm-up forwards, then alternates one forward and one
    backward, then drains its remaining backwards (``one_f_one_b_order``, stage by stage)."""
    devices = tuple(_with_transfers(one_f_one_b_order(num_stages, num_microbatches, s), lambda _chunk, s=s: s, num_stages)
                    for s in range(num_stages))
    return Schedule(name="1f1b", num_stages=num_stages, num_microbatches=num_microbatches, devices=devices)


@functools.lru_cache(maxsize=4096)
def one_f_one_b_order(num_stages: int, num_microbatches: int, stage: int) -> tuple[tuple[str, int, int], ...]:
    """Stage ``stage``'s compute passes under 1F1B as ('F' or 'B', micro-batch, chunk 0). Apart from
    ``one_f_one_b`` because a device's memory reads its own passes only (``baton.costmodel.in_flight_microbatches``),
    and the planner asks that of thousands of (p, m)."""
    p, m, s = num_stages, num_microbatches, stage
    warmup = min(p - s - 1, m)
    order = [("F", i, 0) for i in range(warmup)]
    next_f = warmup
    for b in range(m):
        if next_f < m:
            order.append(("F", next_f, 0))
            next_f += 1
        order.append(("B", b, 0))
    return tuple(order)


@functools.lru_cache(maxsize=4096)
def forwards_before_first_backward(num_stages: int, num_microbatches: int, stage: int) -> int:
    """How many forwards stage ``stage`` runs under 1F1B before its first backward, read from its passes
    (``one_f_one_b_order``); the bound's eq. 1r charges the first backward's wait against them."""
    order = one_f_one_b_order(num_stages, num_microbatches, stage)
    return next(i for i, (kind, _, _) in enumerate(order) if kind == "B")


@functools.lru_cache(maxsize=4096)
def interleaved_one_f_one_b(num_devices: int, num_chunks: int, num_microbatches: int) -> Schedule:
    """Interleaved 1F1B over ``num_devices`` devices of ``num_chunks`` chunks each (Megatron's virtual pipeline
    stages). The micro-batches go in rounds of at least p (max(1, m // p) rounds, as equal as they come, the
    larger first; one round of m when m < p): within a round every device runs the round's forwards through
    chunk 0, then chunk 1, ..., and its backwards from the last chunk down. Device d first runs
    (v - 1) g + 2 (p - 1 - d) forwards (g the first round's size; at most all m v), then alternates one forward
    and one backward, then drains its backwards. Rounds of at least p keep every device busy in the steady
    state: with equal chunks and m >= p the bubble is p - 1 chunk passes, 1/v of 1F1B's (tests/test_schedules.py).
    One chunk per device is 1F1B itself."""
    p, v, m = num_devices, num_chunks, num_microbatches
    if v == 1:
        return one_f_one_b(p, m)
    count = max(1, m // p)
    sizes = [m // count + (1 if r < m % count else 0) for r in range(count)]
    starts = [sum(sizes[:r]) for r in range(count)]
    rounds = [range(a, a + n) for a, n in zip(starts, sizes)]
    fwd = [(c, i) for rnd in rounds for c in range(v) for i in rnd]
    bwd = [(c, i) for rnd in rounds for c in reversed(range(v)) for i in rnd]
    devices = []
    for d in range(p):
        warmup = min((v - 1) * sizes[0] + 2 * (p - 1 - d), m * v)
        order = [("F", i, c) for c, i in fwd[:warmup]]
        nf = warmup
        for c, i in bwd:
            if nf < len(fwd):
                order.append(("F", fwd[nf][1], fwd[nf][0]))
                nf += 1
            order.append(("B", i, c))
        devices.append(_with_transfers(order, lambda chunk, d=d: chunk * p + d, p * v))
    return Schedule(name="interleaved", num_stages=p * v, num_microbatches=m, devices=tuple(devices))


@functools.lru_cache(maxsize=1024)
def layer_by_layer(zero_stage: int, num_layers: int, num_microbatches: int) -> Schedule:
    """Stages 2 and 3 (eq. 17): a one-stage replica runs all its micro-batches through the embedding, then layer 0,
    ..., then each micro-batch's head and loss with its backward right away (one fp32 softmax alive at a time),
    then the backward of the last layer for all of them, ..., the embedding. Each layer's gradient is whole after
    its backward over every micro-batch and is reduce-scattered at once; stage 3 gathers the edges before
    the embedding's forward (kept to the end of the step, used at both ends) and each layer before its forward
    and before its backward, releasing it after; stage 2 all-gathers the updated weights after the step."""
    L, micro = num_layers, range(num_microbatches)
    stage3 = zero_stage >= 3
    acts: list[Action] = [Gather(unit=EDGES)] if stage3 else []
    acts += [Forward(micro=i, stage=0, part=EMBEDDING) for i in micro]
    for layer in range(L):
        acts += [Gather(unit=layer)] if stage3 else []
        acts += [Forward(micro=i, stage=0, part=layer) for i in micro]
        acts += [Release(unit=layer)] if stage3 else []
    for i in micro:
        acts += [Forward(micro=i, stage=0, part=HEAD), Backward(micro=i, stage=0, part=HEAD)]
    for layer in reversed(range(L)):
        acts += [Gather(unit=layer)] if stage3 else []
        acts += [Backward(micro=i, stage=0, part=layer) for i in micro]
        acts.append(ReduceScatter(unit=layer))
        acts += [Release(unit=layer)] if stage3 else []
    acts += [Backward(micro=i, stage=0, part=EMBEDDING) for i in micro]
    acts += [ReduceScatter(unit=EDGES), OptimizerStep()]
    if stage3:
        acts.append(Release(unit=EDGES))
    else:  # the updated weights, every unit in order
        acts += [Gather(unit=EDGES)] + [Gather(unit=layer) for layer in range(L)]
    return Schedule(name="layer_by_layer", num_stages=1, num_microbatches=num_microbatches, devices=(tuple(acts),))


def live_counts(schedule: Schedule, device: int) -> list[tuple[int, ...]]:
    """The moments ``device`` may peak at, as how many micro-batches' activations each of its chunks holds (chunk c
    runs virtual stage c p + device): a forward's are kept until the same micro-batch's backward of the same
    virtual stage has run, and a peak comes right after a forward. Only moments no other moment holds at least as
    many of on every chunk (the peak of any weighting is at one of them)."""
    p = schedule.num_devices
    return device_live_counts([(kind, i, (k - device) // p) for kind, i, k in schedule.passes(device)], schedule.num_chunks)


def device_live_counts(passes: Sequence[tuple[str, int, int]], num_chunks: int) -> list[tuple[int, ...]]:
    """``live_counts`` of one device's compute passes in order, as ('F' or 'B', micro-batch, chunk)."""
    live, moments = [0] * num_chunks, set()
    for kind, _, chunk in passes:
        live[chunk] += 1 if kind == "F" else -1
        if kind == "F":
            moments.add(tuple(live))
    return sorted(n for n in moments if not any(o != n and all(x >= y for x, y in zip(o, n)) for o in moments))


def peak_in_flight(schedule: Schedule, device: int, held=lambda stage: 1.0) -> float:
    """The most activations ``device`` holds at once (``live_counts``), ``held(stage)`` weighing a virtual stage's
    micro-batch (1: count micro-batches). Under 1F1B stage s holds min(p - s, m) micro-batches at its peak (eq. 8)."""
    p = schedule.num_devices
    weights = [held(c * p + device) for c in range(schedule.num_chunks)]
    return max((sum(n * w for n, w in zip(counts, weights)) for counts in live_counts(schedule, device)), default=0.0)


PassKey = tuple[str, int, int]
"""A compute pass as ('F' or 'B', virtual stage, micro-batch)."""


def pass_dependencies(schedule: Schedule) -> list[tuple[PassKey, list[tuple[PassKey, tuple[str, int] | None]]]]:
    """Every compute pass of a pipeline schedule with what must finish before it starts: the pass its device ran
    just before (no link), and for a pass after a receive the sender's pass whose tensor it takes, with the link
    ('fwd', k): ``send_fwd_ms[k]``, or ('bwd', k): ``send_bwd_ms[k]``. A pass finishes its duration after the
    latest of them (eq. 1); the longest path over these is ``baton.pipeline.iteration_time``, and the MILP states
    one ``>=`` constraint per pair (``solver.milp``). Passes come device by device, each device's in order."""
    sender: dict[tuple[bool, int, int], PassKey] = {}
    for actions in schedule.devices:
        last = None
        for a in actions:
            if isinstance(a, COMPUTE):
                last = ("F" if isinstance(a, Forward) else "B", a.stage, a.micro)
            elif isinstance(a, Send):
                sender[(a.grad, a.micro, a.stage - 1 if a.grad else a.stage + 1)] = last
    out = []
    for actions in schedule.devices:
        prev, received = None, []
        for a in actions:
            if isinstance(a, Recv):
                link = ("bwd", a.stage) if a.grad else ("fwd", a.stage - 1)
                received.append((sender[(a.grad, a.micro, a.stage)], link))
            elif isinstance(a, COMPUTE):
                me = ("F" if isinstance(a, Forward) else "B", a.stage, a.micro)
                out.append((me, ([(prev, None)] if prev is not None else []) + received))
                prev, received = me, []
    return out
