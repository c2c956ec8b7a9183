"""One rank's training step: a 1F1B pipeline schedule over point-to-point sends, gradient
synchronisation (tied embedding, data-parallel replicas) and the optimizer.

The model spec's dtype decides the precision (``runtime.precision``): the stage's parameters,
activations, pipeline messages and gradients are in the compute dtype, the stage's cross-entropy works
in fp32 (the head keeps an fp32 softmax, as docs/cost-model.md counts), and AdamW updates fp32 master
weights in fp16/bf16. In fp16 the loss is scaled, and a step whose gradients overflow on any rank
is skipped on every rank.

The step returns a ``StepStats`` with what the planner predicts (per micro-batch forward, backward and
recompute time, per-stage time, iteration time, peak saved-activation bytes), so a report can put
measurement next to prediction.
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from baton.pipeline import schedule_1f1b
from baton.plan import Plan
from runtime.model import init_parameter, parameter_shapes
from runtime.meters import SavedBytes
from runtime.precision import LossScaleSettings, MasterWeights, compute_dtype
from runtime.slicing import parameter_slice, take_slice
from runtime.stage import StageModel
from runtime.tp_layer import MicroBatch
from runtime.tensor_parallel import AllReduceClock
from runtime.topology import Topology

ADAM_BETAS = (0.9, 0.95)
ADAM_EPS = 1e-8


@dataclass(kw_only=True)
class StepStats:
    """Measurements of one step on one rank (``loss`` and ``stage_ms`` are the same on every rank)."""

    step: int
    """Index of the step (0-based)."""
    loss: float
    """Mean cross-entropy over the global batch."""
    iteration_ms: float
    """Wall time of the whole step on this rank, optimizer included."""
    forward_ms: list[float] = field(default_factory=list)
    """Per micro-batch forward compute on this rank (waits for activations excluded)."""
    backward_ms: list[float] = field(default_factory=list)
    """Per micro-batch backward compute on this rank, recomputation included."""
    recompute_ms: list[float] = field(default_factory=list)
    """Per micro-batch time re-running recomputed operators (part of backward_ms)."""
    stage_ms: list[float] = field(default_factory=list)
    """Compute time (forward + backward) of each stage of pipeline 0, from its TP rank 0."""
    tp_allreduce_ms: float | None = 0.0
    """Time in tensor-parallel all-reduces over the step's passes, waits for peers included (None on
    CUDA, where the call returns before the GPU runs it)."""
    grad_sync_ms: float = 0.0
    """Tied-embedding and data-parallel gradient all-reduces on this rank (waits for peers included)."""
    optimizer_ms: float = 0.0
    """The AdamW update on this rank."""
    peak_saved_bytes: int = 0
    """Peak bytes of activations kept for backward on this rank during the step."""
    peak_allocated_bytes: int = 0
    """Peak CUDA memory allocated by this rank during the step (0 on CPU)."""
    recomputed_ops: dict[str, int] = field(default_factory=dict)
    """Operator name -> executions during backward (recomputations) on this rank."""
    tokens: int = 0
    """Tokens in the global batch."""
    skipped: bool = False
    """The optimizer step was skipped because some rank's gradients held inf/NaN (fp16 loss scaling)."""
    loss_scale: float = 1.0
    """The loss scale this step's backward ran with (1 outside fp16)."""
    weights_bytes: int = 0
    """Measured after the step: this rank's parameters in the compute dtype (eq. 8's W_d)."""
    grads_bytes: int = 0
    """Measured after the step: their gradients (eq. 8's second W_d)."""
    master_bytes: int = 0
    """Measured after the step: fp32 master weights (fp16/bf16 only)."""
    moments_bytes: int = 0
    """Measured after the step: AdamW's fp32 moments."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.iteration_ms, 1e-9) * 1e3


class Engine:
    """Everything one rank holds for training under a plan; the process group must already exist."""

    def __init__(self, plan: Plan, rank: int, *, device: torch.device | str = "cpu", seed: int = 0,
                 lr: float = 3e-4, weight_decay: float = 0.0, full=None, measure: bool = True,
                 timeout_s: float | None = None, loss_scale: LossScaleSettings | None = None):
        self.plan, self.seed = plan, seed
        self.timeout_s = timeout_s  # bounds every receive and every subgroup collective (None: torch's defaults)
        self.device = torch.device(device)
        self.topo = Topology(plan)
        self.pos = self.topo.position(rank)
        self.groups = self.topo.groups(self.pos, timeout_s=timeout_s)
        spec, stage = plan.model, self.topo.stage(self.pos)
        self.first, self.last = self.pos.stage == 0, self.pos.stage == plan.num_stages - 1
        self.model = StageModel(spec, layers=stage.layers, heads=self.pos.heads, ffn_cols=self.pos.ffn_cols,
                                first=self.first, last=self.last, recompute=self.pos.recompute,
                                tp_group=self.groups.tp)
        self.model.load_full(full or (lambda name: init_parameter(spec, name, seed)))
        self.model.to(self.device)
        self.dtype = compute_dtype(spec.dtype)
        # Casts the module to the compute dtype after copying the fp32 masters (fp16/bf16).
        self.precision = MasterWeights(self.model, spec.dtype, lr=lr, betas=ADAM_BETAS, eps=ADAM_EPS,
                                       weight_decay=weight_decay, loss_scale=loss_scale)
        self.optimizer = self.precision.optimizer
        self.grad_buffer = self._contiguous_grads()
        self.measure = measure
        self.samples_per_step = plan.global_batch

    def load_full(self, full) -> None:
        """Set this rank's weights (and fp32 master weights) from ``full(name) -> full fp32 tensor``."""
        if not self.precision.mixed:
            self.model.load_full(full)
            return
        # The masters take the exact values, the module their rounding; each full tensor is read once.
        spec, pos, shapes = self.plan.model, self.pos, parameter_shapes(self.plan.model)
        values = []
        for name, p in self.model.named_parameters():
            t = full(name)
            if tuple(t.shape) != shapes[name]:
                raise ValueError(f"{name}: expected shape {shapes[name]}, got {tuple(t.shape)}")
            values.append((p, take_slice(t, parameter_slice(spec, name, pos.heads, pos.ffn_cols)).to(self.device)))
        self.precision.load_full_values(values)

    def master_parameters(self) -> dict[str, torch.Tensor]:
        """Parameter name -> the fp32 tensor AdamW updates (the parameter itself in fp32): what
        checkpoints save and restore, with its AdamW state in ``self.optimizer.state``."""
        masters = self.precision.master_of()
        return {name: masters[id(p)] for name, p in self.model.named_parameters()}

    def _contiguous_grads(self) -> torch.Tensor:
        """One flat buffer whose views are every parameter's ``.grad``: backward accumulates into it in
        place and data-parallel synchronisation all-reduces it as it is. Flattening the gradients
        into a fresh tensor and copying them back cost 60% on top of a 25 MB all-reduce over gloo."""
        params = list(self.model.parameters())
        dtypes = {p.dtype for p in params}
        assert len(dtypes) == 1, f"parameters of one dtype expected, got {dtypes}"
        buffer = torch.zeros(sum(p.numel() for p in params), dtype=dtypes.pop(), device=self.device)
        self._grad_views, offset = [], 0
        for p in params:
            self._grad_views.append((p, buffer[offset:offset + p.numel()].view_as(p)))
            offset += p.numel()
        self._bind_grads()
        return buffer

    def _bind_grads(self) -> None:
        """Make every ``.grad`` its view of the buffer again (a ``zero_grad()`` elsewhere sets them to
        None; a later backward would then leave the buffer the all-reduce reads stale)."""
        for p, view in self._grad_views:
            if p.grad is None:
                view.zero_()
                p.grad = view
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
                p.grad = view

    # --- point-to-point ----------------------------------------------------------------------------
    def _recv(self, src: int) -> torch.Tensor:
        spec = self.plan.model
        buf = torch.empty(self.plan.micro_batch_size, spec.seq_len, spec.hidden_dim, device=self.device, dtype=self.dtype)
        return self.topo.recv(buf, src, timeout_s=self.timeout_s)

    def _send(self, t: torch.Tensor, targets: list[int], pending: list) -> None:
        t = t.detach().contiguous()
        for dst in targets:
            pending.append((dist.isend(t, dst), t))

    # --- one step ----------------------------------------------------------------------------------
    def forward_backward(self, step: int, data) -> StepStats:
        """Run the 1F1B schedule of one step and leave the synchronised gradients in ``.grad``."""
        plan, spec, pos, topo = self.plan, self.plan.model, self.pos, self.topo
        m, mbs = plan.num_microbatches, plan.micro_batch_size
        denom = self.samples_per_step * spec.seq_len
        sync = self.device.type == "cuda"
        self._bind_grads()
        meter = self.model.meter
        meter.reset()
        saved = SavedBytes(self.model.parameters()) if self.measure else None
        meter.saved = saved
        scale = self.precision.loss_scale
        stats = StepStats(step=step, loss=0.0, iteration_ms=0.0, forward_ms=[0.0] * m, backward_ms=[0.0] * m,
                          recompute_ms=[0.0] * m, tokens=self.samples_per_step * spec.seq_len, loss_scale=scale)
        if sync:
            torch.cuda.reset_peak_memory_stats(self.device)
        AllReduceClock.reset()
        start = time.perf_counter()
        pending, inflight, loss_sum = [], {}, 0.0
        fwd_src, bwd_src = topo.forward_source(pos), topo.backward_source(pos)
        fwd_dst, bwd_dst = topo.forward_targets(pos), topo.backward_targets(pos)
        for kind, i in schedule_1f1b(plan.num_stages, m, pos.stage):
            samples = torch.arange(mbs) + (pos.pipeline * m + i) * mbs
            if kind == "F":
                tokens, targets = data.batch(step, samples) if (self.first or self.last) else (None, None)
                x = tokens.to(self.device) if self.first else self._recv(fwd_src).requires_grad_()
                t0 = time.perf_counter()
                with saved.record(i) if saved is not None else nullcontext():
                    y = self.model(x, MicroBatch(self.seed, step, samples.to(self.device)),
                                   targets=targets.to(self.device) if self.last else None)
                    if self.last:
                        # The stage returns the summed vocabulary-parallel cross-entropy, computed in fp32
                        # (the softmax it keeps is fp32 in every dtype).
                        y = y / denom
                        loss_sum += y.item()
                        if scale != 1.0:
                            y = y * scale
                if sync:
                    torch.cuda.synchronize()
                stats.forward_ms[i] = (time.perf_counter() - t0) * 1e3
                if not self.last:
                    self._send(y, fwd_dst, pending)
                inflight[i] = (x, y)
            else:
                x, y = inflight.pop(i)
                grad = None if self.last else self._recv(bwd_src)
                t0, r0 = time.perf_counter(), meter.recompute_s
                meter.in_backward = True
                try:
                    torch.autograd.backward(y, grad)
                finally:
                    meter.in_backward = False
                if sync:
                    torch.cuda.synchronize()
                stats.backward_ms[i] = (time.perf_counter() - t0) * 1e3
                stats.recompute_ms[i] = (meter.recompute_s - r0) * 1e3
                if saved is not None:
                    saved.release(i)
                if not self.first:
                    self._send(x.grad, bwd_dst, pending)
        for work, _ in pending:
            work.wait()
        stats.tp_allreduce_ms = None if sync else AllReduceClock.seconds * 1e3
        t0 = time.perf_counter()
        self._sync_grads()
        if sync:
            torch.cuda.synchronize()
        stats.grad_sync_ms = (time.perf_counter() - t0) * 1e3
        my_ms = sum(stats.forward_ms) + sum(stats.backward_ms)
        # One small all-reduce carries the global loss, every stage's compute time and (fp16) the count of
        # ranks whose gradients overflowed to all ranks, so every rank skips an overflowing step together.
        metrics = torch.zeros(2 + plan.num_stages, dtype=torch.float64)
        if self.last and pos.tp_rank == 0:
            metrics[0] = loss_sum
        if pos.pipeline == 0 and pos.tp_rank == 0:
            metrics[2 + pos.stage] = my_ms
        if self.precision.scaler is not None and not bool(torch.isfinite(self.grad_buffer).all()):
            metrics[1] = 1.0
        metrics = self._all_reduce_cpu(metrics)
        stats.loss = float(metrics[0])
        stats.skipped = bool(metrics[1] > 0)
        stats.stage_ms = [float(v) for v in metrics[2:]]
        stats.peak_saved_bytes = saved.peak if saved is not None else 0
        stats.peak_allocated_bytes = torch.cuda.max_memory_allocated(self.device) if sync else 0
        stats.recomputed_ops = dict(meter.recomputed)
        stats.iteration_ms = (time.perf_counter() - start) * 1e3
        meter.saved = None
        return stats

    def _all_reduce_cpu(self, t: torch.Tensor) -> torch.Tensor:
        t = t.to(self.device)
        dist.all_reduce(t)
        return t.cpu()

    def _sync_grads(self) -> None:
        """Sum the tied embedding's two gradients (first and last stage), then sum the replicas'
        gradients (each micro-batch loss is already divided by the global batch's token count)."""
        if self.groups.tied is not None and hasattr(self.model, "wte"):
            # Each rank holds its own vocabulary rows; the two stages may split them differently.
            self.model.sum_tied_gradient(self.groups.tied)
        if self.groups.dp is not None:
            dist.all_reduce(self.grad_buffer, group=self.groups.dp)

    def train_step(self, step: int, data) -> StepStats:
        """Forward, backward, gradient sync and one AdamW update (skipped on every rank when fp16
        gradients overflowed on any)."""
        t0 = time.perf_counter()
        self.grad_buffer.zero_()  # the gradients are views of it: keep them (no set_to_none)
        stats = self.forward_backward(step, data)
        t1 = time.perf_counter()
        self.precision.step(overflow=stats.skipped)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            stats.peak_allocated_bytes = torch.cuda.max_memory_allocated(self.device)  # the update included
        stats.optimizer_ms = (time.perf_counter() - t1) * 1e3
        stats.iteration_ms = (time.perf_counter() - t0) * 1e3
        held = self.precision.state_bytes()
        stats.weights_bytes, stats.grads_bytes = held.weights_bytes, held.grads_bytes
        stats.master_bytes, stats.moments_bytes = held.master_bytes, held.moments_bytes
        return stats
