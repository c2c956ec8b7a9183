"""``baton solve``: find the fastest plan that fits, with a proven gap, or one of the baselines."""
from __future__ import annotations

import contextlib
import json
from collections import Counter
from pathlib import Path
from typing import Annotated, Optional

import typer

from baton.cli_support import say, check_output_path, console, guarded
from baton.fields import excerpt
from baton.model_spec import LIMITS as MODEL_LIMITS
from baton.plan import MAX_DEVICES, MAX_GLOBAL_BATCH, SUPPORTED_ZERO_STAGES
from baton.cluster import load_cluster
from baton.commands import render_report, say_derived
from baton.errors import BatonError
from baton.profile import ProfileSet
from baton.model_files import load_model
from baton.plan import save_plan
from solver import stop
from solver.instance import DEFAULT_SHARD_GRID

STRATEGIES = ("baton", "megatron", "hethub", "hap", "poplar", "cephalo", "exhaustive")
MAX_TIME_LIMIT_S = 7 * 24 * 3600.0


MAX_CHUNKS = 16
"""Most chunks per device group ``--max-chunks`` offers: each chunk count is one more MILP per candidate."""
STAGED = ("baton", "poplar", "exhaustive")
"""Strategies that search the sharding stage (``--zero-stage`` restricts them to one)."""


FAMILY_WORDS = {
    "exact": "exact family: every plan with these options",
    "structured": ("structured family: TP groups within one node and GPU type, a node kind's nodes all or none, "
                   "replicas of one shape, its batch splits; solver/README.md, 'Families of skeletons'"),
}
"""What a status of ``baton solve`` holds over: 'optimal' means no plan of this space is faster (issue 25: a
restriction that stays is part of the problem statement, and the output says so)."""


def _space(strategy: str, family: str) -> str:
    """The space the status holds over: the planner's family in words, a baseline's by name."""
    if strategy == "baton" and family in FAMILY_WORDS:
        return f"strategy baton; among plans of the {FAMILY_WORDS[family]}"
    return f"strategy {strategy}, {family}"


def _over_every_plan(result) -> str:
    """The gap over every plan (eq. 12b or 12c), where the family's does not already cover them all."""
    if result.strategy != "baton" or result.space_bound_ms <= 0:
        return ""
    if result.family == "exact" and result.space_bound_ms >= result.bound_ms:
        return ""  # the status already says the family is every plan
    return (f"; over every plan: gap {result.space_gap:.2%}, bound {result.space_bound_ms:.1f} ms "
            f"({result.space_bound_from})")


def run_strategy(strategy: str, spec, cluster, profiles, *, global_batch: int, micro_batch: int | None,
                 time_limit: float, gap: float, threads: int, shard_grid: int = DEFAULT_SHARD_GRID, log=None,
                 zero_stage: int | None = None, max_chunks: int = 1, offload: bool = False, offload_optimizer: bool = False):
    """Dispatch to the planner or a baseline; every result has been re-checked by baton.evaluate. ``zero_stage``
    restricts the strategies of ``STAGED`` to one sharding stage (default: every stage they search); ``max_chunks``
    > 1 offers the planner and the exhaustive search interleaved 1F1B with 2 .. max_chunks chunks per group; ``offload``
    lets them keep activations in host memory (eq. 2o-4o, 8o; the space offered, solver/README.md), and
    ``offload_optimizer`` optimizer state (eq. 7h, 10h)."""
    from solver import baselines
    from solver.search import search

    stages = SUPPORTED_ZERO_STAGES if zero_stage is None else (zero_stage,)
    if zero_stage is not None:
        if zero_stage not in SUPPORTED_ZERO_STAGES:
            raise BatonError(f"sharding stage {excerpt(str(zero_stage))} is not one of "
                             f"{', '.join(map(str, SUPPORTED_ZERO_STAGES))} (0 replicated, 1 optimizer state sharded, "
                             "2 and gradients, 3 and weights)", field="--zero-stage")
        if strategy not in STAGED:
            raise BatonError(f"strategy '{strategy}' has its own sharding stage; --zero-stage applies to "
                             f"{', '.join(STAGED)}", field="--zero-stage")
    if strategy == "baton":
        # One line per better plan on stderr: a long solve is never silent, and stdout stays the result.
        return search(spec, cluster, profiles, global_batch=global_batch, micro_batch=micro_batch, time_limit=time_limit,
                      gap=gap, threads=threads, shard_grid=shard_grid, zero_stages=stages, chunks=tuple(range(1, max_chunks + 1)),
                      offload=offload, offload_optimizer=offload_optimizer, every_plan=True,
                      log=(lambda line: say(line, err=True)) if log is None else log,
                      extra_splits=lambda sk, deadline_s: baselines.baseline_splits(
                          spec, cluster, profiles, sk, global_batch=global_batch, micro_batch=micro_batch,
                          deadline_s=deadline_s))
    if max_chunks > 1 and strategy not in ("baton", "exhaustive"):
        raise BatonError(f"strategy '{strategy}' runs 1F1B only; --max-chunks applies to baton and exhaustive", field="--max-chunks")
    if strategy == "megatron":
        return baselines.megatron(spec, cluster, profiles, global_batch=global_batch, micro_batch=micro_batch)
    if strategy == "hethub":
        return baselines.hethub(spec, cluster, profiles, global_batch=global_batch, micro_batch=micro_batch,
                                time_limit=time_limit, gap=gap, threads=threads)
    if strategy == "hap":
        return baselines.hap(spec, cluster, profiles, global_batch=global_batch, micro_batch=micro_batch, threads=threads)
    if strategy == "poplar":
        return baselines.poplar(spec, cluster, profiles, global_batch=global_batch, micro_batch=micro_batch, zero_stages=stages)
    if strategy == "cephalo":
        return baselines.cephalo(spec, cluster, profiles, global_batch=global_batch, micro_batch=micro_batch)
    if strategy == "exhaustive":
        return baselines.exhaustive(spec, cluster, profiles, global_batch=global_batch, micro_batch=micro_batch,
                                    shard_grid=shard_grid, zero_stages=stages, workers=threads, offload=offload,
                                    offload_optimizer=offload_optimizer,
                                    **({"chunks": tuple(range(1, max_chunks + 1))} if max_chunks > 1 else {}))
    raise BatonError(f"unknown strategy '{strategy}' (choose one of {', '.join(STRATEGIES)})", field="--strategy")


def register(app: typer.Typer) -> None:
    @app.command("solve")
    @guarded
    def solve_cmd(
        cluster: Annotated[Path, typer.Option("--cluster", "-c", help="Cluster spec YAML.")],
        model: Annotated[str, typer.Option("--model", "-m", help="Preset name or model YAML.")],
        global_batch: Annotated[int, typer.Option(help="Samples per iteration.")] = 64,
        micro_batch: Annotated[Optional[int], typer.Option(help="Samples per micro-batch (default: the solver chooses).")] = None,
        seq_len: Annotated[Optional[int], typer.Option(help="Sequence length (needs profiles for it; default: the model's).")] = None,
        time_limit: Annotated[float, typer.Option(help="Seconds for the whole search.")] = 60.0,
        gap: Annotated[float, typer.Option(help="Relative optimality gap at which to stop (0 = prove optimal).")] = 1e-4,
        threads: Annotated[int, typer.Option(help="Solver threads (processes for --strategy exhaustive).")] = 2,
        strategy: Annotated[str, typer.Option(help="baton | megatron | hethub | hap | poplar | cephalo | exhaustive.")] = "baton",
        shard_grid: Annotated[int, typer.Option(help="K: at sharding stage 1 a device owns a multiple of 1/K of its peer "
                                                     "group's training state (stages 1-3), or the equal part.")] = DEFAULT_SHARD_GRID,
        zero_stage: Annotated[Optional[int], typer.Option(
            "--zero-stage", help="Search only this sharding stage: 0 replicated, 1 optimizer state sharded, 2 and "
                                 "gradients, 3 and weights (2 and 3: replicas of one stage each). Default: every stage.")] = None,
        max_chunks: Annotated[int, typer.Option(
            "--max-chunks", help="Also offer interleaved 1F1B with 2 .. this many chunks of layers per device group "
                                 "(replicas of one shape, sharding stages 0 and 1 with equal parts). Default 1: 1F1B only.")] = 1,
        offload: Annotated[bool, typer.Option(
            "--offload", help="Also let devices keep each block's saved activations in host memory between the passes "
                              "(1F1B, replicas of one shape, sharding stages 0 and 1): for memory-bound clusters.")] = False,
        offload_optimizer: Annotated[bool, typer.Option(
            "--offload-optimizer", help="Also let devices keep their optimizer state in host memory and run their Adam "
                                        "step there (ZeRO-Offload's trade: memory for a slower step).")] = False,
        profiles: Annotated[Optional[Path], typer.Option(help="Directory of profile tables (default: yours, then the shipped ones).")] = None,
        out: Annotated[Optional[Path], typer.Option(help="Write the plan JSON here.")] = None,
        as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")] = False,
    ) -> None:
        """Plan the fastest training iteration that fits in every GPU's memory (three-level MILP)."""
        if strategy not in STRATEGIES:
            raise BatonError(f"unknown strategy {excerpt(strategy)} (choose one of {', '.join(STRATEGIES)})", field="--strategy")
        # Bounds (docs/errors.md, "Upper bounds"): a typo such as 10^12 samples would otherwise grow the search without end.
        if not 0 < global_batch <= MAX_GLOBAL_BATCH:
            raise BatonError(f"must be in 1..{MAX_GLOBAL_BATCH}, got {global_batch}", field="--global-batch")
        if micro_batch is not None and not 0 < micro_batch <= global_batch:
            raise BatonError(f"must be in 1..--global-batch ({global_batch}), got {micro_batch}", field="--micro-batch")
        if not 0 < time_limit <= MAX_TIME_LIMIT_S:  # also refuses nan
            raise BatonError(f"must be a number of seconds in (0, {MAX_TIME_LIMIT_S:g}], got {time_limit}", field="--time-limit")
        if not 0 <= gap < 1:
            raise BatonError("must be in [0, 1)", field="--gap")
        if not 0 < threads <= 1024:
            raise BatonError(f"must be in 1..1024, got {threads}", field="--threads")
        if not 0 < shard_grid <= 1024:
            raise BatonError(f"must be in 1..1024, got {shard_grid}", field="--shard-grid")
        if not 0 < max_chunks <= MAX_CHUNKS:
            raise BatonError(f"must be in 1..{MAX_CHUNKS}, got {max_chunks}", field="--max-chunks")
        if seq_len is not None and not 0 < seq_len <= MODEL_LIMITS["seq_len"]:
            raise BatonError(f"must be in 1..{MODEL_LIMITS['seq_len']}, got {seq_len}", field="--seq-len")
        if profiles is not None and not profiles.is_dir():
            raise BatonError("not a directory", source=str(profiles), field="--profiles")
        if out is not None:
            check_output_path(out, "--out")  # before the solve, which may take minutes
        spec = load_model(model)
        if seq_len is not None and seq_len != spec.seq_len:
            spec = spec.with_overrides(seq_len=seq_len)
        c = load_cluster(cluster)
        if len(c.devices) > MAX_DEVICES:
            raise BatonError(f"{len(c.devices)} devices, more than the {MAX_DEVICES} Baton plans for", source=str(cluster), field="nodes")
        profile_set = ProfileSet(spec, directory=profiles, derive_missing=say_derived)
        for g in c.gpu_types:  # fail early, one line, naming the missing table; or derive it now
            prof = profile_set[g]
            if prof.seq_len != spec.seq_len:
                raise BatonError(f"the profile is for seq_len {prof.seq_len}, not {spec.seq_len}", source=prof.source, field="--seq-len")
        # Ctrl-C stops the search as its time limit would, keeping the best plan so far (solver/stop.py); a second
        # one aborts. Not for the exhaustive search, whose worker processes get the same Ctrl-C.
        graceful = stop.on_interrupt("stopping: the best plan so far follows (Ctrl-C again to abort)")
        with graceful if strategy != "exhaustive" else contextlib.nullcontext():
            result = run_strategy(strategy, spec, c, profile_set, global_batch=global_batch, micro_batch=micro_batch,
                                  time_limit=time_limit, gap=gap, threads=threads, shard_grid=shard_grid,
                                  zero_stage=zero_stage, max_chunks=max_chunks, offload=offload,
                                  offload_optimizer=offload_optimizer)
        if out is not None:
            save_plan(result.plan, out)
        rep = result.report
        if as_json:
            print(json.dumps({"plan": result.plan.to_dict(), "solver": result.info(), "report": rep.to_dict()}, indent=2))
            return
        plan = result.plan
        batches = [plan.batch(i) for i in range(len(plan.pipelines))]
        split = (f"micro-batch {plan.micro_batch_size} x {plan.num_microbatches}" if plan.uniform_batches else
                 "batches " + ", ".join(f"{n} x {b}x{m}" for (b, m), n in Counter(batches).items()))
        render_report(rep, title=f"{strategy}: {spec.name} on {c.name}: {plan.global_batch} samples x {spec.seq_len} tokens, "
                                 f"{split}, sharding stage {plan.zero_stage}")
        units = {d.id: (d.units, s.units_per_layer) for p in result.plan.pipelines for s in p.stages for d in s.devices}
        if len(units) <= 16:
            say("units: " + "  ".join(f"{k} {u}/{U}" for k, (u, U) in units.items()))
        else:  # hundreds of devices: how many hold each share, not a line per device
            counts = Counter(f"{u}/{U}" for u, U in units.values())
            say("units: " + "  ".join(f"{n} devices at {share}" for share, n in counts.most_common()))
        ratios = {d.id: d.shard_ratio for p in plan.pipelines for s in p.stages for d in s.devices if d.shard_ratio is not None}
        if ratios and len(ratios) <= 16:
            say("shard ratios: " + "  ".join(f"{k} {r:g}" for k, r in ratios.items()))
        elif plan.zero_stage:
            say("shard ratios: " + ("equal parts" if not ratios else f"{len(ratios)} devices with their own ratio"))
        console.print(
            f"solver: [bold]{result.status}[/] ({_space(strategy, result.family)}), proven gap {result.gap:.3%}, "
            f"bound {result.bound_ms:.1f} ms{_over_every_plan(result)}, build {result.build_s:.2f} s, solve {result.solve_s:.2f} s, total {result.total_s:.2f} s, "
            f"{result.candidates} candidates, {result.solved} MILPs, {result.pruned} pruned by bound", highlight=False)
        if out is not None:
            say(f"wrote {out}")  # the user's path, printed literally
