"""Schedules as data (baton/schedules.py): every reader takes the same lists, and each list is a valid schedule.

The recurrence and the event simulation of baton/pipeline.py, the MILP's precedences, the cost model's eq. 17 chain and
the runtime's interpreter all read the action lists; these tests pin the lists themselves and check the readers agree.
"""
from __future__ import annotations

import random
from collections import Counter

import pytest

from baton.costmodel import in_flight_microbatches, layered_chain
from baton.peers import EDGES
from baton.pipeline import PipelineTiming, iteration_time, simulate
from baton.schedules import (Backward, Forward, Gather, OptimizerStep, Recv, ReduceScatter, Release, Send,
                             interleaved_one_f_one_b, layer_by_layer, one_f_one_b, pass_dependencies, peak_in_flight)


def _random_timing(rng: random.Random, stages: int) -> PipelineTiming:
    return PipelineTiming(fwd_ms=tuple(rng.uniform(0.1, 5) for _ in range(stages)),
                          bwd_ms=tuple(rng.uniform(0.1, 9) for _ in range(stages)),
                          send_fwd_ms=tuple(rng.uniform(0, 2) for _ in range(stages - 1)),
                          send_bwd_ms=tuple(rng.uniform(0, 2) for _ in range(stages - 1)))


def _schedules():
    for p in range(1, 6):
        for v in range(1, 4 if p > 1 else 2):
            for m in range(1, 11):
                yield interleaved_one_f_one_b(p, v, m)


def test_every_pass_runs_once_on_its_device_and_every_send_has_its_receive():
    """Catches a pass run twice or never, a pass on the wrong device, or a tensor sent that nobody waits for
    (the runtime would hang, or take the next micro-batch's tensor)."""
    for sch in _schedules():
        p, m = sch.num_devices, sch.num_microbatches
        passes = Counter()
        sent, received = Counter(), Counter()
        for d, actions in enumerate(sch.devices):
            for a in actions:
                if isinstance(a, (Forward, Backward)):
                    assert sch.device_of(a.stage) == d
                    passes[(type(a), a.stage, a.micro)] += 1
                elif isinstance(a, Send):
                    sent[(a.grad, a.micro, a.stage - 1 if a.grad else a.stage + 1)] += 1
                elif isinstance(a, Recv):
                    received[(a.grad, a.micro, a.stage)] += 1
        assert passes == Counter({(kind, k, i): 1 for kind in (Forward, Backward) for k in range(sch.num_stages) for i in range(m)})
        assert sent == received and all(n == 1 for n in sent.values())
        assert sch.num_stages == p * sch.num_chunks


def test_one_f_one_b_lists():
    """The 1F1B order with its transfers: receive, forward, send; receive the gradient, backward, send it back."""
    sch = one_f_one_b(2, 2)
    assert sch.devices[0] == (Forward(micro=0, stage=0), Send(micro=0, stage=0, grad=False),
                              Forward(micro=1, stage=0), Send(micro=1, stage=0, grad=False),
                              Recv(micro=0, stage=0, grad=True), Backward(micro=0, stage=0),
                              Recv(micro=1, stage=0, grad=True), Backward(micro=1, stage=0))
    assert sch.devices[1][:4] == (Recv(micro=0, stage=1, grad=False), Forward(micro=0, stage=1), Backward(micro=0, stage=1),
                                  Send(micro=0, stage=1, grad=True))
    assert interleaved_one_f_one_b(3, 1, 4) is one_f_one_b(3, 4)


@pytest.mark.parametrize("seed", range(3))
def test_recurrence_simulation_and_precedences_agree(seed):
    """The three readers of a pipeline schedule (the recurrence, the event simulation, and the precedences the MILP
    states one >= constraint each for) give one longest path. Catches a reader that skips or reorders an action."""
    rng = random.Random(seed)
    for _ in range(150):
        p = rng.randint(1, 5)
        v = rng.randint(1, 3) if p > 1 else 1
        sch = interleaved_one_f_one_b(p, v, rng.randint(1, 10))
        t = _random_timing(rng, sch.num_stages)
        exact = iteration_time(sch, t)
        sim, trace = simulate(sch, t)
        assert exact == pytest.approx(sim, rel=1e-12)
        assert [len(runs) for runs in trace] == [2 * v * sch.num_microbatches] * p
        deps = pass_dependencies(sch)
        finish: dict = {}
        while len(finish) < len(deps):
            for me, before in deps:
                if me in finish or any(q not in finish for q, _ in before):
                    continue
                ready = [finish[q] + (0.0 if lk is None else t.fwd_link(lk[1]) if lk[0] == "fwd" else t.bwd_link(lk[1]))
                         for q, lk in before]
                finish[me] = max(ready, default=0.0) + (t.fwd_ms if me[0] == "F" else t.bwd_ms)[me[1]]
        assert max(finish.values()) == pytest.approx(exact, rel=1e-12)


def test_interleaving_divides_the_bubble_by_the_chunks():
    """Equal chunks, free links, m a multiple of p (and any m >= p): the iteration is (m v + p - 1) chunk passes,
    against 1F1B's (m + p - 1) stage passes, v chunks to a stage: the bubble (p - 1) stage passes becomes (p - 1) / v."""
    for p in range(2, 6):
        for v in range(1, 5):
            for m in range(p, 3 * p + 2):
                t = PipelineTiming(fwd_ms=(1.0 / v,) * (p * v), bwd_ms=(2.0 / v,) * (p * v))
                assert iteration_time(interleaved_one_f_one_b(p, v, m), t) == pytest.approx((m + (p - 1) / v) * 3.0)


def test_in_flight_activations_read_from_the_schedule():
    """Eq. 8's min(p - s, m) is what the 1F1B list holds at its peak; interleaved, device d holds at most the
    (v - 1) g + 2 (p - 1 - d) + 1 chunk passes of its warm-up and first steady forward."""
    for p in range(1, 7):
        for m in range(1, 12):
            for s in range(p):
                assert in_flight_microbatches(s, p, m) == min(p - s, m) == peak_in_flight(one_f_one_b(p, m), s)
    sch = interleaved_one_f_one_b(4, 2, 8)
    assert [peak_in_flight(sch, d) for d in range(4)] == [11, 9, 7, 5]
    # Weighted by the chunks' activations (chunk 0: 3 per micro-batch, chunk 1: 1): device 0's peak comes when its
    # steady state has run chunk 0 of micro-batch 7 and the backward of chunk 1 of micro-batch 0: chunk 0 of
    # micro-batches 0-7 and chunk 1 of 1-3 are alive.
    assert peak_in_flight(sch, 0, lambda k: 3.0 if k == 0 else 1.0) == 8 * 3.0 + 3 * 1.0


def test_layered_chain_is_the_layer_by_layer_schedule():
    """Eq. 17's chain as the evaluator prices it, as written before it was read from the schedule: catches a change of
    order in either."""
    assert layered_chain(3, 2) == (
        ("gather", EDGES), ("compute", ("emb_fwd_ms",)), ("gather", 0), ("compute", ("layer_fwd_ms",)),
        ("gather", 1), ("compute", ("layer_fwd_ms",)), ("compute", ("head_fwd_ms", "head_bwd_ms")),
        ("gather", 1), ("compute", ("layer_bwd_ms",)), ("reduce", 1), ("gather", 0), ("compute", ("layer_bwd_ms",)),
        ("reduce", 0), ("compute", ("emb_bwd_ms",)), ("reduce", EDGES), ("optimizer", None))
    assert layered_chain(2, 2) == (
        ("compute", ("emb_fwd_ms",)), ("compute", ("layer_fwd_ms",)), ("compute", ("layer_fwd_ms",)),
        ("compute", ("head_fwd_ms", "head_bwd_ms")), ("compute", ("layer_bwd_ms",)), ("reduce", 1),
        ("compute", ("layer_bwd_ms",)), ("reduce", 0), ("compute", ("emb_bwd_ms",)), ("reduce", EDGES),
        ("optimizer", None), ("gather", EDGES), ("gather", 0), ("gather", 1))


def test_layer_by_layer_runs_every_micro_batch_per_part_and_releases_what_it_gathers():
    """Catches a unit used while released at stage 3 (its storage is empty), or a layer reduce-scattered before every
    micro-batch's backward over it."""
    for zero_stage in (2, 3):
        actions = layer_by_layer(zero_stage, 3, 2).devices[0]
        whole = set() if zero_stage == 3 else {EDGES, 0, 1, 2}
        done_backward = Counter()
        for a in actions:
            if isinstance(a, Gather):
                whole.add(a.unit)
            elif isinstance(a, Release):
                whole.discard(a.unit)
            elif isinstance(a, (Forward, Backward)):
                unit = a.part if isinstance(a.part, int) else EDGES
                assert unit in whole
                if isinstance(a, Backward):
                    done_backward[unit] += 1
            elif isinstance(a, ReduceScatter):
                assert done_backward[a.unit] == 2 * (2 if a.unit is EDGES else 1)
        assert sum(isinstance(a, OptimizerStep) for a in actions) == 1
