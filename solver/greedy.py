"""A constructive plan for one candidate (skeleton, batches, sharding stage), in milliseconds instead of a MILP.

It gives the search an incumbent within seconds on any cluster, so a user sees a plan (and every MILP
after it gets a cutoff) long before the exact search finishes. What it gives up, against the MILP of
the same candidate:
  * shares: a tied stage takes its equal split (as the MILP does); a mixed stage takes the largest
    granularity and units proportional to each device's speed (largest remainder, one unit at least);
  * recompute: each device takes, for its stage's layer count, the fastest of its Pareto-front sets
    (``solver.options.device_choices``) that still fits, judged by its own per-layer time rather than
    by the group's per-block maximum;
  * layers: the split minimises the largest per-stage F + B (the steady state of 1F1B, times each replica's
    micro-batch count), not the exact 1F1B time with its warm-up and transfers;
  * sharding (stage 1): every peer group is split evenly (``shard_ratio`` unset: 1/r each).
The plan it returns is priced by ``baton.evaluate`` like every other; the MILP can only improve on it.
"""
from __future__ import annotations

import math
from dataclasses import replace

from baton.evaluate import PlanReport, evaluate
from baton.operators import operator_names
from baton.memory import tensor_roles
from baton.plan import DeviceShare, Plan, Stage, plan_of_replicas

from solver.instance import Instance
from solver.options import units_in_proportion


def _shares(inst: Instance, s: int) -> list[tuple[int, int]] | None:
    """(U, u) per rank of stage s: the tied option, or speed-proportional units at the largest U."""
    opts = inst.share_options[s]
    stage = inst.stages[0][s]
    if stage.tied:
        return [opts[0]] * len(stage.ids)
    U = max(inst.unit_counts[s])
    speed = []
    for g in stage.groups:
        full = [c for (UU, u), cs in g.choices.items() if UU == U for c in cs]
        if not full:
            return None
        t = min(sum(c.fwd) + sum(c.bwd) for c in full)
        speed.append(1.0 / t if t > 0 else 1.0)
    return [(U, u) for u in units_in_proportion(speed, U)]


def _per_layer(inst: Instance, s: int, shares, L: int):
    """Per replica: (F + B per layer incl. all-reduces, chosen Choice per group, embedding/head F + B) for L
    layers, or None."""
    out = []
    j = inst.ratios.equal  # the even split's owned fraction
    for rho in range(inst.modelled_replicas):
        stage = inst.stages[rho][s]
        picked = []
        for g, grp in enumerate(stage.groups):
            cs = [c for c in grp.choices.get(shares[0 if grp.rank is None else g], []) if c.max_layers[j] >= L]
            if not cs:
                return None
            picked.append(min(cs, key=lambda c: (sum(c.bwd), c.offload_optimizer, len(c.recompute))))
        t = sum(max(c.fwd[k] for c in picked) + max(c.bwd[k] for c in picked) for k in range(2)) + 2 * stage.allreduce_ms
        edge = (max(c.edge_fwd_ms for c in picked) + max(c.edge_bwd_ms for c in picked)
                + stage.edge_fwd_comm_ms + stage.edge_bwd_comm_ms)
        out.append((t, picked, edge))
    return out


def greedy_plan(inst: Instance) -> Plan | None:
    """The constructive plan of ``inst`` (None when its rules find nothing that fits)."""
    p, N = inst.skeleton.num_stages, inst.spec.num_layers
    shares = [_shares(inst, s) for s in range(p)]
    if any(x is None for x in shares):
        return None

    def stage_cost(s: int, L: int) -> float:
        got = _per_layer(inst, s, shares[s], L)
        if got is None:
            return math.inf
        return max(inst.batch(rho)[1] * (L * t + edge) for rho, (t, _, edge) in enumerate(got))

    cost = [[stage_cost(s, L) if inst.min_layers[s] <= L <= inst.max_layers[s] else math.inf for L in range(N + 1)]
            for s in range(p)]
    # Smallest threshold T at which the stages can hold every layer with each stage's cost <= T.
    levels = sorted({c for row in cost for c in row if math.isfinite(c)})

    def most_layers(T):
        return [max((L for L in range(N + 1) if cost[s][L] <= T), default=-1) for s in range(p)]

    lo, hi = 0, len(levels) - 1
    if hi < 0 or sum(most_layers(levels[hi])) < N or min(most_layers(levels[hi])) < 0:
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        caps = most_layers(levels[mid])
        if min(caps) >= 0 and all(c >= m for c, m in zip(caps, inst.min_layers)) and sum(caps) >= N:
            hi = mid
        else:
            lo = mid + 1
    layers = most_layers(levels[lo])
    while sum(layers) > N:  # drop surplus layers from the stages they cost most on
        s = max((s for s in range(p) if layers[s] > inst.min_layers[s]), key=lambda s: cost[s][layers[s]])
        layers[s] -= 1
    names = operator_names(inst.spec)
    replicas = []
    for rho, pipe in enumerate(inst.skeleton.pipelines):
        src = inst.replica_class[rho]
        stages, first = [], 0
        for s, ids in enumerate(pipe):
            _, picked, _ = _per_layer(inst, s, shares[s], layers[s])[src]
            devs = []
            for k, dev_id in enumerate(ids):
                c = picked[0 if inst.stages[src][s].tied else k]
                U, u = shares[s][k]
                devs.append(DeviceShare(id=dev_id, units=u, recompute=tuple(o for o in names if o in c.recompute),
                                        offload=tuple(t for t in tensor_roles(inst.spec) if t in c.offload),
                                        offload_optimizer=c.offload_optimizer))
            stages.append(Stage(first_layer=first, num_layers=layers[s], units_per_layer=shares[s][0][0], devices=tuple(devs)))
            first += layers[s]
        replicas.append(stages)
    return plan_of_replicas(inst.spec, inst.batches, inst.zero_stage, replicas)


def greedy_incumbent(inst: Instance, cluster, profiles) -> tuple[float, Plan, PlanReport] | None:
    """The constructive plan with its evaluation, when it fits."""
    plan = greedy_plan(inst)
    if plan is None:
        return None
    plan = replace(plan, cluster=cluster.name)
    report = evaluate(plan, cluster, profiles)
    if not report.fits:
        return None
    return report.iteration_time_ms, plan, report
