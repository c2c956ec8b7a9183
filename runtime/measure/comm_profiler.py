"""Measure all-reduce and send/receive on the chosen backend and fit the link model of the cluster spec.

Cost model (docs/cost-model.md, eq. 5 and 6): a ring all-reduce of X bytes over n ranks takes
2(n-1) * latency + 2(n-1)/n * X / bandwidth, a transfer latency + X / bandwidth. A least-squares line
through the measured (bytes, ms) points gives both parameters; the result is written as the
``bandwidth_gb_per_s`` / ``latency_us`` block a cluster YAML takes, with the all-reduce fit as
``allreduce_bandwidth_gb_per_s`` / ``allreduce_latency_us`` (collectives seldom reach the link's
transfer figures: over gloo on one host a 256 KiB all-reduce costs several transfers).

Transfers are timed several back to back after a barrier (the time of one is the batch's time over its
count), under the same core pinning as ``baton train`` (``BATON_PIN_CPUS=1``). The collectives of a
gradient sync (all-reduce; the sharded sync's reduce-scatter and all-gather, staging included) are timed
one call at a time as a step makes them: the measuring rank arrives last, from flushing its caches, while
the others already wait in the call (``_one_at_a_time``). Given a model, the
all-reduces of tensor parallelism are also measured by what they add to the runtime's own layer (four
layers split evenly over the ranks, run with and without the all-reduces; the difference over their
count) at each micro-batch size, and fitted on their own as ``tp_allreduce_bandwidth_gb_per_s`` /
``tp_allreduce_latency_us``. On gloo between CPU processes the two differ a lot: a 256 KiB all-reduce
took about 0.5-1 ms between idle ranks and about 2 ms inside the layer, where each rank arrives from
its own compute and gloo's I/O threads compete with it for the cores; and the in-layer cost grows
about three times faster with size.
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from baton.cluster import MAX_REPLICA_TIME_CV
from baton.errors import BatonError
from baton.model_spec import ModelSpec, splits_into
from runtime.launch.affinity import pin_rank
from runtime.launch.host_memory import keep_freed_memory
from runtime.train.precision import compute_dtype
from runtime.launch.processes import die_with_parent, stop_processes

DEFAULT_SIZES = tuple(2**k for k in range(12, 27, 2))  # 4 KiB .. 64 MiB: a whole small model's gradients
BATCH = 4
"""Operations per timed batch (transfers: back to back; collectives: one at a time, ``BATCH`` timings)."""
PIECES = 12
"""Tensors a unit's gradients and weights come in when the sharded sync is timed (a layer has 12)."""


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
    tp_allreduce_bandwidth_gb_per_s: float | None
    """Bandwidth implied by the all-reduces timed inside the tensor-parallel layer (None: not measured)."""
    tp_allreduce_latency_us: float | None
    """Per-step latency implied by those."""
    reduce_scatter_bandwidth_gb_per_s: float | None = None
    """Per-step bandwidth of the padded reduce-scatter the sharded sync runs (None: not measured)."""
    reduce_scatter_latency_us: float | None = None
    """Per-step latency of that reduce-scatter."""
    all_gather_bandwidth_gb_per_s: float | None = None
    """Per-step bandwidth of the sharded sync's all-gather (None: not measured)."""
    all_gather_latency_us: float | None = None
    """Per-step latency of that all-gather."""
    replica_time_cv: float | None = None
    """The relative spread of a rank's time for the same work between two meetings that the other ranks do not
    share (the cluster's ``replica_time_cv``, eq. 19; None: not measured)."""
    dtype: str = "fp32"
    """Element type the messages were timed in (the model's: gloo reduces bf16 at a fraction of fp32's rate per
    byte, so a bf16 model's syncs are priced from bf16 messages)."""
    points: dict
    """{'p2p': [[bytes, ms], ...], 'allreduce': [...], 'reduce_scatter': [...], 'all_gather': [...] (bytes: the
    whole flat vector, n chunks), 'allreduce_in_layer': [...] (given a model)}"""

    def link_fields(self) -> dict:
        """The fields of a cluster YAML link block."""
        fields = {"bandwidth_gb_per_s": round(self.bandwidth_gb_per_s, 4), "latency_us": round(self.latency_us, 2),
                  "allreduce_bandwidth_gb_per_s": round(self.allreduce_bandwidth_gb_per_s, 4),
                  "allreduce_latency_us": round(self.allreduce_latency_us, 2)}
        if self.tp_allreduce_bandwidth_gb_per_s is not None:
            fields.update(tp_allreduce_bandwidth_gb_per_s=round(self.tp_allreduce_bandwidth_gb_per_s, 4),
                          tp_allreduce_latency_us=round(self.tp_allreduce_latency_us, 2))
        for kind in ("reduce_scatter", "all_gather"):
            bw = getattr(self, f"{kind}_bandwidth_gb_per_s")
            if bw is not None:
                fields[f"{kind}_bandwidth_gb_per_s"] = round(bw, 4)
                fields[f"{kind}_latency_us"] = round(getattr(self, f"{kind}_latency_us"), 2)
        return fields

    def yaml_block(self, key: str = "intra_node_link") -> str:
        """The fit as a cluster file's link block under ``key`` (``nic`` for a link between machines)."""
        import yaml

        # The block goes into a node; the replicas' spread belongs at the top of the cluster file.
        noise, cv = "", self.replica_time_cv
        if cv is not None:
            # A cluster file refuses a cv beyond eq. 19's limit, so a noisier measurement is written at the limit.
            over = (f"# measured {cv:.4f}, beyond eq. 19's limit of {MAX_REPLICA_TIME_CV}: the host was too busy to say; "
                    "measure again on a quiet one\n" if cv > MAX_REPLICA_TIME_CV else "")
            noise = (f"# at the cluster file's top level (docs/cost-model.md, eq. 19):\n{over}"
                     f"# replica_time_cv: {min(cv, MAX_REPLICA_TIME_CV):.4f}\n")
        return (f"# measured by 'baton profile --comm' over {self.backend} ({self.world_size} ranks, {self.dtype} messages)\n"
                + noise + yaml.safe_dump({key: self.link_fields()}, default_flow_style=None, sort_keys=False,
                                         width=1000))

    def to_dict(self) -> dict:
        return asdict(self)


MIN_SIZE_SHARE = 0.1
"""Below this share of the largest message's time, a fitted per-byte term is within the noise of the
latency (a few percent between repetitions), not a bandwidth the measurement resolved."""


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(intercept ms, slope ms/byte) of a line fitted to relative error, intercept clamped at 0.

    Relative weighting keeps the small messages (which fix the latency) from being drowned by the large
    ones (which fix the bandwidth). Where the times do not grow measurably with the size (a slope of at
    most ``MIN_SIZE_SHARE`` of the largest message's time, or none: messages too small for the link, or
    noise), the fit has no bandwidth term and would imply an unbounded bandwidth. The slope is then the
    fastest rate actually measured (the smallest ms per byte of any point: a lower bound of the link's
    bandwidth, since every point's time includes its latency) and the intercept the one that then fits
    best, so the link block holds only figures the measurement supports.
    """
    x = np.array([p[0] for p in points], dtype=float)
    y = np.array([p[1] for p in points], dtype=float)
    slope, intercept = (float(v) for v in np.polyfit(x, y, 1, w=1.0 / np.maximum(y, 1e-9)))
    if slope * x.max() <= MIN_SIZE_SHARE * y[x.argmax()]:
        timed = (x > 0) & (y > 0)
        if not timed.any():
            raise BatonError("every message took no measurable time: no link figures can be fitted; measure larger "
                             "messages or more repetitions", field="--comm")
        slope = float(np.min(y[timed] / x[timed]))
        w = 1.0 / np.maximum(y, 1e-9) ** 2  # the intercept that fits best to relative error, given that slope
        intercept = float(np.sum(w * (y - slope * x)) / np.sum(w))
    return max(intercept, 0.0), slope


def _in_layer_allreduce(spec: ModelSpec, rank: int, world: int, micro_batches, reps: int,
                        beat: Callable[[], None] = lambda: None) -> list[tuple[int, float]]:
    """(bytes, ms per all-reduce) at each micro-batch size: what the all-reduces add to the runtime's
    tensor-parallel layer (gloo).

    Each rank runs its shard of four layers twice in turn, joined by the all-reduces and on its own
    (the same arithmetic, no communication); the difference of the medians over the number of
    all-reduces is the cost per all-reduce as training pays it: the call, the wait for the slower
    rank, and the time the communication threads take from the compute after the call returns.
    """
    from runtime.measure.op_profiler import _init
    from runtime.parallel.stage import StageModel
    from runtime.parallel.tp_layer import MicroBatch
    from runtime.parallel.tensor_parallel import AllReduceClock

    nh, nf = spec.num_heads // world, spec.ffn_dim // world
    shard = dict(layers=range(4), heads=range(rank * nh, (rank + 1) * nh), ffn_cols=range(rank * nf, (rank + 1) * nf),
                 first=False, last=False)
    dtype = compute_dtype(spec.dtype)
    joined, alone = StageModel(spec, tp_group=dist.group.WORLD, **shard), StageModel(spec, tp_group=None, **shard)
    for model in (joined, alone):
        _init(model, 0)
        model.to(dtype).train()
    points = []
    for b in micro_batches:
        mb = MicroBatch(seed=0, step=0, samples=torch.arange(b))
        x = torch.randn(b, spec.seq_len, spec.hidden_dim, generator=torch.Generator().manual_seed(b)).to(dtype)
        times = {"joined": [], "alone": []}
        calls = 0
        for i in range(reps + 2):
            for name, model in (("joined", joined), ("alone", alone)):
                dist.barrier()
                AllReduceClock.reset()
                t0 = time.perf_counter()
                xx = x.detach().requires_grad_()
                y = model(xx, mb)
                y.backward(torch.ones_like(y))
                took = (time.perf_counter() - t0) * 1e3
                if i >= 2:
                    times[name].append(took)
                if name == "joined":
                    calls = AllReduceClock.calls
            beat()
        # Every rank must hold the same figure: the mean of the ranks' differences.
        added = torch.tensor([max(statistics.median(times["joined"]) - statistics.median(times["alone"]), 0.0) / max(calls, 1)],
                             dtype=torch.float64)
        dist.all_reduce(added)
        points.append((b * spec.seq_len * spec.hidden_dim * spec.dtype_bytes, float(added) / world))
    return points


def _heartbeat(out_dir: str, rank: int) -> Callable[[], None]:
    """A function that marks this rank as still measuring (a file's time stamp the parent watches): the
    measurement's length grows with the model and the machine (a bf16 layer on a CPU without bf16
    instructions ran 18x slower than in fp32), so the parent gives up on a rank that stops finishing
    measurements, not on a run that is merely long."""
    path = os.path.join(out_dir, f"alive-{rank}")

    def beat() -> None:
        with open(path, "a"):
            os.utime(path)
    beat()
    return beat


NOISE_REPS = 40
"""Repetitions of the whole model's forward and backward the replica-time probe times on every rank."""


def _replica_times(spec: ModelSpec, rank: int, world: int, micro_batch: int, reps: int,
                   beat: Callable[[], None] = lambda: None) -> list[list[float]]:
    """Every rank's time (ms) for the same work, the whole model's layers forward and backward on its own, in
    ``reps`` rounds that start together (a barrier, as replicas leave a sync): times[r][i] of rank r in round i."""
    from runtime.measure.op_profiler import _init
    from runtime.parallel.stage import StageModel
    from runtime.parallel.tp_layer import MicroBatch

    dtype = compute_dtype(spec.dtype)
    model = StageModel(spec, tp_group=None, layers=range(spec.num_layers), heads=range(spec.num_heads),
                       ffn_cols=range(spec.ffn_dim), first=False, last=False)
    _init(model, 0)
    model.to(dtype).train()
    beat()  # building the whole model is this probe's longest gap between measurements
    mb = MicroBatch(seed=0, step=0, samples=torch.arange(micro_batch))
    x = torch.randn(micro_batch, spec.seq_len, spec.hidden_dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    mine = []
    for i in range(reps + 2):
        dist.barrier()
        t0 = time.perf_counter()
        y = model(x.detach().requires_grad_(), mb)
        y.backward(torch.ones_like(y))
        if i >= 2:
            mine.append((time.perf_counter() - t0) * 1e3)
        beat()
    everyone = [torch.zeros(reps, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(everyone, torch.tensor(mine, dtype=torch.float64))
    return [t.tolist() for t in everyone]


def replica_time_cv(times: list[list[float]]) -> float:
    """Eq. 19's cv from rounds of equal work started together: each rank's time relative to its own median, less
    the round's mean over the ranks (a slowdown every rank shares delays no one's arrival relative to the others);
    the standard deviation of what is left, with (n - 1) degrees of freedom per round (the round's mean takes one).
    The plain deviation, stalls included: a step pays for its stalls."""
    x = np.asarray(times, dtype=float)
    n = x.shape[0]
    rel = x / np.median(x, axis=1, keepdims=True) - 1.0
    own = rel - rel.mean(axis=0, keepdims=True)
    return float(np.sqrt((own ** 2).sum() / ((n - 1) * x.shape[1]))) if n > 1 else 0.0


def _worker(rank: int, world: int, backend: str, init_file: str, sizes, reps: int, out_dir: str, spec=None,
            micro_batches=(), parent_pid: int | None = None, dtype: str = "fp32") -> None:
    if parent_pid is not None:
        die_with_parent(parent_pid)  # a killed `baton profile --comm` must not leave ranks behind
    try:
        torch.set_num_threads(1)
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=120))
        pin_rank(rank)
        beat = _heartbeat(out_dir, rank)
        device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
        if device.type == "cpu":
            keep_freed_memory()  # the in-layer all-reduces are timed in the allocator state training runs in
        if backend == "nccl":
            torch.cuda.set_device(device)
        points = _link_points(rank, world, device, sizes, reps, compute_dtype(dtype), beat)
        noise = None
        if spec is not None:
            points["allreduce_in_layer"] = _in_layer_allreduce(spec, rank, world, micro_batches, reps, beat)
            noise = replica_time_cv(_replica_times(spec, rank, world, max(micro_batches), NOISE_REPS, beat))
        if rank == 0:
            torch.save(points, os.path.join(out_dir, "points.pt"))
            if noise is not None:
                torch.save(torch.tensor(noise, dtype=torch.float64), os.path.join(out_dir, "noise.pt"))
        dist.destroy_process_group()
    except Exception:
        with open(os.path.join(out_dir, f"error-{rank}.txt"), "w") as fh:
            fh.write(traceback.format_exc())
        raise


def _link_points(rank: int, world: int, device: torch.device, sizes, reps: int, elem: torch.dtype,
                 beat: Callable[[], None]) -> dict[str, list[tuple[int, float]]]:
    """(bytes, median ms) of every size for transfers, all-reduces and the sharded sync's reduce-scatter and
    all-gather (those at the size their equal shards add up to), messages of ``elem``."""
    from runtime.measure.op_profiler import cache_evictor

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    evict = cache_evictor(device)
    elem_bytes = torch.empty(0, dtype=elem).element_size()
    p2p, ar, rs, ag = [], [], [], []
    for size in sizes:
        t = torch.ones(size // elem_bytes, dtype=elem, device=device)
        shard = -(-t.numel() // world)  # the sharded sync pads the tensor to equal shards
        times_p, times_a, times_rs, times_ag = _time_size(t, shard, rank, world, reps, sync, evict, beat)
        p2p.append((size, statistics.median(times_p)))
        ar.append((size, statistics.median(times_a)))
        rs.append((shard * world * elem_bytes, statistics.median(times_rs)))
        ag.append((shard * world * elem_bytes, statistics.median(times_ag)))
    return {"p2p": p2p, "allreduce": ar, "reduce_scatter": rs, "all_gather": ag}


def _time_size(t: torch.Tensor, shard: int, rank: int, world: int, reps: int, sync: Callable[[], None],
               evict: Callable[[], None], beat: Callable[[], None]) -> tuple[list[float], list[float], list[float], list[float]]:
    """The ms of ``reps`` rounds (after two for warm-up) of one transfer (rank 0 to 1 and back, ``BATCH`` times,
    per transfer) and ``BATCH`` one-at-a-time all-reduces, reduce-scatters and all-gathers of ``t`` (in shards of
    ``shard`` elements)."""
    from runtime.train.replica_sync import padded_all_gather, padded_reduce_scatter  # the sharded sync's own passes

    device = t.device
    # A unit's gradients as the sharded sync finds them: several tensors, equal shards of the whole.
    pieces = [p.contiguous() for p in torch.ones(t.numel(), dtype=t.dtype, device=device).tensor_split(PIECES)]
    bounds = [0]
    for p in pieces:
        bounds.append(bounds[-1] + p.numel())
    offsets = tuple(min(k * shard, t.numel()) for k in range(world))
    shards = tuple(min(shard, t.numel() - o) for o in offsets)

    def copy(lo, hi, buf, into_buffer):  # as the runtime moves a flat range, piece by piece, either way
        for p, a in zip(pieces, bounds):
            x, y = max(lo, a), min(hi, a + p.numel())
            if x < y:
                part, piece = buf[x - lo:y - lo], p[x - a:y - a]
                (part if into_buffer else piece).copy_(piece if into_buffer else part)

    def fill(lo, hi, buf):
        copy(lo, hi, buf, True)

    def place(lo, hi, buf):
        copy(lo, hi, buf, False)

    def one_at_a_time(fn) -> list[float]:
        return _one_at_a_time(fn, rank, sync, evict)

    times_p, times_a, times_rs, times_ag = [], [], [], []
    for i in range(reps + 2):
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        for _ in range(BATCH):
            if rank == 0:
                dist.send(t, 1)
                dist.recv(t, 1)
            elif rank == 1:
                dist.recv(t, 0)
                dist.send(t, 0)
        sync()
        transfers = (time.perf_counter() - t0) * 1e3 / (2 * BATCH)
        took = one_at_a_time(lambda: dist.all_reduce(t))
        scattered = one_at_a_time(lambda: padded_reduce_scatter(offsets, shards, fill, copies=1, group=None,
                                                                dtype=t.dtype, device=device))
        gathered = one_at_a_time(lambda: padded_all_gather(offsets, shards, rank, fill, place, group=None,
                                                            dtype=t.dtype, device=device))
        beat()
        if i >= 2:
            times_p.append(transfers)
            times_a += took
            times_rs += scattered
            times_ag += gathered
    return times_p, times_a, times_rs, times_ag


def _one_at_a_time(fn: Callable[[], object], rank: int, sync: Callable[[], None], evict: Callable[[], None]) -> list[float]:
    """``BATCH`` calls, each alone and as a training step makes it: the ranks reach a sync pass from
    their own compute at different times, and the pass is charged from the last arrival (eq. 13-17).
    So rank 0 (whose figures are kept) comes last, from flushing its caches as a pass leaves them,
    while the others wait inside the call since the barrier: its start-up, the waiting peers' wake-up
    and its staging copies (finding nothing in cache) are paid in full. Back to back and cache-hot,
    the sharded passes came out up to 2x faster than in training; arriving together, both ranks
    stage their chunks at once and a layer's reduce-scatter took 9.4 ms (median) where arriving
    last from compute, as in training, took 8.3."""
    out = []
    for _ in range(BATCH):
        dist.barrier()
        sync()
        if rank == 0:
            evict()
            sync()
        t0 = time.perf_counter()
        fn()
        sync()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def measure_links(*, backend: str = "gloo", world_size: int = 2, sizes=DEFAULT_SIZES, reps: int = 10, timeout_s: float = 300,
                  spec: ModelSpec | None = None, micro_batches=(1, 2, 4), dtype: str | None = None) -> LinkFit:
    """Spawn ``world_size`` local processes, time transfers and collectives, fit the link model.

    Messages are of ``dtype`` (default: the model's, else fp32): the syncs move the model's gradients and
    weights, and a library's reductions need not run every type at one rate. With ``spec`` (a model whose
    heads and FFN columns split evenly over the ranks, gloo only, fp32 or bf16), all-reduces at its
    activation sizes are timed inside its tensor-parallel layer. ``timeout_s``: how long a rank may go without
    finishing a measurement before the run is given up (the whole run may take longer).
    """
    dtype = dtype or (spec.dtype if spec is not None else "fp32")
    if backend == "gloo" and dtype == "fp16":
        raise BatonError("gloo processes on CPUs do not train in fp16; measure the link in fp32 or bf16", field="--model")
    if spec is not None and (backend != "gloo" or spec.dtype == "fp16" or not splits_into(spec, world_size)):
        spec = None  # NCCL calls return before the GPU runs them: the microbenchmark (synchronised) is the measure there
    if world_size < 2:
        raise BatonError("needs at least 2 ranks", field="--comm-ranks")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise BatonError(f"nccl needs {world_size} GPUs, this machine has {torch.cuda.device_count()}", field="--device")
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        ctx = mp.start_processes(_worker, args=(world_size, backend, init_file, tuple(sizes), reps, tmp, spec, tuple(micro_batches),
                                                os.getpid(), dtype),
                                 nprocs=world_size, join=False, start_method="spawn")
        started = time.time()
        try:
            while not ctx.join(timeout=1.0):
                # Every rank must keep finishing measurements; a stalled one (a lost peer, a hung collective)
                # stops the run, however long the whole of it takes.
                beats = [os.path.join(tmp, f"alive-{r}") for r in range(world_size)]
                last = min((os.path.getmtime(b) if os.path.exists(b) else started) for b in beats)
                if time.time() - last > timeout_s:
                    raise BatonError(f"communication measurement made no progress for {timeout_s:.0f} s", field="--comm")
        except mp.ProcessRaisedException:
            errors = [open(os.path.join(tmp, f)).read().strip().splitlines()[-1] for f in sorted(os.listdir(tmp)) if f.startswith("error-")]
            raise BatonError("communication measurement failed: " + (errors[0] if errors else "a rank died"), field="--comm") from None
        finally:
            stop_processes(ctx.processes)
        points = torch.load(os.path.join(tmp, "points.pt"), weights_only=True)
        noise_path = os.path.join(tmp, "noise.pt")
        noise = float(torch.load(noise_path, weights_only=True)) if os.path.exists(noise_path) else None
    return link_fit(backend, world_size, points, dtype, replica_time_cv=noise)


def link_fit(backend: str, world_size: int, points: dict, dtype: str = "fp32", *, replica_time_cv: float | None = None) -> LinkFit:
    """Fit the link model to measured points: transfers as latency + bytes / bandwidth, all-reduces
    (between idle ranks, and inside the tensor-parallel layer where measured) as eq. 5's ring."""
    n = world_size

    def ring(pts):
        lat, slope = fit_line(pts)
        return (2 * (n - 1) / n) / (slope * 1e6), lat * 1e3 / (2 * (n - 1))

    def ring_pass(pts):
        """One ring pass of X bytes (n chunks of X/n): (n - 1) * (latency + X/n / bandwidth), eq. 13."""
        lat, slope = fit_line(pts)
        return ((n - 1) / n) / (slope * 1e6), lat * 1e3 / (n - 1)

    lat_p, slope_p = fit_line(points["p2p"])
    ar_bw, ar_lat = ring(points["allreduce"])
    inside = points.get("allreduce_in_layer") or []
    tp_bw, tp_lat = ring(inside) if len(inside) >= 2 else (None, None)
    rs_bw, rs_lat = ring_pass(points["reduce_scatter"]) if len(points.get("reduce_scatter") or []) >= 2 else (None, None)
    ag_bw, ag_lat = ring_pass(points["all_gather"]) if len(points.get("all_gather") or []) >= 2 else (None, None)
    return LinkFit(
        backend=backend, world_size=n, bandwidth_gb_per_s=1.0 / (slope_p * 1e6), latency_us=lat_p * 1e3,
        allreduce_bandwidth_gb_per_s=ar_bw, allreduce_latency_us=ar_lat,
        tp_allreduce_bandwidth_gb_per_s=tp_bw, tp_allreduce_latency_us=tp_lat,
        reduce_scatter_bandwidth_gb_per_s=rs_bw, reduce_scatter_latency_us=rs_lat,
        all_gather_bandwidth_gb_per_s=ag_bw, all_gather_latency_us=ag_lat, dtype=dtype, replica_time_cv=replica_time_cv,
        points={k: [[float(x) for x in p] for p in v] for k, v in points.items()})


def median_link(fits: list[LinkFit]) -> LinkFit:
    """One fit through the median, size by size, of several measurements of the same link."""
    first = fits[0]
    shape = {k: [p[0] for p in v] for k, v in first.points.items()}
    if any({k: [p[0] for p in v] for k, v in f.points.items()} != shape or f.world_size != first.world_size or f.dtype != first.dtype for f in fits):
        raise BatonError("link measurements to combine must have the same ranks, message type, kinds and sizes", field="--comm")
    points = {kind: [[size, statistics.median(f.points[kind][i][1] for f in fits)] for i, (size, _) in enumerate(pts)]
              for kind, pts in first.points.items()}
    noise = [f.replica_time_cv for f in fits if f.replica_time_cv is not None]
    return link_fit(first.backend, first.world_size, points, first.dtype,
                    replica_time_cv=statistics.median(noise) if noise else None)


MACHINE_SIZES = (2**18, 2**20, 2**22)  # 256 KiB .. 4 MiB: resolves tens of MB/s within seconds
"""Message sizes between two machines: a network is slower than a host's loopback, so smaller messages suffice."""


def measure_between_machines(endpoint: str, rank: int, *, sizes=MACHINE_SIZES, reps: int = 3, timeout_s: float = 300,
                             interface: str | None = None) -> LinkFit | None:
    """Time transfers and collectives between this machine and one other, one process on each (this one): rank 0
    holds the rendezvous at ``endpoint`` (HOST:PORT, its own address) and returns the fit of the link; rank 1
    returns None. ``interface`` is the network interface gloo talks through (GLOO_SOCKET_IFNAME)."""
    if rank not in (0, 1):
        raise BatonError(f"must be 0 (the machine at the endpoint) or 1, got {rank}", field="--peer-rank")
    if interface:
        os.environ["GLOO_SOCKET_IFNAME"] = interface
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            dist.init_process_group("gloo", init_method=f"tcp://{endpoint}", rank=rank, world_size=2,
                                    timeout=timedelta(seconds=timeout_s))
        except (RuntimeError, ValueError, TimeoutError) as exc:
            raise BatonError(f"could not meet the other machine at {endpoint}: {str(exc).splitlines()[0]}",
                             field="--peer") from None
        try:
            points = _link_points(rank, 2, torch.device("cpu"), tuple(sizes), reps, torch.float32, _heartbeat(tmp, rank))
        except RuntimeError as exc:
            raise BatonError(f"the link to the other machine failed: {str(exc).splitlines()[0]}", field="--peer") from None
        finally:
            dist.destroy_process_group()
    return link_fit("gloo", 2, points) if rank == 0 else None
