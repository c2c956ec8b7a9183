"""The optimisation settings of a run: learning-rate schedule, gradient clipping, which parameters decay.

The schedule is a pure function of the step (nanoGPT's ``get_lr``, Megatron's ``OptimizerParamScheduler``):
linear warm-up from ``lr / warmup_steps`` to ``lr`` over the first ``warmup_steps`` steps, then a decay
to ``lr_min`` ending at ``decay_steps`` (cosine, linear, or none), and ``lr_min`` after that. Because it
keeps no state besides the step, a resumed run under any plan continues exactly where it stopped; the
checkpoint records the settings (``as_dict``) so a resume can say when they changed.

Weight decay skips biases and LayerNorm parameters (nanoGPT's rule: only tensors of 2 or more dimensions
decay, which are the matrices and embeddings), decided on full parameter names so a TP shard of a
weight decays exactly as the full weight does.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

DECAYS = ("cosine", "linear", "constant")


@dataclass(frozen=True, kw_only=True, slots=True)
class LRSchedule:
    """Learning rate of every step."""

    lr: float
    """Peak learning rate, reached at the end of warm-up."""
    lr_min: float = 0.0
    """Learning rate at the end of the decay (and after it)."""
    warmup_steps: int = 0
    """Steps of linear warm-up (0: start at ``lr``)."""
    decay: str = "constant"
    """cosine, linear or constant (no decay: ``lr`` after warm-up)."""
    decay_steps: int = 0
    """The step where the decay reaches ``lr_min`` (usually the run's --steps)."""

    def lr_at(self, step: int) -> float:
        """Learning rate of optimizer step ``step`` (0-based)."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.decay == "constant":
            return self.lr
        span = self.decay_steps - self.warmup_steps
        if span <= 0 or step >= self.decay_steps:
            return self.lr_min
        progress = (step - self.warmup_steps) / span
        if self.decay == "cosine":
            return self.lr_min + 0.5 * (self.lr - self.lr_min) * (1.0 + math.cos(math.pi * progress))
        return self.lr - (self.lr - self.lr_min) * progress

    def as_dict(self) -> dict:
        return asdict(self)


def decays(name: str) -> bool:
    """Whether parameter ``name`` (a ``runtime.model.gpt`` name) takes weight decay: weights of linear layers
    and embeddings do; biases and LayerNorm weights do not."""
    return name.endswith(".weight") and ".ln_" not in f".{name}" and not name.startswith("ln_f.")


def grad_square_sum(views, device=None):
    """Sum of squares of the gradient ``views`` (each norm in fp32, their squares summed in fp64): a rank's part of
    the global norm, a float64 scalar on ``device`` (the views'), not read to the host (the engine's step reads it once,
    with its other figures). Timed with the optimizer step it precedes
    (``runtime.measure.op_profiler.profile_optimizer``, eq. 10)."""
    import torch

    views = [v for v in views if v.numel()]
    if not views:
        return torch.zeros((), dtype=torch.float64, device=device)
    # One multi-tensor call for every view (a norm per view launched one by one cost 2 ms a step on a CPU).
    return torch.stack(torch._foreach_norm(views, 2, dtype=torch.float32)).double().pow(2).sum()


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """What gradients are multiplied by to clip their global norm to ``max_norm`` (torch's
    ``clip_grad_norm_`` formula, so a single-device reference using it agrees): 1 when no clipping."""
    if max_norm <= 0 or not math.isfinite(total_norm):
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))
