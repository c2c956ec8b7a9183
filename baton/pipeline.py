"""Iteration time of a pipeline schedule (``baton.schedules``): the exact recurrence, and an event-driven
simulation to check it.

Both walk the schedule's actions, device by device. A forward or backward of virtual stage k takes
``fwd_ms[k]`` or ``bwd_ms[k]`` of its device's time; a send returns at once and its tensor arrives after the
link (``send_fwd_ms[k]`` from k to k + 1, ``send_bwd_ms[k]`` from k + 1 back to k); a receive waits for its
tensor. Under 1F1B (``schedule_1f1b``) a forward of micro-batch i on stage s therefore needs the forward of i
on s - 1 plus the transfer, a backward the backward of i on s + 1 plus the transfer. The familiar
``(m - 1) * max(F + B) + sum(F + B)`` is only an upper bound once stages differ (docs/cost-model.md,
section 5), so Baton uses the exact longest path.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

from baton.schedules import Backward, Forward, Recv, Schedule, Send, one_f_one_b


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineTiming:
    """Per-stage times of one micro-batch and the links between stages (virtual stages, when interleaved)."""

    fwd_ms: tuple[float, ...]
    """Forward time of one micro-batch on each stage."""
    bwd_ms: tuple[float, ...]
    """Backward time (recomputation included) of one micro-batch on each stage."""
    send_fwd_ms: tuple[float, ...] = ()
    """Activation transfer from stage s to s + 1 (p - 1 entries; empty means free)."""
    send_bwd_ms: tuple[float, ...] = ()
    """Gradient transfer from stage s + 1 back to s (p - 1 entries)."""

    @property
    def num_stages(self) -> int:
        return len(self.fwd_ms)

    def fwd_link(self, s: int) -> float:
        return self.send_fwd_ms[s] if self.send_fwd_ms else 0.0

    def bwd_link(self, s: int) -> float:
        return self.send_bwd_ms[s] if self.send_bwd_ms else 0.0

    def duration(self, action) -> float:
        """A compute action's time on its device."""
        return self.fwd_ms[action.stage] if isinstance(action, Forward) else self.bwd_ms[action.stage]

    def delivery(self, send: Send) -> tuple[tuple[bool, int, int], float]:
        """Where a sent tensor goes, as the key of the receive that waits for it, and the link time it takes."""
        if send.grad:
            return (True, send.micro, send.stage - 1), self.bwd_link(send.stage - 1)
        return (False, send.micro, send.stage + 1), self.fwd_link(send.stage)


def schedule_1f1b(num_stages: int, num_microbatches: int, stage: int) -> list[tuple[str, int]]:
    """The passes ``stage`` runs under 1F1B (``baton.schedules.one_f_one_b``): [('F', 0), ('F', 1), ('B', 0), ...]."""
    return [(kind, i) for kind, i, _ in one_f_one_b(num_stages, num_microbatches).passes(stage)]


def iteration_time(schedule: Schedule, t: PipelineTiming) -> float:
    """Exact finish time of the last pass: a longest-path recurrence over the schedule's actions.

    A device's clock moves on by each pass's time and, at a receive, up to the arrival of its tensor (the
    sender's finish plus the link); with 1F1B that is eq. 1:
    finish(F, s, i) = max(finish(prev pass on s), finish(F, s-1, i) + link_f(s-1)) + F_s
    finish(B, s, i) = max(finish(prev pass on s), finish(B, s+1, i) + link_b(s)) + B_s
    Devices are visited in turn, each as far as its receives allow (a wavefront).
    """
    lists = schedule.devices
    clock = [0.0] * len(lists)
    pos = [0] * len(lists)
    arrival: dict[tuple[bool, int, int], float] = {}
    remaining = sum(len(a) for a in lists)
    fwd, bwd = t.fwd_ms, t.bwd_ms
    while remaining:
        advanced = False
        for d, actions in enumerate(lists):
            here, now = pos[d], clock[d]
            while here < len(actions):
                a = actions[here]
                kind = type(a)
                if kind is Forward:
                    now += fwd[a.stage]
                elif kind is Backward:
                    now += bwd[a.stage]
                elif kind is Recv:
                    key = (a.grad, a.micro, a.stage)
                    if key not in arrival:
                        break
                    now = max(now, arrival[key])
                elif kind is Send:
                    key, link = t.delivery(a)
                    arrival[key] = now + link
                else:
                    raise ValueError(f"{kind.__name__} has no place in a pipeline schedule")
                here += 1
            if here > pos[d]:
                remaining -= here - pos[d]
                pos[d], clock[d] = here, now
                advanced = True
        if not advanced:
            raise RuntimeError(f"schedule {schedule.name} deadlocked")
    return max(clock)


def simulate(schedule: Schedule, t: PipelineTiming) -> tuple[float, list[list[tuple[str, int, int, float, float]]]]:
    """Event-driven simulation: devices are workers, messages arrive after link delays.

    Returns the makespan and, per device, the passes it ran as (kind, micro-batch, virtual stage, start, end).
    Written independently of ``iteration_time`` so that tests can check one against the other.
    """
    queues = [list(actions) for actions in schedule.devices]
    arrived: set[tuple[bool, int, int]] = set()
    waiting: dict[tuple[bool, int, int], int] = {}  # receive key -> the device that waits for it
    for d, actions in enumerate(schedule.devices):
        for a in actions:
            if isinstance(a, Recv):
                waiting[(a.grad, a.micro, a.stage)] = d
    idle = [True] * len(queues)
    trace: list[list[tuple[str, int, int, float, float]]] = [[] for _ in queues]
    events: list[tuple[float, int, str, object]] = []  # (time, seq, what, device or key)
    seq = 0

    def push(time: float, what: str, who) -> None:
        nonlocal seq
        heapq.heappush(events, (time, seq, what, who))
        seq += 1

    def run(d: int, now: float) -> None:
        while idle[d] and queues[d]:
            a = queues[d][0]
            if isinstance(a, Recv):
                if (a.grad, a.micro, a.stage) not in arrived:
                    return
                queues[d].pop(0)
            elif isinstance(a, Send):
                queues[d].pop(0)
                key, link = t.delivery(a)
                push(now + link, "arrive", key)
            else:
                queues[d].pop(0)
                dur = t.fwd_ms[a.stage] if isinstance(a, Forward) else t.bwd_ms[a.stage]
                idle[d] = False
                trace[d].append(("F" if isinstance(a, Forward) else "B", a.micro, a.stage, now, now + dur))
                push(now + dur, "done", d)

    for d in range(len(queues)):
        run(d, 0.0)
    end = 0.0
    while events:
        now, _, what, who = heapq.heappop(events)
        if what == "done":
            end = max(end, now)
            idle[who] = True
            run(who, now)
        else:
            arrived.add(who)
            run(waiting[who], now)
    if any(queues):
        raise RuntimeError(f"schedule {schedule.name} deadlocked")
    return end, trace


def iteration_time_1f1b(t: PipelineTiming, num_microbatches: int) -> float:
    """Eq. 1: ``iteration_time`` of the 1F1B schedule over ``t``'s stages."""
    return iteration_time(one_f_one_b(t.num_stages, num_microbatches), t)


def simulate_1f1b(t: PipelineTiming, num_microbatches: int) -> tuple[float, list[list[tuple[str, int, float, float]]]]:
    """``simulate`` of the 1F1B schedule, each stage's passes as (kind, micro-batch, start, end)."""
    end, trace = simulate(one_f_one_b(t.num_stages, num_microbatches), t)
    return end, [[(kind, i, a, b) for kind, i, _, a, b in stage] for stage in trace]


def classic_bound_1f1b(t: PipelineTiming, num_microbatches: int) -> float:
    """(m - 1) * max_s(F_s + B_s) + sum_s(F_s + B_s) + link times: exact only for equal stages."""
    per = [f + b for f, b in zip(t.fwd_ms, t.bwd_ms)]
    links = sum(t.send_fwd_ms) + sum(t.send_bwd_ms)
    return (num_microbatches - 1) * max(per) + sum(per) + links
