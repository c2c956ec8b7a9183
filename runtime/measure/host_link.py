"""The device's host link as eq. 2o prices it: the rate of a pinned copy each way.

The catalog gives each GPU type its PCIe generation's figure (``baton/catalog.py`` ``PCIE_GB_PER_S``: 48 GB/s for
PCIe 5 x16); a machine reaches its own (52-55 GB/s each way on an H200 host, bench/results/gpu-2026-11-27b.md).
``measure_host_link`` times copies of one size between a pinned host buffer and the device on a side stream, as
``runtime.parallel.offload`` makes them, and the slower direction is what a cluster node's ``host_link_gb_per_s``
takes. On a CPU it times host-to-host copies (the catalog's ``cpu`` entry stands for those).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class HostLink:
    """Measured copy rates between host memory and one device."""

    to_host_gb_per_s: float
    """Device to (pinned) host, median over repetitions."""
    to_device_gb_per_s: float
    """Host (pinned) to device, median over repetitions."""
    copy_bytes: int
    """Bytes of each timed copy."""

    @property
    def gb_per_s(self) -> float:
        """The rate eq. 2o takes for both directions: the slower one."""
        return min(self.to_host_gb_per_s, self.to_device_gb_per_s)


def measure_host_link(device: torch.device, *, copy_bytes: int = 256 << 20, reps: int = 5, warmup: int = 2) -> HostLink:
    """Time ``reps`` copies of ``copy_bytes`` each way between ``device`` and a pinned host buffer (``warmup`` untimed
    first: the first copies map the buffer)."""
    if copy_bytes <= 0 or reps < 1 or warmup < 0:
        raise ValueError("copy_bytes and reps must be positive, warmup at least 0")
    cuda = device.type == "cuda"
    host = torch.empty(copy_bytes, dtype=torch.uint8, pin_memory=cuda)
    dev = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
    host.fill_(1)
    dev.fill_(2)
    stream = torch.cuda.Stream(device) if cuda else None

    def timed(dst: torch.Tensor, src: torch.Tensor) -> float:
        if not cuda:
            t0 = time.perf_counter()
            dst.copy_(src)
            return time.perf_counter() - t0
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            dst.copy_(src, non_blocking=True)
            end.record(stream)
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    rates = {}
    for name, dst, src in (("to_host", host, dev), ("to_device", dev, host)):
        seconds = [timed(dst, src) for _ in range(warmup + reps)][warmup:]
        rates[name] = copy_bytes / max(statistics.median(seconds), 1e-9) / 1e9
    return HostLink(to_host_gb_per_s=rates["to_host"], to_device_gb_per_s=rates["to_device"], copy_bytes=copy_bytes)
