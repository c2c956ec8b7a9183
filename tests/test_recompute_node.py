"""A recomputed segment as one autograd node (``tp_layer._Recompute``): the numbers of torch.utils.checkpoint, bit
for bit, and a forward that keeps nothing of the segment but its inputs."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from baton.memory import held_tensors
from baton.model_spec import PRESETS
from baton.operators import ALLREDUCE_OUTPUTS, operator_names
from runtime.parallel.llama_layer import parallel_block
from runtime.parallel.tp_layer import MicroBatch, ParallelBlock

RECOMPUTE = {
    "all": None,  # every operator of the layer
    "attention": ("attn_core",),
    "mlp": ("ln2", "fc1", "gelu", "fc2"),
}


def spec_of(family: str, dropout: float):
    base = PRESETS["tiny-llama" if family == "llama" else "tiny"]
    return base.with_overrides(attention="fused", dropout=0.0 if family == "llama" else dropout)


def recompute_of(spec, which: str) -> frozenset[str]:
    names = operator_names(spec)
    chosen = names if RECOMPUTE[which] is None else [n for n in RECOMPUTE[which] if n in names]
    return frozenset(chosen)


def block_of(spec, recompute: frozenset[str]) -> ParallelBlock:
    torch.manual_seed(0)
    block = parallel_block(spec, 0, heads=range(spec.num_heads), ffn_cols=range(spec.ffn_dim), recompute=recompute)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.05)
    return block


def step(block, spec, x):
    """The block's output and the gradients of its input and parameters after one backward."""
    x = x.clone().requires_grad_(True)
    mb = MicroBatch(seed=3, step=5, samples=torch.arange(x.shape[0]))
    y = block(x, mb)
    (y.float() * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    return y.detach(), x.grad, [p.grad.clone() for p in block.parameters()]


@pytest.mark.parametrize("family", ["gpt", "llama"])
@pytest.mark.parametrize("which", sorted(RECOMPUTE))
def test_the_segment_node_computes_what_the_checkpoint_computes(family, which, monkeypatch):
    spec = spec_of(family, dropout=0.1)
    recompute = recompute_of(spec, which)
    x = torch.randn(2, spec.seq_len, spec.hidden_dim)
    block = block_of(spec, recompute)
    node = step(block, spec, x)
    # Every operator ran once and the recomputed ones once more, in full: the planner charges each replay. (The
    # checkpoint skips a segment that saved nothing, such as Llama's last residual add without dropout.)
    assert {n: c for n, c in block.meter.calls.items() if c != 1} == {n: 2 for n in recompute}
    for p in block.parameters():
        p.grad = None
    monkeypatch.setattr(ParallelBlock, "checkpoint_segments", True)
    checkpointed = step(block, spec, x)
    assert torch.equal(node[0], checkpointed[0]) and torch.equal(node[1], checkpointed[1])
    assert all(torch.equal(a, b) for a, b in zip(node[2], checkpointed[2]))


@pytest.mark.parametrize("family", ["gpt", "llama"])
@pytest.mark.parametrize("which", sorted(RECOMPUTE))
def test_a_forward_keeps_only_what_the_plan_holds(family, which, monkeypatch):
    """Every tensor an operator made in the forward is freed by the forward's end unless the plan holds it
    (``baton.memory.held_tensors``) or it is the layer's output: a recomputed segment keeps its inputs, nothing of
    its inside."""
    spec = spec_of(family, dropout=0.0)
    recompute = recompute_of(spec, which)
    block = block_of(spec, recompute)
    made: dict[str, weakref.ref] = {}
    run_ops = ParallelBlock._run_ops

    def watching(self, ops, mb, env, *rest):
        run_ops(self, ops, mb, env, *rest)
        if not self.meter.in_backward:
            for op in ops:
                for name in op.outputs:
                    made.setdefault(name, weakref.ref(env[name]))

    monkeypatch.setattr(ParallelBlock, "_run_ops", watching)
    x = torch.randn(2, spec.seq_len, spec.hidden_dim, requires_grad=True)
    y = block(x, MicroBatch(seed=3, step=5, samples=torch.arange(2)))
    gc.collect()
    alive = {name for name, ref in made.items() if ref() is not None}
    held = set(held_tensors(spec, recompute))
    # Alone in its TP group a row-parallel product's all-reduce returns the product itself: held under both names.
    allowed = held | {"layer_output"} | {partial for partial, full in ALLREDUCE_OUTPUTS.items() if full in held}
    assert alive <= allowed, sorted(alive - allowed)
    assert y.requires_grad
