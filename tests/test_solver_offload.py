"""Offload in the planner (issue 26): keep, recompute or send to host memory, chosen per device.

The planner's offload space (solver/README.md): at 1F1B with replicas of one shape, sharding stages 0 and 1, a
device keeps each block's held tensors in host memory or not, on top of its recompute set. The exhaustive oracle
enumerates the same space (``exhaustive(offload=True)``), and the planner must return its optimum; with a node's host
memory capped (eq. 8o) too. The hosts' links are slowed so that copies cost time and the choice is a real trade.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from baton.costmodel import device_slot, slot_prices
from baton.evaluate import evaluate
from baton.memory import recompute_space
from solver.baselines import exhaustive
from solver.options import device_choices
from solver.search import NoPlanFits, search
from tests.test_solver_helpers import random_instance

GRID = 2


def _slow_hosts(inst, link_gb_per_s: float, host_memory: dict | None = None):
    """``inst``'s cluster with every device's host link at ``link_gb_per_s`` and the given node host memory."""
    devices = tuple(dataclasses.replace(d, host_link_gb_per_s=link_gb_per_s) for d in inst.cluster.devices)
    return dataclasses.replace(inst.cluster, devices=devices, host_memory=dict(host_memory or {}))


CASES = [
    # seed, devices, layers, universe, memory scale, host link GB/s
    (3, 2, 4, 3, (0.5, 0.7), 1.0),  # offloading beats the best plan without it by 12.9%
    (18, 2, 4, 3, (0.5, 0.7), 0.1),  # only plans that offload fit
    (11, 3, 3, 2, (0.5, 0.7), 1.0),
]
QUICK = {3, 18}


def _case(case):
    seed, n, layers, uni, mem, link = case
    inst = random_instance(seed, num_devices=n, num_layers=layers, heads=2, universe_size=uni, global_batch=2,
                           memory_scale=mem, dropout=0.0)
    return inst, _slow_hosts(inst, link)


def _both(inst, cluster, **kw):
    try:
        oracle = exhaustive(inst.spec, cluster, inst.profiles, global_batch=inst.global_batch, universe=inst.universe,
                            shard_grid=GRID, offload=True, max_plans=2_000_000)
    except NoPlanFits:
        oracle = None
    try:
        got = search(inst.spec, cluster, inst.profiles, global_batch=inst.global_batch, gap=0.0, time_limit=300,
                     space=recompute_space(inst.spec, tuple(inst.universe), offload=True), shard_grid=GRID, **kw)
    except NoPlanFits:
        got = None
    return oracle, got


@pytest.mark.parametrize("case", [pytest.param(c, marks=() if c[0] in QUICK else pytest.mark.long) for c in CASES],
                         ids=[f"seed{c[0]}-{c[1]}gpu" for c in CASES])
def test_planner_with_offload_equals_exhaustive(case):
    inst, cluster = _case(case)
    oracle, got = _both(inst, cluster)
    assert (oracle is None) == (got is None)
    if got is None:
        return
    assert math.isclose(got.objective_ms, oracle.objective_ms, rel_tol=1e-6), (got.plan.to_json(), oracle.plan.to_json())
    rep = evaluate(got.plan, cluster, inst.profiles)
    assert rep.fits and math.isclose(rep.iteration_time_ms, got.objective_ms, rel_tol=1e-6)


def test_offload_is_in_the_optimum_where_memory_binds_and_never_slower():
    """On the quick instance offloading wins over the best plan without it, and the planner with offload is never
    slower than without (its space holds every plan without offload)."""
    inst, cluster = _case(CASES[0])
    plain = search(inst.spec, cluster, inst.profiles, global_batch=inst.global_batch, gap=0.0, time_limit=300,
                   space=recompute_space(inst.spec, tuple(inst.universe)), shard_grid=GRID)
    with_offload = search(inst.spec, cluster, inst.profiles, global_batch=inst.global_batch, gap=0.0, time_limit=300,
                          space=recompute_space(inst.spec, tuple(inst.universe), offload=True), shard_grid=GRID)
    assert with_offload.objective_ms < plain.objective_ms * (1 - 1e-6), (plain.plan.to_json(), with_offload.plan.to_json())
    assert any(d.offload for p in with_offload.plan.pipelines for s in p.stages for d in s.devices)


def test_a_node_host_memory_cap_binds_and_the_planner_still_equals_the_oracle():
    """Eq. 8o in the MILP: cap the node's host memory at half of what the unconstrained optimum keeps there; both
    searches must respect it and agree."""
    inst, cluster = _case(CASES[0])
    free = search(inst.spec, cluster, inst.profiles, global_batch=inst.global_batch, gap=0.0, time_limit=300,
                  space=recompute_space(inst.spec, tuple(inst.universe), offload=True), shard_grid=GRID)
    held = {h.node: h.activation_bytes for h in evaluate(free.plan, cluster, inst.profiles).host_memory}
    node, most = max(held.items(), key=lambda kv: kv[1])
    assert most > 0
    capped = _slow_hosts(inst, CASES[0][-1], {node: int(most / 2)})
    oracle, got = _both(inst, capped)
    assert oracle is not None and got is not None
    assert math.isclose(got.objective_ms, oracle.objective_ms, rel_tol=1e-6), (got.plan.to_json(), oracle.plan.to_json())
    rep = evaluate(got.plan, capped, inst.profiles)
    assert rep.fits and all(h.fits for h in rep.host_memory)
    assert got.objective_ms > free.objective_ms * (1 + 1e-9)  # the cap costs something: it binds


def test_pruned_offload_choices_dominate_every_dropped_one():
    """Every (recompute, offload) row ``device_choices`` drops is no better, in every number the MILP reads, than a
    row it keeps: forward and backward per block, the layers that fit, and the host bytes. Checked at the place of
    the device that offloads in the quick instance's optimum, over every subset of the operators."""
    inst, cluster = _case(CASES[0])
    best = search(inst.spec, cluster, inst.profiles, global_batch=inst.global_batch, gap=0.0, time_limit=300,
                  space=recompute_space(inst.spec, tuple(inst.universe), offload=True), shard_grid=GRID)
    plan = best.plan
    pipe = plan.pipelines[0]
    s, stage, dev = next((s, st, d) for s, st in enumerate(pipe.stages) for d in st.devices if d.offload)
    slot = device_slot(cluster, inst.profiles, inst.spec, plan.micro_batch_size, dev.id, stage=s,
                       num_stages=len(pipe.stages), num_microbatches=plan.num_microbatches)
    share = dev.units / stage.units_per_layer
    space = recompute_space(inst.spec, None, offload=True)
    kw = dict(min_layers=0, cap=inst.spec.num_layers)
    kept = device_choices(slot, inst.spec, plan.micro_batch_size, share, space, **kw)
    every = device_choices(slot, inst.spec, plan.micro_batch_size, share, space, prune=False, **kw)
    assert any(o for _, o, _, _ in kept), "an offloading row should survive where the optimum offloads"
    assert len(kept) < len(every)

    def key(row):
        _, _, lc, fits = row
        return np.array([-fits[0], *lc.block_fwd_ms(), *lc.block_bwd_ms(), lc.host_bytes])

    kept_keys = np.array([key(r) for r in kept])
    for row in every:
        assert np.any(np.all(kept_keys <= key(row) + 1e-12, axis=1)), row[:2]
    prices = slot_prices(slot, inst.spec, plan.micro_batch_size, share, space)
    assert prices.host_bytes.shape == (len(space),) and prices.offload_fwd_ms.shape == (len(space), 2)


def _host_step_case(seed: int, memory_scale: tuple, host_memory: dict | None = None):
    """A quick instance whose hosts step Adam at 5 GB/s over a 1 GB/s link (so the host step costs time)."""
    inst = random_instance(seed, num_devices=2, num_layers=4, heads=2, universe_size=3, global_batch=2,
                           memory_scale=memory_scale, dropout=0.0)
    cluster = _slow_hosts(inst, 1.0, host_memory)
    cluster = dataclasses.replace(cluster, devices=tuple(dataclasses.replace(d, host_optimizer_gb_per_s=5.0)
                                                         for d in cluster.devices))
    return inst, cluster


def _with_host_step(inst, cluster):
    oracle = exhaustive(inst.spec, cluster, inst.profiles, global_batch=inst.global_batch, universe=inst.universe,
                        shard_grid=GRID, offload=True, offload_optimizer=True, zero_stages=(0,), max_plans=4_000_000)
    got = search(inst.spec, cluster, inst.profiles, global_batch=inst.global_batch, gap=0.0, time_limit=300,
                 space=recompute_space(inst.spec, tuple(inst.universe), offload=True), shard_grid=GRID, zero_stages=(0,),
                 offload_optimizer=True)
    assert math.isclose(got.objective_ms, oracle.objective_ms, rel_tol=1e-6), (got.plan.to_json(), oracle.plan.to_json())
    rep = evaluate(got.plan, cluster, inst.profiles)
    assert rep.fits and math.isclose(rep.iteration_time_ms, got.objective_ms, rel_tol=1e-6)
    return got, rep


@pytest.mark.parametrize("seed,memory_scale", [(3, (0.5, 0.7)), pytest.param(18, (0.4, 0.55), marks=pytest.mark.long)],
                         ids=["wins", "only-fit"])
def test_optimizer_state_on_the_host_equals_the_oracle(seed, memory_scale):
    """The planner's choice per device of where its optimizer state lives (eq. 7h, 10h), with its activation choices,
    against the oracle enumerating both at stage 0: seed 3, where the host step beats the best plan keeping the state
    on the devices (1.8195 -> 1.7300 ms), and seed 18, where only plans with it on the host fit."""
    inst, cluster = _host_step_case(seed, memory_scale)
    got, _ = _with_host_step(inst, cluster)
    assert any(d.offload_optimizer for p in got.plan.pipelines for s in p.stages for d in s.devices)
    try:
        without = search(inst.spec, cluster, inst.profiles, global_batch=inst.global_batch, gap=0.0, time_limit=300,
                         space=recompute_space(inst.spec, tuple(inst.universe), offload=True), shard_grid=GRID,
                         zero_stages=(0,)).objective_ms
    except NoPlanFits:
        without = math.inf
    assert got.objective_ms < without * (1 - 1e-6)


@pytest.mark.long
def test_optimizer_state_counts_in_the_node_host_memory():
    """Eq. 8o with eq. 7h: a node capped below what the uncapped optimum keeps there (activations and optimizer state)
    makes the planner and the oracle give up some of it, and agree."""
    inst, cluster = _host_step_case(3, (0.5, 0.7))
    free, rep = _with_host_step(inst, cluster)
    node, most = max(((h.node, h.activation_bytes + h.optimizer_bytes) for h in rep.host_memory), key=lambda kv: kv[1])
    assert any(h.optimizer_bytes > 0 for h in rep.host_memory)
    _, capped = _host_step_case(3, (0.5, 0.7), {node: int(most * 0.6)})
    got, rep = _with_host_step(inst, capped)
    assert all(h.fits for h in rep.host_memory)
    assert got.objective_ms > free.objective_ms * (1 + 1e-9)


def test_what_offloading_does_not_need_goes_back_to_the_device():
    """``keep_on_device``: a device whose offload costs time for nothing gets its tensors back, a plan that fits only
    by offloading keeps it (the quick instance where only offloading plans fit)."""
    from solver.search import keep_on_device

    inst, cluster = _case(CASES[1])
    fitted = search(inst.spec, cluster, inst.profiles, global_batch=inst.global_batch, gap=0.0, time_limit=300,
                    space=recompute_space(inst.spec, tuple(inst.universe), offload=True), shard_grid=GRID)
    report = evaluate(fitted.plan, cluster, inst.profiles)
    same, again = keep_on_device(fitted.plan, cluster, inst.profiles, report)
    assert same is fitted.plan and again is report
    roomy = dataclasses.replace(cluster, devices=tuple(dataclasses.replace(d, memory_bytes=d.memory_bytes * 100)
                                                       for d in cluster.devices))
    plan, rep = keep_on_device(fitted.plan, roomy, inst.profiles, evaluate(fitted.plan, roomy, inst.profiles))
    assert not any(d.offload or d.offload_optimizer for p in plan.pipelines for s in p.stages for d in s.devices)
    assert rep.fits and rep.iteration_time_ms <= evaluate(fitted.plan, roomy, inst.profiles).iteration_time_ms
