"""The least memory-hungry plan we can write down, used only to explain why nothing fits; and the training state's
shortfall, which proves nothing fits before any search."""
from __future__ import annotations

import math

import numpy as np

from baton.costmodel import (device_memory, device_slot, edge_cost, layer_cost, layer_cost_of, layer_limits,
                             slot_prices, state_bytes)
from baton.memory import RecomputeSpace
from baton.plan import DeviceShare, Pipeline, Plan, Stage

from solver.options import plan_shares, valid_unit_counts


def least_memory_plan(spec, cluster, profiles, global_batch: int, micro_batch: int, space: RecomputeSpace) -> Plan:
    """Every device its own stage (TP groups only when there are more devices than layers), larger memory
    first (early stages hold more micro-batches), the recompute set holding the fewest bytes, and layers
    spread so that the largest overflow over capacity is as small as possible."""
    N = spec.num_layers
    devices = sorted(cluster.devices, key=lambda d: (-(d.memory_bytes - d.reserve_bytes), d.id))
    Us = valid_unit_counts(spec)
    q = 1
    while -(-len(devices) // q) > N + 2 and q < max(Us):
        q += 1
    groups = [devices[i:i + q] for i in range(0, len(devices), q)]
    p = len(groups)
    m = global_batch // micro_batch
    U = min(u for u in Us if u >= max(len(g) for g in groups))
    stage_devs = []
    offload: dict[str, tuple[str, ...]] = {}
    for s, g in enumerate(groups):
        n = len(g)
        units = [U // n + (1 if k < U % n else 0) for k in range(n)]
        rows = []
        for dev, u in zip(g, units):
            slot = device_slot(cluster, profiles, spec, micro_batch, dev.id, stage=s, num_stages=p, num_microbatches=m)
            t = slot_prices(slot, spec, micro_batch, u / U, space)
            usable = np.isfinite(t.offload_fwd_ms).all(axis=1)  # offloading needs a host link
            i = int(np.lexsort((t.transient_bytes, np.where(usable, t.held_bytes, np.inf)))[0])
            offload[dev.id] = tuple(x for x in space.tensors if x in space.offload_set(i))
            rows.append((dev, u, space.recompute_set(i), layer_cost_of(t, i), slot, edge_cost(slot, spec, micro_batch, u / U)))
        stage_devs.append(rows)

    lo, _ = layer_limits(N, p)

    def over(s, L):
        return max(device_memory(slot, spec, L, param_bytes=lc.param_bytes, held_bytes=lc.held_bytes,
                                 transient_bytes=lc.transient_bytes, edge=edge).peak_bytes - slot.memory_bytes
                   for _, _, _, lc, slot, edge in stage_devs[s])

    def split(theta):
        caps = []
        for s in range(p):
            L = lo[s]
            while L < N and over(s, L + 1) <= theta:
                L += 1
            caps.append(L)
        if sum(caps) < N:
            return None
        layers, left = list(lo), N - sum(lo)
        for s in range(p):
            add = min(left, caps[s] - lo[s])
            layers[s] += add
            left -= add
        return layers

    hi = max(over(s, N) for s in range(p)) + 1.0
    low = min(over(s, lo[s]) for s in range(p)) - 1.0
    layers = split(hi)
    for _ in range(60):
        mid = (low + hi) / 2
        got = split(mid)
        if got is None:
            low = mid
        else:
            hi, layers = mid, got
    stages, first = [], 0
    for s, rows in enumerate(stage_devs):
        stages.append(Stage(first_layer=first, num_layers=layers[s], units_per_layer=U, devices=tuple(
            DeviceShare(id=dev.id, units=u, recompute=tuple(o for o in space.ops if o in rset), offload=offload[dev.id]) for dev, u, rset, _, _, _ in rows)))
        first += layers[s]
    return Plan(model=spec, cluster=cluster.name, micro_batch_size=micro_batch, num_microbatches=m,
                pipelines=(Pipeline(stages=tuple(stages)),))


def state_memory_shortfall(spec, cluster, profiles, *, host_optimizer: bool = False) -> tuple[float, float, float] | None:
    """A proof that no plan fits, from the training state alone: (bytes every plan needs on the GPUs, bytes the
    cluster's GPUs have beyond their reserves, what the need would be with the optimizer state in host memory), or
    None when the state fits in the sum.

    Why it bounds every plan (any layout, sharding stage, schedule, recompute or offload choice): each layer is
    held by TP ranks whose shares add up to 1, and a rank at share r holds the table's ``param_bytes`` at r, at
    least r x q where q is the least ``param_bytes / share`` over the cluster's tables (every micro-batch size, every
    share u / U the planner offers). At sharding stages 0 and 1 every replica holds its weights and gradients
    whole; at 2 and 3 the owned fractions of one position's peers add up to 1 and each keeps at least its owned part
    of its gradients (and at 3 of its weights) (eq. 8, 18); the optimizer state is eq. 7 of the owned weights
    (none on the device with ``host_optimizer``, which stages 0 and 1 allow). So over all GPUs the weights, the
    gradients and the optimizer state take at least N q each's factor, the edges, activations and buffers only
    add to it, and every used GPU keeps its reserve."""
    q = math.inf
    for g in cluster.gpu_types:
        prof = profiles[g]
        for b in prof.micro_batches("qkv"):
            for share in plan_shares(spec):
                q = min(q, layer_cost(prof, spec, b, share).param_bytes / share)
    if not math.isfinite(q) or q <= 0:
        return None
    weights = spec.num_layers * q
    with_host = state_bytes(weights, spec, offload_optimizer=True)
    need = state_bytes(weights, spec, offload_optimizer=host_optimizer)
    have = sum(max(0, d.memory_bytes - d.reserve_bytes) for d in cluster.devices)
    return (need, have, with_host) if need > have * (1 + 1e-9) else None
