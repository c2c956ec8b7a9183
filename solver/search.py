"""The three-level planner: outer enumeration of (skeleton, batch split, sharding stage) candidates with
bound pruning, inner MILP per candidate, and an independent re-check of the winner by ``baton.evaluate``.

Level 1: the batch split (replica i trains on m_i micro-batches of a profiled size b_i, sum b_i m_i = G;
         solver/splits.py) and the sharding stage (0; 1 with shard ratios from a grid, solver/instance.py; 2 and 3,
         the same ratios, for replicas of one stage each, solver/layered.py).
Level 2: the skeleton: which devices form each TP group (mixed GPU types allowed), in which rank order,
         and the order of the groups along each pipeline (solver/space.py).
Level 3: the MILP (solver/milp.py): layers per stage, units per layer U and units per device,
         recompute set per device, owned fractions at stage 1, and the exact 1F1B schedule of every replica.
         For replicas of different shapes (solver/unlike.py), and at stages 2 and 3 (solver/layered.py), every
         replica's layer split and units (and at stages 2-3 the shard ratios) are enumerated instead, one heap
         entry per structure, and the recompute sets are chosen exactly per stage.

Candidates are visited in increasing order of a lower bound (solver/bounds.py), from a heap; a candidate
whose bound is not below the incumbent (shrunk by the allowed gap) cannot hold a better plan and is
skipped. In the exact family the non-uniform splits of a skeleton wait in the heap as one entry and are
listed, in windows of their bounds, only when that entry reaches the front. The proven bound of the whole
search is the smallest bound of any candidate not known to be worse: the MILP bound for solved ones, the
cheap bound for skipped ones.
"""
from __future__ import annotations

import heapq
import itertools
import math
import time
from dataclasses import dataclass, field, replace
from typing import Iterable

from baton.cluster import ClusterSpec
from baton.costmodel import device_slot, edge_cost, edge_param_count, layer_cost, layer_param_count
from baton.errors import BatonError
from baton.evaluate import PlanReport, evaluate, explain_over_capacity
from baton.profile import ProfileSet
from baton.memory import RecomputeSpace, recompute_space
from baton.model_spec import ModelSpec
from baton.plan import Plan, validate

from solver.bounds import (BoundCache, bound_owned, candidate_lower_bound, layered_lower_bound, layered_replica_bound,
                           replica_bound, skeleton_constant)
from solver.greedy import greedy_incumbent
from solver.instance import DEFAULT_SHARD_GRID, build_instance
from solver.layered import LAYERED_STAGES, collectives_lower_bound, expand_layered, layered_skeleton, solve_layered
from solver.milp import InnerModel
from solver.options import monotone_in_share, valid_unit_counts
from solver.space import Skeleton, exact_skeletons, iter_structured_skeletons, replica_pattern
from solver.unlike import expand, solve_structure
from solver.splits import _largest_m, canonical, exact_splits_below, replica_classes, structured_splits, uniform_splits

EXACT_LIMIT = 5000
"""Above this many exact skeletons the search switches to the structured family."""
EXACT_MAX_DEVICES = 8
"""Clusters with more devices go straight to the structured family."""


class NoPlanFits(BatonError):
    """Nothing in the searched space fits in memory."""


class SolverCheckFailed(RuntimeError):
    """The evaluator disagrees with the MILP: a bug, never a user error."""


@dataclass(kw_only=True)
class SolveResult:
    plan: Plan
    report: PlanReport
    strategy: str
    status: str
    """'optimal' (within the requested gap), 'time_limit' (best found, gap below), 'heuristic'."""
    objective_ms: float
    bound_ms: float
    gap: float
    build_s: float
    solve_s: float
    total_s: float
    family: str
    candidates: int = 0
    solved: int = 0
    pruned: int = 0
    first_plan_s: float | None = None
    """Seconds from the start to the first plan that fits (the constructive one or a MILP's)."""
    unbounded: bool = False
    """The time limit stopped candidate construction: some candidates have no bound, so no gap is proven."""
    notes: list = field(default_factory=list)

    def info(self) -> dict:
        return {"strategy": self.strategy, "objective_ms": self.objective_ms, "bound_ms": self.bound_ms, "gap": self.gap,
                "status": self.status, "build_s": round(self.build_s, 4), "solve_s": round(self.solve_s, 4),
                "total_s": round(self.total_s, 4), "family": self.family, "candidates": self.candidates,
                "milps_solved": self.solved, "pruned": self.pruned, "first_plan_s": self.first_plan_s,
                "unbounded": self.unbounded}


def micro_batch_candidates(spec: ModelSpec, cluster: ClusterSpec, profiles: ProfileSet, global_batch: int,
                           micro_batch: int | None) -> list[int]:
    if micro_batch is not None:
        if micro_batch <= 0 or global_batch % micro_batch:
            raise BatonError(f"micro-batch {micro_batch} does not divide the global batch {global_batch}", field="--micro-batch")
        return [micro_batch]
    common = None
    for g in cluster.gpu_types:
        prof = profiles[g]
        have = set(prof.micro_batches("qkv"))
        common = have if common is None else common & have
    mbs = sorted(b for b in (common or set()) if global_batch % b == 0)
    if not mbs:
        raise BatonError(f"no profiled micro-batch size divides the global batch {global_batch}", field="--global-batch")
    return mbs


def check_profiles(spec: ModelSpec, cluster: ClusterSpec, profiles: ProfileSet) -> dict:
    """Load every GPU type's table (errors name the missing file) and test monotonicity in the share."""
    out = {}
    for g in cluster.gpu_types:
        prof = profiles[g]
        if prof.seq_len != spec.seq_len:
            raise BatonError(f"profile for '{g}' is for seq_len {prof.seq_len}, the model uses {spec.seq_len}", source=prof.source)
        out[g] = monotone_in_share(prof)
    return out


def stage_one_dominates(spec: ModelSpec, cluster: ClusterSpec, profiles: ProfileSet) -> bool:
    """True when, for replicas (r >= 2), stage 1 with equal parts is never worse than stage 0 (solver/README.md,
    rule 8): mixed precision, and every table's parameter bytes are at least the analytic counts times the
    element size at every share, so each device's optimizer bytes saved, O (1 - 1/r) = 6 W (r - 1)/r, cover
    the staging buffer (r + 1)/r P e of eq. 14 (4 (r + 1) <= 24 (r - 1) for r >= 2); and no link has measured
    reduce-scatter or all-gather figures of its own, so stage 1's two passes at equal parts cost the all-reduce
    (eq. 13)."""
    if spec.dtype_bytes >= 4:
        return False
    if cluster.has_ring_pass_figures:  # measured passes need not add up to the all-reduce: stage 1 may sync slower
        return False
    e, Umax = spec.dtype_bytes, max(valid_unit_counts(spec))
    for g in cluster.gpu_types:
        dev = next(d for d in cluster.devices if d.gpu.name == g)
        b = profiles[g].micro_batches("qkv")[0]
        for k in range(1, Umax + 1):
            share = k / Umax
            if layer_cost(profiles[g], spec, b, share).param_bytes < layer_param_count(spec, share) * e * (1 - 1e-12):
                return False
            for stage, p in ((0, 1), (0, 2), (1, 2)):
                slot = device_slot(cluster, profiles, spec, b, dev.id, stage=stage, num_stages=p, num_microbatches=1)
                held = edge_cost(slot, spec, b, share).param_bytes
                if held < edge_param_count(spec, share, first=slot.first, last=slot.last) * e * (1 - 1e-12):
                    return False
    return True


def skeleton_family(spec: ModelSpec, cluster: ClusterSpec, family: str = "auto") -> tuple[str, Iterable[Skeleton]]:
    """The family and its skeletons; the structured family comes as a generator, so that a large
    cluster's enumeration runs inside the time limit, interleaved with bounding."""
    max_stages = spec.num_layers + 2
    if family == "exact" or (family == "auto" and len(cluster.devices) <= EXACT_MAX_DEVICES):
        sks = exact_skeletons(cluster, max_stages=max_stages, limit=EXACT_LIMIT if family == "auto" else 10**7)
        if sks is not None:
            return "exact", sks
    return "structured", iter_structured_skeletons(cluster, heads=spec.num_heads, max_stages=max_stages)


class Progress:
    """One line per improvement (time, incumbent, proven bound, gap, candidates left) for ``log``."""

    def __init__(self, log, t_start: float, detail_log=None):
        self.log, self.t_start, self.detail_log = log, t_start, detail_log
        self.first_s: float | None = None

    def improved(self, objective_ms: float, bound_ms: float | None, how: str, *, left: int | None = None,
                 bounded: str = "") -> None:
        now = time.perf_counter() - self.t_start
        if self.first_s is None:
            self.first_s = now
        if not self.log:
            return
        if bound_ms is None:  # still bounding candidates: no proven bound yet
            self.log(f"{now:7.1f}s  plan {objective_ms:.1f} ms ({how}), bound pending ({bounded} candidates bounded)")
            return
        gap = max(0.0, (objective_ms - bound_ms) / objective_ms)
        self.log(f"{now:7.1f}s  plan {objective_ms:.1f} ms ({how}), bound {bound_ms:.1f} ms, gap {gap:.2%}"
                 + (f", {left} candidates left" if left is not None else ""))

    def detail(self, line: str) -> None:
        if self.detail_log:
            self.detail_log("  " + line)


def replica_micro_batches(cluster: ClusterSpec, profiles: ProfileSet, patterns, global_batch: int,
                          micro_batch: int | None) -> list[tuple[int, ...]]:
    """Micro-batch sizes each replica (given by its ``space.replica_pattern``) may use: the ones every table of
    its GPUs holds (or the one given)."""
    if micro_batch is not None:
        return [(micro_batch,)] * len(patterns)
    have = {g: set(profiles[g].micro_batches("qkv")) for g in cluster.gpu_types}
    out, memo = [], {}
    for pattern in patterns:
        if pattern not in memo:
            types = {rest[1] for stage in pattern for _, rest in stage}
            memo[pattern] = tuple(sorted(b for b in set.intersection(*(have[g] for g in types)) if b <= global_batch))
        out.append(memo[pattern])
    return out


@dataclass(kw_only=True)
class _Skeleton:
    """What the search keeps of one skeleton: its replicas' patterns, classes and micro-batch sizes."""

    sk: Skeleton
    patterns: list
    classes: list
    sizes: list
    pushed: set = field(default_factory=set)
    """(zero stage, canonical batches) already pushed as candidates."""


def search(spec: ModelSpec, cluster: ClusterSpec, profiles: ProfileSet, *, global_batch: int, micro_batch: int | None = None,
           time_limit: float = 60.0, gap: float = 1e-4, threads: int = 2, space: RecomputeSpace | None = None,
           skeletons: list[Skeleton] | None = None, family: str = "auto", strategy: str = "baton",
           allowed: dict | None = None, reduce_symmetry: bool = True, log=None, detail_log=None,
           shard_grid: int = DEFAULT_SHARD_GRID, zero_stages: tuple[int, ...] = (0, 1, 2, 3), splits: str = "auto",
           extra_splits=None) -> SolveResult:
    """Best plan over the candidates; raises NoPlanFits when none fits.

    A candidate is a skeleton, every replica's batch (micro-batch size and count, adding up to the global
    batch) and the sharding stage (0; 1 with shard ratios multiples of 1/``shard_grid``; 2 and 3, the same
    ratios, for skeletons of at least two replicas of one stage each, solver/layered.py), one of ``zero_stages``. ``splits``:
    'auto' (every split in the exact family, a few in the structured one, solver/splits.py) or 'uniform'
    (every replica the same batch). ``extra_splits(skeleton)`` may add splits for a skeleton (the baselines'
    per-GPU batches). ``log`` gets one line per improvement, ``detail_log`` one per MILP solved.
    ``time_limit`` covers the whole search: bounding candidates, constructive plans and MILPs.
    """
    t_start = time.perf_counter()
    deadline = t_start + time_limit
    monotone = check_profiles(spec, cluster, profiles)
    space = space or recompute_space(spec)
    micro_batch_candidates(spec, cluster, profiles, global_batch, micro_batch)  # one clear error when no size fits
    dominated = stage_one_dominates(spec, cluster, profiles)
    if skeletons is None:
        family, skeletons = skeleton_family(spec, cluster, family)
    exact = family == "exact" and splits == "auto"
    cache = BoundCache()
    heap: list = []
    seq = itertools.count()
    infos: list[_Skeleton] = []
    ceilings: dict = {}  # (skeleton, stage) -> largest finite bound of its splits
    collectives: dict = {}  # (skeleton, stage 2 or 3) -> least collectives of eq. 17 over its units
    t0 = time.perf_counter()
    best = None  # (objective, plan, instance or None)
    progress = Progress(log, t_start, detail_log)
    greedy_lb = math.inf  # smallest bound of a candidate the constructive plan has been tried on
    unbounded = False
    timed_out = False
    pushed = 0

    def even(info: _Skeleton) -> bool:
        """Stage 1 with equal parts only: the structured family (a heuristic restriction), except Cephalo's layout,
        every device its own replica, on a cluster of several kinds of devices."""
        if exact:
            return False
        single = all(len(pipe) == 1 and len(pipe[0]) == 1 for pipe in info.sk.pipelines)
        return not single or len(set(info.classes)) == 1

    def bound(info: _Skeleton, batches, z: int, sync: bool | None = None) -> float:
        if z in LAYERED_STAGES:  # the collectives' bound when the candidate reaches the front (``sync``)
            coll = None
            if sync:
                if (info.sk, z) not in collectives:
                    collectives[info.sk, z] = collectives_lower_bound(spec, cluster, info.sk.pipelines, z, info.patterns,
                                                                      even=not exact)
                coll = collectives[info.sk, z]
            return layered_lower_bound(spec, cluster, profiles, info.sk, batches, space, cache, zero_stage=z, collectives=coll)
        return candidate_lower_bound(spec, cluster, profiles, info.sk, batches, space, cache, monotone if reduce_symmetry else None,
                                     zero_stage=z, patterns=info.patterns, sync=exact if sync is None else sync,
                                     even_shards=even(info))

    def phi(info: _Skeleton, z: int, owned: float | None = None):
        """Replica i's cheap bound on m micro-batches of b (owning ``owned`` of its optimizer state at stage 1;
        None: anything)."""
        mono = monotone if reduce_symmetry else None
        if z in LAYERED_STAGES:
            return lambda i, b, m: layered_replica_bound(spec, cluster, profiles, info.sk.pipelines[i][0], b, m, space, cache, z)
        return lambda i, b, m: replica_bound(spec, cluster, profiles, info.sk.pipelines[i], b, m, space, cache, mono,
                                             zero_stage=z, pattern=info.patterns[i], owned=owned)[0]

    def instance(info: _Skeleton, batches, z: int, even_shards: bool = False):
        return build_instance(spec, cluster, profiles, info.sk, batches, space, zero_stage=z, shard_grid=shard_grid,
                              monotone=monotone, reduce_symmetry=reduce_symmetry, allowed=allowed,
                              even_shards=even_shards or even(info))

    def try_greedy(info, batches, z):
        """A constructive plan for a promising candidate: an incumbent within seconds (solver/greedy.py)."""
        nonlocal best
        if not info.sk.one_shape or z in LAYERED_STAGES:  # its rules cut every replica one way, at stage 0 or 1
            return
        inst = instance(info, batches, z, even_shards=True)  # it splits every peer group evenly anyway
        if inst.infeasible_reason is not None:
            return
        found = greedy_incumbent(inst, cluster, profiles)
        if found is not None and (best is None or found[0] < best[0]):
            best = (found[0], found[1], None)
            progress.improved(best[0], None, "constructive", bounded=str(pushed))

    def push_candidate(info, k, batches, z, lb, refined):
        nonlocal pushed
        key = (z, canonical(batches, info.classes))
        if key in info.pushed:
            return
        info.pushed.add(key)
        heapq.heappush(heap, (lb, next(seq), "cand", k, z, key[1], refined))
        pushed += 1

    def constant(info: _Skeleton, z: int) -> float:
        """What a candidate's bound adds to its slowest replica's before it reaches the front (the splits of a group
        are listed against it): at stages 2 and 3 no sync bound (``bounds.layered_lower_bound``)."""
        return skeleton_constant(spec, cluster, info.sk, cache, sync=z not in LAYERED_STAGES)

    def group_range(info: _Skeleton, z: int) -> tuple[float, float]:
        """Bounds of the skeleton's splits: below, each replica runs at least one micro-batch; above, the largest
        finite bound a replica can reach (no split with a finite bound lies beyond it)."""
        f, r = phi(info, z), info.sk.num_replicas
        const = constant(info, z)
        floor = const + max(min(f(i, b, 1) for b in info.sizes[i]) for i in range(r))
        top = [f(i, b, _largest_m(lambda m, i=i, b=b: math.isfinite(f(i, b, m)), global_batch // b))
               for i in range(r) for b in info.sizes[i] if math.isfinite(f(i, b, 1))]
        return floor, const + max(top, default=math.inf)

    # Candidate construction: bound every (skeleton, split, stage); the time limit covers it too.
    for sk in skeletons:
        if time.perf_counter() >= deadline:
            unbounded = timed_out = True  # the rest were never even enumerated
            break
        patterns = [replica_pattern(cluster, pipe) for pipe in sk.pipelines]
        info = _Skeleton(sk=sk, patterns=patterns, classes=replica_classes(patterns),
                         sizes=replica_micro_batches(cluster, profiles, patterns, global_batch, micro_batch))
        if any(not x for x in info.sizes):
            continue
        k = len(infos)
        infos.append(info)
        zs = [z for z in zero_stages if z == 0 or (sk.num_replicas > 1 and (z == 1 or layered_skeleton(sk)))]
        if sk.num_replicas > 1 and 1 in zs and dominated:
            zs = [z for z in zs if z != 0]  # stage 0 can only tie with stage 1 (rule 8)
        pipelined = [z for z in zs if z not in LAYERED_STAGES]
        extras = None
        for z in zs:
            if splits == "uniform" or exact:
                cands = uniform_splits(info.sizes, global_batch)
            else:
                # Speeds from the bound the candidates get (its stage bounds are then shared with theirs).
                zb = z if z in LAYERED_STAGES or not pipelined else pipelined[-1]
                owned = bound_owned(sk.num_replicas, zb, even(info))
                cands = structured_splits(phi(info, zb, owned), info.sizes, info.classes, global_batch)
                if extra_splits is not None:
                    if extras is None:  # once per skeleton, for every stage
                        extras = [x for x in extra_splits(sk) if sum(b * m for b, m in x) == global_batch]
                    cands += extras
            for batches in cands:
                lb = bound(info, batches, z)
                if not math.isfinite(lb):
                    continue
                push_candidate(info, k, batches, z, lb, refined=exact and z not in LAYERED_STAGES)
                if strategy == "baton" and lb < greedy_lb * 0.97 and time.perf_counter() < deadline:
                    greedy_lb = lb
                    try_greedy(info, batches, z)
            if exact and sk.num_replicas > 1:  # every other split, expanded lazily in bound order
                floor, ceilings[k, z] = group_range(info, z)
                if math.isfinite(floor):
                    heapq.heappush(heap, (floor, next(seq), "group", k, z, 0.0, True))
    build_s = time.perf_counter() - t0
    solve_s = 0.0
    bounds: list[float] = [0.0] if unbounded else []  # candidates never bounded could hold anything
    notes: list[str] = []
    solved = pruned = 0
    while heap:
        lb, _, kind, k, z, data, refined = heap[0]
        inc = best[0] if best else math.inf
        threshold = inc * (1 - gap) - 1e-9 * inc
        if lb >= threshold:
            pruned += len(heap)
            bounds.append(lb)  # the smallest bound of everything skipped
            break
        if time.perf_counter() >= deadline:
            timed_out = True
            bounds.append(lb)
            break
        heapq.heappop(heap)
        info = infos[k]
        if kind == "group":  # push the splits whose bound lies in [data, upto)
            tg = time.perf_counter()
            upto = min(inc * (1 - gap), lb * 1.05 + 1e-9) if math.isfinite(inc) else lb * 1.25 + 1e-9
            const = constant(info, z)
            last = upto > ceilings[k, z]  # beyond every finite replica bound: this window takes all the rest
            for batches in exact_splits_below(phi(info, z), info.sizes, info.classes, global_batch,
                                              math.inf if last else upto - const):
                x = bound(info, batches, z)
                if data <= x and (last or x < upto) and math.isfinite(x):
                    push_candidate(info, k, batches, z, x, refined=z not in LAYERED_STAGES)
            if not last:  # every split not pushed yet has a bound of at least upto
                heapq.heappush(heap, (upto, next(seq), "group", k, z, upto, True))
            build_s += time.perf_counter() - tg
            continue
        if not refined:  # the data-parallel sync bound, computed for the candidates that reach the front
            x = bound_refined = bound(info, data, z, sync=True)
            if x > lb * (1 + 1e-12):
                heapq.heappush(heap, (bound_refined, next(seq), kind, k, z, data, True))
                continue
        if kind == "struct":  # one layout of every unlike replica: solved exactly, no MILP (solver/unlike.py)
            tables, struct, sync = data
            tb = time.perf_counter()
            got = solve_layered(tables, struct, sync) if z in LAYERED_STAGES else solve_structure(tables, struct, sync,
                                                                                                  tables.emb_ms, z)
            solve_s += time.perf_counter() - tb
            solved += 1
            if got is None:
                continue
            bounds.append(got[0])
            if got[0] < inc:
                best = (got[0], got[1], None)
                rest = [heap[0][0]] if heap else []
                progress.improved(best[0], min(bounds + rest + ([0.0] if unbounded else [])), "layout", left=len(heap))
            continue
        batches = data
        if not info.sk.one_shape or z in LAYERED_STAGES:  # list the structures that may beat the incumbent
            tb = time.perf_counter()
            limit = threshold if math.isfinite(inc) else math.inf
            try:
                if z in LAYERED_STAGES:
                    entries, dropped = expand_layered(spec, cluster, profiles, space, info.sk.pipelines, batches, z,
                                                      info.patterns, limit, grid=shard_grid, even=not exact,
                                                      collectives_ms=collectives.get((info.sk, z), 0.0))
                else:
                    entries, dropped = expand(spec, cluster, profiles, space, info.sk.pipelines, batches, z, info.patterns, limit)
            except OverflowError as exc:
                bounds.append(lb)  # not searched: its cheap bound stays in the proven bound
                notes.append(f"{info.sk.describe()} ({_describe(batches)}, stage {z}): {exc.args[0]} layouts, not searched")
                build_s += time.perf_counter() - tb
                continue
            if math.isfinite(dropped):
                bounds.append(dropped)
            for entry in entries:
                heapq.heappush(heap, (max(lb, entry[0]), next(seq), "struct", k, z, entry[1:], True))
                pushed += 1
            build_s += time.perf_counter() - tb
            continue
        tb = time.perf_counter()
        inst = instance(info, batches, z)
        if inst.infeasible_reason is not None:
            build_s += time.perf_counter() - tb
            continue
        model = InnerModel(inst)
        build_s += time.perf_counter() - tb
        left = deadline - time.perf_counter()
        res = model.solve(time_limit=left, rel_gap=gap, threads=threads, cutoff=inc if math.isfinite(inc) else None)
        solve_s += res.solve_s
        solved += 1
        progress.detail(f"{_describe(batches)} z={z} {info.sk.describe()}: lb {lb:.1f} -> {res.status} {res.objective_ms} "
                        f"(bound {res.bound_ms:.1f}) [{model.build_s:.2f}s build, {res.solve_s:.2f}s solve]")
        if res.status in ("infeasible", "cutoff"):
            continue
        if res.status == "no_solution":  # time ran out before any incumbent
            bounds.append(max(lb, res.bound_ms))
            timed_out = True
            continue
        if res.status == "time_limit":
            timed_out = True
        bounds.append(max(lb, res.bound_ms))
        if res.objective_ms < inc:
            best = (res.objective_ms, res.plan, inst)
            rest = [heap[0][0]] if heap else []
            progress.improved(best[0], min(bounds + rest + ([0.0] if unbounded else [])), "MILP", left=len(heap))
    total_s = time.perf_counter() - t_start
    if best is None:
        if timed_out:
            raise NoPlanFits(f"no plan found within the time limit of {time_limit:g} s ({solved} of {pushed} candidates tried)")
        mbs = micro_batch_candidates(spec, cluster, profiles, global_batch, micro_batch)
        raise NoPlanFits("no plan fits in memory: " + least_memory_explanation(spec, cluster, profiles, global_batch, mbs, space))
    objective, plan, inst = best
    bound_ms = min([objective] + [x for x in bounds])
    achieved_gap = max(0.0, (objective - bound_ms) / objective)
    status = "optimal" if not timed_out and achieved_gap <= gap + 1e-9 else "time_limit"
    plan = validate(replace(plan, cluster=cluster.name, info={}))
    report = recheck(plan, cluster, profiles, objective)
    result = SolveResult(plan=plan, report=report, strategy=strategy, status=status, objective_ms=objective, bound_ms=bound_ms,
                         gap=achieved_gap, build_s=build_s, solve_s=solve_s, total_s=total_s, family=family,
                         candidates=pushed, solved=solved, pruned=pruned, first_plan_s=progress.first_s,
                         unbounded=unbounded, notes=notes)
    result.plan = plan.with_info(**result.info())
    return result


def _describe(batches) -> str:
    """'b=2' for a uniform split, else every replica's 'b x m'."""
    if len(set(batches)) == 1:
        return f"b={batches[0][0]}"
    return "batches " + ",".join(f"{b}x{m}" for b, m in batches)


def recheck(plan: Plan, cluster: ClusterSpec, profiles: ProfileSet, objective_ms: float) -> PlanReport:
    """The evaluator must agree with the MILP (relative difference < 1e-6) and every device must fit."""
    report = evaluate(plan, cluster, profiles)
    rel = abs(report.iteration_time_ms - objective_ms) / max(abs(report.iteration_time_ms), 1e-12)
    if rel >= 1e-6:
        raise SolverCheckFailed(f"evaluator says {report.iteration_time_ms:.6f} ms, the MILP {objective_ms:.6f} ms "
                                f"(relative difference {rel:.2e}) for plan {plan.to_json()}")
    if not report.fits:
        raise SolverCheckFailed("the MILP returned a plan that does not fit: " + explain_over_capacity(report))
    return report


def least_memory_explanation(spec, cluster, profiles, global_batch, mbs, space) -> str:
    """One line: under the least memory-hungry plan we can build, which device runs out and by how much."""
    from solver.lowmem import least_memory_plan

    plan = least_memory_plan(spec, cluster, profiles, global_batch, min(mbs), space)
    report = evaluate(plan, cluster, profiles)
    worst = max(report.devices, key=lambda d: d.peak_memory_bytes - d.capacity_bytes)
    if worst.peak_memory_bytes <= worst.capacity_bytes:
        return "every candidate plan was rejected (no plan in the searched space fits)"
    return (f"{worst.id} ({worst.gpu}) needs {_size(worst.peak_memory_bytes)} of {_size(worst.capacity_bytes)} "
            f"(over by {_size(worst.peak_memory_bytes - worst.capacity_bytes)}) even with every device in its own "
            f"stage, micro-batch {plan.micro_batch_size}, and the least-memory recompute set")


def _size(num_bytes: float) -> str:
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(num_bytes) >= 0.1 * scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{num_bytes:.0f} B"
