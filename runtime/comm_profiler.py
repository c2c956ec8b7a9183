"""Measure all-reduce and send/receive on the chosen backend and fit the link model of the cluster spec.

Cost model (docs/cost-model.md, eq. 5 and 6): a ring all-reduce of X bytes over n ranks takes
2(n-1) * latency + 2(n-1)/n * X / bandwidth, a transfer latency + X / bandwidth. A least-squares line
through the measured (bytes, ms) points gives both parameters; the result is written as the
``bandwidth_gb_per_s`` / ``latency_us`` block a cluster YAML takes.
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from baton.errors import BatonError

DEFAULT_SIZES = tuple(2**k for k in range(12, 25, 2))  # 4 KiB .. 16 MiB


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkFit:
    """A fitted link and the points it came from."""

    backend: str
    """gloo or nccl."""
    world_size: int
    """Ranks in the all-reduce."""
    bandwidth_gb_per_s: float
    """From the send/receive slope."""
    latency_us: float
    """From the send/receive intercept."""
    allreduce_bandwidth_gb_per_s: float
    """Link bandwidth implied by the all-reduce slope under the ring model."""
    allreduce_latency_us: float
    """Per-step latency implied by the all-reduce intercept under the ring model."""
    points: dict
    """{'p2p': [[bytes, ms], ...], 'allreduce': [...]}"""

    def yaml_block(self) -> str:
        return (f"# measured by 'baton profile --comm' over {self.backend} ({self.world_size} ranks)\n"
                f"intra_node_link: {{bandwidth_gb_per_s: {self.bandwidth_gb_per_s:.3f}, latency_us: {self.latency_us:.1f}}}\n")

    def to_dict(self) -> dict:
        return asdict(self)


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(intercept ms, slope ms/byte) of a line fitted to relative error, intercept clamped at 0.

    Relative weighting keeps the small messages (which fix the latency) from being drowned by the large
    ones (which fix the bandwidth).
    """
    x = np.array([p[0] for p in points], dtype=float)
    y = np.array([p[1] for p in points], dtype=float)
    slope, intercept = np.polyfit(x, y, 1, w=1.0 / np.maximum(y, 1e-9))
    return max(float(intercept), 0.0), max(float(slope), 1e-15)


def _worker(rank: int, world: int, backend: str, init_file: str, sizes, reps: int, out_dir: str) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=120))
        device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
        if backend == "nccl":
            torch.cuda.set_device(device)

        def sync():
            if backend == "nccl":
                torch.cuda.synchronize()

        p2p, ar = [], []
        for size in sizes:
            t = torch.ones(size // 4, dtype=torch.float32, device=device)
            times_p, times_a = [], []
            for i in range(reps + 2):
                dist.barrier()
                sync()
                t0 = time.perf_counter()
                if rank == 0:
                    dist.send(t, 1)
                    dist.recv(t, 1)
                elif rank == 1:
                    dist.recv(t, 0)
                    dist.send(t, 0)
                sync()
                round_trip = (time.perf_counter() - t0) * 1e3
                dist.barrier()
                sync()
                t0 = time.perf_counter()
                dist.all_reduce(t)
                sync()
                took = (time.perf_counter() - t0) * 1e3
                if i >= 2:
                    times_p.append(round_trip / 2)
                    times_a.append(took)
            p2p.append((size, statistics.median(times_p)))
            ar.append((size, statistics.median(times_a)))
        if rank == 0:
            torch.save({"p2p": p2p, "allreduce": ar}, os.path.join(out_dir, "points.pt"))
        dist.destroy_process_group()
    except Exception:
        with open(os.path.join(out_dir, f"error-{rank}.txt"), "w") as fh:
            fh.write(traceback.format_exc())
        raise


def measure_links(*, backend: str = "gloo", world_size: int = 2, sizes=DEFAULT_SIZES, reps: int = 10, timeout_s: float = 300) -> LinkFit:
    """Spawn ``world_size`` local processes, time transfers and all-reduces, fit the link model."""
    if world_size < 2:
        raise BatonError("needs at least 2 ranks", field="--comm-ranks")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise BatonError(f"nccl needs {world_size} GPUs, this machine has {torch.cuda.device_count()}", field="--device")
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        ctx = mp.start_processes(_worker, args=(world_size, backend, init_file, tuple(sizes), reps, tmp),
                                 nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise BatonError(f"communication measurement did not finish in {timeout_s:.0f} s", field="--comm")
        except mp.ProcessRaisedException:
            errors = [open(os.path.join(tmp, f)).read().strip().splitlines()[-1] for f in sorted(os.listdir(tmp)) if f.startswith("error-")]
            raise BatonError("communication measurement failed: " + (errors[0] if errors else "a rank died"), field="--comm") from None
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
        points = torch.load(os.path.join(tmp, "points.pt"), weights_only=True)
    lat_p, slope_p = fit_line(points["p2p"])
    lat_a, slope_a = fit_line(points["allreduce"])
    n = world_size
    return LinkFit(
        backend=backend, world_size=n,
        bandwidth_gb_per_s=1.0 / (slope_p * 1e6), latency_us=lat_p * 1e3,
        allreduce_bandwidth_gb_per_s=(2 * (n - 1) / n) / (slope_a * 1e6), allreduce_latency_us=lat_a * 1e3 / (2 * (n - 1)),
        points={k: [list(map(float, p)) for p in v] for k, v in points.items()})
