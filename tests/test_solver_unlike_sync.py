"""Rules 13 and 14 of solver/README.md: the data-parallel sync bound of replicas of different shapes
(``bounds.unlike_sync_lower_bound``) and the stage-2/3 collectives bound in closed form
(``bounds.layered_collectives_bound``) lie under the evaluator's sync (eq. 13, 15) or collectives (eq. 17) of every
plan of the skeleton."""
from __future__ import annotations

import pytest

import solver.search as S
from baton.errors import BatonError
from baton.evaluate import evaluate
from baton.memory import RecomputeSpace
from baton.plan import validate
from solver.bounds import layered_collectives_bound, unlike_sync_lower_bound
from solver.layered import collectives_lower_bound, layered_skeleton
from solver.moves import neighbours
from solver.space import Skeleton, replica_pattern
from tests.test_solver_helpers import random_instance

MOVES = ("move-layer", "move-unit", "move-sample", "shard-ratio", "micro-batch", "zero-stage")
"""Moves that keep the plan's device layout: its skeleton, so its bound, stays the same."""


def _skeleton(plan) -> Skeleton:
    return Skeleton(pipelines=tuple(tuple(tuple(s.device_ids) for s in pipe.stages) for pipe in plan.pipelines))


def _instance(seed: int):
    """A random four-GPU instance at hidden 256, where the bandwidth terms dominate (at hidden 32 the groups'
    latencies, which the bounds count once per device, made every plan 2.6-3x the bound), and its exact skeletons."""
    inst = random_instance(seed, num_devices=4, num_layers=4, heads=16, universe_size=3, global_batch=4)
    return inst, S.skeleton_family(inst.spec, inst.cluster, "exact")[1], RecomputeSpace(inst.spec, inst.universe)


def _sync_of_plans(inst, space, sk: Skeleton, z: int):
    """The evaluator's sync (``dp_sync_ms``: eq. 15, or eq. 17's collectives at stages 2 and 3) of the skeleton's
    best plan at stage z and of every plan one layout-keeping move away that stays at z and fits."""
    try:
        best = S.search(inst.spec, inst.cluster, inst.profiles, global_batch=inst.global_batch, gap=0.0, time_limit=60,
                        space=space, shard_grid=2, family="exact", skeletons=[sk], zero_stages=(z,))
    except S.NoPlanFits:
        return
    plans = [best.plan] + [n.plan for n in neighbours(best.plan, inst.cluster, inst.profiles, moves=MOVES,
                                                     shard_grid=2, max_per_move=8)]
    for plan in plans:
        if plan.zero_stage != z or _skeleton(plan) != sk:
            continue
        try:
            validate(plan)
            yield evaluate(plan, inst.cluster, inst.profiles).dp_sync_ms
        except (BatonError, ValueError):
            continue


def _check(inst, space, sk: Skeleton, z: int, bound: float) -> tuple[int, int]:
    """Every plan of ``_sync_of_plans`` pays at least ``bound``; (plans checked, those within 2x of it)."""
    checked = close = 0
    for sync_ms in _sync_of_plans(inst, space, sk, z):
        assert sync_ms >= bound * (1 - 1e-9), (sk.describe(), z, sync_ms, bound)
        checked += 1
        close += sync_ms <= 2 * bound
    return checked, close


@pytest.mark.parametrize("seed", (0, 5, 9))  # seeds whose unlike skeletons have plans that fit
def test_the_unlike_sync_bound_lies_under_every_plans_sync(seed):
    """For skeletons of replicas of different shapes, each skeleton's best plan at stages 0 and 1 and every plan one
    layout-keeping move away (other layer splits, units, batches, shard ratios and stages) pay at least the bound
    in data-parallel sync. Fails if the bound counts a parameter twice, assumes fewer holders or a faster link than
    a group has, or adds the fixed cost of a device's groups more than once."""
    inst, skeletons, space = _instance(seed)
    unlike = [sk for sk in skeletons if sk.num_replicas > 1 and not sk.one_shape][:12]
    assert unlike
    checked, close = 0, 0
    for sk in unlike:
        bound = unlike_sync_lower_bound(inst.spec, inst.cluster, sk)
        for z in (0, 1):
            n, k = _check(inst, space, sk, z, bound)
            checked, close = checked + n, close + k
    assert checked >= 5
    assert close, "the bound was never within 2x of a plan's sync: it bounds nothing worth having"


def test_two_whole_replicas_pay_the_all_reduce_of_their_layers():
    """A replica of one device and one of two stages: the one device holds every layer, so the bound is at least the
    all-reduce of the layers' parameters over the cheaper of its links to the other replica's devices."""
    from baton.costmodel import allreduce_ms, layer_param_count

    inst = random_instance(1, num_devices=3, num_layers=4, heads=2, universe_size=3, global_batch=4)
    a, b, c = [d.id for d in inst.cluster.devices][:3]
    sk = Skeleton(pipelines=(((a,),), ((b,), (c,))))
    assert not sk.one_shape
    bound = unlike_sync_lower_bound(inst.spec, inst.cluster, sk)
    P = inst.spec.num_layers * layer_param_count(inst.spec, 1.0)
    cheapest = min(allreduce_ms(P * inst.spec.dtype_bytes, 2, inst.cluster.slowest_link([a, x])) for x in (b, c))
    assert bound >= cheapest * (1 - 1e-9)
    assert bound > 0


@pytest.mark.parametrize("seed", (0, 5))
def test_the_closed_collectives_bound_lies_under_every_layered_plans_collectives(seed):
    """Rule 14: for skeletons of one-stage replicas at stages 2 and 3, the closed form lies under
    ``layered.collectives_lower_bound`` (the least over every units choice, priced as plans) and under the
    evaluator's collectives (eq. 17) of each skeleton's best plan and every plan one layout-keeping move away.
    Fails if it counts a layer's gathers more often than the schedule runs them, or a pass at fewer holders."""
    inst, skeletons, space = _instance(seed)
    layered = [sk for sk in skeletons if sk.num_replicas > 1 and layered_skeleton(sk)][:10]
    assert layered
    checked, close = 0, 0
    for sk in layered:
        patterns = [replica_pattern(inst.cluster, pipe) for pipe in sk.pipelines]
        for z in (2, 3):
            bound = layered_collectives_bound(inst.spec, inst.cluster, sk, z)
            least = collectives_lower_bound(inst.spec, inst.cluster, sk.pipelines, z, patterns)
            assert least == 0.0 or bound <= least * (1 + 1e-9), (sk.describe(), z, bound, least)
            n, k = _check(inst, space, sk, z, bound)
            checked, close = checked + n, close + k
    assert checked >= 5
    assert close, "the bound was never within 2x of a plan's collectives: it bounds nothing worth having"
