"""Baselines, each the best plan its rules allow, all scored by the same evaluator.

* megatron: uniform layers per stage, uniform TP (equal shares), data parallelism, recompute none /
  selective (attention core) / full on every device; ranks laid out TP-fastest, then DP, then PP over the
  devices in cluster order (optionally only some GPU types).
* hethub: stages of one GPU type each with a TP degree per type (equal shares), uneven layers (chosen
  exactly by the inner MILP), recompute none or full per stage, every type order tried.
* hap: one TP group (no pipeline) with uneven shares from HAP's sharding-ratio LP, rounded to units.
* poplar: pure data parallelism, every device its own replica with its own batch, balanced on each device's
  compute time as Poplar's Algorithm 2 does; each ZeRO stage 0-3 (even shards), the best that fits.
* cephalo: pure data parallelism at stage 3 (Cephalo is built on FSDP, i.e. ZeRO-3, with layered gradient
  accumulation), every device its own batch (Cephalo's dynamic programme: slowest device's compute time,
  aggregate memory), full recomputation (activation checkpointing), and uneven training-state shards given
  greedily to the device with the lowest memory use.
* exhaustive: every plan (layout, rank order, batch split, sharding stage and shard-ratio grid, layers,
  units, recompute sets from a given universe; offered chunk counts, interleaved pipelines too), each evaluated.
  Small instances only: the test oracle.
"""
from __future__ import annotations

import itertools
import math
import multiprocessing
import os
import pickle
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, replace

import pyomo.environ as pyo

import numpy as np

from baton.cluster import ClusterSpec
from baton.errors import BatonError
from baton.costmodel import (device_memory, device_slot, edge_cost, edge_param_count, layer_cost, layer_limits,
                             layer_param_count, layer_train_ms, sync_buffer_bytes)
from baton.evaluate import evaluate
from baton.lifetime import die_with_parent
from baton.memory import held_tensors, recompute_space, tensor_roles
from baton.model_spec import ModelSpec
from baton.operators import operator_names
from baton.plan import DeviceShare, Pipeline, Plan, Stage, plan_of_replicas, validate
from baton.profile import ProfileSet

from solver import stop
from solver.milp import highs_solve
from solver.options import ratio_vectors, units_in_proportion, valid_unit_counts
from solver.space import Skeleton, device_codes, hethub_layout, megatron_layout
from solver.search import NoPlanFits, SolveResult, micro_batch_candidates, search

SELECTIVE = ("attn_scores", "softmax", "attn_dropout", "attn_v")


def recompute_modes(spec) -> dict[str, tuple[str, ...]]:
    names = operator_names(spec)
    return {"none": (), "selective": tuple(o for o in names if o in SELECTIVE), "full": tuple(names)}


def _result(best, strategy, t0, evaluated, notes=()) -> SolveResult:
    if best is None:
        raise NoPlanFits(f"{strategy}: no plan allowed by its rules fits in memory ({evaluated} evaluated)")
    report, plan = best
    total = time.perf_counter() - t0
    res = SolveResult(plan=plan, report=report, strategy=strategy, status="best of enumeration",
                      objective_ms=report.iteration_time_ms, bound_ms=report.iteration_time_ms, gap=0.0, build_s=0.0,
                      solve_s=total, total_s=total, family="enumeration", candidates=evaluated, notes=list(notes))
    res.plan = plan.with_info(**res.info())
    return res


def _consider(best, plan, cluster, profiles):
    report = evaluate(plan, cluster, profiles)
    if report.fits and (best is None or report.iteration_time_ms < best[0].iteration_time_ms):
        return (report, plan)
    return best


def _type_subsets(cluster):
    types = cluster.gpu_types
    for k in range(len(types), 0, -1):
        for sub in itertools.combinations(types, k):
            yield [d for d in cluster.devices if d.gpu.name in sub]


def megatron(spec, cluster, profiles, *, global_batch: int, micro_batch: int | None = None) -> SolveResult:
    t0 = time.perf_counter()
    N = spec.num_layers
    Us = valid_unit_counts(spec)
    modes = recompute_modes(spec)
    best, n_eval = None, 0
    for b in micro_batch_candidates(spec, cluster, profiles, global_batch, micro_batch):
        for devs in _type_subsets(cluster):
            n = len(devs)
            for t in [u for u in Us if n % u == 0]:
                for p in [q for q in range(1, N + 1) if N % q == 0 and (n // t) % q == 0]:
                    layout = megatron_layout([d.id for d in devs], t, p)
                    if global_batch % (b * layout.num_replicas):
                        continue
                    for rec in modes.values():
                        pipes = tuple(Pipeline(stages=tuple(
                            Stage(first_layer=s * (N // p), num_layers=N // p, units_per_layer=t,
                                  devices=tuple(DeviceShare(id=i, units=1, recompute=rec) for i in ids))
                            for s, ids in enumerate(pipe))) for pipe in layout.pipelines)
                        plan = validate(Plan(model=spec, cluster=cluster.name, micro_batch_size=b,
                                             num_microbatches=global_batch // (b * layout.num_replicas), pipelines=pipes))
                        best = _consider(best, plan, cluster, profiles)
                        n_eval += 1
    return _result(best, "megatron", t0, n_eval)


def hethub_skeletons(spec, cluster) -> list[Skeleton]:
    """Stages of one GPU type; each type cut into equal TP groups (devices in cluster order)."""
    by_type: dict[str, list[str]] = {}
    for d in cluster.devices:
        by_type.setdefault(d.gpu.name, []).append(d.id)
    out = []
    types = list(by_type)
    for k in range(1, len(types) + 1):
        for order in itertools.permutations(types, k):
            degrees = [[t for t in valid_unit_counts(spec) if len(by_type[g]) % t == 0] for g in order]
            for ts in itertools.product(*degrees):
                sk = hethub_layout(by_type, order, ts)
                if sk.num_stages <= spec.num_layers + 2:
                    out.append(sk)
    return out


def hethub(spec, cluster, profiles, *, global_batch: int, micro_batch: int | None = None, time_limit: float = 60.0,
           gap: float = 1e-4, threads: int = 2) -> SolveResult:
    modes = recompute_modes(spec)
    allowed = {"uniform_tp": True, "recompute": {frozenset(), frozenset(modes["full"])}}
    res = search(spec, cluster, profiles, global_batch=global_batch, micro_batch=micro_batch, time_limit=time_limit, gap=gap,
                 threads=threads, skeletons=hethub_skeletons(spec, cluster), family="hethub", strategy="hethub",
                 allowed=allowed, space=recompute_space(spec, (frozenset(), frozenset(modes["full"]))),
                 splits="uniform", zero_stages=(0,))
    return res


def hap_shares(times_at: list[list[float]], U: int, threads: int = 1) -> list[int]:
    """HAP's sharding-ratio LP (Sec. 5.1): minimise max_j comp_j(B_j), comp_j linear in the ratio, sum B = 1;
    then round B_j * U to units (largest remainder, at least one each)."""
    n = len(times_at)
    m = pyo.ConcreteModel()
    m.B = pyo.Var(range(n), domain=pyo.NonNegativeReals)
    m.z = pyo.Var(domain=pyo.NonNegativeReals)
    m.c = pyo.ConstraintList()
    m.c.add(sum(m.B[j] for j in range(n)) == 1)
    for j, (a, slope) in enumerate(times_at):  # comp_j(B) = a + slope * B
        m.c.add(m.z >= a + slope * m.B[j])
    m.obj = pyo.Objective(expr=m.z)
    res = highs_solve(m, threads=threads)
    res.solution_loader.load_vars()
    ratios = [max(0.0, pyo.value(m.B[j])) for j in range(n)]
    return units_in_proportion(ratios, U)


def hap(spec, cluster, profiles, *, global_batch: int, micro_batch: int | None = None, threads: int = 1) -> SolveResult:
    t0 = time.perf_counter()
    N = spec.num_layers
    modes = recompute_modes(spec)
    best, n_eval = None, 0

    for b in micro_batch_candidates(spec, cluster, profiles, global_batch, micro_batch):
        for devs in _type_subsets(cluster):
            Us = [u for u in valid_unit_counts(spec) if u >= len(devs)]
            if not Us:
                continue
            U = max(Us)
            times = []
            for d in devs:  # HAP's linear cost model, through shares 1/U and 1
                prof = profiles[d.gpu.name]
                full, least = layer_train_ms(prof, spec, b, 1.0), layer_train_ms(prof, spec, b, 1.0 / U)
                slope = (full - least) / (1 - 1.0 / U) if U > 1 else full
                times.append((full - slope, slope))
            units = hap_shares(times, U, threads)
            for rec in modes.values():
                stage = Stage(first_layer=0, num_layers=N, units_per_layer=U,
                              devices=tuple(DeviceShare(id=d.id, units=u, recompute=rec) for d, u in zip(devs, units)))
                plan = validate(Plan(model=spec, cluster=cluster.name, micro_batch_size=b, num_microbatches=global_batch // b,
                                     pipelines=(Pipeline(stages=(stage,)),)))
                best = _consider(best, plan, cluster, profiles)
                n_eval += 1
    return _result(best, "hap", t0, n_eval)


# -- pure data parallelism: Poplar and Cephalo ----------------------------------------------------------


def _lone(spec, cluster, profiles, device_id: str, b: int, recompute: tuple, *, owned: float = 1.0, group: int = 1,
          zero_stage: int = 0, num_microbatches: int = 1, offload: tuple = ()):
    """A device training the whole model alone on ``num_microbatches`` micro-batches of b (in flight together at
    stages 2 and 3), keeping ``offload`` in host memory: (F + B ms per micro-batch, peak bytes owning ``owned`` of
    its state, bytes owning none of it and without sync buffer, bytes owning all of it adds), from the cost model
    (eq. 2, 2o-4o, 7-9, 14, 18). At stages 2 and 3 the buffer is the largest unit's (a layer or the edges)."""
    slot = device_slot(cluster, profiles, spec, b, device_id, stage=0, num_stages=1, num_microbatches=num_microbatches,
                       layered=zero_stage >= 2)
    lc = layer_cost(slot.profile, spec, b, 1.0, recompute, offload, cluster.device(device_id).host_link_gb_per_s)
    edge = edge_cost(slot, spec, b, 1.0)
    N = spec.num_layers
    ms = N * (sum(lc.block_fwd_ms()) + sum(lc.block_bwd_ms())) + edge.fwd_ms + edge.bwd_ms
    layer, edges = layer_param_count(spec, 1.0), edge_param_count(spec, 1.0, first=True, last=True)
    params = max(layer, edges) if zero_stage >= 2 else layer * N + edges
    buf = sync_buffer_bytes(spec, group, params * owned, min(zero_stage, 1))

    def peak(own, buffer):
        return float(device_memory(slot, spec, N, param_bytes=lc.param_bytes, held_bytes=lc.held_bytes,
                                   transient_bytes=lc.transient_bytes, edge=edge, owned_fraction=own, sync_buffer_bytes=buffer,
                                   zero_stage=zero_stage, owned_layer_fraction=own).peak_bytes)

    bare = peak(0.0, 0.0)
    return ms, peak(owned, buf), bare, peak(1.0, 0.0) - bare


def _sizes(cluster, profiles, device_id, global_batch, micro_batch):
    if micro_batch is not None:
        return [micro_batch]
    return [b for b in profiles[cluster.device(device_id).gpu.name].micro_batches("qkv") if b <= global_batch]


def _dp_plan(spec, cluster, ids, batches, zero_stage, recompute, ratios=None, offload=()) -> Plan:
    """Every device its own replica holding the whole model, with its own (micro-batch size, count)."""
    N = spec.num_layers
    replicas = [[Stage(first_layer=0, num_layers=N, units_per_layer=1, devices=(
        DeviceShare(id=i, units=1, recompute=recompute, offload=offload, shard_ratio=None if ratios is None else ratios[k]),))]
        for k, i in enumerate(ids)]
    return validate(plan_of_replicas(spec, batches, zero_stage if len(ids) > 1 else 0, replicas, cluster=cluster.name))


def poplar_batches(spec, cluster, profiles, ids, *, global_batch: int, zero_stage: int, micro_batch: int | None = None,
                   keep_all: bool = False):
    """Poplar's batch allocation (Algorithm 2, lines 1-16) over the devices ``ids``: each device's speed is its
    best samples/ms over the micro-batch sizes that fit it with one micro-batch (Algorithm 1 runs one batch at
    the given ZeRO stage: its memory with every device in the sync group, shards even); the global batch goes in
    proportion to speed, rounded down, and the samples left go one by one to the device that would finish them
    soonest. A device then runs the fastest fitting micro-batch size that divides its samples (Poplar's last
    smaller batch is not in our plan format). At stages 2 and 3 our replicas run layer by layer, every
    micro-batch in flight (eq. 18), which Poplar's one-batch measurement does not see; the evaluator decides
    whether the plan fits. Returns (ids kept, [(b, m)] per kept device) or None; devices given no sample are
    dropped, unless ``keep_all`` (then None)."""
    n = len(ids)
    own = 1.0 / n if zero_stage else 1.0
    speed, options = [], []
    for i in ids:
        fit = {}
        for b in _sizes(cluster, profiles, i, global_batch, micro_batch):
            ms, peak, _, _ = _lone(spec, cluster, profiles, i, b, (), owned=own, group=n, zero_stage=zero_stage)
            if peak <= cluster.device(i).memory_bytes:
                fit[b] = b / ms
        if not fit:
            return None  # this stage cannot hold the model on this device (Poplar moves to the next stage)
        options.append(fit)
        speed.append(max(fit.values()))
    total = sum(speed)
    samples = [math.floor(global_batch * v / total) for v in speed]
    while sum(samples) < global_batch:
        k = min(range(n), key=lambda k: ((samples[k] + 1) / speed[k], k))
        samples[k] += 1
    kept, batches = [], []
    for i, n_i, fit in zip(ids, samples, options):
        if n_i == 0:
            if keep_all:
                return None
            continue
        divisors = [b for b in fit if n_i % b == 0]
        if not divisors:
            return None
        b = max(divisors, key=lambda b: (fit[b], b))
        kept.append(i)
        batches.append((b, n_i // b))
    return kept, batches


def poplar(spec, cluster, profiles, *, global_batch: int, micro_batch: int | None = None,
           zero_stages: tuple[int, ...] = (0, 1, 2, 3)) -> SolveResult:
    """Poplar: every device its own replica (no tensor or pipeline parallelism, no recomputation), per-device
    batches balancing compute time, each ZeRO stage 0-3 (even shards; Poplar searches every stage); the best that
    fits."""
    t0 = time.perf_counter()
    micro_batch_candidates(spec, cluster, profiles, global_batch, micro_batch)
    ids = [d.id for d in cluster.devices]
    best, n_eval = None, 0
    for z in zero_stages:
        got = poplar_batches(spec, cluster, profiles, ids, global_batch=global_batch, zero_stage=z, micro_batch=micro_batch)
        if got is None or (z >= 1 and len(got[0]) == 1):
            continue
        best = _consider(best, _dp_plan(spec, cluster, got[0], got[1], z, ()), cluster, profiles)
        n_eval += 1
    return _result(best, "poplar", t0, n_eval)


CEPHALO_GRAIN = 256
"""Cephalo's greedy hands out the optimizer state in 1/256 pieces (a power of two: exact ratios)."""


CEPHALO_STAGE = 3
"""Cephalo is built on FSDP (ZeRO-3: weights, gradients and optimizer state sharded) with layered gradient
accumulation (all micro-batches of one layer before the next); its paper has no other stage."""


def _cephalo_memory(spec, cluster, profiles, device_id: str, b: int, l: int):
    """(bytes owning none of the training state, bytes owning all of it adds) of a device running l micro-batches
    of b at Cephalo's stage with every layer recomputed and its boundary in host memory: its compute memory and its
    training state (eq. 18, 3o)."""
    full = tuple(operator_names(spec))
    _, _, bare, state = _lone(spec, cluster, profiles, device_id, b, full, zero_stage=CEPHALO_STAGE, num_microbatches=l,
                              offload=cephalo_offload(spec))
    return bare, state


def cephalo_offload(spec) -> tuple[str, ...]:
    """What Cephalo keeps in host memory: with every layer checkpointed, the layer boundary (every tensor a layer
    then holds, ``baton.memory.held_tensors``)."""
    return held_tensors(spec, frozenset(operator_names(spec)))


def cephalo_batches(spec, cluster, profiles, ids, *, global_batch: int, micro_batch: int | None = None, skip: int = 0,
                    deadline_s: float | None = None):
    """Cephalo's compute partition (its dynamic programme, eq. 4 of the paper): every device i gets l_i >= 1
    micro-batches of a size b_i whose compute memory fits it (the unsharded part at stage 3: the edges, one
    gathered layer and one layer's gradient, the activations of all l_i micro-batches with every layer
    recomputed, as layered accumulation keeps them; constraint II), sum b_i l_i = G, the free memory left holds
    the whole training state between them (constraint III: sum_i free_i / state_i >= 1, state_i the state's
    bytes on device i), minimising the slowest device's l_i (F + B). The ``skip``-th smallest feasible threshold
    is taken (0: the best). Returns [(b, l)] per device or None. ``deadline_s`` (``time.perf_counter()``): past it,
    TimeoutError (the dynamic programme is linear in the devices times the batch: minutes at 1,024 GPUs)."""
    full = tuple(operator_names(spec))
    G = global_batch
    offload = cephalo_offload(spec)
    opts, rows = [], {}  # per device: [(b, l, ms, free / state)]; alike devices (device_codes) share theirs
    kind_of = device_codes(cluster)[1]
    for i in ids:
        _past(deadline_s)
        kind = kind_of[i]
        if kind not in rows:
            row = []
            for b in _sizes(cluster, profiles, i, G, micro_batch):
                ms = _lone(spec, cluster, profiles, i, b, full, offload=offload)[0]
                for l in range(1, G // b + 1):
                    bare, state = _cephalo_memory(spec, cluster, profiles, i, b, l)
                    free = cluster.device(i).memory_bytes - bare
                    if free < 0:
                        break  # more micro-batches in flight only need more
                    row.append((b, l, ms, free / state))
            rows[kind] = row
        if not rows[kind]:
            return None
        opts.append(rows[kind])
    times = np.unique([l * ms for row in opts for b, l, ms, _ in row])

    def table(T):
        """best[j] = most free memory (in states) over assignments of j samples with every device within T."""
        best = np.zeros(G + 1)
        best[1:] = -np.inf
        picks = []
        for row in opts:
            _past(deadline_s)
            new = np.full(G + 1, -np.inf)
            pick = np.zeros((G + 1, 2), dtype=np.int64)
            for b, l, ms, free in row:
                if l * ms > T * (1 + 1e-12):
                    continue
                n = b * l
                cand = np.full(G + 1, -np.inf)
                cand[n:] = best[:G + 1 - n] + free
                better = cand > new
                new = np.where(better, cand, new)
                pick[better] = (b, l)
            best = new
            picks.append(pick)
        return best, picks

    feasible = [None]

    def ok(k):
        best, picks = table(times[k])
        if best[G] >= 1:
            feasible[0] = picks
            return True
        return False

    lo, hi = 0, len(times) - 1
    if hi < 0 or not ok(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    k = min(lo + skip, len(times) - 1)
    ok(k)
    picks, out, j = feasible[0], [], G
    for pick in reversed(picks):
        b, l = (int(x) for x in pick[j])
        if l == 0:
            return None
        out.append((b, l))
        j -= b * l
    return list(reversed(out)) if j == 0 else None


def _past(deadline_s: float | None) -> None:
    if deadline_s is not None and stop.past(deadline_s):
        raise TimeoutError


def cephalo_ratios(spec, cluster, profiles, ids, batches) -> list[float] | None:
    """Cephalo's training-state partition: pieces of 1/CEPHALO_GRAIN of the training state, each to the device
    whose memory use (compute memory plus the state it owns, over its capacity) is lowest, until all are given."""
    used, cap, piece = [], [], []
    for i, (b, l) in zip(ids, batches):
        bare, state = _cephalo_memory(spec, cluster, profiles, i, b, l)
        used.append(bare)
        cap.append(cluster.device(i).memory_bytes)
        piece.append(state / CEPHALO_GRAIN)
    pieces = [0] * len(ids)
    for _ in range(CEPHALO_GRAIN):
        room = [k for k in range(len(ids)) if used[k] + piece[k] <= cap[k]]
        if not room:
            return None
        k = min(room, key=lambda k: ((used[k] + piece[k]) / cap[k], k))
        pieces[k] += 1
        used[k] += piece[k]
    return [x / CEPHALO_GRAIN for x in pieces]


def cephalo(spec, cluster, profiles, *, global_batch: int, micro_batch: int | None = None, tries: int = 8) -> SolveResult:
    """Cephalo: every device its own replica at stage 3 with layered accumulation (FSDP; no tensor or pipeline
    parallelism), its batch from the dynamic programme, every layer recomputed, uneven training-state shards from
    the greedy, and the layer boundary it keeps in host memory (eq. 3o; Cephalo moves the boundary's gradients there
    too, which eq. 18 does not count on the device either). When the units' staging buffer (eq. 18, which Cephalo's
    memory model lacks) does not fit, the next larger time threshold is tried."""
    t0 = time.perf_counter()
    micro_batch_candidates(spec, cluster, profiles, global_batch, micro_batch)
    ids = [d.id for d in cluster.devices]
    full = tuple(operator_names(spec))
    best, n_eval = None, 0
    if len(ids) > 1:
        for skip in range(tries):
            batches = cephalo_batches(spec, cluster, profiles, ids, global_batch=global_batch, micro_batch=micro_batch, skip=skip)
            ratios = cephalo_ratios(spec, cluster, profiles, ids, batches) if batches else None
            if ratios is None:
                break
            best = _consider(best, _dp_plan(spec, cluster, ids, batches, CEPHALO_STAGE, full, ratios, cephalo_offload(spec)),
                             cluster, profiles)
            n_eval += 1
            if best is not None:
                break
    return _result(best, "cephalo", t0, n_eval)


def baseline_splits(spec, cluster, profiles, skeleton, *, global_batch: int, micro_batch: int | None = None,
                    deadline_s: float | None = None) -> list:
    """Poplar's and Cephalo's per-device batches for a skeleton whose replicas are single devices, so that the
    structured family holds the baselines' layouts with their splits (solver/README.md). Past ``deadline_s``
    (``time.perf_counter()``), TimeoutError."""
    if not all(len(pipe) == 1 and len(pipe[0]) == 1 for pipe in skeleton.pipelines) or skeleton.num_replicas < 2:
        return []
    ids = [pipe[0][0] for pipe in skeleton.pipelines]
    out = []
    for z in (0, 1, 2, 3):
        got = poplar_batches(spec, cluster, profiles, ids, global_batch=global_batch, zero_stage=z, micro_batch=micro_batch,
                             keep_all=True)
        if got is not None:
            out.append(tuple(got[1]))
    if len(ids) > CEPHALO_SPLIT_MAX_DEVICES:
        return out
    got = cephalo_batches(spec, cluster, profiles, ids, global_batch=global_batch, micro_batch=micro_batch,
                          deadline_s=deadline_s)
    if got is not None:
        out.append(tuple(got))
    return out


CEPHALO_SPLIT_MAX_DEVICES = 128
"""The structured family holds Cephalo's per-device batches on clusters of up to this many devices: its dynamic
programme is linear in the devices times the global batch (2 s at 64 GPUs and a batch of 512, minutes at 1,024
GPUs and 2,048), and Cephalo's own clusters have 64."""


# -- exhaustive --------------------------------------------------------------------------------------


def _ordered_groups(devs):
    for k in range(1, len(devs) + 1):
        for combo in itertools.combinations(devs, k):
            for perm in itertools.permutations(combo):
                yield perm


def _raw_pipelines(devs, shape=None):
    """Every sequence of disjoint ordered groups (optionally with fixed group sizes)."""
    if shape is not None and not shape:
        yield (), devs
        return
    for g in _ordered_groups(devs):
        if shape is not None and len(g) != shape[0]:
            continue
        rest = [d for d in devs if d not in g]
        if shape is None:
            yield (g,), rest
            for tail, left in _raw_pipelines(rest):
                yield (g,) + tail, left
        else:
            for tail, left in _raw_pipelines(rest, shape[1:]):
                yield (g,) + tail, left


def raw_layouts(device_ids: list[str], max_stages: int):
    """All replica sets: each replica a sequence of ordered groups, of any shape (stage count, group sizes)."""
    def more(reps, left):
        yield reps
        for pipe, rest in _raw_pipelines(left):
            if pipe > reps[-1] and len(pipe) <= max_stages:
                yield from more(reps + (pipe,), rest)
    for pipe, rest in _raw_pipelines(list(device_ids)):
        if len(pipe) <= max_stages:
            yield from more((pipe,), rest)


def _layered(reps) -> bool:
    """Stages 2 and 3 apply: every replica one stage."""
    return all(len(pp) == 1 for pp in reps)


def _one_shape(reps) -> bool:
    return len({tuple(len(g) for g in pp) for pp in reps}) == 1


def _cuts(reps, N, Us, chunks=1):
    """Every (layers per stage, (U, units) per stage) per replica: one split shared by replicas of one shape (the
    planner's positions, solver/README.md), each replica its own for replicas of different shapes. Interleaved
    (``chunks`` > 1, replicas of one shape only) the layers are split over the p ``chunks`` virtual stages and the
    units per device group: a device has one share on all its chunks."""
    if _one_shape(reps):
        for layers in _splits(N, len(reps[0]) * chunks):
            for units in itertools.product(*[list(_unit_splits(len(g), Us)) for g in reps[0]]):
                yield ((layers, units),) * len(reps)
        return
    own = [[(layers, units) for layers in _splits(N, len(pp))
            for units in itertools.product(*[list(_unit_splits(len(g), Us)) for g in pp])] for pp in reps]
    yield from itertools.product(*own)


def _interleavable(reps, N, chunks) -> bool:
    """Interleaved 1F1B with ``chunks`` per device group applies to this layout (the planner's space): replicas of one
    shape, pipelines of at least two groups, every one of the p v virtual stages able to hold its least layers
    (``costmodel.layer_limits``: a middle one at least one layer)."""
    p = len(reps[0])
    return chunks > 1 and p >= 2 and _one_shape(reps) and sum(layer_limits(N, p * chunks)[0]) <= N


def _interleaved_stages(reps, zero_stages) -> list[int]:
    """The sharding stages an interleaved layout is searched at: 0, and 1 (equal parts) when it has replicas; never 2
    or 3, which need one-stage replicas."""
    return [z for z in (0, 1) if z in zero_stages and (z == 0 or len(reps) > 1)]


def _interleaved_size(reps, N, Us, chunks, splits, stages, universe_size) -> int:
    """Plans of one interleaved layout: its layer splits over p v virtual stages (comb(N + 1, p v - 1) with the middle
    ones at least one layer), unit splits per group, batch splits, stages and recompute sets per device."""
    groups = reps[0]
    units = math.prod(sum(1 for _ in _unit_splits(len(g), Us)) for g in groups)
    devices = sum(len(g) for pp in reps for g in pp)
    return math.comb(N + 1, len(groups) * chunks - 1) * units * splits * len(stages) * universe_size ** devices


def _interleaved_tasks(reps, N, chunks, zero_stages, splits) -> list[tuple]:
    """The exhaustive search's tasks for one layout interleaved: for each chunk count v > 1 that applies, every batch
    split and stage with equal parts (an empty ratio map: every device's ``shard_ratio`` None)."""
    return [(reps, split, z, {}, v) for v in chunks if _interleavable(reps, N, v)
            for split in splits for z in _interleaved_stages(reps, zero_stages)]


def _splits(N, p):
    lo = [N] if p == 1 else [0] + [1] * (p - 2) + [0]
    def rec(s, left):
        if s == p - 1:
            if left >= lo[s]:
                yield (left,)
            return
        for L in range(lo[s], left + 1):
            for tail in rec(s + 1, left - L):
                yield (L,) + tail
    yield from rec(0, N)


def _unit_splits(n, Us):
    for U in Us:
        if U < n:
            continue
        for cut in itertools.combinations(range(1, U), n - 1):
            bounds = (0,) + cut + (U,)
            yield U, tuple(bounds[i + 1] - bounds[i] for i in range(n))


def all_splits(sizes, global_batch: int):
    """Every ordered split of ``global_batch`` over the replicas: replica i takes m_i >= 1 micro-batches of a size
    b_i in ``sizes[i]``, sum b_i m_i = global batch (no symmetry used: the oracle's view)."""
    def rec(i, left):
        if i == len(sizes):
            if left == 0:
                yield ()
            return
        for b in sizes[i]:
            for m in range(1, left // b + 1):
                for tail in rec(i + 1, left - b * m):
                    yield ((b, m),) + tail
    yield from rec(0, global_batch)


def exhaustive(spec, cluster, profiles, *, global_batch: int, micro_batch: int | None = None,
               universe: list[frozenset] | None = None, max_plans: int = 3_000_000, shard_grid: int = 8,
               zero_stages: tuple[int, ...] = (0, 1, 2, 3), workers: int | None = None,
               chunks: tuple[int, ...] = (1,), offload: bool = False, offload_optimizer: bool = False) -> SolveResult:
    """Evaluate every plan: every layout (replicas of any shapes), batch split over its replicas (each replica its
    own profiled micro-batch size and count), sharding stage (2 and 3 for replicas of one stage each) and, at
    stages 1-3, every grid of shard ratios per position; layers, units and recompute sets from ``universe``
    (default: all). Replicas of different shapes each take their own layer split and units, with equal shards at
    stages 1-3; replicas of one shape share one split and units (the planner's space, solver/README.md). Small
    instances only: the test oracle. ``workers``: at most this many processes evaluate at once (None: one per
    usable core); an instance of fewer than ``PARALLEL_FROM_PLANS`` plans is evaluated in this process.

    ``chunks``: for each count v > 1 in it, every layout of replicas of one shape with p >= 2 groups is also
    evaluated interleaved (docs/schedules.md), every replica with v chunks, wherever its p v virtual stages can
    each hold their least layers: every batch split, stage 0 and stage 1 with equal parts, every layer split over
    the virtual stages, and units and recompute sets per device as for 1F1B (a device keeps them on all its
    chunks); the planner's space. 1F1B plans are evaluated whatever ``chunks`` holds, and before the interleaved
    plans of their layout, so of equal plans the 1F1B one is kept.

    ``offload``: where the planner offers offload (1F1B replicas of one shape at stages 0 and 1), every device also
    takes every block-level offload choice of each of its recompute sets (``baton.memory.recompute_space(...,
    offload=True)``, the planner's offload space), and a plan must fit its nodes' host memory (eq. 8o).
    ``offload_optimizer``: at stage 0 with 1F1B, every device also takes each choice with its optimizer state in host
    memory (eq. 7h, 10h; the planner offers it at stage 1 with equal parts too, which the oracle does not cover)."""
    t0 = time.perf_counter()
    N = spec.num_layers
    names = operator_names(spec)
    if any(not isinstance(v, int) or v < 1 for v in chunks):
        raise BatonError(f"chunks per device group must be whole numbers >= 1, got {chunks}", field="chunks")
    if len(cluster.devices) > 6:
        raise BatonError(f"exhaustive search is for small instances only (at most 6 devices, the cluster has "
                         f"{len(cluster.devices)})", field="--strategy")
    if universe is None:
        universe = [frozenset(c) for k in range(len(names) + 1) for c in itertools.combinations(names, k)]
    universe, with_offload, host_step = _device_choices(spec, universe, offload, offload_optimizer)
    Us = valid_unit_counts(spec)
    micro_batch_candidates(spec, cluster, profiles, global_batch, micro_batch)  # the same error as the planner's
    have = {g: set(profiles[g].micro_batches("qkv")) for g in cluster.gpu_types}

    def sizes_of(pipe):
        if micro_batch is not None:
            return (micro_batch,)
        types = {cluster.device(i).gpu.name for g in pipe for i in g}
        return tuple(sorted(b for b in set.intersection(*(have[t] for t in types)) if b <= global_batch))

    layouts = list(raw_layouts([d.id for d in cluster.devices], N + 2))
    # Rough size check before starting: layouts x splits x stages x ratios x layer splits x units x recompute choices.
    estimate = 0
    for reps in layouts:
        r = len(reps)
        cuts = [math.comb(N + 1, max(len(pp) - 1, 0)) * math.prod(sum(1 for _ in _unit_splits(len(g), Us)) for g in pp)
                for pp in reps]
        splits = sum(1 for _ in all_splits([sizes_of(pp) for pp in reps], global_batch))
        positions = sum(len(g) for g in reps[0])
        sharded = len([z for z in zero_stages if z == 1 or (z > 1 and _layered(reps))]) if r > 1 else 0
        if _one_shape(reps):
            ratios = 1 + sharded * sum(1 for _ in ratio_vectors(r, shard_grid)) ** positions
            cuts = cuts[:1]
        else:
            ratios = 1 + sharded
        per_device = len(with_offload) + len(host_step) if _one_shape(reps) else len(universe)
        estimate += math.prod(cuts) * splits * ratios * per_device ** sum(len(g) for pp in reps for g in pp)
        estimate += sum(_interleaved_size(reps, N, Us, v, splits, _interleaved_stages(reps, zero_stages), len(universe))
                        for v in chunks if _interleavable(reps, N, v))
    if estimate > max_plans:
        raise BatonError(f"exhaustive search would evaluate about {estimate:.2g} plans (limit {max_plans:.2g}); "
                         "use it on small instances only", field="--strategy")
    tasks = []
    for reps in layouts:
        r = len(reps)
        positions = [(s, k) for s, g in enumerate(reps[0]) for k in range(len(g))]
        shardings = [(0, None)]
        for z in [z for z in zero_stages if z == 1 or (z > 1 and _layered(reps))] if r > 1 else []:
            if _one_shape(reps):
                shardings += [(z, combo) for combo in itertools.product(list(ratio_vectors(r, shard_grid)), repeat=len(positions))]
            else:  # unlike replicas: equal parts (the planner's restriction, solver/unlike.py and solver/layered.py)
                shardings.append((z, None))
        shardings = [x for x in shardings if x[0] in zero_stages]
        # Each sharding's shard ratio per device: replica rho's device at position (s, k) takes vec[rho].
        ratios = [(z, {} if combo is None else {pp[s][k]: None if vec is None else vec[rho]
                                                for (s, k), vec in zip(positions, combo) for rho, pp in enumerate(reps)})
                  for z, combo in shardings]
        batch_splits = list(all_splits([sizes_of(pp) for pp in reps], global_batch))
        for split in batch_splits:
            tasks += [(reps, split, z, ratio) for z, ratio in ratios]
        tasks += _interleaved_tasks(reps, N, chunks, zero_stages, batch_splits)
    space = _Enumeration(spec=spec, cluster=cluster, profiles=profiles, universe=tuple(universe), unit_counts=tuple(Us),
                         with_offload=with_offload, host_step=host_step)
    best, n_eval = None, 0
    # In enumeration order, the earlier of two equal plans kept (as one process would): the same oracle
    # whatever the number of workers.
    for found, n in _map_tasks(space, tasks, estimate, workers):
        n_eval += n
        if found is not None and (best is None or found[0].iteration_time_ms < best[0].iteration_time_ms):
            best = found
    return _result(best, "exhaustive", t0, n_eval)


def _device_choices(spec, universe, offload: bool, offload_optimizer: bool) -> tuple[list, tuple, tuple]:
    """Each device's choices as (recompute set, offload set, optimizer state on the host), names in layer order:
    the recompute sets of ``universe`` alone; with their offload rows where offload is searched (``offload``:
    ``recompute_space(..., offload=True)``, else the same); and those with the state on the host (empty unless
    ``offload_optimizer``)."""
    names, tensors = operator_names(spec), list(tensor_roles(spec))
    rows = recompute_space(spec, tuple(frozenset(r) for r in universe), offload=offload)
    with_offload = tuple((tuple(o for o in names if o in rows.recompute_set(i)),
                          tuple(t for t in tensors if t in rows.offload_set(i)), False) for i in range(len(rows)))
    host_step = tuple((r, o, True) for r, o, _ in with_offload) if offload_optimizer else ()
    return [(tuple(o for o in names if o in r), (), False) for r in universe], with_offload, host_step


@dataclass(frozen=True, kw_only=True)
class _Enumeration:
    """What every task of the exhaustive search reads."""

    spec: ModelSpec
    """The model."""
    cluster: ClusterSpec
    """The cluster."""
    profiles: ProfileSet
    """Its tables."""
    universe: tuple
    """(recompute set, ()) a device may take (operator names in layer order)."""
    unit_counts: tuple
    """Valid units per layer."""
    with_offload: tuple = ()
    """(recompute set, offload set) a device may take where the planner offers offload (1F1B replicas of one shape
    at stages 0 and 1; tensor names in layer order); ``universe`` itself when offload is not searched."""
    host_step: tuple = ()
    """The same with the optimizer state in host memory, taken at stage 0 with 1F1B (empty: not searched)."""


def _best_of_task(space: _Enumeration, reps, split, z, ratio, chunks=1) -> tuple[tuple | None, int]:
    """The best fitting (report, plan) of one layout, batch split and sharding (``ratio``: device -> shard ratio)
    over every layer split, unit split and recompute choice of it (the first of equals), and how many plans it
    evaluated; with ``chunks`` > 1 every replica interleaved with that many chunks per device group."""
    flat = [d for pp in reps for g in pp for d in g]
    best, n_eval = None, 0
    choices = space.with_offload if chunks == 1 and z < 2 and _one_shape(reps) and space.with_offload else space.universe
    if chunks == 1 and z == 0 and _one_shape(reps):
        choices = choices + space.host_step
    for cut in _cuts(reps, space.spec.num_layers, space.unit_counts, chunks):
        for recs in itertools.product(choices, repeat=len(flat)):
            rec_of = dict(zip(flat, recs))
            replicas = [_replica_stages(pp, *cut[rho], rec_of, ratio) for rho, pp in enumerate(reps)]
            plan = _with_chunks(plan_of_replicas(space.spec, split, z, replicas, cluster=space.cluster.name), chunks)
            best = _consider(best, validate(plan), space.cluster, space.profiles)
            n_eval += 1
    return best, n_eval


def _replica_stages(groups, layers, units, rec_of, ratio) -> list[Stage]:
    """A replica's stages in model order: stage k holds ``layers[k]`` layers on device group k mod p with that group's
    (U, units); one stage per group under 1F1B, the virtual stages of an interleaved replica otherwise."""
    stages, first = [], 0
    for k, n in enumerate(layers):
        g = groups[k % len(groups)]
        U, us = units[k % len(groups)]
        stages.append(Stage(first_layer=first, num_layers=n, units_per_layer=U, devices=tuple(
            DeviceShare(id=d, units=u, recompute=rec_of[d][0], offload=rec_of[d][1], offload_optimizer=rec_of[d][2],
                        shard_ratio=ratio.get(d))
            for d, u in zip(g, us))))
        first += n
    return stages


def _with_chunks(plan: Plan, chunks: int) -> Plan:
    """``plan`` with every pipeline's stages read as virtual stages of ``chunks`` chunks per group (1: as it is)."""
    if chunks == 1:
        return plan
    return replace(plan, pipelines=tuple(replace(pipe, chunks=chunks) for pipe in plan.pipelines))


PARALLEL_FROM_PLANS = 20_000
"""Below this many plans (about 20 s in one process) the exhaustive search does not start workers: each
spends a second or two importing the solver."""

_SPACE: _Enumeration | None = None


def _start_worker(space_file: str, parent_pid: int) -> None:
    global _SPACE
    # A killed `baton solve` must not leave workers evaluating plans for minutes; the parent's pid comes
    # from the parent, so a parent that died while this worker started is noticed too.
    die_with_parent(parent_pid)
    with open(space_file, "rb") as f:
        _SPACE = pickle.load(f)


def _worker_task(task) -> tuple[tuple | None, int]:
    return _best_of_task(_SPACE, *task)


def _map_tasks(space: _Enumeration, tasks: list, estimate: int, workers: int | None):
    """(best, evaluated) of each task, in the tasks' order."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    workers = max(1, min(workers or cores, cores, len(tasks)))
    if estimate < PARALLEL_FROM_PLANS:
        workers = 1
    if workers == 1:
        for task in tasks:
            yield _best_of_task(space, *task)
        return
    ctx = multiprocessing.get_context("spawn")  # no copy of a parent's threads (HiGHS, torch) in the workers
    with tempfile.TemporaryDirectory(prefix="baton-exhaustive-") as tmp:
        # The workers read the instance from a file: handed to them at their start instead, it filled the pipe
        # to a worker that died before reading it (a script without an `if __name__ == "__main__":` guard,
        # which each spawned worker runs again), and the search waited on that pipe forever.
        space_file = os.path.join(tmp, "space.pickle")
        with open(space_file, "wb") as f:
            pickle.dump(space, f)
        try:
            with ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_start_worker,
                                     initargs=(space_file, os.getpid())) as pool:
                yield from pool.map(_worker_task, tasks, chunksize=max(1, len(tasks) // (workers * 16)))
        except BrokenProcessPool:
            raise BatonError("a worker process of the exhaustive search died (killed, out of memory, or started from a script "
                             "that calls the search outside `if __name__ == \"__main__\":`, whose top level each worker runs "
                             "again); workers=1 searches in this process", field="workers") from None
