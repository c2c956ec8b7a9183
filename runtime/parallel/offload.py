"""Activation offload: tensors a layer holds from its forward to its backward kept in host memory in between.

Besides keeping a held tensor on the device or recomputing it, a plan may *offload* it (Cephalo does this
for layer-boundary activations, ZeRO-Offload and Mist for others): the forward copies it to host memory and
drops the device copy, and the backward copies it back just before the operator that needs it. The names are
those of ``baton.memory.tensor_roles``; ``ParallelBlock`` decides which tensor is which and calls this module.

``OffloadStash`` (one per stage, shared by its layers) holds the host copies of every micro-batch in flight:

* a *storage* is the unit of what is stored. Tensors of one storage (fused attention's q, k and v, views of
  one qkv output) are stored once and come back as views with their strides and offsets, so the backward reads
  the very bytes, in the very layout, that it would have read on the device;
* a *layer* is the unit of a copy (``LayerCopy``): its storages are gathered during its forward and copied at
  its end (``flush``) into one host buffer, each at an aligned offset, and brought back by one copy into one
  device buffer that their views share. The host's bookkeeping per copy (a stream switch, a wait, an event) is
  then paid per layer, not per storage: per storage it was the step's bottleneck on a GPU;
* on CUDA the copies run on a side stream: a device-to-host copy waits for the kernels launched before it
  (``wait_stream``), and the device storages stay referenced until the copy's event has completed (polled
  with ``Event.query``, never waited for), then are dropped, so the allocator really gets them back. Host
  buffers are pinned and come from ``HostPool``, which keeps them across micro-batches and steps (pinning
  memory at every step is slow). ``prefetch`` issues the host-to-device copy ahead of the backward that
  needs it; the first read of it on a stream makes that stream wait for the copy's event, the host never waits;
* in a CPU process the same code runs with plain host buffers and no streams (copies are host to host), so
  the bookkeeping and the numerics are testable anywhere.

Accounting (for comparison with the cost model, ``baton.memory.tensor_bytes``): ``held_bytes(key)`` host
bytes a micro-batch holds now, ``held_by_tensor`` the same by tensor name, ``peak_held_bytes`` their peak sum
over micro-batches in flight, ``copied_out_bytes``/``copied_in_bytes`` per step (``reset``), and
``late_bytes``: bytes copied in only when the backward asked for them (not prefetched).
"""
from __future__ import annotations

from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from baton.memory import offload_problem
from baton.model_spec import ModelSpec

def check_offload(spec: ModelSpec, recompute: frozenset[str], offload: frozenset[str]) -> None:
    """Raise ``ValueError`` for an offload set a layer of ``spec`` under ``recompute`` cannot honour exactly
    (``baton.memory.offload_problem``, the rule plan validation applies)."""
    problem = offload_problem(spec, frozenset(recompute), frozenset(offload))
    if problem:
        raise ValueError(f"offload names {problem}")


class HostPool:
    """Host buffers (flat uint8) by size in bytes, kept for reuse; pinned when ``pin`` (for CUDA copies)."""

    def __init__(self, pin: bool):
        self.pin = pin
        self.allocations = 0
        """Buffers allocated since the pool was made (a step in steady state adds none)."""
        self.allocated_bytes = 0
        """Bytes of those buffers."""
        self._free: dict[int, list[torch.Tensor]] = {}

    def take(self, nbytes: int) -> torch.Tensor:
        free = self._free.get(nbytes)
        if free:
            return free.pop()
        self.allocations += 1
        self.allocated_bytes += nbytes
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)

    def give(self, buf: torch.Tensor) -> None:
        self._free.setdefault(buf.numel(), []).append(buf)


COPY_ALIGN_BYTES = 512
"""Alignment of each storage within a layer's copy: the byte offset of every part is a multiple of it, so any
element type lies aligned in the buffers and the restored views keep the alignment fused kernels ask for."""


@dataclass(eq=False)
class Stored:
    """One device storage copied to the host: its part of a layer's copy (``LayerCopy``)."""

    names: tuple[str, ...]
    """Tensor names whose bytes it holds (q, k, v for fused attention's qkv; a private tensor's name)."""
    nbytes: int
    """Bytes of the storage (what the cost model counts; its part of the layer's buffers is padded)."""
    layer: "LayerCopy"
    """The layer's copy it is part of."""
    offset: int = 0
    """Byte offset of its part in the layer's host buffer and in the restored device buffer."""
    uses: int = 0
    """Reads the backward has still to make (saved-tensor unpacks, segment replays)."""

    @property
    def host(self) -> torch.Tensor:
        """Its bytes in the layer's host buffer (after ``OffloadStash.flush``)."""
        return self.layer.host[self.offset:self.offset + self.nbytes]


@dataclass(eq=False)
class LayerCopy:
    """What one layer offloaded for one micro-batch, copied as one: the forward gathers the storages and
    ``OffloadStash.flush`` copies them at the layer's end into one pinned buffer behind one event; the backward
    brings the whole buffer back with one copy into one device buffer, read by every part. Per storage the host
    then does a slice and a copy call, not a stream switch, a wait and an event each: with a few thousand
    storages a step, that bookkeeping was the step's bottleneck on a GPU (about 0.15 ms a storage)."""

    device: torch.device | None = None
    """Where the storages came from and go back to (set by the first ``store``)."""
    stored: dict[str, Stored] = field(default_factory=dict)
    """Label -> its storages' parts."""
    pending: list = field(default_factory=list)
    """(part, flat device storage) stored since the last flush, not yet copied."""
    nbytes: int = 0
    """Bytes of the buffers: the parts, each padded to ``COPY_ALIGN_BYTES``. The stash's accounting (``held_bytes``,
    the peak, the bytes copied) counts the parts' own bytes, as eq. 8o does; the padding, under 512 bytes a
    storage, is not counted."""
    host: torch.Tensor | None = None
    """Flat uint8 host buffer (pinned for CUDA), from ``HostPool``."""
    restored: torch.Tensor | None = None
    """Flat uint8 device copy brought back (prefetched or on demand), until the parts' last read."""
    ready: object = None
    """CUDA event: the copy into ``restored`` is complete (None on CPU)."""
    reader: int | None = None
    """The stream (``cuda_stream`` handle) made to wait for ``ready`` already: one wait per stream and copy."""

    def in_use(self) -> bool:
        return any(s.uses > 0 for s in self.stored.values())


@dataclass(frozen=True, slots=True)
class View:
    """How a tensor lies in its storage, to rebuild it on the restored copy."""

    dtype: torch.dtype
    """Element type."""
    size: tuple[int, ...]
    """Shape."""
    stride: tuple[int, ...]
    """Strides in elements (a transposed view keeps its transposed strides)."""
    offset: int
    """Storage offset, in elements of ``dtype``."""

    @staticmethod
    def of(t: torch.Tensor) -> "View":
        return View(t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset())


class OffloadStash:
    """Host copies of the held tensors of a stage's micro-batches in flight (see the module docstring).

    The engine wraps a micro-batch's forward in ``record(key)`` (as ``SavedBytes.record``), may call
    ``prefetch(key, layer)`` ahead of a layer's backward, and calls ``release(key)`` after the micro-batch's
    backward; ``reset`` starts a step's counters. A layer's forward ends with ``flush`` (its copies start) and
    its backward prefetches the layer below it itself (``prefetch_ahead``)."""

    def __init__(self):
        self.current = None
        """The micro-batch key of the forward running now (``record``)."""
        self.copied_out_bytes = 0
        """Bytes copied device to host since ``reset``."""
        self.copied_in_bytes = 0
        """Bytes copied host to device since ``reset``."""
        self.late_bytes = 0
        """Of ``copied_in_bytes``, those copied when the backward read them (not prefetched): on CUDA the
        backward waits for them."""
        self.peak_held_bytes = 0
        """Peak of host bytes held, over all micro-batches in flight, since ``reset``."""
        self.pools = {False: HostPool(pin=False), True: HostPool(pin=True)}
        """Host buffers by pinned-ness (pinned for CUDA tensors)."""
        self._groups: dict[object, dict[int, LayerCopy]] = {}  # key -> layer (forward order) -> its copy
        self._unflushed: list[LayerCopy] = []
        self._held_now = 0  # host bytes of every group, kept as a sum: a step makes thousands of copies
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._in_flight: deque = deque()  # (device storages, event): device-to-host copies not known complete

    # --- forward ------------------------------------------------------------------------------------
    @contextmanager
    def record(self, key):
        """A micro-batch's forward: what its layers offload is kept under ``key`` until ``release(key)``."""
        self.current = key
        try:
            yield
        finally:
            self.current = None

    def begin(self, layer: int):
        """A layer's forward starts: the key of the micro-batch it runs (an error outside ``record``, or when that
        micro-batch's copies of the layer were never released: they would be taken for the new ones)."""
        if self.current is None:
            raise RuntimeError("an offloading layer ran its forward outside OffloadStash.record(key): the stash "
                               "cannot tell which micro-batch its tensors belong to")
        layers = self._groups.setdefault(self.current, {})
        if layer in layers:
            raise RuntimeError(f"layer {layer} of micro-batch {self.current!r} ran its forward again before "
                               "OffloadStash.release of the previous one")
        layers[layer] = LayerCopy()
        self._unflushed.append(layers[layer])
        return self.current

    def store(self, key, layer: int, label: str, names: tuple[str, ...], t: torch.Tensor) -> Stored:
        """``t``'s whole storage under ``label``, to be copied to the host at the layer's ``flush`` (once per layer
        and micro-batch); its device storage stays referenced until that copy is done."""
        copy = self._groups[key][layer]
        copy.device = t.device
        if label in copy.stored:
            return copy.stored[label]
        flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())  # every byte of it
        stored = copy.stored[label] = Stored(names=names, nbytes=flat.numel(), layer=copy, offset=copy.nbytes)
        copy.nbytes += -(-stored.nbytes // COPY_ALIGN_BYTES) * COPY_ALIGN_BYTES
        copy.pending.append((stored, flat))
        self.copied_out_bytes += stored.nbytes
        self._held_now += stored.nbytes
        self.peak_held_bytes = max(self.peak_held_bytes, self._held_now)
        return stored

    def flush(self) -> None:
        """Copy what the layers stored since the last flush to the host: per layer one pinned buffer and, on CUDA,
        one stream switch, one wait for the kernels launched so far and one event."""
        for copy in self._unflushed:
            if not copy.pending:
                continue
            if copy.host is not None:
                raise RuntimeError("a layer stored tensors after its copy to the host was made")
            copy.host = self.pools[copy.device.type == "cuda"].take(copy.nbytes)
            stream = self._stream(copy.device)
            if stream is None:
                for stored, flat in copy.pending:
                    stored.host.copy_(flat)
            else:
                # After the kernels that made them; the device storages stay referenced until the copy is done.
                stream.wait_stream(torch.cuda.current_stream(copy.device))
                with torch.cuda.stream(stream):
                    for stored, flat in copy.pending:
                        stored.host.copy_(flat, non_blocking=True)
                done = torch.cuda.Event()
                done.record(stream)
                self._in_flight.append(([flat for _, flat in copy.pending], done))
            copy.pending = []
        self._unflushed = []
        self.reap()

    def reap(self) -> None:
        """Drop the device storages whose copy to the host has completed (polled: the host does not wait)."""
        while self._in_flight and self._in_flight[0][1].query():
            self._in_flight.popleft()

    # --- backward -----------------------------------------------------------------------------------
    def prefetch(self, key, layer: int) -> None:
        """Start copying back what ``layer`` of micro-batch ``key`` offloaded (nothing if already under way)."""
        copy = self._groups.get(key, {}).get(layer)
        if copy is not None and copy.restored is None and copy.in_use():
            self._copy_in(copy)
            self.reap()

    def prefetch_ahead(self, key, layer: int) -> None:
        """A layer's backward starts: its own tensors (if not yet under way) and those of the layer before it
        in the forward, whose backward comes next."""
        self.prefetch(key, layer)
        layers = list(self._groups.get(key, {}))
        if layer in layers and layers.index(layer) > 0:
            self.prefetch(key, layers[layers.index(layer) - 1])

    def read(self, stored: Stored, view: View) -> torch.Tensor:
        """The tensor ``view`` of ``stored`` on its device: from the prefetched copy, else copied back now."""
        copy = stored.layer
        if copy.restored is None:
            self._copy_in(copy)
            self.late_bytes += sum(s.nbytes for s in copy.stored.values())
        dev = copy.restored
        if copy.ready is not None:
            stream = torch.cuda.current_stream(dev.device)
            if copy.reader != stream.cuda_stream:
                stream.wait_event(copy.ready)
                dev.record_stream(stream)  # allocated on the copy stream, read on this one
                copy.reader = stream.cuda_stream
        offset = stored.offset // view.dtype.itemsize + view.offset
        t = torch.empty(0, dtype=view.dtype, device=dev.device).set_(dev.untyped_storage(), offset, view.size, view.stride)
        stored.uses -= 1
        if not copy.in_use():  # the last read of the layer's parts: the device copy goes with the views
            copy.restored, copy.ready, copy.reader = None, None, None
        return t

    def _copy_in(self, copy: LayerCopy) -> None:
        if copy.pending:
            self.flush()
        stream = self._stream(copy.device)
        if stream is None:
            copy.restored = copy.host.clone()
        else:
            # The copy to the host ran on this stream before, so no wait is needed for the buffer.
            with torch.cuda.stream(stream):
                dev = torch.empty(copy.nbytes, dtype=torch.uint8, device=copy.device)
                dev.copy_(copy.host, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(stream)
            copy.restored, copy.ready, copy.reader = dev, ready, None
        self.copied_in_bytes += sum(s.nbytes for s in copy.stored.values())

    def release(self, key) -> None:
        """Micro-batch ``key``'s backward is done: its host buffers go back to the pool."""
        copies = list(self._groups.pop(key, {}).values())
        for copy in copies:
            for stored in copy.stored.values():
                self._held_now -= stored.nbytes
            if copy.host is not None:
                self.pools[copy.host.is_pinned()].give(copy.host)
        if self._unflushed:  # a forward that failed before its layer's flush
            self._unflushed = [c for c in self._unflushed if all(c is not r for r in copies)]
        self.reap()

    # --- accounting ---------------------------------------------------------------------------------
    def held_bytes(self, key=None) -> int:
        """Host bytes micro-batch ``key`` holds (all micro-batches in flight when None)."""
        keys = list(self._groups) if key is None else [key]
        return sum(s.nbytes for k in keys for c in self._groups.get(k, {}).values() for s in c.stored.values())

    def held_by_tensor(self, key, layer: int | None = None) -> dict[str, int]:
        """Host bytes of micro-batch ``key`` (one layer, or all) by tensor name; a storage of several names
        (fused q, k, v) under their names joined by '+'."""
        out: dict[str, int] = {}
        for lay, copy in self._groups.get(key, {}).items():
            if layer is None or lay == layer:
                for s in copy.stored.values():
                    name = "+".join(s.names)
                    out[name] = out.get(name, 0) + s.nbytes
        return out

    @property
    def host_buffers_allocated(self) -> int:
        """Host buffers allocated so far (pinned or not): constant once the pool has what a step needs."""
        return sum(p.allocations for p in self.pools.values())

    def reset(self) -> None:
        """A step begins: per-step counters back to 0 (the peak restarts at what is held now)."""
        self.copied_out_bytes = self.copied_in_bytes = self.late_bytes = 0
        self.peak_held_bytes = self._held_now

    def _stream(self, device: torch.device):
        """The side copy stream of a CUDA device; None for host tensors (copies are plain host copies)."""
        if device.type != "cuda":
            return None
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]


class SavedHandle:
    """What autograd keeps for one tensor an offloading layer's kept operator saves: the tensor itself (not
    offloaded), or where its bytes lie on the host."""

    __slots__ = ("tensor", "stash", "stored", "view")

    def __init__(self, t: torch.Tensor):
        self.tensor = t
        self.stash = self.stored = self.view = None

    def offload(self, stash: OffloadStash, stored: Stored) -> None:
        self.stash, self.stored, self.view = stash, stored, View.of(self.tensor)
        stored.uses += 1
        self.tensor = None  # the device tensor is no longer referenced from the graph

    def unpack(self) -> torch.Tensor:
        return self.tensor if self.stored is None else self.stash.read(self.stored, self.view)


class SegmentFeed:
    """Offloaded inputs of one recomputed segment, handed to its checkpointed function beside the positional
    inputs (the checkpoint keeps positional inputs alive on the device): the device tensors for the forward
    call, then, for the replay in the backward, copies read back from the host (detached, with the
    original's ``requires_grad``, so the replay saves what the forward saved)."""

    def __init__(self, stash: OffloadStash, live: dict[str, torch.Tensor], stored: dict[str, Stored]):
        self.stash = stash
        self.live: dict[str, torch.Tensor] | None = live
        self.parts = {n: (stored[n], View.of(t), t.requires_grad) for n, t in live.items()}
        for s, _, _ in self.parts.values():
            s.uses += 1

    def take(self) -> dict[str, torch.Tensor]:
        if self.live is not None:  # the forward: once, then the device tensors are let go
            live, self.live = self.live, None
            return live
        return {n: self.stash.read(s, view).detach().requires_grad_(rg) for n, (s, view, rg) in self.parts.items()}


def offloaded_of(names: tuple[str, ...], offload: frozenset[str], held: frozenset[str]) -> tuple[str, ...]:
    """Which of ``names`` (tensors of one storage) are offloaded: none, or every held one (a storage is copied
    whole and freed whole, so it cannot stay on the device for one name and leave it for another). Names not
    held may share it (alone in a TP group, an all-reduce's result is its partial sum)."""
    off = tuple(n for n in names if n in offload)
    kept = [n for n in names if n in held and n not in offload]
    if off and kept:
        raise RuntimeError(f"{'+'.join(names)} share one storage but only {list(off)} are offloaded")
    return off


def storage_names(env: dict[str, torch.Tensor]) -> dict[int, tuple[str, ...]]:
    """Storage address -> names of the tensors of ``env`` lying in it (several for views of one storage)."""
    out: dict[int, tuple[str, ...]] = {}
    for name, t in env.items():
        s = t.untyped_storage()
        if s.nbytes() > 0:
            out[s.data_ptr()] = out.get(s.data_ptr(), ()) + (name,)
    return out


class OpCapture:
    """Saved-tensor hooks around one kept operator of an offloading layer.

    While the operator runs, each tensor it saves is packed into a ``SavedHandle`` still holding it (its own
    outputs are not known yet). ``resolve`` then names each saved tensor and offloads those named in
    ``offload``:
      * a tensor in the storage of an entry of ``env`` or of the operator's outputs has that entry's names
        (views count: ``k.transpose(-2, -1)`` saved by the scores' product is k);
      * the rest (not parameters) are the operator's private tensors (LayerNorm's mean and rstd, a dropout's
        boolean mask, the fused kernel's log-sum-exp) or a copy it made of an input (eager ``out_proj``
        keeps its (B, T, nl hs) copy of ctx): they take the one name of ``op.saves`` not matched by a storage,
        when there is exactly one; a storage of several such tensors (mean and rstd) is one copy each;
      * a tensor left unnamed is kept on the device, unless its candidate names are offloaded: an error.
    Tensors kept on the device are passed on to ``count`` (the ``SavedBytes`` meter's ``add``: these hooks,
    the innermost, hide them from its own)."""

    def __init__(self, stash: OffloadStash, key, layer: int, op, env: dict, offload: frozenset[str],
                 held: frozenset[str], param_ptrs: set[int], count=None):
        self.stash, self.key, self.layer, self.op = stash, key, layer, op
        self.env, self.offload, self.held, self.param_ptrs, self.count = env, offload, held, param_ptrs, count
        self.handles: list[SavedHandle] = []

    @contextmanager
    def hooks(self):
        handles = self.handles

        # Autograd keeps the pack hook as long as the saved tensor: a closure over the list alone, so that the
        # capture (and the layer's env, with every device tensor of the forward) is not kept with it.
        def pack(t: torch.Tensor) -> SavedHandle:
            handles.append(SavedHandle(t))
            return handles[-1]

        with torch.autograd.graph.saved_tensors_hooks(pack, SavedHandle.unpack):
            yield self

    def resolve(self, outputs: dict[str, torch.Tensor]) -> None:
        names_of = storage_names({**self.env, **outputs})
        named: list[tuple[SavedHandle, str, tuple[str, ...]]] = []
        unnamed: list[SavedHandle] = []
        matched: set[str] = set()
        for h in self.handles:
            s = h.tensor.untyped_storage()
            if s.nbytes() == 0 or s.data_ptr() in self.param_ptrs:
                continue
            names = names_of.get(s.data_ptr())
            if names is None:
                unnamed.append(h)
            else:
                matched.update(names)
                named.append((h, None, names))
        left = [n for n in self.op.saves if n not in matched]
        if unnamed and len(left) == 1:
            private: dict[int, str] = {}
            for h in unnamed:
                ptr = h.tensor.untyped_storage().data_ptr()
                label = private.setdefault(ptr, f"{left[0]}#{len(private)}")
                named.append((h, label, (left[0],)))
            unnamed = []
        elif unnamed and self.offload & set(left):
            raise RuntimeError(f"{self.op.name} saved {len(unnamed)} tensors that are no entry of the layer and could "
                               f"be any of {left}; cannot tell which to offload")
        for h, label, names in named:
            off = offloaded_of(names, self.offload, self.held)
            if off:
                h.offload(self.stash, self.stash.store(self.key, self.layer, label or "+".join(off), off, h.tensor))
            elif self.count is not None:
                self.count(h.tensor)
        if self.count is not None:
            for h in unnamed:
                self.count(h.tensor)
        self.handles.clear()


def prefetch_hook(stash: OffloadStash, key, layer: int, grad: torch.Tensor) -> None:
    """A tensor hook on a layer's output: its backward starts now (see ``OffloadStash.prefetch_ahead``)."""
    stash.prefetch_ahead(key, layer)
