"""Public datasheet figures of the GPU types Baton knows, what real kernels reach of them, and a
``cpu`` stand-in device.

Peaks are dense (no structured sparsity) figures as vendors publish them: tensor-core fp16/bf16 and
TF32, and plain fp32 (the vector units). Bandwidths are DRAM bandwidths. Where a GPU has no bf16
support its ``peak_bf16_tflops`` is None and a bf16 model is rejected for it; where it has no TF32
``peak_tf32_tflops`` is None and fp32 matmuls run on the vector units whatever the setting.

Datasheet peaks are not what a training step sees. ``Architecture`` holds, per GPU generation, the
fractions of the peaks and of DRAM bandwidth that kernels reach and the fixed cost of every kernel;
each GPU adds the share of its boost clock it holds under sustained load (power-limited cards hold
far less). Every figure carries its source; ``baton show gpus`` prints them, and
``docs/cost-model.md`` section 11 says how the derivation uses them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from baton.errors import BatonError

GIB = 1024**3
GB = 1e9

REFERENCE = "profiles/reference/layers.csv"
"""Published and quoted per-layer and throughput measurements (bench/bench_profiles.py). The fitted figures below
were chosen on its fitting set (rows with ``set`` = fit) alone; its held-out set (other sources) checks them."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Architecture:
    """What kernels reach on one GPU generation, as fractions of the datasheet figures."""

    name: str
    """Generation key (``volta``, ``ampere-ga10x``...); calibration transfers between GPUs of one key."""
    fp32_issue: float
    """Share of the datasheet fp32 peak a GEMM inner loop can issue: 0.5 where the peak counts FP32
    lanes that are shared with INT32 (dual issue), which GEMMs do not keep busy."""
    gemm_fp32: float
    """Fraction of the issuable fp32 peak (at the sustained clock) cuBLAS SGEMM reaches on large shapes."""
    gemm_tensor: float
    """Same for fp16/bf16 tensor-core GEMMs; for GPUs without tensor cores, their fp16 vector GEMMs."""
    gemm_tf32: float = 0.0
    """Same for fp32 GEMMs on TF32 tensor cores (0 where the generation has none)."""
    bandwidth: float
    """Fraction of DRAM bandwidth a streaming kernel (copy, triad) reaches."""
    launch_us: float
    """Fixed cost of one operator in eager PyTorch: kernel launch plus framework dispatch."""
    small_op_us: float
    """Shortest time a LayerNorm or softmax kernel takes, however small its input (reductions, a sync per row)."""
    sources: dict[str, str] = field(default_factory=dict)
    """Figure name -> where it comes from."""


_FIT = f"fitted to the fitting set (set = fit) of {REFERENCE}"

ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in [
        Architecture(
            name="pascal", fp32_issue=1.0, gemm_fp32=0.8, gemm_tensor=0.7, bandwidth=0.8, launch_us=10.0, small_op_us=8.0,
            sources={"fp32_issue": "Pascal SM: 64 FP32 lanes, no dual issue (NVIDIA P100 whitepaper)",
                     "gemm_fp32": "estimate: as Volta (same cuBLAS SGEMM structure, no tensor cores)",
                     "gemm_tensor": "estimate: fp16 runs on the vector units (half2); 'tensor' here means those",
                     "gemm_tf32": "no TF32",
                     "bandwidth": "estimate: HBM2/GDDR5X stream kernels reach 75-85% (BabelStream-class results)",
                     "launch_us": "estimate: eager PyTorch dispatch + launch on older hosts",
                     "small_op_us": "estimate: as Volta"}),
        Architecture(
            name="volta", fp32_issue=1.0, gemm_fp32=0.8, gemm_tensor=0.55, bandwidth=0.85, launch_us=8.0, small_op_us=6.0,
            sources={"fp32_issue": "Volta SM: 64 FP32 lanes beside separate INT32 lanes (NVIDIA V100 whitepaper)",
                     "gemm_fp32": f"{_FIT} (V100, GPT-3 1.3B layer, fp32, 18 ms)",
                     "gemm_tensor": f"{_FIT} (V100 fp16 BERT-large throughput, Lambda)", "gemm_tf32": "no TF32",
                     "bandwidth": "estimate: V100 stream kernels reach ~800 of 900 GB/s (BabelStream-class results)",
                     "launch_us": "estimate: eager PyTorch dispatch + launch, ~5-10 us per op",
                     "small_op_us": "estimate: one block per row, a few us at any size"}),
        Architecture(
            name="turing", fp32_issue=1.0, gemm_fp32=0.8, gemm_tensor=0.7, bandwidth=0.8, launch_us=8.0, small_op_us=6.0,
            sources={"fp32_issue": "Turing SM: 64 FP32 lanes beside separate INT32 lanes (NVIDIA Turing whitepaper)",
                     "gemm_fp32": "estimate: as Volta (same SGEMM kernels); the T4's shortfall is its clock",
                     "gemm_tensor": "estimate: as Volta", "gemm_tf32": "no TF32",
                     "bandwidth": "estimate: GDDR6 stream kernels reach ~80%",
                     "launch_us": "estimate: as Volta", "small_op_us": "estimate: as Volta"}),
        Architecture(
            name="ampere-ga100", fp32_issue=1.0, gemm_fp32=0.8, gemm_tensor=0.6, gemm_tf32=0.5, bandwidth=0.85, launch_us=8.0, small_op_us=5.0,
            sources={"fp32_issue": "GA100 SM: 64 FP32 lanes, no dual issue (NVIDIA A100 whitepaper)",
                     "gemm_fp32": "estimate: as Volta",
                     "gemm_tensor": f"{_FIT} (A100 fp16 BERT-large throughput, Lambda)",
                     "gemm_tf32": f"{_FIT} (A100 TF32 BERT-large throughput, Lambda); TF32 operands are twice as wide as fp16",
                     "bandwidth": "estimate: HBM2e stream kernels reach ~85-90%",
                     "launch_us": "estimate: as Volta", "small_op_us": "estimate: slightly faster than Volta"}),
        Architecture(
            name="ampere-ga10x", fp32_issue=0.5, gemm_fp32=0.8, gemm_tensor=0.7, gemm_tf32=0.7, bandwidth=0.8, launch_us=8.0, small_op_us=5.0,
            sources={"fp32_issue": "GA10x SM: 128 FP32 lanes of which 64 share the INT32 path; the datasheet peak counts all "
                                   "128, SGEMM inner loops keep about half busy (issue 14: A6000/A10G measure ~2x the "
                                   "dual-issue roofline)",
                     "gemm_fp32": "estimate: as Volta, applied to the issuable half",
                     "gemm_tensor": f"{_FIT} (A6000, A10, RTX 3090 fp16 BERT-large throughput, Lambda)",
                     "gemm_tf32": f"{_FIT} (same cards, TF32)",
                     "bandwidth": "estimate: GDDR6(X) stream kernels reach ~80%",
                     "launch_us": "estimate: as Volta", "small_op_us": "estimate: as GA100"}),
        Architecture(
            name="ada", fp32_issue=0.5, gemm_fp32=0.8, gemm_tensor=0.7, gemm_tf32=0.7, bandwidth=0.8, launch_us=7.0, small_op_us=5.0,
            sources={"fp32_issue": "AD10x SM: same FP32/INT32 sharing as GA10x (NVIDIA Ada whitepaper)",
                     "gemm_fp32": "estimate: as GA10x",
                     "gemm_tensor": f"{_FIT} (RTX 4090 fp16 BERT-large throughput, Lambda)",
                     "gemm_tf32": f"{_FIT} (RTX 4090 TF32)",
                     "bandwidth": "estimate: GDDR6(X) stream kernels reach ~80%; the large L2 is not modelled",
                     "launch_us": "estimate: newer hosts", "small_op_us": "estimate: as GA100"}),
        Architecture(
            name="hopper", fp32_issue=1.0, gemm_fp32=0.75, gemm_tensor=0.55, gemm_tf32=0.5, bandwidth=0.85, launch_us=7.0, small_op_us=4.0,
            sources={"fp32_issue": "GH100 SM: 128 FP32 lanes, INT32 separate (NVIDIA H100 whitepaper)",
                     "gemm_fp32": "estimate: slightly below Volta, SGEMM is not the tuned path on Hopper",
                     "gemm_tensor": f"{_FIT} (H100 SXM fp16 BERT-large throughput, Lambda, PyTorch 1.13)",
                     "gemm_tf32": f"{_FIT} (H100 SXM TF32)",
                     "bandwidth": "estimate: HBM3 stream kernels reach ~85%",
                     "launch_us": "estimate: newer hosts", "small_op_us": "estimate"}),
        Architecture(
            name="cpu", fp32_issue=1.0, gemm_fp32=1.0, gemm_tensor=1.0, gemm_tf32=1.0, bandwidth=1.0, launch_us=8.0, small_op_us=0.0,
            sources={"*": "stand-in device: its catalog peaks are already effective figures; measure it with "
                          "'baton profile --device cpu' (measured tables win)"}),
    ]
}


PCIE_GB_PER_S = {3: 12.0, 4: 24.0, 5: 48.0}
"""Effective rate of a pinned host<->device copy over a x16 link per PCIe generation, each direction, 10^9 bytes/s:
about 3/4 of the link's 15.75, 31.5 and 63 GB/s (128b/130b coding, packet headers and the DMA engine; CUDA's
bandwidthTest reports 12-13 GB/s on gen 3 and 24-26 GB/s on gen 4 hosts, ~50 GB/s on gen 5). SXM modules reach
the host over PCIe too (A100: gen 4, H100/H200: gen 5, V100: gen 3)."""
CPU_COPY_GB_PER_S = 5.0
"""A CPU process's offload is a copy within host memory by the process itself, on its one thread: a 64 MiB
``torch.Tensor.copy_`` took 12.7 ms (5.3 GB/s, median of 10) on this project's 2-core test VM."""

HOST_OPTIMIZER_GB_PER_S = 20.0
"""DRAM traffic rate (10^9 bytes/s, eq. 10h) of torch's fused AdamW running on a training server's host CPUs, for a
device that keeps its optimizer state in host memory: eq. 10's bandwidth rule (36 bytes per parameter) at this
rate. A node's ``host_optimizer_gb_per_s`` overrides it. Measured here: 2.4 GB/s on this project's 2-core VM
(20M parameters, two threads, other work running); a server with tens of cores and several memory channels moves
about ten times that. A CPU process's own table (its measured optimizer row) prices its host step instead."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GpuType:
    """One kind of accelerator and the figures the analytic profiler and MFU need."""

    name: str
    """Catalog key, lower case (``a100-40gb``)."""
    memory_bytes: int
    """Device memory as sold (GiB for GPUs: a '40 GB' A100 has 40 GiB)."""
    peak_fp16_tflops: float
    """Dense fp16 matrix throughput with fp32 accumulation (tensor cores where present), 10^12 FLOP/s."""
    peak_bf16_tflops: float | None
    """Dense bf16 matrix throughput; None where the GPU has no bf16 support."""
    peak_fp32_tflops: float
    """Plain fp32 throughput (no TF32) as the datasheet gives it (dual issue counted where the SM has it)."""
    memory_bandwidth_gb_per_s: float
    """DRAM bandwidth, 10^9 bytes/s."""
    note: str = ""
    """Where the figures come from, and any caveat."""
    arch: str = "cpu"
    """Key into ``ARCHITECTURES``."""
    peak_tf32_tflops: float | None = None
    """Dense TF32 tensor throughput; None where the GPU has no TF32."""
    clock_fraction: float = 1.0
    """Share of the boost clock (the one the peaks assume) the GPU holds under sustained GEMM load."""
    clock_source: str = "estimate: holds near its boost clock at its power limit"
    """Where ``clock_fraction`` comes from."""
    host_link_gb_per_s: float = PCIE_GB_PER_S[3]
    """What a pinned copy between host memory and the device sustains in each direction, 10^9 bytes/s: its host
    link's effective rate (eq. 2o; a cluster node's ``host_link_gb_per_s`` overrides it)."""

    @property
    def architecture(self) -> Architecture:
        return ARCHITECTURES[self.arch]

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

    def matmul_tflops(self, dtype: str, *, tf32: bool = False) -> float:
        """What large GEMMs sustain in ``dtype`` (fp32 on TF32 tensor cores when ``tf32`` and the GPU has them)."""
        a = self.architecture
        if dtype == "fp32":
            if tf32 and self.peak_tf32_tflops is not None:
                return self.peak_tf32_tflops * self.clock_fraction * a.gemm_tf32
            return self.peak_fp32_tflops * a.fp32_issue * self.clock_fraction * a.gemm_fp32
        return self.peak_tflops(dtype) * self.clock_fraction * a.gemm_tensor

    def vector_tflops(self) -> float:
        """What elementwise and reduction kernels can issue in fp32."""
        return self.peak_fp32_tflops * self.architecture.fp32_issue * self.clock_fraction

    def achievable_bandwidth_gb_per_s(self) -> float:
        return self.memory_bandwidth_gb_per_s * self.architecture.bandwidth


def _gpu(name, mem_gib, fp16, bf16, fp32, bw, note="", *, arch, tf32=None, clock=1.0, clock_source=None, pcie=3,
         host_link=None):
    return GpuType(
        name=name,
        memory_bytes=int(mem_gib * GIB),
        peak_fp16_tflops=fp16,
        peak_bf16_tflops=bf16,
        peak_fp32_tflops=fp32,
        memory_bandwidth_gb_per_s=bw,
        note=note,
        arch=arch,
        peak_tf32_tflops=tf32,
        clock_fraction=clock,
        host_link_gb_per_s=host_link if host_link is not None else PCIE_GB_PER_S[pcie],
        **({"clock_source": clock_source} if clock_source else {}),
    )


CATALOG: dict[str, GpuType] = {
    g.name: g
    for g in [
        _gpu("a100-40gb", 40, 312.0, 312.0, 19.5, 1555.0, "NVIDIA A100 SXM4 40GB datasheet", arch="ampere-ga100", tf32=156.0,
             pcie=4),
        _gpu("a100-80gb", 80, 312.0, 312.0, 19.5, 2039.0, "NVIDIA A100 SXM4 80GB datasheet", arch="ampere-ga100", tf32=156.0,
             pcie=4),
        _gpu("a800-80gb", 80, 312.0, 312.0, 19.5, 1935.0, "NVIDIA A800 PCIe 80GB: A100 compute, NVLink capped at 400 GB/s",
             arch="ampere-ga100", tf32=156.0, clock=0.9,
             clock_source="estimate: PCIe card at 300 W holds less clock than the 400 W SXM4 A100", pcie=4),
        _gpu("h100", 80, 989.0, 989.0, 67.0, 3350.0, "NVIDIA H100 SXM5 80GB datasheet (dense)", arch="hopper", tf32=494.7,
             clock=0.9, clock_source="estimate: sustained GEMM load at 700 W runs ~10% below the 1.98 GHz boost", pcie=5),
        _gpu("h200", 141, 989.0, 989.0, 67.0, 4800.0, "NVIDIA H200 SXM 141GB datasheet (dense)", arch="hopper", tf32=494.7,
             clock=0.9, clock_source="estimate: as H100 SXM", pcie=5),
        _gpu("v100-16gb", 16, 125.0, None, 15.7, 900.0, "NVIDIA V100 SXM2 16GB datasheet", arch="volta"),
        _gpu("v100-32gb", 32, 125.0, None, 15.7, 900.0, "NVIDIA V100 SXM2 32GB datasheet", arch="volta"),
        _gpu("v100s-32gb", 32, 130.0, None, 16.4, 1134.0, "NVIDIA V100S PCIe 32GB datasheet", arch="volta"),
        _gpu("p100-12gb", 12, 18.7, None, 9.3, 549.0, "NVIDIA P100 PCIe 12GB datasheet", arch="pascal"),
        _gpu("t4", 16, 65.0, None, 8.1, 320.0, "NVIDIA T4 datasheet (70 W)", arch="turing", clock=0.67,
             clock_source=f"{_FIT} (T4 2.9x V100); 70 W cap: sustained GEMM clocks ~1.0 GHz of the 1.59 GHz boost"),
        _gpu("l4", 24, 121.0, 121.0, 30.3, 300.0, "NVIDIA L4 datasheet (dense; 242 with sparsity)", arch="ada", tf32=60.0,
             clock=0.55, clock_source=f"{_FIT} (L4 1.9x V100); 72 W cap: sustained GEMM clocks ~1.0 GHz of the 2.04 GHz boost",
             pcie=4),
        _gpu("a10g", 24, 70.0, 70.0, 31.2, 600.0, "AWS A10G as reported for g5 instances (dense tensor ~70 TFLOPS)",
             arch="ampere-ga10x", tf32=35.0, clock=0.94,
             clock_source=f"{_FIT} (A10G ~1.1x V100); power-capped card, ~1.6 of 1.71 GHz under GEMM load", pcie=4),
        _gpu("a6000", 48, 154.8, 154.8, 38.7, 768.0, "NVIDIA RTX A6000 datasheet (dense)", arch="ampere-ga10x", tf32=77.4,
             clock=0.95, clock_source=f"{_FIT} (A6000 ~0.9x V100); 300 W, ~1.7 of 1.8 GHz under GEMM load", pcie=4),
        _gpu("p100", 16, 21.2, None, 10.6, 732.0, "NVIDIA P100 SXM2 16GB datasheet (no tensor cores)", arch="pascal"),
        _gpu("p40", 24, 0.18, None, 11.8, 346.0, "NVIDIA P40 datasheet: fp16 runs at 1/64 rate; train it in fp32", arch="pascal",
             clock=0.85, clock_source="estimate: 250 W passively cooled card, below its 1.53 GHz boost under load"),
        _gpu("rtx3090", 24, 71.0, 71.0, 35.6, 936.0, "GeForce RTX 3090: dense fp16 tensor with fp32 accumulate",
             arch="ampere-ga10x", tf32=35.6, clock=1.05,
             clock_source=f"{_FIT} (RTX 3090, Lambda); GeForce cards run above their rated boost clock when power allows",
             pcie=4),
        _gpu("rtx4090", 24, 165.2, 165.2, 82.6, 1008.0,
             "GeForce RTX 4090 (Ada whitepaper): dense fp16/bf16 tensor with fp32 accumulate 165.2, TF32 82.6",
             arch="ada", tf32=82.6, clock=1.05,
             clock_source=f"{_FIT} (RTX 4090, Lambda); GeForce cards run above their rated boost clock when power allows",
             pcie=4),
        _gpu("cpu", 24, 0.2, 0.2, 0.2, 20.0, "stand-in for a CPU process; measure it with 'baton profile --device cpu'", arch="cpu",
             host_link=CPU_COPY_GB_PER_S),
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
