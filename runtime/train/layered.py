"""ZeRO stages 2 and 3 with layered gradient accumulation (docs/cost-model.md, section 9, eq. 16-18).

At ``zero_stage`` 2 and 3 every replica is one stage (tensor parallelism inside it allowed) and runs its
micro-batches *layer by layer*, in the order ``baton.schedules.layer_by_layer`` states and the engine's interpreter
runs (``runtime.train.engine``), with this object's gathers, releases and reduce-scatters where the list puts them.
The parameters are cut into *units* (``baton.peers.unit_groups``): the edges (token
and position embedding, final LayerNorm; the tied head uses the token rows) and each layer. ``UnitShards``
keeps what a rank holds of each unit group (``runtime.train.replica_sync.SyncGroup`` with its ``unit``) and runs
the unit's collectives, each padded to equal chunks as at stage 1:

* the owner's *gradient shard* of every unit group (compute dtype, its owned elements, kept across steps):
  ``reduce_scatter(u)`` sums the holders' full gradients of unit ``u`` into it once the unit's backward has
  run over all micro-batches, then frees the unit's full gradients (``p.grad = None``): a rank holds its
  owned gradient shards, the edges' full gradient (alive from the head's backward to the embedding's; the
  position embedding's only from the embedding's backward, when no layer's is left) and one layer's full
  gradient (eq. 18's ``phi W + E + max(par - s h e, 0)``);
* at stage 3 the owner's *weight shard* of every unit group (compute dtype; in fp32 it is the master AdamW
  updates): between uses a layer's parameters keep their shapes but hold no memory. ``gather(u)`` gives the
  parameters their storage back and all-gathers the shards into it; ``release(u)`` frees the storage again.
  This is FSDP's way: the storage is resized to 0 bytes and back, and refilled through ``.data``, so
  autograd's saved references to a parameter (``F.linear`` keeps its weight) stay valid and its version
  counter is not bumped; a recomputed segment reads the parameter again in backward, after the gather.
  The edges are gathered once before the embedding's forward and released after the optimizer step; while
  they are whole their owned shard is part of them (no separate copy: eq. 18's ``E``), and releasing them
  cuts the owned shard out again.

The owners' AdamW step runs on the flat shards (``runtime.train.sharded_optimizer.ShardedAdamW`` with this object
as its ``store``); at stage 2 it is followed by the all-gather of the updated weights, unit by unit.

What it measured (``peak_weights_bytes``, ``peak_grads_bytes``): the largest sum, over the step, of the
storages of this rank's parameters plus weight shards, and of its parameters' gradients plus gradient shards,
read from the tensors at each gather and before each reduce-scatter frees a unit's gradients (where those
peaks fall).
"""
from __future__ import annotations

import time

import torch

from baton.peers import EDGES
from runtime.train.precision import storage_bytes
from runtime.train.replica_sync import ReplicaSync, SyncGroup, entry_spans


def unit_of_name(name: str) -> int | None:
    """The unit of a ``runtime.parallel.stage.StageModel`` parameter: its layer, or ``EDGES``."""
    return int(name.split(".")[1]) if name.startswith("h.") else EDGES


class UnitShards:
    """This rank's shards of its unit groups at stage 2 or 3, and the per-unit collectives (module docstring).
    Build it after the module has its compute dtype (``ShardedAdamW`` casts it)."""

    def __init__(self, sync: ReplicaSync, model: torch.nn.Module, *, zero_stage: int, measure: bool = True):
        assert zero_stage in (2, 3), zero_stage
        self.sync, self.model, self.zero_stage, self.measure = sync, model, zero_stage, measure
        self.named = dict(model.named_parameters())
        self.params = list(self.named.values())
        p0 = self.params[0]
        self.dtype, self.device = p0.dtype, p0.device
        self.unit_params: dict[int | None, list[torch.Tensor]] = {}
        for name, p in self.named.items():
            self.unit_params.setdefault(unit_of_name(name), []).append(p)
        self.groups: dict[int | None, list[SyncGroup]] = {}
        for sg in sync.mine:
            self.groups.setdefault(sg.unit, []).append(sg)
        assert set(self.groups) == set(self.unit_params), "every unit a rank holds has unit groups, and only those"
        self.units = [EDGES] + sorted(u for u in self.unit_params if u is not EDGES)
        self.full_nbytes = {id(p): p.numel() * p.element_size() for p in self.params}
        self.grad_shards = {sg.index: torch.zeros(sg.owned[1] - sg.owned[0], dtype=self.dtype, device=self.device)
                            for sg in sync.mine}
        """Owned gradient shards (flat, compute dtype), by group index."""
        self.weight_shards: dict[int, torch.Tensor | None] = {}
        """Stage 3: owned weight shards (flat, compute dtype), by group index (None while the unit's
        parameters are whole and the shard is part of them: the edges during a step)."""
        self.whole = set(self.unit_params)
        """Units whose parameters hold their full storage now."""
        self.clock = None
        """The engine's ``runtime.measure.meters.PhaseClock`` during a step: the collectives are timed on it (under
        ``("reduce", unit)`` and ``("gather", unit)``) and the engine adds the times to ``reduce_ms`` and
        ``gather_ms`` once it has read them; outside a step (validation) ``perf_counter`` adds them here."""
        if zero_stage == 3:
            for u in self.units:
                self.release(u)
        self.start_step()

    # --- bookkeeping ----------------------------------------------------------------------------------
    def start_step(self) -> None:
        """Reset the per-unit timers and the peaks (to what is held now)."""
        self.reduce_ms = {u: 0.0 for u in self.units}
        self.gather_ms = {u: 0.0 for u in self.units}
        self.peak_weights_bytes = self.peak_grads_bytes = 0
        self._measure_weights()
        self._measure_grads()

    def weights_bytes(self) -> int:
        """Bytes of the parameters' storages and the weight shards held now."""
        return storage_bytes(self.params) + sum(t.nbytes for t in self.weight_shards.values() if t is not None)

    def grads_bytes(self) -> int:
        """Bytes of the parameters' gradients and the gradient shards held now."""
        return storage_bytes(p.grad for p in self.params) + sum(t.nbytes for t in self.grad_shards.values())

    def _measure_weights(self) -> None:
        if self.measure:
            self.peak_weights_bytes = max(self.peak_weights_bytes, self.weights_bytes())

    def _measure_grads(self) -> None:
        if self.measure:
            self.peak_grads_bytes = max(self.peak_grads_bytes, self.grads_bytes())

    def _start(self):
        return self.clock.start() if self.clock is not None else time.perf_counter()

    def _stop(self, token, kind: str, unit) -> None:
        """No host wait for the device here: on CUDA the clock's events are read after the step's one read."""
        if self.clock is not None:
            self.clock.stop(token, (kind, unit))
        else:
            times = self.reduce_ms if kind == "reduce" else self.gather_ms
            times[unit] += (time.perf_counter() - token) * 1e3

    def whole_at_step(self, sg: SyncGroup) -> bool:
        """The optimizer updates this group's owned elements in the module's parameters (stage 2, and the
        edges at stage 3, which are whole until after the step), else in the flat weight shard."""
        return sg.unit in self.whole

    # --- gradients ------------------------------------------------------------------------------------
    def _grad_of(self, name: str) -> torch.Tensor:
        p = self.named[name]
        if p.grad is None:  # a parameter the step did not reach (none in this model; zeros to be safe)
            p.grad = torch.zeros_like(p)
        return p.grad

    def _grads_to(self, sg: SyncGroup, lo: int, hi: int, buf: torch.Tensor) -> None:
        self.sync.copy(sg, self._grad_of, lo, hi, buf, into_buffer=True)

    @torch.no_grad()
    def reduce_scatter(self, unit: int | None) -> None:
        """Sum the holders' gradients of ``unit`` into the owners' gradient shards (every holder divides
        by its ``copies``), then free the unit's full gradients."""
        self._measure_grads()
        t0 = self._start()
        for sg in self.groups[unit]:
            shard = self.grad_shards[sg.index]
            lo, hi = sg.owned
            if sg.process_group is None:  # the only holder: its gradient is the sum
                self._grads_to(sg, lo, hi, shard)
            else:
                mine = self.sync.reduce_scatter(sg, self._grads_to, self.dtype, self.device)
                shard.copy_(mine[:hi - lo])
        for p in self.unit_params[unit]:
            p.grad = None
        self._stop(t0, "reduce", unit)

    def norm_views(self) -> list[torch.Tensor]:
        """Views of the gradient shards this rank adds to the global norm: its owned share of each group's
        counted pieces (every element of the model once over all ranks), one per parameter region."""
        out = []
        for sg in self.sync.mine:
            lo, hi = sg.owned
            for a, b in sg.layout.counted:
                a, b = max(a, lo), min(b, hi)
                out += [self.grad_shards[sg.index][x - lo:y - lo] for _, x, y, _ in entry_spans(sg, a, b)]
        return out

    def all_finite(self) -> torch.Tensor:
        """No inf/NaN in this rank's gradient shards (after the reduce-scatters every holder's overflow has
        reached the owner of the element), as a device bool: the engine reads it with the step's one read."""
        flags = [torch.isfinite(t).all() for t in self.grad_shards.values() if t.numel()]
        return torch.stack(flags).all() if flags else torch.ones((), dtype=torch.bool, device=self.device)

    # --- weights (stage 3) ----------------------------------------------------------------------------
    @torch.no_grad()
    def gather(self, unit: int | None) -> None:
        """Give ``unit``'s parameters their storage back and all-gather the owners' weight shards into it."""
        if unit in self.whole:
            return
        t0 = self._start()
        for p in self.unit_params[unit]:
            p.untyped_storage().resize_(self.full_nbytes[id(p)])
        for sg in self.groups[unit]:
            lo, hi = sg.owned
            shard = self.weight_shards[sg.index]
            if sg.process_group is None:
                self.sync.copy(sg, self.sync._param, lo, hi, shard, into_buffer=False)
            else:
                self.sync.all_gather_weights(sg, lambda a, b, buf, shard=shard: buf.copy_(shard), self.dtype, self.device,
                                             own=True)
            if unit is EDGES:
                self.weight_shards[sg.index] = None  # the owned shard is part of the whole edges now
        self.whole.add(unit)
        self._stop(t0, "gather", unit)
        self._measure_weights()

    @torch.no_grad()
    def release(self, unit: int | None) -> None:
        """Free ``unit``'s parameter storage (stage 3), keeping the owned weight shards (cut out of the
        parameters first where they were part of them: the edges, and every unit at the start)."""
        if unit not in self.whole:
            return
        for sg in self.groups[unit]:
            if self.weight_shards.get(sg.index) is None:
                lo, hi = sg.owned
                shard = torch.empty(hi - lo, dtype=self.dtype, device=self.device)
                self.sync.copy(sg, self.sync._param, lo, hi, shard, into_buffer=True)
                self.weight_shards[sg.index] = shard
        for p in self.unit_params[unit]:
            p.untyped_storage().resize_(0)
        self.whole.discard(unit)

    def gathered(self):
        """Context: every unit whole (stage 3: gathered, then released again), e.g. for validation."""
        from contextlib import contextmanager

        @contextmanager
        def ctx():
            before = set(self.whole)
            for u in self.units:
                self.gather(u)
            try:
                yield
            finally:
                for u in self.units:
                    if u not in before:
                        self.release(u)
        return ctx()

    @torch.no_grad()
    def load_weights(self, full) -> None:
        """Stage 3, between steps: set the owned weight shards from ``full(name)`` -> full fp32 tensor
        (rounded to the compute dtype)."""
        from runtime.parallel.slicing import take_slice

        for sg in self.sync.mine:
            lo, hi = sg.owned
            shard = self.weight_shards[sg.index]
            for _, a, b, e in entry_spans(sg, lo, hi):
                region = take_slice(full(e.name), e.where).reshape(-1)
                shard[a - lo:b - lo].copy_(region[a - e.offset:b - e.offset])
