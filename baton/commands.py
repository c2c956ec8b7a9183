"""Subcommands of the planning core: ``evaluate``, ``profile`` and ``show``.

``profile --analytic`` is derived here; ``profile --device`` measures the runtime's own layer, so the
runtime installs that branch (``set_profile_measurer``) and this package imports nothing from it.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table
from rich.text import Text

from baton.catalog import CATALOG, GIB, gpu_type
from baton.cli_support import check_output_path, console, guarded, say
from baton.cluster import load_cluster
from baton.errors import BatonError
from baton.fields import excerpt, load_yaml
from baton.file_kinds import kind_of
from baton.evaluate import PlanReport, evaluate
from baton.profile import ProfileSet
from baton.model_files import load_model
from baton.model_spec import PRESETS, split_profile_name
from baton.plan import load_plan
from baton.profile import (DEFAULT_MICRO_BATCHES, calibrate, calibration_summary, derive_table, profiles_dir, read_table,
                           user_derived_path, write_table)

SHARDED = {1: "optimizer state", 2: "optimizer state and gradients", 3: "optimizer state, gradients and weights"}
"""What each sharding stage splits between the devices that hold the same parameters."""


def _gib(x: float) -> str:
    return f"{x / GIB:.2f}"


MAX_DEVICE_ROWS = 48
"""Beyond this many devices the device table prints one row per set of devices that print alike."""


def render_report(report: PlanReport, *, title: str) -> None:
    """Rich tables of stages and devices, then the headline figures.

    Device ids, cluster and model names come from the user's files: every such cell and the title are
    ``Text`` (printed literally), so a node named ``n[red]`` shows as written and ``[/x]`` cannot crash
    the printer. Only our own fixed strings carry markup.
    """
    stages = Table(title=Text(title), show_lines=False)
    for col in ("replica", "stage", "devices", "layers", "F ms", "B ms", "TP all-reduce ms", "send ms"):
        stages.add_column(col, justify="right" if "ms" in col or col in ("replica", "stage") else "left")
    grouped_stages = len(report.stages) > MAX_DEVICE_ROWS
    stage_rows: dict[tuple, tuple[tuple, list]] = {}
    for s in report.stages:
        cells = (str(s.index), f"{s.first_layer}-{s.first_layer + s.num_layers - 1}" if s.num_layers else "-",
                 f"{s.fwd_ms:.2f}", f"{s.bwd_ms:.2f}", f"{s.allreduce_ms:.2f}", f"{s.send_fwd_ms:.2f}")
        key = (len(s.devices), *cells) if grouped_stages else (s.pipeline, s.index)
        stage_rows.setdefault(key, (cells, []))[1].append(s)
    for cells, members in stage_rows.values():
        first = members[0]
        label = str(first.pipeline) if len(members) == 1 else f"{first.pipeline} (+{len(members) - 1} alike)"
        stages.add_row(label, cells[0], Text(" ".join(first.devices)), *cells[1:])
    console.print(stages)
    if len(report.replica_pipeline_ms) > 1 or report.zero_stage:
        reps = Table(show_lines=False)
        for col in ("replica", "devices", "stages", "micro-batch", "micro-batches", "samples", "pipeline ms"):
            reps.add_column(col, justify="right")
        alike: dict[tuple, tuple[tuple, list[int]]] = {}
        for r, ms in enumerate(report.replica_pipeline_ms):
            mine = [d for d in report.devices if d.pipeline == r]
            b = mine[0].micro_batch_size
            cells = (str(len(mine)), str(1 + max(d.stage for d in mine)), str(b), str(report.replica_samples[r] // b),
                     str(report.replica_samples[r]), f"{ms:.1f}")
            key = cells if len(report.replica_pipeline_ms) > MAX_DEVICE_ROWS else (r,)
            alike.setdefault(key, (cells, []))[1].append(r)
        for cells, members in alike.values():
            label = str(members[0]) if len(members) == 1 else f"{members[0]} (+{len(members) - 1} alike)"
            reps.add_row(label, *cells)
        console.print(reps)
    devs = Table(show_lines=False)
    for col in ("device", "gpu", "stage", "units", "recompute", "fwd ms", "bwd ms", "recomp ms", "weights+grads+opt GiB",
                "activations GiB", *(("state owned",) if report.zero_stage else ()), "peak / capacity GiB", "fits"):
        devs.add_column(col, justify="left" if col in ("device", "gpu", "recompute") else "right",
                        overflow="fold" if col == "recompute" else "ellipsis")
    multi = len({d.pipeline for d in report.devices}) > 1
    rows: dict[tuple, tuple[tuple, list[str]]] = {}
    for d in report.devices:
        static = d.weights_bytes + d.grads_bytes + d.optimizer_bytes
        grouped = len(report.devices) > MAX_DEVICE_ROWS
        cells = (d.gpu, f"r{d.pipeline}.s{d.stage}" if multi and not grouped else str(d.stage), str(d.units), ",".join(d.recompute) or "-",
                 f"{d.fwd_ms:.2f}", f"{d.bwd_ms:.2f}", f"{d.recompute_ms:.2f}", _gib(static),
                 _gib(d.activation_bytes + d.transient_bytes), *((f"{d.owned_fraction:.0%}",) if report.zero_stage else ()),
                 f"{_gib(d.peak_memory_bytes)} / {_gib(d.capacity_bytes)}", d.fits)
        # On large clusters devices that print alike share a row (one row per device is unreadable at 1,024).
        rows.setdefault(cells if grouped else (d.id,), (cells, []))[1].append(d.id)
    for cells, ids in rows.values():
        name = ids[0] if len(ids) == 1 else f"{ids[0]} (+{len(ids) - 1} alike)"
        devs.add_row(Text(name), Text(cells[0]), cells[1], cells[2], Text(cells[3]), *cells[4:-1],
                     "[green]yes[/]" if cells[-1] else "[bold red]NO[/]")
    console.print(devs)
    _render_host_memory(report)
    console.print(
        f"iteration [bold]{report.iteration_time_ms:.1f} ms[/] ({'compute and waits, layer by layer' if report.zero_stage >= 2 else 'pipeline'} "
        f"{report.pipeline_ms:.1f}"
        + (f" with {report.arrival_wait_ms:.1f} waiting for the last replica" if report.arrival_wait_ms > 0 else "")
        + ", embedding sync "
        f"{report.embedding_sync_ms:.1f}, data-parallel sync {report.dp_sync_ms:.1f}, optimizer {report.optimizer_ms:.1f})  "
        + (f"{SHARDED[report.zero_stage]} sharded (stage {report.zero_stage})  " if report.zero_stage else "") +
        f"throughput [bold]{report.tokens_per_s:,.0f} tokens/s[/]  MFU {report.mfu:.1%}  "
        f"efficiency vs ideal [bold]{report.efficiency_vs_ideal:.1%}[/] (ideal {report.ideal_tokens_per_s:,.0f} tokens/s)",
        highlight=False)


@dataclass(frozen=True, kw_only=True, slots=True)
class MeasureRequest:
    """What ``baton profile --device`` asks the measurer for; options only it understands arrive unparsed."""

    model: str
    """Preset or model YAML."""
    device: str
    """As typed: cpu, cuda or cuda:N (checked by the measurer)."""
    gpu: str | None
    """Catalog GPU type to record in the table, or None to let the measurer name the device."""
    seq_len: int | None
    """Sequence length, or None for the model's."""
    micro_batches: tuple[int, ...]
    """Micro-batch sizes to tabulate (positive)."""
    tp_shares: str | None
    """Comma-separated tensor-parallel shares, or None for the whole layer."""
    warmup: int
    """Untimed repetitions before measuring."""
    reps: int
    """Timed repetitions; the median is kept."""
    threads: int | None
    """torch threads while measuring on CPU, or None to leave torch's default."""
    comm: bool
    """Also measure all-reduce and send/receive and fit a link."""
    comm_ranks: int
    """Processes for ``comm``."""
    concurrent: int
    """Profilers running at once, as training loads the machine."""
    out: Path | None
    """Output CSV, or None for the default path under profiles/measured/."""
    back_to_back: bool = False
    """Time each layer, embedding and head in pieces of repetitions run one after another (``runtime.measure.op_profiler.measure``)."""
    compile: bool = False
    """Time the layers compiled, as ``baton train --compile`` runs them."""


_measure_profile: Callable[[MeasureRequest], None] | None = None
_measure_link_between: Callable[..., None] | None = None


def set_profile_measurer(measure: Callable[[MeasureRequest], None]) -> None:
    """Make ``baton profile --device`` call ``measure``; the runtime does this when it registers its
    commands (the planning core sits below the runtime and must not import it: tests/test_layering.py)."""
    global _measure_profile
    _measure_profile = measure


def set_link_measurer(measure: Callable[..., None]) -> None:
    """Make ``baton profile --comm --peer`` call ``measure(peer=, peer_rank=, interface=, out=)`` (the runtime's)."""
    global _measure_link_between
    _measure_link_between = measure


def evaluate_cmd(
    plan: Annotated[Path, typer.Argument(help="Plan JSON (from 'baton solve --out' or written by hand).")],
    cluster: Annotated[Path, typer.Option("--cluster", "-c", help="Cluster spec YAML.")],
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="Preset or model YAML; must match the plan's model.")] = None,
    profiles: Annotated[Optional[Path], typer.Option(help="Directory of profile tables (default: yours, then the shipped ones).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")] = False,
) -> None:
    """Predict iteration time, throughput and per-device memory of a plan, independently of any solver."""
    p = load_plan(plan)
    if model is not None:
        spec = load_model(model)
        mine, planned = spec.to_dict(), p.model.to_dict()
        if mine != planned:
            differ = ", ".join(f"{k} {excerpt(planned.get(k))} vs {excerpt(mine.get(k))}" for k in mine if mine[k] != planned.get(k))
            raise BatonError(f"the plan was made for model '{p.model.name}', not '{spec.name}' ({differ})",
                             source=str(plan), field="model")
    c = load_cluster(cluster)
    report = evaluate(p, c, ProfileSet(p.model, directory=profiles, derive_missing=say_derived), plan_source=str(plan))
    if as_json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        render_report(report, title=f"{p.model.name} on {c.name}: {p.global_batch} samples x {p.model.seq_len} tokens")
    if not report.fits:
        raise typer.Exit(1)


def _render_host_memory(report: PlanReport) -> None:
    """What each device keeps in host memory (eq. 8o, 7h), and each node's total against its capacity."""
    for d in report.devices:
        if d.offload:
            console.print(f"{d.id} keeps {', '.join(d.offload)} in host memory: {_gib(d.host_activation_bytes)} GiB at its peak, "
                          f"copies adding {d.offload_ms:.2f} ms per micro-batch beyond the compute they overlap", highlight=False)
        if d.offload_optimizer:
            console.print(f"{d.id} keeps its optimizer state in host memory ({_gib(d.host_optimizer_bytes)} GiB) and steps "
                          f"it there: {d.optimizer_ms:.2f} ms", highlight=False)
    for h in report.host_memory:
        room = "no host_memory_gib given" if h.capacity_bytes is None else f"of {_gib(h.capacity_bytes)} GiB"
        what = f"{_gib(h.activation_bytes)} GiB of offloaded activations" + (
            f" and {_gib(h.optimizer_bytes)} GiB of optimizer state" if h.optimizer_bytes else "")
        console.print(f"node {h.node}: {what} in host memory ({room})"
                      + ("" if h.fits else " [bold red]does not fit[/]"), highlight=False)


def profile_cmd(
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="Preset, model YAML, or 'all' presets (with --analytic); "
                                                                     "not with --peer.")] = None,
    analytic: Annotated[bool, typer.Option("--analytic", help="Derive the table from the GPU catalog (roofline).")] = False,
    device: Annotated[Optional[str], typer.Option(help="Measure on this device: cpu, cuda or cuda:N.")] = None,
    gpu: Annotated[Optional[str], typer.Option(help="Catalog GPU type ('all' with --analytic); with --device, the type to record.")] = None,
    seq_len: Annotated[Optional[int], typer.Option(help="Sequence length (default: the model's).")] = None,
    micro_batch: Annotated[Optional[list[int]], typer.Option(help="Micro-batch sizes to tabulate (repeatable).")] = None,
    tp_shares: Annotated[Optional[str], typer.Option(help="Comma-separated TP shares to measure, e.g. 0.25,0.5,1.")] = None,
    warmup: Annotated[int, typer.Option(help="Untimed repetitions before measuring.")] = 2,
    reps: Annotated[int, typer.Option(help="Timed repetitions; the median is kept.")] = 7,
    threads: Annotated[Optional[int], typer.Option(help="torch threads while measuring on CPU.")] = None,
    comm: Annotated[bool, typer.Option("--comm", help="Also measure all-reduce and send/receive and fit a link.")] = False,
    comm_ranks: Annotated[int, typer.Option(help="Processes for --comm.")] = 2,
    concurrent: Annotated[int, typer.Option(help="Profile on this many cores (CPU, with BATON_PIN_CPUS=1) or GPUs at once, "
                                                 "as training loads them; times are the median over them.")] = 1,
    back_to_back: Annotated[bool, typer.Option("--back-to-back", help="Time each layer, embedding and head in pieces of "
                                               "repetitions run one after another, not one from an idle device: on a GPU "
                                               "the launches then overlap the kernels, as in a training step.")] = False,
    calibrate_from: Annotated[Optional[Path], typer.Option(help="With --analytic: scale by a measured table of a similar device.")] = None,
    compile: Annotated[bool, typer.Option("--compile", help="With --device: time the layers compiled (torch.compile), as "
                                                            "`baton train --compile` runs them; recorded in "
                                                            "<table>.settings.json.")] = False,
    out: Annotated[Optional[Path], typer.Option(help="Output CSV (default: <derived|measured>/<gpu>__<model>__s<seq>.csv in your "
                                                     "profile directory: $BATON_PROFILES, else e.g. ~/.local/share/baton/profiles); "
                                                     "with --peer, the link YAML.")] = None,
    peer: Annotated[Optional[str], typer.Option(help="With --comm: measure the link between this machine and another, "
                                                     "one process each, meeting at HOST:PORT (the address of the machine "
                                                     "with --peer-rank 0, run on both).")] = None,
    peer_rank: Annotated[int, typer.Option(help="With --peer: 0 on the machine at HOST, 1 on the other.")] = 0,
    interface: Annotated[Optional[str], typer.Option(help="With --peer: the network interface to talk through (e.g. eth0).")] = None,
) -> None:
    """Write operator-level profile tables: derived from the catalog, or measured on this machine."""
    if peer is not None:
        if not comm or model is not None or device is not None or analytic:
            raise BatonError("--peer measures only the link between two machines: give it with --comm and without "
                             "--model, --device or --analytic", field="--peer")
        if _measure_link_between is None:
            raise BatonError("measuring needs Baton's runtime, which has not registered its commands", field="--peer")
        _measure_link_between(peer=peer, peer_rank=peer_rank, interface=interface, out=out)
        return
    if model is None:
        raise BatonError("missing: give --model (or --comm --peer to measure a link between machines)", field="--model")
    if analytic == (device is not None):
        raise BatonError("choose exactly one of --analytic (derive from the catalog) or --device (measure here)", field="--device")
    mbs = tuple(micro_batch) if micro_batch else (DEFAULT_MICRO_BATCHES if analytic else (1, 2))
    if any(b <= 0 for b in mbs):
        raise BatonError("micro-batch sizes must be positive", field="--micro-batch")
    if seq_len is not None and seq_len <= 0:
        raise BatonError("must be positive", field="--seq-len")
    if analytic:
        if compile:
            raise BatonError("a derived table has no compiled layers to time; --compile applies to --device", field="--compile")
        _derive(model, gpu, seq_len, mbs, calibrate_from, out)
    else:
        if _measure_profile is None:
            raise BatonError("measuring needs Baton's runtime, which has not registered its commands", field="--device")
        if model != "all" and load_model(model).tf32:
            # The profiler times matmuls as PyTorch does by default (no TF32); its table would be filed
            # under the model's plain name and then never be found for this model.
            raise BatonError(f"model '{load_model(model).name}' sets tf32: true, which the profiler does not apply; measure it "
                             "with tf32: false, or derive its tables with --analytic", field="--model")
        _measure_profile(MeasureRequest(model=model, device=device, gpu=gpu, seq_len=seq_len, micro_batches=mbs,
                                        tp_shares=tp_shares, warmup=warmup, reps=reps, threads=threads, comm=comm,
                                        comm_ranks=comm_ranks, concurrent=concurrent, out=out, back_to_back=back_to_back,
                                        compile=compile))


def show_cmd(
    what: Annotated[str, typer.Argument(help="'gpus', 'models', a cluster YAML, a model preset/YAML, or a plan JSON.")],
    cluster: Annotated[Optional[Path], typer.Option("--cluster", "-c", help="With a plan: the cluster spec YAML it runs on.")] = None,
    profiles: Annotated[Optional[Path], typer.Option(help="With a plan: directory of profile tables.")] = None,
    timeline: Annotated[Optional[Path], typer.Option(help="With a plan: draw its predicted 1F1B timeline into this PNG.")] = None,
    memory: Annotated[Optional[Path], typer.Option(help="With a plan: draw its predicted memory per device into this PNG.")] = None,
) -> None:
    """Show the GPU catalog, the model presets, a cluster, a model, or a plan (with pictures)."""
    if what.endswith(".json") or timeline is not None or memory is not None:
        _show_plan(Path(what), cluster, profiles, timeline, memory)
    elif what == "gpus":
        t = Table(title="GPU catalog")
        for col in ("type", "memory GiB", "fp16 TFLOPS", "bf16 TFLOPS", "fp32 TFLOPS", "GB/s", "source"):
            t.add_column(col)
        for g in CATALOG.values():
            t.add_row(g.name, f"{g.memory_bytes / GIB:g}", f"{g.peak_fp16_tflops:g}",
                      "-" if g.peak_bf16_tflops is None else f"{g.peak_bf16_tflops:g}", f"{g.peak_fp32_tflops:g}",
                      f"{g.memory_bandwidth_gb_per_s:g}", g.note)
        console.print(t)
        _show_achievable()
    elif what == "models":
        t = Table(title="Model presets")
        for col in ("name", "arch", "layers", "hidden", "heads", "kv heads", "ffn", "seq", "vocab", "head", "dtype", "params"):
            t.add_column(col)
        for m in PRESETS.values():
            t.add_row(m.name, m.architecture, str(m.num_layers), str(m.hidden_dim), str(m.num_heads), str(m.kv_heads),
                      str(m.ffn_dim), str(m.seq_len), str(m.vocab_size), "tied" if m.tie_embeddings else "untied", m.dtype,
                      f"{m.num_params() / 1e6:,.1f}M")
        console.print(t)
    elif _file_kind(what) == "cluster":
        c = load_cluster(what)
        t = Table(title=Text(f"cluster {c.name} ({len(c.devices)} devices)"))
        for col in ("device", "gpu", "memory GiB", "reserve GiB"):
            t.add_column(col)
        for d in c.devices:
            t.add_row(Text(d.id), d.gpu.name, f"{d.memory_bytes / GIB:g}", f"{d.reserve_bytes / GIB:g}")
        console.print(t)
    else:
        m = load_model(what)
        console.print_json(json.dumps({**m.to_dict(), "num_params": m.num_params()}))


def register(app: typer.Typer) -> None:
    app.command("evaluate")(guarded(evaluate_cmd))
    app.command("profile")(guarded(profile_cmd))
    app.command("show")(guarded(show_cmd))


def _show_plan(plan_path: Path, cluster: Path | None, profiles: Path | None, timeline: Path | None, memory: Path | None) -> None:
    """The plan's prediction as tables, and as pictures when asked (baton/pictures.py)."""
    if not plan_path.name.endswith(".json"):
        raise BatonError("--timeline and --memory draw a plan: give a plan JSON", source=str(plan_path), field="--timeline"
                         if timeline is not None else "--memory")
    if cluster is None:
        raise BatonError("showing a plan needs --cluster (the cluster YAML it runs on)", field="--cluster")
    for path, flag in ((timeline, "--timeline"), (memory, "--memory")):
        if path is not None:
            check_output_path(path, flag)
    p = load_plan(plan_path)
    c = load_cluster(cluster)
    report = evaluate(p, c, ProfileSet(p.model, directory=profiles, derive_missing=say_derived), plan_source=str(plan_path))
    title = f"{p.model.name} on {c.name}: {p.global_batch} samples x {p.model.seq_len} tokens"
    render_report(report, title=title)
    if timeline is None and memory is None:
        return
    from baton import pictures  # matplotlib only when a picture is asked for

    where = f"{plan_path.name} on {c.name}"
    if timeline is not None:
        kind = "interleaved 1F1B" if any(pipe.chunks > 1 for pipe in p.pipelines) else "1F1B"
        pictures.save_figure(pictures.timeline_figure(report, p.num_microbatches, title=f"predicted {kind} timeline: {where}, "
                             f"{p.num_microbatches} micro-batch(es) of {p.micro_batch_size}"), timeline)
        say(f"wrote {timeline}")
    if memory is not None:
        pictures.save_figure(pictures.memory_figure(report, title=f"predicted memory per device: {where}"), memory)
        say(f"wrote {memory}")


def _file_kind(what: str) -> str:
    """'cluster' or 'model' for what ``baton show`` was given that is neither a plan JSON nor a word it
    knows: a preset, or a YAML file told by its fields (``baton.file_kinds``); a plan written as YAML is
    refused here, in one line. A file of no clear kind goes to the model reader, whose error names it."""
    path = Path(what)
    if what in PRESETS or not (path.suffix in (".yaml", ".yml") or path.is_file()):
        return "model"
    kind = kind_of(load_yaml(path)) or "model"
    if kind == "plan":
        raise BatonError("this is a plan, and plans are read as JSON: save it as .json and show it with --cluster "
                         "(the cluster YAML it runs on)", source=what)
    return kind


def say_derived(line: str) -> None:
    """Where ``solve``, ``evaluate`` and ``show`` report a profile table they derived because none was found:
    stderr, so ``--json`` output stays one JSON object."""
    say(line, err=True)


def _show_achievable() -> None:
    """What the derivation uses of each GPU (peaks x generation fractions x sustained clock), with sources."""
    from baton.catalog import ARCHITECTURES

    t = Table(title="Achievable rates the analytic profiles use (docs/cost-model.md, section 11)")
    for col in ("type", "arch", "clock", "fp32 GEMM", "TF32 GEMM", "fp16 GEMM", "bf16 GEMM", "GB/s", "clock source"):
        t.add_column(col)
    for g in CATALOG.values():
        t.add_row(g.name, g.arch, f"{g.clock_fraction:g}", f"{g.matmul_tflops('fp32'):.1f}",
                  "-" if g.peak_tf32_tflops is None else f"{g.matmul_tflops('fp32', tf32=True):.1f}",
                  f"{g.matmul_tflops('fp16'):.1f}", "-" if g.peak_bf16_tflops is None else f"{g.matmul_tflops('bf16'):.1f}",
                  f"{g.achievable_bandwidth_gb_per_s():.0f}", g.clock_source)
    console.print(t)
    a = Table(title="Per-generation fractions and fixed costs, with sources")
    for col in ("arch", "fp32 issue", "SGEMM", "tensor GEMM", "TF32 GEMM", "DRAM", "launch us", "small op us", "sources"):
        a.add_column(col, overflow="fold")
    for x in ARCHITECTURES.values():
        a.add_row(x.name, f"{x.fp32_issue:g}", f"{x.gemm_fp32:g}", f"{x.gemm_tensor:g}", f"{x.gemm_tf32:g}", f"{x.bandwidth:g}",
                  f"{x.launch_us:g}", f"{x.small_op_us:g}", "; ".join(f"{k}: {v}" for k, v in x.sources.items()))
    console.print(a)


def _derive(model, gpu, seq_len, mbs, calibrate_from, out) -> None:
    if gpu is None:
        raise BatonError("missing --gpu (a catalog GPU type or 'all')", field="--gpu")
    gpus = list(CATALOG) if gpu == "all" else [gpu_type(gpu, field="--gpu").name]
    specs = list(PRESETS.values()) if model == "all" else [load_model(model)]
    if out is not None and len(gpus) * len(specs) > 1:
        raise BatonError("--out names one file; use it with one GPU and one model", field="--out")
    if out is not None:
        check_output_path(out, "--out")
    measured = measured_tf32 = None
    if calibrate_from is not None:
        measured = read_table(calibrate_from)
        measured_names = {split_profile_name(m) for m in set(measured["model"])}
        measured_tf32 = next(iter(measured_names))[1] if len(measured_names) == 1 else None
    target_dir = profiles_dir() / "derived"
    written = 0
    for spec in specs:
        for g in gpus:
            gt = CATALOG[g]
            if spec.dtype == "bf16" and gt.peak_bf16_tflops is None and gpu == "all":
                continue
            s = seq_len or spec.seq_len
            df = derive_table(spec, gt, micro_batches=mbs, seq_len=s)
            if measured is not None:
                if measured_names != {(spec.name, measured_tf32)} or set(measured["seq_len"]) != {s}:
                    raise BatonError(f"measured for model {sorted(set(measured['model']))}, not '{spec.name}' at seq_len {s}",
                                     source=str(calibrate_from), field="model")
                src_gpu = gpu_type(str(measured["gpu"].iloc[0]), source=str(calibrate_from), field="gpu")
                # The measured device's derivation takes the measurement's own TF32 setting (its model column),
                # so the ratios compare like with like; the target keeps the spec's.
                df = calibrate(df, measured, derive_table(spec, src_gpu, micro_batches=tuple(sorted(set(measured["micro_batch"]))),
                                                          shares=tuple(sorted(set(measured["tp_share"]))), seq_len=s,
                                                          tf32=measured_tf32))
                say(f"{g}: {calibration_summary(df)}")
            path = out or user_derived_path(g, spec, s)
            write_table(df, path)
            written += 1
            if len(gpus) * len(specs) == 1:
                say(f"wrote {len(df)} rows to {path}")  # the user's path, printed literally
    if written > 1:
        say(f"wrote {written} tables under {target_dir}")  # a path of the user's, printed literally
