"""Gradient synchronisation across data-parallel replicas of any shapes, over ``baton.peers``' peer groups
(docs/cost-model.md, section 9).

A peer group is a set of devices that hold the same pieces of the parameters (``baton.peers.Block``); for
replicas of one shape it is one (stage, TP rank) position across the replicas. Every rank runs the
collectives of its groups one after another in ``peer_groups`` order (the order is global, so no two
ranks wait on each other in a cycle), after the tied embedding's gradients were summed inside each
replica:

* ``zero_stage`` 0: one all-reduce of the group's gradients (each holder adds its gradient divided by
  ``copies``), in place on the rank's flat gradient buffer when the group is all it holds (replicas of one
  shape), else through a staging buffer of the group's size.
* ``zero_stage`` 2 and 3: the groups are ``baton.peers.unit_groups`` (``sync_groups``), one per unit and
  holder set; ``runtime.train.layered`` runs their reduce-scatters (``reduce_scatter``) and all-gathers
  (``all_gather_weights``) unit by unit, in the same padded layout as stage 1.
* ``zero_stage`` 1: a reduce-scatter of the (scaled) gradients to the holders' owned shards
  (``group_shard_sizes``; the input is n chunks each padded to the largest shard, the layout the cost
  model charges, since collectives take equal chunks) written back into the owner's gradients; after the
  optimizer step (``runtime.train.sharded_optimizer``) an all-gather of the updated weights in the same padded
  layout, copied into every holder's parameters. Staging: the n padded chunks and one chunk, (n + 1) x the
  largest shard, alive only while the group syncs (eq. 14).

The group's parameters as one flat vector (``Layout``): its pieces in ``baton.peers`` order, each piece the
regions of full tensors ``runtime.parallel.slicing.block_slices`` lists, flattened row-major; a holder finds each
region in its local tensors with ``runtime.parallel.slicing.local_region`` (a row range of the embedding, a head
range of q, k and v, a column range of a row-parallel weight). When every holder holds exactly the group's
parameters (replicas of one shape), the flat vector is instead the holder's whole flat gradient buffer,
its tensors in module order, so stage 0's all-reduce runs on that buffer without copies (stage 1 stages
its padded chunks in every case).

The global gradient norm counts every element of the model once over all ranks: each piece is counted in
the first group that holds it (``Layout.counted``), at stage 0 by the group's first holder (all holders
have the same sum), at stage 1 by the owner of the element (only it has the sum).
"""
from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass

import torch
import torch.distributed as dist

from baton.operators import padded_vocab
from baton.peers import EDGES, PeerGroup, group_shard_sizes, peer_groups, unit_groups, whole_groups
from runtime.model.family import parameter_shapes
from runtime.train.optim_settings import decays
from runtime.parallel.slicing import block_slices, local_region, parameter_slice, region_shape

# gloo and NCCL both take equal chunks; newer torch names the two collectives *_single.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True, slots=True)
class Entry:
    """One region of one full parameter in a group's flat vector."""

    name: str
    """Parameter name (``runtime.model.gpt``)."""
    where: object
    """The region of the full tensor (``runtime.parallel.slicing.parameter_slice`` format; None: all of it)."""
    shape: tuple[int, ...]
    """Shape of the region (its elements lie row-major in the flat vector)."""
    offset: int
    """First element in the flat vector."""
    numel: int
    decays: bool
    """Takes weight decay (``runtime.train.optim_settings.decays``)."""


@dataclass(frozen=True, slots=True)
class Layout:
    """A peer group's parameters as one flat vector: the same on every holder, computed the same on every rank."""

    entries: tuple[Entry, ...]
    numel: int
    whole: bool
    """Every holder holds exactly these parameters: the entries are its local tensors in module order, and
    the flat vector is its flat gradient buffer."""
    counted: tuple[tuple[int, int], ...]
    """Flat ranges of the pieces no earlier group holds: counted in the gradient norm and written to checkpoints."""
    starts: tuple[int, ...] = ()
    """Each entry's offset (for ``locate``)."""

    def locate(self, lo: int) -> int:
        """Index of the entry holding flat element ``lo``."""
        return max(0, bisect_right(self.starts, lo) - 1)


def stage_parameter_names(spec, *, layers, first: bool, last: bool) -> list[str]:
    """The parameters a rank of a stage holds, in its module's order (``runtime.parallel.stage.StageModel``)."""
    names = []
    for name in parameter_shapes(spec):
        if name.startswith("wte."):
            keep = first or (last and spec.tie_embeddings)
        elif name.startswith("lm_head."):
            keep = last
        elif name.startswith("wpe."):
            keep = first
        elif name.startswith("ln_f."):
            keep = last
        else:
            keep = int(name.split(".")[1]) in layers
        if keep:
            names.append(name)
    return names


def _merge(ranges) -> tuple[tuple[int, int], ...]:
    out: list[list[int]] = []
    for a, b in sorted(r for r in ranges if r[1] > r[0]):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return tuple((a, b) for a, b in out)


def _region_ranges(entry: Entry, region) -> list[tuple[int, int]]:
    """Flat ranges of ``region`` ((dim, start, length) of the entry's tensor, or None: all of it)."""
    if region is None:
        return [(entry.offset, entry.offset + entry.numel)]
    dim, start, length = region
    if dim == 0:
        row = math.prod(entry.shape[1:])
        return [(entry.offset + start * row, entry.offset + (start + length) * row)]
    rows, cols = entry.shape
    return [(entry.offset + r * cols + start, entry.offset + r * cols + start + length) for r in range(rows)]


def group_layouts(plan, topo, groups=None) -> tuple[Layout, ...]:
    """The flat layout of every peer group of ``plan`` (``topo``: its ``runtime.parallel.topology.Topology``), or of
    ``groups`` (``sync_groups``: at stages 2 and 3 the unit groups, none of them whole)."""
    spec, shapes = plan.model, parameter_shapes(plan.model)
    first_group: dict = {}
    if groups is None:
        groups, wholes = peer_groups(plan), whole_groups(plan)
    else:
        wholes = (False,) * len(groups)
    for gi, g in enumerate(groups):
        for b in g.blocks:
            first_group.setdefault((b.part, b.layer, b.lo, b.hi), gi)
    out = []
    for gi, g in enumerate(groups):
        counted_blocks = [b for b in g.blocks if first_group[(b.part, b.layer, b.lo, b.hi)] == gi]
        entries: list[Entry] = []

        def add(name, where):
            # The embedding as the ranks hold it: rows of the padded vocabulary (runtime.parallel.slicing).
            full = (padded_vocab(spec), spec.hidden_dim) if name in ("wte.weight", "lm_head.weight") else shapes[name]
            shape = region_shape(full, where)
            offset = entries[-1].offset + entries[-1].numel if entries else 0
            entries.append(Entry(name=name, where=where, shape=shape, offset=offset, numel=math.prod(shape),
                                 decays=decays(name)))

        whole = wholes[gi]
        if whole:
            pos = topo.position(topo.rank_of[g.holders[0]])
            for name in stage_parameter_names(spec, layers=topo.layers(pos), first=pos.first, last=pos.last):
                add(name, parameter_slice(spec, name, pos.heads, pos.ffn_cols))
            by_name = {e.name: e for e in entries}
            counted = [r for b in counted_blocks for name, where in block_slices(spec, b)
                       for r in _region_ranges(by_name[name], local_region(by_name[name].where, where))]
        else:
            counted = []
            for b in g.blocks:
                start = entries[-1].offset + entries[-1].numel if entries else 0
                for name, where in block_slices(spec, b):
                    add(name, where)
                if b in counted_blocks:
                    counted.append((start, entries[-1].offset + entries[-1].numel))
        numel = entries[-1].offset + entries[-1].numel
        assert numel == g.num_params, f"group {gi}: layout of {numel} elements, peers count {g.num_params}"
        out.append(Layout(entries=tuple(entries), numel=numel, whole=whole, counted=_merge(counted),
                          starts=tuple(e.offset for e in entries)))
    return tuple(out)


def sync_groups(plan) -> tuple[PeerGroup, ...]:
    """The groups whose collectives the runtime runs, in order: ``peer_groups`` at stages 0 and 1; at stages 2
    and 3 the unit groups (``baton.peers.unit_groups``: the edges, then layer 0, 1, ..., each unit's groups in
    ``peer_groups`` order), one collective per unit group."""
    if plan.zero_stage >= 2:
        return tuple(g for _, gs in unit_groups(plan) for g in gs)
    return peer_groups(plan)


def unit_of(group: PeerGroup) -> int | None:
    """The unit a unit group belongs to: its layer, or ``EDGES`` (None)."""
    return group.blocks[0].layer


def flat_pieces(view: torch.Tensor, a: int, b: int) -> list[torch.Tensor]:
    """Views whose elements, each row-major, are elements [a, b) of ``view`` in row-major order: one view for
    a contiguous tensor, else (a column range of a matrix) a partial row, whole rows, a partial row."""
    if view.is_contiguous():
        return [view.view(-1)[a:b]]
    assert view.dim() == 2, f"a non-contiguous region of {view.dim()} dimensions"
    cols = view.size(1)
    (r0, c0), (r1, c1) = divmod(a, cols), divmod(b, cols)
    if r0 == r1:
        return [view[r0, c0:c1]]
    out = []
    if c0:
        out.append(view[r0, c0:])
        r0 += 1
    if r1 > r0:
        out.append(view[r0:r1])
    if c1:
        out.append(view[r1, :c1])
    return out


@dataclass(kw_only=True, slots=True)
class SyncGroup:
    """One peer group as this rank sees it."""

    index: int
    """Position in ``peer_groups(plan)``."""
    group: PeerGroup
    layout: Layout
    ranks: tuple[int, ...]
    """Global ranks of the holders (ascending: chunk k of a collective belongs to holder k)."""
    me: int
    """This rank's index among the holders."""
    copies: int
    """This rank adds its gradient divided by this."""
    process_group: object
    """The holders' process group (None for a single holder)."""
    shards: tuple[int, ...]
    """Stage 1: flat elements each holder owns; stage 0: the whole vector for the first holder (the one
    that counts it in the norm and saves it), none for the others."""
    offsets: tuple[int, ...]
    regions: list
    """Per entry, where it lies in this rank's local tensor (``local_region``)."""
    unit: int | None = EDGES
    """Stages 2 and 3: the unit (layer, or ``EDGES``) of this unit group."""

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def largest(self) -> int:
        return max(self.shards)

    @property
    def owned(self) -> tuple[int, int]:
        """This rank's flat range [lo, hi)."""
        return self.offsets[self.me], self.offsets[self.me] + self.shards[self.me]


def group_owners(plan, group: PeerGroup, numel: int) -> tuple[int, ...]:
    """Flat elements of the group each holder keeps the optimizer state of (stage 1), or, at stage 0, the
    whole vector for the first holder and nothing for the others (who holds what the norm and checkpoints read)."""
    if plan.zero_stage >= 1:
        return group_shard_sizes(plan, group)
    return (numel,) + (0,) * (group.size - 1)


def entry_spans(sg: SyncGroup, lo: int, hi: int) -> list[tuple[int, int, int, Entry]]:
    """(entry index, a, b, entry): flat elements [lo, hi) of ``sg`` cut at its entries (one parameter region
    each)."""
    out, entries = [], sg.layout.entries
    i = sg.layout.locate(lo) if hi > lo else len(entries)
    while i < len(entries) and entries[i].offset < hi:
        e = entries[i]
        a, b = max(lo, e.offset), min(hi, e.offset + e.numel)
        if a < b:
            out.append((i, a, b, e))
        i += 1
    return out


@torch.no_grad()
def padded_reduce_scatter(offsets, shards, fill, *, copies: int, group, dtype, device) -> torch.Tensor:
    """One reduce-scatter of a flat vector whose holders own ``shards`` elements from ``offsets``: every
    holder's pieces are staged into n chunks padded to the largest shard (collectives take equal chunks;
    ``fill(lo, hi, buf)`` copies this rank's elements [lo, hi) into ``buf``), divided by ``copies``, and
    reduce-scattered. Returns this rank's chunk (the largest shard's size, its owned elements first).

    The sharded sync's reduce-scatter as the runtime makes it, which ``runtime.measure.comm_profiler`` times for
    the link's measured pass figures (eq. 13/16 charge the pass with its staging)."""
    n, S = len(shards), max(shards)
    # Always the padded staging, even for equal shards whose input could be the gradient buffer itself:
    # it is what eq. 14 charges (n + 1 chunks), and one rule keeps memory predictable across ratios.
    chunks = torch.empty(n * S, dtype=dtype, device=device)
    for k, (o, s) in enumerate(zip(offsets, shards)):
        fill(o, o + s, chunks[k * S:k * S + s])
        chunks[k * S + s:(k + 1) * S].zero_()
    if copies != 1:
        chunks.div_(copies)
    mine = torch.empty(S, dtype=chunks.dtype, device=chunks.device)
    _reduce_scatter(mine, chunks, group=group)
    return mine


@torch.no_grad()
def padded_all_gather(offsets, shards, me: int, fill, place, *, group, dtype, device, skip: int | None = None) -> None:
    """The all-gather back: this rank's (holder ``me``'s) elements, staged with ``fill(lo, hi, buf)`` into one
    chunk padded to the largest shard, to every holder in n such chunks, each holder's elements then copied
    out with ``place(lo, hi, buf)`` (holder ``skip``'s not: this rank's own, when they are in place already).
    Timed as it is for the link's pass figures, staging included."""
    n, S = len(shards), max(shards)
    lo, size = offsets[me], shards[me]
    mine = torch.empty(S, dtype=dtype, device=device)
    fill(lo, lo + size, mine[:size])
    mine[size:].zero_()
    chunks = torch.empty(n * S, dtype=dtype, device=device)
    _all_gather(chunks, mine, group=group)
    for k, (o, s) in enumerate(zip(offsets, shards)):
        if k != skip:
            place(o, o + s, chunks[k * S:k * S + s])


class ReplicaSync:
    """This rank's peer groups, their flat layouts, and the collectives that sum gradients across replicas."""

    def __init__(self, plan, topo, pos, model, peer_process_groups: dict):
        self.plan, self.zero_stage = plan, plan.zero_stage
        self.rank_of = dict(topo.rank_of)
        self.groups = sync_groups(plan)
        self.layouts = group_layouts(plan, topo, self.groups if plan.zero_stage >= 2 else None)
        self.model = model
        spec = plan.model
        self.params = dict(model.named_parameters())
        mine = {name: parameter_slice(spec, name, pos.heads, pos.ffn_cols) for name in self.params}
        self.mine: list[SyncGroup] = []
        for gi, (g, layout) in enumerate(zip(self.groups, self.layouts)):
            ranks = tuple(topo.rank_of[h] for h in g.holders)
            if pos.rank not in ranks:
                continue
            assert list(ranks) == sorted(ranks), f"holders {g.holders} are not in rank order"
            me = ranks.index(pos.rank)
            shards = group_owners(plan, g, layout.numel)
            offsets = tuple(sum(shards[:k]) for k in range(len(shards)))
            self.mine.append(SyncGroup(
                index=gi, group=g, layout=layout, ranks=ranks, me=me, copies=g.copies[me],
                process_group=peer_process_groups[ranks] if len(ranks) > 1 else None, shards=shards, offsets=offsets,
                regions=[local_region(mine[e.name], e.where) for e in layout.entries], unit=unit_of(g)))
        whole = [sg for sg in self.mine if sg.layout.whole]
        if whole:
            assert len(self.mine) == 1, "a group that holds all of a rank's parameters is its only group"
            names = [e.name for e in whole[0].layout.entries]
            assert names == list(self.params), f"module order {list(self.params)} differs from the layout's {names}"
        self.grads: dict[str, torch.Tensor] = {}
        self.grad_buffer: torch.Tensor | None = None

    def bind_grads(self, grad_buffer: torch.Tensor, views: dict[str, torch.Tensor]) -> None:
        """The engine's flat gradient buffer and each parameter's view of it (the ``.grad`` tensors)."""
        self.grad_buffer, self.grads = grad_buffer, views
        for sg in self.mine:
            if sg.layout.whole:
                for e in sg.layout.entries:
                    v = views[e.name]
                    assert v.data_ptr() == grad_buffer.data_ptr() + e.offset * grad_buffer.element_size(), \
                        f"{e.name}: the flat gradient buffer is not in the layout's order"

    # --- moving a flat range between local tensors and a buffer ------------------------------------------
    @torch.no_grad()
    def copy(self, sg: SyncGroup, tensor_of, lo: int, hi: int, buf: torch.Tensor, *, into_buffer: bool) -> None:
        """Copy flat elements [lo, hi) of ``sg`` between this rank's local tensors (``tensor_of(name)``) and
        ``buf`` (hi - lo elements), in either direction."""
        for start, piece, _ in self.pieces(sg, tensor_of, lo, hi):
            part = buf[start - lo:start - lo + piece.numel()].view(piece.shape)
            if into_buffer:
                part.copy_(piece)
            else:
                piece.copy_(part)

    def pieces(self, sg: SyncGroup, tensor_of, lo: int, hi: int) -> list[tuple[int, torch.Tensor, Entry]]:
        """(flat start, view, entry) of the local pieces making up flat elements [lo, hi) of ``sg``: views of
        ``tensor_of(name)`` whose row-major elements follow the flat vector."""
        out = []
        for i, a, b, e in entry_spans(sg, lo, hi):
            view = tensor_of(e.name)
            if sg.regions[i] is not None:
                view = view.narrow(*sg.regions[i])
            k = a
            for piece in flat_pieces(view, a - e.offset, b - e.offset):
                out.append((k, piece, e))
                k += piece.numel()
        return out

    def _grads_to(self, sg: SyncGroup, lo: int, hi: int, buf: torch.Tensor) -> None:
        if sg.layout.whole:
            buf.copy_(self.grad_buffer[lo:hi])
        else:
            self.copy(sg, self.grads.__getitem__, lo, hi, buf, into_buffer=True)

    def _grads_from(self, sg: SyncGroup, lo: int, hi: int, buf: torch.Tensor) -> None:
        if sg.layout.whole:
            self.grad_buffer[lo:hi].copy_(buf)
        else:
            self.copy(sg, self.grads.__getitem__, lo, hi, buf, into_buffer=False)

    def _param(self, name: str) -> torch.Tensor:
        return self.params[name].data

    # --- the collectives ------------------------------------------------------------------------------
    @torch.no_grad()
    def sync_grads(self) -> None:
        """Sum the replicas' gradients group by group: all of them on every holder (stage 0), or each
        owner's shard on its owner (stage 1; the rest of a rank's gradients are left as they were)."""
        for sg in self.mine:
            if sg.process_group is None:
                continue  # a single holder: its gradient is already the sum
            if self.zero_stage == 0:
                self._all_reduce(sg)
            else:
                self._reduce_scatter(sg)

    def _all_reduce(self, sg: SyncGroup) -> None:
        if sg.layout.whole:
            buf = self.grad_buffer
            if sg.copies != 1:
                buf.div_(sg.copies)
            dist.all_reduce(buf, group=sg.process_group)
            return
        buf = torch.empty(sg.layout.numel, dtype=self.grad_buffer.dtype, device=self.grad_buffer.device)
        self._grads_to(sg, 0, sg.layout.numel, buf)
        if sg.copies != 1:
            buf.div_(sg.copies)
        dist.all_reduce(buf, group=sg.process_group)
        self._grads_from(sg, 0, sg.layout.numel, buf)

    def _reduce_scatter(self, sg: SyncGroup) -> None:
        lo, hi = sg.owned
        mine = self.reduce_scatter(sg, self._grads_to, self.grad_buffer.dtype, self.grad_buffer.device)
        self._grads_from(sg, lo, hi, mine[:hi - lo])

    def reduce_scatter(self, sg: SyncGroup, grads_to, dtype, device) -> torch.Tensor:
        """Sum the holders' gradients of ``sg`` into each owner's shard: returns this rank's (``largest``
        elements, the owned ones first). ``grads_to(sg, lo, hi, buf)`` copies this rank's local gradients
        of flat elements [lo, hi) into ``buf``."""
        return padded_reduce_scatter(sg.offsets, sg.shards, lambda lo, hi, buf: grads_to(sg, lo, hi, buf),
                                     copies=sg.copies, group=sg.process_group, dtype=dtype, device=device)

    @torch.no_grad()
    def all_gather_weights(self, sg: SyncGroup, fill, dtype, device, *, own: bool = False) -> None:
        """Stages 1 and 2, after the owners' update (and stage 3 before a unit is used): this rank's owned
        weights (``fill(lo, hi, buf)`` copies them into ``buf``) to every holder, padded to equal chunks, and
        into every holder's parameters (``own``: this rank's shard too, else it is there already)."""
        padded_all_gather(sg.offsets, sg.shards, sg.me, fill,
                          lambda lo, hi, buf: self.copy(sg, self._param, lo, hi, buf, into_buffer=False),
                          group=sg.process_group, dtype=dtype, device=device, skip=None if own else sg.me)

    # --- what the norm counts -------------------------------------------------------------------------
    def norm_views(self) -> list[torch.Tensor]:
        """Views of the gradient buffer this rank adds to the global norm after ``sync_grads``: its share
        (stage 0: all, as the group's first holder; stage 1: its owned shard) of each group's counted pieces."""
        out = []
        for sg in self.mine:
            lo, hi = sg.owned
            for a, b in sg.layout.counted:
                a, b = max(a, lo), min(b, hi)
                if a >= b:
                    continue
                # One view per parameter piece (as a per-parameter norm): float32 norms of views of similar
                # sizes on every plan, rather than one sum over a whole rank's gradients.
                out += [v for _, v, _ in self.pieces(sg, self.grads.__getitem__, a, b)]
        return out

    # --- checkpoints ----------------------------------------------------------------------------------
    def state_owners(self, index: int) -> list[tuple[int, int, int]]:
        """(global rank, lo, hi): who keeps the optimizer state of which flat range of group ``index``."""
        g, layout = self.groups[index], self.layouts[index]
        shards = group_owners(self.plan, g, layout.numel)
        ranks = [self.rank_of[h] for h in g.holders]
        out, o = [], 0
        for r, s in zip(ranks, shards):
            if s:
                out.append((r, o, o + s))
            o += s
        return out

    def mine_by_index(self, index: int) -> SyncGroup | None:
        return next((sg for sg in self.mine if sg.index == index), None)
