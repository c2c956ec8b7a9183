"""One rank's training step: its replica's schedule (``baton.schedules``, the lists of actions the cost model
prices) run by one interpreter over point-to-point sends, gradient synchronisation (tied embedding,
data-parallel replicas) and the optimizer.

Replicas may differ in shape and batch: replica r runs its own ``plan.batch(r)`` = (b_r, m_r), m_r
micro-batches of b_r samples, on samples [sum_{q<r} b_q m_q, + b_r m_r) of each global batch in the
batch's canonical order, and every micro-batch's loss is divided by the global batch's token count, so
the summed update is the single-device update on the whole global batch. Gradients are summed across
replicas over ``baton.peers``' peer groups (``runtime.train.replica_sync``); with ``zero_stage`` 1 the
optimizer state is sharded over each group's holders (``runtime.train.sharded_optimizer``). With ``zero_stage`` 2
and 3 every replica is one stage and runs its micro-batches layer by layer instead of 1F1B, the gradients
(and at 3 the weights) sharded too, unit by unit (``runtime.train.layered``, docs/cost-model.md eq. 16-18).

The model spec's dtype decides the precision (``runtime.train.precision``): the stage's parameters,
activations, pipeline messages and gradients are in the compute dtype, the stage's cross-entropy works
in fp32 (the head keeps an fp32 softmax, as docs/cost-model.md counts), and AdamW updates fp32 master
weights in fp16/bf16. In fp16 the loss is scaled, and a step whose gradients overflow on any rank
is skipped on every rank.

Optimisation (``runtime.train.optim_settings``): the learning rate of every step comes from an ``LRSchedule``; weight
decay skips biases and LayerNorms; the global gradient norm is summed over every parameter of the model
exactly once (each piece in the first peer group that holds it, by the group's first holder, or at
``zero_stage`` 1 by the element's owner: ``ReplicaSync.norm_views``), rides on the step's one small
all-reduce, and clips the update when ``clip_grad`` is set: the update of any plan is the
single-device one.

The host reads the device once a step (``Engine._read_step``): the micro-batches' losses are summed on the
device, and that sum, the overflow flag, the squared gradient norm, the stage times and the ranks' peak memory
ride on the one small all-reduce, whose result the host reads once, before the update (the clip coefficient
and the skip come from it). On CUDA nothing else waits for the GPU: the passes and collectives are timed with
CUDA events read after that read (``runtime.measure.meters.PhaseClock``; none recorded when no report or trace
wants them), so the host keeps launching while the GPU runs, as the plainest fast PyTorch loop does.

With a ``tracer`` (``runtime.measure.trace``, ``baton train --trace``) the step also records its spans: forward,
backward and recompute per micro-batch, receives and sends, tensor-parallel and gradient all-reduces,
the optimizer.

Activation offload (a device's ``DeviceShare.offload``, ``runtime.parallel.offload``): each pass runs under its
stage's ``OffloadStash.record`` with the key the saved-bytes meter uses, and its host copies are released after its
backward. The copies back of a pass's top layer are started ahead of its backward: in a pipeline when the
gradient's receive is posted, layer by layer (``zero_stage`` 2 and 3, one key per layer) before the backward ahead
of it; each layer's backward then starts the copies of the layer below (``prefetch_ahead``). Where a part's input
is a layer input the layers offload, it enters the part through ``_Boundary`` instead of as a leaf, so that nothing
but the offloaded copy holds it: a leaf is kept alive by its gradient accumulator, and layer by layer the part
before's output would be too.

Optimizer-state offload (a device's ``DeviceShare.offload_optimizer``, ``runtime.train.host_optimizer``): the rank's
fp32 masters and moments (at ``zero_stage`` 1 its owned shards') are host tensors and its AdamW runs on the host,
after the step's one read; the gradients go to the host and the updated weights come back within the update, the
host waiting once for the gradients' copies (on CUDA; the copies themselves do not block). The same numbers as the
device step (on a CPU process bit for bit).

The step returns a ``StepStats`` with what the planner predicts (per micro-batch forward, backward and
recompute time, per-stage time, iteration time, peak saved-activation bytes), so a report can put
measurement next to prediction.
"""
from __future__ import annotations

import math
import resource
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist

from baton.operators import EMBEDDING, HEAD
from baton.plan import Plan
from baton.peers import EDGES
from baton.schedules import (WHOLE, Backward, Forward, Gather, OptimizerStep, Recv, ReduceScatter, Release, Send,
                             interleaved_one_f_one_b, layer_by_layer)
from runtime.launch.host_memory import keep_freed_memory
from runtime.train.layered import UnitShards
from runtime.model.family import init_parameter, parameter_shapes
from runtime.measure.meters import PhaseClock, SavedBytes
from runtime.train.host_optimizer import HostMasterWeights
from runtime.train.precision import LossScaleSettings, MasterWeights, compute_dtype
from runtime.train.replica_sync import ReplicaSync
from runtime.train.optim_settings import LRSchedule, clip_coefficient, decays, grad_square_sum
from runtime.train.sharded_optimizer import ShardedAdamW
from runtime.parallel.slicing import parameter_slice, take_slice
from runtime.parallel.stage import StageModel
from runtime.parallel.tp_layer import MicroBatch
from runtime.parallel.tensor_parallel import AllReduceClock
from runtime.parallel.topology import Topology

ACTIVATION_TAG, GRADIENT_TAG = 0, 1
"""Message tags of a boundary activation and of a gradient: an interleaved pipeline of two groups receives both
from the same peer, each kind in its own order."""
ADAM_BETAS = (0.9, 0.95)
ADAM_EPS = 1e-8
_ADOPT_BYTES = 64 * 1024
"""On CPU, the size from which a parameter's gradient is adopted rather than summed onto zeros
(``Engine._contiguous_grads``): on one thread a gradient's zeroing and add cost as much as the hook's calls from
about 64 KiB (one micro-batch) to 256 KiB (four)."""


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
    """Compute time (forward + backward) of each stage (interleaved: each device group) of pipeline 0, from its
    TP rank 0. On CUDA the step before's (0 at a run's first step): a stage's time is known only after the step's
    one read, which also carries it to the other ranks (``Engine._read_step``)."""
    tp_allreduce_ms: float | None = 0.0
    """Time in tensor-parallel all-reduces over the step's passes, waits for peers included (None on
    CUDA, where the call returns before the GPU runs it)."""
    grad_sync_ms: float = 0.0
    """Tied-embedding all-reduce and the data-parallel gradient collectives on this rank (all-reduces, or at
    ``zero_stage`` 1 the reduce-scatters; waits for peers included)."""
    optimizer_ms: float = 0.0
    """The step after the passes on this rank (eq. 10): the gradient norm it counts (``norm_ms``) and the
    AdamW update (at ``zero_stage`` 1 with the all-gathers of the updated weights). On CUDA the update's time is
    the step before's, read with this step's one read (the host's launch time at a run's first step)."""
    norm_ms: float = 0.0
    """The sum of squares of the gradients this rank counts for the global norm (part of optimizer_ms)."""
    gather_ms: float = 0.0
    """At ``zero_stage`` 1 and 2: the all-gathers of the updated weights on this rank (part of optimizer_ms); at
    3: the all-gathers of the units before their forward and backward (part of the passes' wall time)."""
    unit_reduce_ms: list[float] = field(default_factory=list)
    """At ``zero_stage`` 2 and 3, per unit (the edges, then layer 0, 1, ...): its reduce-scatter on this rank,
    waits for peers included (their sum is grad_sync_ms)."""
    unit_gather_ms: list[float] = field(default_factory=list)
    """At ``zero_stage`` 2 and 3, per unit: its all-gathers on this rank (stage 2 the one after the update,
    stage 3 the ones before its forward and backward), waits included (their sum is gather_ms)."""
    peak_saved_bytes: int = 0
    """Peak bytes of activations kept for backward on this rank during the step, in device memory (offloaded
    tensors excluded). Each pass's bytes are measured the first time it runs and held by it in later steps
    (``SavedBytes.known``), which sum their peak the same way."""
    peak_host_activation_bytes: int = 0
    """Peak bytes of activations this rank kept in host memory during the step (its plan's ``offload``), over all
    micro-batches in flight (``OffloadStash.peak_held_bytes``)."""
    offload_out_bytes: int = 0
    """Activation bytes copied device to host during the step (``OffloadStash.copied_out_bytes``)."""
    offload_in_bytes: int = 0
    """Activation bytes copied host to device during the step (``OffloadStash.copied_in_bytes``)."""
    offload_late_bytes: int = 0
    """Of ``offload_in_bytes``, those not prefetched: copied when the backward read them (on CUDA it waited)."""
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
    """Measured after the step: this rank's parameters in the compute dtype (eq. 8's W_d); at ``zero_stage`` 2
    and 3 the peak over the step of its parameters and weight shards (eq. 18's weights)."""
    grads_bytes: int = 0
    """Measured after the step: their gradients (eq. 8's second W_d); at ``zero_stage`` 2 and 3 the peak over
    the step of its full gradients and gradient shards (eq. 18's grads)."""
    master_bytes: int = 0
    """Measured after the step: fp32 master weights in device memory (fp16/bf16 only; at ``zero_stage`` 1 the owned
    shards'; 0 with ``offload_optimizer``, see ``host_optimizer_bytes``)."""
    moments_bytes: int = 0
    """Measured after the step: AdamW's fp32 moments in device memory (at ``zero_stage`` 1 the owned shards'; 0 with
    ``offload_optimizer``)."""
    host_optimizer_bytes: int = 0
    """Measured after the step, with the plan's ``offload_optimizer``: host memory this rank's optimizer state takes,
    per parameter whose state it keeps (at ``zero_stage`` 1 its owned shards) an fp32 master, two fp32 moments and
    one compute-dtype element of the staging buffer (``runtime.train.host_optimizer``)."""
    host_optimizer_ms: float = 0.0
    """With ``offload_optimizer``: the host's AdamW step (unscaling, AdamW, rounding), after the gradients arrived;
    part of optimizer_ms."""
    host_optimizer_wait_ms: float = 0.0
    """With ``offload_optimizer``: how long the host waited for the gradients' copies to the host (0 on CPU)."""
    host_optimizer_out_bytes: int = 0
    """With ``offload_optimizer``: gradient bytes copied device to host for the step (0 on a skipped step)."""
    host_optimizer_in_bytes: int = 0
    """With ``offload_optimizer``: updated weight bytes copied host to device after the step."""
    lr: float = 0.0
    """Learning rate this step's update used."""
    grad_norm: float = 0.0
    """Global L2 norm of the gradients over the whole model, before clipping (unscaled in fp16; inf/NaN on
    an overflowing step)."""
    clipped: bool = False
    """The update was scaled down by ``clip_grad``."""
    memory_bytes: list[float] = field(default_factory=list)
    """Peak memory of every rank, in rank order: CUDA memory allocated, or on CPU the process's peak
    resident set. This rank's own is its peak over the whole step; another rank's is its peak up to the step's
    all-reduce or, if larger, over its whole step before (the update runs after the one read that carries them,
    and from one step to the next its transient is the same)."""
    val_loss: float | None = None
    """Validation loss measured after this step (``--eval-every``), else None."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.iteration_ms, 1e-9) * 1e3


class Engine:
    """Everything one rank holds for training under a plan; the process group must already exist."""

    def __init__(self, plan: Plan, rank: int, *, device: torch.device | str = "cpu", seed: int = 0,
                 lr: float = 3e-4, weight_decay: float = 0.0, full=None, measure: bool = True,
                 timeout_s: float | None = None, loss_scale: LossScaleSettings | None = None,
                 schedule: LRSchedule | None = None, clip_grad: float = 0.0):
        self.plan, self.seed = plan, seed
        self.schedule = schedule or LRSchedule(lr=lr)  # constant ``lr`` unless a schedule is given
        self.clip_grad = clip_grad  # 0: no clipping
        self.weight_decay = weight_decay
        self.timeout_s = timeout_s  # bounds every receive and every subgroup collective (None: torch's defaults)
        self.device = torch.device(device)
        if self.device.type == "cpu":
            # Reuse freed host memory instead of faulting fresh pages in every step, as the op profiler
            # does (runtime.launch.host_memory): otherwise a step's speed depends on its allocation history.
            keep_freed_memory()
        self.topo = Topology(plan)
        self.pos = self.topo.position(rank)
        # Every group of the run (tensor-parallel, peer, tied), created on every rank in one order.
        self.groups = self.topo.groups(self.pos, timeout_s=timeout_s)
        spec = plan.model
        self.first, self.last = self.pos.first, self.pos.last
        self.num_stages = self.pos.num_stages
        """Stages of this rank's pipeline."""
        self.micro_batch_size, self.num_microbatches = plan.batch(self.pos.pipeline)
        """This replica's micro-batch size and count."""
        self.first_sample = sum(plan.samples(r) for r in range(self.pos.pipeline))
        """Index in the global batch of this replica's first sample."""
        self.offload = frozenset(self.topo.stage(self.pos).devices[self.pos.tp_rank].offload)
        """Tensors every layer of this rank keeps in host memory between its passes (virtual stages of an
        interleaved pipeline have the same devices, so the same set)."""
        self.model = StageModel(spec, layers=self.topo.layers(self.pos), heads=self.pos.heads, ffn_cols=self.pos.ffn_cols,
                                first=self.first, last=self.last, recompute=self.pos.recompute,
                                tp_group=self.groups.tp, offload=self.offload)
        self.model.load_full(full or (lambda name: init_parameter(spec, name, seed)))
        self.model.to(self.device)
        self.dtype = compute_dtype(spec.dtype)
        self.layered = plan.zero_stage >= 2
        """Stages 2 and 3: the replica runs its micro-batches layer by layer (``runtime.train.layered``)."""
        if self.layered and self.num_stages != 1:
            raise ValueError(f"zero_stage {plan.zero_stage} needs every replica to be one stage; replica "
                             f"{self.pos.pipeline} has {self.num_stages} (baton.plan.validate refuses such plans)")
        pipe = plan.pipelines[self.pos.pipeline]
        self.replica_schedule = (layer_by_layer(plan.zero_stage, spec.num_layers, self.num_microbatches) if self.layered
                                 else interleaved_one_f_one_b(self.num_stages, pipe.chunks, self.num_microbatches))
        """This replica's schedule (``baton.schedules``), the one the cost model prices; ``_interpret`` runs it."""
        mine = self.replica_schedule.devices[self.pos.stage]
        cut = next((k for k, a in enumerate(mine) if isinstance(a, OptimizerStep)), len(mine))
        self.actions, self.after_step = mine[:cut + 1], mine[cut + 1:]
        """This rank's actions up to the optimizer step (``forward_backward``), and after it (``train_step``)."""
        self.stage_layers = [st.layers for st in pipe.stages]
        """The layers of every (virtual) stage of this rank's pipeline."""
        self.sync = ReplicaSync(plan, self.topo, self.pos, self.model, self.groups.peers)
        self.offload_optimizer = self.topo.stage(self.pos).devices[self.pos.tp_rank].offload_optimizer
        """This rank keeps its optimizer state in host memory and steps there (``runtime.train.host_optimizer``)."""
        # All cast the module to the compute dtype after copying the fp32 masters (fp16/bf16).
        if plan.zero_stage >= 1:
            self.precision = ShardedAdamW(self.model, self.sync, spec.dtype, lr=lr, betas=ADAM_BETAS, eps=ADAM_EPS,
                                          weight_decay=weight_decay, loss_scale=loss_scale, host=self.offload_optimizer)
        else:
            kind = HostMasterWeights if self.offload_optimizer else MasterWeights
            self.precision = kind(self.model, spec.dtype, lr=lr, betas=ADAM_BETAS, eps=ADAM_EPS,
                                  weight_decay=weight_decay, loss_scale=loss_scale,
                                  decays=[decays(n) for n, _ in self.model.named_parameters()])
        self.optimizer = self.precision.optimizer
        """The torch AdamW over this rank's (master) parameters, host tensors with ``offload_optimizer``; None with sharded
        state (``zero_stage`` >= 1)."""
        self.units: UnitShards | None = None
        """Stages 2 and 3: the owned gradient (and weight) shards of the unit groups and their collectives."""
        if self.layered:
            # No flat gradient buffer: a layer's gradients exist from its backward to its reduce-scatter.
            self.units = UnitShards(self.sync, self.model, zero_stage=plan.zero_stage, measure=measure)
            self.precision.attach(self.units)
            self.grad_buffer = None
            self._norm_views = self.units.norm_views()
        else:
            self.grad_buffer = self._contiguous_grads()
            self.sync.bind_grads(self.grad_buffer, {n: v for (n, _), (_, v) in zip(self.model.named_parameters(), self._grad_views)})
            if isinstance(self.precision, HostMasterWeights):
                self.precision.bind_grads(self.grad_buffer)  # one copy of it to the host a step
            self._norm_views = self.sync.norm_views()
        self.measure = measure
        self.samples_per_step = plan.global_batch
        self.tracer = None
        """A ``runtime.measure.trace.Tracer`` to record this rank's spans into (``--trace``), or None."""
        self.events = self.device.type == "cuda"
        """Time the step's phases with CUDA events read after the step's one host read (``PhaseClock``), not
        ``perf_counter`` (exact on CPU, where every op has finished when it returns)."""
        self._carried_stage_ms = 0.0
        """With events: this rank's compute time of the step before, which the next step's all-reduce carries."""
        self._carried_peak_bytes = 0
        """This rank's peak memory of the step before, update included (see ``_memory_now``)."""
        self._update_events = None
        """With events: the (start, end) events of the last update, read at the next step's host read."""
        self._last_update_ms: float | None = None
        """With events: the GPU time of the last update read so far (None before the first was read)."""
        self._fresh_grads = False
        """The next ``forward_backward`` starts the gradients afresh (``train_step``), else it adds to them."""
        self._saved_bytes: tuple[tuple, dict] = ((), {})
        """What each pass (``_timed_forward``'s key) saved when it was measured, and under which layers
        (``_known_saved_bytes``)."""
        self._anchor = torch.zeros((), device=self.device, requires_grad=True)
        """What a ``_Boundary`` hangs a pass's input on in the graph (it never gets a gradient)."""

    def load_full(self, full) -> None:
        """Set this rank's weights (and fp32 master weights) from ``full(name) -> full fp32 tensor``."""
        if isinstance(self.precision, ShardedAdamW):
            if self.plan.zero_stage == 3:
                self.units.load_weights(full)  # the owned weight shards (the parameters hold nothing now)
            else:
                self.model.load_full(full)  # the compute-dtype weights, rounded from the full values
            self.precision.load_masters(full)
            return
        if not self.precision.mixed and not self.offload_optimizer:
            self.model.load_full(full)
            return
        # The masters take the exact values, the module their rounding (host masters: their own copy in fp32 too);
        # each full tensor is read once.
        spec, pos, shapes = self.plan.model, self.pos, parameter_shapes(self.plan.model)
        values = []
        for name, p in self.model.named_parameters():
            t = full(name)
            if tuple(t.shape) != shapes[name]:
                raise ValueError(f"{name}: expected shape {shapes[name]}, got {tuple(t.shape)}")
            values.append((p, take_slice(t, parameter_slice(spec, name, pos.heads, pos.ffn_cols)).to(self.device)))
        self.precision.load_full_values(values)

    def master_parameters(self) -> dict[str, torch.Tensor]:
        """Parameter name -> the fp32 tensor AdamW updates (the parameter itself in fp32), with its AdamW
        state in ``self.optimizer.state``. Not at ``zero_stage`` 1, where a rank keeps master weights
        of its owned shards only (``state_range``)."""
        masters = self.precision.master_of()
        return {name: masters[id(p)] for name, p in self.model.named_parameters()}

    @property
    def sharded(self) -> bool:
        """The optimizer state is sharded over peer groups (``zero_stage`` >= 1)."""
        return isinstance(self.precision, ShardedAdamW)

    def optimizer_steps(self) -> int:
        """Optimizer steps taken (AdamW's bias-correction step; skipped steps not counted)."""
        if self.sharded:
            return self.precision.steps
        for st in self.optimizer.state.values():
            if "step" in st:
                return int(st["step"])
        return 0

    def optimizer_settings(self) -> dict:
        """lr (of the last step), betas and eps of the AdamW update."""
        if self.sharded:
            return {"lr": self.precision.lr, "betas": list(self.precision.betas), "eps": self.precision.eps}
        g = self.optimizer.param_groups[0]
        return {"lr": g["lr"], "betas": list(g["betas"]), "eps": g["eps"]}

    @torch.no_grad()
    def state_range(self, index: int, lo: int, hi: int) -> torch.Tensor:
        """(3, hi - lo) fp32: (master) weights, exp_avg and exp_avg_sq of flat elements [lo, hi) of peer
        group ``index`` (``ReplicaSync.state_owners`` says which rank keeps which range): what checkpoints save."""
        if self.sharded:
            return self.precision.state_range(index, lo, hi)
        sg = self.sync.mine_by_index(index)
        masters = self.master_parameters()
        out = torch.zeros((3, hi - lo), dtype=torch.float32, device=self.device)
        self.sync.copy(sg, masters.__getitem__, lo, hi, out[0], into_buffer=True)
        for k, key in ((1, "exp_avg"), (2, "exp_avg_sq")):
            def moment(name, key=key):
                return self.optimizer.state.get(masters[name], {}).get(key, torch.zeros_like(masters[name]))
            self.sync.copy(sg, moment, lo, hi, out[k], into_buffer=True)
        return out

    def _known_saved_bytes(self) -> dict:
        """The saved bytes of the passes measured so far (``SavedBytes.known``: a pass saves the same tensors every
        step, so each is measured once), forgotten when the layers changed how they run (compiled since, or
        evaluation mode)."""
        signature = (self.model.training, *(getattr(block, "compiled", False) for block in self.model.h.values()))
        if signature != self._saved_bytes[0]:
            self._saved_bytes = (signature, {})
        return self._saved_bytes[1]

    def _contiguous_grads(self) -> torch.Tensor:
        """One flat buffer whose views are every parameter's ``.grad``: backward accumulates into it in
        place and data-parallel synchronisation all-reduces it as it is. Flattening the gradients
        into a fresh tensor and copying them back cost 60% on top of a 25 MB all-reduce over gloo.

        A step starts each gradient one of two ways (``_start_grads``), both giving the numbers of a zeroed buffer
        that every backward adds to. Most gradients stay bound to their views, which the step zeroes (one fill for
        all of them), and every backward adds into them in place. On CPU a gradient of ``_ADOPT_BYTES`` or more is
        unset instead, so the first backward to reach its parameter hands it a fresh gradient (autograd's own, not a
        sum with zeros), which a hook after the accumulation copies into the view (``_adopt_grad``) while it is
        still in the cache; the later backwards of the step add into the view in place. Zeroing and adding onto the
        zeros cost 2.3 + 4 ms a step on 4.9M fp32 parameters on one CPU thread, the copy about a third of that; but
        the hook is a call into Python at every backward (about 3 us), more than a small gradient's zeroing and
        add. On CUDA no gradient is adopted: the zeroing is one kernel and a memory-bound add costs the device
        little, while the hooks' host time is what bounds a step of small micro-batches."""
        params = list(self.model.parameters())
        dtypes = {p.dtype for p in params}
        assert len(dtypes) == 1, f"parameters of one dtype expected, got {dtypes}"
        buffer = torch.zeros(sum(p.numel() for p in params), dtype=dtypes.pop(), device=self.device)
        adopt = self.device.type == "cpu"
        self._grad_views, self._adopting, zeroed, offset = [], [], [], 0
        for p in params:
            view = buffer[offset:offset + p.numel()].view_as(p)
            self._grad_views.append((p, view))
            if adopt and view.nbytes >= _ADOPT_BYTES:
                self._adopting.append(p)
                p.register_post_accumulate_grad_hook(partial(_adopt_grad, view))
            else:
                zeroed.append(view)
            offset += p.numel()
        self._zeroed = zeroed if self._adopting else [buffer]
        """What ``_start_grads`` zeroes: the views of the gradients not adopted (the whole buffer if none is)."""
        self._bind_grads()
        return buffer

    def _bind_grads(self) -> None:
        """Make every ``.grad`` its view of the buffer again: a gradient left unset (a ``zero_grad()`` elsewhere,
        or a parameter no backward of the step reached) is zero, any other tensor is copied in (a later
        backward would otherwise leave the buffer the all-reduce reads stale)."""
        for p, view in self._grad_views:
            grad = p.grad
            if grad is view:
                continue
            if grad is None:
                view.zero_()
            elif grad.data_ptr() != view.data_ptr():
                view.copy_(grad)
            p.grad = view

    def _start_grads(self) -> None:
        """A step's start (see ``_contiguous_grads``): the adopted gradients unset, the others zeroed in the buffer.
        A bound gradient that something replaced since is copied into the buffer at the end (``_bind_grads``)."""
        for p in self._adopting:
            p.grad = None
        if self._zeroed:  # empty when every gradient is adopted
            torch._foreach_zero_(self._zeroed)

    # --- point-to-point ----------------------------------------------------------------------------
    def _boundary_buffer(self, rows: int | None = None) -> torch.Tensor:
        """An activation (or its gradient) as it crosses a stage boundary: rows x s x h, compute dtype."""
        spec = self.plan.model
        rows = self.micro_batch_size if rows is None else rows
        return torch.empty(rows, spec.seq_len, spec.hidden_dim, device=self.device, dtype=self.dtype)

    def _recv(self, src: int, rows: int | None = None, **trace_args) -> torch.Tensor:
        buf = self._boundary_buffer(rows)
        t0 = time.perf_counter()
        out = self.topo.wait_recv(self.topo.post_recv(buf, src, ACTIVATION_TAG), timeout_s=self.timeout_s)
        if self.tracer is not None:
            self.tracer.add(f"recv from {src}", "p2p", t0, time.perf_counter(), **trace_args)
        return out

    def _send(self, t: torch.Tensor, targets: list[int], pending: list, tag: int = 0, **trace_args) -> None:
        t0 = time.perf_counter()
        t = t.detach().contiguous()
        for dst in targets:
            pending.append((dist.isend(t, dst, tag=tag), t))
        if self.tracer is not None and targets:
            self.tracer.add(f"send to {','.join(map(str, targets))}", "p2p", t0, time.perf_counter(), **trace_args)

    # --- one step ----------------------------------------------------------------------------------
    def forward_backward(self, step: int, data) -> StepStats:
        """Run the schedule of one step and leave the synchronised gradients in ``.grad`` (stages 2 and
        3: the layered passes, leaving the summed gradients in the owners' shards, ``runtime.train.layered``).

        The step reads the device once (``_read_step``): until then the losses, the overflow flag, the squared
        gradient norm and (on CUDA) the phases' times stay on the device."""
        spec = self.plan.model
        m = self.num_microbatches
        denom = self.samples_per_step * spec.seq_len
        cuda = self.device.type == "cuda"
        if not self.layered:
            if self._fresh_grads:  # train_step: this step's gradients replace the last one's
                self._fresh_grads = False
                self._start_grads()
            else:  # accumulate onto the gradients there are
                self._bind_grads()
        meter = self.model.meter
        meter.reset()
        saved = SavedBytes(self.model.parameters(), known=self._known_saved_bytes()) if self.measure else None
        meter.saved = saved
        stash = self.model.stash
        if stash is not None:
            stash.reset()
        scale = self.precision.loss_scale
        stats = StepStats(step=step, loss=0.0, iteration_ms=0.0, forward_ms=[0.0] * m, backward_ms=[0.0] * m,
                          recompute_ms=[0.0] * m, tokens=self.samples_per_step * spec.seq_len, loss_scale=scale)
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        AllReduceClock.reset()
        tracer = self.tracer
        if tracer is not None:
            AllReduceClock.spans = []
        # perf_counter costs nothing on CPU; CUDA events are recorded only when a report or trace wants the times.
        clock = PhaseClock(events=self.events, enabled=not self.events or self.measure or tracer is not None)
        meter.clock = clock
        if self.units is not None:
            self.units.clock = clock
        start = time.perf_counter()
        try:
            loss_sum = self._interpret(step, data, stats, saved, scale, denom, clock)
            if not self.layered:
                self._bind_grads()  # every gradient in the buffer: a parameter no backward reached holds zeros
            if tracer is not None:
                for a, b in AllReduceClock.spans:
                    tracer.add("tp all-reduce", "allreduce", a, b, step=step)
            stats.tp_allreduce_ms = None if cuda else AllReduceClock.seconds * 1e3
            if not self.layered:  # stages 2 and 3: the reduce-scatters ran inside the backward pass, unit by unit
                t0 = clock.start()
                self._sync_grads()
                clock.stop(t0, ("grad sync",))
            self._read_step(step, stats, clock, loss_sum, scale)
        finally:
            AllReduceClock.spans, meter.clock, meter.saved = None, None, None
            if self.units is not None:
                self.units.clock = None
        stats.peak_saved_bytes = saved.peak if saved is not None else 0
        if saved is not None:
            self._saved_bytes[1].update(saved.measured)
        if stash is not None:  # host-side counters: no read of the device
            stats.peak_host_activation_bytes, stats.offload_late_bytes = stash.peak_held_bytes, stash.late_bytes
            stats.offload_out_bytes, stats.offload_in_bytes = stash.copied_out_bytes, stash.copied_in_bytes
        stats.peak_allocated_bytes = torch.cuda.max_memory_allocated(self.device) if cuda else 0
        stats.recomputed_ops = dict(meter.recomputed)
        stats.iteration_ms = (time.perf_counter() - start) * 1e3
        return stats

    def _read_step(self, step: int, stats: StepStats, clock: PhaseClock, loss_sum: torch.Tensor, scale: float) -> None:
        """The step's one small all-reduce (none with one rank) and its one read to the host: the global loss, (fp16)
        the count of ranks whose gradients overflowed, so every rank skips an overflowing step together, the squared
        global gradient norm (each element counted once over all ranks), every stage's compute time and every rank's
        peak memory. Fills ``stats`` from it and from the clock.

        On CPU the clock's times are known before the all-reduce, which carries this step's stage times. With
        CUDA events a time is known only after a read that waited for the stream, which is this one: the
        all-reduce carries each stage's time of the step before (``stage_ms`` lags one step; 0 at the first),
        as a second all-reduce and read after it would stall every step once more. Peak memory is likewise each
        rank's peak so far in this step or, if larger, its whole previous step's (update included; a rank's own
        ``peak_allocated_bytes`` is exact): the update runs after the read."""
        pos, tracer = self.pos, self.tracer
        t_metrics = time.perf_counter()
        t_norm = clock.start()
        square_sum = grad_square_sum(self._norm_views, self.device)
        clock.stop(t_norm, ("norm",))
        if self.precision.scaler is not None:
            finite = self.units.all_finite() if self.layered else torch.isfinite(self.grad_buffer).all()
            overflow = (~finite).double()
        else:
            overflow = torch.zeros((), dtype=torch.float64, device=self.device)
        if not clock.events:
            self._take_times(clock.resolve(), stats, step)
            my_ms = sum(stats.forward_ms) + sum(stats.backward_ms)
        else:
            my_ms = self._carried_stage_ms
        num_stages, world = len(self.plan.pipelines[0].device_stages), dist.get_world_size()
        metrics = torch.zeros(3 + num_stages + world, dtype=torch.float64, device=self.device)
        if not (self.last and pos.tp_rank == 0):
            loss_sum = torch.zeros_like(loss_sum)  # the loss counts once, from the last stage's TP rank 0
        metrics[:3] = torch.stack([loss_sum, overflow, square_sum])
        # The two slots known on the host are filled by kernels taking the value as an argument: a copy from
        # pageable host memory would make the host wait for the stream (torch synchronises such a copy).
        if pos.pipeline == 0 and pos.tp_rank == 0:
            metrics[3 + pos.stage].fill_(my_ms)
        metrics[3 + num_stages + dist.get_rank()].fill_(float(max(self._memory_now(), self._carried_peak_bytes)))
        if world > 1:  # alone, the sum is this rank's figures: the collective would only cost host time
            dist.all_reduce(metrics)
        values = metrics.tolist()  # the step's one host read
        if tracer is not None:
            tracer.add("grad norm, step all-reduce", "allreduce", t_metrics, time.perf_counter(), step=step)
        if clock.events:
            self._take_times(clock.resolve(), stats, step)
            self._carried_stage_ms = sum(stats.forward_ms) + sum(stats.backward_ms)
            if self._update_events is not None:  # the last update ran before this read: its events are complete
                a, b = self._update_events
                self._last_update_ms, self._update_events = a.elapsed_time(b), None
        if self.layered:
            stats.grad_sync_ms = sum(self.units.reduce_ms.values())
        stats.loss = values[0]
        stats.skipped = values[1] > 0
        stats.grad_norm = math.sqrt(values[2]) / scale if math.isfinite(values[2]) else math.inf
        stats.stage_ms = values[3:3 + num_stages]
        stats.memory_bytes = values[3 + num_stages:]

    def _take_times(self, spans, stats: StepStats, step: int) -> None:
        """Add the clock's resolved ``spans`` to ``stats`` (and the unit collectives' to ``self.units``), and to
        the trace."""
        tracer = self.tracer
        for key, a, b in spans:
            kind, ms = key[0], (b - a) * 1e3
            if kind in ("forward", "backward"):
                (stats.forward_ms if kind == "forward" else stats.backward_ms)[key[1]] += ms
                if tracer is not None:
                    tracer.add(key[2], kind, a, b, step=step, mb=key[1])
            elif kind == "recompute":
                stats.recompute_ms[key[1]] += ms
                if tracer is not None:
                    tracer.add("recompute", "recompute", a, b, step=step)
            elif kind == "grad sync":
                stats.grad_sync_ms += ms
                if tracer is not None:
                    tracer.add("gradient sync (tied, data-parallel)" if not self.sharded else
                               "gradient sync (tied, data-parallel reduce-scatter)", "allreduce", a, b, step=step)
            elif kind == "norm":
                stats.norm_ms += ms
            elif kind in ("reduce", "gather"):
                (self.units.reduce_ms if kind == "reduce" else self.units.gather_ms)[key[1]] += ms
                if tracer is not None:
                    what = "reduce-scatter" if kind == "reduce" else "gather"
                    tracer.add(f"{what} {_unit_name(key[1])}", "allreduce", a, b, step=step)

    def _run_stage(self, stage: int, x: torch.Tensor, mb: MicroBatch, targets: torch.Tensor | None) -> torch.Tensor:
        """A whole (virtual) stage's forward, as ``StageModel.forward`` runs this rank's: the embedding on the first
        (``x`` the tokens), its layers, the head on the last (with ``targets`` the summed loss, else the logits)."""
        model = self.model
        if stage == 0:
            x = model.embed(x)
        for layer in self.stage_layers[stage]:
            x = model.h[str(layer)](x, mb)
        return model.head(x, targets) if stage == len(self.stage_layers) - 1 else x

    def _interpret(self, step: int, data, stats: StepStats, saved, scale: float, denom: int,
                   clock: PhaseClock) -> torch.Tensor:
        """The one interpreter of ``baton.schedules``: runs this rank's actions of its replica's schedule (1F1B, or
        layer by layer at stages 2 and 3) up to the optimizer step; returns the summed loss (where the schedule
        computes it, else 0), a float64 scalar on the device: the micro-batches' losses are never read here.
        The passes are timed on ``clock`` (``_take_times`` reads it).

        A forward runs on a detached copy of its input (tokens, a received activation, or this rank's output of
        the part before), so autograd runs one pass at a time and its backward leaves the input's gradient for
        the next backward of the micro-batch, or for a send. The part that ends in the loss (the head, or the
        last stage whole) divides it by the global batch's tokens and scales it (fp16); its backward starts
        from it. Stage 3's gathers track the parameters' new storages, so the saved-bytes meter does not count
        them as activations."""
        pos, model, meter, tracer = self.pos, self.model, self.model.meter, self.tracer
        mbs, dev, actions = self.micro_batch_size, self.device, self.actions
        last_stage = self.replica_schedule.num_stages - 1
        recvs = [a for a in actions if isinstance(a, Recv)]
        sources = {False: self.topo.forward_source(pos), True: self.topo.backward_source(pos)}
        inbox = {grad: _Inbox(self, sources[grad], [(a.micro, a.stage) for a in recvs if a.grad == grad], step,
                              GRADIENT_TAG if grad else ACTIVATION_TAG)
                 for grad in (False, True) if any(a.grad == grad for a in recvs)}
        targets_of = {False: self.topo.forward_targets(pos), True: self.topo.backward_targets(pos)}
        batches: dict = {}

        def to_device(t: torch.Tensor) -> torch.Tensor:
            """A host tensor on the device. On CUDA through pinned memory without waiting: torch makes the host wait
            for the stream after a copy from pageable memory, which here would be once per micro-batch."""
            return t.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else t.to(dev)

        def batch(i):
            """(tokens, targets, dropout key) of micro-batch ``i``: samples [first + i b, + b) of the batch."""
            if i not in batches:
                samples = torch.arange(mbs) + self.first_sample + i * mbs
                tokens, targets = data.batch(step, samples) if (self.first or self.last) else (None, None)
                batches[i] = (to_device(tokens) if self.first else None, to_device(targets) if self.last else None,
                              MicroBatch(self.seed, step, to_device(samples)))
            return batches[i]

        def run_part(stage, part, x, mb, targets, loss_end):
            if part == WHOLE:
                y = self._run_stage(stage, x, mb, targets if loss_end else None)
            elif part == EMBEDDING:
                y = model.embed(x)
            elif part == HEAD:
                y = model.head(x, targets)
            else:
                y = model.h[str(part)](x, mb)
            if not loss_end:
                return y, None
            # The summed vocabulary-parallel cross-entropy, computed in fp32 (the softmax it keeps is fp32 in
            # every dtype).
            y = y / denom
            return (y * scale if scale != 1.0 else y), y.detach()

        def collective(action, fn):
            fn(action.unit)  # timed (and traced) on the clock by ``UnitShards``
            if isinstance(action, Gather) and saved is not None:
                saved.track_params(model.parameters())  # gathered storages have new addresses

        def ends_in_loss(a) -> bool:
            return a.part == HEAD or (a.part == WHOLE and a.stage == last_stage)

        def span_name(a) -> str:
            """'F0', 'B2 layer 3', 'F1 embedding'; interleaved 'F0 stage 2' (the virtual stage)."""
            where = f" stage {a.stage}" if self.replica_schedule.num_chunks > 1 else _part_name(a.part)
            return f"{'F' if isinstance(a, Forward) else 'B'}{a.micro}{where}"

        stash = model.stash
        # Offloaded layer inputs: parts are joined through ``_Boundary`` (see the module docstring).
        joined = "layer_input" in self.offload

        def top_layer(stage, part) -> int | None:
            """The last layer a pass runs (the first its backward reaches); None: it runs none."""
            if part == WHOLE:
                layers = self.stage_layers[stage]
                return layers[-1] if layers else None
            return part if isinstance(part, int) else None

        def prefetch(a) -> None:
            """Start copying back what the top layer of backward ``a`` offloaded."""
            layer = top_layer(a.stage, a.part) if stash is not None else None
            if layer is not None:
                stash.prefetch((a.stage, a.part, a.micro), layer)

        # Layer by layer (one key per layer) each backward starts the copies of the one after it.
        backwards = [k for k, a in enumerate(actions) if isinstance(a, Backward)]
        after = {k: actions[n] for k, n in zip(backwards, backwards[1:])} if self.layered else {}

        # Per micro-batch, the activation its next forward takes and the gradient its next backward takes; per
        # pass (stage, part, micro-batch), its (input, output) until its backward.
        pending, loss_sum = [], torch.zeros((), dtype=torch.float64, device=dev)
        acts, grads, graph = {}, {}, {}
        for k, a in enumerate(actions):
            if isinstance(a, Forward):
                i, key = a.micro, (a.stage, a.part, a.micro)
                tokens, targets, mb = batch(i)
                loss_end = ends_in_loss(a)
                takes_tokens = a.part == EMBEDDING or (a.part == WHOLE and a.stage == 0)
                if takes_tokens:
                    x, held = tokens, None
                elif joined and top_layer(a.stage, a.part) is not None:
                    held = _Boundary()
                    x = held.enter(acts.pop(i).detach(), self._anchor)
                else:
                    x = held = acts.pop(i).detach().requires_grad_()
                y, loss = _timed_forward(clock, i, span_name(a), saved, stash, key,
                                         lambda: run_part(a.stage, a.part, x, mb, targets, loss_end))
                if loss is not None:
                    loss_sum += loss.double()  # fp32 losses summed in fp64, on the device
                out = _Boundary().leave(y) if joined and self.layered and not loss_end else y
                graph[key] = (held, out)  # not x when it entered through a boundary: x is let go
                if not loss_end:
                    acts[i] = y
                del x, held, out  # the graph keeps what the backward needs, and only that
            elif isinstance(a, Backward):
                i, key = a.micro, (a.stage, a.part, a.micro)
                x, y = graph.pop(key)
                prefetch(a)  # nothing if its receive started it
                if k in after:
                    prefetch(after[k])
                grad = None if ends_in_loss(a) else grads.pop(i)
                if isinstance(y, _Boundary):
                    y.give(grad)
                    y, grad = y.handle, None
                _timed_backward(meter, clock, i, span_name(a), y, grad)
                if saved is not None:
                    saved.release(key)
                if stash is not None:
                    stash.release(key)
                if x is not None:
                    grads[i] = x.grad
            elif isinstance(a, Send):
                t = grads.pop(a.micro) if a.grad else acts.pop(a.micro)
                self._send(t, targets_of[a.grad], pending, GRADIENT_TAG if a.grad else ACTIVATION_TAG,
                           step=step, mb=a.micro)
            elif isinstance(a, Recv):
                if a.grad:  # the copies back overlap the wait for the gradient
                    prefetch(Backward(micro=a.micro, stage=a.stage))
                (grads if a.grad else acts)[a.micro] = inbox[a.grad].take((a.micro, a.stage))
            elif isinstance(a, Gather):
                collective(a, self.units.gather)
            elif isinstance(a, Release):
                self.units.release(a.unit)
            elif isinstance(a, ReduceScatter):
                collective(a, self.units.reduce_scatter)
            elif isinstance(a, OptimizerStep):
                break  # the step and what follows it: ``train_step``
        if pending:
            t0 = time.perf_counter()
            for work, _ in pending:
                work.wait()
            if tracer is not None:
                tracer.add("wait for sends", "p2p", t0, time.perf_counter(), step=step)
        return loss_sum

    # --- validation -------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, source) -> float:
        """Mean cross-entropy over every window of ``source`` (a ``runtime.data.source.ValidationSource``), without
        dropout: the same number ``runtime.data.source.validation_loss`` gives for the single-device model.
        Collective: every rank calls it.

        Each batch of the source is split over pipelines and micro-batches as a training step's is, and
        run forward only (every stage receives, computes and sends on, in micro-batch order). A batch's
        samples past the source's last window are not run at all, so every window counts once."""
        spec, pos, m, mbs = self.plan.model, self.pos, self.num_microbatches, self.micro_batch_size
        fwd_src, fwd_dst = self.topo.forward_source(pos), self.topo.forward_targets(pos)
        self.model.eval()
        pending, loss_sum = [], 0.0
        # Stage 3: every unit gathered for the validation passes, released again after them.
        whole = self.units.gathered() if self.plan.zero_stage == 3 else nullcontext()
        with whole:
            try:
                stages = len(self.stage_layers)
                for index in range(source.num_batches):
                    windows = min(source.global_batch, source.num_windows - index * source.global_batch)
                    # This rank's (virtual) stages in model order, every micro-batch through each.
                    for k in range(pos.stage, stages, self.num_stages):
                        for i in range(m):
                            first_sample = self.first_sample + i * mbs
                            n = min(mbs, windows - first_sample)  # a prefix of the micro-batch: the same on every rank
                            if n <= 0:
                                continue
                            samples = torch.arange(n) + first_sample
                            tokens, targets = source.batch(index, samples) if (self.first or self.last) else (None, None)
                            if k == 0:
                                x = tokens.to(self.device)
                            else:
                                x = self._recv(fwd_src, rows=n, validation_batch=index, mb=i)
                            y = self._run_stage(k, x, MicroBatch(self.seed, 0, samples.to(self.device)),
                                                targets.to(self.device) if k == stages - 1 else None)
                            if k == stages - 1:
                                loss_sum += float(y)
                            else:
                                self._send(y, fwd_dst, pending)
                for work, _ in pending:
                    work.wait()
            finally:
                self.model.train()
        total = torch.tensor([loss_sum if self.last and pos.tp_rank == 0 else 0.0], dtype=torch.float64)
        return float(self._all_reduce_cpu(total)[0]) / (source.num_windows * spec.seq_len)

    def _all_reduce_cpu(self, t: torch.Tensor) -> torch.Tensor:
        t = t.to(self.device)
        dist.all_reduce(t)
        return t.cpu()

    def _sync_grads(self) -> None:
        """Sum the tied embedding's two gradients (first and last stage), then sum the replicas'
        gradients over the peer groups (each micro-batch loss is already divided by the global batch's
        token count): all-reduces, or at ``zero_stage`` 1 reduce-scatters to the owners."""
        if self.groups.tied is not None and hasattr(self.model, "wte"):
            # Each rank holds its own vocabulary rows; the two stages may split them differently.
            self.model.sum_tied_gradient(self.groups.tied)
        self.sync.sync_grads()

    def train_step(self, step: int, data) -> StepStats:
        """Forward, backward, gradient sync, clipping and one AdamW update at the schedule's learning
        rate (skipped on every rank when fp16 gradients overflowed on any).

        The host reads the device once (``_read_step``, before the update: the clip coefficient and the skip
        come from it) and does not wait for the update. On CUDA the host's next step then waits at its own read
        for this update, so ``iteration_ms`` is the host's pace (exact on average over steps), and
        ``optimizer_ms`` times the update of the step before with CUDA events (the host's launch time at the
        first step)."""
        t0 = time.perf_counter()
        if self.layered:
            self.units.start_step()  # the gradients were freed unit by unit: nothing to zero
        else:
            self._fresh_grads = True  # this step's gradients replace the last one's (_start_grads)
        stats = self.forward_backward(step, data)
        t1 = time.perf_counter()
        stats.lr = self.schedule.lr_at(step)
        self.precision.set_lr(stats.lr)
        # Every rank computes the same coefficient from the same all-reduced norm.
        factor = clip_coefficient(stats.grad_norm, self.clip_grad) if self.clip_grad > 0 else 1.0
        stats.clipped = factor < 1.0
        update = PhaseClock(events=self.events, enabled=self.events and (self.measure or self.tracer is not None))
        u0 = update.start()
        self.precision.step(overflow=stats.skipped, grad_factor=factor)
        for action in self.after_step:
            # Stage 3's release of the edges (their owners' updated shards cut out, the rest freed); stage 2's
            # gathers of the updated weights are the step's own (``ShardedAdamW.step``, unit by unit in this order).
            if isinstance(action, Release):
                self.units.release(action.unit)
        if u0 is not None:
            update.stop(u0, ("update",))
            self._update_events = update.spans[-1][1:]  # read at the next step's host read
        if self.device.type == "cuda":
            # The allocator's counters live on the host: the update's allocations are in them without a wait.
            stats.peak_allocated_bytes = torch.cuda.max_memory_allocated(self.device)
        t2 = time.perf_counter()
        update_ms = (t2 - t1) * 1e3 if not self.events or self._last_update_ms is None else self._last_update_ms
        stats.optimizer_ms = stats.norm_ms + update_ms
        stats.gather_ms = getattr(self.precision, "gather_ms", 0.0)
        if self.layered:
            gathers = self.units.gather_ms if self.plan.zero_stage == 3 else self.precision.unit_gather_ms
            stats.unit_reduce_ms = [self.units.reduce_ms[u] for u in self.units.units]
            stats.unit_gather_ms = [gathers.get(u, 0.0) for u in self.units.units]
            stats.gather_ms = sum(stats.unit_gather_ms)
        if self.tracer is not None:
            self.tracer.add("optimizer", "optimizer", t1, t2, step=step, lr=stats.lr)
        stats.iteration_ms = (time.perf_counter() - t0) * 1e3
        held = self.precision.state_bytes()
        stats.weights_bytes, stats.grads_bytes = held.weights_bytes, held.grads_bytes
        stats.master_bytes, stats.moments_bytes = held.master_bytes, held.moments_bytes
        stats.host_optimizer_bytes = held.host_optimizer_bytes
        link = getattr(self.precision, "link", None)
        if link is not None:  # host-side figures: no read of the device
            stats.host_optimizer_ms, stats.host_optimizer_wait_ms = link.step_ms, link.wait_ms
            stats.host_optimizer_out_bytes, stats.host_optimizer_in_bytes = link.out_bytes, link.in_bytes
        self._carried_peak_bytes = max(self._memory_now(), stats.peak_allocated_bytes)
        if stats.memory_bytes:
            stats.memory_bytes[dist.get_rank()] = float(self._carried_peak_bytes)  # this rank's own is known whole
        return stats

    def _memory_now(self) -> int:
        """This rank's peak memory so far: CUDA memory allocated since the step began (the allocator's host-side
        counter, no wait for the device), or on CPU the process's peak resident set."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _adopt_grad(view: torch.Tensor, p: torch.Tensor) -> None:
    """After autograd accumulated ``p``'s gradient: a gradient that is not ``view`` (a step's first, which autograd
    made) is copied into the buffer, and ``view`` is the gradient from then on (``Engine._contiguous_grads``)."""
    grad = p.grad
    if grad is not view:
        view.copy_(grad)
        p.grad = view


class _Boundary:
    """Where a pass's input enters it or its output leaves it, with nothing but autograd's graph holding the tensor
    (an offloaded layer input must not stay on the device for the engine's sake: module docstring).

    ``enter``: the input as a view made by ``_Enter`` (not a leaf, which its gradient accumulator keeps alive); its
    gradient lands in ``grad``. ``leave``: the output stands for itself in the backward by a 0-d ``handle``
    (``_Leave``); ``give`` hands it the output's gradient, and the backward from the handle passes that on."""

    def __init__(self):
        self.grad: torch.Tensor | None = None
        """The gradient passing through (entering: the input's, after the backward)."""
        self.handle: torch.Tensor | None = None
        """Leaving: the 0-d tensor the backward starts from."""

    def enter(self, x: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        """``x`` (detached) as the pass's input; ``anchor``: a 0-d leaf needing a gradient (it never gets one)."""
        return _Enter.apply(anchor, x, self)

    def leave(self, y: torch.Tensor) -> "_Boundary":
        self.handle = _Leave.apply(y, self)
        return self

    def give(self, grad: torch.Tensor) -> None:
        """The output's gradient, for the backward from ``handle`` (which then needs none of its own)."""
        self.grad = grad


class _Enter(torch.autograd.Function):
    """A view of ``x`` in the graph; its gradient goes to ``link.grad`` (``_Boundary.enter``)."""

    @staticmethod
    def forward(ctx, anchor, x, link):
        ctx.link = link
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.link.grad = grad
        return None, None, None


class _Leave(torch.autograd.Function):
    """A 0-d handle for ``y`` whose backward gives ``y`` the gradient in ``link.grad`` (``_Boundary.leave``)."""

    @staticmethod
    def forward(ctx, y, link):
        ctx.link = link
        return y.new_zeros(())

    @staticmethod
    def backward(ctx, _):
        grad, ctx.link.grad = ctx.link.grad, None
        return grad, None


class _Inbox:
    """What one peer sends this rank during a pipeline step (the activations of the stage before, or the gradients
    of the stage after), in the order the schedule receives them, each receive posted before it is needed.

    Over gloo a send whose receive is not posted yet waits for the receiver's request, and then for the
    sender's I/O thread, which a sender busy with its next pass serves late: between two CPU processes a
    256 KiB activation reached a receiver that asked for it after the send 4 ms later (median; 1.2 ms from an
    idle sender), against 0.02 ms when the receive was posted first, so a pipeline paid milliseconds per
    micro-batch that eq. 6 does not charge. Posting the next receive as soon as the last one has arrived
    lets every transfer start when its sender finishes, as eq. 1 has it, at the price of one boundary
    buffer waiting ahead (docs/cost-model.md, section 6). NCCL runs a pair's sends and receives in order on
    one stream, where a receive posted early would hold up this rank's own sends to that peer, and the GPU
    moves the data without the sender's CPU: there each receive is posted when it is needed."""

    def __init__(self, engine: "Engine", src: int, keys: list, step: int, tag: int = 0):
        self.engine, self.src, self.keys, self.step, self.tag = engine, src, keys, step, tag
        """``keys``: (micro-batch, virtual stage) of every tensor this peer sends, in the order they are taken
        (the sender's sends to this rank come in the same order: both follow the schedule)."""
        self.ahead = engine.device.type == "cpu"
        self.posted: list = []
        self.next = 0
        """How many receives have been posted."""
        if self.ahead:
            self._post()

    def _post(self) -> None:
        if self.next < len(self.keys):
            self.posted.append(self.engine.topo.post_recv(self.engine._boundary_buffer(), self.src, self.tag))
            self.next += 1

    def take(self, key: tuple[int, int]) -> torch.Tensor:
        """The tensor of ``key`` (micro-batch, virtual stage), waiting for it if it has not arrived; tensors
        are taken in the order of ``keys``."""
        engine, t0 = self.engine, time.perf_counter()
        if not self.ahead:
            self._post()
        if self.keys[self.next - 1] != key or len(self.posted) != 1:  # one at a time, in the peer's order
            raise RuntimeError(f"{key} taken from rank {self.src} out of order (next posted: {self.keys[self.next - 1]})")
        out = engine.topo.wait_recv(self.posted.pop(0), timeout_s=engine.timeout_s)
        if engine.tracer is not None:
            engine.tracer.add(f"recv from {self.src}", "p2p", t0, time.perf_counter(), step=self.step, mb=key[0])
        if self.ahead:
            self._post()
        return out


def _unit_name(unit) -> str:
    """'edges' or 'layer 3' for a unit in trace span names."""
    return "edges" if unit is EDGES else f"layer {unit}"


def _part_name(part) -> str:
    """What a pass span's name adds after 'F0' or 'B0': nothing for a whole stage, else ' embedding', ' layer 3',
    ' head'."""
    if part == WHOLE:
        return ""
    return f" {part}" if isinstance(part, str) else f" {_unit_name(part)}"


def _timed_forward(clock: PhaseClock, i: int, name: str, saved, stash, key, fn):
    """A forward of micro-batch ``i`` (``fn()``), the tensors it saves recorded under ``key`` (on the ``SavedBytes``
    meter ``saved``, and what it offloads in the ``OffloadStash`` ``stash``; either may be None), timed on ``clock`` as
    ``name`` (a micro-batch's forward may come in several pieces, one per layer when run layer by layer).
    Returns what ``fn`` returned. No wait for the device: on CUDA the clock records events."""
    token = clock.start()
    with (saved.record(key) if saved is not None else nullcontext(),
          stash.record(key) if stash is not None else nullcontext()):
        out = fn()
    clock.stop(token, ("forward", i, name))
    return out


def _timed_backward(meter, clock: PhaseClock, i: int, name: str, y, grad) -> None:
    """Backward of micro-batch ``i`` from ``y`` with the meter told recomputation runs now (the recomputed
    segments time themselves on ``clock``), timed on ``clock`` as ``name`` (a micro-batch's backward may come
    in several pieces, one per layer when run layer by layer)."""
    token = clock.start()
    meter.in_backward, meter.backward_mb = True, i
    try:
        torch.autograd.backward(y, grad)
    finally:
        meter.in_backward = False
    clock.stop(token, ("backward", i, name))
