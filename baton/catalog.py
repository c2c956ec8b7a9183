"""Public datasheet figures of the GPU types Baton knows, plus a ``cpu`` stand-in device.

Peaks are dense (no structured sparsity) tensor-core figures for fp16/bf16 and plain (non-TF32)
fp32, as vendors publish them; bandwidths are DRAM bandwidths. Where a GPU has no bf16 support its
``peak_bf16_tflops`` is None and a bf16 model is rejected for it.
"""
from __future__ import annotations

from dataclasses import dataclass

from baton.errors import BatonError

GIB = 1024**3
GB = 1e9


@dataclass(frozen=True, kw_only=True, slots=True)
class GpuType:
    """One kind of accelerator and the figures the analytic profiler and MFU need."""

    name: str
    """Catalog key, lower case (``a100-40gb``)."""
    memory_bytes: int
    """Device memory as sold (GiB for GPUs: a '40 GB' A100 has 40 GiB)."""
    peak_fp16_tflops: float
    """Dense fp16 matrix throughput (tensor cores where present), 10^12 FLOP/s."""
    peak_bf16_tflops: float | None
    """Dense bf16 matrix throughput; None where the GPU has no bf16 support."""
    peak_fp32_tflops: float
    """Plain fp32 throughput (no TF32), 10^12 FLOP/s."""
    memory_bandwidth_gb_per_s: float
    """DRAM bandwidth, 10^9 bytes/s."""
    note: str = ""
    """Where the figures come from, and any caveat."""

    def peak_tflops(self, dtype: str) -> float:
        """Matrix peak for the model's dtype; raises for bf16 on GPUs without it."""
        if dtype == "fp32":
            return self.peak_fp32_tflops
        if dtype == "fp16":
            return self.peak_fp16_tflops
        if dtype == "bf16":
            if self.peak_bf16_tflops is None:
                raise BatonError(f"GPU type '{self.name}' has no bf16 support; use dtype fp16 or fp32", field="dtype")
            return self.peak_bf16_tflops
        raise BatonError(f"unknown dtype '{dtype}' (expected fp16, bf16 or fp32)", field="dtype")


def _gpu(name, mem_gib, fp16, bf16, fp32, bw, note=""):
    return GpuType(
        name=name,
        memory_bytes=int(mem_gib * GIB),
        peak_fp16_tflops=fp16,
        peak_bf16_tflops=bf16,
        peak_fp32_tflops=fp32,
        memory_bandwidth_gb_per_s=bw,
        note=note,
    )


CATALOG: dict[str, GpuType] = {
    g.name: g
    for g in [
        _gpu("a100-40gb", 40, 312.0, 312.0, 19.5, 1555.0, "NVIDIA A100 SXM4 40GB datasheet"),
        _gpu("a100-80gb", 80, 312.0, 312.0, 19.5, 2039.0, "NVIDIA A100 SXM4 80GB datasheet"),
        _gpu("a800-80gb", 80, 312.0, 312.0, 19.5, 1935.0, "NVIDIA A800 PCIe 80GB: A100 compute, NVLink capped at 400 GB/s"),
        _gpu("h100", 80, 989.0, 989.0, 67.0, 3350.0, "NVIDIA H100 SXM5 80GB datasheet (dense)"),
        _gpu("h200", 141, 989.0, 989.0, 67.0, 4800.0, "NVIDIA H200 SXM 141GB datasheet (dense)"),
        _gpu("v100-16gb", 16, 125.0, None, 15.7, 900.0, "NVIDIA V100 SXM2 16GB datasheet"),
        _gpu("v100-32gb", 32, 125.0, None, 15.7, 900.0, "NVIDIA V100 SXM2 32GB datasheet"),
        _gpu("v100s-32gb", 32, 130.0, None, 16.4, 1134.0, "NVIDIA V100S PCIe 32GB datasheet"),
        _gpu("p100-12gb", 12, 18.7, None, 9.3, 549.0, "NVIDIA P100 PCIe 12GB datasheet"),
        _gpu("t4", 16, 65.0, None, 8.1, 320.0, "NVIDIA T4 datasheet (70 W)"),
        _gpu("l4", 24, 121.0, 121.0, 30.3, 300.0, "NVIDIA L4 datasheet (dense; 242 with sparsity)"),
        _gpu("a10g", 24, 70.0, 70.0, 31.2, 600.0, "AWS A10G as reported for g5 instances (dense tensor ~70 TFLOPS)"),
        _gpu("a6000", 48, 154.8, 154.8, 38.7, 768.0, "NVIDIA RTX A6000 datasheet (dense)"),
        _gpu("p100", 16, 21.2, None, 10.6, 732.0, "NVIDIA P100 SXM2 16GB datasheet (no tensor cores)"),
        _gpu("p40", 24, 0.18, None, 11.8, 346.0, "NVIDIA P40 datasheet: fp16 runs at 1/64 rate; train it in fp32"),
        _gpu("rtx3090", 24, 71.0, 71.0, 35.6, 936.0, "GeForce RTX 3090: dense fp16 tensor with fp32 accumulate"),
        _gpu("rtx4090", 24, 82.6, 82.6, 82.6, 1008.0, "GeForce RTX 4090: dense fp16 tensor with fp32 accumulate"),
        _gpu("cpu", 24, 0.2, 0.2, 0.2, 20.0, "stand-in for a CPU process; measure it with 'baton profile --device cpu'"),
    ]
}

ALIASES = {
    "a100": "a100-40gb",
    "v100": "v100-16gb",
    "a100-40g": "a100-40gb",
    "a100-80g": "a100-80gb",
    "h100-80gb": "h100",
    "3090": "rtx3090",
    "4090": "rtx4090",
    "rtx-a6000": "a6000",
}


def gpu_type(name: str, *, source: str | None = None, field: str | None = None) -> GpuType:
    """Look a GPU type up by catalog name or alias, case-insensitively."""
    key = str(name).strip().lower()
    key = ALIASES.get(key, key)
    if key not in CATALOG:
        raise BatonError(
            f"unknown GPU type '{name}' (known: {', '.join(CATALOG)})", source=source, field=field
        )
    return CATALOG[key]
