"""Activation offload in the runtime (``runtime/parallel/offload.py``), on CPU: the same code path as on CUDA with
host-to-host copies and no streams.

A layer that offloads a held tensor must compute exactly what it computes without (the backward reads the very
bytes, in the very layout), keep exactly the cost model's bytes of that tensor on the host
(``baton.memory.tensor_bytes``) and no longer on the device (the ``SavedBytes`` meter and the tensors' own
lifetimes say so), keep micro-batches in flight apart and reuse its host buffers from step to step.
"""
from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn as nn

from baton.memory import is_held, layer_order, tensor_bytes, tensor_roles
from baton.model_spec import PRESETS
from baton.operators import layer_operators, operator_names
from baton.profile import Profile, derive_table
from runtime.measure.meters import SavedBytes
from runtime.parallel.llama_layer import parallel_block
from runtime.parallel.offload import COPY_ALIGN_BYTES, OffloadStash, View
from runtime.parallel.tp_layer import MicroBatch

B = 2
GPT_EAGER = PRESETS["tiny"].with_overrides(dropout=0.1, attention="eager")
GPT_FUSED = PRESETS["tiny"].with_overrides(dropout=0.1, attention="fused")
LLAMA = PRESETS["tiny-llama"].with_overrides(dropout=0.1)
SPECS = {"eager": GPT_EAGER, "fused": GPT_FUSED, "llama": LLAMA}


def held_tensors(spec, recompute) -> frozenset[str]:
    roles, order = tensor_roles(spec), layer_order(spec)
    return frozenset(t for t, role in roles.items() if is_held(role, frozenset(recompute), order))


def stack(spec, recompute=(), offload=(), *, layers=2, heads=None):
    """``layers`` blocks sharing one meter and one stash, with the same (random) weights whatever the offload."""
    heads = heads or range(spec.num_heads)
    nf = spec.ffn_dim * len(heads) // spec.num_heads
    stash = OffloadStash()
    blocks = nn.ModuleList([parallel_block(spec, i, heads=heads, ffn_cols=range(nf), recompute=frozenset(recompute),
                                           offload=frozenset(offload), stash=stash) for i in range(layers)])
    for b in blocks[1:]:
        b.meter = blocks[0].meter
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in blocks.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (1.0 if p.dim() == 1 else 0.0))
    return blocks, stash


def forward(blocks, stash, saved, key, *, seed=1):
    """One micro-batch's forward through the stack (input a non-leaf, so nothing outside holds it); returns
    (leaf input, output)."""
    gen = torch.Generator().manual_seed(seed)
    x0 = torch.randn(B, blocks[0].spec.seq_len, blocks[0].spec.hidden_dim, generator=gen, requires_grad=True)
    mb = MicroBatch(seed=0, step=0, samples=torch.arange(B) + B * key)
    blocks[0].meter.saved = saved  # as the engine sets it: what the offload hooks keep on the device is counted there
    with saved.record(key), stash.record(key):
        y = x0 * 1.0
        for b in blocks:
            y = b(y, mb)
    return x0, y


def backward(blocks, y, saved, stash, key):
    blocks[0].meter.in_backward = True
    (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    blocks[0].meter.in_backward = False
    saved.release(key)
    stash.release(key)


def one_step(spec, recompute, offload, **kw):
    blocks, stash = stack(spec, recompute, offload, **kw)
    saved = SavedBytes(blocks.parameters())
    x0, y = forward(blocks, stash, saved, 0)
    host = {layer: stash.held_by_tensor(0, layer) for layer in range(len(blocks))}
    host_total, device_total = stash.held_bytes(0), saved.total()
    backward(blocks, y, saved, stash, 0)
    grads = [x0.grad] + [p.grad for p in blocks.parameters()]
    return dict(y=y.detach(), grads=grads, host=host, host_total=host_total, device=device_total, stash=stash)


def analytic_bytes(spec, share=1.0) -> dict[str, float]:
    """``baton.memory.tensor_bytes`` from the derived (analytic) table: what the cost model charges per tensor."""
    p = Profile(derive_table(spec, "cpu", micro_batches=(B,)))
    costs = {o.name: p.cost(o.name, B, share if o.tp_split else 1.0) for o in layer_operators(spec)}  # as layer_prices
    return tensor_bytes(spec, B, share, {n: c.saved_bytes for n, c in costs.items()}, {n: c.output_bytes for n, c in costs.items()})


ALL = "all held"
CASES = [
    # (spec, recompute, offload): single kept tensors, private tensors, everything, segment inputs, mixes.
    ("eager", [], ["probs"]),
    ("eager", [], ["attn_mask", "ln1_stats", "resid2_mask"]),  # private tensors: a dropout mask, LayerNorm's mean and rstd
    ("eager", [], ["ctx"]),  # out_proj keeps its own (B, T, nl hs) copy of ctx
    ("eager", [], ["k", "v"]),  # k saved by the scores' product as a transposed view
    ("eager", [], ALL),
    ("eager", "all", ["layer_input"]),  # Cephalo: layer-boundary checkpoint + offload of the boundary
    ("eager", "all", ALL),  # the layer input and the all-reduce results fed to segments
    ("eager", ["softmax", "attn_dropout"], ["scores", "q", "x_mid"]),  # a segment input beside kept tensors
    ("eager", ["gelu"], ["fc1_out", "gelu_out"]),  # a segment input and a segment output kept by fc2
    ("eager", ["out_proj", "resid1", "ln2", "fc1"], ALL),
    ("fused", [], ["q", "k", "v"]),  # views of one qkv storage, copied once
    ("fused", [], ["attn_lse", "ctx"]),
    ("fused", [], ALL),
    ("fused", ["attn_core"], ["q", "k", "v"]),  # views fed to a segment
    ("fused", "all", ["layer_input"]),
    ("fused", ["ln1", "qkv"], ["layer_input", "x_mid"]),  # x_mid: saved by ln2 and fed to resid2's segment, one copy
    ("llama", [], ALL),
    ("llama", [], ["rms1_stats", "gate"]),
    ("llama", "all", ["layer_input"]),
    ("llama", ["rope", "attn_core"], ["q", "k", "v"]),  # views fed to a segment
    ("llama", ["swiglu"], ["gate", "up", "swiglu_out"]),
]


def _resolve(spec, recompute, offload):
    recompute = operator_names(spec) if recompute == "all" else recompute
    offload = held_tensors(spec, recompute) if offload == ALL else frozenset(offload)
    return recompute, offload


@pytest.mark.parametrize("name,recompute,offload", CASES, ids=lambda v: v if isinstance(v, str) else "-".join(v) or "none")
def test_offload_changes_no_number_and_moves_exactly_the_modelled_bytes(name, recompute, offload):
    """Outputs and input and parameter gradients bit for bit those of the same layers without offload (dropout on);
    per layer the host holds exactly ``tensor_bytes`` of the offloaded tensors and the device (``SavedBytes``)
    exactly that much less; every byte copied out comes back in, prefetched one layer ahead.

    Catches: a restored tensor in another layout or with other bytes, a dropout mask drawn again, a private tensor
    or view not recognised (kept on the device or copied twice), a segment input kept by the checkpoint, the
    meter still counting offloaded tensors, a prefetch that never runs."""
    spec = SPECS[name]
    recompute, offload = _resolve(spec, recompute, offload)
    base = one_step(spec, recompute, ())
    run = one_step(spec, recompute, offload)
    assert torch.equal(run["y"], base["y"])
    for g, g0 in zip(run["grads"], base["grads"]):
        assert torch.equal(g, g0)
    sizes = analytic_bytes(spec)
    for host in run["host"].values():
        by_name: dict[str, int] = {}
        for label, nbytes in host.items():
            names = label.split("+")
            assert nbytes == sum(sizes[n] for n in names), label
            by_name.update((n, sizes[n]) for n in names)
        assert set(by_name) == offload
    assert run["host_total"] == 2 * sum(sizes[n] for n in offload)
    assert base["device"] - run["device"] == run["host_total"]
    stash = run["stash"]
    assert stash.copied_out_bytes == stash.copied_in_bytes == run["host_total"]
    assert stash.late_bytes == 0
    assert stash.held_bytes() == 0


def test_share_below_one_moves_the_modelled_bytes():
    """Heads 1..3 of 4 (share 3/4): split tensors shrink on the host as the cost model says."""
    spec = GPT_FUSED
    offload = held_tensors(spec, [])
    run = one_step(spec, [], offload, heads=range(1, 4), layers=1)
    sizes = analytic_bytes(spec, 0.75)
    assert run["host_total"] == sum(sizes[n] for n in offload)


def test_micro_batches_in_flight_stay_apart():
    """F0, F1, B0, B1 as 1F1B runs them: each micro-batch's tensors come back to its own backward, and the
    host holds both while both are in flight. Catches entries keyed by layer only."""
    spec = GPT_EAGER
    offload = held_tensors(spec, ["gelu"])
    results = []
    for off in ((), offload):
        blocks, stash = stack(spec, ["gelu"], off)
        saved = SavedBytes(blocks.parameters())
        x0, y0 = forward(blocks, stash, saved, 0, seed=1)
        x1, y1 = forward(blocks, stash, saved, 1, seed=2)  # other inputs and dropout masks
        one = stash.held_bytes(0)
        assert stash.held_bytes(1) == one and stash.held_bytes() == 2 * one
        backward(blocks, y0, saved, stash, 0)
        assert stash.held_bytes() == stash.held_bytes(1) == one
        g0 = [p.grad.clone() for p in blocks.parameters()]
        backward(blocks, y1, saved, stash, 1)
        results.append([y0, y1, x0.grad, x1.grad, *g0, *(p.grad for p in blocks.parameters())])
    for u, v in zip(*results):
        assert torch.equal(u, v)
    assert one > 0
    assert stash.peak_held_bytes == stash.copied_out_bytes == 2 * one
    assert stash.late_bytes == 0


def test_a_layers_storages_travel_as_one_copy_and_come_back_as_they_were():
    """Storages of several element types and layouts (a float32 tensor, a bool mask, a transposed float64 slice) of
    one layer: one host buffer, each part at an aligned offset, and each view read back equal, strides and all; a
    read before the layer's flush (and so before any prefetch) copies it out and back then. Catches parts overlapping or misaligned in the shared buffer and
    element offsets counted in bytes."""
    gen = torch.Generator().manual_seed(3)
    tensors = {"a": torch.randn(5, 7, generator=gen), "mask": torch.rand(33, generator=gen) > 0.5,
               "t": torch.randn(6, 9, generator=gen, dtype=torch.float64)[1:, 2:].t()}
    for flush_first in (True, False):
        stash = OffloadStash()
        with stash.record(0):
            stash.begin(0)
            parts = {n: stash.store(0, 0, n, (n,), t) for n, t in tensors.items()}
            for p in parts.values():
                p.uses = 1
            if flush_first:
                stash.flush()
        if flush_first:
            stash.prefetch(0, 0)
        copy = stash._groups[0][0]
        assert [p.offset % COPY_ALIGN_BYTES for p in parts.values()] == [0, 0, 0]
        ends = sorted((p.offset, p.offset + p.nbytes) for p in parts.values())
        assert all(e <= s for (_, e), (s, _) in zip(ends, ends[1:]))  # no part overlaps the next
        assert stash.held_bytes(0) == sum(t.untyped_storage().nbytes() for t in tensors.values())
        for n, t in tensors.items():
            back = stash.read(parts[n], View.of(t))
            assert back.dtype == t.dtype and back.stride() == t.stride() and torch.equal(back, t), n
        assert copy.host is not None and copy.restored is None  # the last read let the device copy go
        assert stash.late_bytes == (0 if flush_first else stash.held_bytes(0))  # not prefetched: copied when read
        stash.release(0)
        assert stash.held_bytes() == 0 and stash.host_buffers_allocated == 1


def test_a_second_step_allocates_no_host_buffers():
    """Two steps of two micro-batches: the second takes every host buffer from the pool."""
    spec = LLAMA
    blocks, stash = stack(spec, [], held_tensors(spec, []))
    saved = SavedBytes(blocks.parameters())
    counts = []
    for _ in range(2):
        stash.reset()
        ys = [forward(blocks, stash, saved, k, seed=k)[1] for k in range(2)]
        for k, y in enumerate(ys):
            backward(blocks, y, saved, stash, k)
        counts.append(stash.host_buffers_allocated)
    assert counts[0] > 0 and counts[1] == counts[0]
    assert stash.copied_out_bytes == stash.copied_in_bytes > 0


@pytest.mark.parametrize("name,recompute,offload", [
    ("eager", [], ALL), ("fused", [], ALL), ("fused", "all", ALL), ("llama", ["rope", "attn_core"], ["q", "k", "v"])])
def test_offloaded_device_tensors_are_freed_after_the_forward(name, recompute, offload):
    """After the forward no storage of a tensor of an offloaded name is alive (storages, not tensor objects: a
    detached alias or a view keeps the bytes too): autograd and the checkpoint hold host copies only. Without
    offload the same check finds them alive, so it can fail.

    Catches: a saved-tensor handle or a checkpoint's positional input still pointing at the device tensor."""
    spec = SPECS[name]
    recompute, offload = _resolve(spec, recompute, offload)

    def alive_after_forward(off):
        blocks, stash = stack(spec, recompute, off, layers=1)
        refs: dict[str, list] = {}
        run_ops = blocks[0]._run_ops

        def watching(ops, mb, env, *rest):
            run_ops(ops, mb, env, *rest)
            if not blocks[0].meter.in_backward:
                for n, t in env.items():
                    refs.setdefault(n, []).append(weakref.ref(t.untyped_storage()))
        blocks[0]._run_ops = watching
        saved = SavedBytes(blocks.parameters())
        _, y = forward(blocks, stash, saved, 0)
        gc.collect()
        return {n for n in offload if any(r() is not None for r in refs.get(n, []))}, set(refs), y

    alive, _, y = alive_after_forward(offload)
    assert alive == set()
    kept, seen, _ = alive_after_forward(())
    assert kept, "the check finds nothing alive even without offload"
    # Private tensors (statistics, masks) are no entries to watch; eager out_proj keeps a copy of ctx, not ctx.
    assert kept == {n for n in offload if n in seen} - ({"ctx"} if name == "eager" else set())


def test_refused_offload_sets():
    """Unknown names, tensors the layer does not hold, and part of fused attention's qkv storage are refused."""
    def build(spec, recompute, offload):
        parallel_block(spec, 0, heads=range(spec.num_heads), ffn_cols=range(spec.ffn_dim), recompute=frozenset(recompute),
                       offload=frozenset(offload))
    with pytest.raises(ValueError, match="unknown tensors qkv_out of a layer"):
        build(GPT_EAGER, [], ["qkv_out"])
    with pytest.raises(ValueError, match="scores not held from the forward"):
        build(GPT_EAGER, [], ["scores"])  # softmax keeps its output, not its input
    with pytest.raises(ValueError, match="ln1_out not held from the forward"):
        build(GPT_EAGER, ["ln1", "qkv"], ["ln1_out"])  # recomputed inside its segment
    with pytest.raises(ValueError, match="views of one qkv storage"):
        build(GPT_FUSED, [], ["q"])


def test_micro_batch_keys_are_checked():
    """Validation passes (no autograd) offload nothing and need no micro-batch key; a training forward outside
    ``record``, or under a key whose copies were never released, is an error, not a silent mix of micro-batches."""
    blocks, stash = stack(GPT_EAGER, [], ["probs"], layers=1)
    x = torch.randn(B, GPT_EAGER.seq_len, GPT_EAGER.hidden_dim)
    mb = MicroBatch(seed=0, step=0, samples=torch.arange(B))
    with torch.no_grad():
        blocks[0](x, mb)
    assert stash.copied_out_bytes == 0
    with pytest.raises(RuntimeError, match="outside OffloadStash.record"):
        blocks[0](x.requires_grad_(), mb)
    with stash.record(0):
        blocks[0](x, mb)
        with pytest.raises(RuntimeError, match="before OffloadStash.release"):
            blocks[0](x, mb)  # micro-batch 0 again, its copies never released
