"""``baton train``: run a plan, one process per device, with a live progress display.

On one machine it starts the processes itself (CPU processes over gloo stand in for the plan's GPUs
when the machine has fewer GPUs than the plan has devices). Across machines, start it under torchrun on
every machine with one process per plan device; ranks follow ``plan.device_ids()`` order:

    torchrun --nnodes=2 --nproc-per-node=4 --node-rank=<0|1> --rdzv-backend=c10d \\
        --rdzv-endpoint=<host of node 0>:29500 -m cli train --plan plan.json --save-dir /shared/ckpt

(checkpoints are written by rank 0 and read by every rank: use a directory all machines see).

Before any rank starts, the plan's predicted peak memory per device is checked against the devices the
ranks will use (``runtime.devices``). At the end it prints the average tokens/s and MFU (and, for fp16,
the steps skipped for overflowing gradients); ``--report`` adds them to the report. ``--report-timeline
PATH.png`` draws one step as predicted and as measured (``runtime.report.timeline_figure``); it records the
spans ``--trace`` records, into a temporary file when no --trace is given.

Every step is also a JSON line in the run directory's ``metrics.jsonl`` (``--run-dir``; default the
save directory, else a new ``runs/<time>`` directory), whatever the output is; when the output is not a
terminal, a readable line every ``--log-every`` steps stands in for the progress bar. ``--config
run.yaml`` reads the options from a file (``runtime.train_config``); the run directory keeps the
resolved options as ``resolved.yaml``.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from baton.cli_support import check_output_path, console, guarded, say
from baton.plan import load_plan
from runtime import profile_command


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
    profile_command.register()  # `baton profile --device` measures with the runtime's layer
    __import__("runtime.data_export_commands").data_export_commands.register(app)  # data prepare, export, generate

    @app.command("train")
    @guarded
    def train(
        ctx: typer.Context,
        plan: Optional[Path] = typer.Option(None, "--plan", help="Plan JSON written by `baton solve` (required, here or in --config)."),
        steps: int = typer.Option(10, "--steps", help="Train until this many optimizer steps (resumed runs count earlier steps)."),
        data: Optional[Path] = typer.Option(None, "--data", help="Text file read as bytes (vocab 256); synthetic tokens if omitted."),
        save_dir: Optional[Path] = typer.Option(None, "--save-dir", help="Directory for checkpoints (step-XXXXXX)."),
        save_every: int = typer.Option(0, "--save-every", help="Also save every N steps (0: only at the end)."),
        keep: int = typer.Option(0, "--keep", help="Keep only the newest N checkpoints in --save-dir (0: all)."),
        resume: bool = typer.Option(False, "--resume", metavar="", help="Continue from the newest intact checkpoint in --save-dir (any plan)."),
        allow_other_data: bool = typer.Option(False, "--allow-other-data", metavar="", help="With --resume: continue on other data than the checkpoint's."),
        init_from: Optional[Path] = typer.Option(None, "--init-from", help="Hugging Face GPT-2 directory to initialise from."),
        seed: int = typer.Option(0, "--seed", help="Initialisation, data order and dropout masks."),
        lr: float = typer.Option(3e-4, "--lr", help="Peak AdamW learning rate (after warm-up)."),
        lr_min: float = typer.Option(0.0, "--lr-min", help="Learning rate at the end of the decay."),
        warmup_steps: int = typer.Option(0, "--warmup-steps", help="Steps of linear learning-rate warm-up."),
        decay: str = typer.Option("constant", "--decay", help="Learning-rate decay after warm-up, reaching --lr-min at --steps: cosine, linear or constant."),
        clip_grad: float = typer.Option(0.0, "--clip-grad", help="Clip the global gradient norm (all ranks) to this (0: off)."),
        weight_decay: float = typer.Option(0.0, "--weight-decay", help="AdamW weight decay (biases and LayerNorms never decay)."),
        eval_every: int = typer.Option(0, "--eval-every", help="Validation loss every N steps and at the end (needs --data DIR with a val split; 0: off)."),
        eval_windows: int = typer.Option(0, "--eval-windows", help="At most this many validation windows (0: the whole val split)."),
        run_dir: Optional[Path] = typer.Option(None, "--run-dir", help="Directory for metrics.jsonl and resolved.yaml (default: --save-dir, else runs/<time>)."),
        log_every: int = typer.Option(10, "--log-every", help="When the output is not a terminal, print a progress line every N steps."),
        trace: Optional[Path] = typer.Option(None, "--trace", help="Write a Chrome/Perfetto trace (JSON) of every rank's measured forward, backward, recompute, sends/receives, all-reduces and optimizer."),
        config: Optional[Path] = typer.Option(None, "--config", help="YAML file of options (keys: option names); the command line overrides it."),
        device: str = typer.Option("auto", "--device", help="auto, cpu or cuda (cuda: an error without a GPU per plan device)."),
        gpus: Optional[str] = typer.Option(None, "--gpus", help="CUDA devices of the ranks in rank order, e.g. 0,1 (implies --device cuda)."),
        timeout: float = typer.Option(300.0, "--timeout", help="Seconds a rank may wait on a peer (any collective or receive) before failing."),
        report: Optional[Path] = typer.Option(None, "--report", help="Write measured vs predicted times and memory (JSON)."),
        report_timeline: Optional[Path] = typer.Option(None, "--report-timeline", help="Draw one step after the first as predicted and as measured by every rank, two timelines over one time axis (PNG; the format follows the suffix); needs --cluster."),
        cluster: Optional[Path] = typer.Option(None, "--cluster", help="Cluster YAML the plan was made for: the pre-flight memory check and MFU use it (default: the shipped spec of the plan's cluster); --report and --report-timeline need it."),
        profiles: Optional[Path] = typer.Option(None, "--profiles", help="Profile tables for the predictions (default: the shipped ones)."),
    ) -> None:
        """Train the plan's model with exactly the plan's pipeline, tensor splits and recomputation.

        Ctrl-C or SIGTERM with --save-dir: the ranks finish the current step and save a checkpoint (a second
        one stops at once); without --save-dir they stop at once."""
        from baton.errors import BatonError
        from runtime.devices import parse_gpus
        from runtime.launch import TrainConfig, train as run
        from runtime.meters import throughput
        from runtime.metrics import readable
        from runtime.train_config import resolve_options, write_resolved

        options = resolve_options(ctx, config)
        (plan, steps, data, save_dir, save_every, keep, resume, allow_other_data, init_from, seed, lr, lr_min, warmup_steps,
         decay, clip_grad, weight_decay, eval_every, eval_windows, run_dir, log_every, device, gpus, timeout, report, cluster,
         profiles, trace, report_timeline) = (options[k] for k in (
            "plan", "steps", "data", "save_dir", "save_every", "keep", "resume", "allow_other_data", "init_from", "seed", "lr",
            "lr_min", "warmup_steps", "decay", "clip_grad", "weight_decay", "eval_every", "eval_windows", "run_dir",
            "log_every", "device", "gpus", "timeout", "report", "cluster", "profiles", "trace", "report_timeline"))
        if plan is None:
            raise BatonError("missing: give --plan or a 'plan' key in --config", field="--plan")
        if not 1 <= log_every <= 10**9:
            raise BatonError(f"must be in 1..{10**9}, got {log_every}", field="--log-every")
        if run_dir is None:
            run_dir = save_dir if save_dir is not None else _new_run_dir()
            options["run_dir"] = run_dir
        the_plan = load_plan(plan)
        gpu_list = parse_gpus(gpus)
        if report is not None:
            check_output_path(report, "--report")  # before training, not after it
        if report_timeline is not None:
            check_output_path(report_timeline, "--report-timeline")
        predict = None
        if report is not None or report_timeline is not None:
            from baton.cluster import load_cluster
            from baton.errors import BatonError
            from baton.evaluate import evaluate
            from baton.profile import ProfileSet

            if cluster is None:
                flag = "--report" if report is not None else "--report-timeline"
                raise BatonError(f"{flag} needs --cluster (the cluster YAML the plan was made for) to predict", field="--cluster")
            c = load_cluster(cluster)
            ps = ProfileSet(the_plan.model, directory=profiles)
            evaluate(the_plan, c, ps, plan_source=str(plan))  # fail before training on a missing profile or device
            predict = (c, ps)
        spans_file, scratch = trace, None
        if report_timeline is not None and trace is None:
            # The picture needs every rank's spans, which exist only as a trace: record one the user did not
            # ask for into a temporary directory (removed at the end, or by its finaliser on any error).
            import tempfile

            scratch = tempfile.TemporaryDirectory(prefix="baton-timeline-")
            spans_file = Path(scratch.name) / "trace.json"
        cfg = TrainConfig(plan=the_plan, steps=steps, data=str(data) if data else None,
                          save_dir=str(save_dir) if save_dir else None, save_every=save_every, keep=keep, resume=resume,
                          allow_other_data=allow_other_data,
                          init_from=str(init_from) if init_from else None, seed=seed, lr=lr, lr_min=lr_min,
                          warmup_steps=warmup_steps, decay=decay, clip_grad=clip_grad, weight_decay=weight_decay,
                          eval_every=eval_every, eval_windows=eval_windows, run_dir=str(run_dir),
                          device=device, gpus=gpu_list, timeout_s=timeout,
                          cluster_path=str(cluster) if cluster else None, profiles_dir=str(profiles) if profiles else None,
                          collect_all_ranks=report is not None, trace=str(spans_file) if spans_file else None)
        checked: dict = {}
        per_rank: dict = {}
        show = os.environ.get("RANK", "0") == "0"
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
        speed = throughput(history, the_plan.model, the_plan.global_batch, pre.peak_flops if pre else None) if history else None
        if show and history:
            last = history[-1]
            where = f", checkpoint in {save_dir}" if save_dir else ""
            val = f", validation loss {last.val_loss:.4f}" if last.val_loss is not None else ""
            say(f"step {last.step + 1}: loss {last.loss:.4f}{val}{where}")
            say(f"metrics in {Path(run_dir) / 'metrics.jsonl'}" + (f", trace in {trace}" if trace else ""))
            mfu = (f", MFU {speed.mfu:.2%} of {speed.peak_tflops:,.1f} TFLOP/s ({the_plan.model.dtype} catalog peak of the plan's "
                   "devices)") if speed.mfu is not None else ""
            say(f"throughput: {speed.tokens_per_s:,.0f} tokens/s averaged over {speed.steps} step(s){mfu}")
            if the_plan.model.dtype == "fp16":
                say(f"fp16 loss scale {history[-1].loss_scale:g}; {speed.skipped_steps} step(s) skipped for inf/NaN gradients")
        if report is not None and show and per_rank:
            from rich.table import Table
            from rich.text import Text

            from runtime.report import build_report, summary_rows, write_report

            rep = build_report(the_plan, predict[0], predict[1], per_rank, speed=speed)
            write_report(rep, report)
            table = Table(title=f"measured vs predicted ({rep['steps_measured']} steps)")
            for col in ("", "measured", "predicted", "prediction error"):
                table.add_column(col, justify="left" if not col else "right")
            for row in summary_rows(rep):
                table.add_row(*(Text(cell) for cell in row))  # device ids are the user's text: never markup
            console.print(table)
            say(f"wrote {report}")
        if report_timeline is not None and show and history:
            from baton.pictures import save_figure
            from runtime.report import timeline_figure
            from runtime.trace import read_spans

            fig, step = timeline_figure(the_plan, predict[0], predict[1], read_spans(spans_file), history)
            save_figure(fig, report_timeline)
            say(f"wrote {report_timeline} (step {step + 1}, predicted and measured)")
        if scratch is not None:
            scratch.cleanup()
