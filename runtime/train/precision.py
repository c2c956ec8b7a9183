"""Mixed precision as the cost model counts it (docs/cost-model.md, eq. 7 and 8).

The model spec's dtype decides:

* ``fp32``: the module's parameters are what AdamW updates; 4 + 4 + 8 bytes per parameter (weight,
  gradient, two moments).
* ``bf16``: the module computes in bf16 (weights, activations and gradients, 2 + 2 bytes); AdamW updates
  fp32 master copies with fp32 moments (4 + 8 bytes); after the update the bf16 weights are rounded
  from the masters.
* ``fp16``: as bf16, plus a dynamic loss scale (``LossScaler``): the loss is multiplied by the scale so
  small gradients survive fp16's range, the gradients are divided by it on their way into fp32, a step
  whose gradients hold inf or NaN on any rank is skipped on every rank, the scale halves after such a
  step and doubles after a run of clean ones.

Gradients stay in the compute dtype while they are accumulated and all-reduced (eq. 8 counts W_d of
them); ``MasterWeights.step`` turns them into fp32 a chunk of parameters at a time, so the fp32 copy of
the gradients never exists whole: the transient is at most the largest parameter (plus what AdamW
allocates for that chunk), and it comes after the backward pass has freed the activations.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""Model spec dtype -> the torch dtype of weights, activations and gradients."""


def compute_dtype(dtype: str) -> torch.dtype:
    return COMPUTE_DTYPES[dtype]


CPU_ADAMW_KERNEL = {"fused": True}
"""AdamW's kernel for CPU tensors: torch's fused CPU kernel. It is several times faster than the per-tensor loop
(torch's CPU default): 14.6M fp32 parameters on one thread of a 2-core Intel Xeon took 22 ms a step against the
loop's 101 ms, and the reference training loop of bench/bench_reference.py uses it. It agrees with the
loop to an ulp or two of fp32, not bit for bit (tests/test_optimizer_fused.py); ``{"foreach": False}`` selects
the loop."""


def adamw_kernel(tensors) -> dict:
    """The keyword that picks torch's AdamW kernel for ``tensors`` (parameters or master weights, their
    gradients and moments): ``fused=True`` (one fused kernel per dtype and device) on a device torch has it for
    (CUDA), when every tensor is contiguous, else ``foreach=True`` (a few multi-tensor kernels); on CPU
    ``CPU_ADAMW_KERNEL``. torch's own default is foreach on CUDA. The fused CPU kernel walks a tensor's storage
    as if it were dense, so it updates a strided view (a column range of a matrix, as ZeRO shards cut) wrongly;
    the CUDA one is not asked to: such tensors never take the fused kernel."""
    from torch.optim.optimizer import _get_fused_kernels_supported_devices  # private: no public list

    tensors = list(tensors)
    devices = {t.device.type for t in tensors}
    dense = all(t.is_contiguous() and t.is_floating_point() for t in tensors)
    if devices == {"cpu"}:
        return dict(CPU_ADAMW_KERNEL) if dense or not CPU_ADAMW_KERNEL.get("fused") else {"foreach": False}
    if tensors and dense and devices <= set(_get_fused_kernels_supported_devices()):
        return {"fused": True}
    return {"foreach": True}


def cpu_runs_natively(dtype: str) -> bool | None:
    """Whether this CPU has instructions for ``dtype``'s matrix products (oneDNN's own test: AVX-512 BF16 or
    AMX for bf16, AVX-512 FP16 or AMX for fp16); None when torch cannot tell. fp32 always runs natively."""
    if dtype == "fp32":
        return True
    probe = {"bf16": "_is_mkldnn_bf16_supported", "fp16": "_is_mkldnn_fp16_supported"}[dtype]
    try:
        return bool(getattr(torch.ops.mkldnn, probe)())
    except (AttributeError, RuntimeError):  # a private probe: a torch without it says nothing
        return None


def emulation_note(dtype: str, device_type: str, native: bool | None) -> str | None:
    """What a user should hear before a ``dtype`` model runs on ``device_type`` whose CPU lacks the
    instructions (``native``: ``cpu_runs_natively(dtype)``), else None. Without them PyTorch runs
    low-precision matrix products in an emulation: on a 2-core AMD EPYC with AVX2 only, a 512^3 bf16
    product on one thread took 207 ms against 4.6 ms in fp32. The run is right, and a table measured
    there is right for that CPU, but both are many times slower than fp32."""
    if device_type != "cpu" or dtype == "fp32" or native is not False:
        return None
    return (f"this CPU has no {dtype} instructions: PyTorch emulates {dtype} matrix products here, many times "
            f"slower than fp32 (the results are right; the model's dtype decides)")


# --- dynamic loss scaling (fp16) ---------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class LossScaleSettings:
    """How the fp16 loss scale moves."""

    initial_scale: float = 2.0**16
    """Scale of the first step (fp16's largest finite value is 65504; typical gradients are far below 1)."""
    growth_factor: float = 2.0
    """Multiplies the scale after ``growth_interval_steps`` clean steps in a row."""
    backoff_factor: float = 0.5
    """Multiplies the scale after a step with inf/NaN gradients."""
    growth_interval_steps: int = 1000
    """Clean steps in a row before the scale grows."""
    min_scale: float = 1.0
    """The scale never backs off below this (a model that overflows at scale 1 is not a scaling problem)."""


class LossScaler:
    """The loss scale and its history; every rank holds the same one because every rank sees the same
    overflow flag (the engine all-reduces it over every rank)."""

    def __init__(self, settings: LossScaleSettings | None = None):
        self.settings = settings or LossScaleSettings()
        self.scale = float(self.settings.initial_scale)
        self.clean_steps = 0
        """Steps without overflow since the scale last changed direction or grew."""
        self.skipped_steps = 0
        """Steps skipped for inf/NaN gradients over the whole run (restored on resume)."""

    def update(self, overflow: bool) -> None:
        """After a step: back off and count the skip on overflow, else grow after enough clean steps."""
        s = self.settings
        if overflow:
            self.scale = max(self.scale * s.backoff_factor, s.min_scale)
            self.clean_steps = 0
            self.skipped_steps += 1
            return
        self.clean_steps += 1
        if self.clean_steps >= s.growth_interval_steps:
            self.scale *= s.growth_factor
            self.clean_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        scale = float(state["scale"])
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"loss scale must be a finite positive number, got {scale!r}")
        self.scale = scale
        self.clean_steps = int(state.get("clean_steps", 0))
        self.skipped_steps = int(state.get("skipped_steps", 0))


# --- master weights and the optimizer step -----------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class StateBytes:
    """Bytes one rank's training state takes, measured from its tensors (eq. 7/8's terms)."""

    weights_bytes: int
    """Module parameters in the compute dtype (W_d)."""
    grads_bytes: int
    """Their gradients, in the compute dtype (W_d)."""
    master_bytes: int
    """fp32 master weights (4 bytes per parameter in fp16/bf16, none in fp32)."""
    moments_bytes: int
    """AdamW's two fp32 moments (8 bytes per parameter, once the first step has created them)."""
    host_optimizer_bytes: int = 0
    """With the optimizer state offloaded (``runtime.train.host_optimizer``): host memory it holds, fp32 masters,
    moments and the staging buffer (``host_staging_bytes``); ``master_bytes`` and ``moments_bytes`` are then 0 (they
    count device memory)."""
    host_staging_bytes: int = 0
    """Of ``host_optimizer_bytes``, the host buffer the gradients come into and fp16/bf16 weights leave from."""

    @property
    def optimizer_bytes(self) -> int:
        """Eq. 7's O_d: master weights and moments."""
        return self.master_bytes + self.moments_bytes


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


class MasterWeights:
    """Owns the AdamW step of one rank's module: over the module's own fp32 parameters, or over fp32
    master copies of its fp16/bf16 parameters (see the module docstring).

    Build it while the module is still fp32 (the masters are copied from the exact initial values),
    then it casts the module to the compute dtype itself.
    """

    def __init__(self, module: nn.Module, dtype: str, *, lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float, loss_scale: LossScaleSettings | None = None,
                 decays: list[bool] | None = None):
        self.dtype = dtype
        self.module = module
        self.params = list(module.parameters())
        self.mixed = dtype != "fp32"
        # Copied before the cast: rounding to bf16 first would lose the initial values for good.
        self.masters = self._make_masters()
        if self.mixed:
            module.to(compute_dtype(dtype))
            self.params = list(module.parameters())
        # Fused where the device has it (the moments the first step makes are contiguous like the masters).
        self.optimizer = torch.optim.AdamW(self._groups(decays, weight_decay), lr=lr, betas=betas, eps=eps,
                                           weight_decay=weight_decay, **adamw_kernel(self.masters))
        self.scaler = LossScaler(loss_scale) if dtype == "fp16" else None
        self._chunks = self._chunk(self.params) if self.mixed else []
        self._held: tuple | None = None
        """``state_bytes``'s count of what changes only with the optimizer's state: (its key, weights, masters,
        moments)."""

    def _make_masters(self) -> list[torch.Tensor]:
        """The fp32 tensors AdamW updates, made while the module is still fp32: copies of the parameters in
        fp16/bf16, the parameters themselves in fp32 (``runtime.train.host_optimizer`` keeps host copies instead)."""
        return [nn.Parameter(p.detach().float().clone()) for p in self.params] if self.mixed else self.params

    def _groups(self, decays: list[bool] | None, weight_decay: float) -> list[dict]:
        """AdamW parameter groups: those ``decays`` marks (every parameter when None) take
        ``weight_decay``, the others none. Empty groups are left out (a rank may hold no bias)."""
        if decays is None:
            return [{"params": self.masters}]
        assert len(decays) == len(self.masters), "one decay flag per parameter expected"
        groups = [{"params": [m for m, d in zip(self.masters, decays) if d]},
                  {"params": [m for m, d in zip(self.masters, decays) if not d], "weight_decay": 0.0}]
        return [g for g in groups if g["params"]]

    def set_lr(self, lr: float) -> None:
        """The learning rate of the next ``step`` (every group)."""
        for g in self.optimizer.param_groups:
            g["lr"] = lr

    @staticmethod
    def _chunk(params: list[torch.Tensor]) -> list[range]:
        """Consecutive parameter index ranges of at most the largest parameter's size each."""
        limit = max((p.numel() for p in params), default=0)
        chunks, start, size = [], 0, 0
        for i, p in enumerate(params):
            if size and size + p.numel() > limit:
                chunks.append(range(start, i))
                start, size = i, 0
            size += p.numel()
        if start < len(params):
            chunks.append(range(start, len(params)))
        return chunks

    @property
    def loss_scale(self) -> float:
        """What the loss is multiplied by before backward (1 without fp16 loss scaling)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    def master_of(self) -> dict[int, torch.Tensor]:
        """id(module parameter) -> the fp32 tensor AdamW updates for it (itself in fp32)."""
        return {id(p): m for p, m in zip(self.params, self.masters)}

    @torch.no_grad()
    def load_full_values(self, named_full) -> None:
        """Set masters and module weights from full-precision values: ``named_full`` yields (module
        parameter, this rank's fp32 value)."""
        masters = self.master_of()
        for p, value in named_full:
            masters[id(p)].copy_(value)
            if self.mixed:
                p.copy_(value)

    @torch.no_grad()
    def step(self, *, overflow: bool = False, grad_factor: float = 1.0) -> bool:
        """Apply the update unless ``overflow`` (every rank must pass the same flag), then move the loss
        scale. The gradients are multiplied by ``grad_factor`` first (gradient clipping; in fp16/bf16 on
        their way into fp32, so clipping costs no precision). Returns whether the weights were updated."""
        inv_scale = grad_factor / self.loss_scale  # the scale this step's backward ran with
        if self.scaler is not None:
            self.scaler.update(overflow)
        if overflow:
            return False
        if not self.mixed:
            grads = [p.grad for p in self.params if p.grad is not None]
            if grad_factor != 1.0 and grads:
                torch._foreach_mul_(grads, grad_factor)
            self.optimizer.step()
            return True
        for chunk in self._chunks:
            unscaled = {i: self.params[i].grad.float() for i in chunk if self.params[i].grad is not None}
            if unscaled:  # the foreach kernels refuse an empty list (a chunk may be one parameter without a gradient)
                torch._foreach_mul_(list(unscaled.values()), inv_scale)  # one launch for the chunk, not one per parameter
            for i in chunk:
                self.masters[i].grad = unscaled.get(i)
            self.optimizer.step()
            for i in chunk:
                self.masters[i].grad = None
            torch._foreach_copy_([self.params[i] for i in chunk], [self.masters[i] for i in chunk])
        return True

    def moments(self) -> list:
        """Both Adam moments of every master (None where the optimizer has not stepped yet)."""
        return [st.get(k) for st in (self.optimizer.state.get(m, {}) for m in self.masters) for k in ("exp_avg", "exp_avg_sq")]

    def state_bytes(self) -> StateBytes:
        """What this rank holds. The gradients, which come and go, are counted at every call; the weights, masters
        and moments (about three quarters of the cost, which the engine pays every step) again only when the
        optimizer's state gained entries or was replaced (the moments appear at a parameter's first update, or a
        checkpoint puts them in, over any there are with their sizes): AdamW updates them in place, and the
        parameters and masters keep their storages."""
        state = self.optimizer.state
        key = (id(state), len(state))
        if self._held is None or self._held[0] != key:
            self._held = (key, storage_bytes(self.params), storage_bytes(self.masters) if self.mixed else 0,
                          storage_bytes(self.moments()))
        _, weights, masters, moments = self._held
        return StateBytes(weights_bytes=weights, grads_bytes=storage_bytes(p.grad for p in self.params),
                          master_bytes=masters, moments_bytes=moments)
