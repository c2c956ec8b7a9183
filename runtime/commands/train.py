"""``baton train``: run a plan, one process per device, with a live progress display.

On one machine it starts the processes itself (CPU processes over gloo stand in for the plan's GPUs
when the machine has fewer GPUs than the plan has devices). Across machines, every machine runs it with
``--rdzv-endpoint HOST:PORT`` and its plan node (``--node``): it checks the machine against the plan and starts
the node's devices under torchelastic's agent, each process running this command again and taking its plan
rank after the rendezvous (``runtime.launch.machine_train``; ``baton launch --print`` prints the commands):

    baton train --plan plan.json --node m1 --rdzv-endpoint m1:29400 --save-dir /shared/ckpt

(checkpoints are written by plan rank 0 and read by every rank: use a directory all machines see).

Before any rank starts, the plan's predicted peak memory per device is checked against the devices the
ranks will use (``runtime.launch.devices``). At the end it prints the average tokens/s and MFU (and, for fp16,
the steps skipped for overflowing gradients); ``--report`` adds them to the report. ``--report-timeline
PATH.png`` draws one step as predicted and as measured (``runtime.measure.report.timeline_figure``); it records the
spans ``--trace`` records, into a temporary file when no --trace is given.

Every step is also a JSON line in the run directory's ``metrics.jsonl`` (``--run-dir``; default the
save directory, else a new ``runs/<time>`` directory), whatever the output is; when the output is not a
terminal, a readable line every ``--log-every`` steps stands in for the progress bar. ``--config
run.yaml`` reads the options from a file (``runtime.commands.train_config``); the run directory keeps the
resolved options as ``resolved.yaml``. The options themselves, and the ``TrainConfig`` they make, are
declared in ``runtime.commands.train_options``.
"""
from __future__ import annotations

import inspect
import os
import time
from dataclasses import replace
from pathlib import Path

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from baton.cli_support import check_output_path, console, guarded, say
from baton.errors import BatonError
from baton.plan import Plan, load_plan
from runtime.commands.train_options import option_parameters


def _new_run_dir() -> Path:
    """``runs/<date>-<time>`` (with a suffix when a run started in the same second; ``runs`` is
    $BATON_RUNS_DIR when set): a run without --run-dir or --save-dir still leaves its metrics somewhere
    findable."""
    base = Path(os.environ.get("BATON_RUNS_DIR") or "runs") / time.strftime("%Y%m%d-%H%M%S")
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def register(app: typer.Typer) -> None:
    app.command("train")(guarded(train))


def train(ctx: typer.Context, **options) -> None:
    """Train the plan's model with exactly the plan's pipeline, tensor splits and recomputation.

    Ctrl-C or SIGTERM with --save-dir: the ranks finish the current step and save a checkpoint (a second
    one stops at once); without --save-dir they stop at once."""
    if options.get("node") or options.get("rdzv_endpoint"):
        # A machine's launcher: c10d's C++ warnings (a store whose holder left, each with its stack) would bury the one
        # line it prints, as they would its processes' (runtime.launch.machines); torch reads the level at its import.
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    from runtime.commands.train_config import resolve_options
    from runtime.commands.train_options import train_config

    options = resolve_options(ctx, options["config"])
    _check_own_options(options)
    the_plan = load_plan(options["plan"])
    cfg = train_config(options, plan=the_plan, collect_all_ranks=options["report"] is not None)
    if not _started_by_torchrun() or _shows_progress(the_plan):
        _note_compile_setting(cfg)
    if (cfg.rdzv_endpoint or cfg.node) and not _started_by_torchrun():
        _launch_machine(cfg, options)
        return
    predict = _prediction_inputs(options, the_plan)
    scratch = None
    if options["report_timeline"] is not None and options["trace"] is None:
        # The picture needs every rank's spans, which exist only as a trace: record one the user did not
        # ask for into a temporary directory (removed at the end, or by its finaliser on any error).
        import tempfile

        scratch = tempfile.TemporaryDirectory(prefix="baton-timeline-")
        cfg = replace(cfg, trace=str(Path(scratch.name) / "trace.json"))
    history, per_rank, speed = _run_with_progress(cfg, options)
    show = _shows_progress(the_plan)
    if show and history:
        _say_summary(the_plan, history, speed, options)
    if options["report"] is not None and show and per_rank:
        _write_report(the_plan, predict, per_rank, speed, options["report"])
    if options["report_timeline"] is not None and show and history:
        _draw_timeline(the_plan, predict, Path(cfg.trace), history, options["report_timeline"])
    if scratch is not None:
        scratch.cleanup()


train.__signature__ = inspect.Signature([
    inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context), *option_parameters()])


def _note_compile_setting(cfg) -> None:
    """One line when the tables of the run's prediction were profiled with another --compile setting than the run's."""
    from runtime.commands.profile import compile_mismatch

    line = compile_mismatch(cfg.plan, cfg.compile, cfg.cluster_path, cfg.profiles_dir)
    if line:
        say(f"note: {line}", err=True)


def _started_by_torchrun() -> bool:
    from runtime.launch.launcher import under_torchrun

    return under_torchrun()


def _launch_machine(cfg, options: dict) -> None:
    """This machine's part of a run across machines: its processes run this command again, from its options as
    resolved here (``runtime.launch.machine_train``)."""
    import tempfile

    from runtime.commands.train_config import write_resolved
    from runtime.launch.launcher import prepare
    from runtime.launch.machine_train import launch_here

    notice = lambda line: say(f"note: {line}", err=True)  # noqa: E731
    prepare(cfg, notice)
    with tempfile.TemporaryDirectory(prefix="baton-machine-") as tmp:
        launch_here(cfg, write_resolved(tmp, options), notice=notice)


def _check_own_options(options: dict) -> None:
    """Check the options the launcher does not see, and give the run its directory."""
    if options["plan"] is None:
        raise BatonError("missing: give --plan or a 'plan' key in --config", field="--plan")
    if not 1 <= options["log_every"] <= 10**9:
        raise BatonError(f"must be in 1..{10**9}, got {options['log_every']}", field="--log-every")
    if options["run_dir"] is None:
        options["run_dir"] = options["save_dir"] if options["save_dir"] is not None else _new_run_dir()


def _shows_progress(plan: Plan) -> bool:
    """Whether this process shows the run's progress: the only one, or the one of plan rank 0."""
    from runtime.launch.machines import runs_plan_rank_zero

    here = runs_plan_rank_zero(plan)
    return here if here is not None else os.environ.get("RANK", "0") == "0"


def _prediction_inputs(options: dict, the_plan: Plan):
    """(cluster, profiles) for --report and --report-timeline, None without them: checked, with the output
    paths, before training rather than after it."""
    report, report_timeline = options["report"], options["report_timeline"]
    if report is not None:
        check_output_path(report, "--report")
    if report_timeline is not None:
        check_output_path(report_timeline, "--report-timeline")
    if report is None and report_timeline is None:
        return None
    from baton.cluster import load_cluster
    from baton.evaluate import evaluate
    from baton.profile import ProfileSet

    if options["cluster"] is None:
        flag = "--report" if report is not None else "--report-timeline"
        raise BatonError(f"{flag} needs --cluster (the cluster YAML the plan was made for) to predict", field="--cluster")
    c = load_cluster(options["cluster"])
    ps = ProfileSet(the_plan.model, directory=options["profiles"])
    evaluate(the_plan, c, ps, plan_source=str(options["plan"]))  # fail before training on a missing profile or device
    return c, ps


def _run_with_progress(cfg, options: dict):
    """Train with a live progress bar (or, when the output is no terminal, a line every --log-every steps);
    the history, every rank's steps (with --report) and the run's throughput (None without steps)."""
    from runtime.commands.train_config import write_resolved
    from runtime.launch.launcher import train as run
    from runtime.measure.meters import throughput
    from runtime.measure.metrics import readable

    steps, log_every, run_dir = options["steps"], options["log_every"], options["run_dir"]
    checked: dict = {}
    per_rank: dict = {}
    show = _shows_progress(cfg.plan)
    terminal = console.is_terminal
    timed: list = []  # (tokens, ms) of the steps after the first of this run: the first pays for warm-up
    with Progress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                  TimeElapsedColumn(), TimeRemainingColumn(), console=console, disable=not show) as progress:
        task = progress.add_task("train", total=steps, info="starting ranks...")

        def on_step(s) -> None:
            if not timed and "resolved" not in checked:
                # Written once the run is under way: a run refused before its start leaves no directory.
                checked["resolved"] = write_resolved(run_dir, options)
            timed.append((s.tokens, s.iteration_ms))
            shown = timed[1:] or timed
            average = sum(t for t, _ in shown) / max(sum(ms for _, ms in shown), 1e-9) * 1e3
            val = f"  val {s.val_loss:.4f}" if s.val_loss is not None else ""
            progress.update(task, completed=s.step + 1,
                            info=f"loss {s.loss:.4f}{val}  lr {s.lr:.2e}  {average:,.0f} tok/s (avg)")
            record = checked["metrics"].last if "metrics" in checked else None
            done = s.step + 1
            if show and not terminal and record is not None and (done % log_every == 0 or done == steps or s.val_loss is not None):
                eta = sum(ms for _, ms in shown) / len(shown) / 1e3 * (steps - done)
                say(readable(record, steps, eta))

        history = run(cfg, on_step=on_step, per_rank=per_rank, on_notice=lambda line: say(f"note: {line}", err=True),
                      checked=checked)
    pre = checked.get("preflight")
    speed = throughput(history, cfg.plan.model, cfg.plan.global_batch, pre.peak_flops if pre else None) if history else None
    return history, per_rank, speed


def _say_summary(the_plan: Plan, history: list, speed, options: dict) -> None:
    last = history[-1]
    where = f", checkpoint in {options['save_dir']}" if options["save_dir"] else ""
    val = f", validation loss {last.val_loss:.4f}" if last.val_loss is not None else ""
    say(f"step {last.step + 1}: loss {last.loss:.4f}{val}{where}")
    trace = options["trace"]
    say(f"metrics in {Path(options['run_dir']) / 'metrics.jsonl'}" + (f", trace in {trace}" if trace else ""))
    mfu = (f", MFU {speed.mfu:.2%} of {speed.peak_tflops:,.1f} TFLOP/s ({the_plan.model.dtype} catalog peak of the plan's "
           "devices)") if speed.mfu is not None else ""
    say(f"throughput: {speed.tokens_per_s:,.0f} tokens/s averaged over {speed.steps} step(s){mfu}")
    if the_plan.model.dtype == "fp16":
        say(f"fp16 loss scale {history[-1].loss_scale:g}; {speed.skipped_steps} step(s) skipped for inf/NaN gradients")


def _write_report(the_plan: Plan, predict, per_rank: dict, speed, report: Path) -> None:
    from rich.table import Table
    from rich.text import Text

    from runtime.measure.report import build_report, summary_rows, write_report

    rep = build_report(the_plan, predict[0], predict[1], per_rank, speed=speed)
    write_report(rep, report)
    table = Table(title=f"measured vs predicted ({rep['steps_measured']} steps)")
    for col in ("", "measured", "predicted", "prediction error"):
        table.add_column(col, justify="left" if not col else "right")
    for row in summary_rows(rep):
        table.add_row(*(Text(cell) for cell in row))  # device ids are the user's text: never markup
    console.print(table)
    say(f"wrote {report}")


def _draw_timeline(the_plan: Plan, predict, spans_file: Path, history: list, out: Path) -> None:
    from baton.pictures import save_figure
    from runtime.measure.report import timeline_figure
    from runtime.measure.trace import read_spans

    fig, step = timeline_figure(the_plan, predict[0], predict[1], read_spans(spans_file), history)
    save_figure(fig, out)
    say(f"wrote {out} (step {step + 1}, predicted and measured)")
