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
skipped. Each (skeleton, stage) waits in the heap as one entry at a bound on all its candidates until that entry
reaches the front; in the exact family the non-uniform splits of a skeleton then wait as one entry again and are
listed, in windows of their bounds, only when that entry reaches the front. The proven bound of the whole
search is the smallest bound of any candidate not known to be worse: the MILP bound for solved ones, the
cheap bound for skipped ones.

In the code: ``search`` fills a ``_Frontier`` (the heap, the incumbent, the bound bookkeeping) skeleton by
skeleton (``_seed_skeleton``, ``_seed_candidate``, ``_try_constructive``), then ``_visit_candidates`` takes its
entries in bound order and hands each to the step its kind needs (``_expand_group``, ``_requeued_at_sync_bound``,
``_expand_structures``, ``_solve_structure``, ``_solve_milp``); ``_result`` re-checks the winner. What was asked,
and the bounds' memos, are one frozen ``_Inputs`` every step reads.
"""
from __future__ import annotations

import gc
import heapq
import itertools
import math
import time
from dataclasses import dataclass, field, replace
from typing import Iterable, Iterator, NamedTuple

from baton.cluster import ClusterSpec
from baton.costmodel import device_slot, edge_cost, edge_param_count, layer_cost, layer_limits, layer_param_count
from baton.errors import BatonError
from baton.evaluate import PlanReport, evaluate, explain_over_capacity
from baton.profile import ProfileSet
from baton.memory import RecomputeSpace, recompute_space
from baton.model_spec import ModelSpec
from baton.plan import DeviceShare, Plan, validate

from solver.bounds import (BoundCache, bound_owned, candidate_lower_bound, data_parallel_sync_bound,
                           interleaved_candidate_bound, interleaved_replica_bound, layered_collectives_memo,
                           layered_lower_bound, layered_replica_bound, replica_bound, skeleton_constant,
                           splits_lower_bound)
from solver.greedy import greedy_incumbent
from solver.instance import DEFAULT_SHARD_GRID, build_instance
from solver.layered import LAYERED_STAGES, collectives_lower_bound, expand_layered, layered_skeleton, solve_layered
from solver import stop
from solver.milp import InnerModel
from solver.options import monotone_in_share, valid_unit_counts
from solver.space import Skeleton, exact_skeletons, iter_structured_skeletons, replica_pattern
from solver.unlike import expand, solve_structure
from solver.ideal import ideal_bound
from solver.relaxation import micro_batch_sizes, relaxation_bound
from solver.splits import (_largest_m, canonical, class_members, exact_splits_below, replica_classes, structured_splits,
                           uniform_splits)

CONSTRUCTIVE_MARGIN = 0.97
"""A constructive plan is tried on a candidate (and the structured family's splits listed at once while skeletons
are enumerated) when its bound lies this far below every candidate a constructive plan was found for."""

CONSTRUCTIVE_FAILED_SHARE = 0.1
"""Constructive attempts that find nothing may take this share of the time spent so far (plus a second)."""

GROUP_WINDOW = 0.05
"""A group's first window of splits: 5% above its bound (``_expand_group``)."""

EAGER_SPLITS_SHARE = 0.5
"""While skeletons are enumerated, the structured family lists a skeleton's splits at once (for constructive plans:
a first plan, and a good one, within seconds) when no plan exists yet or its splits bound lies 3% below every
candidate a constructive plan was found for; such listings may take this share of the time spent so far (plus a
second)."""
EXACT_LIMIT = 5000
"""Above this many exact skeletons the search switches to the structured family."""
EXACT_MAX_DEVICES = 8
"""Clusters with more devices go straight to the structured family."""
PROOF_MAX_SKELETONS = 200_000
"""Rule 15: on a cluster of up to ``EXACT_MAX_DEVICES`` devices whose exact family has more than ``EXACT_LIMIT``
skeletons (and at most this many), the exact family is searched after the structured one, from its plan."""
IDEAL = "eq. 12b"
"""``SolveResult.space_bound_from`` where the bound over every plan is ``solver.ideal``'s."""
EXACT_SEARCH = "the exact family's search"
"""... where the family searched is the exact one and its own bound is higher."""
AFTER_STRUCTURED = "the exact family, searched after the structured one"
"""Rule 15's bound over every plan, as the status line names it."""
SHARPENED = "eq. 12c"
"""... where the bound over every plan is ``solver.relaxation``'s (eq. 12c) and higher than the others."""
BOUND_SOURCE_SHORT = {IDEAL: "12b", SHARPENED: "12c", EXACT_SEARCH: "exact", AFTER_STRUCTURED: "exact"}
"""``SolveResult.space_bound_from`` as the benchmarks' tables name it."""
PROOF_S_PER_SKELETON = 0.5e-3
"""Rule 15 starts only with this much time left per exact skeleton: bounding every skeleton (without which the pass
proves nothing) took 0.17 ms each on poplar_a's 57,316 on this project's 2-core VM (10 s), and 0.08 ms on poplar_c's."""


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
    space_bound_ms: float = 0.0
    """A lower bound on every plan the format can express with the options given, whatever the family: eq. 12b
    (``solver.ideal``), and in the exact family the search's own bound where that is higher."""
    space_gap: float = 1.0
    """The gap of ``objective_ms`` against ``space_bound_ms`` (1 where nothing is claimed: the baselines)."""
    space_bound_from: str = IDEAL
    """Where ``space_bound_ms`` comes from: eq. 12b, the exact family's own search, ``AFTER_STRUCTURED`` (rule 15) or
    ``SHARPENED`` (eq. 12c)."""
    notes: list = field(default_factory=list)

    def raise_space_bound(self, bound_ms: float, source: str) -> None:
        """A higher bound over every plan, from ``source``."""
        self.space_bound_ms = min(self.objective_ms, bound_ms)
        self.space_gap = max(0.0, (self.objective_ms - self.space_bound_ms) / self.objective_ms)
        self.space_bound_from = source

    def info(self) -> dict:
        return {"strategy": self.strategy, "objective_ms": self.objective_ms, "bound_ms": self.bound_ms, "gap": self.gap,
                "status": self.status, "build_s": round(self.build_s, 4), "solve_s": round(self.solve_s, 4),
                "total_s": round(self.total_s, 4), "family": self.family, "candidates": self.candidates,
                "milps_solved": self.solved, "pruned": self.pruned, "first_plan_s": self.first_plan_s,
                "unbounded": self.unbounded, "space_bound_ms": self.space_bound_ms, "space_gap": self.space_gap,
                "space_bound_from": self.space_bound_from}


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
    """One line per improvement (time, incumbent, proven bound, gap, candidates left) for ``log``: a better plan, or
    a bound that shrank the gap by ``BOUND_LINE_SHRINK`` since the last line that gave one."""

    BOUND_LINE_SHRINK = 0.9
    BOUND_CHECK_S = 0.5
    """The proven bound is the least of every bound kept: recomputed at most this often while candidates are taken."""

    def __init__(self, log, t_start: float, detail_log=None, space_bound_ms: float = 0.0, every_plan: bool = False):
        self.log, self.t_start, self.detail_log = log, t_start, detail_log
        self.space_bound_ms = space_bound_ms
        """Eq. 12b: every line also gives the gap over every plan against it."""
        self.every_plan = every_plan
        """The family's bound holds over every plan (rule 15's pass): the lines say so instead."""
        self.first_s: float | None = None
        self.last_gap: float | None = None
        """The family's gap of the last line that gave one."""
        self.checked_s = -math.inf
        """``time.perf_counter()`` of the last bound check."""

    def improved(self, objective_ms: float, bound_ms: float | None, how: str, *, left: int | None = None,
                 bounded: str = "") -> None:
        now = time.perf_counter() - self.t_start
        if self.first_s is None:
            self.first_s = now
        if not self.log:
            return
        whole = max(0.0, (objective_ms - self.space_bound_ms) / objective_ms)
        tail = "; the bound holds over every plan" if self.every_plan else f"; over every plan gap {whole:.2%}"
        if bound_ms is None:  # still bounding candidates: no proven bound of the family yet
            self.log(f"{now:7.1f}s  plan {objective_ms:.1f} ms ({how}), bound pending ({bounded} candidates bounded)"
                     + ("" if self.every_plan else tail))
            return
        gap = max(0.0, (objective_ms - bound_ms) / objective_ms)
        self.last_gap = gap
        self.log(f"{now:7.1f}s  plan {objective_ms:.1f} ms ({how}), bound {bound_ms:.1f} ms, gap {gap:.2%}"
                 + (f", {left} candidates left" if left is not None else "") + tail)

    def bound_rose(self, frontier: "_Frontier", *, now: bool = False) -> None:
        """A line for the same plan when the proven bound has shrunk the gap enough (checked every
        ``BOUND_CHECK_S``, or ``now``): in the structured family most of the gap closes by bounds, not plans."""
        t = time.perf_counter()
        if not self.log or frontier.best is None or frontier.unbounded or (not now and t - self.checked_s < self.BOUND_CHECK_S):
            return
        self.checked_s = t
        objective = frontier.best.objective_ms
        bound = min(objective, frontier.proven_bound_ms())
        gap = max(0.0, (objective - bound) / objective)
        if self.last_gap is None or gap < self.BOUND_LINE_SHRINK * self.last_gap:
            self.improved(objective, bound, "so far", left=len(frontier.heap))

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
    """``space.replica_pattern`` of each replica."""
    classes: list
    """Class of each replica: replicas of one class are interchangeable (``splits.replica_classes``)."""
    sizes: list
    """Micro-batch sizes each replica may use (``replica_micro_batches``)."""
    pushed: set = field(default_factory=set)
    """(zero stage, canonical batches) already pushed as candidates."""
    extras: list | None = None
    """``extra_splits`` of the skeleton, asked once for every stage (None: not yet)."""


class _Entry(NamedTuple):
    """One heap entry. Entries compare as tuples: by bound, then by push order (``seq`` is unique), so candidates
    of equal bounds are taken in the order they were pushed."""

    bound_ms: float
    """Lower bound of every plan the entry stands for."""
    seq: int
    """Push order."""
    kind: str
    """'cand' (one candidate), 'interleaved' (one candidate run interleaved), 'group' (the exact family's splits of a
    (skeleton, stage) not listed yet), 'stage' (the exact family's candidates of a (skeleton, stage), not seeded yet),
    'splits' (the structured family's splits of a (skeleton, stage), not listed yet) or 'struct' (one structure of an
    unlike or stage-2/3 candidate)."""
    skeleton: int
    """Index into ``_Frontier.skeletons``."""
    zero_stage: int
    data: object
    """'cand': the canonical batches; 'interleaved': (canonical batches, chunks); 'group': (the start of its window
    in ms, its relative width); 'splits' and 'stage': the stage whose replica bounds rank the replicas' speeds;
    'struct': (tables, structure, sync)."""
    refined: bool
    """The bound already holds what is only computed at the front (the sync bound, the collectives' bound)."""
    covered_ms: float
    """A bound of every plan the entry stands for that may lie above ``bound_ms``: that of the entry it was pushed while
    processing (a stage's rule-10 bound covers every candidate seeded from it, whose own cheap bounds may lie below).
    Not a heap key, so it changes no search order; a search stopped early takes the least over the heap."""


@dataclass(frozen=True, kw_only=True)
class _Incumbent:
    """The best plan found so far."""

    objective_ms: float
    """Its iteration time (the evaluator's, for a constructive plan; the MILP's or the structure's otherwise)."""
    plan: Plan


@dataclass(frozen=True, kw_only=True)
class _Inputs:
    """What one search was asked, with the memos its bounds share. Frozen: every function of the search reads it,
    none changes it (the memos only fill up)."""

    spec: ModelSpec
    cluster: ClusterSpec
    profiles: ProfileSet
    space: RecomputeSpace
    """The recompute sets a device chooses among."""
    global_batch: int
    """Samples per iteration."""
    micro_batch: int | None
    """The micro-batch size asked for; None: every size the tables of a replica's GPUs hold."""
    monotone: dict
    """GPU type -> its table is non-decreasing in the share (``check_profiles``; rule 3 of solver/README.md)."""
    reduce_symmetry: bool
    allowed: dict | None
    """Restrictions of the choices (the baselines'), for ``build_instance``."""
    shard_grid: int
    """K: owned fractions are multiples of 1/K."""
    exact: bool
    """Every batch split is searched (the exact family with splits 'auto'): groups of splits, the stage-1 grid, and
    the sync bound from the start."""
    strategy: str
    gap: float
    """Relative optimality gap at which a candidate cannot beat the incumbent."""
    threads: int
    """HiGHS threads per MILP."""
    deadline_s: float
    """``time.perf_counter()`` at which the search stops."""
    chunks: tuple = (1,)
    """Chunk counts per device group offered to every pipeline (1: 1F1B; more: interleaved 1F1B)."""
    host_optimizer: bool = False
    """Devices may keep their optimizer state in host memory (eq. 7h, 10h)."""
    space_bound_ms: float = 0.0
    """Eq. 12b: no plan of any layout is faster (``solver.ideal``)."""
    extra_splits: object = None
    """``search``'s ``extra_splits(skeleton, deadline_s)``: more splits for the structured family (the baselines')."""
    cache: BoundCache = field(default_factory=BoundCache)
    collectives_ms: dict = field(default_factory=dict)
    """(skeleton, stage 2 or 3) -> least collectives of eq. 17 over its units (filled when one reaches the front)."""
    phi_memo: dict = field(default_factory=dict)
    """(skeleton, stage, owned, every schedule) -> {(replica class, b, m): its cheap bound} (``phi``)."""

    def time_left(self) -> bool:
        return not stop.past(self.deadline_s)

    def skeleton_info(self, sk: Skeleton) -> _Skeleton:
        patterns = [replica_pattern(self.cluster, pipe) for pipe in sk.pipelines]
        classes = replica_classes(patterns)
        # Sizes per class: a pattern is hashed once per replica here, not again per lookup (1,024 GPUs: 700,000).
        members = class_members(classes)
        sizes = dict(zip(members, replica_micro_batches(self.cluster, self.profiles, [patterns[ids[0]] for ids in members.values()],
                                                        self.global_batch, self.micro_batch)))
        return _Skeleton(sk=sk, patterns=patterns, classes=classes, sizes=[sizes[c] for c in classes])

    def even(self, info: _Skeleton) -> bool:
        """Stage 1 with equal parts only: the structured family (a heuristic restriction), except Cephalo's layout,
        every device its own replica, on a cluster of several kinds of devices."""
        if self.exact:
            return False
        single = all(len(pipe) == 1 and len(pipe[0]) == 1 for pipe in info.sk.pipelines)
        return not single or len(set(info.classes)) == 1

    def bound(self, info: _Skeleton, batches, z: int, sync: bool | None = None) -> float:
        """A candidate's cheap bound; ``sync`` adds what is computed only at the front (default: in the exact family)."""
        if z in LAYERED_STAGES:  # the collectives' bound when the candidate reaches the front (``sync``)
            coll = self.closed_collectives(info, z)
            if sync:
                if (info.sk, z) not in self.collectives_ms:
                    self.collectives_ms[info.sk, z] = max(coll, collectives_lower_bound(
                        self.spec, self.cluster, info.sk.pipelines, z, info.patterns, even=not self.exact))
                coll = self.collectives_ms[info.sk, z]
            return layered_lower_bound(self.spec, self.cluster, self.profiles, info.sk, batches, self.space, self.cache,
                                       zero_stage=z, collectives=coll)
        return candidate_lower_bound(self.spec, self.cluster, self.profiles, info.sk, batches, self.space, self.cache,
                                     self.monotone if self.reduce_symmetry else None, zero_stage=z, patterns=info.patterns,
                                     classes=info.classes,
                                     sync=self.exact if sync is None else sync, even_shards=self.even(info),
                                     host_optimizer=self.host_optimizer)

    def interleavings(self, info: _Skeleton, z: int) -> list[int]:
        """The chunk counts above one offered to a candidate: replicas of one shape of at least two stages, at
        stages 0 and 1 (equal parts), where every virtual stage can hold its layers (solver/README.md)."""
        sk, N = info.sk, self.spec.num_layers
        if not sk.one_shape or z in LAYERED_STAGES or sk.num_stages < 2:
            return []
        return [v for v in self.chunks if v > 1 and sum(layer_limits(N, sk.num_stages * v)[0]) <= N]

    def interleaved_bound(self, info: _Skeleton, batches, z: int, sync: bool | None = None) -> float:
        """A cheap bound of the candidate run interleaved, any chunk count (``bounds.interleaved_candidate_bound``)."""
        return interleaved_candidate_bound(self.spec, self.cluster, self.profiles, info.sk, batches, self.space, self.cache,
                                           self.monotone if self.reduce_symmetry else None, zero_stage=z,
                                           sync=self.exact if sync is None else sync, patterns=info.patterns)

    def phi(self, info: _Skeleton, z: int, owned: float | None = None, *, every_schedule: bool = False):
        """Replica i's cheap bound on m micro-batches of b (owning ``owned`` of its optimizer state at stage 1;
        None: anything); ``every_schedule``: the least of its 1F1B and interleaved bounds where it is offered (what
        the exact family lists splits by). Memoised per skeleton: a group's splits are listed again at every window,
        asking the same (i, b, m) each time."""
        memo = self.phi_memo.setdefault((info.sk, z, owned, every_schedule), {})
        bound, classes = self._phi(info, z, owned, every_schedule=every_schedule), info.classes

        def phi(i, b, m):
            key = (classes[i], b, m)  # replicas of one class are one replica on other nodes: one bound
            if key not in memo:
                memo[key] = bound(i, b, m)
            return memo[key]
        return phi

    def _phi(self, info: _Skeleton, z: int, owned: float | None = None, *, every_schedule: bool = False):
        spec, cluster, profiles, space, cache = self.spec, self.cluster, self.profiles, self.space, self.cache
        mono = self.monotone if self.reduce_symmetry else None
        if z in LAYERED_STAGES:
            return lambda i, b, m: layered_replica_bound(spec, cluster, profiles, info.sk.pipelines[i][0], b, m, space, cache, z)

        if self.host_optimizer:  # its state may be on the host: nothing owned on the device (bounds.candidate_lower_bound)
            owned = 0.0

        def one_f_one_b(i, b, m):
            return replica_bound(spec, cluster, profiles, info.sk.pipelines[i], b, m, space, cache, mono,
                                 zero_stage=z, pattern=info.patterns[i], owned=owned)[0]

        if not (every_schedule and self.interleavings(info, z)):
            return one_f_one_b
        even = bound_owned(info.sk.num_replicas, z, True)
        return lambda i, b, m: min(one_f_one_b(i, b, m), interleaved_replica_bound(
            spec, cluster, profiles, info.sk.pipelines[i], b, m, space, cache, mono, zero_stage=z, owned=even,
            pattern=info.patterns[i])[0])

    def instance(self, info: _Skeleton, batches, z: int, even_shards: bool = False, chunks: int = 1):
        return build_instance(self.spec, self.cluster, self.profiles, info.sk, batches, self.space, zero_stage=z,
                              shard_grid=self.shard_grid, monotone=self.monotone, reduce_symmetry=self.reduce_symmetry,
                              allowed=self.allowed, even_shards=even_shards or self.even(info), chunks=chunks,
                              host_optimizer=self.host_optimizer)

    def constant(self, info: _Skeleton, z: int) -> float:
        """What a candidate's bound adds to its slowest replica's before it reaches the front (the splits of a group
        are listed against it): at stages 2 and 3 no sync bound (``bounds.layered_lower_bound``), but in the exact
        family the collectives' closed form (``closed_collectives``)."""
        return (skeleton_constant(self.spec, self.cluster, info.sk, self.cache, sync=z not in LAYERED_STAGES,
                                  classes=info.classes)
                + (self.closed_collectives(info, z) if z in LAYERED_STAGES else 0.0))

    def closed_collectives(self, info: _Skeleton, z: int) -> float:
        """Rule 14's bound on the collectives of every stage-2/3 plan of the skeleton (``bounds.layered_collectives_bound``)
        in the exact family; 0 in the structured family, whose skeletons may
        hold a thousand devices (the bound looks at every pair)."""
        if not self.exact:
            return 0.0
        return layered_collectives_memo(self.spec, self.cluster, info.sk, z, self.cache)

    def splits_bound(self, info: _Skeleton, z: int) -> float:
        """A bound on every candidate of the skeleton at stage z, whatever its batch split
        (``bounds.splits_lower_bound``), at an owned fraction no larger than its candidates' bounds assume."""
        owned = bound_owned(info.sk.num_replicas, z, self.even(info)) if info.sk.one_shape else None
        return splits_lower_bound(self.spec, self.cluster, self.profiles, info.sk, info.sizes, info.classes, info.patterns,
                                  self.global_batch, self.space, self.cache, self.monotone if self.reduce_symmetry else None,
                                  zero_stage=z, owned=0.0 if self.host_optimizer else owned,
                                  extra_ms=self.split_free(info, z))

    def split_free(self, info: _Skeleton, z: int) -> float:
        """What every candidate of the skeleton at stage z pays on top of its replicas, whatever its split, that rule
        10's bound adds in the exact family: the data-parallel sync (rules 13 and 11's position bound) at stages 0
        and 1, the collectives (rule 14) at 2 and 3. The structured family adds them only at the front (cost)."""
        if not self.exact:
            return 0.0
        if z in LAYERED_STAGES:
            return self.closed_collectives(info, z)
        return data_parallel_sync_bound(self.spec, self.cluster, info.sk, self.cache)

    def group_range(self, info: _Skeleton, z: int) -> tuple[float, float]:
        """Bounds of the skeleton's splits: below, each replica runs at least one micro-batch; above, the largest
        finite bound a replica can reach (no split with a finite bound lies beyond it)."""
        f, r = self.phi(info, z, every_schedule=True), info.sk.num_replicas
        const = self.constant(info, z)
        floor = const + max(min(f(i, b, 1) for b in info.sizes[i]) for i in range(r))
        top = [f(i, b, _largest_m(lambda m, i=i, b=b: math.isfinite(f(i, b, m)), self.global_batch // b))
               for i in range(r) for b in info.sizes[i] if math.isfinite(f(i, b, 1))]
        return floor, const + max(top, default=math.inf)


@dataclass(kw_only=True)
class _Frontier:
    """What the search changes as it goes: the candidates waiting in bound order, the incumbent, and what the
    proven bound and the result's counts are made of."""

    progress: Progress
    skeletons: list = field(default_factory=list)
    """_Skeleton of every skeleton with candidates; heap entries name theirs by index."""
    heap: list = field(default_factory=list)
    """_Entry heap, smallest bound first."""
    covering_ms: float = -math.inf
    """While an entry taken from the heap is processed, its ``covered_ms``: every entry pushed meanwhile stands for some
    of its plans (its candidates, structures, the rest of its splits, itself at a higher bound)."""
    seq: Iterator[int] = field(default_factory=itertools.count)
    group_ceiling_ms: dict = field(default_factory=dict)
    """(skeleton index, stage) -> the largest finite bound of its splits: a window beyond it takes all the rest."""
    best: _Incumbent | None = None
    greedy_bound_ms: float = math.inf
    """Smallest bound of a candidate the constructive plan found a plan for."""
    greedy_failed_s: float = 0.0
    """Seconds spent on constructive attempts that found nothing (instance or plan not fitting)."""
    bounds_ms: list = field(default_factory=list)
    """Bounds of everything not shown worse than the incumbent; with the incumbent, their least is the proven bound."""
    notes: list = field(default_factory=list)
    candidates: int = 0
    """Candidates and structures pushed."""
    solved: int = 0
    """MILPs and structures solved."""
    pruned: int = 0
    """Entries left in the heap when the search stopped at the bound."""
    unbounded: bool = False
    """The time limit stopped the enumeration of skeletons: those not reached could hold anything."""
    timed_out: bool = False
    eager_s: float = 0.0
    """Seconds spent listing structured splits while skeletons were enumerated (``EAGER_SPLITS_SHARE``)."""
    build_s: float = 0.0
    solve_s: float = 0.0

    @property
    def incumbent_ms(self) -> float:
        return self.best.objective_ms if self.best else math.inf

    def threshold_ms(self, gap: float) -> float:
        """A bound at or above this cannot beat the incumbent by more than the gap. With no incumbent it is nan,
        which no bound reaches (an infinite bound included)."""
        inc = self.incumbent_ms
        return inc * (1 - gap) - 1e-9 * inc

    def push(self, bound_ms: float, kind: str, k: int, z: int, data, refined: bool) -> None:
        heapq.heappush(self.heap, _Entry(bound_ms, next(self.seq), kind, k, z, data, refined,
                                         max(bound_ms, self.covering_ms)))

    def stopped_bound_ms(self) -> float:
        """A bound of every plan of the heap's entries, for a search that stops before taking them."""
        return min(e.covered_ms for e in self.heap)

    def push_candidate(self, info: _Skeleton, k: int, batches, z: int, bound_ms: float, refined: bool) -> None:
        """Once per (stage, canonical batches): swapping interchangeable replicas' batches gives the same candidate."""
        key = (z, canonical(batches, info.classes))
        if key in info.pushed:
            return
        info.pushed.add(key)
        self.push(bound_ms, "cand", k, z, key[1], refined)
        self.candidates += 1

    def push_interleaved(self, info: _Skeleton, k: int, batches, z: int, chunks: int, bound_ms: float, refined: bool) -> None:
        """The candidate run interleaved with ``chunks`` chunks per group, once per (stage, canonical batches, chunks)."""
        key = (z, canonical(batches, info.classes), chunks)
        if key in info.pushed:
            return
        info.pushed.add(key)
        self.push(bound_ms, "interleaved", k, z, key[1:], refined)
        self.candidates += 1

    def proven_bound_ms(self) -> float:
        """The least bound of everything not shown worse, the heap's front included."""
        rest = [self.heap[0].bound_ms] if self.heap else []
        return min(self.bounds_ms + rest + ([0.0] if self.unbounded else []))

    def improve(self, objective_ms: float, plan: Plan, how: str, bound_ms: float | None) -> None:
        """A better plan, and its progress line (``bound_ms`` None: candidates are still being bounded)."""
        self.best = _Incumbent(objective_ms=objective_ms, plan=plan)
        self.progress.improved(objective_ms, bound_ms, how, left=len(self.heap), bounded=str(self.candidates))


def search(spec: ModelSpec, cluster: ClusterSpec, profiles: ProfileSet, *, global_batch: int, micro_batch: int | None = None,
           time_limit: float = 60.0, gap: float = 1e-4, threads: int = 2, space: RecomputeSpace | None = None,
           skeletons: list[Skeleton] | None = None, family: str = "auto", strategy: str = "baton",
           allowed: dict | None = None, reduce_symmetry: bool = True, log=None, detail_log=None,
           shard_grid: int = DEFAULT_SHARD_GRID, zero_stages: tuple[int, ...] = (0, 1, 2, 3), splits: str = "auto",
           extra_splits=None, chunks: tuple[int, ...] = (1,), offload: bool = False,
           offload_optimizer: bool = False, every_plan: bool = False) -> SolveResult:
    """Best plan over the candidates; raises NoPlanFits when none fits.

    A candidate is a skeleton, every replica's batch (micro-batch size and count, adding up to the global
    batch) and the sharding stage (0; 1 with shard ratios multiples of 1/``shard_grid``; 2 and 3, the same
    ratios, for skeletons of at least two replicas of one stage each, solver/layered.py), one of ``zero_stages``. ``splits``:
    'auto' (every split in the exact family, a few in the structured one, solver/splits.py) or 'uniform'
    (every replica the same batch). ``extra_splits(skeleton, deadline_s)`` may add splits for a skeleton (the baselines'
    per-GPU batches), given ``time.perf_counter()``'s deadline; past it, it raises TimeoutError and the family is not
    bounded. ``log`` gets one line per improvement, ``detail_log`` one per MILP solved.
    ``time_limit`` covers the whole search: bounding candidates, constructive plans and MILPs. ``chunks``: the
    chunk counts per device group offered (1: 1F1B; more: interleaved 1F1B, to replicas of one shape at stages 0
    and 1 with equal parts, every replica alike; solver/README.md). ``offload``: 1F1B replicas of one shape at stages
    0 and 1 may keep each block's held tensors in host memory (the default space, ``space``, gets those rows;
    solver/README.md). ``offload_optimizer``: devices may also keep their optimizer state in host memory and step it
    there (eq. 7h, 10h), at 1F1B where owned fractions are not chosen per device. ``every_plan``: after the
    structured family on a cluster of up to ``EXACT_MAX_DEVICES`` devices, search the exact family from its plan for
    the time left, where that could bound every exact skeleton (rule 15; ``baton solve`` does).
    """
    t_start = time.perf_counter()
    monotone = check_profiles(spec, cluster, profiles)
    space = space or recompute_space(spec, offload=offload)
    mbs = micro_batch_candidates(spec, cluster, profiles, global_batch, micro_batch)  # one clear error when no size fits
    if strategy == "baton":  # proven before any search: the training state alone does not fit (the baselines say their own)
        _refuse_if_state_does_not_fit(spec, cluster, profiles, global_batch, mbs, space, offload_optimizer)
    dominated = stage_one_dominates(spec, cluster, profiles)
    if skeletons is None:
        family, skeletons = skeleton_family(spec, cluster, family)
    ideal = ideal_bound(spec, cluster, profiles, global_batch, micro_batch)
    inputs = _Inputs(spec=spec, cluster=cluster, profiles=profiles, space=space, global_batch=global_batch,
                     micro_batch=micro_batch, monotone=monotone, reduce_symmetry=reduce_symmetry, allowed=allowed,
                     shard_grid=shard_grid, exact=family == "exact" and splits == "auto", strategy=strategy, gap=gap,
                     threads=threads, deadline_s=t_start + time_limit, chunks=tuple(sorted(set(chunks) | {1})),
                     host_optimizer=offload_optimizer, extra_splits=extra_splits,
                     space_bound_ms=ideal.bound_ms)
    frontier = _Frontier(progress=Progress(log, t_start, detail_log, inputs.space_bound_ms))
    t0 = time.perf_counter()
    _seed_all(inputs, frontier, skeletons, zero_stages=zero_stages, dominated=dominated, splits=splits)
    frontier.build_s = time.perf_counter() - t0
    if frontier.unbounded:
        frontier.bounds_ms.append(0.0)  # candidates never bounded could hold anything
    _visit_candidates(inputs, frontier)
    result = _result(inputs, frontier, t_start=t_start, time_limit=time_limit, family=family)
    if (every_plan and family == "structured" and inputs.strategy == "baton" and allowed is None and splits == "auto"
            and len(cluster.devices) <= EXACT_MAX_DEVICES and result.space_gap > gap):
        result = _search_every_plan(inputs, result, t_start=t_start, time_limit=time_limit, zero_stages=zero_stages,
                                    dominated=dominated, log=log)
        result.total_s = time.perf_counter() - t_start  # the pass's time too, whether or not it started
        result.plan = result.plan.with_info(**result.info())
    if (every_plan and inputs.strategy == "baton" and allowed is None and splits == "auto" and inputs.chunks == (1,)
            and result.space_gap > gap):
        _sharpen_space_bound(inputs, result, ideal.optimizer_ms, t_start=t_start, log=log)
        result.total_s = time.perf_counter() - t_start
        result.plan = result.plan.with_info(**result.info())
    return result


def _sharpen_space_bound(inputs: _Inputs, result: SolveResult, optimizer_ms: float, *, t_start: float, log) -> None:
    """Eq. 12c (``solver.relaxation``, solver/README.md "A sharper bound from replicas") for the time left, where it
    applies (1F1B or layered replicas only: ``chunks`` 1) and its programme is small enough; it replaces the bound over
    every plan where it is higher. A bound above the plan found would be a broken proof, not a better bound: it
    raises, as a plan the evaluator disagrees with does. ``optimizer_ms``: eq. 12b's Adam step."""
    sizes = micro_batch_sizes(inputs.cluster, inputs.profiles, inputs.global_batch, inputs.micro_batch)
    found = relaxation_bound(inputs.spec, inputs.cluster, inputs.profiles, inputs.global_batch, sizes,
                             optimizer_ms, deadline_s=inputs.deadline_s)
    if found is None or found.bound_ms <= result.space_bound_ms:
        return
    if found.bound_ms > result.objective_ms * (1 + 1e-9):
        raise SolverCheckFailed(f"eq. 12c bounds every plan at {found.bound_ms:.6f} ms, above the plan found "
                                f"({result.objective_ms:.6f} ms): the bound's proof does not hold here")
    result.raise_space_bound(found.bound_ms, SHARPENED)
    if log:
        log(f"{time.perf_counter() - t_start:7.1f}s  over every plan: bound {found.bound_ms:.1f} ms from replicas "
            f"(eq. 12c{', whole layers' if found.whole_layers else ''}{', round trip' if found.round_trip else ''}, "
            f"{found.seconds:.1f} s), gap {result.space_gap:.2%}")


def _seed_all(inputs: _Inputs, frontier: _Frontier, skeletons, *, zero_stages, dominated: bool, splits: str) -> None:
    """Every skeleton's candidates pushed at their bounds (``_seed_skeleton``) while time is left; past it the rest
    were never bounded, so ``frontier.unbounded``."""
    collecting = gc.isenabled()
    # Enumerating makes millions of tuples that live on (patterns, keys, heap entries) and no reference cycles, so
    # the collector's full passes only rescan them: on the shipped 1,024-GPU cluster 8 of 55 s.
    gc.disable()
    try:
        for sk in skeletons:  # the structured family is a generator: enumerating it is inside the time limit too
            if not inputs.time_left():
                frontier.unbounded = frontier.timed_out = True  # the rest were never even enumerated
                break
            _seed_skeleton(inputs, frontier, sk, zero_stages=zero_stages, dominated=dominated, splits=splits)
    finally:
        if collecting:
            gc.enable()


def _search_every_plan(inputs: _Inputs, result: SolveResult, *, t_start: float, time_limit: float, zero_stages,
                       dominated: bool, log) -> SolveResult:
    """Rule 15 of solver/README.md: the exact family (every plan with the options given) with the structured family's
    plan as its incumbent, for the time left, where that could bound every one of its skeletons
    (``PROOF_S_PER_SKELETON``). Its bound holds over every plan; a better plan it finds replaces the structured one.
    Returns ``result`` with the higher bound over every plan, or the exact family's result if it found a better
    plan; ``result`` alone where the pass cannot start or bounds nothing."""
    # Listing them takes about 2% of the time bounding them does: list no more than the time left could bound.
    limit = min(PROOF_MAX_SKELETONS, int(stop.seconds_left(inputs.deadline_s) / PROOF_S_PER_SKELETON))
    if limit <= EXACT_LIMIT:
        return result
    skeletons = exact_skeletons(inputs.cluster, max_stages=inputs.spec.num_layers + 2, limit=limit)
    if skeletons is None or stop.seconds_left(inputs.deadline_s) < len(skeletons) * PROOF_S_PER_SKELETON:
        return result
    if log:
        log(f"{time.perf_counter() - t_start:7.1f}s  searching every plan ({len(skeletons):,} exact skeletons) from the "
            f"structured family's plan")
    exact = replace(inputs, exact=True, cache=BoundCache(), collectives_ms={}, phi_memo={})
    frontier = _Frontier(progress=Progress(log, t_start, None, inputs.space_bound_ms, every_plan=True))
    frontier.best = _Incumbent(objective_ms=result.objective_ms, plan=result.plan)
    frontier.greedy_bound_ms = -math.inf  # an incumbent exists: no stage is seeded before it reaches the front
    _seed_all(exact, frontier, skeletons, zero_stages=zero_stages, dominated=dominated, splits="auto")
    if frontier.unbounded:
        return result  # skeletons never bounded could hold anything
    _visit_candidates(exact, frontier)
    proof = _result(exact, frontier, t_start=t_start, time_limit=time_limit, family="exact")
    if proof.objective_ms < result.objective_ms * (1 - 1e-9):
        proof.notes.append(f"the exact family, searched after the structured one, found a better plan "
                           f"({result.objective_ms:.1f} -> {proof.objective_ms:.1f} ms)")
        if proof.space_bound_from != IDEAL:  # stopped early, its own bound may lie under eq. 12b
            proof.space_bound_from = AFTER_STRUCTURED
        return proof
    if proof.bound_ms > result.space_bound_ms:
        result.raise_space_bound(proof.bound_ms, AFTER_STRUCTURED)
    return result


def _stages_searched(sk: Skeleton, zero_stages, dominated: bool) -> list[int]:
    """The sharding stages a skeleton's candidates take: 1 needs replicas, 2 and 3 replicas of one stage each;
    0 is left out where stage 1 dominates it (rule 8)."""
    zs = [z for z in zero_stages if z == 0 or (sk.num_replicas > 1 and (z == 1 or layered_skeleton(sk)))]
    if sk.num_replicas > 1 and 1 in zs and dominated:
        zs = [z for z in zs if z != 0]  # stage 0 can only tie with stage 1 (rule 8)
    return zs


def _seed_skeleton(inputs: _Inputs, frontier: _Frontier, sk: Skeleton, *, zero_stages, dominated: bool, splits: str) -> None:
    """Push one skeleton's candidates at their cheap bounds, stage by stage (``_seed_stage``), or, where a stage's
    candidates may wait, one entry standing for all of them at a bound on every split (``_Inputs.splits_bound``,
    rule 10 of solver/README.md) until it reaches the front. The structured family's splits wait so on 1,024 GPUs,
    where most skeletons' splits never have to be bounded; the exact family's whole stages do, where poplar_a's
    57,316 skeletons would otherwise be seeded one by one before any reached the front (rule 12). A stage is seeded
    at once, for constructive plans (a first plan, and a good one, within seconds), when no plan exists yet or its
    bound lies 3% below every candidate a constructive plan was found for (``EAGER_SPLITS_SHARE`` of the time)."""
    info = inputs.skeleton_info(sk)
    if any(not x for x in info.sizes):
        return
    k = len(frontier.skeletons)
    frontier.skeletons.append(info)
    zs = _stages_searched(sk, zero_stages, dominated)
    pipelined = [z for z in zs if z not in LAYERED_STAGES]
    for z in zs:
        zb = z if z in LAYERED_STAGES or not pipelined else pipelined[-1]
        if splits == "uniform":
            _seed_stage(inputs, frontier, k, z, zb, splits)
            continue
        key = inputs.splits_bound(info, z)
        if not math.isfinite(key):  # no replica of some class can run any micro-batch
            continue
        spent = time.perf_counter() - frontier.progress.t_start
        if ((frontier.best is None or key < frontier.greedy_bound_ms * CONSTRUCTIVE_MARGIN)
                and frontier.eager_s <= EAGER_SPLITS_SHARE * spent + 1.0):
            t = time.perf_counter()
            _seed_stage(inputs, frontier, k, z, zb, splits, key)
            frontier.eager_s += time.perf_counter() - t
        else:
            frontier.push(key, "stage" if inputs.exact else "splits", k, z, zb, True)


def _seed_stage(inputs: _Inputs, frontier: _Frontier, k: int, z: int, zb: int, splits: str,
                key: float | None = None) -> None:
    """Push skeleton k's candidates at stage z: its uniform splits (exact family, or ``splits`` 'uniform') and in the
    exact family one group entry standing for all its other splits, or the structured family's splits
    (``_list_structured``, with ``key`` their bound and the replicas' speeds ranked at stage ``zb``)."""
    info = frontier.skeletons[k]
    if splits == "uniform" or inputs.exact:
        for batches in uniform_splits(info.sizes, inputs.global_batch):
            _seed_candidate(inputs, frontier, k, batches, z)
    else:
        _list_structured(inputs, frontier, k, z, zb, key)
    if inputs.exact and info.sk.num_replicas > 1:  # every other split, expanded lazily in bound order
        floor, frontier.group_ceiling_ms[k, z] = inputs.group_range(info, z)
        if math.isfinite(floor):
            frontier.push(floor, "group", k, z, (0.0, GROUP_WINDOW), True)


def _list_structured(inputs: _Inputs, frontier: _Frontier, k: int, z: int, zb: int, key: float) -> None:
    """Push the structured family's candidates of skeleton k at stage z (solver/splits.py), with the speeds of the
    replicas ranked by their bounds at stage ``zb`` (the candidates' own stage bounds are then shared with them),
    and ``inputs.extra_splits``'. ``key``: the bound of them all, which stays in the proven bound if the extra splits'
    time runs out."""
    tb = time.perf_counter()
    info = frontier.skeletons[k]
    owned = bound_owned(info.sk.num_replicas, zb, inputs.even(info))
    cands = structured_splits(inputs.phi(info, zb, owned), info.sizes, info.classes, inputs.global_batch)
    if inputs.extra_splits is not None:
        if info.extras is None:  # once per skeleton, for every stage
            try:
                info.extras = [x for x in inputs.extra_splits(info.sk, inputs.deadline_s)
                               if sum(b * m for b, m in x) == inputs.global_batch
                               and all(b in sizes for (b, _), sizes in zip(x, info.sizes))]  # what ``key`` covers
            except TimeoutError:  # the time limit: the splits not listed are covered by the key
                frontier.bounds_ms.append(key)
                frontier.timed_out = True
                return
        cands = cands + info.extras
    for batches in cands:
        _seed_candidate(inputs, frontier, k, batches, z)
    frontier.build_s += time.perf_counter() - tb


def _seed_candidate(inputs: _Inputs, frontier: _Frontier, k: int, batches, z: int) -> None:
    """Push a candidate at its cheap bound (none that cannot fit), and try the constructive plan on it when its
    bound is at least 3% below every one it found a plan for so far: an incumbent, and a cutoff, long before the
    MILPs. Candidates it does not apply to (unlike replicas, stages 2 and 3) do not count, nor do attempts that
    found nothing; those may take at most ``CONSTRUCTIVE_FAILED_SHARE`` of the time spent so far (plus a second),
    so a cluster where its rules never fit does not slow the enumeration down."""
    info = frontier.skeletons[k]
    _seed_interleaved(inputs, frontier, k, batches, z)
    lb = inputs.bound(info, batches, z)
    if not math.isfinite(lb):
        return
    frontier.push_candidate(info, k, batches, z, lb, refined=inputs.exact and z not in LAYERED_STAGES)
    if (inputs.strategy == "baton" and lb < frontier.greedy_bound_ms * CONSTRUCTIVE_MARGIN and _constructive_applies(info, z)
            and inputs.time_left()):
        spent = time.perf_counter() - frontier.progress.t_start
        if frontier.greedy_failed_s > CONSTRUCTIVE_FAILED_SHARE * spent + 1.0:
            return
        t = time.perf_counter()
        if _try_constructive(inputs, frontier, info, batches, z):
            frontier.greedy_bound_ms = lb
        else:
            frontier.greedy_failed_s += time.perf_counter() - t


def _seed_interleaved(inputs: _Inputs, frontier: _Frontier, k: int, batches, z: int, below: float = math.inf,
                      since: float = 0.0) -> None:
    """Push the candidate run interleaved, once per chunk count offered, at its interleaved bound (when in
    [``since``, ``below``): the exact family's window)."""
    info = frontier.skeletons[k]
    offered = inputs.interleavings(info, z)
    if not offered:
        return
    lb = inputs.interleaved_bound(info, batches, z)
    if math.isfinite(lb) and since <= lb < below:
        for v in offered:
            frontier.push_interleaved(info, k, batches, z, v, lb, refined=inputs.exact)


def _constructive_applies(info: _Skeleton, z: int) -> bool:
    """The constructive plan's rules cut every replica one way, at stage 0 or 1."""
    return info.sk.one_shape and z not in LAYERED_STAGES


def _try_constructive(inputs: _Inputs, frontier: _Frontier, info: _Skeleton, batches, z: int) -> bool:
    """A constructive plan for a promising candidate: an incumbent within seconds (solver/greedy.py). True when it
    found a plan that fits (the evaluator's verdict), better than the incumbent or not."""
    if not _constructive_applies(info, z):
        return False
    inst = inputs.instance(info, batches, z, even_shards=True)  # it splits every peer group evenly anyway
    if inst.infeasible_reason is not None:
        return False
    found = greedy_incumbent(inst, inputs.cluster, inputs.profiles)
    if found is None:
        return False
    if frontier.best is None or found[0] < frontier.best.objective_ms:
        frontier.improve(found[0], found[1], "constructive", None)
    return True


def _visit_candidates(inputs: _Inputs, frontier: _Frontier) -> None:
    """Take heap entries in bound order until the front cannot beat the incumbent (then its bound bounds every
    entry left) or the time is up."""
    heap = frontier.heap
    frontier.progress.bound_rose(frontier, now=True)  # every skeleton is in: the family's gap is proven from here on
    while heap:
        frontier.progress.bound_rose(frontier)
        entry = heap[0]
        if entry.bound_ms >= frontier.threshold_ms(inputs.gap):
            frontier.pruned += len(heap)
            frontier.bounds_ms.append(entry.bound_ms)  # the smallest bound of everything skipped
            break
        if not inputs.time_left():
            frontier.timed_out = True
            frontier.bounds_ms.append(frontier.stopped_bound_ms())
            break
        heapq.heappop(heap)
        frontier.covering_ms = entry.covered_ms
        info = frontier.skeletons[entry.skeleton]
        if entry.kind == "group":
            _expand_group(inputs, frontier, entry)
        elif entry.kind == "splits":
            _list_structured(inputs, frontier, entry.skeleton, entry.zero_stage, entry.data, entry.bound_ms)
        elif entry.kind == "stage":
            tb = time.perf_counter()
            _seed_stage(inputs, frontier, entry.skeleton, entry.zero_stage, entry.data, "auto")
            frontier.build_s += time.perf_counter() - tb
        elif not entry.refined and _requeued_at_sync_bound(inputs, frontier, entry):
            pass  # back in the heap at its higher bound: other entries may now come first
        elif entry.kind == "struct":
            _solve_structure(frontier, entry)
        elif not info.sk.one_shape or entry.zero_stage in LAYERED_STAGES:
            _expand_structures(inputs, frontier, entry)
        else:
            _solve_milp(inputs, frontier, entry)
        frontier.covering_ms = -math.inf


def _expand_group(inputs: _Inputs, frontier: _Frontier, entry: _Entry) -> None:
    """List the group's splits whose bounds lie in its window [start, upto) as candidates and push the group back
    at upto: every split not listed yet has a bound of at least that. The window ends at the incumbent times
    (1 - gap), or ``widen`` above the start, so no split is bounded long before it has to be; ``widen`` starts at
    ``GROUP_WINDOW`` and doubles after a window that listed nothing (each window lists its splits again from the
    first, so empty windows in a row would cost that listing each)."""
    tg = time.perf_counter()
    lb, k, z, info = entry.bound_ms, entry.skeleton, entry.zero_stage, frontier.skeletons[entry.skeleton]
    since, widen = entry.data
    inc = frontier.incumbent_ms
    upto = min(inc * (1 - inputs.gap), lb * (1 + widen) + 1e-9) if math.isfinite(inc) else lb * 1.25 + 1e-9
    const = inputs.constant(info, z)
    last = upto > frontier.group_ceiling_ms[k, z]  # beyond every finite replica bound: this window takes all the rest
    before = frontier.candidates
    for batches in exact_splits_below(inputs.phi(info, z, every_schedule=True), info.sizes, info.classes,
                                      inputs.global_batch, math.inf if last else upto - const):
        if not inputs.time_left():  # the rest of the window keeps the group's bound (those listed are not listed twice)
            frontier.push(lb, "group", k, z, entry.data, True)
            frontier.build_s += time.perf_counter() - tg
            return
        x = inputs.bound(info, batches, z)
        if since <= x and (last or x < upto) and math.isfinite(x):
            frontier.push_candidate(info, k, batches, z, x, refined=z not in LAYERED_STAGES)
        _seed_interleaved(inputs, frontier, k, batches, z, below=math.inf if last else upto, since=since)
    if not last:  # every split not pushed yet has a bound of at least upto
        frontier.push(upto, "group", k, z, (upto, widen if frontier.candidates > before else 2 * widen), True)
    frontier.build_s += time.perf_counter() - tg


def _requeued_at_sync_bound(inputs: _Inputs, frontier: _Frontier, entry: _Entry) -> bool:
    """Add the bound computed only at the front (the data-parallel sync, or the collectives at stages 2 and 3:
    too costly for every one of 10^5 candidates). True when that raised the bound and the entry went back."""
    info = frontier.skeletons[entry.skeleton]
    if entry.kind == "interleaved":
        bound_ms = inputs.interleaved_bound(info, entry.data[0], entry.zero_stage, sync=True)
    else:
        bound_ms = inputs.bound(info, entry.data, entry.zero_stage, sync=True)
    if bound_ms > entry.bound_ms * (1 + 1e-12):
        frontier.push(bound_ms, entry.kind, entry.skeleton, entry.zero_stage, entry.data, True)
        return True
    return False


def _expand_structures(inputs: _Inputs, frontier: _Frontier, entry: _Entry) -> None:
    """A candidate of unlike replicas, or at stage 2 or 3, is no MILP: push every structure of it (layer splits,
    units, ratios) that may beat the incumbent; the least bound of those dropped stays in the proven bound."""
    tb = time.perf_counter()
    info, z, batches, lb = frontier.skeletons[entry.skeleton], entry.zero_stage, entry.data, entry.bound_ms
    limit = frontier.threshold_ms(inputs.gap) if math.isfinite(frontier.incumbent_ms) else math.inf
    args = (inputs.spec, inputs.cluster, inputs.profiles, inputs.space, info.sk.pipelines, batches, z, info.patterns, limit)
    try:
        if z in LAYERED_STAGES:
            entries, dropped = expand_layered(*args, grid=inputs.shard_grid, even=not inputs.exact,
                                              collectives_ms=inputs.collectives_ms.get((info.sk, z),
                                                                                       inputs.closed_collectives(info, z)),
                                              deadline_s=inputs.deadline_s)
        else:
            entries, dropped = expand(*args, deadline_s=inputs.deadline_s)
    except TimeoutError:  # the time limit, mid-listing: its bound stays in the proven bound
        frontier.bounds_ms.append(entry.covered_ms)
        frontier.timed_out = True
        frontier.build_s += time.perf_counter() - tb
        return
    except OverflowError as exc:
        frontier.bounds_ms.append(entry.covered_ms)  # not searched: its bound stays in the proven bound
        frontier.notes.append(f"{info.sk.describe()} ({_describe(batches)}, stage {z}): {exc.args[0]} layouts, not searched")
        frontier.build_s += time.perf_counter() - tb
        return
    if math.isfinite(dropped):
        frontier.bounds_ms.append(dropped)
    for found in entries:
        frontier.push(max(lb, found[0]), "struct", entry.skeleton, z, found[1:], True)
        frontier.candidates += 1
    frontier.build_s += time.perf_counter() - tb


def _solve_structure(frontier: _Frontier, entry: _Entry) -> None:
    """One layout of every replica, solved exactly in closed form (solver/unlike.py, solver/layered.py)."""
    tables, struct, sync = entry.data
    z = entry.zero_stage
    tb = time.perf_counter()
    got = solve_layered(tables, struct, sync) if z in LAYERED_STAGES else solve_structure(tables, struct, sync,
                                                                                          tables.emb_ms, z)
    frontier.solve_s += time.perf_counter() - tb
    frontier.solved += 1
    if got is None:
        return
    frontier.bounds_ms.append(got[0])
    if got[0] < frontier.incumbent_ms:
        frontier.improve(got[0], got[1], "layout", frontier.proven_bound_ms())


def _solve_milp(inputs: _Inputs, frontier: _Frontier, entry: _Entry) -> None:
    """One candidate's MILP, with the incumbent as its cutoff and the time left as its limit."""
    tb = time.perf_counter()
    info, z, batches, lb = frontier.skeletons[entry.skeleton], entry.zero_stage, entry.data, entry.bound_ms
    chunks = 1
    if entry.kind == "interleaved":
        batches, chunks = entry.data
    inc = frontier.incumbent_ms
    inst = inputs.instance(info, batches, z, chunks=chunks)
    if inst.infeasible_reason is not None:
        frontier.build_s += time.perf_counter() - tb
        return
    model = InnerModel(inst)
    frontier.build_s += time.perf_counter() - tb
    left = stop.seconds_left(inputs.deadline_s)
    if left <= 0:  # the limit passed, or a stop was asked for, while the instance was built: it keeps its bound
        frontier.bounds_ms.append(entry.covered_ms)
        frontier.timed_out = True
        return
    res = model.solve(time_limit=left, rel_gap=inputs.gap, threads=inputs.threads, cutoff=inc if math.isfinite(inc) else None)
    frontier.solve_s += res.solve_s
    frontier.solved += 1
    frontier.progress.detail(f"{_describe(batches)} z={z}{f' chunks={chunks}' if chunks > 1 else ''} {info.sk.describe()}: lb {lb:.1f} -> {res.status} {res.objective_ms} "
                             f"(bound {res.bound_ms:.1f}) [{model.build_s:.2f}s build, {res.solve_s:.2f}s solve]")
    if res.status in ("infeasible", "cutoff"):
        return
    if res.status == "no_solution":  # time ran out before any incumbent
        frontier.bounds_ms.append(max(entry.covered_ms, res.bound_ms))
        frontier.timed_out = True
        return
    if res.status == "time_limit":
        frontier.timed_out = True
    frontier.bounds_ms.append(max(entry.covered_ms, res.bound_ms))
    if res.objective_ms < inc:
        frontier.improve(res.objective_ms, res.plan, "MILP", frontier.proven_bound_ms())


def _result(inputs: _Inputs, frontier: _Frontier, *, t_start: float, time_limit: float, family: str) -> SolveResult:
    """The incumbent, re-checked by the evaluator, with its proven bound and gap; NoPlanFits (saying why) without one."""
    total_s = time.perf_counter() - t_start
    spec, cluster, profiles = inputs.spec, inputs.cluster, inputs.profiles
    if frontier.best is None:
        off = [flag for flag, on in (("--offload", bool(inputs.space.offloads.any())),
                                     ("--offload-optimizer", inputs.host_optimizer)) if not on]
        hint = f"; host memory may hold what does not fit ({' and '.join(off)})" if off and inputs.strategy == "baton" else ""
        if frontier.timed_out and stop.requested():
            raise NoPlanFits(f"stopped on request before any plan was found ({frontier.solved} of {frontier.candidates} "
                             "candidates tried)")
        if frontier.timed_out:
            raise NoPlanFits(f"no plan found within the time limit of {time_limit:g} s "
                             f"({frontier.solved} of {frontier.candidates} candidates tried){hint}")
        mbs = micro_batch_candidates(spec, cluster, profiles, inputs.global_batch, inputs.micro_batch)
        raise NoPlanFits("no plan fits in memory: "
                         + least_memory_explanation(spec, cluster, profiles, inputs.global_batch, mbs, inputs.space) + hint)
    objective = frontier.best.objective_ms
    plan = validate(replace(frontier.best.plan, cluster=cluster.name, info={}))
    report = recheck(plan, cluster, profiles, objective)
    kept, report = keep_on_device(plan, cluster, profiles, report)
    if kept is not plan:
        plan, objective = kept, min(objective, report.iteration_time_ms)
    bound_ms = min([objective] + frontier.bounds_ms)
    achieved_gap = max(0.0, (objective - bound_ms) / objective)
    # The exact family is every plan over the options given (solver/README.md, "Families"), the structured one not.
    whole = family == "exact" and inputs.exact and inputs.strategy == "baton" and inputs.allowed is None
    space_bound = min(objective, max(inputs.space_bound_ms, bound_ms if whole else 0.0))
    status = ("optimal" if not frontier.timed_out and achieved_gap <= inputs.gap + 1e-9
              else "interrupted" if stop.requested() else "time_limit")
    result = SolveResult(plan=plan, report=report, strategy=inputs.strategy, status=status, objective_ms=objective,
                         bound_ms=bound_ms, gap=achieved_gap, build_s=frontier.build_s, solve_s=frontier.solve_s,
                         total_s=total_s, family=family, candidates=frontier.candidates, solved=frontier.solved,
                         pruned=frontier.pruned, first_plan_s=frontier.progress.first_s, unbounded=frontier.unbounded,
                         space_bound_ms=space_bound, space_gap=max(0.0, (objective - space_bound) / objective),
                         space_bound_from=EXACT_SEARCH if whole and bound_ms > inputs.space_bound_ms else IDEAL,
                         notes=frontier.notes)
    result.plan = plan.with_info(**result.info())
    return result


def _describe(batches) -> str:
    """'b=2' for a uniform split, else every replica's 'b x m'."""
    if len(set(batches)) == 1:
        return f"b={batches[0][0]}"
    return "batches " + ",".join(f"{b}x{m}" for b, m in batches)


OFFLOAD_UNDO_DEVICES = 64
"""``keep_on_device`` tries each offloading device on its own up to this many (an evaluation each)."""


def keep_on_device(plan: Plan, cluster: ClusterSpec, profiles: ProfileSet, report: PlanReport) -> tuple[Plan, PlanReport]:
    """``plan`` with as little in host memory as costs nothing: among plans of equal time the MILP may return one
    that offloads where it need not (host memory and PCIe traffic the model does not charge for), so every
    device's offload, and its optimizer state's place, goes back to the device where the evaluator says the plan
    still fits and is no slower; all at once first, then device by device (the first ``OFFLOAD_UNDO_DEVICES``)."""
    def undo(p: Plan, ids) -> Plan:
        def share(d: DeviceShare) -> DeviceShare:
            return replace(d, offload=(), offload_optimizer=False) if d.id in ids else d
        return validate(replace(p, pipelines=tuple(replace(pipe, stages=tuple(replace(st, devices=tuple(map(share, st.devices)))
                                                                                for st in pipe.stages)) for pipe in p.pipelines)))

    def better(p: Plan, current: PlanReport) -> PlanReport | None:
        rep = evaluate(p, cluster, profiles)
        return rep if rep.fits and rep.iteration_time_ms <= current.iteration_time_ms * (1 + 1e-12) else None

    ids = [d.id for pipe in plan.pipelines for st in pipe.stages for d in st.devices if d.offload or d.offload_optimizer]
    if not ids:
        return plan, report
    whole = undo(plan, set(ids))
    rep = better(whole, report)
    if rep is not None:
        return whole, rep
    for i in ids[:OFFLOAD_UNDO_DEVICES]:
        trial = undo(plan, {i})
        rep = better(trial, report)
        if rep is not None:
            plan, report = trial, rep
    return plan, report


RECHECK_ABS_MS = 1e-5
"""What ``recheck`` lets the MILP and the evaluator differ by besides 1e-6 of the time: HiGHS accepts rows violated by
up to its MIP feasibility tolerance (1e-6 ms here), and an objective reached through a few such rows can be that many
times off, which on a sub-millisecond iteration is more than 1e-6 of it (tests/test_solver_recheck.py)."""


def recheck(plan: Plan, cluster: ClusterSpec, profiles: ProfileSet, objective_ms: float) -> PlanReport:
    """The evaluator must agree with the MILP (within 1e-6 of the time, or ``RECHECK_ABS_MS``) and every device must
    fit."""
    report = evaluate(plan, cluster, profiles)
    diff = abs(report.iteration_time_ms - objective_ms)
    rel = diff / max(abs(report.iteration_time_ms), 1e-12)
    if rel >= 1e-6 and diff >= RECHECK_ABS_MS:
        raise SolverCheckFailed(f"evaluator says {report.iteration_time_ms:.6f} ms, the MILP {objective_ms:.6f} ms "
                                f"(relative difference {rel:.2e}) for plan {plan.to_json()}")
    if not report.fits:
        raise SolverCheckFailed("the MILP returned a plan that does not fit: " + explain_over_capacity(report))
    return report


def _refuse_if_state_does_not_fit(spec, cluster, profiles, global_batch, mbs, space, host_optimizer: bool) -> None:
    """NoPlanFits, in one line saying why, when the weights, gradients and optimizer state of the model need more
    than all the GPUs have (``lowmem.state_memory_shortfall``: a proof for every plan, so no search is run)."""
    from solver.lowmem import state_memory_shortfall

    got = state_memory_shortfall(spec, cluster, profiles, host_optimizer=host_optimizer)
    if got is None:
        return
    need, have, with_host = got
    what = "weights and gradients" if host_optimizer else "weights, gradients and optimizer state"
    tries = (["--offload-optimizer (its weights and gradients alone need " + _size(with_host) + ")"]
             if not host_optimizer and with_host <= have else []) + ["more or larger GPUs", "a smaller model"]
    device = least_memory_explanation(spec, cluster, profiles, global_batch, mbs, space)
    raise NoPlanFits(f"no plan fits in memory: the {what} of {spec.name} need at least {_size(need)} over all GPUs "
                     f"whatever the layout, and the {len(cluster.devices)} GPUs of {cluster.name} have {_size(have)} "
                     f"beyond their reserves; {device}; try {', '.join(tries[:-1])} or {tries[-1]}")


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
