"""Pictures of a plan's prediction: its 1F1B timeline and its memory per device (matplotlib, Agg).

Nothing here computes a time or a size. The timeline places each stage's passes where
``baton.pipeline.simulate_1f1b`` runs them, with the stage times, transfers and synchronisations of
``baton.evaluate``'s report; the memory picture stacks the terms of each ``DeviceReport``.

Timeline rows are devices (replica by replica, stage by stage, tensor-parallel rank by rank); the
devices of a stage run the same passes, so they share its schedule. Forward passes are light, backward
passes dark, in the stage's colour; the device's own recomputation is hatched at the start of each
backward pass (its total per micro-batch: in the runtime it is spread over the layers). Transfers to the
neighbouring stage are thin grey bars under the sender's row. After the slowest pipeline come the
tied-embedding sync (first and last stages), the data-parallel sync and each device's optimizer step,
as ``baton.evaluate`` adds them.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: never open a window, work without a display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from baton.atomic import write_atomically_with  # noqa: E402
from baton.catalog import GIB  # noqa: E402
from baton.evaluate import PlanReport  # noqa: E402
from baton.pipeline import PipelineTiming, simulate_1f1b  # noqa: E402

MAX_LABELLED_BLOCKS = 400
"""Micro-batch numbers are written into blocks only up to this many blocks per picture (legibility)."""
SYNC_COLOURS = {"embedding sync": "#8c564b", "data-parallel sync": "#7f7f7f", "optimizer": "#bcbd22"}


def _stage_colour(stage: int):
    return plt.get_cmap("tab10")(stage % 10)


def replica_schedules(report: PlanReport, num_microbatches: int) -> dict[int, list[list[tuple[str, int, float, float]]]]:
    """Per replica, per stage, the passes (kind, micro-batch, start ms, end ms) that ``simulate_1f1b`` runs
    with the report's stage times and transfers."""
    out = {}
    for pi in sorted({s.pipeline for s in report.stages}):
        stages = sorted((s for s in report.stages if s.pipeline == pi), key=lambda s: s.index)
        timing = PipelineTiming(fwd_ms=tuple(s.fwd_ms for s in stages), bwd_ms=tuple(s.bwd_ms for s in stages),
                                send_fwd_ms=tuple(s.send_fwd_ms for s in stages[:-1]),
                                send_bwd_ms=tuple(s.send_bwd_ms for s in stages[:-1]))
        out[pi] = simulate_1f1b(timing, num_microbatches)[1]
    return out


def _rows(report: PlanReport):
    """(label, device report, stage report) per row, in plan order."""
    stages = {(s.pipeline, s.index): s for s in report.stages}
    multi = len({s.pipeline for s in report.stages}) > 1
    rows = []
    for d in report.devices:
        where = f"r{d.pipeline} s{d.stage}" if multi else f"s{d.stage}"
        rows.append((f"{where}  {d.id} ({d.gpu})", d, stages[(d.pipeline, d.stage)]))
    return rows


def timeline_figure(report: PlanReport, num_microbatches: int, *, title: str):
    """The predicted 1F1B timeline of every replica, one row per device."""
    num_mb = num_microbatches
    schedules = replica_schedules(report, num_mb)
    rows = _rows(report)
    num_stages = {pi: len(sched) for pi, sched in schedules.items()}
    fig, ax = plt.subplots(figsize=(14, 1.6 + 0.42 * len(rows)))
    label_blocks = 2 * num_mb * len(rows) <= MAX_LABELLED_BLOCKS
    end = report.iteration_time_ms
    for y, (_, dev, st) in enumerate(rows):
        colour = _stage_colour(st.index)
        passes = schedules[st.pipeline][st.index]
        fwd = [(a, b - a) for kind, _, a, b in passes if kind == "F"]
        bwd = [(a, b - a) for kind, _, a, b in passes if kind == "B"]
        ax.broken_barh(fwd, (y - 0.4, 0.7), facecolors=colour, alpha=0.45, edgecolor="white", linewidth=0.4)
        ax.broken_barh(bwd, (y - 0.4, 0.7), facecolors=colour, alpha=0.95, edgecolor="white", linewidth=0.4)
        if dev.recompute_ms > 0:
            ax.broken_barh([(a, min(dev.recompute_ms, w)) for a, w in bwd], (y - 0.4, 0.7), facecolors=(0, 0, 0, 0.3),
                           edgecolor="black", hatch="////", linewidth=0.0)
        # transfers: forward activations after each forward, gradients back after each backward
        if st.index + 1 < num_stages[st.pipeline] and st.send_fwd_ms > 0:
            ax.broken_barh([(a + w, st.send_fwd_ms) for a, w in fwd], (y + 0.32, 0.08), facecolors="#555555",
                           edgecolor="#555555", linewidth=0.5)  # a hairline at least: short sends stay visible
        prev = [s for s in report.stages if s.pipeline == st.pipeline and s.index == st.index - 1]
        if prev and prev[0].send_bwd_ms > 0:
            ax.broken_barh([(a + w, prev[0].send_bwd_ms) for a, w in bwd], (y + 0.32, 0.08), facecolors="#999999",
                           edgecolor="#999999", linewidth=0.5)
        if label_blocks:
            for kind, mb, a, b in passes:
                ax.text((a + b) / 2, y - 0.05, f"{kind}{mb}", ha="center", va="center", fontsize=6,
                        color="black" if kind == "F" else "white", clip_on=True)
        # after the slowest pipeline: the syncs and this device's optimizer step (baton.evaluate's sum)
        t = report.pipeline_ms
        first_or_last = st.index in (0, num_stages[st.pipeline] - 1)
        for name, dur, on in (("embedding sync", report.embedding_sync_ms, first_or_last),
                              ("data-parallel sync", report.dp_sync_ms, True)):
            if dur > 0 and on:
                ax.broken_barh([(t, dur)], (y - 0.4, 0.7), facecolors=SYNC_COLOURS[name])
            t += dur
        ax.broken_barh([(t, dev.optimizer_ms)], (y - 0.4, 0.7), facecolors=SYNC_COLOURS["optimizer"])
    ax.axvline(end, color="black", linestyle="--", linewidth=0.8)
    ax.text(end, -0.9, f" {end:.1f} ms", fontsize=8, va="center")
    ax.set_yticks(range(len(rows)), [r[0] for r in rows], fontsize=8)
    ax.set_ylim(len(rows) - 0.4, -1.2)
    ax.set_xlim(0, end * 1.06)
    ax.set_xlabel("time in one iteration (ms, predicted)")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    legend = [Patch(facecolor=_stage_colour(s), alpha=0.45, label=f"stage {s} forward")
              for s in sorted({r[2].index for r in rows})[:10]]
    legend.append(Patch(facecolor="#444444", label="backward (stage colour, dark)"))
    if any(d.recompute_ms > 0 for d in report.devices):
        legend.append(Patch(facecolor=(0, 0, 0, 0.3), edgecolor="black", hatch="////", label="recompute (in backward)"))
    if any(s.send_fwd_ms > 0 or s.send_bwd_ms > 0 for s in report.stages):
        legend += [Patch(facecolor="#555555", label="send activations"), Patch(facecolor="#999999", label="send gradients")]
    drawn = {"embedding sync": report.embedding_sync_ms > 0, "data-parallel sync": report.dp_sync_ms > 0, "optimizer": True}
    legend += [Patch(facecolor=c, label=n) for n, c in SYNC_COLOURS.items() if drawn[n]]
    ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


MEMORY_TERMS = (("weights", "weights_bytes", "#1f77b4"), ("gradients", "grads_bytes", "#ff7f0e"),
                ("optimizer", "optimizer_bytes", "#2ca02c"), ("activations", "activation_bytes", "#d62728"),
                ("recompute buffer", "transient_bytes", "#9467bd"), ("reserve", "reserve_bytes", "#c7c7c7"))
"""The terms of a device's predicted peak (``baton.memory``), in the order they are stacked."""


def memory_figure(report: PlanReport, *, title: str):
    """Each device's predicted peak memory, term by term, against its capacity (GiB)."""
    rows = _rows(report)
    fig, ax = plt.subplots(figsize=(12, 1.6 + 0.42 * len(rows)))
    ys = range(len(rows))
    left = [0.0] * len(rows)
    for label, attr, colour in MEMORY_TERMS:
        widths = [getattr(d, attr) / GIB for _, d, _ in rows]
        ax.barh(ys, widths, left=left, height=0.7, color=colour, label=label)
        left = [a + b for a, b in zip(left, widths)]
    caps = [d.capacity_bytes / GIB for _, d, _ in rows]
    ax.scatter(caps, ys, marker="|", s=900, color="black", linewidths=2, label="capacity", zorder=3)
    for y, (_, d, _) in enumerate(rows):
        share = d.peak_memory_bytes / d.capacity_bytes if d.capacity_bytes else float("inf")
        ax.text(max(left[y], caps[y]) * 1.01, y, f" {d.peak_memory_bytes / GIB:.2f} / {d.capacity_bytes / GIB:.2f} GiB "
                f"({share:.0%})", va="center", fontsize=8, color="black" if d.fits else "red")
    ax.set_yticks(list(ys), [r[0] for r in rows], fontsize=8)
    for tick, (_, d, _) in zip(ax.get_yticklabels(), rows):
        if not d.fits:
            tick.set_color("red")
    ax.invert_yaxis()
    ax.set_xlim(0, max(max(left), max(caps)) * 1.3)
    ax.set_xlabel("GiB (predicted peak)")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False, markerscale=0.4)
    fig.tight_layout()
    return fig


def save_figure(fig, path: str | Path) -> None:
    """Write ``fig`` as ``path`` (format from its suffix; PNG by default) via a temporary file and a
    rename, so a failure never leaves half a picture; the figure is closed either way."""
    path = Path(path)
    fmt = path.suffix.lstrip(".").lower() or "png"
    try:
        write_atomically_with(path, lambda fh: fig.savefig(fh, format=fmt, dpi=130))
    finally:
        plt.close(fig)
