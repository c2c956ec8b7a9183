"""Iteration time of a 1F1B pipeline: the exact recurrence, and an event-driven simulation to check it.

Stage s (0-based, p stages) runs min(p - s - 1, m) warm-up forwards, then alternates one forward and
one backward, then drains its remaining backwards. A forward of micro-batch i on stage s needs the
forward of i on s - 1 plus the transfer ``send_fwd_ms[s - 1]``; a backward needs the backward of i on
s + 1 plus ``send_bwd_ms[s]``. The familiar ``(m - 1) * max(F + B) + sum(F + B)`` is only an upper
bound once stages differ (docs/cost-model.md, section 5), so Baton uses the exact longest path.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineTiming:
    """Per-stage times of one micro-batch and the links between stages."""

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


def schedule_1f1b(num_stages: int, num_microbatches: int, stage: int) -> list[tuple[str, int]]:
    """The order in which ``stage`` runs its passes: [('F', 0), ('F', 1), ('B', 0), ...]."""
    p, m = num_stages, num_microbatches
    warmup = min(p - stage - 1, m)
    order = [("F", i) for i in range(warmup)]
    next_f = warmup
    for b in range(m):
        if next_f < m:
            order.append(("F", next_f))
            next_f += 1
        order.append(("B", b))
    return order


def iteration_time_1f1b(t: PipelineTiming, num_microbatches: int) -> float:
    """Exact finish time of the last backward: a longest-path recurrence over the 1F1B graph.

    finish(F, s, i) = max(finish(prev pass on s), finish(F, s-1, i) + link_f(s-1)) + F_s
    finish(B, s, i) = max(finish(prev pass on s), finish(B, s+1, i) + link_b(s)) + B_s
    Passes are visited in an order where every dependency is already known (a wavefront).
    """
    p, m = t.num_stages, num_microbatches
    orders = [schedule_1f1b(p, m, s) for s in range(p)]
    finish: dict[tuple[str, int, int], float] = {}
    clock = [0.0] * p
    pos = [0] * p
    remaining = 2 * m * p
    while remaining:
        advanced = False
        for s in range(p):
            while pos[s] < len(orders[s]):
                kind, i = orders[s][pos[s]]
                if kind == "F":
                    dep = finish.get(("F", s - 1, i)) if s > 0 else 0.0
                    ready = None if dep is None else dep + (t.fwd_link(s - 1) if s > 0 else 0.0)
                    dur = t.fwd_ms[s]
                else:
                    dep = finish.get(("B", s + 1, i)) if s < p - 1 else finish.get(("F", s, i))
                    ready = None if dep is None else dep + (t.bwd_link(s) if s < p - 1 else 0.0)
                    dur = t.bwd_ms[s]
                if ready is None:
                    break
                clock[s] = max(clock[s], ready) + dur
                finish[(kind, s, i)] = clock[s]
                pos[s] += 1
                remaining -= 1
                advanced = True
        if not advanced:  # pragma: no cover - the 1F1B order is deadlock-free
            raise RuntimeError("1F1B schedule deadlocked")
    return max(clock)


def simulate_1f1b(t: PipelineTiming, num_microbatches: int) -> tuple[float, list[list[tuple[str, int, float, float]]]]:
    """Event-driven simulation: stages are workers, messages arrive after link delays.

    Returns the makespan and, per stage, the executed passes as (kind, micro-batch, start, end).
    Written independently of ``iteration_time_1f1b`` so that tests can check one against the other.
    """
    p, m = t.num_stages, num_microbatches
    queues = [schedule_1f1b(p, m, s) for s in range(p)]
    arrived: list[set[tuple[str, int]]] = [set() for _ in range(p)]
    for i in range(m):
        arrived[0].add(("F", i))  # the first stage has its inputs from the start
    busy_until = [0.0] * p
    idle = [True] * p
    trace: list[list[tuple[str, int, float, float]]] = [[] for _ in range(p)]
    events: list[tuple[float, int, str, int, int]] = []  # (time, seq, what, stage, micro)
    seq = 0

    def push(time: float, what: str, stage: int, micro: int) -> None:
        nonlocal seq
        heapq.heappush(events, (time, seq, what, stage, micro))
        seq += 1

    def try_start(s: int, now: float) -> None:
        if not idle[s] or not queues[s]:
            return
        kind, i = queues[s][0]
        if (kind, i) not in arrived[s]:
            return
        queues[s].pop(0)
        dur = t.fwd_ms[s] if kind == "F" else t.bwd_ms[s]
        idle[s] = False
        busy_until[s] = now + dur
        trace[s].append((kind, i, now, now + dur))
        push(now + dur, "done" + kind, s, i)

    for s in range(p):
        try_start(s, 0.0)
    end = 0.0
    while events:
        now, _, what, s, i = heapq.heappop(events)
        end = max(end, now)
        if what == "doneF":
            idle[s] = True
            if s + 1 < p:
                push(now + t.fwd_link(s), "arriveF", s + 1, i)
            else:
                arrived[s].add(("B", i))
            try_start(s, now)
        elif what == "doneB":
            idle[s] = True
            if s > 0:
                push(now + t.bwd_link(s - 1), "arriveB", s - 1, i)
            try_start(s, now)
        elif what == "arriveF":
            arrived[s].add(("F", i))
            try_start(s, now)
        elif what == "arriveB":
            arrived[s].add(("B", i))
            try_start(s, now)
    return end, trace


def classic_bound_1f1b(t: PipelineTiming, num_microbatches: int) -> float:
    """(m - 1) * max_s(F_s + B_s) + sum_s(F_s + B_s) + link times: exact only for equal stages."""
    per = [f + b for f, b in zip(t.fwd_ms, t.bwd_ms)]
    links = sum(t.send_fwd_ms) + sum(t.send_bwd_ms)
    return (num_microbatches - 1) * max(per) + sum(per) + links
