"""Runtime speed, measured side by side in one run over gloo (CPU processes, one thread each).

1. Tensor parallelism: forward + backward of one layer of the ``small`` preset on 2 ranks.
   * ours, even split (2:2 units) vs a plain Megatron-style even-split layer (``divide(n, world)``,
     the same operators written inline): the cost of our non-uniform machinery (operator program,
     explicit split sizes). Target: ratio <= 1.03.
   * ours, uneven split (3:1): for information; its slowest rank holds 1.5x the even share of work.
2. Pipeline: one training step (forward + backward, no optimizer) of the ``small`` preset on 2 stages
   (4 + 2 layers), 4 micro-batches: our 1F1B vs ``torch.distributed.pipelining.Schedule1F1B`` on the
   same split and the same stage modules. Target: ratio <= 1.0.

Run: ``python bench/bench_runtime.py [--iters 30]``; writes bench/results/runtime.json and .md.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from baton.model_spec import PRESETS  # noqa: E402

SPEC = PRESETS["small"].with_overrides(dropout=0.0)
RESULTS = ROOT / "bench" / "results"


# --- 1. tensor-parallel layer ----------------------------------------------------------------------


class EvenBlock(nn.Module):
    """Baseline: a Megatron-style layer that assumes an even split (heads // world on every rank)."""

    def __init__(self, spec, rank, world, group, full):
        super().__init__()
        from runtime.parallel.slicing import parameter_slice, take_slice

        self.spec, self.group = spec, group
        nh, nf = spec.num_heads // world, spec.ffn_dim // world  # divide(n, world)
        heads, cols = range(rank * nh, (rank + 1) * nh), range(rank * nf, (rank + 1) * nf)
        self.nh = nh
        self.p = nn.ParameterDict()
        for name in ("ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
                     "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
                     "mlp.c_proj.weight", "mlp.c_proj.bias"):
            t = take_slice(full("h.0." + name), parameter_slice(spec, "h.0." + name, heads, cols))
            self.p[name.replace(".", "_")] = nn.Parameter(t.clone())

    def forward(self, x):
        from runtime.parallel.tensor_parallel import copy_to_tp, reduce_from_tp

        p, B, T, C, hs = self.p, x.size(0), x.size(1), x.size(2), self.spec.head_dim
        a = copy_to_tp(F.layer_norm(x, (C,), p["ln_1_weight"], p["ln_1_bias"], 1e-5), self.group)
        q, k, v = F.linear(a, p["attn_c_attn_weight"], p["attn_c_attn_bias"]).view(B, T, 3, self.nh, hs).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))
        causal = torch.ones(T, T, dtype=torch.bool).triu(1)
        att = F.softmax(att.masked_fill(causal, float("-inf")), dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, self.nh * hs)
        x = x + reduce_from_tp(F.linear(y, p["attn_c_proj_weight"]), self.group) + p["attn_c_proj_bias"]
        h = copy_to_tp(F.layer_norm(x, (C,), p["ln_2_weight"], p["ln_2_bias"], 1e-5), self.group)
        h = F.gelu(F.linear(h, p["mlp_c_fc_weight"], p["mlp_c_fc_bias"]), approximate="tanh")
        return x + reduce_from_tp(F.linear(h, p["mlp_c_proj_weight"]), self.group) + p["mlp_c_proj_bias"]


def bench_tp(rank, world, iters):
    from runtime.model.gpt import init_parameter
    from runtime.parallel.tp_layer import MicroBatch, ParallelBlock

    spec = SPEC
    full = lambda name: init_parameter(spec, name, 0)  # noqa: E731
    group = dist.new_group(list(range(world)))
    U = 4

    def ours(units):
        before = sum(units[:rank])
        hpu, fpu = spec.num_heads // U, spec.ffn_dim // U
        blk = ParallelBlock(spec, 0, heads=range(before * hpu, (before + units[rank]) * hpu),
                            ffn_cols=range(before * fpu, (before + units[rank]) * fpu), tp_group=group)
        with torch.no_grad():
            from runtime.parallel.slicing import parameter_slice, take_slice
            for n, prm in blk.named_parameters():
                prm.copy_(take_slice(full("h.0." + n), parameter_slice(spec, "h.0." + n, blk.heads,
                                                                        range(before * fpu, (before + units[rank]) * fpu))))
        mb = MicroBatch(0, 0, torch.arange(4))
        return lambda x: blk(x, mb)

    runs = {"ours_even_2_2": ours([2, 2]), "baseline_even_2_2": EvenBlock(spec, rank, world, group, full),
            "ours_uneven_3_1": ours([3, 1])}
    x0 = torch.randn(4, spec.seq_len, spec.hidden_dim, generator=torch.Generator().manual_seed(0))
    times = {k: [] for k in runs}
    for it in range(iters + 5):
        for name, fn in runs.items():
            x = x0.clone().requires_grad_()
            dist.barrier(group)
            t0 = time.perf_counter()
            fn(x).sum().backward()
            dist.barrier(group)
            if it >= 5:
                times[name].append((time.perf_counter() - t0) * 1e3)
    return times


# --- 2. pipeline schedule --------------------------------------------------------------------------


def bench_pp(rank, world, iters):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from runtime.data.source import TokenSource
    from runtime.train.engine import Engine
    from runtime.parallel.tp_layer import MicroBatch
    from tests.runtime_helpers import plan_of

    spec, m, mbs = SPEC, 4, 2
    plan = plan_of(spec, [[1], [1]], [4, 2], 1, m=m, mbs=mbs)
    engine = Engine(plan, rank, seed=0, measure=False)
    data = TokenSource(spec, seed=0, global_batch=plan.global_batch)

    class Wrapped(nn.Module):  # the same stage module, driven by torch.distributed.pipelining
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x, MicroBatch(0, 0, torch.arange(x.size(0))))

    theirs = Wrapped(engine.model)
    stage = PipelineStage(theirs, rank, world, torch.device("cpu"))
    loss_fn = lambda logits, y: F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))  # noqa: E731
    sched = Schedule1F1B(stage, n_microbatches=m, loss_fn=loss_fn)
    tokens, targets = data.batch(0, torch.arange(plan.global_batch))
    times = {"ours_1f1b": [], "torch_pipelining_1f1b": []}
    for it in range(iters + 3):
        for name in times:
            engine.model.zero_grad(set_to_none=True)
            dist.barrier()
            t0 = time.perf_counter()
            if name == "ours_1f1b":
                engine.forward_backward(0, data)
            elif rank == 0:
                sched.step(tokens)
            else:
                sched.step(target=targets, losses=[])
            dist.barrier()
            if it >= 3:
                times[name].append((time.perf_counter() - t0) * 1e3)
    return times


# --- harness ---------------------------------------------------------------------------------------


def _entry(fn, rank, world, tmp, iters):
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv-{fn.__name__}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=300))
        out = fn(rank, world, iters)
        Path(f"{tmp}/{fn.__name__}-{rank}.json").write_text(json.dumps(out))
    except BaseException:
        Path(f"{tmp}/{fn.__name__}-{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _spawn(fn, world, iters):
    tmp = tempfile.mkdtemp(prefix="baton-bench-")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_entry, args=(fn, r, world, tmp, iters)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(900)
    for r in range(world):
        err = Path(f"{tmp}/{fn.__name__}-{r}.err")
        if err.exists():
            raise SystemExit(f"rank {r} of {fn.__name__} failed:\n{err.read_text()}")
    per_rank = [json.loads(Path(f"{tmp}/{fn.__name__}-{r}.json").read_text()) for r in range(world)]
    # Per iteration, the step ends with the slowest rank.
    return {k: [max(vals) for vals in zip(*(d[k] for d in per_rank))] for k in per_rank[0]}


def _paired(times, ours, ref):
    """Median of per-iteration ratios: the runs alternate, so drifting machine load cancels out."""
    return statistics.median(a / b for a, b in zip(times[ours], times[ref]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args()
    tp_raw = _spawn(bench_tp, 2, args.iters)
    pp_raw = _spawn(bench_pp, 2, args.iters)
    tp = {k: statistics.median(v) for k, v in tp_raw.items()}
    pp = {k: statistics.median(v) for k, v in pp_raw.items()}
    result = {
        "model": SPEC.to_dict(), "iters": args.iters, "torch": torch.__version__, "machine": platform.machine(),
        "cpus": os.cpu_count(), "backend": "gloo",
        "tensor_parallel_ms": tp, "pipeline_ms": pp,
        "per_iteration_ms": {"tensor_parallel": tp_raw, "pipeline": pp_raw},
        "ratios": {
            "tp_ours_even_vs_baseline_even": _paired(tp_raw, "ours_even_2_2", "baseline_even_2_2"),
            "tp_ours_uneven_3_1_vs_baseline_even": _paired(tp_raw, "ours_uneven_3_1", "baseline_even_2_2"),
            "pp_ours_vs_torch_pipelining": _paired(pp_raw, "ours_1f1b", "torch_pipelining_1f1b"),
        },
        "targets": {"tp_ours_even_vs_baseline_even": 1.03, "pp_ours_vs_torch_pipelining": 1.0},
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "runtime.json").write_text(json.dumps(result, indent=2) + "\n")
    r = result["ratios"]
    md = [
        f"# Runtime benchmark (`python bench/bench_runtime.py --iters {args.iters}`)",
        "",
        f"Model `small` (h={SPEC.hidden_dim}, heads={SPEC.num_heads}, ffn={SPEC.ffn_dim}, seq={SPEC.seq_len}), fp32, "
        f"dropout 0, gloo, 2 CPU processes with 1 thread each, torch {torch.__version__}, {os.cpu_count()} cores. "
        "Median ms per step of the slowest rank; ratio = median of per-iteration ratios (runs alternate).",
        "",
        "| measurement | ours (ms) | reference (ms) | ratio | target |",
        "| --- | ---: | ---: | ---: | ---: |",
        f"| TP layer fwd+bwd, even 2:2, ours vs Megatron-style even layer | {tp['ours_even_2_2']:.2f} | "
        f"{tp['baseline_even_2_2']:.2f} | {r['tp_ours_even_vs_baseline_even']:.3f} | <= 1.03 |",
        f"| TP layer fwd+bwd, uneven 3:1 (slowest rank holds 1.5x the even share) | {tp['ours_uneven_3_1']:.2f} | "
        f"{tp['baseline_even_2_2']:.2f} | {r['tp_ours_uneven_3_1_vs_baseline_even']:.3f} | (info) |",
        f"| PP step, 2 stages 4+2 layers, 4 micro-batches: our 1F1B vs torch.distributed.pipelining 1F1B | "
        f"{pp['ours_1f1b']:.2f} | {pp['torch_pipelining_1f1b']:.2f} | {r['pp_ours_vs_torch_pipelining']:.3f} | <= 1.00 |",
        "",
    ]
    (RESULTS / "runtime.md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
