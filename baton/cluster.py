"""Cluster specs: nodes of GPUs, the links inside and between nodes, and per-device memory.

Between nodes, every node has its network interface figures (``nic``, or several ``nics`` whose
bandwidths add up); a transfer between two nodes runs at the slower end (lower bandwidth, higher
latency), and a collective at the slowest pair it spans (``slowest_link``). The cluster-wide
``inter_node_link`` is a shorthand: the NIC of every node that does not give its own.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from baton.catalog import GIB, HOST_OPTIMIZER_GB_PER_S, GpuType, gpu_type
from baton.errors import BatonError
from baton.fields import Fields, excerpt, load_yaml
from baton.plan import MAX_DEVICES


@dataclass(frozen=True, kw_only=True, slots=True)
class Link:
    """A point-to-point path: alpha-beta model, time = latency + bytes / bandwidth."""

    bandwidth_gb_per_s: float
    """Unidirectional bandwidth, 10^9 bytes/s."""
    latency_us: float
    """Per-message latency, microseconds."""
    allreduce_bandwidth_gb_per_s: float | None = None
    """Per-link bandwidth a ring all-reduce achieves, when measured apart from transfers (None: the same)."""
    allreduce_latency_us: float | None = None
    """Per-ring-step latency of an all-reduce, when measured apart from transfers (None: the same)."""
    tp_allreduce_bandwidth_gb_per_s: float | None = None
    """Per-link bandwidth of the all-reduces inside a tensor-parallel layer, between ranks busy computing
    (None: as ``allreduce_bandwidth_gb_per_s``)."""
    tp_allreduce_latency_us: float | None = None
    """Per-ring-step latency of those all-reduces (None: as ``allreduce_latency_us``)."""
    reduce_scatter_bandwidth_gb_per_s: float | None = None
    """Per-link bandwidth of a ring reduce-scatter (the sharded sync's first pass, eq. 13 and 16), when
    measured (None: the all-reduce's: a ring all-reduce is a reduce-scatter and an all-gather)."""
    reduce_scatter_latency_us: float | None = None
    """Per-ring-step latency of a reduce-scatter (None: the all-reduce's)."""
    all_gather_bandwidth_gb_per_s: float | None = None
    """Per-link bandwidth of a ring all-gather, when measured (None: the all-reduce's)."""
    all_gather_latency_us: float | None = None
    """Per-ring-step latency of an all-gather (None: the all-reduce's)."""

    def transfer_ms(self, num_bytes: float) -> float:
        return self.latency_us * 1e-3 + num_bytes / (self.bandwidth_gb_per_s * 1e9) * 1e3

    @property
    def collective_bandwidth_gb_per_s(self) -> float:
        """What eq. 5 uses: collective libraries seldom reach a link's point-to-point figures."""
        return self.allreduce_bandwidth_gb_per_s if self.allreduce_bandwidth_gb_per_s is not None else self.bandwidth_gb_per_s

    @property
    def collective_latency_us(self) -> float:
        return self.allreduce_latency_us if self.allreduce_latency_us is not None else self.latency_us

    @property
    def tp_collective_bandwidth_gb_per_s(self) -> float:
        """What eq. 5 uses inside a tensor-parallel layer, where the all-reduces compete with compute."""
        v = self.tp_allreduce_bandwidth_gb_per_s
        return v if v is not None else self.collective_bandwidth_gb_per_s

    @property
    def tp_collective_latency_us(self) -> float:
        return self.tp_allreduce_latency_us if self.tp_allreduce_latency_us is not None else self.collective_latency_us

    def ring_pass_figures(self, kind: str) -> tuple[float, float]:
        """(bandwidth GB/s, latency us) per ring step of a ``"reduce_scatter"`` or ``"all_gather"`` pass:
        measured where the link has them (libraries need not run the two halves of an all-reduce at its
        speed: gloo's reduce-scatter took twice its all-gather), else the all-reduce's."""
        bw, lat = {"reduce_scatter": (self.reduce_scatter_bandwidth_gb_per_s, self.reduce_scatter_latency_us),
                   "all_gather": (self.all_gather_bandwidth_gb_per_s, self.all_gather_latency_us)}[kind]
        return (bw if bw is not None else self.collective_bandwidth_gb_per_s,
                lat if lat is not None else self.collective_latency_us)


@dataclass(frozen=True, kw_only=True, slots=True)
class Device:
    """One GPU (or CPU process) of the cluster."""

    id: str
    """'<node>:<index>', unique in the cluster; plans refer to devices by it."""
    node: str
    """Name of the node that holds it."""
    gpu: GpuType
    """Its catalog entry."""
    memory_bytes: int
    """Usable capacity: the catalog memory unless the spec overrides it."""
    reserve_bytes: int
    """Held back for the CUDA context, allocator fragmentation and communication buffers."""
    host_link_gb_per_s: float = 0.0
    """What a pinned copy between host memory and the device sustains each way (eq. 2o), 10^9 bytes/s: its node's
    ``host_link_gb_per_s``, else its catalog type's (``GpuType.host_link_gb_per_s``)."""
    host_optimizer_gb_per_s: float = HOST_OPTIMIZER_GB_PER_S
    """DRAM traffic rate of an Adam step on its node's host CPUs (eq. 10h), 10^9 bytes/s: its node's
    ``host_optimizer_gb_per_s``, else ``baton.catalog.HOST_OPTIMIZER_GB_PER_S``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterSpec:
    """Devices in node order and the two kinds of link between them."""

    name: str
    """The spec's label (the file stem unless it sets one)."""
    devices: tuple[Device, ...]
    """All devices, node by node."""
    intra_links: dict
    """Node name -> Link between devices of that node."""
    inter_link: Link | None
    """The cluster-wide ``inter_node_link`` shorthand (None when absent)."""
    source: str = "<memory>"
    """The file it was read from, for error messages."""
    nics: dict = field(default_factory=dict)
    """Node name -> that node's network figures (its NICs together); nodes without one use ``inter_link``."""
    replica_time_cv: float = 0.0
    """Relative standard deviation of a replica's time between two collectives that the other replicas do not
    share (eq. 19: what replicas of equal predicted time lose waiting for the last of them); 0: none stated.
    ``baton profile --comm`` measures it between the local processes."""
    interfaces: dict = field(default_factory=dict)
    """Node name -> the network interface its processes talk through (gloo's and NCCL's socket interface, e.g.
    ``eth0``); nodes without one let the libraries choose."""
    host_memory: dict = field(default_factory=dict)
    """Node name -> bytes of host memory its devices may fill with offloaded activations (pinned buffers, eq. 8o);
    nodes without one are not limited."""

    @property
    def has_ring_pass_figures(self) -> bool:
        """Some link carries its own reduce-scatter or all-gather figures (measured), so a sharded sync's two
        passes need not cost the all-reduce (eq. 13)."""
        links = list(self.intra_links.values()) + list(self.nics.values()) + ([self.inter_link] if self.inter_link else [])
        return any(x is not None for l in links for x in (l.reduce_scatter_bandwidth_gb_per_s, l.reduce_scatter_latency_us,
                                                         l.all_gather_bandwidth_gb_per_s, l.all_gather_latency_us))

    def device(self, device_id: str) -> Device:
        found = _device_index(self).get(device_id)
        if found is None:
            raise BatonError(f"no device '{device_id}' in cluster '{self.name}'")
        return found

    def link(self, a: str, b: str) -> Link:
        """The link between two devices (a device talking to itself costs nothing)."""
        da, db = self.device(a), self.device(b)
        if da.node == db.node:
            return self.intra_links[da.node]
        # Pipelines price every sender-receiver pair of every candidate: a new Link per call was most of the cost.
        pairs = _cluster_cache(self)[3]
        key = (da.node, db.node)
        found = pairs.get(key)
        if found is None:
            na, nb = self.nic(da.node), self.nic(db.node)
            found = pairs[key] = na if na == nb else slower_end(na, nb)
        return found

    def nic(self, node: str) -> Link:
        """A node's network figures: its own NICs, else the cluster-wide ``inter_node_link``."""
        if node in self.nics:
            return self.nics[node]
        if self.inter_link is None:
            raise BatonError(f"node '{node}' has no nic and the cluster gives no inter_node_link", source=self.source, field="inter_node_link")
        return self.inter_link

    def slowest_link(self, ids: list[str]) -> Link | None:
        """The lowest-bandwidth link among all pairs of ``ids`` (None for fewer than two devices)."""
        # Planners ask for the same peer sets on every plan they price: each set's answer is kept.
        cache = _cluster_cache(self)[2]
        key = tuple(ids)
        if key not in cache:
            if len(cache) >= 1 << 12:  # a key may hold hundreds of ids on a large cluster
                cache.clear()
            cache[key] = self._slowest_link(ids)
        return cache[key]

    def _slowest_link(self, ids: list[str]) -> Link | None:
        # Every pair's link is its node's intra link or the slower end of two nodes' NICs, and the slower
        # end is taken figure by figure, so the slowest over all pairs needs each node only once: the
        # intra links of nodes holding two or more of ``ids``, and the NICs of all nodes once two differ.
        # Linear in len(ids): data-parallel peer sets span hundreds of nodes.
        per_node: dict[str, int] = {}
        for i in ids:
            node = self.device(i).node
            per_node[node] = per_node.get(node, 0) + 1
        links = [self.intra_links[n] for n, k in per_node.items() if k >= 2]
        if len(per_node) >= 2:
            links += [self.nic(n) for n in per_node]
        if not links:
            return None
        return slower_end(*links)

    @property
    def gpu_types(self) -> list[str]:
        seen: list[str] = []
        for d in self.devices:
            if d.gpu.name not in seen:
                seen.append(d.gpu.name)
        return seen


def slower_end(*links: Link) -> Link:
    """What traffic across all of ``links`` gets: the lowest bandwidths and highest latencies among them,
    each kind of figure (transfer, all-reduce, in-layer all-reduce) taken separately."""
    return Link(
        bandwidth_gb_per_s=min(l.bandwidth_gb_per_s for l in links),
        latency_us=max(l.latency_us for l in links),
        allreduce_bandwidth_gb_per_s=min(l.collective_bandwidth_gb_per_s for l in links),
        allreduce_latency_us=max(l.collective_latency_us for l in links),
        tp_allreduce_bandwidth_gb_per_s=min(l.tp_collective_bandwidth_gb_per_s for l in links),
        tp_allreduce_latency_us=max(l.tp_collective_latency_us for l in links),
        reduce_scatter_bandwidth_gb_per_s=min(l.ring_pass_figures("reduce_scatter")[0] for l in links),
        reduce_scatter_latency_us=max(l.ring_pass_figures("reduce_scatter")[1] for l in links),
        all_gather_bandwidth_gb_per_s=min(l.ring_pass_figures("all_gather")[0] for l in links),
        all_gather_latency_us=max(l.ring_pass_figures("all_gather")[1] for l in links),
    )


def combined_nics(links: list[Link]) -> Link:
    """Several NICs of one node as one: bandwidths add up (traffic spreads over them), the highest latency counts."""
    if len(links) == 1:
        return links[0]

    def total(attr: str) -> float:
        return sum(getattr(l, attr) for l in links)

    return Link(
        bandwidth_gb_per_s=total("bandwidth_gb_per_s"),
        latency_us=max(l.latency_us for l in links),
        allreduce_bandwidth_gb_per_s=total("collective_bandwidth_gb_per_s"),
        allreduce_latency_us=max(l.collective_latency_us for l in links),
        tp_allreduce_bandwidth_gb_per_s=total("tp_collective_bandwidth_gb_per_s"),
        tp_allreduce_latency_us=max(l.tp_collective_latency_us for l in links),
        reduce_scatter_bandwidth_gb_per_s=sum(l.ring_pass_figures("reduce_scatter")[0] for l in links),
        reduce_scatter_latency_us=max(l.ring_pass_figures("reduce_scatter")[1] for l in links),
        all_gather_bandwidth_gb_per_s=sum(l.ring_pass_figures("all_gather")[0] for l in links),
        all_gather_latency_us=max(l.ring_pass_figures("all_gather")[1] for l in links),
    )


FIELDS = {"name", "nodes", "inter_node_link", "memory_reserve_gib", "description", "replica_time_cv"}
"""The top-level fields of a cluster file."""
MAX_REPLICA_TIME_CV = 0.5
"""Beyond this the normal noise model of eq. 19 would give replicas negative times a few % of the steps."""
_NODE = {"name", "gpus", "intra_node_link", "count", "nic", "nics", "interface", "host_memory_gib", "host_link_gb_per_s",
         "host_optimizer_gb_per_s"}
_NIC_COUNT = "count"
"""How many identical NICs one ``nics`` entry stands for."""
_GPUS = {"type", "count", "memory_gib", "memory_reserve_gib"}
_LINK = {"bandwidth_gb_per_s", "latency_us", "allreduce_bandwidth_gb_per_s", "allreduce_latency_us",
         "tp_allreduce_bandwidth_gb_per_s", "tp_allreduce_latency_us", "reduce_scatter_bandwidth_gb_per_s",
         "reduce_scatter_latency_us", "all_gather_bandwidth_gb_per_s", "all_gather_latency_us", "kind"}


def _link(f: Fields, *, extra: frozenset = frozenset()) -> Link:
    f.check_known(_LINK | extra, what="a link")

    def optional(key, **kw):
        return f.number(key, **kw) if f.has(key) else None

    return Link(bandwidth_gb_per_s=f.number("bandwidth_gb_per_s"), latency_us=f.number("latency_us", default=0.0, allow_zero=True),
                allreduce_bandwidth_gb_per_s=optional("allreduce_bandwidth_gb_per_s"),
                allreduce_latency_us=optional("allreduce_latency_us", allow_zero=True),
                tp_allreduce_bandwidth_gb_per_s=optional("tp_allreduce_bandwidth_gb_per_s"),
                tp_allreduce_latency_us=optional("tp_allreduce_latency_us", allow_zero=True),
                reduce_scatter_bandwidth_gb_per_s=optional("reduce_scatter_bandwidth_gb_per_s"),
                reduce_scatter_latency_us=optional("reduce_scatter_latency_us", allow_zero=True),
                all_gather_bandwidth_gb_per_s=optional("all_gather_bandwidth_gb_per_s"),
                all_gather_latency_us=optional("all_gather_latency_us", allow_zero=True))


def from_mapping(data, *, source: str) -> ClusterSpec:
    """Build a ClusterSpec from parsed YAML.

    A node entry with ``count: k`` stands for k identical nodes named ``<name>-0`` ... ``<name>-(k-1)``,
    so large clusters stay short to write.
    """
    top = Fields(data, source=source)
    top.check_known(FIELDS, what="a cluster file")
    default_reserve = top.number("memory_reserve_gib", default=0.0, allow_zero=True)
    devices: list[Device] = []
    intra: dict[str, Link] = {}
    nics: dict[str, Link] = {}
    interfaces: dict[str, str] = {}
    host_memories: dict[str, int] = {}
    node_names: set[str] = set()
    node_names_in_order: list[str] = []
    for i, raw_node in enumerate(top.sequence("nodes")):
        node = Fields(raw_node, source=source, prefix=f"nodes[{i}]")
        node.check_known(_NODE, what="a node")
        base_name = node.string("name", default=f"node{i}")
        copies = node.integer("count", default=1)
        link = _link(node.mapping("intra_node_link")) if node.has("intra_node_link") else None
        nic = _node_nic(node)
        interface = _interface(node) if node.has("interface") else None
        host_memory = int(node.number("host_memory_gib") * GIB) if node.has("host_memory_gib") else None
        host_link = node.number("host_link_gb_per_s") if node.has("host_link_gb_per_s") else None
        host_adam = node.number("host_optimizer_gb_per_s") if node.has("host_optimizer_gb_per_s") else HOST_OPTIMIZER_GB_PER_S
        entries = node.sequence("gpus")
        parsed = []
        for j, raw_gpu in enumerate(entries):
            g = Fields(raw_gpu, source=source, prefix=f"{node.prefix}.gpus[{j}]")
            g.check_known(_GPUS, what="a GPU entry")
            gpu = gpu_type(g.string("type"), source=source, field=g.path("type"))
            count = g.integer("count", default=1)
            memory = int(g.number("memory_gib") * GIB) if g.has("memory_gib") else gpu.memory_bytes
            reserve = int(g.number("memory_reserve_gib", default=default_reserve, allow_zero=True) * GIB)
            if reserve >= memory:
                raise g.error("memory_reserve_gib", f"reserve {reserve / GIB:g} GiB leaves no memory of {memory / GIB:g} GiB")
            parsed.append((gpu, count, memory, reserve))
        total = sum(c for _, c, _, _ in parsed)
        if total > 1 and link is None:
            raise node.error("intra_node_link", "missing required field (the node has more than one device)")
        if len(devices) + copies * total > MAX_DEVICES:  # counted before any is built: counts multiply
            raise node.error("count" if copies > 1 else "gpus", f"the cluster would have {len(devices) + copies * total} devices "
                                                                f"up to here, more than the {MAX_DEVICES} Baton plans for")
        for c in range(copies):
            name = base_name if copies == 1 else f"{base_name}-{c}"
            if name in node_names:
                raise node.error("name", f"duplicate node name '{name}'")
            node_names.add(name)
            node_names_in_order.append(name)
            intra[name] = link or Link(bandwidth_gb_per_s=1e6, latency_us=0.0)
            if nic is not None:
                nics[name] = nic
            if interface is not None:
                interfaces[name] = interface
            if host_memory is not None:
                host_memories[name] = host_memory
            k = 0
            for gpu, count, memory, reserve in parsed:
                for _ in range(count):
                    devices.append(Device(id=f"{name}:{k}", node=name, gpu=gpu, memory_bytes=memory, reserve_bytes=reserve,
                                          host_link_gb_per_s=host_link or gpu.host_link_gb_per_s,
                                          host_optimizer_gb_per_s=host_adam))
                    k += 1
    inter = _link(top.mapping("inter_node_link")) if top.has("inter_node_link") else None
    if len(node_names) > 1 and inter is None:
        bare = [i for i, n in enumerate(node_names_in_order) if n not in nics]
        if len(nics) == 0:
            raise top.error("inter_node_link", "missing required field (the cluster has more than one node; "
                                               "give it, or a nic on every node)")
        if bare:
            raise top.error("inter_node_link", f"missing required field (node '{node_names_in_order[bare[0]]}' has no nic)")
    return ClusterSpec(
        name=top.string("name", default=Path(source).stem),
        devices=tuple(devices), intra_links=intra, inter_link=inter, source=source, nics=nics, interfaces=interfaces,
        host_memory=host_memories,
        replica_time_cv=top.number("replica_time_cv", default=0.0, allow_zero=True, maximum=MAX_REPLICA_TIME_CV),
    )


def _interface(node: Fields) -> str:
    """A node's ``interface``: a Linux interface name (at most 15 characters, no slash or space)."""
    name = node.string("interface")
    if not re.fullmatch(r"[A-Za-z0-9_.:@-]{1,15}", name):
        raise node.error("interface", f"expected a network interface name such as eth0 (at most 15 letters, digits "
                                      f"or _.:@-), got {excerpt(name)}")
    return name


def _node_nic(node: Fields) -> Link | None:
    """A node's ``nic`` (one mapping) or ``nics`` (a list, each with an optional ``count``), as one Link."""
    if node.has("nic") and node.has("nics"):
        raise node.error("nics", "give either nic or nics, not both")
    if node.has("nic"):
        return _link(node.mapping("nic"))
    if not node.has("nics"):
        return None
    links = []
    for k, raw in enumerate(node.sequence("nics")):
        f = Fields(raw, source=node.source, prefix=f"{node.path('nics')}[{k}]")
        copies = f.integer(_NIC_COUNT, default=1)
        links += [_link(f, extra=frozenset({_NIC_COUNT}))] * copies
    return combined_nics(links)


def load_cluster(path: str | Path) -> ClusterSpec:
    """Read a cluster YAML file."""
    return from_mapping(load_yaml(path), source=str(path))


def homogeneous_cpu_cluster(num_devices: int, *, name: str = "cpu") -> ClusterSpec:
    """N CPU processes on one node: what ``baton train`` runs on a machine without GPUs."""
    data = {
        "name": name,
        "nodes": [{"name": "local", "gpus": [{"type": "cpu", "count": num_devices}],
                   "intra_node_link": {"bandwidth_gb_per_s": 5.0, "latency_us": 50.0}}],
    }
    return from_mapping(data, source=f"<{name}>")


_CLUSTER_CACHE: dict[int, tuple[ClusterSpec, dict[str, Device], dict, dict]] = {}


def _cluster_cache(cluster: ClusterSpec) -> tuple[ClusterSpec, dict[str, Device], dict, dict]:
    """(the spec, device id -> Device, peer-id tuple -> slowest link, (node, other node) -> their link): planners
    look devices, peer sets' links and pairs' links up millions of times on clusters of 1,000 GPUs.

    Keyed by identity (the spec holds dicts, so it has no hash); the entry keeps the spec alive, so
    the id cannot be reused while it is cached. A spec is frozen, so what is derived from it stays true.
    """
    hit = _CLUSTER_CACHE.get(id(cluster))
    if hit is None or hit[0] is not cluster:
        if len(_CLUSTER_CACHE) >= 32:
            _CLUSTER_CACHE.clear()
        hit = _CLUSTER_CACHE[id(cluster)] = (cluster, {d.id: d for d in cluster.devices}, {}, {})
    return hit


def _device_index(cluster: ClusterSpec) -> dict[str, Device]:
    return _cluster_cache(cluster)[1]


def shipped_clusters_dir() -> Path:
    """The cluster specs that come with Baton: the checkout's clusters/, else (an installed wheel) the copy
    shipped inside the package. Read only."""
    checkout = Path(__file__).resolve().parent.parent / "clusters"
    return checkout if checkout.is_dir() else Path(__file__).resolve().parent / "shipped" / "clusters"
