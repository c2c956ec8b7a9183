"""Level 1 of the search, the data-parallel half: how the global batch G is split over a skeleton's replicas.

A split gives replica i a micro-batch size b_i (one that the tables of all its GPUs hold) and m_i >= 1
micro-batches, n_i = b_i m_i samples, with sum_i n_i = G (Poplar: uneven per-replica batches). Replicas
with the same ``space.replica_pattern`` are interchangeable: swapping their batches (and their choices)
maps a plan to one priced the same, so splits are enumerated modulo those swaps (each class's members
take non-decreasing (b, m) in member order).

* ``exact_splits_below``: every split whose replicas all have a cheap bound below a threshold (the exact
  family: the search asks for those that can still beat the incumbent, nothing else is dropped).
* ``structured_splits``: a heuristic few for large clusters: the uniform split, the split in proportion to
  the replicas' speed (per-sample time of their cheap bound) rounded to whole micro-batches, and its
  neighbours (one micro-batch moved between two classes of replicas).
"""
from __future__ import annotations

import functools
import math
from typing import Callable, Iterator, Sequence

Batches = tuple
"""((micro-batch size, micro-batches), ...) per replica."""


def replica_classes(patterns: Sequence) -> tuple[int, ...]:
    """Class of each replica: replicas with one pattern share a class, numbered by first appearance."""
    ids: dict = {}
    return tuple(ids.setdefault(p, len(ids)) for p in patterns)


def canonical(batches: Sequence, classes: Sequence[int]) -> Batches:
    """The representative of ``batches`` modulo swaps inside a class: each class's (b, m) sorted, given to its
    members in member order."""
    out = [tuple(x) for x in batches]
    for group in _shared_classes(tuple(classes)):
        for i, v in zip(group, sorted(out[i] for i in group)):
            out[i] = v
    return tuple(out)


def class_members(classes: Sequence[int]) -> dict[int, list[int]]:
    """Class -> its replicas, in replica order (classes in order of first appearance)."""
    members: dict[int, list[int]] = {}
    for i, c in enumerate(classes):
        members.setdefault(c, []).append(i)
    return members


@functools.lru_cache(maxsize=256)
def _shared_classes(classes: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """The members of every class of two or more replicas: a skeleton's splits are made canonical thousands of
    times, and it may hold 1,024 replicas."""
    return tuple(tuple(g) for g in class_members(classes).values() if len(g) > 1)


def uniform_splits(sizes: Sequence[Sequence[int]], global_batch: int) -> list[Batches]:
    """Every replica the same micro-batch size and count (the only splits before per-replica batches)."""
    r = len(sizes)
    common = sorted(set.intersection(*(set(s) for s in sizes)))
    return [((b, global_batch // (b * r)),) * r for b in common if global_batch % (b * r) == 0]


def _largest_m(ok: Callable[[int], bool], most: int) -> int:
    """Largest m in [1, most] with ok(m), ok true then false as m grows; 0 when ok(1) is false."""
    if most < 1 or not ok(1):
        return 0
    lo, hi = 1, most
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def exact_splits_below(phi: Callable[[int, int, int], float], sizes: Sequence[Sequence[int]], classes: Sequence[int],
                       global_batch: int, limit: float) -> Iterator[Batches]:
    """Every split (modulo interchangeable replicas) with phi(i, b_i, m_i) < ``limit`` for every replica i.

    ``phi`` must not decrease with m (a replica's cheap bound: more micro-batches, more passes and more
    in-flight activations). Depth-first over the replicas, class by class; a branch ends as soon as the
    samples left cannot be placed on the remaining replicas within the limit."""
    r, G = len(sizes), global_batch
    M = [{b: _largest_m(lambda m, i=i, b=b: phi(i, b, m) < limit, G // b) for b in sizes[i]} for i in range(r)]
    order = sorted(range(r), key=lambda i: (classes[i], i))
    most = [max((b * M[i][b] for b in sizes[i]), default=0) for i in order]
    least = [min((b for b in sizes[i] if M[i][b] >= 1), default=math.inf) for i in order]
    if any(math.isinf(x) for x in least):
        return
    most_after = [sum(most[k:]) for k in range(r + 1)]
    least_after = [sum(least[k:]) for k in range(r + 1)]
    chosen: list = [None] * r

    def dfs(k: int, left: int, prev):
        if k == r:
            if left == 0:
                yield tuple(chosen)
            return
        i = order[k]
        same_class = k > 0 and classes[order[k - 1]] == classes[i]
        for b in sizes[i]:
            for m in range(1, M[i][b] + 1):
                rest = left - b * m
                if rest < least_after[k + 1]:
                    break
                if rest > most_after[k + 1] or (same_class and (b, m) < prev):
                    continue
                chosen[i] = (b, m)
                yield from dfs(k + 1, rest, (b, m))

    yield from dfs(0, G, None)


def _best_sizes(batches: Batches, phi: Callable[[int, int, int], float], sizes: Sequence[Sequence[int]],
                classes: Sequence[int], best: dict | None = None) -> Batches:
    """``batches`` with every replica at the micro-batch size its tables hold that its cheap bound ranks best for its
    samples (30 micro-batches of 1 become 15 of 2): a fast replica alone often gains from a larger size that the
    slowest replica's memory or bubble rules out for everyone. ``best``: the choices already made with this ``phi``,
    ``sizes`` and ``classes``, shared by the calls of one listing (a thousand replicas each)."""
    out, best = [], {} if best is None else best
    for i, (b, m) in enumerate(batches):
        key = (classes[i], b, m)  # members of a class on one batch choose alike
        if key not in best:
            n = b * m
            fits = [(phi(i, x, n // x), x != b, x) for x in sizes[i] if n % x == 0]  # a tie keeps the size it has
            t, _, x = min(fits, default=(math.inf, False, b))
            best[key] = (x, n // x) if math.isfinite(t) else (b, m)
        out.append(best[key])
    return canonical(tuple(out), classes)


def structured_splits(phi: Callable[[int, int, int], float], sizes: Sequence[Sequence[int]], classes: Sequence[int],
                      global_batch: int, *, within_class: bool = False) -> list[Batches]:
    """The structured family's splits (a heuristic restriction, see the module docstring): for each micro-batch
    size b all replicas hold, the uniform split, the split in proportion to each class's speed (``phi`` per
    micro-batch at the uniform count, rounded to whole micro-batches by largest remainder, members of a class
    within one of each other), and its neighbours (one micro-batch moved from the fullest member of one class
    to the emptiest of another; ``within_class``: also between two members of one class); and each of these with
    every replica at the size its own cheap bound ranks best for its samples (``_best_sizes``)."""
    r, G = len(sizes), global_batch
    if r == 1:
        return [((b, G // b),) for b in sizes[0] if G % b == 0]
    out = {canonical(x, classes) for x in uniform_splits(sizes, G)}
    common = sorted(set.intersection(*(set(s) for s in sizes)))
    members = class_members(classes)
    cls = sorted(members)
    for b in common:
        q = G // b
        if G % b or q < r:
            continue
        m0 = -(-q // r)  # the most micro-batches of a near-uniform split: its bound is the candidate's
        speed = {}
        for c in cls:
            t = phi(members[c][0], b, m0)
            speed[c] = len(members[c]) * m0 / t if math.isfinite(t) and t > 0 else 0.0
        if not any(speed.values()):
            continue
        total = sum(speed.values())
        # Micro-batches per class in proportion to speed (largest remainder), at least one per member.
        raw = {c: q * speed[c] / total for c in cls}
        per = {c: max(len(members[c]), math.floor(raw[c])) for c in cls}
        while sum(per.values()) > q:
            c = max((c for c in cls if per[c] > len(members[c])), key=lambda c: per[c] - raw[c])
            per[c] -= 1
        while sum(per.values()) < q:
            c = max(cls, key=lambda c: raw[c] - per[c])
            per[c] += 1

        def spread(alloc):
            counts = [0] * r
            for c in cls:
                n = len(members[c])
                for k, i in enumerate(members[c]):
                    counts[i] = alloc[c] // n + (1 if k < alloc[c] % n else 0)
            return counts

        counts = spread(per)
        out.add(canonical(tuple((b, x) for x in counts), classes))
        for a in cls:
            for c in cls:
                if a == c and not (within_class and len(members[a]) > 1):
                    continue
                src = max(members[a], key=lambda i: counts[i])
                dst = min((i for i in members[c] if i != src), key=lambda i: counts[i], default=None)
                if dst is None or counts[src] <= 1:
                    continue
                moved = list(counts)
                moved[src] -= 1
                moved[dst] += 1
                out.add(canonical(tuple((b, x) for x in moved), classes))
    best: dict = {}
    return sorted(out | {_best_sizes(x, phi, sizes, classes, best) for x in out})
