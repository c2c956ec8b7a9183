"""The exact 1F1B recurrence against the event-driven simulation, and against cases solved by hand."""
from __future__ import annotations

import random

import pytest

from baton.pipeline import PipelineTiming, classic_bound_1f1b, iteration_time_1f1b, schedule_1f1b, simulate_1f1b


def test_schedule_has_warmup_steady_and_cooldown():
    assert schedule_1f1b(3, 4, 0) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("B", 2), ("B", 3)]
    assert schedule_1f1b(3, 4, 2) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2), ("F", 3), ("B", 3)]
    assert schedule_1f1b(4, 2, 0) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]


@pytest.mark.parametrize("seed", range(5))
def test_closed_form_equals_event_simulation_on_random_stages(seed):
    """Catches a wrong dependency or pass order in either implementation."""
    rng = random.Random(seed)
    for _ in range(300):
        p, m = rng.randint(1, 7), rng.randint(1, 12)
        t = PipelineTiming(
            fwd_ms=tuple(rng.uniform(0.1, 5) for _ in range(p)), bwd_ms=tuple(rng.uniform(0.1, 10) for _ in range(p)),
            send_fwd_ms=tuple(rng.uniform(0, 2) for _ in range(p - 1)), send_bwd_ms=tuple(rng.uniform(0, 2) for _ in range(p - 1)))
        sim, trace = simulate_1f1b(t, m)
        assert iteration_time_1f1b(t, m) == pytest.approx(sim, rel=1e-12)
        assert all(len(stage) == 2 * m for stage in trace)


def test_uniform_stages_take_m_plus_p_minus_1_slots():
    t = PipelineTiming(fwd_ms=(1.0,) * 4, bwd_ms=(2.0,) * 4)
    assert iteration_time_1f1b(t, 8) == pytest.approx((8 + 4 - 1) * 3.0)


def test_classic_formula_is_only_an_upper_bound_for_unequal_stages():
    t = PipelineTiming(fwd_ms=(3.0, 3.0, 1.0), bwd_ms=(4.0, 3.0, 4.0))
    exact = iteration_time_1f1b(t, 4)
    assert exact == simulate_1f1b(t, 4)[0]
    assert classic_bound_1f1b(t, 4) >= exact
    rng = random.Random(7)
    for _ in range(200):
        p, m = rng.randint(1, 5), rng.randint(1, 9)
        t = PipelineTiming(fwd_ms=tuple(rng.uniform(0.1, 5) for _ in range(p)), bwd_ms=tuple(rng.uniform(0.1, 9) for _ in range(p)))
        assert classic_bound_1f1b(t, m) >= iteration_time_1f1b(t, m) - 1e-9


def test_single_stage_is_serial():
    t = PipelineTiming(fwd_ms=(2.0,), bwd_ms=(5.0,))
    assert iteration_time_1f1b(t, 6) == 42.0


def test_two_stage_hand_case_with_links():
    """F=(1,2), B=(2,4), link 0.5 each way, m=2, worked out on paper: 16.0 ms.

    s0 runs F0 0-1 and F1 1-2. s1 gets F0 at 1.5 and runs it 1.5-3.5, B0 3.5-7.5, F1 7.5-9.5, B1 9.5-13.5.
    s0 gets B0 at 8.0 and runs it 8-10, gets B1 at 14.0 and runs it 14-16.
    """
    t = PipelineTiming(fwd_ms=(1.0, 2.0), bwd_ms=(2.0, 4.0), send_fwd_ms=(0.5,), send_bwd_ms=(0.5,))
    assert iteration_time_1f1b(t, 2) == pytest.approx(16.0)
