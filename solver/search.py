"""The three-level planner: outer enumeration of (micro-batch, skeleton) candidates with bound pruning,
inner MILP per candidate, and an independent re-check of the winner by ``baton.evaluate``.

Level 1: micro-batch size b (a divisor of the global batch that every profile table holds) and the
         number of replicas r (from the skeleton), so m = G / (b r).
Level 2: the skeleton: which devices form each TP group (mixed GPU types allowed), in which rank order,
         and the order of the groups along each pipeline (solver/space.py).
Level 3: the MILP (solver/milp.py): layers per stage, units per layer U and units per device,
         recompute set per device, and the exact 1F1B schedule.

Candidates are visited in increasing order of a lower bound (solver/bounds.py); a candidate whose bound
is not below the incumbent (shrunk by the allowed gap) cannot hold a better plan and is skipped. The
proven bound of the whole search is the smallest bound of any candidate not known to be worse: the MILP
bound for solved ones, the cheap bound for skipped ones.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Iterable

from baton.cluster import ClusterSpec
from baton.errors import BatonError
from baton.evaluate import PlanReport, evaluate, explain_over_capacity
from baton.profile import ProfileSet
from baton.memory import RecomputeSpace, recompute_space
from baton.model_spec import ModelSpec
from baton.plan import Plan, validate

from solver.bounds import BoundCache, candidate_lower_bound
from solver.greedy import greedy_incumbent
from solver.instance import build_instance
from solver.milp import InnerModel
from solver.options import monotone_in_share
from solver.space import Skeleton, exact_skeletons, iter_structured_skeletons

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


def search(spec: ModelSpec, cluster: ClusterSpec, profiles: ProfileSet, *, global_batch: int, micro_batch: int | None = None,
           time_limit: float = 60.0, gap: float = 1e-4, threads: int = 2, space: RecomputeSpace | None = None,
           skeletons: list[Skeleton] | None = None, family: str = "auto", strategy: str = "baton",
           allowed: dict | None = None, reduce_symmetry: bool = True, log=None, detail_log=None) -> SolveResult:
    """Best plan over the candidates; raises NoPlanFits when none fits.

    ``log`` gets one line per improvement, ``detail_log`` one per MILP solved. ``time_limit`` covers the
    whole search: bounding candidates, constructive plans and MILPs.
    """
    t_start = time.perf_counter()
    deadline = t_start + time_limit
    monotone = check_profiles(spec, cluster, profiles)
    space = space or recompute_space(spec)
    mbs = micro_batch_candidates(spec, cluster, profiles, global_batch, micro_batch)
    if skeletons is None:
        family, skeletons = skeleton_family(spec, cluster, family)
    cache = BoundCache()
    cands = []
    t0 = time.perf_counter()
    best = None  # (objective, plan, instance or None)
    progress = Progress(log, t_start, detail_log)
    greedy_lb = math.inf  # smallest bound of a candidate the constructive plan has been tried on
    unbounded = False
    timed_out = False

    def try_greedy(lb, b, sk):
        """A constructive plan for a promising candidate: an incumbent within seconds (solver/greedy.py)."""
        nonlocal best
        inst = build_instance(spec, cluster, profiles, sk, b, global_batch, space, monotone=monotone,
                              reduce_symmetry=reduce_symmetry, allowed=allowed)
        if inst.infeasible_reason is not None:
            return
        found = greedy_incumbent(inst, cluster, profiles)
        if found is not None and (best is None or found[0] < best[0]):
            best = (found[0], found[1], None)
            progress.improved(best[0], None, "constructive", bounded=str(len(cands)))

    # Candidate construction: bound every (micro-batch, skeleton); the time limit covers it too.
    work = ((b, sk) for sk in skeletons for b in mbs if global_batch % (b * sk.num_replicas) == 0)
    for b, sk in work:
        if time.perf_counter() >= deadline:
            unbounded = True  # the rest were never even enumerated
            timed_out = True
            break
        lb = candidate_lower_bound(spec, cluster, profiles, sk, b, global_batch, space, cache, monotone if reduce_symmetry else None)
        if not math.isfinite(lb):
            continue
        cands.append((lb, b, sk))
        if strategy == "baton" and lb < greedy_lb * 0.97 and time.perf_counter() < deadline:
            greedy_lb = lb
            try_greedy(lb, b, sk)
    cands.sort(key=lambda c: (c[0], c[1], c[2].describe()))
    build_s = time.perf_counter() - t0
    solve_s = 0.0
    bounds: list[float] = [0.0] if unbounded else []  # candidates never bounded could hold anything
    solved = pruned = 0
    for idx, (lb, b, sk) in enumerate(cands):
        inc = best[0] if best else math.inf
        if lb >= inc * (1 - gap) - 1e-9 * inc:
            pruned += len(cands) - idx
            bounds.append(lb)  # the smallest bound of everything skipped
            break
        if time.perf_counter() >= deadline:
            timed_out = True
            bounds.extend(c[0] for c in cands[idx:])
            break
        tb = time.perf_counter()
        inst = build_instance(spec, cluster, profiles, sk, b, global_batch, space, monotone=monotone,
                              reduce_symmetry=reduce_symmetry, allowed=allowed)
        if inst.infeasible_reason is not None:
            build_s += time.perf_counter() - tb
            continue
        model = InnerModel(inst)
        build_s += time.perf_counter() - tb
        left = deadline - time.perf_counter()
        res = model.solve(time_limit=left, rel_gap=gap, threads=threads, cutoff=inc if math.isfinite(inc) else None)
        solve_s += res.solve_s
        solved += 1
        progress.detail(f"b={b} {sk.describe()}: lb {lb:.1f} -> {res.status} {res.objective_ms} (bound {res.bound_ms:.1f}) "
                        f"[{model.build_s:.2f}s build, {res.solve_s:.2f}s solve]")
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
            rest = [c[0] for c in cands[idx + 1:]]
            progress.improved(best[0], min(bounds + rest + ([0.0] if unbounded else [])), "MILP", left=len(cands) - idx - 1)
    total_s = time.perf_counter() - t_start
    if best is None:
        if timed_out:
            raise NoPlanFits(f"no plan found within the time limit of {time_limit:g} s ({solved} of {len(cands)} candidates tried)")
        raise NoPlanFits("no plan fits in memory: " + least_memory_explanation(spec, cluster, profiles, global_batch, mbs, space))
    objective, plan, inst = best
    bound = min([objective] + [x for x in bounds])
    achieved_gap = max(0.0, (objective - bound) / objective)
    status = "optimal" if not timed_out and achieved_gap <= gap + 1e-9 else "time_limit"
    plan = validate(Plan(model=plan.model, cluster=cluster.name, micro_batch_size=plan.micro_batch_size,
                         num_microbatches=plan.num_microbatches, pipelines=plan.pipelines))
    report = recheck(plan, cluster, profiles, objective)
    result = SolveResult(plan=plan, report=report, strategy=strategy, status=status, objective_ms=objective, bound_ms=bound,
                         gap=achieved_gap, build_s=build_s, solve_s=solve_s, total_s=total_s, family=family,
                         candidates=len(cands), solved=solved, pruned=pruned, first_plan_s=progress.first_s,
                         unbounded=unbounded)
    result.plan = plan.with_info(**result.info())
    return result


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
