"""A lower bound on the iteration time of every plan of a cluster, whatever its layout: the ideal throughput.

The search's own bounds (``bounds.py``) hold for the candidates it builds; in the structured family that is a
heuristic subset of the plans the format can express. This bound holds for all of them (solver/README.md,
"The bound over every plan"), so ``baton solve`` can state a gap over the whole space from its first second.

Proof, in the cost model's terms (docs/cost-model.md): in every schedule (1F1B, interleaved, layer by layer) a
device runs the forward and backward passes of every (layer, micro-batch) it holds one after another, so the
iteration is at least each device's compute time (eq. 1, 16). Device d at micro-batch b and share u spends at
least t_d(b, u) per layer (eq. 2: the stage's per-layer time takes, per block, the slowest rank, and
recomputation, offload copies, all-reduces and the host term only add), and t_d(b, u) >= b u c_d with
c_d = min over the search's micro-batch sizes and every share a plan can hold (k/U) of t_d(b, u) / (b u). Every
sample crosses every layer once, its shares adding up to one over the group (eq. 9), so the layer work is G N
"sample-layers" shared among the devices: x_d of them on d, sum x_d = G N, and T >= x_d c_d for every d, so
T >= G N / sum_d (1 / c_d). The embedding and the head are G sample-units each, on devices of our choosing:
counting them in d's time as x_e,d e_d >= x_e,d rho c_d with rho = min_d e_d / c_d adds G rho to the
numerator. The Adam step comes after the last backward in every schedule and the iteration pays the slowest
device's (eq. 10, 17): device d owns w_d bytes of weights at a_d ms per byte (the least of its own step and the
host's, eq. 10h), every weight is owned at least once (sum w_d >= P), so that step is at least
P / sum_d (1 / a_d). Memory, links, pipeline bubbles and the syncs are left out, each of which only adds, so the
bound holds; it is tight only when a plan can spread the work in proportion to speed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from baton.cluster import ClusterSpec
from baton.costmodel import device_slot, edge_cost, layer_cost, layer_train_ms
from baton.model_spec import ModelSpec
from baton.profile import ProfileSet

from solver.options import plan_shares


@dataclass(frozen=True, kw_only=True, slots=True)
class IdealBound:
    """The ideal-throughput bound and the per-type rates it was made of."""

    bound_ms: float
    """Lower bound on the iteration time of every plan, in ms."""
    sample_layer_ms: dict
    """GPU type -> c_d: its least time for one sample through one whole layer (forward + backward)."""
    edge_layers: float
    """rho_embedding + rho_head: the least cost of one sample's embedding and head, in layers of the device
    that runs them most cheaply relative to its layers."""
    compute_ms: float
    """The part of ``bound_ms`` that is forward and backward passes."""
    optimizer_ms: float
    """The part that is the Adam step."""


def ideal_bound(spec: ModelSpec, cluster: ClusterSpec, profiles: ProfileSet, global_batch: int,
                micro_batch: int | None = None) -> IdealBound:
    """The bound over plans whose replicas run any micro-batch size their GPUs' tables hold (``micro_batch``
    alone when the user fixed it)."""
    shares = plan_shares(spec)
    per_type, edge_ratio = {}, {"first": math.inf, "last": math.inf}
    for gpu in cluster.gpu_types:
        prof = profiles[gpu]
        micro_batches = [micro_batch] if micro_batch else prof.micro_batches("qkv")
        c = min(layer_train_ms(prof, spec, b, u) / (b * u) for b in micro_batches for u in shares)
        per_type[gpu] = c
        dev = next(d for d in cluster.devices if d.gpu.name == gpu)
        for stage, end in ((0, "first"), (1, "last")):  # two stages: each edge alone
            for b in micro_batches:
                slot = device_slot(cluster, profiles, spec, b, dev.id, stage=stage, num_stages=2, num_microbatches=1)
                for u in shares:
                    e = edge_cost(slot, spec, b, u)
                    edge_ratio[end] = min(edge_ratio[end], (e.fwd_ms + e.bwd_ms) / (b * u) / c)
    rate = sum(1.0 / per_type[d.gpu.name] for d in cluster.devices)
    edge_layers = edge_ratio["first"] + edge_ratio["last"]
    compute = global_batch * (spec.num_layers + edge_layers) / rate
    optimizer = _weight_bytes(spec, cluster, profiles, micro_batch) / _optimizer_rate(spec, cluster, profiles)
    return IdealBound(bound_ms=compute + optimizer, sample_layer_ms=per_type, edge_layers=edge_layers,
                      compute_ms=compute, optimizer_ms=optimizer)


def _weight_bytes(spec, cluster, profiles, micro_batch) -> float:
    """P: the fewest bytes of weights a plan holds once, over the GPU types' tables (one stage holding both
    edges, so a tied head is not counted twice)."""
    least = math.inf
    for gpu in cluster.gpu_types:
        prof = profiles[gpu]
        b = micro_batch or prof.micro_batches("qkv")[0]
        dev = next(d for d in cluster.devices if d.gpu.name == gpu)
        slot = device_slot(cluster, profiles, spec, b, dev.id, stage=0, num_stages=1, num_microbatches=1)
        layers = layer_cost(prof, spec, b, 1.0).param_bytes * spec.num_layers
        least = min(least, layers + edge_cost(slot, spec, b, 1.0).param_bytes)
    return least


def _optimizer_rate(spec, cluster, profiles) -> float:
    """sum_d 1 / a_d: bytes of weights per ms the devices step together, each on itself or its host."""
    rate = 0.0
    for d in cluster.devices:
        b = profiles[d.gpu.name].micro_batches("qkv")[0]  # the slopes do not depend on the micro-batch
        slot = device_slot(cluster, profiles, spec, b, d.id, stage=0, num_stages=1, num_microbatches=1)
        rate += 1.0 / min(slot.optimizer_ms_per_byte, slot.host_optimizer_ms_per_byte)
    return rate
