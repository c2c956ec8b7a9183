"""The outer level: which device layouts (skeletons) the search visits.

Two families:

* ``exact_skeletons``: every way to pick devices, cut them into ordered TP groups (rank order included)
  and order the groups into pipelines, 1..k replicas of any shapes (each its own stage count and group
  sizes), modulo swapping interchangeable devices and reordering replicas. Devices are interchangeable when they share node, GPU type, memory and reserve: every cost of
  the model depends on a device only through those and through which node it is on, so swapping two
  such devices maps a plan to one with the same time and memory. Within a TP group whose devices all sit
  on one node, rank order changes nothing either (all links from or to the group are the same whatever
  the order, and the p2p rule only counts receivers per sender), so those groups are enumerated sorted.
  Replica order never matters (max over replicas, symmetric all-reduce).
* ``structured_skeletons`` (large clusters): a heuristic family, stated precisely in its docstring.
"""
from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import dataclass, field

from baton.cluster import ClusterSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class Skeleton:
    """Device layout without numbers: replicas, each a list of stages, each a TP group in rank order."""

    pipelines: tuple[tuple[tuple[str, ...], ...], ...]
    one_shape: bool = field(init=False, compare=False, repr=False)
    """Every replica has the same number of stages and the same TP group sizes stage by stage: the peer groups
    are then the (stage, rank) positions when the replicas share one layer split and units (the MILP's case).
    Computed once: bounds ask it of every candidate, and a skeleton may hold 1,024 devices."""

    def __post_init__(self):
        object.__setattr__(self, "one_shape", len({tuple(len(g) for g in pipe) for pipe in self.pipelines}) == 1)

    @property
    def num_replicas(self) -> int:
        return len(self.pipelines)

    @property
    def num_stages(self) -> int:
        """Stages of replica 0 (of every replica when ``one_shape``)."""
        return len(self.pipelines[0])

    def device_ids(self) -> list[str]:
        return [d for p in self.pipelines for s in p for d in s]

    def describe(self) -> str:
        return " | ".join(" -> ".join("[" + ",".join(s) + "]" for s in p) for p in self.pipelines)


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceClass:
    key: tuple
    """(node, gpu, memory_bytes, reserve_bytes)."""
    ids: tuple[str, ...]
    """Its devices, in cluster order."""

    @property
    def node(self) -> str:
        return self.key[0]

    @property
    def gpu(self) -> str:
        return self.key[1]


def device_classes(cluster: ClusterSpec) -> list[DeviceClass]:
    groups: dict[tuple, list[str]] = {}
    for d in cluster.devices:
        groups.setdefault((d.node, d.gpu.name, d.memory_bytes, d.reserve_bytes), []).append(d.id)
    return [DeviceClass(key=k, ids=tuple(v)) for k, v in groups.items()]


def _stages_from(counts: tuple[int, ...], classes: list[DeviceClass], max_group: int | None):
    """Every TP group (ordered tuple of class indices) that ``counts`` can supply, canonical order only."""
    avail = [c for c, n in enumerate(counts) for _ in range(n)]
    seen = set()
    limit = len(avail) if max_group is None else min(len(avail), max_group)
    for size in range(1, limit + 1):
        for combo in set(itertools.combinations(avail, size)):
            nodes = {classes[c].node for c in combo}
            orders = [tuple(sorted(combo))] if len(nodes) == 1 else set(itertools.permutations(combo))
            for o in orders:
                if o not in seen:
                    seen.add(o)
                    yield o


def _pipelines(counts: tuple[int, ...], classes, max_group, max_stages):
    """Sequences of at most ``max_stages`` groups drawn from ``counts``, with the counts left over."""
    for stage in _stages_from(counts, classes, max_group):
        rest = list(counts)
        for c in stage:
            rest[c] -= 1
        rest = tuple(rest)
        yield (stage,), rest
        if max_stages > 1:
            for tail, left in _pipelines(rest, classes, max_group, max_stages - 1):
                yield (stage,) + tail, left


def exact_skeletons(cluster: ClusterSpec, *, max_stages: int, max_group: int | None = None, limit: int = 200_000) -> list[Skeleton] | None:
    """All skeletons modulo interchangeable devices, or None if there are more than ``limit``."""
    classes = device_classes(cluster)
    counts = tuple(len(c.ids) for c in classes)
    found = set()

    def extend(replicas, left):
        key = tuple(sorted(replicas))
        if key in found:
            return
        found.add(key)
        if len(found) > limit:
            raise OverflowError
        for pipe, rest in _pipelines(left, classes, max_group, max_stages):
            if pipe >= replicas[-1]:  # replicas generated in sorted order: each set once
                extend(replicas + (pipe,), rest)

    try:
        for pipe, rest in _pipelines(counts, classes, max_group, max_stages):
            extend((pipe,), rest)
    except OverflowError:
        return None
    return [_realise(key, classes) for key in sorted(found)]


def _realise(replicas, classes: list[DeviceClass]) -> Skeleton:
    """Class indices -> concrete device ids, taking each class's devices in cluster order."""
    nxt = Counter()
    pipes = []
    for pipe in replicas:
        stages = []
        for stage in pipe:
            ids = []
            for c in stage:
                ids.append(classes[c].ids[nxt[c]])
                nxt[c] += 1
            stages.append(tuple(ids))
        pipes.append(tuple(stages))
    return Skeleton(pipelines=tuple(pipes))


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeKind:
    """Nodes with the same devices (type, memory, reserve, count), the same intra-node link and NIC, and the same host
    links and host memory."""

    nodes: tuple[str, ...]
    """Its nodes, in cluster order."""
    layout: tuple
    """((gpu, memory, reserve, count), ...) of one node, sorted."""
    link: tuple = ()
    """(intra-node link, NIC, (GPU type, host link) pairs, host memory bytes or None) of one node."""

    @property
    def key(self) -> str:
        """Everything the cost model sees of one of its nodes (layout and links), as a sortable string."""
        return repr((self.layout, self.link))


def node_kinds(cluster: ClusterSpec) -> list[NodeKind]:
    """Nodes grouped by everything the cost model sees of them: their devices, intra-node link and NIC.
    Nodes of one kind are interchangeable: swapping two maps every plan to one priced the same. In the
    order of the cluster file (``canonical_kinds``: in an order that does not depend on it)."""
    per_node: dict[str, list] = {}
    host_links: dict[str, set] = {}
    for d in cluster.devices:
        per_node.setdefault(d.node, []).append((d.gpu.name, d.memory_bytes, d.reserve_bytes))
        host_links.setdefault(d.node, set()).add((d.gpu.name, d.host_link_gb_per_s))
    kinds: dict[tuple, list[str]] = {}
    for node, devs in per_node.items():
        # The host side too (eq. 2o, 8o): nodes that differ in their host links or host memory are not interchangeable.
        link = (cluster.intra_links[node], cluster.nics.get(node, cluster.inter_link), tuple(sorted(host_links[node])),
                cluster.host_memory.get(node))
        layout = tuple(sorted(Counter(devs).items()))
        kinds.setdefault((layout, link), []).append(node)
    return [NodeKind(nodes=tuple(v), layout=tuple((g, mem, res, n) for (g, mem, res), n in k[0]), link=k[1])
            for k, v in kinds.items()]


def canonical_kinds(cluster: ClusterSpec) -> list[NodeKind]:
    """``node_kinds`` sorted by ``NodeKind.key``: permuting the nodes (or a node's GPU entries) of the cluster file
    gives the same kinds in the same order, each with its nodes renamed."""
    return sorted(node_kinds(cluster), key=lambda k: k.key)


def replica_pattern(cluster: ClusterSpec, pipe) -> tuple:
    """A replica up to interchangeable nodes: per device in stage and rank order, (its node relabelled by
    first appearance, the node's kind, the device's GPU, memory and reserve). Two replicas with one
    pattern are the same replica on other nodes of the same kinds, so every cost of theirs is equal."""
    info = _device_info(cluster)
    label: dict[str, int] = {}
    out = []
    for stage in pipe:
        row = []
        for i in stage:
            node, rest = info[i]
            row.append((label.setdefault(node, len(label)), rest))
        out.append(tuple(row))
    return tuple(out)


_KINDS: dict[int, tuple[ClusterSpec, dict[str, tuple]]] = {}


def _device_info(cluster: ClusterSpec) -> dict[str, tuple]:
    """Device id -> (node, (node kind, GPU, memory, reserve)), memoised per cluster object (the spec holds
    dicts, so it has no hash)."""
    hit = _KINDS.get(id(cluster))
    if hit is None or hit[0] is not cluster:
        if len(_KINDS) >= 32:
            _KINDS.clear()
        kind = {n: k for k, nk in enumerate(node_kinds(cluster)) for n in nk.nodes}
        hit = _KINDS[id(cluster)] = (cluster, {d.id: (d.node, (kind[d.node], d.gpu.name, d.memory_bytes, d.reserve_bytes))
                                               for d in cluster.devices})
    return hit[1]


_CODES: dict[int, tuple[ClusterSpec, dict[str, int], dict[str, int]]] = {}


def device_codes(cluster: ClusterSpec) -> tuple[dict[str, int], dict[str, int]]:
    """Device id -> its node's number, and device id -> the number of its (node kind, GPU, memory, reserve),
    memoised per cluster object like ``_device_info``."""
    hit = _CODES.get(id(cluster))
    if hit is None or hit[0] is not cluster:
        if len(_CODES) >= 32:
            _CODES.clear()
        info = _device_info(cluster)
        nodes: dict[str, int] = {}
        classes: dict[tuple, int] = {}
        hit = _CODES[id(cluster)] = (cluster, {d: nodes.setdefault(n, len(nodes)) for d, (n, _) in info.items()},
                                     {d: classes.setdefault(c, len(classes)) for d, (_, c) in info.items()})
    return hit[1], hit[2]


def symmetry_key(cluster: ClusterSpec, sk: Skeleton) -> tuple:
    """A skeleton up to interchangeable nodes and devices: its replicas sorted by their group sizes and the
    (node kind, GPU, memory, reserve) of each device, then every device's node relabelled by first appearance over
    the whole skeleton. Two skeletons with one key differ by renaming nodes within kinds, swapping devices of one
    node and type and reordering replicas, so each plan of one is a plan of the other priced the same (rules 1
    and 6). Equivalent skeletons may still have two keys (replicas alike but for their nodes keep their order)."""
    node, cls = device_codes(cluster)

    def replica(pipe) -> tuple:
        return tuple(len(st) for st in pipe), tuple(map(cls.__getitem__, itertools.chain.from_iterable(pipe)))

    keyed = sorted(zip(map(replica, sk.pipelines), range(len(sk.pipelines))))
    nodes = [node[d] for _, i in keyed for st in sk.pipelines[i] for d in st]
    first = {n: i for i, n in enumerate(dict.fromkeys(nodes))}
    return tuple(r for r, _ in keyed), tuple(map(first.__getitem__, nodes))


def structured_skeletons(cluster: ClusterSpec, *, heads: int, max_stages: int) -> list[Skeleton]:
    """Every skeleton of the structured family (see ``iter_structured_skeletons``), as a list."""
    return list(iter_structured_skeletons(cluster, heads=heads, max_stages=max_stages))


def _tp_sizes(count: int, heads: int) -> list[int]:
    return [q for q in range(1, count + 1) if count % q == 0 and heads % q == 0]


def iter_structured_skeletons(cluster: ClusterSpec, *, heads: int, max_stages: int):
    """A heuristic family for clusters too large to enumerate. Up to renaming nodes within a node kind and
    devices within a node and type, it does not depend on the order of the cluster file's nodes or GPU entries
    (kinds are taken in ``canonical_kinds`` order, and every order is tried wherever one matters). What it gives
    up, precisely:

    * TP groups hold devices of one node and one type (a node's devices of that type cut into equal
      groups of size n, n dividing both that count and the head count; every node of a kind is cut the
      same way; a type of a mixed node may be left idle, or only some of its groups used, the rest of its
      devices idle). Exception: the layouts of the baselines below.
    * Nodes of a kind are used all or none. Every replica has one shape (stage count and group sizes). With
      r replicas, either each used kind's groups (nodes in cluster order, a node's groups consecutive) are cut
      into r consecutive blocks of equal count, one per replica, each block whole nodes or part of one node
      ("spread": r dividing every used kind's group count, the block size a multiple or a divisor of a node's
      group count), or every node's groups of each type are split evenly among them ("share").
    * A pipeline runs through the used node kinds in some order (every order is tried), a kind's groups
      consecutive in the order above (in a mixed node, every type order is tried). A pipeline of one replica may
      also run a mixed node's groups in any order of their types (``_interleavings``, up to ``INTERLEAVE_LIMIT``
      orders), and start with any one group of its last kind's, so that its first and last stages can share a node
      (the tied embedding's sync between them then stays inside the node).
    * Plus the baselines' layouts over canonically ordered devices (kinds in every order, a node's types in
      every order, nodes of a kind and devices of a node and type in cluster order): Megatron's TP-DP-PP rank
      order over the devices of some GPU types, HetHub's one-type stages, HAP's single group. Megatron's and
      HetHub's own layouts (over the devices in cluster order) are among them when the cluster file lists the
      nodes of each kind together and the nodes of a kind list their GPU entries alike (one entry per type,
      memory and reserve, in one order), so neither baseline is then better than Baton by more than the
      requested gap.
    Skeletons with one ``symmetry_key`` (equal up to interchangeable nodes and devices) are given once.
    Inside the family, stage layers, units, recompute sets, micro-batch and replicas are chosen exactly.
    """
    seen: set[tuple] = set()
    kinds = canonical_kinds(cluster)

    def new(sk: Skeleton) -> bool:
        key = symmetry_key(cluster, sk)
        if key in seen:
            return False
        seen.add(key)
        return True

    # The baselines' layouts first: cheap, and often good enough to give the search an early incumbent.
    for sk in baseline_skeletons(cluster, heads=heads, max_stages=max_stages):
        if new(sk):
            yield sk
    by_node = _devices_by_node(cluster)
    for used in itertools.product([False, True], repeat=len(kinds)):
        chosen = [k for k, u in zip(kinds, used) if u]
        if not chosen:
            continue
        type_lists = [[(g, mem, res, n) for g, mem, res, n in k.layout] for k in chosen]
        mixed = any(len(tl) > 1 for tl in type_lists)  # only then can a spread block hold other group sizes
        cut: dict[tuple, list] = {}  # (node, type index, TP size, groups used) -> its TP groups
        size_opts = []
        for tl in type_lists:
            # (TP size, groups used) per type; in a mixed node also some of its groups, or none (0): a slow or
            # small type may serve better as one stage beside the others than not at all or all of it.
            per_type = [[(q, n // q) for q in _tp_sizes(n, heads)]
                        + ([(q, k) for q in _tp_sizes(n, heads) for k in range(1, n // q)] + [0] if len(tl) > 1 else [])
                        for *_, n in tl]
            size_opts.append([c for c in itertools.product(*per_type) if any(c)])
        for sizes in itertools.product(*size_opts):
            per_type_groups = [[q[1] if q else 0 for q in sz] for sz in sizes]
            groups_per_node = [sum(g) for g in per_type_groups]
            totals = [len(k.nodes) * g for k, g in zip(chosen, groups_per_node)]
            # A spread block is whole nodes or part of one node: a block across a node boundary would give
            # replicas of one shape different links (a heuristic restriction, it keeps the family small).
            spread = [("spread", r) for r in range(1, min(totals) + 1)
                      if all(t % r == 0 and (t // r % g == 0 or g % (t // r) == 0) for t, g in zip(totals, groups_per_node))
                      and sum(totals) // r <= max_stages]
            shared = [("share", r) for r in range(2, min(groups_per_node) + 1)
                      if all(g % r == 0 for gs in per_type_groups for g in gs) and sum(totals) // r <= max_stages]
            if not spread and not shared:
                continue
            for perm in itertools.permutations(range(len(chosen))):
                type_orders = [[o for o in itertools.permutations(range(len(type_lists[i]))) if all(sizes[i][t] or t == o[t] for t in range(len(o)))]
                               for i in perm]
                for n_order, torder in enumerate(itertools.product(*type_orders)):
                    # Per used kind (in pipeline order), per node, its TP groups in the type order.
                    node_groups = []
                    for pos, ki in enumerate(perm):
                        rows = []
                        for node in chosen[ki].nodes:
                            row = []
                            for ti in torder[pos]:
                                g, mem, res, n = type_lists[ki][ti]
                                if sizes[ki][ti]:
                                    q, used = sizes[ki][ti]
                                    if (node, ti, q, used) not in cut:  # devices of a node and type are alike
                                        ids = by_node[node][g, mem, res]
                                        cut[node, ti, q, used] = [tuple(ids[j:j + q]) for j in range(0, used * q, q)]
                                    row.append(cut[node, ti, q, used])
                            rows.append(row)
                        node_groups.append(rows)
                    seqs = [[grp for row in rows for per_type in row for grp in per_type] for rows in node_groups]
                    for mode, r in spread + shared:
                        pipes = []
                        for rho in range(r):
                            stages = []
                            for rows, seq in zip(node_groups, seqs):
                                if mode == "spread":
                                    per = len(seq) // r
                                    stages.extend(seq[rho * per:(rho + 1) * per])
                                else:
                                    for row in rows:
                                        for per_type in row:
                                            per = len(per_type) // r
                                            stages.extend(per_type[rho * per:(rho + 1) * per])
                            pipes.append(tuple(stages))
                        sk = Skeleton(pipelines=tuple(pipes))
                        if (not mixed or sk.one_shape) and new(sk):
                            yield sk
                        if r != 1:
                            continue
                        # One replica: a mixed node's groups also in every order of their types, not only type
                        # by type (every type order gives the same set: listed once, at the first).
                        blocks = [seqs] + (list(_interleavings(node_groups)) if n_order == 0 and mixed else [])
                        for order in blocks:
                            one = Skeleton(pipelines=(tuple(g for block in order for g in block),))
                            if order is not seqs and new(one):
                                yield one
                            if len(order) > 1 and len(order[-1]) > 1:
                                # The last kind's block lends one group to the front: first and last stage on one
                                # node, where the tied embedding's sync between them stays inside the node.
                                for grp in order[-1]:
                                    front = Skeleton(pipelines=((grp,) + tuple(g for g in one.pipelines[0] if g != grp),))
                                    if new(front):
                                        yield front


INTERLEAVE_LIMIT = 24
"""Orders of one mixed node's groups by type (``_interleavings``) past which a kind keeps only its type-by-type orders;
and the most orders of the whole pipeline's kinds together."""


def _type_patterns(counts: list[int]):
    """Every distinct sequence holding ``counts[t]`` copies of each type t, in lexicographic order."""
    if not any(counts):
        yield ()
        return
    for t, n in enumerate(counts):
        if n:
            rest = list(counts)
            rest[t] -= 1
            for tail in _type_patterns(rest):
                yield (t,) + tail


def _interleavings(node_groups):
    """For a pipeline of one replica through the used kinds (``node_groups``: per kind, per node, per type its TP
    groups), every per-kind block in which each node's groups come in one order of their types, the same order on
    every node of the kind, the types' groups each in their own order; the given order among them. A kind with more
    than ``INTERLEAVE_LIMIT`` orders keeps its given one, and so do all where their product is larger."""
    per_kind = []
    for rows in node_groups:
        counts = [len(groups) for groups in rows[0]]
        patterns = []
        for pattern in itertools.islice(_type_patterns(counts), INTERLEAVE_LIMIT + 1):
            block = []
            for row in rows:
                nxt = [iter(groups) for groups in row]
                block.extend(next(nxt[t]) for t in pattern)
            patterns.append(block)
        per_kind.append(patterns if len(patterns) <= INTERLEAVE_LIMIT else
                        [[g for row in rows for groups in row for g in groups]])
    if math.prod(len(p) for p in per_kind) > INTERLEAVE_LIMIT:
        return
    yield from (list(order) for order in itertools.product(*per_kind))


def _devices_by_node(cluster: ClusterSpec) -> dict[str, dict[tuple, list[str]]]:
    """node -> (gpu, memory, reserve) -> its device ids, in cluster order."""
    out: dict[str, dict[tuple, list[str]]] = {}
    for d in cluster.devices:
        out.setdefault(d.node, {}).setdefault((d.gpu.name, d.memory_bytes, d.reserve_bytes), []).append(d.id)
    return out


def megatron_layout(device_ids: list[str], tp: int, pp: int) -> Skeleton:
    """Megatron's rank order over ``device_ids``: tensor-parallel ranks fastest, then data-parallel
    replicas, then pipeline stages (rank = tp_rank + tp * (dp_rank + dp * pp_rank))."""
    dp = len(device_ids) // (tp * pp)
    return Skeleton(pipelines=tuple(
        tuple(tuple(device_ids[k + tp * (r + dp * s)] for k in range(tp)) for s in range(pp)) for r in range(dp)))


def hethub_layout(by_type: dict[str, list[str]], order: tuple[str, ...], degrees: tuple[int, ...]) -> Skeleton:
    """HetHub's pipeline: the GPU types in ``order``, each type's devices (cluster order) cut into
    consecutive TP groups of its degree, one stage per group."""
    stages = [tuple(by_type[g][i:i + t]) for g, t in zip(order, degrees) for i in range(0, len(by_type[g]), t)]
    return Skeleton(pipelines=(tuple(stages),))


def baseline_skeletons(cluster: ClusterSpec, *, heads: int, max_stages: int):
    """The baselines' layouts over canonically ordered devices, for every subset of GPU types: Megatron (TP
    fastest, then DP, then PP) over the devices of the kinds holding them, kinds in every order, a node's types
    in every order; HetHub (stages of one type, one TP degree per type, every type order) over each type's
    devices, the kinds holding it in every order; HAP (one group of all of them, ``canonical_kinds`` order: one
    stage, so no p2p link depends on the rank order). Nodes of a kind and devices of one node and type stay in
    cluster order: they are interchangeable."""
    kinds = canonical_kinds(cluster)
    by_node = _devices_by_node(cluster)
    types = sorted(cluster.gpu_types)

    def ordered(kind_order, type_orders) -> list[str]:
        return [d for k, sigs in zip(kind_order, type_orders) for node in k.nodes for sig in sigs
                for d in by_node[node].get(sig, ())]

    for size in range(len(types), 0, -1):
        for sub in itertools.combinations(types, size):
            here = [k for k in kinds if any(g in sub for g, *_ in k.layout)]
            sigs = {k.key: [tuple(x[:3]) for x in k.layout if x[0] in sub] for k in here}
            devs = ordered(here, [sigs[k.key] for k in here])
            n = len(devs)
            if n <= heads:
                yield Skeleton(pipelines=((tuple(devs),),))
            shapes = [(t, p) for t in _tp_sizes(n, heads) for p in range(1, max_stages + 1) if (n // t) % p == 0]
            for kind_order in itertools.permutations(here):
                for type_orders in itertools.product(*[itertools.permutations(sigs[k.key]) for k in kind_order]):
                    devs = ordered(kind_order, type_orders)
                    for t, p in shapes:
                        yield megatron_layout(devs, t, p)
            holders = {g: [k for k in here if any(x[0] == g for x in k.layout)] for g in sub}
            for kind_orders in itertools.product(*[itertools.permutations(holders[g]) for g in sub]):
                by_type = {g: ordered(order, [[x for x in sigs[k.key] if x[0] == g] for k in order])
                           for g, order in zip(sub, kind_orders)}
                for order in itertools.permutations(sub):
                    for ts in itertools.product(*[_tp_sizes(len(by_type[g]), heads) for g in order]):
                        sk = hethub_layout(by_type, order, ts)
                        if sk.num_stages <= max_stages:
                            yield sk
