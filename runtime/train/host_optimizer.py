"""Optimizer-state offload (a device's ``DeviceShare.offload_optimizer``; ZeRO-Offload, Mist): the fp32 master weights
and AdamW's two fp32 moments live in host memory and the AdamW step runs on the host (docs/cost-model.md eq. 7h/10h).

One step of an offloading rank, after the gradient sync and the step's one read (the clip coefficient and the fp16
skip come from it, as without offload):

1. its gradients (at ``zero_stage`` 1 its owned shard of them) are copied device to host, in the compute dtype, into
   one host staging buffer (pinned on CUDA, copied on the current stream without blocking);
2. the host waits for those copies (``HostLink.wait``): the one wait the offload adds, inherent to it, since the host
   step reads the gradients. It comes after the step's read, so the GPU has at most the gradient copies left to run;
3. the host runs torch's fused CPU AdamW on its fp32 masters and moments (the gradients turned into fp32 and unscaled
   on their way in, a chunk at a time, as on the device), with the hyper-parameters and learning rate of the device
   optimizer it replaces;
4. the updated weights go back host to device in the compute dtype (fp16/bf16: rounded on the host into the staging
   buffer, whose gradients are spent by then; fp32: straight from the pinned masters), again without blocking. A
   later step writes those host buffers only after its own wait, which comes after these copies on the stream.

In a CPU process the same code runs with plain host buffers and no waits, so the bookkeeping and the numerics are
tested anywhere: on CPU the host step is the device step, the same fused kernel on the same fp32 values, so an
offloading plan's numbers equal the plain plan's bit for bit.

Host memory per parameter whose state the rank keeps: 4 (fp32 master) + 8 (moments) + e (staging, the compute
dtype's bytes), i.e. 14 in bf16/fp16 and 16 in fp32; over the host link per step, e bytes out (gradients) and e in
(weights). ``MasterWeights``' stand-in for ``zero_stage`` 0 is ``HostMasterWeights`` here; at ``zero_stage`` 1
``runtime.train.sharded_optimizer.ShardedAdamW`` takes ``host=True`` and uses ``HostLink`` the same way.
"""
from __future__ import annotations

import time

import torch
import torch.nn as nn

from runtime.train.precision import LossScaleSettings, MasterWeights, StateBytes, compute_dtype, storage_bytes


class HostLink:
    """The host side of one rank's optimizer offload: its host buffers, its copies, and what a step moved and took."""

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        """Pinned buffers and copies that do not block the host (else plain host tensors and plain copies)."""
        self.out_bytes = 0
        """Bytes copied device to host by the last step (gradients)."""
        self.in_bytes = 0
        """Bytes copied host to device by the last step (updated weights)."""
        self.step_ms = 0.0
        """The last step's host work: unscaling, AdamW and rounding, after the gradients arrived."""
        self.wait_ms = 0.0
        """How long the last step's host waited for its gradient copies (0 on CPU, where a copy is done on return)."""
        self._started = 0.0

    def buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat host tensor, pinned on CUDA (a copy from pageable memory would make the host wait for the stream)."""
        return torch.empty(numel, dtype=dtype, pin_memory=self.cuda)

    def start(self) -> None:
        """A step begins: its counters restart."""
        self.out_bytes = self.in_bytes = 0
        self.step_ms = self.wait_ms = 0.0

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=self.cuda)
        self.out_bytes += src.numel() * src.element_size()

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=self.cuda)
        self.in_bytes += src.numel() * src.element_size()

    def wait(self) -> None:
        """Until every copy to the host launched so far has landed, then the host step's clock starts."""
        t0 = self._started = time.perf_counter()
        if self.cuda:
            # The one wait of the offload (module docstring): the copies are on the current stream, behind the
            # gradient sync; an event on it is done exactly when they are.
            done = torch.cuda.Event()
            done.record()
            done.synchronize()
            self._started = time.perf_counter()
            self.wait_ms += (self._started - t0) * 1e3

    def stop(self) -> None:
        """The host step's work is done (the copies back may still run)."""
        self.step_ms += (time.perf_counter() - self._started) * 1e3


class HostMasterWeights(MasterWeights):
    """``MasterWeights`` with its fp32 masters (fp32 copies of the weights, in fp32 training too) and AdamW's moments in
    host memory, and its AdamW on the host (module docstring); the module's parameters stay on the device.

    Build it while the module is still fp32, then ``bind_grads`` the engine's flat gradient buffer (the parameters'
    ``.grad`` are views of it in parameter order, so one copy brings them all to the host)."""

    def __init__(self, module: nn.Module, dtype: str, *, lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float, loss_scale: LossScaleSettings | None = None, decays: list[bool] | None = None):
        params = list(module.parameters())
        self.link = HostLink(params[0].device if params else "cpu")
        numel = sum(p.numel() for p in params)
        # Pinned only where the weights leave from them (fp32); in fp16/bf16 the rounded weights leave from the staging.
        self.flat_master = torch.empty(numel, dtype=torch.float32, pin_memory=self.link.cuda and dtype == "fp32")
        self.staging = self.link.buffer(numel, compute_dtype(dtype))
        """Gradients come in here; in fp16/bf16 the rounded weights leave from here."""
        self._masters, offset = [], 0
        with torch.no_grad():
            for p in params:
                view = self.flat_master[offset:offset + p.numel()].view_as(p)
                view.copy_(p.detach())  # the module is still fp32: the exact initial values
                self._masters.append(nn.Parameter(view))  # shares the flat buffer's storage
                offset += p.numel()
        self.grad_buffer: torch.Tensor | None = None
        super().__init__(module, dtype, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         loss_scale=loss_scale, decays=decays)

    def _make_masters(self) -> list[nn.Parameter]:
        return self._masters

    def bind_grads(self, grad_buffer: torch.Tensor) -> None:
        """The engine's flat gradient buffer, whose views are the parameters' ``.grad`` in parameter order."""
        assert grad_buffer.numel() == self.staging.numel() and grad_buffer.dtype == self.staging.dtype
        self.grad_buffer = grad_buffer

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [m.view_as(p) for p, m in zip(self.params, flat.split([p.numel() for p in self.params]))]

    @torch.no_grad()
    def load_full_values(self, named_full) -> None:
        """Masters and module weights from full-precision values (the weights rounded in fp16/bf16)."""
        masters = self.master_of()
        for p, value in named_full:
            masters[id(p)].copy_(value)
            p.copy_(value)

    @torch.no_grad()
    def step(self, *, overflow: bool = False, grad_factor: float = 1.0) -> bool:
        """``MasterWeights.step`` on the host: gradients out, AdamW, weights back (module docstring)."""
        link = self.link
        link.start()
        inv_scale = grad_factor / self.loss_scale
        if self.scaler is not None:
            self.scaler.update(overflow)
        if overflow:
            return False  # nothing crosses the link on a skipped step
        assert self.grad_buffer is not None, "bind_grads first"
        link.to_host(self.staging, self.grad_buffer)
        link.wait()
        host_grads = self._views(self.staging)
        if not self.mixed:
            # The staged fp32 gradients are the masters' gradients; clipped in place as on the device.
            if grad_factor != 1.0:
                torch._foreach_mul_(host_grads, grad_factor)
            for m, g in zip(self.masters, host_grads):
                m.grad = g
            self.optimizer.step()
            for m in self.masters:
                m.grad = None
            link.stop()
            for p, m in zip(self.params, self.masters):
                link.to_device(p.data, m.detach())
            return True
        for chunk in self._chunks:
            unscaled = [host_grads[i].float() for i in chunk]
            torch._foreach_mul_(unscaled, inv_scale)
            for i, g in zip(chunk, unscaled):
                self.masters[i].grad = g
            self.optimizer.step()
            for i in chunk:
                self.masters[i].grad = None
            # Rounded into the chunk's staging, whose gradients are spent: what goes back is the compute dtype.
            torch._foreach_copy_([host_grads[i] for i in chunk], [self.masters[i].detach() for i in chunk])
        link.stop()
        for p, w in zip(self.params, host_grads):
            link.to_device(p.data, w)
        return True

    def state_bytes(self) -> StateBytes:
        host = self.flat_master.nbytes + storage_bytes(self.moments()) + self.staging.nbytes
        return StateBytes(weights_bytes=storage_bytes(self.params), grads_bytes=storage_bytes(p.grad for p in self.params),
                          master_bytes=0, moments_bytes=0, host_optimizer_bytes=host, host_staging_bytes=self.staging.nbytes)
