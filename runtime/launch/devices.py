"""Which devices a run uses, how much memory each really has, and the pre-flight check that the plan fits.

Before any rank starts, ``baton train`` predicts every plan device's peak memory with the evaluator
(docs/cost-model.md eq. 8: weights, gradients, optimizer state, the in-flight micro-batches'
activations, the recompute buffer and the cluster's reserve) and compares it with the memory of the
device that rank will run on:

* CUDA: the total memory of the rank's GPU (``--gpus``, else GPUs 0..n-1 in rank order);
* CPU: ``CPU_MEMORY_SHARE`` of the machine's RAM, split equally among the ranks on the machine (CPU
  processes share the RAM; the rest is left to the operating system and to each process's Python and
  torch, which eq. 8 does not count).

A plan that cannot fit is refused in one line naming the device, its need and the capacity.

The prediction uses the cluster the plan was made for (``--cluster``, else the shipped
``clusters/<plan's cluster>.yaml``) and its profile tables; where no table exists for a GPU type it
derives one, since the memory figures of a derived table depend only on the model. Without any cluster
every device is taken as the catalog's ``cpu`` stand-in with no reserve: the same memory figures, minus
the reserves only the cluster spec knows.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from baton.catalog import CATALOG
from baton.cluster import ClusterSpec, Device, Link, load_cluster, shipped_clusters_dir
from baton.errors import BatonError
from baton.evaluate import PlanReport, evaluate
from baton.plan import Plan, check_against_cluster
from baton.profile import Profile, ProfileSet, derive_table, load_profile
from baton.costmodel import peak_flops

CPU_MEMORY_SHARE = 0.8
"""Share of the machine's RAM that the CPU ranks of one run may use together (each gets an equal part)."""
GIB = 1024**3


@dataclass(frozen=True, kw_only=True, slots=True)
class RunDevices:
    """Where the ranks run."""

    kind: str
    """'cuda' or 'cpu'."""
    gpus: tuple[int, ...] = ()
    """CUDA device index of every rank, in rank order (empty on CPU)."""


def parse_gpus(text: str | None) -> tuple[int, ...] | None:
    """``--gpus 0,1,3`` as device indices (None when not given)."""
    if text is None:
        return None
    try:
        gpus = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise BatonError(f"expected comma-separated GPU indices such as 0,1, got '{text}'", field="--gpus") from None
    if any(g < 0 for g in gpus):
        raise BatonError(f"GPU indices must be >= 0, got '{text}'", field="--gpus")
    if len(set(gpus)) != len(gpus):
        raise BatonError(f"lists a GPU twice ('{text}'): every rank needs a GPU of its own", field="--gpus")
    return gpus


def cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def choose_devices(requested: str, gpus: tuple[int, ...] | None, world: int, *, available: int | None = None) -> RunDevices:
    """The devices of a run started on one machine: ``requested`` is auto, cpu or cuda; ``gpus`` the
    ``--gpus`` list. Asking for CUDA (or naming GPUs) and not having enough is an error; ``auto`` takes
    CUDA only when there is a GPU for every rank."""
    available = cuda_count() if available is None else available
    if gpus is not None:
        if requested == "cpu":
            raise BatonError("--gpus chooses CUDA devices; it cannot go with --device cpu", field="--gpus")
        if len(gpus) != world:
            raise BatonError(f"lists {len(gpus)} GPU(s) but the plan has {world} devices: give one GPU per plan device",
                             field="--gpus")
        missing = [g for g in gpus if g >= available]
        if missing:
            raise BatonError(f"GPU {missing[0]} does not exist: this machine has {available} CUDA GPU(s)", field="--gpus")
        return RunDevices(kind="cuda", gpus=gpus)
    if requested == "cuda" and available < world:
        raise BatonError(f"the plan has {world} devices but this machine has {available} CUDA GPU(s); start one process "
                         "per GPU with torchrun on each machine, or use --device cpu", field="--device")
    if requested == "cuda" or (requested == "auto" and available >= world):
        return RunDevices(kind="cuda", gpus=tuple(range(world)))
    return RunDevices(kind="cpu")


def machine_ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cpu_capacity(ranks_on_machine: int) -> tuple[str, int]:
    """(description, bytes) of what one CPU rank may use."""
    ram = machine_ram_bytes()
    cap = int(CPU_MEMORY_SHARE * ram / max(ranks_on_machine, 1))
    return (f"this machine's CPU ({CPU_MEMORY_SHARE:.0%} of {ram / GIB:.1f} GiB RAM shared by {ranks_on_machine} "
            f"rank{'s' if ranks_on_machine != 1 else ''})", cap)


def cuda_capacity(index: int) -> tuple[str, int]:
    import torch

    props = torch.cuda.get_device_properties(index)
    return f"cuda:{index} ({props.name})", int(props.total_memory)


def capacities(devices: RunDevices, world: int) -> list[tuple[str, int]]:
    """(description, bytes) of the memory each rank really has, in rank order."""
    if devices.kind == "cuda":
        return [cuda_capacity(g) for g in devices.gpus]
    return [cpu_capacity(world)] * world


# --- the prediction --------------------------------------------------------------------------------


def stand_in_cluster(plan: Plan) -> ClusterSpec:
    """Every plan device as the catalog's ``cpu`` stand-in on one node, no reserve: a cluster to price
    the plan's memory when its own cannot be found."""
    cpu = CATALOG["cpu"]
    devices = tuple(Device(id=i, node="plan", gpu=cpu, memory_bytes=cpu.memory_bytes, reserve_bytes=0,
                           host_link_gb_per_s=cpu.host_link_gb_per_s)
                    for i in plan.device_ids())
    return ClusterSpec(name=plan.cluster, devices=devices, intra_links={"plan": Link(bandwidth_gb_per_s=1.0, latency_us=0.0)},
                       inter_link=None, source="<stand-in>")


def resolve_cluster(plan: Plan, path: str | Path | None) -> tuple[ClusterSpec, str | None]:
    """(cluster, note): ``path`` when given (a mismatch is the user's error), else the shipped spec of
    the plan's cluster when it holds the plan's devices, else the stand-in (with a note saying so)."""
    if path is not None:
        return load_cluster(path), None
    shipped = shipped_clusters_dir() / f"{plan.cluster}.yaml"
    if re.fullmatch(r"[A-Za-z0-9_.-]+", plan.cluster) and shipped.is_file():
        try:
            cluster = load_cluster(shipped)
            check_against_cluster(plan, cluster)
            return cluster, None
        except BatonError:
            pass
    return stand_in_cluster(plan), (f"cluster '{plan.cluster}' not found (pass --cluster): memory is predicted from the model "
                                    "alone, without the cluster's reserves")


def prediction_profiles(plan: Plan, cluster: ClusterSpec, directory: str | Path | None) -> ProfileSet:
    """The tables of the plan's GPU types: found ones (measured first), else derived at the micro-batch sizes
    of the plan's replicas."""
    spec, tables = plan.model, {}
    for gpu in {cluster.device(i).gpu.name for i in plan.device_ids()}:
        try:
            tables[gpu] = load_profile(gpu, spec, directory=directory)
        except BatonError as exc:
            if "no profile for GPU" not in exc.message:
                raise
            sizes = tuple(sorted({plan.batch(i)[0] for i in range(len(plan.pipelines))}))  # replicas may differ
            tables[gpu] = Profile(derive_table(spec, gpu, micro_batches=sizes), source=f"<derived {gpu}>")
    return ProfileSet(spec, directory=directory, tables=tables)


@dataclass(frozen=True, kw_only=True, slots=True)
class Preflight:
    """What the check found, kept for the run's report."""

    prediction: PlanReport
    """The evaluator's report of the plan (peak memory of every device, iteration time, MFU)."""
    capacities: list
    """(description, bytes) per rank, in rank order."""
    peak_flops: float
    """Sum of the catalog matrix peaks (model dtype) of the plan's devices, FLOP/s: MFU's denominator."""
    cluster_note: str | None = None
    """Why the plan was priced on stand-ins for its cluster (None when its own spec was found)."""


def check_fits(plan: Plan, prediction: PlanReport, capacities: list[tuple[str, int]], ranks: list[int] | None = None) -> None:
    """Refuse the plan when a rank's predicted peak exceeds its device's memory (one line, the worst rank)."""
    by_id = {d.id: d for d in prediction.devices}
    ids = plan.device_ids()
    over = []
    for rank in (range(len(ids)) if ranks is None else ranks):
        need, (where, cap) = by_id[ids[rank]].peak_memory_bytes, capacities[rank]
        if need > cap:
            over.append((need - cap, rank, need, where, cap))
    if over:
        _, rank, need, where, cap = max(over)
        more = f" ({len(over) - 1} other device(s) do not fit either)" if len(over) > 1 else ""
        raise BatonError(f"plan device {ids[rank]} (rank {rank}) needs {need / GIB:.2f} GiB at its peak but {where} "
                         f"has {cap / GIB:.2f} GiB{more}; plan again with this memory, or use more devices", field="--plan")


def preflight(plan: Plan, capacities: list[tuple[str, int]], *, cluster_path=None, profiles_dir=None,
              ranks: list[int] | None = None) -> Preflight:
    """Predict the plan on its cluster and check that ``ranks`` (all by default) fit their devices."""
    cluster, note = resolve_cluster(plan, cluster_path)
    prediction = evaluate(plan, cluster, prediction_profiles(plan, cluster, profiles_dir), plan_source="--plan")
    check_fits(plan, prediction, capacities, ranks)
    peak = peak_flops([cluster.device(i).gpu for i in plan.device_ids()], plan.model)
    return Preflight(prediction=prediction, capacities=capacities, peak_flops=peak, cluster_note=note)


# --- naming the local GPU ----------------------------------------------------------------------------

_CATALOG_NAMES = [  # (pattern over the lower-cased CUDA device name, catalog key; '{mem}' picks by memory)
    (r"h200", "h200"), (r"h100", "h100"), (r"a800", "a800-80gb"), (r"a100", "a100-{mem}"),
    (r"v100s", "v100s-32gb"), (r"v100", "v100-{mem}"), (r"p100", "p100"), (r"\bt4\b", "t4"), (r"\bl4\b", "l4"),
    (r"a10g", "a10g"), (r"a6000", "a6000"), (r"3090", "rtx3090"), (r"4090", "rtx4090"), (r"p40", "p40"),
]


def catalog_gpu(device_name: str, memory_bytes: int) -> str | None:
    """The catalog type of a CUDA device from its name and memory (None when the catalog lacks it)."""
    name = device_name.lower()
    for pattern, key in _CATALOG_NAMES:
        if re.search(pattern, name):
            if "{mem}" in key:
                sizes = sorted({int(k.rsplit("-", 1)[1][:-2]) for k in CATALOG if k.startswith(key.split("-")[0] + "-")
                                and k.endswith("gb")})
                gib = memory_bytes / GIB
                key = key.format(mem=f"{min(sizes, key=lambda s: abs(s - gib))}gb")
            return key if key in CATALOG else None
    return None
