"""ZeRO stage 1 (and the optimizer of stages 2 and 3) with uneven shards: each holder of a peer group keeps
the optimizer state (fp32 master
weights in fp16/bf16, AdamW's two fp32 moments) of its owned shard of the group's flat vector only
(``baton.peers.group_shard_sizes``: its ``shard_ratio`` over the group's, 0 owning nothing), as
docs/cost-model.md eq. 14 prices it.

One step (``runtime.train.replica_sync`` has already reduce-scattered the gradients, so each owner's gradients
of its shard are the sum over the replicas, and the engine has the global norm for clipping):

1. every owner runs AdamW on each of its shards, piece by piece in place: in fp32 directly on its parameters (a
   column range of a matrix is a strided view), in fp16/bf16 on the master shard, the gradient turned
   into fp32 a few pieces at a time (at most the rank's largest parameter, as ``runtime.train.precision`` does),
   the parameters then rounded from the masters. The update is torch's own AdamW arithmetic (its
   functional ``adam`` with decoupled weight decay), so it equals stage 0's: the learning rate of the
   schedule, no decay for biases and LayerNorms, the clipping factor and the fp16 loss scale applied to
   the gradient on its way in, nothing at all on an overflowing step;
2. then, group by group in ``peer_groups`` order, an all-gather of the updated weights in the compute
   dtype, every chunk padded to the largest shard, copied into the other holders' parameters.

At stages 2 and 3 the groups are unit groups (``runtime.train.replica_sync.sync_groups``) and ``attach`` hands it
the ``runtime.train.layered.UnitShards``: the owned gradients are its flat gradient shards (the module keeps no
gradient after a unit's reduce-scatter); stage 2 then updates the module's parameters and all-gathers them
unit by unit as above; stage 3 updates the flat weight shards (the edges, whole until after the step, in the
module's parameters) and gathers nothing: the weights stay sharded until the next step gathers them.

With ``host`` (the device's ``DeviceShare.offload_optimizer``, ``runtime.train.host_optimizer``) the owned shards'
masters (fp32 copies of the weights in fp32 training too) and moments are host tensors: before 1 every owned gradient
shard is copied to a host staging buffer (compute dtype) and the host waits for the copies once; 1 then runs on the
host, the same pieces, batches and kernel, writing the rounded weights (fp16/bf16) into the staging buffer; the
updated owned weights are copied back into the module's parameters before 2. Stage 1 only: stages 2 and 3 step unit
by unit on the device (``baton.plan.validate`` refuses offload there).

It stands in for ``runtime.train.precision.MasterWeights`` (same ``step``, ``set_lr``, ``loss_scale``,
``scaler``, ``state_bytes``); checkpoints read and write the owned shards (``state_range``,
``load_masters``, ``load_moments``), as full tensors on disk, so a run resumes under any plan and either sharding stage.
"""
from __future__ import annotations

import time

from dataclasses import dataclass

import torch
from torch.optim.adam import adam as _adam

from runtime.train.host_optimizer import HostLink
from runtime.train.precision import LossScaler, LossScaleSettings, StateBytes, storage_bytes, adamw_kernel, compute_dtype
from runtime.train.replica_sync import ReplicaSync, SyncGroup, entry_spans
from runtime.parallel.slicing import take_slice


@dataclass(kw_only=True, slots=True)
class _Shard:
    """This rank's optimizer state of one group: flat elements ``sg.owned`` of the group's vector."""

    sg: SyncGroup
    master: torch.Tensor | None = None
    """fp32 master weights (fp16/bf16 only)."""
    exp_avg: torch.Tensor | None = None
    """AdamW's moments, fp32, created by the first step (as torch's AdamW does)."""
    exp_avg_sq: torch.Tensor | None = None
    staging: torch.Tensor | None = None
    """With the state on the host: the owned gradients in the compute dtype, then (fp16/bf16) the rounded weights."""


class ShardedAdamW:
    """AdamW over this rank's owned shards of its peer groups (see the module docstring). Build it while the
    module is still fp32: the masters are copied from the exact values, then it casts the module."""

    def __init__(self, module: torch.nn.Module, sync: ReplicaSync, dtype: str, *, lr: float, betas: tuple[float, float],
                 eps: float, weight_decay: float, loss_scale: LossScaleSettings | None = None, host: bool = False):
        self.module, self.sync, self.dtype = module, sync, dtype
        p0 = next(module.parameters())
        self.link = HostLink(p0.device) if host else None
        """The owned shards' state is in host memory and steps there (module docstring); None: on the device."""
        self._state_device = torch.device("cpu") if host else p0.device
        self.store = None
        """Stages 2 and 3: the ``runtime.train.layered.UnitShards`` holding the owned gradient (and weight) shards
        (``attach``); None at stage 1, where the gradients are the module's."""
        self.unit_gather_ms: dict = {}
        self.mixed = dtype != "fp32"
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.steps = 0
        """Optimizer steps taken (skipped ones not counted), AdamW's bias-correction step."""
        self.scaler = LossScaler(loss_scale) if dtype == "fp16" else None
        self.optimizer = None  # no torch optimizer object: the state is flat shards
        self.shards: list[_Shard] = []
        for sg in sync.mine:
            shard = _Shard(sg=sg)
            lo, hi = sg.owned
            if self.mixed or host:
                # On the host in fp32 too (the weights leave from it, so pinned); fp16/bf16 leave from the staging.
                shard.master = torch.empty(hi - lo, dtype=torch.float32, device=self._state_device,
                                           pin_memory=host and self.link.cuda and not self.mixed)
                sync.copy(sg, sync._param, lo, hi, shard.master, into_buffer=True)  # the module is still fp32
            if host:
                shard.staging = self.link.buffer(hi - lo, compute_dtype(dtype))
            self.shards.append(shard)
        if self.mixed:
            module.to(compute_dtype(dtype))
        self.params = list(module.parameters())
        self._batch_limit = max((p.numel() for p in self.params), default=0)

    def attach(self, store) -> None:
        """Stages 2 and 3: take the gradients from ``store``'s flat shards (and at stage 3 update its weight
        shards instead of the module's parameters, which are released between uses)."""
        if self.link is not None:
            raise ValueError("optimizer-state offload needs zero_stage 0 or 1 (baton.plan.validate refuses it at 2 and 3)")
        self.store = store

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def set_lr(self, lr: float) -> None:
        self.lr = lr

    def master_of(self) -> dict:
        raise ValueError("with zero_stage >= 1 a rank keeps master weights only for its owned shards; "
                         "use the module's parameters or a checkpoint")

    # --- the step -------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, *, overflow: bool = False, grad_factor: float = 1.0) -> bool:
        """Update the owned shards unless ``overflow`` (every rank passes the same flag), then all-gather the
        weights group by group; moves the fp16 loss scale. Returns whether the weights were updated."""
        self.gather_ms = 0.0
        inv_scale = grad_factor / self.loss_scale
        if self.link is not None:
            self.link.start()
        if self.scaler is not None:
            self.scaler.update(overflow)
        if overflow:
            return False
        self.steps += 1
        owned = [shard for shard in self.shards if shard.sg.owned[1] > shard.sg.owned[0]]
        if self.link is not None:
            # Every owned gradient shard out, then one wait for them all (runtime.train.host_optimizer).
            for shard in owned:
                self._pieces_across(shard, shard.staging, out=True)
            self.link.wait()
        # Every owned shard first, then the all-gathers: an all-gather waits for all its holders, so
        # interleaving them with the updates would chain one owner's update behind another's.
        for shard in owned:
            self._update(shard, inv_scale)
        if self.link is not None:
            self.link.stop()
            for shard in owned:  # the updated owned weights back into the module's parameters, for the all-gathers
                self._pieces_across(shard, shard.staging if self.mixed else shard.master, out=False)
        if self.store is not None and self.store.zero_stage == 3:
            return True  # the weights stay sharded: each owner's update is in its weight shard (or whole edges)
        t0 = time.perf_counter()
        self.unit_gather_ms = {}
        for shard in self.shards:
            sg = shard.sg
            if sg.process_group is not None:
                t1 = time.perf_counter()
                p0 = self.params[0]
                self.sync.all_gather_weights(
                    sg, lambda a, b, buf, sg=sg: self.sync.copy(sg, self.sync._param, a, b, buf, into_buffer=True),
                    p0.dtype, p0.device)
                self.unit_gather_ms[sg.unit] = self.unit_gather_ms.get(sg.unit, 0.0) + (time.perf_counter() - t1) * 1e3
        self.gather_ms = (time.perf_counter() - t0) * 1e3
        return True

    def _pieces_across(self, shard: _Shard, flat: torch.Tensor, *, out: bool) -> None:
        """Copy the owned gradients (``out``) into the host tensor ``flat``, or the owned weights from it into the
        module's parameters, over the link. A whole layout's owned gradients are one range of the flat buffer."""
        sg, sync, link = shard.sg, self.sync, self.link
        lo, hi = sg.owned
        if out and sg.layout.whole:
            link.to_host(flat, sync.grad_buffer[lo:hi])
            return
        for start, piece, _ in sync.pieces(sg, sync.grads.__getitem__ if out else sync._param, lo, hi):
            part = flat[start - lo:start - lo + piece.numel()].view(piece.shape)
            if out:
                link.to_host(part, piece)
            else:
                link.to_device(piece, part)

    def _update(self, shard: _Shard, inv_scale: float) -> None:
        sg, sync = shard.sg, self.sync
        lo, hi = sg.owned
        if shard.exp_avg is None:
            shard.exp_avg = torch.zeros(hi - lo, dtype=torch.float32, device=self._state_device)
            shard.exp_avg_sq = torch.zeros_like(shard.exp_avg)
        host = self.link is not None
        if host:
            # The staged gradients, piece for piece as on the device; the masters are the host's.
            params = sync.pieces(sg, sync._param, lo, hi)
            grads = [(a, shard.staging[a - lo:a - lo + p.numel()].view(p.shape), e) for a, p, e in params]
        elif self.store is None:
            grads = sync.pieces(sg, sync.grads.__getitem__, lo, hi)
            params = sync.pieces(sg, sync._param, lo, hi)
        else:
            # The owned gradients are one flat shard; the weights the module's (stage 2, whole edges) or the
            # flat weight shard (stage 3).
            if self.store.whole_at_step(sg):
                params = sync.pieces(sg, sync._param, lo, hi)
            else:
                flat = self.store.weight_shards[sg.index]
                params = [(a, flat[a - lo:b - lo], e) for _, a, b, e in entry_spans(sg, lo, hi)]
            flat = self.store.grad_shards[sg.index]
            grads = [(a, flat[a - lo:a - lo + p.numel()].view(p.shape), e) for a, p, e in params]
        batches = {True: _Batch(), False: _Batch()}
        for (start, g, entry), (_, p, _) in zip(grads, params):
            a, n, shape = start - lo, g.numel(), g.shape
            if self.mixed:
                g = g.float()
            master = shard.master[a:a + n].view(shape) if self.mixed or host else p
            # The compute-dtype weights rounded from the masters: the module's, or with the state on the host the
            # staging's (this piece's gradient is spent by then: ``g`` is its fp32 copy).
            rounded = (shard.staging[a:a + n].view(shape) if host else p) if self.mixed else None
            batch = batches[entry.decays]
            batch.add(master, g, shard.exp_avg[a:a + n].view(shape), shard.exp_avg_sq[a:a + n].view(shape), rounded)
            if self.mixed and batch.numel >= self._batch_limit:
                self._run(batch, entry.decays, inv_scale)
        for decay, batch in batches.items():
            self._run(batch, decay, inv_scale)

    def _run(self, batch: "_Batch", decay: bool, inv_scale: float) -> None:
        """Unscale the batch's gradients, run torch's AdamW over it (fused where ``adamw_kernel`` allows, else
        foreach), round the masters into the module's pieces (fp16/bf16): each a multi-tensor call."""
        if not batch.params:
            return
        if inv_scale != 1.0:
            torch._foreach_mul_(batch.grads, inv_scale)  # in fp32 the gradients themselves, as before
        b1, b2 = self.betas
        kernel = adamw_kernel(batch.params + batch.grads + batch.exp_avgs + batch.exp_avg_sqs)
        device = batch.params[0].device
        # The step count before this step, one tensor per piece (each is incremented in place); the fused
        # kernel reads it on the parameters' device, the foreach one on the host.
        steps = torch.full((len(batch.params),), float(self.steps - 1), dtype=torch.float32,
                           device=device if kernel.get("fused") else "cpu").unbind()
        _adam(batch.params, batch.grads, batch.exp_avgs, batch.exp_avg_sqs, [], list(steps), capturable=False,
              differentiable=False, grad_scale=None, found_inf=None, has_complex=False,
              decoupled_weight_decay=True, amsgrad=False, beta1=b1, beta2=b2, lr=self.lr,
              weight_decay=self.weight_decay if decay else 0.0, eps=self.eps, maximize=False, **kernel)
        rounded = [(piece, master) for piece, master in zip(batch.rounded, batch.params) if piece is not None]
        if rounded:  # the compute-dtype weights are the updated masters, rounded
            torch._foreach_copy_([p for p, _ in rounded], [m for _, m in rounded])
        batch.clear()

    # --- what it holds ------------------------------------------------------------------------------
    def state_bytes(self) -> StateBytes:
        """What this rank holds; at stages 2 and 3 the weights and gradients are the peaks over the last step
        (``UnitShards``: owned shards, whole units, full gradients before their reduce-scatter)."""
        if self.store is not None:
            weights, grads = self.store.peak_weights_bytes, self.store.peak_grads_bytes
        else:
            weights, grads = storage_bytes(self.params), storage_bytes(p.grad for p in self.params)
        master = sum(s.master.nbytes for s in self.shards if s.master is not None)
        moments = sum(t.nbytes for s in self.shards for t in (s.exp_avg, s.exp_avg_sq) if t is not None)
        if self.link is not None:
            staging = sum(s.staging.nbytes for s in self.shards)
            return StateBytes(weights_bytes=weights, grads_bytes=grads, master_bytes=0, moments_bytes=0,
                              host_optimizer_bytes=master + moments + staging, host_staging_bytes=staging)
        return StateBytes(weights_bytes=weights, grads_bytes=grads, master_bytes=master, moments_bytes=moments)

    def owned_params(self) -> int:
        """Elements whose optimizer state this rank keeps."""
        return sum(s.sg.owned[1] - s.sg.owned[0] for s in self.shards)

    # --- checkpoints ----------------------------------------------------------------------------------
    def _shard(self, index: int) -> _Shard:
        return next(s for s in self.shards if s.sg.index == index)

    @torch.no_grad()
    def state_range(self, index: int, lo: int, hi: int) -> torch.Tensor:
        """(3, hi - lo) fp32: weights (the masters in fp16/bf16), exp_avg and exp_avg_sq of flat elements
        [lo, hi) of group ``index``, inside this rank's owned shard (moments zero before the first step)."""
        shard = self._shard(index)
        o = shard.sg.owned[0]
        out = torch.zeros((3, hi - lo), dtype=torch.float32, device=self.params[0].device)
        if self.mixed or self.link is not None:
            out[0] = shard.master[lo - o:hi - o]
        elif self.store is not None and not self.store.whole_at_step(shard.sg):
            out[0] = self.store.weight_shards[index][lo - o:hi - o]  # stage 3: the weights are the shards
        else:
            self.sync.copy(shard.sg, self.sync._param, lo, hi, out[0], into_buffer=True)
        if shard.exp_avg is not None:
            out[1], out[2] = shard.exp_avg[lo - o:hi - o], shard.exp_avg_sq[lo - o:hi - o]
        return out

    @torch.no_grad()
    def load_masters(self, full) -> None:
        """Set the owned master shards (fp16/bf16) from ``full(name)`` -> full fp32 tensor; the module's
        weights are the caller's (``StageModel.load_full``)."""
        if self.mixed or self.link is not None:
            self._load(lambda shard, kind: shard.master, ["param"], lambda kind, name: full(name))

    @torch.no_grad()
    def load_moments(self, full_of, steps: int) -> None:
        """Set the owned moments from ``full_of(kind, name)`` (kind 'exp_avg' or 'exp_avg_sq') and the step
        count; ``steps`` 0: no moments yet (as before a first step)."""
        self.steps = steps
        for shard in self.shards:
            lo, hi = shard.sg.owned
            if steps > 0 and hi > lo:
                shard.exp_avg = torch.zeros(hi - lo, dtype=torch.float32, device=self._state_device)
                shard.exp_avg_sq = torch.zeros_like(shard.exp_avg)
            else:
                shard.exp_avg = shard.exp_avg_sq = None
        if steps > 0:
            self._load(lambda shard, kind: getattr(shard, kind), ["exp_avg", "exp_avg_sq"], full_of)

    def _load(self, target, kinds, full_of) -> None:
        """Copy each owned range of ``full_of(kind, name)`` (the region of each entry, flattened) into
        ``target(shard, kind)``."""
        for shard in self.shards:
            lo, hi = shard.sg.owned
            if hi <= lo:
                continue
            layout = shard.sg.layout
            i = layout.locate(lo)
            while i < len(layout.entries) and layout.entries[i].offset < hi:
                e = layout.entries[i]
                a, b = max(lo, e.offset), min(hi, e.offset + e.numel)
                for kind in kinds:
                    region = take_slice(full_of(kind, e.name), e.where).reshape(-1)
                    target(shard, kind)[a - lo:b - lo].copy_(region[a - e.offset:b - e.offset])
                i += 1


class _Batch:
    """Pieces of one AdamW call (one weight-decay setting)."""

    def __init__(self):
        self.clear()

    def clear(self) -> None:
        self.params, self.grads, self.exp_avgs, self.exp_avg_sqs, self.rounded = [], [], [], [], []
        self.numel = 0

    def add(self, param, grad, exp_avg, exp_avg_sq, rounded) -> None:
        self.params.append(param)
        self.grads.append(grad)
        self.exp_avgs.append(exp_avg)
        self.exp_avg_sqs.append(exp_avg_sq)
        self.rounded.append(rounded)
        self.numel += param.numel()
