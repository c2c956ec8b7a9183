"""The optimizer step as one kernel family (runtime/train/precision.py, runtime/train/sharded_optimizer.py).

The fp32 master step runs torch's fused AdamW where the device has it (CUDA) and every tensor is contiguous,
else foreach, and on CPU ``precision.CPU_ADAMW_KERNEL`` (torch's per-tensor loop, or its fused CPU kernel);
gradient unscaling (fp16 loss scale, clipping factor) and the rounding of the masters into the compute-dtype
weights are foreach calls. These tests compare the result, over several steps with a decaying and a
non-decaying parameter group, with torch's reference single-tensor AdamW (``foreach=False``) on fp32 copies fed
the same gradients, unscaled the same way; each test runs with the CPU loop and with the fused kernel (on CPU
the same fused arithmetic CUDA's kernel does, in the same fp32 order).

Tolerance: the loop is compared bit for bit. The fused kernel: 1e-6 of the largest weight of a tensor (masters; the bf16/fp16 weights within one rounding of the
reference). The fused kernel does AdamW's arithmetic in fp32 in another order than the reference loop, which
takes ``lr / bias_correction1`` and the bias corrections in Python doubles, so a weight may differ by an ulp or
two of fp32 (measured on CPU: up to 1.4e-7 of the largest weight after four or five steps; the fp32 masters
were bitwise equal in other cases). An error in the update itself (a missing unscale, weight decay on the wrong
group, a step count off by one, moments not kept) moves weights by about lr = 1e-2 relative, 10^4 times more.
"""
from __future__ import annotations


import pytest
import torch
import torch.nn as nn

from runtime.train.precision import LossScaleSettings, MasterWeights, adamw_kernel

LR, BETAS, EPS, WD = 1e-2, (0.9, 0.95), 1e-8, 0.1
STEPS = 5
FUSED_REL_TOL = 1e-6


@pytest.fixture(params=["loop", "fused"])
def cpu_kernel(request, monkeypatch):
    """The CPU kernel under test; returns the tolerance that goes with it."""
    from runtime.train import precision

    fused = request.param == "fused"
    monkeypatch.setattr(precision, "CPU_ADAMW_KERNEL", {"fused": True} if fused else {"foreach": False})
    return FUSED_REL_TOL if fused else 0.0


def _module(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(24, 40), nn.LayerNorm(40), nn.Linear(40, 16))


def _decays(module: nn.Module) -> list[bool]:
    return [name.endswith("weight") and p.dim() >= 2 for name, p in module.named_parameters()]


def _grads(module: nn.Module, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g) * 1e-2 for p in module.parameters()]


def _reference(initial: list[torch.Tensor], decays: list[bool], grads_of, factors) -> list[torch.Tensor]:
    """torch's single-tensor AdamW over fp32 copies of ``initial``; ``grads_of(step)`` the fp32 gradients as the
    masters see them (unscaled), ``factors[step]`` None for a skipped step."""
    masters = [nn.Parameter(t.detach().float().clone()) for t in initial]
    groups = [{"params": [m for m, d in zip(masters, decays) if d]},
              {"params": [m for m, d in zip(masters, decays) if not d], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)
    for step, factor in enumerate(factors):
        if factor is None:
            continue
        for m, g in zip(masters, grads_of(step)):
            m.grad = g * factor
        opt.step()
    return [m.detach() for m in masters]


def _close(got: list[torch.Tensor], want: list[torch.Tensor], tol: float) -> None:
    for a, b in zip(got, want):
        err = (a.float() - b).abs().max().item() / b.abs().max().item()
        assert err <= tol, f"off by {err:.2e} relative (tolerance {tol:.0e})"


def test_master_weights_take_the_chosen_kernel(cpu_kernel):
    """Catches: the optimizer built with torch's default whatever the choice, the fused kernel given a strided
    view (the fused CPU kernel updates one wrongly)."""
    weights = MasterWeights(_module(), "fp32", lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, decays=_decays(_module()))
    assert bool(weights.optimizer.defaults["fused"]) == (cpu_kernel > 0)
    strided = torch.zeros(8, 8)[:, 2:5]
    assert "fused" not in adamw_kernel([torch.zeros(3), strided]), "a strided view must not take the fused kernel"


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_master_weights_step_equals_reference_adamw(dtype, cpu_kernel):
    """fp32 (the module's own parameters) and bf16 (fp32 masters, bf16 weights rounded from them), with a
    clipping factor on every other step. Catches: the factor applied twice or not at all, the decay applied to
    the LayerNorm and biases, the bf16 weights not rounded from the updated masters."""
    module = _module()
    initial = [p.detach().clone() for p in module.parameters()]
    decays = _decays(module)
    weights = MasterWeights(module, dtype, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, decays=decays)
    factors = [1.0 if step % 2 == 0 else 0.5 for step in range(STEPS)]
    for step, factor in enumerate(factors):
        for p, g in zip(weights.params, _grads(module, step)):
            p.grad = g.to(p.dtype)
        assert weights.step(grad_factor=factor)
    # The masters see the gradients as the module holds them (bf16-rounded), turned to fp32.
    want = _reference(initial, decays, lambda s: [g.to(weights.params[0].dtype).float() for g in _grads(module, s)], factors)
    _close(weights.masters, want, cpu_kernel)
    if dtype == "bf16":
        assert all(p.dtype == torch.bfloat16 for p in weights.params)
        for p, m in zip(weights.params, weights.masters):
            assert torch.equal(p, m.to(torch.bfloat16)), "the weights are the masters, rounded"


def test_fp16_step_unscales_and_skips_an_overflowing_step(cpu_kernel):
    """fp16 with a loss scale of 1024: the gradients arrive scaled, the step divides them by the scale (and the
    clipping factor multiplies) on their way into fp32; a step flagged as overflowing changes nothing and the
    AdamW step count does not move. Catches: an unscale missed or done twice, moments touched on a skipped step."""
    module = _module()
    initial = [p.detach().clone() for p in module.parameters()]
    decays = _decays(module)
    scale = 1024.0
    weights = MasterWeights(module, "fp16", lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, decays=decays,
                            loss_scale=LossScaleSettings(initial_scale=scale, growth_interval_steps=10**6))
    factors = [1.0, 0.5, None, 1.0, 0.25]  # None: overflow
    scales = []  # the scale each step's backward ran with (halved after the overflow)
    for step, factor in enumerate(factors):
        before = [m.clone() for m in weights.masters]
        scales.append(weights.loss_scale)
        for p, g in zip(weights.params, _grads(module, step)):
            p.grad = (g * scales[-1]).to(torch.float16)
        updated = weights.step(overflow=factor is None, grad_factor=1.0 if factor is None else factor)
        assert updated == (factor is not None)
        if factor is None:
            assert all(torch.equal(a, b) for a, b in zip(before, weights.masters)), "a skipped step moved the weights"
    assert weights.scaler.scale == scale / 2  # one back-off
    want = _reference(initial, decays,
                      lambda s: [(g * scales[s]).to(torch.float16).float() / scales[s] for g in _grads(module, s)], factors)
    _close(weights.masters, want, cpu_kernel)
    steps = {int(st["step"]) for st in weights.optimizer.state.values()}
    assert steps == {4}, steps


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_sharded_step_equals_reference_adamw(one_rank_group, dtype, cpu_kernel):
    """``ShardedAdamW`` (zero_stage 1, the one rank owning every shard) fed set gradients: the owned masters and
    the module's weights after several steps equal the reference on the full parameters (fp16: loss-scaled
    gradients unscaled on their way in). Catches: the functional call's step count off by one, the unscale or
    the decay groups wrong, the compute-dtype pieces not rounded from the masters."""
    from runtime.model.family import init_parameter
    from runtime.train.engine import Engine
    from runtime.train.optim_settings import decays as decays_of
    from tests.runtime_helpers import replicas_plan, tiny

    plan = replicas_plan(tiny(0.0, dtype=dtype), [dict(stages=[[1]], layers=[4], units=1, m=1, mbs=1)], zero_stage=1)
    engine = Engine(plan, 0, seed=0, lr=LR, weight_decay=WD,
                    loss_scale=LossScaleSettings(initial_scale=256.0, growth_interval_steps=10**6))
    named = list(engine.model.named_parameters())
    initial = [init_parameter(plan.model, name, 0) for name, _ in named]
    decays = [decays_of(name) for name, _ in named]
    scale = engine.precision.loss_scale
    compute = named[0][1].dtype

    def grads_as_held(step):
        g = torch.Generator().manual_seed(7 + step)
        return [(torch.randn(p.shape, generator=g) * 1e-2 * scale).to(compute) for _, p in named]

    factors = [1.0, 0.5, 1.0, 0.25]
    for step, factor in enumerate(factors):
        for (_, p), g in zip(named, grads_as_held(step)):
            p.grad.copy_(g)
        engine.precision.set_lr(LR)
        assert engine.precision.step(grad_factor=factor)
    want = dict(zip([name for name, _ in named],
                    _reference(initial, decays, lambda s: [g.float() / scale for g in grads_as_held(s)], factors)))
    checked = 0
    for shard in engine.precision.shards:  # the owned (master) weights, entry by entry of the flat vector
        for e in shard.sg.layout.entries:
            got = engine.precision.state_range(shard.sg.index, e.offset, e.offset + e.numel)[0]
            _close([got], [want[e.name].reshape(-1)], cpu_kernel)
            checked += 1
    assert checked == len(named)
    for name, p in named:  # the module's weights: the masters rounded (fp32: the masters themselves)
        assert p.dtype == compute
        if dtype == "fp32":
            _close([p.detach()], [want[name]], cpu_kernel)
        elif cpu_kernel == 0.0:
            assert torch.equal(p.detach(), want[name].to(compute)), name
        else:  # within one rounding to bf16/fp16 of the reference
            torch.testing.assert_close(p.detach().float(), want[name].to(compute).float(), rtol=2 ** -7, atol=0.0)
