"""Random small planning instances for the solver tests: a tiny model, synthetic profile tables held in
memory (derived, then scaled per operator), a cluster of 2-4 GPUs of 2-3 types with memory sized so
that recomputation and layer placement matter."""
from __future__ import annotations

import random
from dataclasses import dataclass

import pandas as pd

from baton.cluster import from_mapping
from baton.evaluate import evaluate
from baton.profile import ProfileSet
from baton.model_spec import ModelSpec
from baton.operators import operator_names
from baton.plan import simple_plan
from baton.profile import OPTIMIZER, Profile, derive_table

GIB = 1024**3
TYPES = ["a100-40gb", "t4", "v100-16gb"]


@dataclass
class Instance:
    spec: ModelSpec
    cluster: object
    profiles: ProfileSet
    global_batch: int
    universe: list
    seed: int


def synthetic_profile(spec: ModelSpec, gpu: str, rng: random.Random, *, monotone: bool = True,
                      extra: random.Random | None = None) -> Profile:
    df = derive_table(spec, gpu, micro_batches=(1, 2))
    for op in df["op"].unique():
        scale = rng.uniform(0.5, 2.0)
        rows = df["op"] == op
        df.loc[rows, "fwd_ms"] *= scale
        df.loc[rows, "bwd_ms"] *= scale * rng.uniform(0.8, 1.25)
        df.loc[rows, "saved_bytes"] *= rng.choice([1.0, 1.0, 0.5, 2.0])
    if not monotone:  # a bumpy table: some smaller shares cost more than larger ones
        for i in df.index:
            if df.at[i, "tp_share"] < 1.0:
                df.at[i, "fwd_ms"] *= rng.uniform(0.7, 1.6)
    if extra is not None and extra.random() < 0.5:  # a measured optimizer step (eq. 10) instead of the bandwidth rule
        rows = [{**df.iloc[0].to_dict(), "op": OPTIMIZER, "micro_batch": mb, "tp_share": 1.0, "fwd_ms": extra.uniform(0.5, 5.0),
                 "bwd_ms": 0.0, "saved_bytes": 0.0, "output_bytes": 0.0, "param_bytes": 1e6} for mb in (1, 2)]
        df = pd.concat([df, pd.DataFrame(rows)], ignore_index=True)
    return Profile(df, source=f"<synthetic {gpu}>")


def random_instance(seed: int, *, num_devices: int, num_layers: int, heads: int, universe_size: int,
                    global_batch: int = 2, monotone: bool = True, memory_scale: tuple = (0.25, 1.1),
                    dropout: float = 0.1) -> Instance:
    rng = random.Random(seed)
    extra = random.Random(seed + 7919)  # draws added later come from here, so older instances stay the same
    spec = ModelSpec(name=f"rand{seed}", num_layers=num_layers, hidden_dim=16 * heads, num_heads=heads, ffn_dim=64 * heads,
                     seq_len=32, vocab_size=128, dtype=rng.choice(["fp32", "fp16"]), dropout=dropout)
    types = rng.sample(TYPES, rng.choice([2, 3]) if num_devices >= 3 else 2)
    devs = [types[i % len(types)] for i in range(num_devices)]
    rng.shuffle(devs)
    profiles = ProfileSet(spec, tables={g: synthetic_profile(spec, g, rng, monotone=monotone, extra=extra) for g in sorted(set(devs))})
    # Memory: a random fraction of what one device would need for the whole model without recompute.
    probe = from_mapping({"name": "probe", "nodes": [{"name": "n", "gpus": [{"type": devs[0], "count": 1}]}]}, source="<probe>")
    plan = simple_plan(spec, cluster="probe", stages=[[("n:0", 1)]], layers=[num_layers], units_per_layer=1,
                       micro_batch_size=1, num_microbatches=global_batch)
    need = evaluate(plan, probe, ProfileSet(spec, tables={devs[0]: profiles[devs[0]]})).devices[0].peak_memory_bytes
    nodes, k = [], 0
    split = rng.choice([1, 2]) if num_devices > 1 else 1
    sizes = [num_devices] if split == 1 else [num_devices // 2, num_devices - num_devices // 2]
    for ni, size in enumerate(sizes):
        gpus = [{"type": devs[k + j], "count": 1, "memory_gib": need * rng.uniform(*memory_scale) / GIB, "memory_reserve_gib": 0.0}
                for j in range(size)]
        k += size
        node = {"name": f"n{ni}", "gpus": gpus}
        if size > 1:
            node["intra_node_link"] = {"bandwidth_gb_per_s": rng.choice([0.5, 5.0, 50.0]), "latency_us": rng.choice([1.0, 20.0])}
            if extra.random() < 0.5:  # measured all-reduce figures (eq. 5) apart from the transfer ones
                node["intra_node_link"].update(allreduce_bandwidth_gb_per_s=extra.choice([0.2, 2.0]),
                                               allreduce_latency_us=extra.choice([10.0, 200.0]))
                if extra.random() < 0.5:  # and in-layer (tensor-parallel) ones apart from those
                    node["intra_node_link"].update(tp_allreduce_bandwidth_gb_per_s=extra.choice([0.1, 1.0]),
                                                   tp_allreduce_latency_us=extra.choice([50.0, 500.0]))
        nodes.append(node)
    data = {"name": f"rand{seed}", "nodes": nodes}
    if len(nodes) > 1:
        data["inter_node_link"] = {"bandwidth_gb_per_s": rng.choice([0.2, 2.0]), "latency_us": 30.0}
    cluster = from_mapping(data, source=f"<rand{seed}>")
    names = operator_names(spec)
    pool = [frozenset(), frozenset(o for o in names if o in ("attn_scores", "softmax", "attn_dropout", "attn_v")),
            frozenset(names)]
    while len(pool) < universe_size:
        extra = frozenset(rng.sample(names, rng.randint(1, 4)))
        if extra not in pool:
            pool.append(extra)
    return Instance(spec=spec, cluster=cluster, profiles=profiles, global_batch=global_batch, universe=pool[:universe_size], seed=seed)


def two_gpu_instance(*, types=("a100-40gb", "t4"), slowdown: float = 2.0, memory_gib=(40.0, 16.0), num_layers: int = 2,
                     heads: int = 1, vocab_size: int = 128, global_batch: int = 6, universe_size: int = 2,
                     bandwidth_gb_per_s: float = 50.0) -> Instance:
    """Two GPUs on one node for the data-parallel cases: both priced from one derived table, the second
    ``slowdown`` times slower, so the GPUs differ in speed (and memory) only as asked. One head: no tensor
    parallelism, so layouts are pipelines and replicas. Universe: no recomputation and full recomputation."""
    spec = ModelSpec(name="dp2", num_layers=num_layers, hidden_dim=16 * heads, num_heads=heads, ffn_dim=64 * heads,
                     seq_len=32, vocab_size=vocab_size, dtype="fp16", dropout=0.0)
    base = derive_table(spec, types[0], micro_batches=(1, 2))
    tables = {}
    for gpu, factor in zip(types, (1.0, slowdown)):
        df = base.copy()
        df["gpu"] = gpu
        df["fwd_ms"] *= factor
        df["bwd_ms"] *= factor
        tables[gpu] = Profile(df, source=f"<scaled {gpu}>")
    gpus = [{"type": g, "count": 1, "memory_gib": m, "memory_reserve_gib": 0.0} for g, m in zip(types, memory_gib)]
    cluster = from_mapping({"name": "dp2", "nodes": [{"name": "n", "gpus": gpus, "intra_node_link": {
        "bandwidth_gb_per_s": bandwidth_gb_per_s, "latency_us": 1.0}}]}, source="<dp2>")
    names = operator_names(spec)
    universe = [frozenset(), frozenset(names)][:universe_size]
    return Instance(spec=spec, cluster=cluster, profiles=ProfileSet(spec, tables=tables), global_batch=global_batch,
                    universe=universe, seed=0)


def interleaved_wins_instance() -> Instance:
    """Where interleaved 1F1B beats every other plan under the cost model, for comparing the planner with the oracle
    when both may interleave (2 chunks per device group).

    An A100 and a GPU 1.5 times slower on one node (50 GB/s), 300 kB each, a 4-layer model of one head (no tensor
    parallelism), global batch 4; the universe: no recomputation, full recomputation. Neither GPU holds the model
    alone, two replicas fit only with full recomputation (1.72 ms), and without recomputation a 1F1B stage holds
    at most two layers at micro-batch 2. So the 1F1B optimum is the two-stage pipeline (the slower GPU first) of two
    layers each on two micro-batches of 2: 1.3863 ms, of which the slower GPU idles 18% and the A100 41% (fill and
    drain of two micro-batches over two stages). Interleaved with 2 chunks per GPU (virtual stages of 0, 1, 2 and 1
    layers, the slower GPU on chunks 0 and 2) each GPU still holds two layers, within its memory, and idles less:
    1.2919 ms, 6.8% less (the oracle's optima; tests/test_solver_exact.py)."""
    return two_gpu_instance(types=("a100-40gb", "v100-16gb"), slowdown=1.5, memory_gib=(300e3 / GIB, 300e3 / GIB),
                            num_layers=4, global_batch=4)


CROSSED_EDGES = {"a100-40gb": {"qkv": (4.231394, 0.0), "ln1": (0.0, 0.0), "embedding": (20.129536, 0.689274),
                               "head": (2.990191, 22.240364)},
                 "t4": {"qkv": (0.515184, 0.0), "ln1": (0.0, 4.430872), "embedding": (5.577311, 13.809186),
                        "head": (43.390146, 0.636714)}}
"""``crossed_instance`` lines whose edges cross: the embedding is dear on the A100 and the head on the T4 (a review's
counterexample to charging one stage the embedding's floor and the head's apart, tests/test_relaxation_bound.py)."""


def crossed_instance(lines: dict) -> tuple[ModelSpec, object, ProfileSet]:
    """(spec, cluster, profiles): one GPU of each type in ``lines`` on one node with a free link, one layer, and tables
    exactly linear in the share: per GPU type, operator -> (alpha, beta), forward and backward each (alpha u + beta) / 2,
    every other operator 1e-7 ms."""
    spec = ModelSpec(name="crossed", num_layers=1, hidden_dim=256, num_heads=16, ffn_dim=1024, seq_len=32, vocab_size=128,
                     dtype="fp32", dropout=0.0)

    def table(gpu):
        df = derive_table(spec, gpu, micro_batches=(1,))
        df["fwd_ms"], df["bwd_ms"] = 1e-7, 1e-7
        for op, (alpha, beta) in lines[gpu].items():
            rows = df["op"] == op
            df.loc[rows, "fwd_ms"] = df.loc[rows, "bwd_ms"] = (alpha * df.loc[rows, "tp_share"] + beta) / 2
        return Profile(df, source=f"<crossed {gpu}>")

    cluster = from_mapping({"name": "crossed", "nodes": [{"name": "n", "gpus": [
        {"type": g, "count": 1, "memory_gib": 40.0, "memory_reserve_gib": 0.0} for g in lines],
        "intra_node_link": {"bandwidth_gb_per_s": 1e6, "latency_us": 1e-6}}]}, source="<crossed>")
    return spec, cluster, ProfileSet(spec, tables={g: table(g) for g in lines})
