"""Bounds that let the search prove a gap sooner (issue 25). The structured family lists a skeleton's batch splits
only when a bound on all of them reaches the front (``bounds.splits_lower_bound``: a proven gap within seconds on
1,024 GPUs instead of after bounding every candidate); replicas of one shape are bounded through the one layer split
they share (``bounds._joint_chain_bound``). These tests would catch a bound above what it bounds (the search could
then skip the optimum), a bound that says nothing, and a lazy search that ends elsewhere than listing every split
at once."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from baton.cluster import from_mapping
from baton.costmodel import layer_limits
from baton.memory import recompute_space
from baton.model_spec import PRESETS
from baton.profile import ProfileSet
from solver import bounds as B
from solver import search as S
from solver.layered import LAYERED_STAGES
from solver.splits import exact_splits_below, structured_splits, uniform_splits

MIX16 = {"name": "mix16", "memory_reserve_gib": 1.0,
         "nodes": [{"name": "a100", "count": 2, "gpus": [{"type": "a100-40gb", "count": 4}],
                    "intra_node_link": {"bandwidth_gb_per_s": 300.0, "latency_us": 2.0}},
                   {"name": "t4", "count": 2, "gpus": [{"type": "t4", "count": 4}],
                    "intra_node_link": {"bandwidth_gb_per_s": 12.0, "latency_us": 5.0}}],
         "inter_node_link": {"bandwidth_gb_per_s": 2.8, "latency_us": 30.0}}
"""Two nodes of four A100s and two of four T4s: 16 devices, so the structured family, solved in about a second."""


def _inputs(spec, cluster, profiles, global_batch, chunks=(1,)):
    return S._Inputs(spec=spec, cluster=cluster, profiles=profiles, space=recompute_space(spec),
                     global_batch=global_batch, micro_batch=None, monotone=S.check_profiles(spec, cluster, profiles),
                     reduce_symmetry=True, allowed=None, shard_grid=8, exact=False, strategy="baton", gap=1e-4, threads=1,
                     deadline_s=math.inf, chunks=chunks)


def _candidate_bounds(inputs, info, z, splits) -> list[float]:
    """The cheap bound of every split, run 1F1B and, where offered, interleaved (without the sync bound, which the
    front adds)."""
    out = [inputs.bound(info, x, z, sync=False) for x in splits]
    if z not in LAYERED_STAGES and inputs.interleavings(info, z):
        out += [inputs.interleaved_bound(info, x, z, sync=False) for x in splits]
    return out


@pytest.mark.parametrize("model,batch", [("gpt3-1.3b", 64), ("gpt3-6.7b", 128)])
def test_a_skeletons_splits_bound_lies_below_every_candidate_of_it(model, batch):
    """Every skeleton of the family, every sharding stage it takes: the bound is at most the cheap bound of every
    split (all of them for up to two replicas, else the family's own and the uniform ones), run 1F1B or
    interleaved."""
    spec, cluster = PRESETS[model], from_mapping(MIX16, source="mix16.yaml")
    profiles = ProfileSet(spec)
    inputs = _inputs(spec, cluster, profiles, batch, chunks=(1, 2))
    dominated = S.stage_one_dominates(spec, cluster, profiles)
    checked = 0
    for sk in S.skeleton_family(spec, cluster)[1]:
        info = inputs.skeleton_info(sk)
        if not all(info.sizes):
            continue
        for z in S._stages_searched(sk, (0, 1, 2, 3), dominated):
            key = inputs.splits_bound(info, z)
            if sk.num_replicas <= 2:
                splits = list(exact_splits_below(lambda i, b, m: 0.0, info.sizes, info.classes, batch, 1.0))
            else:
                splits = structured_splits(inputs.phi(info, z), info.sizes, info.classes, batch)
                splits += uniform_splits(info.sizes, batch)
            least = min(_candidate_bounds(inputs, info, z, splits), default=math.inf)
            assert key <= least * (1 + 1e-12), (sk.describe(), z, key, least)
            checked += 1
    assert checked > 100, checked


@pytest.mark.parametrize("replicas,z", [(1, 0), (4, 0), (4, 1), (4, 2)])
def test_the_splits_bound_is_the_least_candidate_bound_for_replicas_of_one_device(replicas, z):
    """Replicas of one A100 each on one node: a replica's time is m times its per-micro-batch time whatever m, and
    a uniform split reaches the least time the bound allows, so the bound is exactly the least candidate bound."""
    spec, cluster = PRESETS["gpt3-1.3b"], from_mapping(MIX16, source="mix16.yaml")
    profiles = ProfileSet(spec)
    inputs = _inputs(spec, cluster, profiles, 64)
    info = inputs.skeleton_info(S.Skeleton(pipelines=tuple(((f"a100-0:{k}",),) for k in range(replicas))))
    splits = list(exact_splits_below(lambda i, b, m: 0.0, info.sizes, info.classes, 64, 1.0))
    least = min(_candidate_bounds(inputs, info, z, splits))
    assert math.isfinite(least) and inputs.splits_bound(info, z) == pytest.approx(least, rel=1e-12)


@pytest.mark.parametrize("model,batch", [("gpt3-1.3b", 64), ("gpt3-6.7b", 128)])
def test_listing_splits_lazily_ends_at_the_optimum_of_listing_them_all(model, batch, monkeypatch):
    """The same family searched twice: with its splits listed when their bound reaches the front, and with every
    skeleton's splits listed at once (a bound of 0 puts them all first). Same optimum; fewer candidates bounded;
    and a progress line with the family's proven gap before the search ends, not only with a better plan."""
    spec, cluster = PRESETS[model], from_mapping(MIX16, source="mix16.yaml")
    profiles = ProfileSet(spec)
    lines: list[str] = []
    lazy = S.search(spec, cluster, profiles, global_batch=batch, time_limit=120, gap=1e-4, threads=1, log=lines.append)
    monkeypatch.setattr(S._Inputs, "splits_bound", lambda self, info, z: 0.0)
    eager = S.search(spec, cluster, profiles, global_batch=batch, time_limit=120, gap=1e-4, threads=1)
    assert lazy.family == "structured" and lazy.status == eager.status == "optimal"
    assert lazy.objective_ms == pytest.approx(eager.objective_ms, rel=1e-9)
    assert lazy.candidates < eager.candidates, (lazy.candidates, eager.candidates)
    assert any("(so far), bound" in line for line in lines), lines


def _random_rows(rng, kinds: int, p: int, N: int):
    """Replica kinds of one shape as ``bounds._joint_chain_bound`` takes them: per stage a per-layer F + B that grows
    with the layer count (recomputation to fit), its backward part, the cheapest per-layer time, edges, caps."""
    lo = np.array(layer_limits(N, p)[0])
    rows = []
    for _ in range(kinds):
        per = rng.uniform(1, 10, size=p)
        growth = rng.uniform(0, 0.3, size=p)
        Ls = np.arange(N + 1)
        per_l = per[:, None] * (1 + growth[:, None] * Ls[None, :] / N)
        edge = rng.uniform(0, 5, size=p)
        c = np.where(Ls[None, :] > 0, Ls[None, :] * per_l, 0.0) + edge[:, None]
        cb = c * rng.uniform(0.5, 0.7)
        cap = np.array([rng.integers(lo[s], N + 1) for s in range(p)])
        rows.append((int(rng.integers(1, 13)), c, cap, lo, cb, per, edge, float(rng.uniform(0, 3))))
    return rows, lo


def _best_shared_split(rows, lo, N: int) -> float:
    """Brute force: min over one split of max over kinds of both 1F1B bounds at that split (``_chain_bound``'s
    terms, at the split itself)."""
    p = len(lo)
    caps = np.min([r[2] for r in rows], axis=0)
    best = math.inf
    for L in itertools.product(*(range(lo[s], caps[s] + 1) for s in range(p))):
        if sum(L) != N:
            continue
        worst = 0.0
        for m, c, _, _, cb, tau, edge, links in rows:
            w = [min(p - b - 1, m - 1) for b in range(p)]
            fill = sum(L[s] * tau[s] + edge[s] for s in range(p))
            chain = fill + max((m - 1 - w[b]) * c[b, L[b]] + w[b] * cb[b, L[b]] for b in range(p)) + links
            worst = max(worst, chain, m * max(c[b, L[b]] for b in range(p)))
        best = min(best, worst)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_the_joint_chain_bound_lies_between_the_first_bound_and_the_best_shared_split(seed):
    """Replica kinds of one shape share one layer split (the MILP's coupling): the bound through that split is at
    least the first 1F1B bound's joint form and at most the exact min over shared splits of every kind's bounds."""
    rng = np.random.default_rng(seed)
    N, p = int(rng.integers(4, 10)), int(rng.integers(2, 5))
    rows, lo = _random_rows(rng, int(rng.integers(2, 4)), p, N)
    exact = _best_shared_split(rows, lo, N)
    got = B._joint_chain_bound(rows, N)
    first = B._joint_pipeline_bound(rows, N)
    if math.isinf(exact):
        assert math.isinf(got)
        return
    assert first <= got * (1 + 1e-12) and got <= exact * (1 + 1e-12), (first, got, exact)


@pytest.mark.parametrize("seed", range(40))
def test_the_least_largest_over_any_rows_is_the_brute_force_minimum(seed):
    rng = np.random.default_rng(seed)
    N, p = int(rng.integers(3, 10)), int(rng.integers(1, 5))
    lo = np.array(layer_limits(N, p)[0])
    caps = np.array([rng.integers(lo[s], N + 1) for s in range(p)])
    G = np.where(rng.uniform(size=(p, N + 1)) < 0.2, np.inf, rng.uniform(0, 10, size=(p, N + 1)))
    exact = min((max(G[s, L[s]] for s in range(p))
                 for L in itertools.product(*(range(lo[s], caps[s] + 1) for s in range(p))) if sum(L) == N), default=math.inf)
    assert B._least_largest_any(G, caps, lo, N) == exact


@pytest.mark.parametrize("seed", range(40))
def test_the_pipeline_and_sync_bound_is_the_brute_force_minimum_of_their_sum(seed):
    """The pipeline and the data-parallel sync through one layer split: min over splits of max_s G + max_s D (D
    non-decreasing in the layer count, as a sync line is), exactly; at least each term's own least."""
    rng = np.random.default_rng(seed)
    N, p = int(rng.integers(3, 10)), int(rng.integers(1, 5))
    lo = np.array(layer_limits(N, p)[0])
    caps = np.array([rng.integers(lo[s], N + 1) for s in range(p)])
    G = np.where(rng.uniform(size=(p, N + 1)) < 0.2, np.inf, rng.uniform(0, 10, size=(p, N + 1)))
    D = rng.uniform(0, 2, size=(p, 1)) * np.arange(N + 1)[None, :] + rng.uniform(0, 3, size=(p, 1))
    splits = [L for L in itertools.product(*(range(lo[s], caps[s] + 1) for s in range(p))) if sum(L) == N]
    exact = min((max(G[s, L[s]] for s in range(p)) + max(D[s, L[s]] for s in range(p)) for L in splits), default=math.inf)
    got = B._joint_sync_bound(G, caps, lo, D, N)
    assert got == pytest.approx(exact, rel=1e-12) if math.isfinite(exact) else math.isinf(got)
    if math.isfinite(exact):
        least_d = min(max(D[s, L[s]] for s in range(p)) for L in splits)
        assert got >= B._least_largest_any(G, caps, lo, N) + least_d - 1e-12


@pytest.mark.parametrize("seed,devices,layers,heads,batch", [(21, 3, 3, 2, 4), (5, 4, 2, 2, 2)])
def test_exact_family_stages_left_waiting_hold_no_better_plan(monkeypatch, seed, devices, layers, heads, batch):
    """Rule 12: the exact family pushes each (skeleton, stage) as one entry at rule 10's bound and seeds it only at
    the front. Random three- and four-GPU instances (mixed-type groups and replicas of different shapes among the skeletons):
    every stage left waiting, solved alone to optimality, costs at least its entry's bound and the returned plan.
    Catches rule 10 above what it bounds for a skeleton the structured family never has (the search would then
    skip the optimum), and a search that seeds everything anyway (nothing left waiting)."""
    from baton.memory import RecomputeSpace
    from tests.test_solver_helpers import random_instance

    inst = random_instance(seed, num_devices=devices, num_layers=layers, heads=heads, universe_size=3,
                           global_batch=batch, monotone=seed != 5)
    pushed, seeded = {}, set()
    push, seed_stage = S._Frontier.push, S._seed_stage

    def recording_push(self, bound_ms, kind, k, z, data, refined):
        if kind == "stage":
            pushed[k, z] = (self.skeletons[k].sk, bound_ms)
        push(self, bound_ms, kind, k, z, data, refined)

    def recording_seed(inputs, frontier, k, z, *args, **kw):
        seeded.add((k, z))
        seed_stage(inputs, frontier, k, z, *args, **kw)

    monkeypatch.setattr(S._Frontier, "push", recording_push)
    monkeypatch.setattr(S, "_seed_stage", recording_seed)
    space = RecomputeSpace(inst.spec, inst.universe)
    kw = dict(global_batch=inst.global_batch, gap=0.0, time_limit=120, space=space, shard_grid=2, family="exact")
    best = S.search(inst.spec, inst.cluster, inst.profiles, **kw)
    monkeypatch.undo()
    waiting = sorted((kz for kz in pushed if kz not in seeded), key=lambda kz: pushed[kz][1])
    assert waiting, "every stage was seeded: nothing waited at its bound"
    for k, z in waiting[:12]:  # the lowest bounds: the ones closest to being wrong
        sk, bound = pushed[k, z]
        try:
            alone = S.search(inst.spec, inst.cluster, inst.profiles, skeletons=[sk], zero_stages=(z,), **kw)
        except S.NoPlanFits:
            continue
        assert alone.objective_ms >= bound * (1 - 1e-9), (sk, z, alone.objective_ms, bound)
        assert alone.objective_ms >= best.objective_ms * (1 - 1e-9)


def _least_time_by_fractions(per, G, floor):
    """The least T >= floor placing G samples, over exact rationals: every breakpoint k a_b in order."""
    from fractions import Fraction
    def samples(t):
        return sum(n * max(b * min(G // b, int(t / Fraction(a))) for b, a in rates) for n, rates in per)
    points = sorted({Fraction(k) * Fraction(a) for _, rates in per for b, a in rates for k in range(1, G // b + 1)}
                    | {Fraction(floor)})
    return next((float(t) for t in points if t >= Fraction(floor) and samples(t) >= G), math.inf)


@pytest.mark.parametrize("seed", range(4))
def test_the_splits_bounds_least_time_is_the_first_breakpoint_that_places_the_batch(seed, monkeypatch):
    """``_least_time_for`` searches the breakpoints k a_b of the samples' step function (and bisects beyond
    ``_MOST_BREAKPOINTS``): within 1e-12 below the exact least time, never above it, on random classes and rates;
    the exact value is ties-free rational arithmetic."""
    rng = np.random.default_rng(seed)
    for bisect in (False, True):
        monkeypatch.setattr(B, "_MOST_BREAKPOINTS", 0 if bisect else 20_000)
        for _ in range(150):
            G = int(rng.choice([8, 16, 64, 96, 256]))
            per = []
            for _ in range(int(rng.integers(1, 5))):
                sizes = rng.choice([1, 2, 4, 8], size=int(rng.integers(1, 5)), replace=False)
                per.append((int(rng.integers(1, 5)), [(int(b), float(rng.uniform(0.1, 50)) * b ** 0.8) for b in sizes]))
            floor = max(min(a for _, a in rates) for _, rates in per)
            exact = _least_time_by_fractions(per, G, floor)
            found = B._least_time_for(per, G, floor)
            if math.isinf(exact):
                assert math.isinf(found)
                continue
            assert exact * (1 - 1e-12) <= found <= exact
