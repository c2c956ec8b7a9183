"""Generated clusters for the planner's scale benchmark (issue 25): 64 to 1,024 GPUs of 2-4 types.

A cluster is a *mix* (which GPU types, in what proportions) at a GPU count, made deterministic by a seed. The
seed moves each type's share by up to +-10% before rounding to whole blocks of 8 GPUs and shuffles the order
of the node entries, so several seeds of one mix are several clusters, and a planner that followed the file's
order would show it (tests/test_solver_order.py). Node kinds carry the figures of the shipped
clusters/scale_*.yaml (NVLink/NVSwitch ring bandwidth as NCCL typically reaches it, PCIe for the GDDR cards)
and a NIC each, as cloud instances of those types have them, so a cross-kind collective runs at the slower NIC.

Some mixes are *held out*: never used to tune the planner; bench/bench_solver_scale.py reports them apart,
so a planner fitted to the tuning mixes shows if it does not carry over.

    python bench/scale_clusters.py --list
    python bench/scale_clusters.py --gpus 256 --mix h100-a100-l4 --out x.yaml [--seed 0]
"""
from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from baton.atomic import write_atomically  # noqa: E402
from baton.catalog import CATALOG  # noqa: E402

BLOCK = 8
"""GPUs are given to types in blocks of this many: one node of 8, or two of 4."""
MIN_GPUS, MAX_GPUS = 64, 1024
"""The range issue 25 asks for (the loader itself allows up to ``baton.plan.MAX_DEVICES``)."""
SHARE_JITTER = 0.10
"""How far (relative) a seed moves each type's share of the GPUs."""
MEMORY_RESERVE_GIB = 2.0
"""As clusters/scale_*.yaml: CUDA context, communication buffers and fragmentation on data-centre cards."""


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeKind:
    """What a node of one GPU type looks like: how many GPUs, the link between them, its network interface."""

    gpu: str
    """Catalog name (baton/catalog.py)."""
    gpus_per_node: int
    """GPUs in one node: 8 (DGX/HGX-class boards, g5.48xlarge), 4 (g4dn.12xlarge, g6.12xlarge)."""
    intra_gb_per_s: float
    """Ring bandwidth between the node's GPUs, 10^9 bytes/s one way: NVLink as NCCL reaches it, else PCIe."""
    intra_latency_us: float
    """Per-message latency inside the node."""
    nic_gb_per_s: float
    """What the node's network interfaces achieve together, 10^9 bytes/s one way (about 88% of line rate)."""
    nic_latency_us: float
    """Per-message latency between nodes."""
    memory_gib: float | None = None
    """Usable memory where it differs from the catalog (ECC carve-out of GDDR6 cards, clusters/README.md)."""
    source: str = ""
    """Where the figures come from, written into the file's header."""


NODE_KINDS: dict[str, NodeKind] = {k.gpu: k for k in [
    NodeKind(gpu="h100", gpus_per_node=8, intra_gb_per_s=450.0, intra_latency_us=3.0, nic_gb_per_s=88.0, nic_latency_us=8.0,
             source="HGX H100: NVSwitch; 8 x 400 Gb/s NDR, of which we count 4 for data-parallel traffic"),
    NodeKind(gpu="h200", gpus_per_node=8, intra_gb_per_s=450.0, intra_latency_us=3.0, nic_gb_per_s=88.0, nic_latency_us=8.0,
             source="HGX H200: as H100"),
    NodeKind(gpu="a100-80gb", gpus_per_node=8, intra_gb_per_s=300.0, intra_latency_us=3.0, nic_gb_per_s=44.0,
             nic_latency_us=10.0, source="HGX A100: NVSwitch; 2 x 200 Gb/s HDR counted"),
    NodeKind(gpu="a100-40gb", gpus_per_node=8, intra_gb_per_s=300.0, intra_latency_us=3.0, nic_gb_per_s=22.0,
             nic_latency_us=10.0, source="DGX A100 40GB (p4d-class): NVSwitch; one 200 Gb/s fabric counted"),
    NodeKind(gpu="a800-80gb", gpus_per_node=8, intra_gb_per_s=180.0, intra_latency_us=3.0, nic_gb_per_s=22.0,
             nic_latency_us=10.0, source="A800 PCIe with NVLink bridges capped at 400 GB/s both ways; 200 Gb/s"),
    NodeKind(gpu="v100-32gb", gpus_per_node=8, intra_gb_per_s=130.0, intra_latency_us=3.0, nic_gb_per_s=11.0,
             nic_latency_us=12.0, source="DGX-1V: hybrid cube mesh; 100 Gb/s"),
    NodeKind(gpu="a10g", gpus_per_node=8, intra_gb_per_s=12.0, intra_latency_us=5.0, nic_gb_per_s=11.0, nic_latency_us=15.0,
             memory_gib=22.5, source="g5.48xlarge: PCIe 4 through the host; 100 Gb/s"),
    NodeKind(gpu="l4", gpus_per_node=4, intra_gb_per_s=12.0, intra_latency_us=5.0, nic_gb_per_s=5.5, nic_latency_us=15.0,
             memory_gib=22.5, source="g6.12xlarge: 4 L4 on PCIe; 40 Gb/s"),
    NodeKind(gpu="t4", gpus_per_node=4, intra_gb_per_s=12.0, intra_latency_us=5.0, nic_gb_per_s=5.5, nic_latency_us=15.0,
             memory_gib=15.0, source="g4dn.12xlarge: 4 T4 on PCIe; 50 Gb/s"),
]}
"""Node kinds by GPU type: the types a mix may use."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Mix:
    """A named combination of GPU types and the share of the GPUs each takes."""

    name: str
    """Label used on the command line and in the benchmark's tables."""
    shares: tuple[tuple[str, float], ...]
    """(catalog GPU type, share of the GPUs) per type, 2 to 4 of them; the shares add up to 1."""
    held_out: bool
    """Never used to tune the planner: the benchmark reports these apart."""
    note: str = ""
    """Why the mix is in the list."""

    @property
    def gpu_types(self) -> tuple[str, ...]:
        return tuple(g for g, _ in self.shares)


MIXES: dict[str, Mix] = {m.name: m for m in [
    Mix(name="a100-v100", shares=(("a100-40gb", 0.5), ("v100-32gb", 0.5)), held_out=False,
        note="two generations of NVLink nodes (clusters/scale_64.yaml)"),
    Mix(name="h100-a100-v100", shares=(("h100", 0.25), ("a100-40gb", 0.375), ("v100-32gb", 0.375)), held_out=False,
        note="three generations (clusters/scale_256.yaml)"),
    Mix(name="h100-a100-v100-a10g", shares=(("h100", 0.25), ("a100-80gb", 0.25), ("v100-32gb", 0.25), ("a10g", 0.25)),
        held_out=False, note="four types, one of them PCIe-only (clusters/scale_1024.yaml)"),
    Mix(name="h100-a100", shares=(("h100", 0.5), ("a100-80gb", 0.5)), held_out=False,
        note="equal memory, unequal speed"),
    Mix(name="h100-a100-l4", shares=(("h100", 0.25), ("a100-80gb", 0.25), ("l4", 0.5)), held_out=True,
        note="half the GPUs small inference cards, 4 to a node, on a slow NIC"),
    Mix(name="a100-v100-t4", shares=(("a100-80gb", 0.25), ("v100-32gb", 0.25), ("t4", 0.5)), held_out=True,
        note="Cephalo-like: many small slow cards beside a few large ones"),
    Mix(name="h200-a800-a10g-t4", shares=(("h200", 0.125), ("a800-80gb", 0.375), ("a10g", 0.25), ("t4", 0.25)),
        held_out=True, note="four types, memory from 15 to 141 GiB"),
    Mix(name="h100-v100", shares=(("h100", 0.25), ("v100-32gb", 0.75)), held_out=True,
        note="a few fast cards among many old ones, 8x apart in speed"),
]}
"""The named mixes; ``held_out`` ones are never used to tune the planner."""


def type_counts(gpus: int, mix: Mix, seed: int) -> dict[str, int]:
    """GPUs of each type: the mix's shares moved by the seed, rounded to blocks of ``BLOCK`` by largest remainder,
    every type at least one block."""
    if gpus % BLOCK:
        raise ValueError(f"--gpus must be a multiple of {BLOCK}, got {gpus}")
    blocks = gpus // BLOCK
    if blocks < len(mix.shares):
        raise ValueError(f"{gpus} GPUs cannot hold {len(mix.shares)} types in blocks of {BLOCK}")
    rng = random.Random(f"{mix.name}/{gpus}/{seed}")  # a str seed is hashed the same in every process
    raw = [share * (1 + rng.uniform(-SHARE_JITTER, SHARE_JITTER)) for _, share in mix.shares]
    want = [blocks * w / sum(raw) for w in raw]
    got = [max(1, int(w)) for w in want]
    # Largest remainder, then take back from the largest type if the minimum of one block overshot.
    order = sorted(range(len(want)), key=lambda i: (got[i] - want[i], i))
    k = 0
    while sum(got) < blocks:
        got[order[k % len(order)]] += 1
        k += 1
    while sum(got) > blocks:
        got[max(range(len(got)), key=lambda i: (got[i], -i))] -= 1
    return {g: n * BLOCK for (g, _), n in zip(mix.shares, got)}


def cluster_mapping(gpus: int, mix: Mix | str, seed: int = 0) -> dict:
    """The cluster file's mapping (what ``baton.cluster.from_mapping`` reads) for ``gpus`` GPUs of ``mix``."""
    mix = MIXES[mix] if isinstance(mix, str) else mix
    if not MIN_GPUS <= gpus <= MAX_GPUS:
        raise ValueError(f"--gpus must be between {MIN_GPUS} and {MAX_GPUS}, got {gpus}")
    counts = type_counts(gpus, mix, seed)
    nodes = []
    for g, n in counts.items():
        kind = NODE_KINDS[g]
        gpu = {"type": g, "count": kind.gpus_per_node}
        if kind.memory_gib is not None:
            gpu["memory_gib"] = kind.memory_gib
        nodes.append({"name": f"{g}-node", "count": n // kind.gpus_per_node, "gpus": [gpu],
                      "intra_node_link": {"bandwidth_gb_per_s": kind.intra_gb_per_s, "latency_us": kind.intra_latency_us},
                      "nic": {"bandwidth_gb_per_s": kind.nic_gb_per_s, "latency_us": kind.nic_latency_us}})
    random.Random(f"order/{mix.name}/{gpus}/{seed}").shuffle(nodes)
    desc = ", ".join(f"{n} {g}" for g, n in counts.items())
    return {"name": f"scale_{gpus}_{mix.name}_s{seed}", "description": f"{desc} (generated, mix {mix.name}, seed {seed})",
            "memory_reserve_gib": MEMORY_RESERVE_GIB, "nodes": nodes}


def cluster_yaml(gpus: int, mix: Mix | str, seed: int = 0) -> str:
    """The cluster file's text: a header saying how it was made and where its figures come from, then the mapping."""
    mix = MIXES[mix] if isinstance(mix, str) else mix
    data = cluster_mapping(gpus, mix, seed)
    head = [f"# Generated by bench/scale_clusters.py --gpus {gpus} --mix {mix.name} --seed {seed}"
            f"{' (a held-out mix: never used to tune the planner)' if mix.held_out else ''}.",
            "# Node figures (one-way GB/s; NICs at ~88% of line rate):"]
    head += [f"#   {g}: {NODE_KINDS[g].source}" for g in mix.gpu_types]
    return "\n".join(head) + "\n" + yaml.safe_dump(data, sort_keys=False, default_flow_style=None, width=120)


def write_cluster(path: str | Path, gpus: int, mix: Mix | str, seed: int = 0) -> Path:
    """Write the generated cluster file atomically (a failed run never leaves half a file)."""
    write_atomically(path, cluster_yaml(gpus, mix, seed))
    return Path(path)


def _check_catalog() -> None:
    # A node kind naming a type the catalog lost would only fail when a cluster is loaded: fail on import.
    missing = [g for g in NODE_KINDS if g not in CATALOG] + [g for m in MIXES.values() for g in m.gpu_types if g not in NODE_KINDS]
    assert not missing, missing


_check_catalog()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, help=f"GPUs in the cluster, a multiple of {BLOCK} from {MIN_GPUS} to {MAX_GPUS}")
    ap.add_argument("--mix", choices=sorted(MIXES), help="which GPU types (see --list)")
    ap.add_argument("--seed", type=int, default=0, help="moves the shares and the node order (default 0)")
    ap.add_argument("--out", type=Path, help="the YAML file to write (default: stdout)")
    ap.add_argument("--list", action="store_true", help="list the mixes and exit")
    args = ap.parse_args(argv)
    if args.list:
        for m in MIXES.values():
            types = ", ".join(f"{g} {s:.0%}" for g, s in m.shares)
            print(f"{m.name:22s} {'held out' if m.held_out else 'tuning  '}  {types}  ({m.note})")
        return 0
    if args.gpus is None or args.mix is None:
        ap.error("--gpus and --mix are required (or --list)")
    try:
        if args.out is None:
            sys.stdout.write(cluster_yaml(args.gpus, args.mix, args.seed))
        else:
            write_cluster(args.out, args.gpus, args.mix, args.seed)
    except ValueError as exc:
        ap.error(str(exc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
