"""Single-process tests of the runtime's parts: dropout masks, the 1F1B order, per-operator
recomputation (counted, and measured in saved bytes), data, atomic checkpoint directories."""
from __future__ import annotations

import pytest
import torch

from baton.operators import operator_names
from runtime.model.gpt import GPT, init_parameter
from runtime.model.rng import DropoutKey, attention_mask, residual_mask
from runtime.parallel.stage import StageModel
from runtime.parallel.tp_layer import MicroBatch, _Segment
from tests.runtime_helpers import tiny


def test_head_slice_of_attention_mask_equals_full_mask():
    """Catches masks indexed by a rank's local head number: heads [1, 3) must draw the full model's."""
    key = DropoutKey(seed=3, step=2, layer=1)
    samples = torch.tensor([4, 5])
    full = attention_mask(key, samples, range(0, 4), 16, 0.1)
    part = attention_mask(key, samples, range(1, 3), 16, 0.1)
    assert torch.equal(part, full[:, 1:3])
    keep = (full > 0).float().mean().item()
    assert 0.85 < keep < 0.95 and torch.allclose(full[full > 0], torch.tensor(1 / 0.9))
    # Another sample, step, layer or operator draws another mask.
    assert not torch.equal(full, attention_mask(key, samples + 1, range(4), 16, 0.1))
    assert not torch.equal(full, attention_mask(DropoutKey(3, 3, 1), samples, range(4), 16, 0.1))
    r1 = residual_mask(key, "resid1", samples, 16, 8, 0.1)
    assert not torch.equal(r1, residual_mask(key, "resid2", samples, 16, 8, 0.1))


def test_one_f_one_b_order_matches_the_planner():
    """Catches a schedule that differs from the one the cost model times (baton.pipeline)."""
    from baton import pipeline, schedules
    from runtime.train import engine

    assert pipeline.schedule_1f1b(3, 4, 0) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("B", 2), ("B", 3)]
    assert pipeline.schedule_1f1b(4, 2, 0) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    assert engine.interleaved_one_f_one_b is schedules.interleaved_one_f_one_b and engine.layer_by_layer is schedules.layer_by_layer


def _blocks(spec, recompute):
    """Two layers on one rank (no embedding, no head), initialised like the full model."""
    model = StageModel(spec, layers=range(2), heads=range(spec.num_heads), ffn_cols=range(spec.ffn_dim),
                       first=False, last=False, recompute=frozenset(recompute))
    model.load_full(lambda name: init_parameter(spec, name, 0))
    return model


def _run(model, spec, B=2):
    from runtime.measure.meters import SavedBytes

    x = torch.randn(B, spec.seq_len, spec.hidden_dim, generator=torch.Generator().manual_seed(1), requires_grad=True)
    saved = SavedBytes(model.parameters())
    model.meter.saved = saved
    with saved.record(0):
        y = model(x, MicroBatch(seed=0, step=0, samples=torch.arange(B)))
    model.meter.in_backward = True
    (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    model.meter.in_backward = False
    grads = {n: p.grad for n, p in model.named_parameters()}
    return grads, x.grad, saved.peak, dict(model.meter.recomputed)


@pytest.mark.parametrize("recompute,saves_memory", [
    (["attn_scores", "softmax", "attn_dropout"], True),
    (["ln1", "qkv", "attn_v", "gelu"], True),
    (["out_proj", "resid1", "ln2", "fc1"], True),
    (["gelu"], False),  # its input stays for the replay and fc2 keeps its output: nothing freed
    (operator_names(tiny(0.1)), True),
])
def test_recompute_happens_exactly_where_planned(recompute, saves_memory):
    """Catches recomputation that is silently skipped (or applied to other operators), dropout that
    draws new masks on replay, and saved activations that do not shrink where the planner's memory
    rule says they should."""
    spec = tiny(0.1)
    base_grads, base_dx, base_bytes, base_re = _run(_blocks(spec, []), spec)
    grads, dx, nbytes, re = _run(_blocks(spec, recompute), spec)
    assert base_re == {}
    assert re == {op: 2 for op in recompute}  # two layers, one micro-batch, each planned op once more
    assert torch.equal(dx, base_dx)
    for n in grads:
        assert torch.equal(grads[n], base_grads[n]), n
    assert nbytes < base_bytes if saves_memory else nbytes == base_bytes


def test_full_recompute_keeps_only_segment_inputs():
    """Everything recomputed: a layer keeps its input plus the all-reduce results its recomputed
    consumers need (attn_out, x_mid, mlp_out): 4 x (B, T, C) fp32 per layer, as the planner assumes.

    Catches a segment that spans an all-reduce, or a checkpoint that keeps more than its inputs."""
    spec = tiny(0.1)
    model = _blocks(spec, operator_names(spec))
    program = next(iter(model.h.values())).program
    assert [item[0] for item in program if isinstance(item, tuple)] == ["allreduce", "allreduce"]
    segs = [item for item in program if isinstance(item, _Segment)]
    assert [s.ops[-1].name for s in segs] == ["out_proj", "fc2", "resid2"]
    _, _, nbytes, _ = _run(model, spec)
    assert nbytes == 2 * 4 * (2 * spec.seq_len * spec.hidden_dim * 4)


def test_reference_model_is_deterministic_and_learns_nothing_from_global_rng():
    """Catches dropout drawn from the global RNG (then recompute and other splits could not replay it)."""
    spec = tiny(0.1)
    idx = torch.randint(0, spec.vocab_size, (2, spec.seq_len))
    torch.manual_seed(0)
    a = GPT(spec)(idx, idx)[1]
    torch.manual_seed(1)
    b = GPT(spec)(idx, idx)[1]
    assert a.item() == b.item()


def test_token_source_is_a_function_of_sample_position(tmp_path):
    """Catches data that depends on the plan's micro-batching (resume under another plan would diverge)."""
    from runtime.data.source import TokenSource

    spec = tiny()
    one = TokenSource(spec, seed=1, global_batch=4)
    x, y = one.batch(2, torch.arange(4))
    x2, _ = one.batch(2, torch.tensor([2, 3]))
    assert torch.equal(x[2:], x2) and torch.equal(x[:, 1:], y[:, :-1])
    resumed = TokenSource(spec, seed=1, global_batch=2, start_step=4, start_sample=8)  # steps 0-1 had batch 4
    assert torch.equal(resumed.batch(4, torch.arange(2))[0], one.batch(2, torch.arange(2))[0])
    f = tmp_path / "t.txt"
    f.write_bytes(b"hello world " * 20)
    xt, _ = TokenSource(spec, path=str(f), seed=0, global_batch=1).batch(0, torch.arange(1))
    assert xt.max() < 256 and bytes(xt[0].tolist()) in b"hello world " * 20


def test_checkpoint_directory_appears_whole_or_not_at_all(tmp_path):
    """Catches a failure while writing that leaves a partial checkpoint under its final name."""
    from runtime.train.checkpoint import latest_checkpoint, write_dir_atomically

    def broken(tmp):
        (tmp / "model.safetensors").write_bytes(b"partial")
        raise OSError("disk full")

    with pytest.raises(OSError):
        write_dir_atomically(tmp_path / "step-000001", broken)
    assert list(tmp_path.iterdir()) == []
    write_dir_atomically(tmp_path / "step-000002", lambda tmp: (tmp / "meta.json").write_text("{}"))
    assert latest_checkpoint(tmp_path) == tmp_path / "step-000002"


def _inbox(device_type: str, count: int):
    """An ``_Inbox`` over a topology that logs what it is asked to do (no process group)."""
    from types import SimpleNamespace

    from runtime.train.engine import _Inbox

    log = []

    def post_recv(buf, src, tag=0):
        log.append(("post", src))
        return len(log)

    def wait_recv(posted, *, timeout_s):
        log.append(("wait", posted))
        return torch.tensor(float(posted))

    engine = SimpleNamespace(device=torch.device(device_type), timeout_s=7.0, tracer=None,
                             topo=SimpleNamespace(post_recv=post_recv, wait_recv=wait_recv),
                             _boundary_buffer=lambda: torch.empty(1))
    return _Inbox(engine, 3, [(i, 1) for i in range(count)], step=0), log


def test_inbox_posts_each_receive_one_micro_batch_ahead_on_cpu():
    """Over gloo the receive for micro-batch i+1 is posted when i's arrives, and the first at once (the
    sender's transfer starts when it sends, eq. 1); none beyond the step's count. Catches a receive
    posted only when needed (milliseconds per micro-batch between CPU processes) or one too many (it
    would take the next step's first tensor)."""
    inbox, log = _inbox("cpu", 3)
    assert log == [("post", 3)]
    got = [inbox.take((i, 1)).item() for i in range(3)]
    assert log == [("post", 3), ("wait", 1), ("post", 3), ("wait", 3), ("post", 3), ("wait", 5)]
    assert got == [1.0, 3.0, 5.0]
    with pytest.raises(RuntimeError, match="out of order"):
        inbox.take((0, 1))


def test_inbox_posts_each_receive_when_needed_on_cuda():
    """Under NCCL a receive posted early would hold up this rank's own sends to that peer: post at take."""
    inbox, log = _inbox("cuda", 2)
    assert log == []
    inbox.take((0, 1))
    assert log == [("post", 3), ("wait", 1)]
    inbox.take((1, 1))
    assert log[2:] == [("post", 3), ("wait", 3)]


def test_interrupts_wait_until_the_loop_takes_them():
    """The launcher reads its ranks' messages inside ``interrupts_as_flags``: a Ctrl-C or SIGTERM raised in the
    middle of a read would leave the pipe misaligned (the next read waits forever), and one raised right after
    it would lose the message. A signal only notes itself until the loop asks; then it is raised as the right
    exception, one per signal, in order; the handlers are put back after the block."""
    import os
    import signal

    from runtime.launch.processes import Terminated, interrupts_as_flags

    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with interrupts_as_flags() as interrupted:
        interrupted()  # nothing waiting: returns
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        read = "a message read after the signals"  # not cut off
        with pytest.raises(Terminated):
            interrupted()
        with pytest.raises(KeyboardInterrupt) as caught:
            interrupted()
        assert not isinstance(caught.value, Terminated)
        interrupted()
    assert read and (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
