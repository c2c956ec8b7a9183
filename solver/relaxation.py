"""Eq. 12c: a bound on every plan from its replicas, each priced with its fill and drain, its tensor-parallel
all-reduces, whole samples and its data-parallel sync (solver/README.md, "A sharper bound from replicas").

Eq. 12b (``solver.ideal``) spreads the batch over every device as a fluid. Where a cluster has about one sample per
GPU (HAP's and Cephalo's clusters at batch 64), every real plan pays for that: long pipelines fill and drain, wide
tensor-parallel groups all-reduce every layer, and many replicas sync their gradients over slow links. This bound
prices those three together, per replica, over *device classes* (devices of one GPU type on nodes of one kind,
which enter every equation alike), so it needs no layout:

* a replica is a vector ``a`` of device counts per class; its stages are compositions ``c`` (counts per class) in
  some order. ``stage_rates`` bounds what a stage of composition ``c`` can do per ms (eq. 2, 5, 9);
  ``pipeline_capacity`` the most a replica of ``a`` can do within its pipeline time with ``m`` micro-batches
  (eq. 1's fill and drain), by a dynamic programme over the stage sequences; ``chain_floor`` the least pipeline
  time eq. 1's chain allows when every stage holds whole layers and the first and last stages run the edges, with
  each stage's wait for micro-batch 0's round trip through the later ones (eq. 1r, ``suffix_totals``), by a
  second programme, where it fits ``CHAIN_WORK``;
* ``sync_floor`` bounds a replica's data-parallel sync (eq. 13, 15-17) when the plan has ``r`` or more replicas, over
  the links ``sync_lines`` allows (a replica that fills its node reaches the other replicas over the network), and
  ``held_counts`` how many micro-batches a replica can run when what its devices hold costs them compute and sync
  at once;
* an LP over replicas (how many of each vector, fractions allowed) finds the least time at which the replicas,
  within the cluster's devices and ``r`` replicas, could train the global batch.

The proof, one step per function, is in solver/README.md. The programme is over every composition, so its size
grows as the product of the class counts: it runs where that stays small (``MAX_PAIRS``), which covers the shipped
clusters of up to 64 GPUs, and where the options leave 1F1B or the layered schedule (interleaved 1F1B is not bounded
by eq. 1's chain in this form).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import highspy
import numpy as np

from baton.cluster import ClusterSpec, Link, slower_end
from baton.costmodel import (edge_comm_passes_on_ms, edge_param_count, edge_train_ms, layer_allreduce_on_ms,
                             layer_backward_ms, layer_param_count, layer_train_ms)
from baton.model_spec import ModelSpec
from baton.profile import ProfileSet
from baton.schedules import forwards_before_first_backward

from solver import stop
from solver.bounds import _sync_line
from solver.options import plan_shares, valid_unit_counts

MAX_PAIRS = 16_000_000
"""Pairs (replica vector, stage composition) the programme may visit: 13.1M on cephalo_64gpu's three classes of 16,
16 and 32 GPUs (8 s, about 700 MB at the peak); beyond it the bound is not computed and eq. 12b stands alone."""
CHAIN_WORK = 2_500_000_000
"""Steps (``ChainPairs.work``, one ``chain_floor`` per micro-batch size and count bucket) eq. 1's chain with whole layers
may take, the round trip's included (``_round_trip_choice``); beyond it eq. 12c stands without it. On this 2-core
machine 1.6-2.6e8 a second: the pass took 5.9-13.7 s for 1.6-2.2e9 on HAP and the generated 64-GPU clusters of two
types. Whole layers alone take 0.24e9 on HAP's 64 GPUs at batch 64, 0.74-1.33e9 on the generated 64-GPU clusters of
two types at batch 512, 0.02e9 on hethub_nv_gpua; cephalo_64gpu (4.1e10 at batch 64) and the generated 64-GPU cluster
of three types (1.4e10) are beyond it. Raised to 5e9, HAP's bound rose 1.2% (every stage's round trip at K = 8, not
4) and the generated clusters' did not move, at up to 12 s more each."""
ROUND_TRIP_STAGES = 8
"""K of ``suffix_totals``: the round trip through the stages after the stage that pays it is charged at their exact
count up to K - 1 and at k = m - 1 beyond (K is also at most the largest micro-batch count less one, past which k no
longer grows: K - 1 exact counts and k = m - 1 beyond are then exact)."""
NEVER_MS = 1e15
"""A time past which no replica trains more: the sizes' counts cannot add up to the batch (every table holding only
micro-batch 2 at batch 3), and the bound's search for the least time stops there instead of doubling forever."""
SCAN = 8
"""Counts ``held_counts`` tries one by one below its bisection's answer (the bisection reads the edges' loss at its
least over larger counts, so it may answer above the largest count that fits)."""
MAX_DEVICES = 128
"""The programme runs one step per device count (its levels), per micro-batch size and count bucket: a cluster of more
devices is not bounded so, however few its classes."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceClass:
    """Devices of one GPU type on nodes of one kind: interchangeable in every equation the bound reads."""

    gpu: str
    """GPU type (its profile table)."""
    count: int
    """Devices of the class in the cluster."""
    per_node: int
    """Devices of the class on one of its nodes."""
    node_devices: int
    """Devices of any class on one of its nodes."""
    node_kind: tuple
    """The node's links and GPU types: classes with one node kind can share a node."""
    intra: Link | None
    """The node's intra-node link (None for a node of one device)."""
    nic: Link | None
    """The node's network link (None on a cluster of one node)."""
    members: tuple[str, ...]
    """The devices of the class."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplicaBound:
    """Eq. 12c and what it was made of."""

    bound_ms: float
    """Lower bound on the iteration time of every plan, ms."""
    pipeline_ms: float
    """Its pipeline and sync part (the least over replica counts), ms."""
    optimizer_ms: float
    """Its Adam step part (eq. 12b's), ms."""
    replicas: tuple[int, int]
    """The range of replica counts where the least was found."""
    whole_layers: bool
    """Whether eq. 1's chain was priced with whole layers per stage (``chain_floor``, within ``CHAIN_WORK``)."""
    round_trip: bool
    """Whether the chain also charged micro-batch 0's round trip (eq. 1r, within ``CHAIN_WORK``): the first stage's, or
    every stage's but the last where that fits."""
    seconds: float
    """Time it took."""


def device_classes(cluster: ClusterSpec) -> list[DeviceClass]:
    """The cluster's devices grouped by GPU type and node kind (its links and the GPU types it holds)."""
    per_node: dict[str, list] = {}
    for d in cluster.devices:
        per_node.setdefault(d.node, []).append(d)
    found: dict[tuple, dict] = {}
    for node, devices in per_node.items():
        intra = cluster.intra_links.get(node) if len(devices) > 1 else None
        nic = cluster.nic(node) if len(per_node) > 1 else None
        kind = (intra, nic, tuple(sorted(d.gpu.name for d in devices)))
        for d in devices:
            entry = found.setdefault((d.gpu.name, kind), {"gpu": d.gpu.name, "node_kind": kind, "intra": intra,
                                                          "nic": nic, "node_devices": len(devices),
                                                          "per_node": sum(x.gpu.name == d.gpu.name for x in devices),
                                                          "members": []})
            entry["members"].append(d.id)
    return [DeviceClass(count=len(e["members"]), **{**e, "members": tuple(e["members"])}) for e in found.values()]


def share_lines(profile, spec: ModelSpec, micro_batch: int) -> list[tuple[float, float, float]]:
    """The lower convex hull of a device's layer time against its share, t(b, u) over every share a plan can hold,
    as (from share, slope, intercept) edges: each edge's line lies under every point, so t(b, u) >= slope u +
    intercept at every share (a device's forward and backward with nothing recomputed, as eq. 12b reads them)."""
    us = plan_shares(spec)
    return _lower_hull(us, [layer_train_ms(profile, spec, micro_batch, u) for u in us])


def backward_lines(profile, spec: ModelSpec, micro_batch: int) -> list[tuple[float, float, float]]:
    """``share_lines`` of a layer's backward alone (eq. 12c's round trip)."""
    us = plan_shares(spec)
    return _lower_hull(us, [layer_backward_ms(profile, spec, micro_batch, u) for u in us])


def edge_lines(profile, spec: ModelSpec, micro_batch: int, *, first: bool, last: bool) -> list[tuple[float, float, float]]:
    """``share_lines`` of the embedding's forward and backward (``first``), the final norm's, head's and loss's
    (``last``), or both together, over the vocabulary shares, which are the layer's (``edge_cost``)."""
    us = plan_shares(spec)
    return _lower_hull(us, [edge_train_ms(profile, spec, micro_batch, u, first=first, last=last) for u in us])


def _lower_hull(us, ts) -> list[tuple[float, float, float]]:
    """The edges of the lower convex hull of the points (us, ts), ``us`` increasing."""
    hull: list[int] = []
    for i in range(len(us)):
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            if (ts[b] - ts[a]) * (us[i] - us[a]) >= (ts[i] - ts[a]) * (us[b] - us[a]):
                hull.pop()
            else:
                break
        hull.append(i)
    if len(hull) == 1:
        return [(us[0], 0.0, ts[0])]
    edges = []
    for a, b in zip(hull, hull[1:]):
        slope = (ts[b] - ts[a]) / (us[b] - us[a])
        # A falling edge (a table slower at a smaller share) cannot carry the proof's tau: the flat line at the least
        # time of all lies under every point too.
        edges.append((us[a], slope, ts[a] - slope * us[a]) if slope > 0 else (us[a], 0.0, min(ts)))
    return edges


def _line_at(lines, share: float) -> tuple[float, float]:
    """The hull edge over ``share`` (the first below the smallest share, the last above the largest)."""
    chosen = lines[0]
    for edge in lines:
        if edge[0] <= share:
            chosen = edge
    return chosen[1], chosen[2]


def class_grid(classes: list[DeviceClass]) -> np.ndarray:
    """Every vector of counts per class up to the cluster's, in row-major order (index = dot with ``strides``)."""
    dims = [c.count + 1 for c in classes]
    return np.stack(np.meshgrid(*[np.arange(d) for d in dims], indexing="ij"), -1).reshape(-1, len(classes))


def _strides(classes: list[DeviceClass]) -> np.ndarray:
    dims = [c.count + 1 for c in classes]
    return np.array([int(np.prod(dims[k + 1:])) for k in range(len(dims))], dtype=np.int64)


def _link_key(classes: list[DeviceClass], c) -> tuple[tuple[int, ...], bool]:
    """What ``_group_links`` reads of a composition ``c``: its classes present, and whether they can share one node
    (every class present has one node kind, with an intra link, and fits one node)."""
    n = int(sum(c))
    present = tuple(k for k, x in enumerate(c) if x)
    together = (len({classes[k].node_kind for k in present}) == 1 and classes[present[0]].intra is not None
                and n <= classes[present[0]].node_devices and all(c[k] <= classes[k].per_node for k in present))
    return present, together


def _group_links(classes: list[DeviceClass], present: tuple[int, ...], together: bool) -> list[Link | None]:
    """The links a group of two or more devices of the classes ``present`` could have as its slowest, one of which is
    the fastest it can have: on one node, that node's intra link, where they can share one (``together``); across
    nodes, the slower end of the NICs of every class present (each has a device on a node of its kind, and a group
    spanning nodes pays every involved node's NIC). Empty where no such group exists."""
    options = [classes[present[0]].intra] if together else []
    nics = [classes[k].nic for k in present if classes[k].nic is not None]
    if nics:
        options.append(slower_end(*nics))
    return options


class FastestLink:
    """The least ``price(n, link)`` a group of composition ``c`` (n devices) can pay over the links it could have
    (``_group_links``): 0 for one device, inf where no such group exists (collectives cost no more on a faster link).
    Called over every composition of a cluster's classes at one price, each set of links and each price of n devices
    on them is worked out once (a 64-GPU cluster of three classes has about 10,000 compositions and a few hundred
    such pairs)."""

    def __init__(self, classes: list[DeviceClass], price):
        self.classes, self.price = classes, price
        self._links: dict[tuple, list[Link | None]] = {}
        self._paid: dict[tuple, float] = {}

    def __call__(self, c) -> float:
        n = int(sum(c))
        if n <= 1:
            return 0.0
        key = _link_key(self.classes, c)
        if (n, key) not in self._paid:
            if key not in self._links:
                self._links[key] = _group_links(self.classes, *key)
            self._paid[n, key] = min((self.price(n, link) for link in self._links[key]), default=math.inf)
        return self._paid[n, key]


def _in_layer_price(spec: ModelSpec, micro_batch: int):
    """A group's in-layer all-reduce of one direction at micro-batch b over a link (eq. 5), by its size and link."""
    return lambda n, link: layer_allreduce_on_ms(spec, micro_batch, n, link)


def _holds(profiles: ProfileSet, classes: list[DeviceClass], micro_batch: int) -> list[bool]:
    """Per class, whether its table holds the micro-batch size (a replica runs only sizes every table of its GPUs
    holds, so a stage with a class that lacks it does not exist)."""
    return [micro_batch in profiles[c.gpu].micro_batches("qkv") for c in classes]


def _slowest_rank_ms(lines: list, c) -> tuple[float, float]:
    """(R, R tau) for ranks of composition ``c`` whose times lie over ``lines`` (per class, at share 1/n): the
    slowest rank takes at least tau = (1 + sum_k R_k beta_k) / R, R_k = c_k / alpha_k (``stage_rates``)."""
    n = int(sum(c))
    R, Rbeta = 0.0, 0.0
    for k, count in enumerate(c):
        if count:
            alpha, beta = _line_at(lines[k], 1.0 / n)
            alpha = max(alpha, 1e-12)  # a flat edge: the rank takes at least beta whatever its share
            R += count / alpha
            Rbeta += count / alpha * beta
    return R, 1.0 + Rbeta


def stage_rates(spec: ModelSpec, profiles: ProfileSet, classes: list[DeviceClass], grid: np.ndarray,
                micro_batch: int) -> np.ndarray:
    """For every composition c: rho(c) >= what a stage of those devices does per ms at micro-batch b, in samples
    times layers, b / (its per-layer time of one micro-batch). Eq. 9: the stage's per-layer time is at least the
    slowest rank's forward and backward plus 4 in-layer all-reduces A(c). Rank d at share u_d takes at least
    alpha_d u_d + beta_d (``share_lines``, any edge), the shares add up to one, so the slowest takes at least
    tau = (1 + sum_d beta_d / alpha_d) / sum_d (1 / alpha_d) (the level at which every rank's share fits). So
    rho(c) <= b / (tau + A) = b R / (1 + sum_k R_k beta_k + A R), R_k = c_k / alpha_k, R = sum_k R_k. A group
    needs a unit per rank: where n exceeds every unit count U the model allows, rho = 0 (no such stage); so is a
    stage with a class whose table does not hold b (a replica runs only sizes every table of its GPUs holds)."""
    most_units = max(valid_unit_counts(spec))
    holds = _holds(profiles, classes, micro_batch)
    lines = [share_lines(profiles[c.gpu], spec, micro_batch) if holds[k] else None for k, c in enumerate(classes)]
    out = np.zeros(len(grid))
    in_layer = FastestLink(classes, _in_layer_price(spec, micro_batch))
    for i, c in enumerate(grid):
        n = int(c.sum())
        if n == 0 or n > most_units or any(c[k] and not holds[k] for k in range(len(classes))):
            continue
        A = 2 * in_layer(c)  # both directions (eq. 9)
        if not math.isfinite(A):
            continue
        R, R_tau = _slowest_rank_ms(lines, c)
        out[i] = micro_batch * R / (R_tau + A * R)
    return out


def backward_floors(spec: ModelSpec, profiles: ProfileSet, classes: list[DeviceClass], grid: np.ndarray,
                    micro_batch: int, layer_ms: np.ndarray) -> np.ndarray:
    """For every composition c: the least time per layer and micro-batch a stage of those devices spends in the
    backward, ms: the slowest rank's backward with nothing recomputed under ``backward_lines`` at shares adding up to
    one (``stage_rates``' tau) plus the two in-layer all-reduces of the backward over the fastest link such a group can
    have (eq. 9 for one direction); inf where no such stage exists (``layer_ms`` inf)."""
    holds = _holds(profiles, classes, micro_batch)
    lines = [backward_lines(profiles[c.gpu], spec, micro_batch) if holds[k] else None for k, c in enumerate(classes)]
    out = np.full(len(grid), math.inf)
    in_layer = FastestLink(classes, _in_layer_price(spec, micro_batch))
    for i, c in enumerate(grid):
        if not math.isfinite(layer_ms[i]):
            continue
        R, R_tau = _slowest_rank_ms(lines, c)
        out[i] = R_tau / R + in_layer(c)
    return out


def edge_floors(spec: ModelSpec, profiles: ProfileSet, classes: list[DeviceClass], grid: np.ndarray,
                micro_batch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For every composition c: the least time per micro-batch a stage of those devices spends on the embedding (as a
    first stage), on the final norm, head and loss (as a last stage), and on both (as the only stage, whose ranks run
    both at one share each), each the slowest rank's forward and backward under ``edge_lines`` at shares adding up to
    one (``stage_rates``' tau) plus the edges' all-reduces over the fastest link such a group can have (eq. 9's edge
    terms, ``edge_comms_ms``). Both edges on one stage get the floor of their sum, not the sum of the two floors: one
    rank may be the slowest at the embedding and another at the head."""
    holds = _holds(profiles, classes, micro_batch)
    roles = {"first": (True, False), "last": (False, True), "both": (True, True)}
    lines = {role: [edge_lines(profiles[c.gpu], spec, micro_batch, first=first, last=last) if holds[k] else None
                    for k, c in enumerate(classes)] for role, (first, last) in roles.items()}
    out = {role: np.full(len(grid), math.inf) for role in roles}
    comms = {role: FastestLink(classes, lambda k, link, first=first, last=last:
                               sum(edge_comm_passes_on_ms(spec, micro_batch, k, link, first=first, last=last)))
             for role, (first, last) in roles.items()}
    for i, c in enumerate(grid):
        n = int(c.sum())
        if n == 0 or any(c[k] and not holds[k] for k in range(len(classes))):
            continue
        for role in roles:
            R, R_tau = _slowest_rank_ms(lines[role], c)
            out[role][i] = R_tau / R + comms[role](c)
    return out["first"], out["last"], out["both"]


def edge_layers(layer_ms: np.ndarray, emb_ms: np.ndarray, head_ms: np.ndarray, both_ms: np.ndarray,
                dims: list[int]) -> np.ndarray:
    """For every replica vector a: E(a), the least the edges can cost a replica of a, in layers of the stages that run
    them (solver/README.md, step 3): one stage runs both, e_both(a) rho(a) / b; two or more put the embedding and the
    head on two stages, each a composition c < a, so at least the least e(c) rho(c) / b over those of the embedding
    plus the same of the head. ``layer_ms`` is b / rho(c); a stage that cannot exist (inf) carries no edge."""
    def layers(ms):
        with np.errstate(invalid="ignore"):
            return np.where(np.isfinite(layer_ms), ms / layer_ms, math.inf)

    apart = least_below(layers(emb_ms), dims) + least_below(layers(head_ms), dims)
    return np.minimum(apart, layers(both_ms))


def least_within(values: np.ndarray, dims: list[int]) -> np.ndarray:
    """For every vector a of the grid: the least value over every vector c <= a (running minima along each class);
    ``values`` is indexed by vector first, and may have further axes (taken one by one)."""
    box = values.reshape(list(dims) + list(values.shape[1:]))
    for axis in range(len(dims)):
        box = np.minimum.accumulate(box, axis=axis)
    return box.reshape(values.shape)


def least_below(values: np.ndarray, dims: list[int]) -> np.ndarray:
    """For every vector a of the grid: the least value over every vector c < a (``least_within`` at a less one device
    of some class); infinite at the zero vector."""
    box = least_within(values, dims).reshape(dims)
    inside = np.full(dims, math.inf)
    for to, frm in _one_device_less(dims):
        inside[to] = np.minimum(inside[to], box[frm])
    return inside.reshape(-1)


def _one_device_less(dims: list[int]):
    """Per class, (slices of the vectors with one or more of its devices, slices of the same vectors less one of
    them), over the grid reshaped to ``dims``."""
    for axis in range(len(dims)):
        to, frm = [slice(None)] * len(dims), [slice(None)] * len(dims)
        to[axis], frm[axis] = slice(1, None), slice(None, -1)
        yield tuple(to), tuple(frm)


@dataclass(frozen=True, slots=True)
class _Pairs:
    """Every (vector a, composition c <= a, c != 0), ordered by a's device count and then by a."""

    a: np.ndarray
    c: np.ndarray
    rest: np.ndarray
    """Index of a - c."""
    levels: list
    """Per device count t: (slice of the pairs, the a's of that count in order, start of each a's run)."""


def _pairs(classes: list[DeviceClass], grid: np.ndarray) -> _Pairs:
    strides = _strides(classes)
    # Per class, every (a_k, c_k) with c_k <= a_k; the pairs are their product over the classes.
    per_class = [np.array([(x, y) for x in range(c.count + 1) for y in range(x + 1)], dtype=np.int64) for c in classes]
    mesh = np.meshgrid(*[np.arange(len(p)) for p in per_class], indexing="ij")
    a = sum(per_class[k][mesh[k].ravel(), 0] * strides[k] for k in range(len(classes)))
    c = sum(per_class[k][mesh[k].ravel(), 1] * strides[k] for k in range(len(classes)))
    del mesh
    keep = c > 0
    a, c = a[keep], c[keep]
    totals = grid.sum(1)
    order = np.lexsort((a, totals[a]))
    a, c = a[order].astype(np.int32), c[order].astype(np.int32)
    rest = (a - c).astype(np.int32)  # row-major indices subtract like the vectors
    return _Pairs(a=a, c=c, rest=rest, levels=_levels(a, totals))


def _levels(a: np.ndarray, totals: np.ndarray) -> list:
    """``_Pairs.levels`` of pairs listed by a's device count and then by a."""
    levels = []
    bounds = np.r_[0, np.nonzero(np.diff(totals[a]))[0] + 1, len(a)]
    for lo, hi in zip(bounds, bounds[1:]):
        if hi > lo:
            starts = np.r_[0, np.nonzero(np.diff(a[lo:hi]))[0] + 1]
            levels.append((slice(lo, hi), a[lo:hi][starts], starts))
    return levels


def _subset(pairs: _Pairs, keep: np.ndarray, totals: np.ndarray) -> _Pairs:
    """The pairs where ``keep`` holds, in the same order, with their levels."""
    a = pairs.a[keep]
    return _Pairs(a=a, c=pairs.c[keep], rest=pairs.rest[keep], levels=_levels(a, totals))


def pair_count(classes: list[DeviceClass]) -> int:
    """How many pairs ``_pairs`` would list: prod_k (n_k + 1)(n_k + 2) / 2, less the zero vectors."""
    return math.prod((c.count + 1) * (c.count + 2) // 2 for c in classes)


def pipeline_capacity(rates: np.ndarray, pairs: _Pairs, size: int, q: float,
                      deadline_s: float = math.inf) -> np.ndarray | None:
    """F(a) = the most sum_s q^s rho(c_s) over sequences of compositions c_0, c_1, ... whose counts add up to a:
    F(a) = max_c rho(c) + q F(a - c). Eq. 1's chain gives every 1F1B replica T_pipe >= sum_{s' < s} t_s' + m t_s for
    every stage s (stage s starts only after micro-batch 0 went forward through the stages before it, then runs its
    2m passes one after another, and after its last backward the stages before it run that micro-batch's backward), so
    with q = 1 - 1/m a replica does at most (T / m) F(a) samples times layers per micro-batch (solver/README.md)."""
    F = np.zeros(size)
    for sl, targets, starts in pairs.levels:
        if stop.past(deadline_s):
            return None
        values = rates[pairs.c[sl]] + q * F[pairs.rest[sl]]
        F[targets] = np.maximum.reduceat(values, starts)
    return F


@dataclass(frozen=True, slots=True)
class ChainPairs:
    """The pairs ``chain_floor`` tries, for one micro-batch size's stage times."""

    middle: _Pairs
    """A middle stage before the rest: compositions that exist and that no smaller one runs as fast, devices left."""
    first: _Pairs
    """A first stage before the rest: compositions that exist (and, where ``chain_pairs`` was given the edge and
    backward floors, that no composition a device smaller beats at all three), devices left after them."""

    def work(self, num_layers: int) -> int:
        """Steps of one ``chain_floor``: each middle pair tries every layer count l at every count from l up (N (N + 1)
        / 2), each first pair every layer count."""
        N = num_layers
        return len(self.middle.a) * N * (N + 1) // 2 + len(self.first.a) * (N + 1)


def chain_pairs(pairs: _Pairs, layer_ms: np.ndarray, dims: list[int], totals: np.ndarray,
                first_ms: np.ndarray | None = None, backward_ms: np.ndarray | None = None) -> ChainPairs:
    """``ChainPairs`` of ``layer_ms`` (per composition; inf where no such stage exists). Given the first stage's edge
    floor ``first_ms`` and the backward floor ``backward_ms`` that ``chain_floor`` reads, a first composition that one
    a device smaller beats at all three is skipped (``_unbeaten``): the smaller one's stage is no slower at any layer
    count and its round trip no longer, before the same suffix on fewer devices, which the least over sub-vectors at
    the end takes."""
    quicker = layer_ms < least_below(layer_ms, dims)
    left = pairs.rest != 0
    if first_ms is None or backward_ms is None:
        firsts = np.isfinite(layer_ms)
    else:
        firsts = _unbeaten((layer_ms, np.where(np.isfinite(layer_ms), first_ms, math.inf), backward_ms), dims)
    return ChainPairs(middle=_subset(pairs, quicker[pairs.c] & left, totals),
                      first=_subset(pairs, firsts[pairs.c] & left, totals))


def _unbeaten(figures: tuple[np.ndarray, ...], dims: list[int]) -> np.ndarray:
    """Per composition: whether it exists (the first figure, its layer time, finite) and no composition one device
    smaller is at or under it in every figure (one that does not exist, the zero vector among them, has an infinite
    layer time and so beats none that does)."""
    boxes = [f.reshape(dims) for f in figures]
    beaten = np.zeros(dims, dtype=bool)
    for to, frm in _one_device_less(dims):
        beaten[to] |= np.logical_and.reduce([box[frm] <= box[to] for box in boxes])
    return np.isfinite(figures[0]) & ~beaten.reshape(-1)


def trip_middles(pairs: _Pairs, layer_ms: np.ndarray, backward_ms: np.ndarray, dims: list[int],
                 totals: np.ndarray) -> _Pairs:
    """Middle stages that pay their round trip (eq. 1r) before the rest: compositions that exist and that no
    composition one device smaller beats at both its layer time and its backward (taken at most the layer time, as
    the term reads it), devices left. The term grows with either, so a composition only as fast per layer as a smaller
    one may still charge less, and ``ChainPairs.middle`` would skip it."""
    unbeaten = _unbeaten((layer_ms, np.minimum(backward_ms, layer_ms)), dims)
    return _subset(pairs, unbeaten[pairs.c] & (pairs.rest != 0), totals)


def _front_stage(per: np.ndarray, after: np.ndarray, num_layers: int, join) -> np.ndarray:
    """For pairs whose front stage takes ``per`` ms a layer and holds l >= 1 layers before a rest whose value at L - l
    layers is ``after``: per pair and L, the least over l of ``join(t, l, after)``, t = l per (inf where no l fits)."""
    N = num_layers
    best = np.full((len(per), N + 1), math.inf)
    per = per[:, None]
    with np.errstate(invalid="ignore"):
        for l in range(1, N + 1):
            np.minimum(best[:, l:], join(per * l, l, after[:, :N + 1 - l]), out=best[:, l:])
    return best


def _plain(join):
    """A join of a front stage's time and the rest's value that reads nothing else (``_over_middles``' ``join_at``)."""
    return lambda c, rest: lambda t, l, after: join(t, after)


def _over_middles(values: np.ndarray, layer_ms: np.ndarray, middle: _Pairs, num_layers: int, join_at, *,
                  rest: np.ndarray | None = None, deadline_s: float) -> np.ndarray | None:
    """``values`` with, at every vector a, the least of its own and of ``_front_stage`` over the middle pairs (c, a - c)
    with the rest read at a - c from ``rest`` (one more stage), or where it is None from the result itself, level by
    level, each reading the levels before it updated (a programme over any number of stages). ``join_at(c, rest)``
    gives a level's join, which may read what it needs of its pairs once. None past the deadline."""
    out = values.copy()
    source = out if rest is None else rest
    for sl, targets, starts in middle.levels:
        if stop.past(deadline_s):
            return None
        c, after = middle.c[sl], middle.rest[sl]
        best = _front_stage(layer_ms[c], source[after], num_layers, join_at(c, after))
        out[targets] = np.minimum(out[targets], np.minimum.reduceat(best, starts, axis=0))
    return out


@dataclass(frozen=True, slots=True)
class SuffixTotals:
    """Least sums of stage times of the stages after a first one, which micro-batch 0 goes forward and back through
    before the first stage's first backward (eq. 12c's round trip, ``suffix_totals``)."""

    exact: tuple[np.ndarray, ...]
    """``exact[j - 1][a, L]``: the least sum over j stages on some of a's devices holding L layers, the last running the
    head (j = 1 .. K - 1), ms."""
    beyond: np.ndarray
    """The same over K or more stages, ms."""


def suffix_totals(layer_ms: np.ndarray, last_ms: np.ndarray, chain: ChainPairs, dims: list[int], num_layers: int,
                  stages: int, deadline_s: float = math.inf) -> SuffixTotals | None:
    """``SuffixTotals`` with K = ``stages``, the stages holding whole layers at ``layer_ms`` each (the last also the
    head's floor ``last_ms``, and it may hold none; the others one or more). By the same programme as ``chain_floor``'s
    S with sums for maxima: one stage alone is L l(a) + e_head(a); j stages put a middle one (c, l >= 1) before j - 1,
    and K or more put K - 1 middle ones before a programme over any number. Middle compositions some smaller one runs
    no slower are skipped and the least over sub-vectors taken, as in ``chain_floor``: the swap keeps the stage count.
    None past the deadline."""
    N = num_layers
    exists = np.isfinite(layer_ms)
    counts = np.arange(N + 1)
    with np.errstate(invalid="ignore"):
        alone = np.where(exists[:, None], layer_ms[:, None] * counts[None, :] + last_ms[:, None], math.inf)
    alone[0, :] = math.inf

    def more(values):
        """One middle stage (c, l >= 1) of some of a's devices before ``values`` at a - c and L - l."""
        found = _over_middles(np.full_like(values, math.inf), layer_ms, chain.middle, N, _plain(np.add), rest=values,
                              deadline_s=deadline_s)
        return None if found is None else least_within(found, dims)

    exact = [least_within(alone, dims)]
    while len(exact) < stages - 1:
        found = more(exact[-1])
        if found is None:
            return None
        exact.append(found)
    beyond = _over_middles(alone, layer_ms, chain.middle, N, _plain(np.add), deadline_s=deadline_s)
    if beyond is None:
        return None
    beyond = least_within(beyond, dims)
    for _ in range(stages - 1):
        beyond = more(beyond)
        if beyond is None:
            return None
    return SuffixTotals(exact=tuple(exact[:stages - 1]), beyond=beyond)


def suffix_work(chain: ChainPairs, num_layers: int, stages: int) -> int:
    """Steps of one ``suffix_totals``: 2 K - 2 passes over the middle pairs (one where K = 1) at N (N + 1) / 2 each."""
    N = num_layers
    return max(1, 2 * stages - 2) * len(chain.middle.a) * N * (N + 1) // 2


@dataclass(frozen=True, slots=True)
class RoundTrip:
    """What ``chain_floor`` reads to charge a stage for micro-batch 0's round trip through the stages after it."""

    backward_ms: np.ndarray
    """Per composition, a layer's least backward per micro-batch (``backward_floors``), ms."""
    totals: SuffixTotals
    """Least sums of the later stages' times (``suffix_totals``)."""
    middles: _Pairs | None
    """The middle pairs that pay it too (``trip_middles``), or None: only the first stage pays it."""


def chain_floor(layer_ms: np.ndarray, first_ms: np.ndarray, last_ms: np.ndarray, both_ms: np.ndarray,
                chain: ChainPairs, dims: list[int], num_layers: int, m: int,
                deadline_s: float = math.inf, round_trip: RoundTrip | None = None) -> np.ndarray | None:
    """Phi_m(a) for every replica vector a: the least T_pipe eq. 1's chain allows a replica of (some of) a's devices with
    m micro-batches when every stage holds whole layers (solver/README.md, step 3, "Whole layers"): the least over
    sequences of stages c_0, c_1, ... and layer counts L_s adding up to N of max_s sum_{s' < s} t_s' + m t_s, with
    t_s = L_s b / rho(c_s) (``layer_ms`` per composition; inf where no such stage exists), plus the embedding's floor
    on the first stage, the head's on the last, both on an only stage. First and last stages may hold no layer; the
    others hold one or more (a stage of none only delays the later ones and uses devices).

    With ``round_trip``, the first stage of p >= 2 (and with ``middles`` every stage but the last) also pays for
    micro-batch 0's round trip (eq. 1r): T_pipe >= (m - k) t_s + k B_s + sum_{s' != s} t_s', k = min(p - s - 1, m - 1),
    B_s >= L_s ``backward_ms`` (the embedding's backward taken as none), the later stages' sum at least ``totals`` at
    their count; counts of K or more stages are charged k = m - 1, the least (B_s is taken at most t_s where the floors
    cross, so the term falls as k grows).

    By dynamic programming from the back: S(a, L), the least over suffixes using exactly a and holding L layers whose
    last stage runs the head, of the chain's largest term measured from the suffix's start, is m t for a last stage
    alone, else min over its first stage (c, l >= 1) of t + max((m - 1) t, S(a - c, L - l)); Phi puts a first stage
    before a suffix the same way (and its round-trip term, each part at its own least over the suffixes), or runs an
    only stage. A middle composition some smaller one runs no slower is skipped: swapping it for the smaller one leaves
    a faster sequence on fewer devices, which the least over every sub-vector at the end takes. Where the middles pay
    their round trip, only one that a composition a device smaller beats at both its layer time and its backward is
    skipped (``trip_middles``): one only as fast per layer may have the smaller backward, and so the smaller term. None
    past the deadline."""
    N = num_layers
    exists = np.isfinite(layer_ms)
    first_ms, last_ms, both_ms = (np.where(exists, e, math.inf) for e in (first_ms, last_ms, both_ms))
    counts = np.arange(N + 1)
    with np.errstate(invalid="ignore"):
        held = np.where(counts[None, :] > 0, layer_ms[:, None] * counts[None, :], 0.0)  # l layers of each composition
    S = m * (held + last_ms[:, None])
    S[0, :] = math.inf

    if round_trip is not None and round_trip.middles is not None:
        S = _over_middles(S, layer_ms, round_trip.middles, N, _trip_join(round_trip, m), deadline_s=deadline_s)
    else:
        S = _over_middles(S, layer_ms, chain.middle, N, _plain(lambda t, after: _chained(t, after, m)),
                          deadline_s=deadline_s)
    if S is None:
        return None
    phi = m * (held[:, N] + both_ms)
    first = chain.first
    if len(first.a):
        t0 = held[first.c] + first_ms[first.c][:, None]  # by the first stage's layer count l
        with np.errstate(invalid="ignore"):
            value = _chained(t0, S[first.rest][:, ::-1], m)  # reversed S: column l is N - l
            if round_trip is not None:
                back = np.minimum(round_trip.backward_ms[first.c][:, None] * counts[None, :], t0)
                tot = round_trip.totals
                value = np.maximum(value, _trip(t0, back, m, tot.beyond[first.rest][:, ::-1],
                                                [e[first.rest][:, ::-1] for e in tot.exact]))
            value = value.min(axis=1)
        starts = np.r_[0, np.nonzero(np.diff(first.a))[0] + 1]
        phi[first.a[starts]] = np.minimum(phi[first.a[starts]], np.minimum.reduceat(value, starts))
    phi[0] = math.inf
    return least_within(phi, dims)


def _chained(t: np.ndarray, after: np.ndarray, m: int) -> np.ndarray:
    """Eq. 1's chain for a front stage of time ``t`` before a rest whose largest term is ``after``, counted from the
    front stage's start: t + max((m - 1) t, after)."""
    # fmax: (m - 1) t is nan where t is inf and m = 1; such a stage is out of play anyway (t + ... = inf)
    return t + np.fmax((m - 1) * t, after)


def _trip(t: np.ndarray, back: np.ndarray, m: int, beyond: np.ndarray, exact: list) -> np.ndarray:
    """Eq. 1r's term of a stage of time ``t`` and backward ``back`` (at most t) before suffixes whose least sums of j
    stages are ``exact[j - 1]`` and of K or more ``beyond``: the least over j of (m - k) t + k B + that sum, k + 1 the
    forwards 1F1B runs on a stage with j stages after it before its first backward (min(j, m - 1)), and for K or more
    m - 1, the most (a stage runs m forwards in all)."""
    trip = t + (m - 1) * back + beyond
    for j, e in enumerate(exact, start=1):
        k = forwards_before_first_backward(j + 1, m, 0) - 1
        trip = np.minimum(trip, (m - k) * t + k * back + e)
    return trip


def _trip_join(round_trip: RoundTrip, m: int):
    """``_over_middles``' join where a middle stage also pays its round trip (eq. 1r, the first stage's form counted
    from the suffix's start): each front stage (c, l) is charged the larger of eq. 1's t + max((m - 1) t, S) and eq.
    1r's least over the suffix's stage counts (``_trip``), B = l times the backward floor, at most t."""
    tot = round_trip.totals

    def at(c: np.ndarray, rest: np.ndarray):
        per_back = round_trip.backward_ms[c][:, None]
        exact, beyond = [e[rest] for e in tot.exact], tot.beyond[rest]

        def join(t, l, after):
            w = after.shape[1]
            trip = _trip(t, np.minimum(per_back * l, t), m, beyond[:, :w], [e[:, :w] for e in exact])
            return np.maximum(_chained(t, after, m), trip)
        return join
    return at


def least_on_node(classes: list[DeviceClass], grid: np.ndarray) -> np.ndarray:
    """Per replica vector a and class k: the fewest of a's devices on the node of a device of class k in a (at least
    that device). A node kind's nodes each hold ``per_node`` devices of each of its classes, so a's a_j devices of a
    class j of that kind leave at least a_j - (nodes - 1) per_node_j on any one of its nodes."""
    out = np.zeros(grid.shape, dtype=np.int64)
    for k, c in enumerate(classes):
        nodes = c.count // c.per_node
        for j, other in enumerate(classes):
            if other.node_kind == c.node_kind:
                out[:, k] += np.maximum(grid[:, j] - (nodes - 1) * other.per_node, 1 if j == k else 0)
    return out


def sync_lines(spec: ModelSpec, classes: list[DeviceClass], grid: np.ndarray,
               holders: int) -> tuple[np.ndarray, np.ndarray]:
    """Per replica vector a and class k: (alpha, beta), the line under the sync of a device of class k in a replica
    of a in every plan of ``holders`` or more replicas (rule 13): a device holding P_d parameters pays at least
    alpha P_d + beta, the line of a group of that many holders over the fastest link d could reach another replica's
    holder by. That is d's node's intra link only where the other replicas' holders of d's parameters (one each, none
    of them a's) fit on d's node beside a's own devices there (``least_on_node``): a replica that fills its node leaves
    no room for them, and d then reaches some holder over its NIC. inf where neither link exists: no plan has this
    many replicas with that class."""
    line = _sync_line(spec, holders)
    on_node = least_on_node(classes, grid)
    alpha = np.full(grid.shape, math.inf)
    beta = np.full(grid.shape, math.inf)
    for k, c in enumerate(classes):
        nic = line(c.nic) if c.nic is not None else (math.inf, math.inf)
        alpha[:, k], beta[:, k] = nic
        if c.intra is not None:
            fits = holders - 1 <= c.node_devices - on_node[:, k]
            intra = line(c.intra)
            alpha[fits, k] = min(intra[0], nic[0])
            beta[fits, k] = min(intra[1], nic[1])
    return alpha, beta


def sync_floor(spec: ModelSpec, grid: np.ndarray, lines: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """For every replica vector a: a lower bound on T_dp (eq. 13, 15; the ring passes of eq. 16-17 at stages 2 and 3)
    in the plans ``lines`` (``sync_lines``) holds for: each device d holding P_d parameters pays at least
    alpha P_d + beta, and the replica's devices hold every layer between them. The least T at which they could, by
    bisection from below."""
    alpha, beta = lines
    need = spec.num_layers * layer_param_count(spec, 1.0)
    counts = grid.astype(float)

    def held(T):
        with np.errstate(invalid="ignore", divide="ignore"):
            each = np.where(np.isfinite(alpha) & (T[:, None] > beta), (T[:, None] - beta) / alpha, 0.0)
        return (counts * each).sum(1)

    lo = np.zeros(len(grid))
    hi = np.full(len(grid), max(1.0, float(np.nanmax(np.where(np.isfinite(beta), beta, 0.0))) + 1.0))
    usable = (counts * np.isfinite(alpha)).sum(1) > 0
    for _ in range(200):
        short = usable & (held(hi) < need)
        if not short.any():
            break
        hi[short] *= 2
    for _ in range(80):
        mid = (lo + hi) / 2
        ok = held(mid) >= need
        lo, hi = np.where(ok, lo, mid), np.where(ok, mid, hi)
    return np.where(usable, lo, math.inf)


def held_counts(T: float, grid: np.ndarray, lines: tuple[np.ndarray, np.ndarray], rates: HeldRates, need: float,
                top: int) -> np.ndarray:
    """Per replica vector: the most micro-batches m (at most ``top``) a replica of it could run within T when its
    devices must also sync what they hold (solver/README.md, step 4, "Holding costs compute"). T - T_opt >= T_pipe +
    T_dp, T_pipe is at least each device's compute and T_dp each device's sync (``sync_lines``), so a device of class k
    holding P_d layer parameters and a share u of an edge has m kappa P_d + m u epsilon + alpha (P_d + u E) + beta <= T
    (``HeldRates``). Its layer parameters are so at most (T - beta - u (m epsilon + alpha E)) / w, w = m kappa + alpha;
    the replica's devices hold every layer (``need``) and each edge at shares adding up to one, on one stage or two,
    so sum_d (T - beta) / w - loss >= need, the loss at least min_d (m epsilon + alpha E) / w per edge. With each loss
    taken at its least over counts from m up (a ratio of two lines is monotone in m: at m or at ``top``) the left side
    falls as m grows, so bisection finds the largest m where that holds, at or above every m where the condition
    does; from there down, counts where the condition itself fails are dropped (``SCAN`` at most). 0 where it fails
    at m = 0."""
    alpha, beta = lines
    present = grid > 0
    room = np.where(present & np.isfinite(alpha) & (T > beta), T - beta, 0.0)
    need = need * (1 - 1e-12)  # generous: a bound from below must not lose a count to rounding

    def per_param(m, per_micro_batch):
        """m times a per-class figure, per vector and class (0 at m = 0, where an inf figure would give nan)."""
        return np.where(m[:, None] > 0, m[:, None] * per_micro_batch[None, :], 0.0)

    def per_device(m, eps, rows):
        """Per vector and class: (m eps + alpha rows) / w at count m (inf where the class is absent)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            spent = per_param(m, eps) + alpha * rows
            return np.where(present & np.isfinite(alpha), spent / (per_param(m, rates.layer_ms) + alpha), math.inf)

    def loss(m, at_top):
        """The least the edges take of the layers' room at count m; with ``at_top``, each term at its least over m and
        ``top``."""
        least = [per_device(m, eps, rows) for eps, rows in zip(rates.edge_ms, rates.edge_rows)]
        if at_top is not None:
            least = [np.minimum(x, y) for x, y in zip(least, at_top)]
        least = [x.min(1) for x in least]
        return np.minimum(least[0] + least[1], least[2])

    tops = np.full(len(grid), float(top))
    at_top = [per_device(tops, eps, rows) for eps, rows in zip(rates.edge_ms, rates.edge_rows)]

    def ok(m, envelope=at_top):
        with np.errstate(invalid="ignore", divide="ignore"):
            each = np.where(room > 0, room / (per_param(m, rates.layer_ms) + alpha), 0.0)
        return (grid * each).sum(1) - loss(m, envelope) >= need

    lo = np.zeros(len(grid))
    hi = tops.copy()
    ok_top = ok(hi)
    while True:
        open_ = ~ok_top & (hi - lo > 1)
        if not open_.any():
            break
        mid = np.floor((lo + hi) / 2)
        good = ok(mid)
        lo = np.where(open_ & good, mid, lo)
        hi = np.where(open_ & ~good, mid, hi)
    most = np.where(ok_top, tops, np.where(ok(np.zeros(len(grid))), lo, 0.0))
    for _ in range(SCAN):
        short = (most > 0) & ~ok(most, None)
        if not short.any():
            break
        most = np.where(short, most - 1, most)
    return most


def _micro_batch_buckets(most: int, exact: int = 16) -> list[tuple[int, int]]:
    """Micro-batch counts one by one up to ``exact``, then in buckets a quarter wide (past 16: 17-21, 22-27, ...): a bucket is
    priced at its largest count, where F is largest (it grows with q = 1 - 1/m); with whole layers, the chain at that
    count is scaled down to each count of the bucket (``chain_floor`` grows no faster than m)."""
    out, lo = [], 1
    while lo <= most:
        hi = min(most, lo if lo <= exact else max(lo, (lo * 5) // 4))
        out.append((lo, hi))
        lo = hi + 1
    return out


def _replica_buckets(most: int) -> list[tuple[int, int]]:
    """Replica counts 2, 3-4, 5-8, 9-16, ...: a bucket's sync is priced at its fewest holders."""
    out, lo = [], 2
    while lo <= most:
        hi = min(most, 2 * lo - 2 if lo > 2 else lo)
        out.append((lo, hi))
        lo = hi + 1
    return out


def micro_batch_sizes(cluster: ClusterSpec, profiles: ProfileSet, global_batch: int, micro_batch: int | None) -> list[int]:
    """Every micro-batch size a replica of some of the cluster's GPUs may run (``search.replica_micro_batches``: those
    every table of its GPUs holds, up to the global batch; the one given, when given): the sizes any table holds.
    ``stage_rates`` gives a stage no rate at a size one of its classes lacks."""
    if micro_batch is not None:
        return [micro_batch]
    return sorted({b for g in cluster.gpu_types for b in profiles[g].micro_batches("qkv") if b <= global_batch})


@dataclass(frozen=True, slots=True)
class SizeTerms:
    """What the bound reads at one micro-batch size b, per composition or replica vector."""

    rates: np.ndarray
    """rho(c) (``stage_rates``)."""
    layer_ms: np.ndarray
    """b / rho(c): a layer's least time per micro-batch, ms; inf where no such stage exists."""
    edges: tuple[np.ndarray, np.ndarray, np.ndarray]
    """The embedding's, the head's and both edges' floors per micro-batch, ms (``edge_floors``)."""
    sample_layers: np.ndarray
    """N + E(a): the layers a sample costs a replica of each vector (``edge_layers``)."""
    chain: ChainPairs
    """The pairs ``chain_floor`` tries."""
    backward_ms: np.ndarray
    """A layer's least backward per micro-batch, ms (``backward_floors``)."""
    held: "HeldRates"
    """Per class, its least compute per parameter it holds (``held_rates``)."""


def size_terms(spec: ModelSpec, profiles: ProfileSet, classes: list[DeviceClass], grid: np.ndarray, pairs: _Pairs,
               micro_batch: int) -> SizeTerms:
    """``SizeTerms`` at ``micro_batch``."""
    rates = stage_rates(spec, profiles, classes, grid, micro_batch)
    layer_ms = np.where(rates > 0, micro_batch / np.where(rates > 0, rates, 1.0), math.inf)
    edges = edge_floors(spec, profiles, classes, grid, micro_batch)
    dims = [c.count + 1 for c in classes]
    backward_ms = backward_floors(spec, profiles, classes, grid, micro_batch, layer_ms)
    return SizeTerms(rates=rates, layer_ms=layer_ms, edges=edges,
                     sample_layers=spec.num_layers + edge_layers(layer_ms, *edges, dims),
                     chain=chain_pairs(pairs, layer_ms, dims, grid.sum(1), edges[0], backward_ms),
                     backward_ms=backward_ms,
                     held=held_rates(spec, profiles, classes, micro_batch))


@dataclass(frozen=True, slots=True)
class HeldRates:
    """What a device's compute per micro-batch is at least, per class, against what it holds (``held_counts``);
    inf where the class's table lacks the size."""

    layer_ms: np.ndarray
    """kappa: the least of t(b, u) / P(u) over the shares u a plan can give, t a layer's forward and backward at
    micro-batch b with nothing recomputed (``costmodel.layer_train_ms``), P(u) the layer parameters a rank at share u
    holds (``costmodel.layer_param_count``), ms per parameter. A device holding P_d layer parameters in a stage of any
    layers at any share spends at least kappa P_d (recomputation and the rest only add)."""
    edge_ms: tuple[np.ndarray, np.ndarray, np.ndarray]
    """epsilon of the embedding, of the final norm, head and loss, and of both on one rank: the least of e(b, u) / u
    over the vocabulary shares (``costmodel.edge_train_ms``), ms per whole vocabulary. A rank at share u spends at
    least u epsilon."""
    edge_rows: tuple[float, float, float]
    """E: the parameters of the embedding, the head and both on one rank that a rank holds in proportion to its
    vocabulary share (``costmodel.edge_param_count``'s split part: a tied head on its own stage keeps a copy of the
    rows, on the embedding's stage none)."""


def held_rates(spec: ModelSpec, profiles: ProfileSet, classes: list[DeviceClass], micro_batch: int) -> HeldRates:
    """``HeldRates`` at ``micro_batch``."""
    holds = _holds(profiles, classes, micro_batch)
    shares = plan_shares(spec)

    def per_class(cost) -> np.ndarray:
        return np.array([min(cost(profiles[c.gpu], u) for u in shares) if holds[k] else math.inf
                         for k, c in enumerate(classes)])

    b = micro_batch
    roles = ((True, False), (False, True), (True, True))
    # The part of the edges' parameters that grows with the share (the cost model's count at share 1 less at 0).
    rows = tuple(edge_param_count(spec, 1.0, first=f, last=la) - edge_param_count(spec, 0.0, first=f, last=la)
                 for f, la in roles)
    return HeldRates(layer_ms=per_class(lambda prof, u: layer_train_ms(prof, spec, b, u) / layer_param_count(spec, u)),
                     edge_ms=tuple(per_class(lambda prof, u, f=f, la=la: edge_train_ms(prof, spec, b, u, first=f,
                                                                                        last=la) / u)
                                   for f, la in roles),
                     edge_rows=rows)


def relaxation_bound(spec: ModelSpec, cluster: ClusterSpec, profiles: ProfileSet, global_batch: int,
                     micro_batches: list[int], optimizer_ms: float, *, deadline_s: float = math.inf) -> ReplicaBound | None:
    """Eq. 12c over plans of 1F1B (one chunk) or layered replicas whose micro-batch sizes are among ``micro_batches``
    (``micro_batch_sizes`` gives the search's); None where the programme is too large (``MAX_PAIRS``, ``MAX_DEVICES``)
    or the deadline (or a stop) came first. ``optimizer_ms`` is eq. 12b's Adam step, which follows everything else in
    every schedule. The chain with whole layers (``chain_floor``) is priced after the bound without it, within
    ``CHAIN_WORK`` and the time left; the higher of the two is returned."""
    t0 = time.perf_counter()
    classes = device_classes(cluster)
    if pair_count(classes) > MAX_PAIRS or len(cluster.devices) > MAX_DEVICES or stop.past(deadline_s):
        return None
    grid = class_grid(classes)
    pairs = _pairs(classes, grid)
    sized = {}
    for b in micro_batches:
        if stop.past(deadline_s):
            return None
        sized[b] = size_terms(spec, profiles, classes, grid, pairs, b)
    capacity: dict[tuple[int, tuple[int, int]], np.ndarray] = {}  # F per (b, bucket), shared by the two passes
    found = _least_pipeline_ms(spec, classes, grid, pairs, sized, capacity, global_batch, False, deadline_s)
    if found is None:
        return None
    trip = _round_trip_choice(sized, pairs, [c.count + 1 for c in classes], grid.sum(1), spec.num_layers, global_batch)
    whole_layers = round_trip = False
    if trip is not None:
        sharper = _least_pipeline_ms(spec, classes, grid, pairs, sized, capacity, global_batch, True, deadline_s, trip)
        if sharper is not None:  # past the deadline the bound without whole layers stands
            whole_layers, round_trip = True, bool(trip.stages)
            # Never lower but for the bisection's tolerance: one more condition per replica.
            found = max(found, sharper)
    best, where = found
    return ReplicaBound(bound_ms=best + optimizer_ms, pipeline_ms=best, optimizer_ms=optimizer_ms, replicas=where,
                        whole_layers=whole_layers, round_trip=round_trip, seconds=time.perf_counter() - t0)


@dataclass(frozen=True, slots=True)
class _TripChoice:
    """How much of the round trip (eq. 1r) whole layers price, within ``CHAIN_WORK``."""

    stages: dict[int, int]
    """Per micro-batch size, K of its ``suffix_totals``; empty: no round trip."""
    middles: dict[int, _Pairs] | None
    """Per micro-batch size, the middle pairs that pay it too (``trip_middles``); None: only the first stage pays it."""
    work: int
    """Steps of whole layers with it (``ChainPairs.work``, ``suffix_work``)."""


def _round_trip_choice(sized: dict[int, "SizeTerms"], pairs: _Pairs, dims: list[int], totals: np.ndarray,
                       num_layers: int, global_batch: int) -> _TripChoice | None:
    """The most of the round trip whole layers can price within ``CHAIN_WORK``: every stage's but the last at K =
    ``ROUND_TRIP_STAGES`` (or the largest micro-batch count less one, if fewer), halved until it fits, else the first
    stage's the same way, else none; None where whole layers alone do not fit. Whole layers take one ``chain_floor``
    per size and count bucket (F is the first pass's). The round trip adds one ``suffix_totals`` per size and K terms
    per first pair, count bucket and layer count; with the middles, the chain's pass over ``ChainPairs.middle`` becomes
    one of K + 1 terms a step over ``trip_middles``' pairs (built here, so only where whole layers fit)."""
    N = num_layers
    buckets = {b: len(_micro_batch_buckets(global_batch // b)) for b in sized}
    work = sum(buckets[b] * x.chain.work(N) for b, x in sized.items())
    if work > CHAIN_WORK:
        return None
    steps = N * (N + 1) // 2
    middles = {b: trip_middles(pairs, x.layer_ms, x.backward_ms, dims, totals) for b, x in sized.items()}
    for paying in (middles, None):
        K = ROUND_TRIP_STAGES
        while K >= 1:
            per = {b: max(1, min(K, global_batch // b - 1)) for b in sized}
            trip = sum(suffix_work(x.chain, N, per[b]) + buckets[b] * per[b] * len(x.chain.first.a) * (N + 1)
                       for b, x in sized.items())
            if paying is not None:
                trip += sum(buckets[b] * ((per[b] + 1) * len(paying[b].a) - len(x.chain.middle.a)) * steps
                            for b, x in sized.items())
            if work + trip <= CHAIN_WORK:
                return _TripChoice(stages=per, middles=paying, work=work + trip)
            K //= 2
    return _TripChoice(stages={}, middles=None, work=work)


def _least_pipeline_ms(spec: ModelSpec, classes: list[DeviceClass], grid: np.ndarray, pairs: _Pairs,
                       sized: dict[int, SizeTerms], capacity: dict, global_batch: int, whole_layers: bool,
                       deadline_s: float, trip_choice: _TripChoice | None = None
                       ) -> tuple[float, tuple[int, int]] | None:
    """Steps 3-5 of the proof: the least T - T_opt at which the replicas could train the global batch, and the bucket
    of replica counts where it was found; with eq. 1's chain over whole layers where ``whole_layers``, and with the
    round trip as ``trip_choice`` says. ``capacity`` keeps F per (b, bucket) between calls. None past the deadline."""
    G, N, size = global_batch, spec.num_layers, len(grid)
    dims = [c.count + 1 for c in classes]
    buckets = {b: _micro_batch_buckets(G // b) for b in sized}
    phi_of: dict[tuple[int, tuple[int, int]], np.ndarray] = {}  # (b, bucket) -> Phi at the bucket's largest count
    for b, x in sized.items():
        trip = None
        if whole_layers and trip_choice is not None and trip_choice.stages:
            totals = suffix_totals(x.layer_ms, x.edges[1], x.chain, dims, N, trip_choice.stages[b], deadline_s)
            if totals is None:
                return None
            trip = RoundTrip(backward_ms=x.backward_ms, totals=totals,
                             middles=None if trip_choice.middles is None else trip_choice.middles[b])
        for bucket in buckets[b]:
            if (b, bucket) not in capacity:
                F = pipeline_capacity(x.rates, pairs, size, 1.0 - 1.0 / bucket[1], deadline_s)
                if F is None:
                    return None
                capacity[b, bucket] = F
            if whole_layers:
                phi = chain_floor(x.layer_ms, *x.edges, x.chain, dims, N, bucket[1], deadline_s, trip)
                if phi is None:
                    return None
                phi_of[b, bucket] = phi

    def samples(T: float, floor: np.ndarray, lines: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
        """Per vector, the most samples a replica of it could train with its pipeline and sync within T: m b with
        m b (N + E(a)) <= (T - sync) F(a) (F at the largest count of m's bucket, so never less than m's own) and, with
        whole layers, Phi_m(a) <= T - sync, where Phi_m >= (m / hi) Phi_hi (the chain at the bucket's largest count;
        solver/README.md, step 3, "Whole layers")."""
        best = np.zeros(size)
        room = np.maximum(T - floor, 0.0)

        def most(count):
            """The whole counts up to ``count``, rounded generously (a bound from below must not lose one to
            rounding); nan (0 / 0) as none, inf as no limit."""
            with np.errstate(invalid="ignore"):
                return np.nan_to_num(np.floor(count * (1 + 1e-12) + 1e-9), posinf=math.inf)

        for b, bucket_list in buckets.items():
            held = math.inf if lines is None else held_counts(T, grid, lines, sized[b].held, need, G // b)
            for lo, hi in bucket_list:
                with np.errstate(invalid="ignore", divide="ignore"):
                    m = np.minimum(np.minimum(hi, held), most(room * capacity[b, (lo, hi)] / (b * sized[b].sample_layers)))
                    if whole_layers:
                        m = np.minimum(m, most(hi * room / phi_of[b, (lo, hi)]))
                best = np.maximum(best, np.where(m >= lo, b * m, 0.0))
        return np.minimum(best, G)

    def least(feasible, start: float, cap: float = math.inf) -> float | None:
        """The least T at which ``feasible`` holds, from below (the bound stays valid whatever the rounding); ``cap``
        where it does not hold at ``cap`` (only a least under it matters)."""
        if math.isfinite(cap) and not feasible(cap):
            return cap
        lo, hi = 0.0, min(max(start, 1e-3), cap)
        while not feasible(hi):
            if stop.past(deadline_s) or hi > NEVER_MS:
                return None  # past NEVER_MS no count of the sizes adds up to the batch: claim nothing
            lo, hi = hi, hi * 2
        while hi - lo > 1e-7 * hi:
            if stop.past(deadline_s):
                return None
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if feasible(mid) else (mid, hi)
        return lo

    full = int(np.nonzero((grid == [c.count for c in classes]).all(1))[0][0])
    no_sync = np.zeros(size)
    guess = N * G / max(1e-12, float(max(F[full] for F in capacity.values())))
    best = least(lambda T: samples(T, no_sync)[full] >= G, guess)  # one replica: every device, the whole batch
    if best is None:
        return None
    where = (1, 1)
    avail = np.array([c.count for c in classes], dtype=float)
    n_devices = int(avail.sum())
    need = N * layer_param_count(spec, 1.0)
    for r_lo, r_hi in _replica_buckets(min(G, n_devices)):
        lines = sync_lines(spec, classes, grid, r_lo)
        floor = sync_floor(spec, grid, lines)
        value = least(lambda T: _replicas_lp(samples(T, floor, lines), grid, avail, r_lo, r_hi) >= G * (1 - 1e-9),
                      best / 2, cap=best)
        if value is None:
            return None
        if value < best:
            best, where = value, (r_lo, r_hi)
    return best, where


def _replicas_lp(samples: np.ndarray, grid: np.ndarray, avail: np.ndarray, r_lo: int, r_hi: int) -> float:
    """max sum_a x_a g_a over x >= 0 with sum_a x_a a <= the cluster's counts and r_lo <= sum_a x_a <= r_hi: every
    plan of r replicas in the bucket gives a feasible x (its replicas' vectors), so its samples are at most this."""
    cols = np.nonzero(samples > 0)[0]
    if len(cols) == 0:
        return 0.0
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    inf = highspy.kHighsInf
    n = len(cols)
    h.addVars(n, np.zeros(n), np.full(n, inf))
    h.changeColsCost(n, np.arange(n, dtype=np.int32), -samples[cols])
    index = np.arange(n, dtype=np.int32)
    for k in range(grid.shape[1]):
        h.addRow(-inf, float(avail[k]), n, index, grid[cols, k].astype(float))
    h.addRow(float(r_lo), float(r_hi), n, index, np.ones(n))
    h.run()
    status = h.getModelStatus()
    if status == highspy.HighsModelStatus.kInfeasible:
        return 0.0
    if status != highspy.HighsModelStatus.kOptimal:
        return math.inf  # not proven infeasible: T may suffice, and a bound from below must allow it
    return -h.getInfo().objective_function_value
