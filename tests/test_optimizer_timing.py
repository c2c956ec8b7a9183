"""The optimizer row is timed as training runs the step (``op_profiler._Timer.behind``): on a GPU launched while
the device still works through queued kernels, so the events time the device, not the host's launches. Here a
stand-in for CUDA's events and synchronize records the order of what happens."""
from __future__ import annotations

import torch

from runtime.measure import op_profiler


class _Events:
    """A log of calls; ``Event`` records into it, ``synchronize`` too."""

    def __init__(self):
        self.log: list[str] = []
        self.clock = 0.0
        outer = self

        class Event:
            def __init__(self, enable_timing=False, **_):
                self.at = None

            def record(self, stream=None):
                outer.clock += 1.0
                self.at = outer.clock
                outer.log.append("record")

            def elapsed_time(self, other):
                return other.at - self.at

        self.Event = Event

    def synchronize(self, device=None):
        self.log.append("synchronize")


def test_the_timed_call_is_launched_behind_the_backlog_and_timed_by_events(monkeypatch):
    events = _Events()
    monkeypatch.setattr(torch.cuda, "Event", events.Event)
    monkeypatch.setattr(torch.cuda, "synchronize", events.synchronize)
    timer = op_profiler._Timer(torch.device("cpu"))
    timer.cuda = True

    def backlog():
        events.log.append("backlog")

    def step():
        events.clock += 5.0  # the device's time of the step, as the stand-in's events read it
        events.log.append("step")

    ms = timer.behind(step, backlog)
    # The queue is emptied first, the backlog queued before the start event, the step between the two events,
    # and the host waits once at the end: nothing in between makes the host wait for the device.
    assert events.log == ["synchronize", "backlog", "record", "step", "record", "synchronize"]
    assert ms == 6.0


def test_on_a_cpu_the_backlog_runs_before_the_timed_call():
    order = []
    timer = op_profiler._Timer(torch.device("cpu"))
    timer.behind(lambda: order.append("step"), lambda: order.append("backlog"))
    assert order == ["backlog", "step"]


def test_the_optimizer_row_is_measured_on_a_cpu():
    from baton.model_spec import PRESETS

    nbytes, ms = op_profiler.profile_optimizer(PRESETS["tiny"], torch.device("cpu"), warmup=1, reps=2)
    assert nbytes > 0 and ms > 0
