"""``baton profile --device``: measured operator tables (and with ``--comm`` a link fit) on this machine.

Tables are measured in the model's dtype, as ``baton train`` runs it (``runtime.train.precision``): bf16 runs on
CPUs and GPUs, fp16 on GPUs only (CPUs do not train in it), and the optimizer row times the runtime's
own step (fp32 master weights for fp16/bf16). Each layer is timed as a training iteration runs it, with the
host's time to launch it beside (``runtime.measure.op_profiler.time_in_step``; eq. 2h of docs/cost-model.md).

With ``--compile`` the layers are timed compiled, as ``baton train --compile`` runs them
(``runtime.measure.op_profiler``). Whether a table was is recorded beside it, in ``<table>.settings.json``
(``{"compile": true, "torch": "2.13.0"}``; a measured table without one was timed uncompiled), and ``baton train``
says in one line when its --compile differs from the tables its plan's prediction reads (``compile_mismatch``).

The ``profile`` command itself belongs to the planning core, which derives tables from the catalog
(``--analytic``); measuring runs the runtime's own layer, so the runtime hands the core this branch
when it registers its commands (``register``), and ``baton/`` never imports the runtime.
"""
from __future__ import annotations

import json
from pathlib import Path

from baton.atomic import write_atomically
from baton.catalog import gpu_type
from baton.cli_support import console, say
from baton.commands import MeasureRequest, set_profile_measurer
from baton.errors import BatonError
from baton.model_files import load_model
from baton.profile import profiles_dir, table_filename, write_table


SETTINGS_SUFFIX = ".settings.json"
"""Beside a measured table ``<name>.csv``: ``<name>.settings.json``, how its layers were run."""


def settings_path(table: str | Path) -> Path:
    return Path(table).with_suffix(SETTINGS_SUFFIX)


def table_compiled(table: str | Path) -> bool:
    """Whether the measured table at ``table`` was timed with compiled layers (no settings beside it: no, it predates
    them; unreadable settings: no)."""
    path = settings_path(table)
    try:
        return bool(json.loads(path.read_text()).get("compile", False))
    except (OSError, ValueError, AttributeError):
        return False


def compile_mismatch(plan, compile: bool, cluster_path=None, profiles_dir=None) -> str | None:
    """One line when a measured table that predicts ``plan`` was timed otherwise than ``compile`` says the run goes
    (None when they agree, or when nothing is measured: derived tables know nothing of compilation). A cluster or
    table that cannot be found is the pre-flight check's to report, not this note's."""
    from runtime.launch.devices import prediction_profiles, resolve_cluster

    try:
        cluster, _ = resolve_cluster(plan, cluster_path)
        tables = prediction_profiles(plan, cluster, profiles_dir)
        gpus = sorted({cluster.device(i).gpu.name for i in plan.device_ids()})
        measured = [tables[g] for g in gpus if tables[g].measured and Path(tables[g].source).is_file()]
    except BatonError:
        return None
    other = [t for t in measured if table_compiled(t.source) != compile]
    if not other:
        return None
    how = "without --compile" if compile else "with --compile"
    run = "compiled" if compile else "uncompiled"
    return (f"--compile: the prediction reads {other[0].source}, profiled {how}; this run's layers are {run}, so measured "
            f"and predicted times differ by that too (profile again with the same setting)")


def register() -> None:
    """Install ``measure`` as the ``--device`` branch of ``baton profile``."""
    set_profile_measurer(measure)


def measure(req: MeasureRequest) -> None:
    """Check the options only measuring uses, write the measured table, then the link fit if asked."""
    # torch and the profilers load here, not at import: every baton command imports this module.
    import torch
    from rich.progress import Progress

    from runtime.measure.op_profiler import profile_table
    from runtime.train.precision import cpu_runs_natively, emulation_note

    compile = req.compile
    spec = load_model(req.model)
    if req.seq_len:
        spec = spec.with_overrides(seq_len=req.seq_len)
    try:
        shares = tuple(float(x) for x in req.tp_shares.split(",")) if req.tp_shares else (1.0,)
    except ValueError:
        raise BatonError(f"expected comma-separated numbers, got '{req.tp_shares}'", field="--tp-shares") from None
    if any(not 0 < s <= 1 for s in shares):
        raise BatonError("shares must be in (0, 1]", field="--tp-shares")
    if req.warmup < 0 or req.reps < 1:
        raise BatonError("need --warmup >= 0 and --reps >= 1", field="--reps")
    dev = req.device.lower()
    if not (dev == "cpu" or dev == "cuda" or (dev.startswith("cuda:") and dev[5:].isdigit())):
        raise BatonError(f"unknown device '{req.device}' (expected cpu, cuda or cuda:N)", field="--device")
    if req.threads:
        torch.set_num_threads(req.threads)
    name = gpu_type(req.gpu, field="--gpu").name if req.gpu else None
    slow = emulation_note(spec.dtype, dev.partition(":")[0], cpu_runs_natively(spec.dtype))
    if slow:
        say(f"note: {slow}", err=True)
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task(f"profiling {spec.name} on {req.device}", total=None)
        df = profile_table(spec, device=dev, micro_batches=req.micro_batches, shares=shares, warmup=req.warmup,
                           reps=req.reps, gpu_name=name, concurrent=req.concurrent, back_to_back=req.back_to_back,
                           compile=compile, progress=lambda done, total: bar.update(task, completed=done, total=total))
    gpu_name = str(df["gpu"].iloc[0])
    path = req.out or profiles_dir() / "measured" / table_filename(gpu_name, spec.name, spec.seq_len)
    write_table(df, path)
    write_atomically(settings_path(path), json.dumps({"compile": compile, "torch": torch.__version__}, indent=2) + "\n")
    say(f"wrote {len(df)} measured rows to {path} "
                  f"({spec.dtype} as the model trains, torch {torch.__version__}, "
                  + (f"{req.concurrent} profilers at once, one thread each" if req.concurrent > 1
                     else f"{torch.get_num_threads()} threads")
                  + f", median of {req.reps} after {req.warmup} warm-up"
                  + (", layers compiled" if compile else "")
                  + ", layers timed in a step with the host's launch times beside"
                  + ("; embedding and head back to back in pieces)" if req.back_to_back else ")"))
    if req.comm:
        _measure_link(spec, dev, req.micro_batches, req.comm_ranks, path)


def _measure_link(spec, dev: str, mbs: tuple[int, ...], comm_ranks: int, table_path: Path) -> None:
    """Fit the link between ``comm_ranks`` local processes; written next to the table it belongs to."""
    from runtime.measure.comm_profiler import measure_links

    backend = "nccl" if dev.startswith("cuda") else "gloo"
    # Two sizes at least, so the in-layer all-reduces get a line of their own.
    layer_mbs = tuple(sorted(mbs)) if len(set(mbs)) > 1 else (mbs[0], 2 * mbs[0])
    fit = measure_links(backend=backend, world_size=comm_ranks, spec=spec, micro_batches=layer_mbs)
    link_path = Path(str(table_path).removesuffix(".csv") + ".link.yaml")
    write_atomically(link_path, fit.yaml_block())
    write_atomically(link_path.with_suffix(".json"), json.dumps(fit.to_dict(), indent=2))
    say(f"link over {backend}: {fit.bandwidth_gb_per_s:.2f} GB/s, {fit.latency_us:.0f} us per message "
                  f"(all-reduce implies {fit.allreduce_bandwidth_gb_per_s:.2f} GB/s"
                  + (f", inside the TP layer {fit.tp_allreduce_bandwidth_gb_per_s:.2f} GB/s and "
                     f"{fit.tp_allreduce_latency_us:.0f} us per step" if fit.tp_allreduce_bandwidth_gb_per_s is not None else "")
                  + (f"; replicas' own spread {fit.replica_time_cv:.1%}" if fit.replica_time_cv is not None else "")
                  + f"); wrote {link_path}")
