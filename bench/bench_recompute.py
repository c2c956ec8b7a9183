"""What a recomputed segment costs the host: Baton's segment node against ``torch.utils.checkpoint`` (issue 27).

A recomputed segment of a layer (``runtime.parallel.tp_layer``) is one autograd node, ``_Recompute``: its forward
runs the operators without autograd and keeps the segment's inputs, its backward replays them and back-propagates
through the replay. Until 2026-11-27 each segment was a non-reentrant ``torch.utils.checkpoint``, which records
the operators' graph in the forward and runs Python hooks per saved tensor. On an H200 (gpt3-350m, bf16, micro-batch
2) that made a forward with every operator recomputed 3x the plain forward (bench/results/gpu-2026-11-27.md).

This bench times, in one run and on the same engine, one-device plans of each model at three settings: nothing
recomputed, every operator recomputed through the node (``node``), and the same through the checkpoint
(``checkpoint``: ``ParallelBlock.checkpoint_segments``). The three take turns in interleaved rounds
(``bench_reference.interleave``), so drift hits each alike. The same numbers come out of both mechanisms
(tests/test_recompute_node.py); the losses here are compared too.

Models: ``host`` is 24 layers of the tiny model at sequence 16, micro-batch 1 (a step is launches, not arithmetic:
the regime of a GPU at small micro-batches); ``compute`` is the ``small`` preset at sequence 256 (arithmetic
dominates). CPU, ``--threads`` threads (default 1: steadier on a shared machine).

Run: ``python bench/bench_recompute.py [--rounds 8] [--steps 2] [--threads 1]``; writes
bench/results/recompute.json and recompute.md (``--out``).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

from baton.model_spec import PRESETS  # noqa: E402
from bench_reference import (BatonContender, build_reference, environment, host_description, interleave,  # noqa: E402
                             one_device_plan, one_rank_group, recompute_sets)

RESULTS = ROOT / "bench" / "results"
MODELS = {
    "host": dict(base="tiny", num_layers=24, seq_len=16, micro_batch_size=1, num_microbatches=4),
    "compute": dict(base="small", num_layers=None, seq_len=256, micro_batch_size=2, num_microbatches=2),
}
"""Name -> the preset, its layers (None: the preset's), sequence and micro-batches."""


class _Contender:
    """Baton's engine on one plan, its segments replayed by the node or by the checkpoint."""

    def __init__(self, plan, *, checkpoint: bool, device: torch.device, full):
        from runtime.parallel.tp_layer import ParallelBlock

        self.block_class, self.checkpoint = ParallelBlock, checkpoint
        self.baton = BatonContender(plan, device=device, full=full)

    def train_step(self, step: int, data) -> float:
        self.block_class.checkpoint_segments = self.checkpoint
        try:
            return self.baton.train_step(step, data)
        finally:
            self.block_class.checkpoint_segments = False

    def resident_bytes(self) -> int:
        return self.baton.resident_bytes()


def run_model(name: str, *, rounds: int, steps: int, warmup: int) -> dict:
    from runtime.data.source import TokenSource

    m = MODELS[name]
    base = PRESETS[m["base"]]
    spec = base.with_overrides(name=f"{m['base']}-{name}", num_layers=m["num_layers"] or base.num_layers,
                               seq_len=m["seq_len"], dtype="fp32", attention="fused", dropout=0.0)
    dev = torch.device("cpu")
    _, initial = build_reference(spec, device=dev)
    b, k = m["micro_batch_size"], m["num_microbatches"]
    data = TokenSource(spec, seed=0, global_batch=b * k)
    everything = recompute_sets(spec)["all"]
    with one_rank_group(dev):
        contenders = {"none": _Contender(one_device_plan(spec, micro_batch_size=b, num_microbatches=k), checkpoint=False,
                                         device=dev, full=initial.__getitem__)}
        for label, checkpoint in (("node", False), ("checkpoint", True)):
            plan = one_device_plan(spec, micro_batch_size=b, num_microbatches=k, recompute=everything)
            contenders[label] = _Contender(plan, checkpoint=checkpoint, device=dev, full=initial.__getitem__)
        record = interleave(contenders, data, device=dev, warmup=warmup, rounds=rounds, steps=steps)
    medians = {label: statistics.median(t for r in rec["step_ms"] for t in r) for label, rec in record.items()}
    return {"model": name, "spec": spec.to_dict(), "micro_batch_size": b, "num_microbatches": k,
            "median_ms": medians, "step_ms": {label: rec["step_ms"] for label, rec in record.items()},
            "same_losses": record["node"]["losses"] == record["checkpoint"]["losses"],
            "node_over_none": medians["node"] / medians["none"],
            "checkpoint_over_none": medians["checkpoint"] / medians["none"],
            "checkpoint_over_node": medians["checkpoint"] / medians["node"]}


def markdown(result: dict) -> str:
    env, s = result["environment"], result["settings"]
    lines = [f"# Recomputation's host cost: the segment node against torch.utils.checkpoint (`{result['command']}`)", "",
             "| model | plan | none ms | every operator recomputed, node ms | through the checkpoint ms | node / none | "
             "checkpoint / none | checkpoint / node | same losses |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in result["models"]:
        t, sp = r["median_ms"], r["spec"]
        lines.append(f"| {r['model']} ({sp['num_layers']} layers, hidden {sp['hidden_dim']}, sequence {sp['seq_len']}) | "
                     f"mb {r['micro_batch_size']} x {r['num_microbatches']} | {t['none']:.1f} | {t['node']:.1f} | "
                     f"{t['checkpoint']:.1f} | {r['node_over_none']:.2f} | {r['checkpoint_over_none']:.2f} | "
                     f"{r['checkpoint_over_node']:.2f} | {'yes' if r['same_losses'] else 'NO'} |")
    lines += ["", f"Medians over {s['rounds']} interleaved rounds of {s['steps']} steps each after {s['warmup']} warm-up "
                  f"steps; fp32, fused attention, one device. {host_description(env)}; torch {env['torch']}, load "
                  f"average {env['load_average'][0]:.2f} at the start, {env['date_utc']} UTC."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="host,compute", help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=2, help="steps of each plan per round")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in MODELS]
    if unknown or min(args.rounds, args.steps) < 1 or args.warmup < 0:
        print(f"bench_recompute: --models must name {', '.join(MODELS)} (got {', '.join(unknown) or 'none unknown'}); "
              "--rounds and --steps at least 1, --warmup at least 0", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    result = {"command": " ".join(["python bench/bench_recompute.py", *(argv if argv is not None else sys.argv[1:])]),
              "environment": environment("cpu"),
              "settings": {"rounds": args.rounds, "steps": args.steps, "warmup": args.warmup, "threads": args.threads},
              "models": []}
    for name in models:
        result["models"].append(run_model(name, rounds=args.rounds, steps=args.steps, warmup=args.warmup))
        r = result["models"][-1]
        print(f"{name}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in r["median_ms"].items())
              + f"; checkpoint / node {r['checkpoint_over_node']:.2f}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "recompute.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "recompute.md").write_text(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
