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
from collections import Counter
from dataclasses import dataclass

from baton.cluster import ClusterSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class Skeleton:
    """Device layout without numbers: replicas, each a list of stages, each a TP group in rank order."""

    pipelines: tuple[tuple[tuple[str, ...], ...], ...]

    @property
    def num_replicas(self) -> int:
        return len(self.pipelines)

    @property
    def num_stages(self) -> int:
        """Stages of replica 0 (of every replica when ``one_shape``)."""
        return len(self.pipelines[0])

    @property
    def one_shape(self) -> bool:
        """Every replica has the same number of stages and the same TP group sizes stage by stage: the peer groups
        are then the (stage, rank) positions when the replicas share one layer split and units (the MILP's case)."""
        return len({tuple(len(g) for g in pipe) for pipe in self.pipelines}) == 1

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
    """Nodes with the same devices (type, memory, reserve, count) and the same intra-node link."""

    nodes: tuple[str, ...]
    layout: tuple
    """((gpu, memory, reserve, count), ...) of one node."""


def node_kinds(cluster: ClusterSpec) -> list[NodeKind]:
    """Nodes grouped by everything the cost model sees of them: their devices, intra-node link and NIC.
    Nodes of one kind are interchangeable: swapping two maps every plan to one priced the same."""
    per_node: dict[str, list] = {}
    for d in cluster.devices:
        per_node.setdefault(d.node, []).append((d.gpu.name, d.memory_bytes, d.reserve_bytes))
    kinds: dict[tuple, list[str]] = {}
    for node, devs in per_node.items():
        link = (cluster.intra_links[node], cluster.nics.get(node, cluster.inter_link))
        layout = tuple(sorted(Counter(devs).items()))
        kinds.setdefault((layout, link), []).append(node)
    return [NodeKind(nodes=tuple(v), layout=tuple((g, mem, res, n) for (g, mem, res), n in k[0])) for k, v in kinds.items()]


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


def structured_skeletons(cluster: ClusterSpec, *, heads: int, max_stages: int) -> list[Skeleton]:
    """Every skeleton of the structured family (see ``iter_structured_skeletons``), as a list."""
    return list(iter_structured_skeletons(cluster, heads=heads, max_stages=max_stages))


def iter_structured_skeletons(cluster: ClusterSpec, *, heads: int, max_stages: int):
    """A heuristic family for clusters too large to enumerate. What it gives up, precisely:

    * TP groups hold devices of one node and one type (a node's devices of that type cut into equal
      groups of size n, n dividing both that count and the head count; every node of a kind is cut the
      same way; a type of a mixed node may be left idle). Exception: the layouts of the baselines below.
    * Nodes of a kind are used all or none. Replicas either own whole nodes (the used nodes of each kind
      split evenly among them) or share every node (each node's groups split evenly among them).
    * A pipeline runs through the used node kinds in some order (every order is tried); the nodes of a
      kind are consecutive, and so are the groups of one node (in a mixed node, every type order is tried).
    * Plus every layout the baselines use (Megatron's TP-DP-PP rank order over the devices of some GPU
      types, HetHub's one-type stages, HAP's single group), so a baseline is never better than Baton by
      more than the requested gap.
    Inside the family, stage layers, units, recompute sets, micro-batch and replicas are chosen exactly.
    """
    seen: set[str] = set()
    # The baselines' layouts first: cheap, and often good enough to give the search an early incumbent.
    for sk in baseline_skeletons(cluster, heads=heads, max_stages=max_stages):
        key = sk.describe()
        if key not in seen:
            seen.add(key)
            yield sk
    kinds = node_kinds(cluster)
    by_node: dict[str, dict[str, list[str]]] = {}
    for d in cluster.devices:
        by_node.setdefault(d.node, {}).setdefault(d.gpu.name, []).append(d.id)
    for used in itertools.product([False, True], repeat=len(kinds)):
        chosen = [k for k, u in zip(kinds, used) if u]
        if not chosen:
            continue
        type_lists = [[(g, n) for g, _, _, n in k.layout] for k in chosen]
        size_opts = []
        for tl in type_lists:
            per_type = [[q for q in range(1, n + 1) if n % q == 0 and heads % q == 0] + ([0] if len(tl) > 1 else []) for _, n in tl]
            size_opts.append([c for c in itertools.product(*per_type) if any(c)])
        counts = [len(k.nodes) for k in chosen]
        for sizes in itertools.product(*size_opts):
            groups_per_node = [sum(n // q for (_, n), q in zip(tl, sz) if q) for tl, sz in zip(type_lists, sizes)]
            whole = [("nodes", r) for r in range(1, min(counts) + 1) if all(c % r == 0 for c in counts)]
            shared = [("share", r) for r in range(2, min(groups_per_node) + 1)
                      if all(g % r == 0 for g in groups_per_node) and all(
                          all(n // q % r == 0 for (_, n), q in zip(tl, sz) if q) for tl, sz in zip(type_lists, sizes))]
            for perm in itertools.permutations(range(len(chosen))):
                type_orders = [[o for o in itertools.permutations(range(len(type_lists[i]))) if all(sizes[i][t] or t == o[t] for t in range(len(o)))]
                               for i in perm]
                for torder in itertools.product(*type_orders):
                    for mode, r in whole + shared:
                        pipes = []
                        for rho in range(r):
                            stages = []
                            for pos, ki in enumerate(perm):
                                k = chosen[ki]
                                nodes = k.nodes if mode == "share" else k.nodes[rho * (len(k.nodes) // r):(rho + 1) * (len(k.nodes) // r)]
                                for node in nodes:
                                    for ti in torder[pos]:
                                        g, n = type_lists[ki][ti]
                                        q = sizes[ki][ti]
                                        if not q:
                                            continue
                                        ids = by_node[node][g]
                                        grp = [tuple(ids[j:j + q]) for j in range(0, n, q)]
                                        if mode == "share":
                                            per = len(grp) // r
                                            grp = grp[rho * per:(rho + 1) * per]
                                        stages.extend(grp)
                            pipes.append(tuple(stages))
                        if len(pipes[0]) <= max_stages:
                            sk = Skeleton(pipelines=tuple(pipes))
                            key = sk.describe()
                            if key not in seen:
                                seen.add(key)
                                yield sk


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


def baseline_skeletons(cluster: ClusterSpec, *, heads: int, max_stages: int) -> list[Skeleton]:
    """Layouts of the baselines: Megatron (TP fastest, then DP, then PP over the devices of some GPU
    types in cluster order), HetHub (stages of one type, one TP degree per type, every type order) and
    HAP (one group of all devices of some types)."""
    types = cluster.gpu_types
    out = []
    for k in range(len(types), 0, -1):
        for sub in itertools.combinations(types, k):
            devs = [d.id for d in cluster.devices if d.gpu.name in sub]
            n = len(devs)
            if n <= heads:
                out.append(Skeleton(pipelines=((tuple(devs),),)))
            for t in [t for t in range(1, n + 1) if n % t == 0 and heads % t == 0]:
                for p in [q for q in range(1, max_stages + 1) if (n // t) % q == 0]:
                    out.append(megatron_layout(devs, t, p))
            by_type = {g: [x.id for x in cluster.devices if x.gpu.name == g] for g in sub}
            for order in itertools.permutations(sub):
                degrees = [[t for t in range(1, len(by_type[g]) + 1) if len(by_type[g]) % t == 0 and heads % t == 0] for g in order]
                for ts in itertools.product(*degrees):
                    sk = hethub_layout(by_type, order, ts)
                    if sk.num_stages <= max_stages:
                        out.append(sk)
    return out
