"""Eq. 19: how long replicas that meet at a collective wait for the last of them.

A replica's time between two collectives every replica joins is its predicted time ``mu_r`` times
``(1 + cv * Z_r)``, the ``Z_r`` independent standard normals (``cv``: the cluster's
``replica_time_cv``, the part of the spread the replicas do not share; a slowdown all of them share
moves no one's arrival relative to the others). The collective starts when the last replica arrives,
at ``f(mu) = E[max_r mu_r (1 + cv Z_r)]``.

``f`` is convex (an expectation of a maximum of linear functions) and homogeneous of degree one, so it
is the maximum of its tangent planes through the origin, each linear in ``mu``: the MILP can minimise
it exactly over any finite family of them. The cost model is that family's maximum (the evaluator's,
the MILP's and the planners' value), a lower bound on ``f`` that is exact for replicas of equal times:

* every replica alone: ``mu_r`` (no noise can make the last arrival earlier than the slowest's mean);
* every k of them equal: ``(1 + cv e_k) / k`` times the sum of the k largest (``e_k`` = E[max of k
  standard normals]; the plane touches ``f`` where those k are equal and the rest far below);
* the two largest at ratio ``t`` (Clark's exact expected maximum of two normals, differentiated):
  ``g1 mu_(1) + g2 mu_(2)``, for ``t`` on a grid of ``ALPHAS`` (the gap in units of its spread).

Every coefficient is non-negative, so the value never decreases when a replica gets slower (what lets
planners keep choosing each replica's fastest recompute sets).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

ALPHAS = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0)
"""Clark's ``alpha`` (the gap between the two largest means over the spread ``theta`` of their difference)
at which the pair planes touch: past 3 the wait is under 0.0004 theta, and between grid points the planes
fall at most 0.004 theta short of Clark's value (``tests/test_waits.py`` checks it)."""


@dataclass(frozen=True, slots=True)
class ArrivalPlanes:
    """The planes of eq. 19 for one replica count and ``cv``."""

    top_k: tuple[tuple[int, float], ...]
    """(k, a_k): the last arrival is at least a_k times the sum of the k largest replica times."""
    pairs: tuple[tuple[float, float], ...]
    """(b, c): at least b (mu_(1) + mu_(2)) + c mu_(1), mu_(1) >= mu_(2) the two largest (b = g2, c = g1 - g2)."""


def _phi(x: float) -> float:
    return math.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)


def _Phi(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


@functools.lru_cache(maxsize=None)
def _normal_grid() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    z = np.linspace(-12.0, 12.0, 48001)
    pdf = np.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)
    cdf = np.array([_Phi(float(v)) for v in z])
    return z, pdf, cdf


@functools.lru_cache(maxsize=None)
def expected_max_of_normals(k: int) -> float:
    """e_k = E[max of k independent standard normals] = integral of z k phi(z) Phi(z)^(k-1) (e_2 = 1/sqrt(pi))."""
    if k < 1:
        raise ValueError("k >= 1")
    if k == 1:
        return 0.0
    z, pdf, cdf = _normal_grid()
    return float(np.trapezoid(z * k * pdf * cdf ** (k - 1), z))


def _pair_ratio(alpha: float, cv: float) -> float | None:
    """The ratio t = mu_(2) / mu_(1) at which Clark's alpha = (1 - t) / (cv sqrt(1 + t^2)) (None past t = 0)."""
    if alpha * cv >= 1.0:
        return None
    lo, hi = 0.0, 1.0  # (1 - t) - alpha cv sqrt(1 + t^2) falls from 1 - alpha cv > 0 at 0 to < 0 at 1
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        if (1.0 - mid) - alpha * cv * math.sqrt(1.0 + mid * mid) > 0.0:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def pair_gradient(t: float, cv: float) -> tuple[float, float]:
    """(g1, g2): the gradient of E[max(mu_1 (1 + cv Z_1), mu_2 (1 + cv Z_2))] at (1, t), by Clark's formula
    ``mu_1 Phi(a) + mu_2 Phi(-a) + theta phi(a)`` with ``theta = cv sqrt(mu_1^2 + mu_2^2)``,
    ``a = (mu_1 - mu_2) / theta`` (the terms in da cancel)."""
    root = math.sqrt(1.0 + t * t)
    a = (1.0 - t) / (cv * root)
    return _Phi(a) + _phi(a) * cv / root, _Phi(-a) + _phi(a) * cv * t / root


@functools.lru_cache(maxsize=256)
def arrival_planes(num_replicas: int, cv: float) -> ArrivalPlanes:
    """Eq. 19's planes beyond the replicas' own times (none for one replica or no noise)."""
    if num_replicas < 2 or cv <= 0.0:
        return ArrivalPlanes(top_k=(), pairs=())
    top_k = tuple((k, (1.0 + cv * expected_max_of_normals(k)) / k) for k in range(2, num_replicas + 1))
    pairs = []
    for alpha in ALPHAS:
        t = _pair_ratio(alpha, cv)
        if t is None:
            continue
        g1, g2 = pair_gradient(t, cv)
        pairs.append((g2, g1 - g2))
    return ArrivalPlanes(top_k=top_k, pairs=tuple(pairs))


def last_arrival_ms(times_ms: Sequence[float], cv: float) -> float:
    """Eq. 19: when the last of the replicas, predicted at ``times_ms``, arrives (their max when ``cv`` is 0)."""
    times = sorted((float(x) for x in times_ms), reverse=True)
    if not times:
        return 0.0
    planes = arrival_planes(len(times), cv)
    best = times[0]
    prefix = np.cumsum(times)
    for k, a in planes.top_k:
        best = max(best, a * float(prefix[k - 1]))
    for b, c in planes.pairs:
        best = max(best, b * float(prefix[1]) + c * times[0])
    return best
