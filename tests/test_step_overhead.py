"""What a one-device step saves against the plainest loop (bench/bench_reference.py) without changing its numbers.

* A step's gradients are the buffer's views zeroed at its start or, for the large ones on CPU, fresh gradients
  of its first backward copied into their views (``Engine._contiguous_grads``); each test runs with none, some
  and all of them adopted. Catches a step whose gradients differ by a bit from accumulating onto zeros, a
  parameter no backward reached keeping the last step's gradient, and gradients left outside the buffer the
  synchronisation and the norm read.
* The saved-bytes meter measures each pass once (``SavedBytes.known``). Catches a later step reporting other
  bytes than the measured ones, and a replayed pass still running hooks.
* ``fused_attention_only`` sets the attention flags ``sdpa_kernel(FUSED_ATTENTION)`` sets, and restores them.
"""
from __future__ import annotations

import pytest
import torch

from tests.runtime_helpers import plan_of, tiny

ADOPTED = pytest.mark.parametrize("adopt_bytes", [1 << 40, 4096, 0],
                                  ids=["none adopted", "some adopted", "all adopted"])
"""``Engine``'s ``_ADOPT_BYTES`` in the tests of the gradient buffer."""


@pytest.fixture
def adopting(monkeypatch, adopt_bytes):
    """Engines built in the test adopt the gradients of ``adopt_bytes`` or more (see ``ADOPTED``)."""
    from runtime.train import engine

    monkeypatch.setattr(engine, "_ADOPT_BYTES", adopt_bytes)
    return adopt_bytes


def _engine(plan, **kwargs):
    from runtime.train.engine import Engine

    return Engine(plan, 0, seed=0, lr=1e-3, **kwargs)


@ADOPTED
def test_a_step_writes_the_gradients_a_zeroed_buffer_would_hold(one_rank_group, adopting):
    from runtime.data.source import TokenSource

    spec = tiny(0.1)
    plan = plan_of(spec, [[1]], [spec.num_layers], 1, m=3)
    data = TokenSource(spec, seed=0, global_batch=plan.global_batch)
    stepped, accumulated = _engine(plan), _engine(plan)
    adopted, views = len(stepped._adopting), len(stepped._grad_views)
    assert {1 << 40: adopted == 0, 4096: 0 < adopted < views, 0: adopted == views}[adopting]
    stepped.grad_buffer.fill_(float("nan"))  # the last step's gradients: none of it may survive
    for step in range(2):
        stats = stepped.train_step(step, data)
        accumulated.grad_buffer.zero_()  # the former step: zeros, then every backward adds
        want = accumulated.forward_backward(step, data)
        assert torch.equal(stepped.grad_buffer.view(torch.int32), accumulated.grad_buffer.view(torch.int32)), step
        assert stats.loss == want.loss and stats.grad_norm == want.grad_norm
        accumulated.precision.step()
        for p, view in stepped._grad_views:
            assert p.grad is view
    for (_, a), (_, b) in zip(stepped.master_parameters().items(), accumulated.master_parameters().items()):
        assert torch.equal(a, b)


@ADOPTED
def test_a_parameter_no_backward_reached_has_zero_gradient(one_rank_group, adopting):
    from runtime.data.source import TokenSource

    spec = tiny(0.0)
    plan = plan_of(spec, [[1]], [spec.num_layers], 1, m=2)
    engine = _engine(plan)
    data = TokenSource(spec, seed=0, global_batch=plan.global_batch)
    engine.train_step(0, data)
    frozen = engine.model.ln_f.bias
    frozen.requires_grad_(False)  # no backward reaches it now
    try:
        engine.train_step(1, data)
    finally:
        frozen.requires_grad_(True)
    view = dict((id(p), v) for p, v in engine._grad_views)[id(frozen)]
    assert frozen.grad is view and not view.any()


def test_saved_bytes_are_measured_once_and_held_as_measured(one_rank_group, monkeypatch):
    from runtime.data.source import TokenSource
    from runtime.measure import meters

    spec = tiny(0.1)
    plan = plan_of(spec, [[1]], [spec.num_layers], 1, m=3)
    data = TokenSource(spec, seed=0, global_batch=plan.global_batch)
    engine = _engine(plan)
    hooked = []
    pack = meters.SavedBytes._pack
    monkeypatch.setattr(meters.SavedBytes, "_pack", lambda self, t: (hooked.append(1), pack(self, t))[1])
    peaks = []
    for step in range(3):
        hooked.clear()
        peaks.append(engine.train_step(step, data).peak_saved_bytes)
        assert bool(hooked) == (step == 0), step  # the hooks run in the first step only
    assert peaks[0] > 0 and peaks == [peaks[0]] * 3
    fresh = _engine(plan)  # a meter that measures every pass of its step
    fresh.train_step(0, data)
    assert fresh.train_step(1, data).peak_saved_bytes == peaks[1]


def test_a_known_pass_holds_its_bytes_until_released():
    from runtime.measure.meters import SavedBytes

    w = torch.nn.Parameter(torch.randn(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    measuring = SavedBytes([w])
    with measuring.record("a"):
        y = (x @ w).tanh()
    assert measuring.measured == {"a": measuring.peak} and measuring.peak > 0
    replay = SavedBytes([w], known=dict(measuring.measured))
    with replay.record("a"):
        y2 = (x @ w).tanh()
        replay.add(y2)  # nothing is added to a known pass
    with replay.record("b"):
        (x * 2).sum()
    assert replay.measured == {"b": 0} and replay.peak == measuring.peak
    replay.release("a")
    assert replay.total() == 0
    y.sum().backward()
    y2.sum().backward()


def test_fused_attention_only_sets_and_restores_what_sdpa_kernel_does():
    from torch.nn.attention import sdpa_kernel

    from runtime.parallel.tp_layer import FUSED_ATTENTION, _SDP_SWITCHES, fused_attention_only

    assert _SDP_SWITCHES is not None
    flags = lambda: [get() for get, _, _ in _SDP_SWITCHES]  # noqa: E731
    before = flags()
    with sdpa_kernel(FUSED_ATTENTION):
        want = flags()
    with fused_attention_only():
        assert flags() == want
        with fused_attention_only():
            assert flags() == want
        assert flags() == want
    assert flags() == before and want != before
