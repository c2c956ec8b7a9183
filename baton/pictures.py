"""Pictures of a plan's prediction (its 1F1B timeline, its memory per device) and of a training step
measured next to it (matplotlib, Agg).

Nothing here computes a time or a size. The timeline places each stage's passes where
``baton.pipeline.simulate`` runs them (1F1B, or interleaved), with the stage times, transfers and synchronisations of
``baton.evaluate``'s report; the memory picture stacks the terms of each ``DeviceReport``. A measured
timeline arrives as plain data (``Timeline``: rows and blocks, built by ``runtime.measure.report`` from the spans
every rank recorded) and is drawn by the same code as the predicted one.

Timeline rows are devices (replica by replica, stage by stage, tensor-parallel rank by rank); the
devices of a stage run the same passes, so they share its schedule. Forward passes are light, backward
passes dark, in the stage's colour; the device's own recomputation is hatched at the start of each
backward pass (its total per micro-batch: in the runtime it is spread over the layers). Transfers to the
neighbouring stage are thin grey bars under the sender's row. After the slowest pipeline come the
tied-embedding sync (first and last stages), the data-parallel sync and each device's optimizer step,
as ``baton.evaluate`` adds them. A plan of more than ``MAX_ROWS`` devices is drawn with one device per
stage, and the picture says so.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: never open a window, work without a display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from baton.atomic import write_atomically_with  # noqa: E402
from baton.catalog import GIB  # noqa: E402
from baton.evaluate import PlanReport  # noqa: E402
from baton.pipeline import PipelineTiming, simulate  # noqa: E402
from baton.schedules import interleaved_one_f_one_b  # noqa: E402

MAX_LABELLED_BLOCKS = 400
"""Micro-batch numbers are written into blocks only up to this many blocks per panel (legibility)."""
MAX_ROWS = 32
"""A timeline draws at most this many device rows; a larger plan shows one device per stage (see ``_visible``)."""
SYNC_COLOURS = {"embedding sync": "#8c564b", "data-parallel sync": "#7f7f7f", "optimizer": "#bcbd22"}

# What a block is, how it is drawn (band of the row: full height, a thin band under it or over it, or hatched
# over what is under it), its colour (None: the stage's) and alpha, and its legend entry. Predicted timelines
# use the first kinds; measured ones (``runtime.measure.report``) all of them, since the runtime also records what the
# cost model folds into other terms (waits, tensor-parallel all-reduces) or leaves out (the step's all-reduce).
KINDS = {
    "forward": ("full", None, 0.45, None),
    "backward": ("full", None, 0.95, "backward (stage colour, dark)"),
    "recompute": ("hatch", (0, 0, 0, 0.3), None, "recompute (in backward)"),
    "send activations": ("under", "#555555", 1.0, "send activations"),
    "send gradients": ("under", "#999999", 1.0, "send gradients"),
    "embedding sync": ("full", SYNC_COLOURS["embedding sync"], 1.0, "embedding sync"),
    "data-parallel sync": ("full", SYNC_COLOURS["data-parallel sync"], 1.0, "data-parallel sync"),
    "optimizer": ("full", SYNC_COLOURS["optimizer"], 1.0, "optimizer"),
    "wait": ("full", "#d9d9d9", 0.6, "waiting for a peer (measured)"),
    "tp all-reduce": ("over", "#17becf", 1.0, "tensor-parallel all-reduce (measured; predicted inside passes)"),
    "step all-reduce": ("full", "#e377c2", 1.0, "loss / grad-norm all-reduce (measured; not in the cost model)"),
}


@dataclass(frozen=True, slots=True)
class Row:
    """One device's row of a timeline."""

    label: str
    stage: int
    """Its stage index (the colour of its passes)."""
    pipeline: int
    tp_rank: int


@dataclass(frozen=True, slots=True)
class Block:
    """One bar: ``kind`` (a key of ``KINDS``) on row ``row`` (an index into ``Timeline.rows``) from
    ``start_ms`` to ``end_ms``, ``label`` written into it when there is room (a pass: "F3", "B3")."""

    row: int
    kind: str
    start_ms: float
    end_ms: float
    label: str = ""


@dataclass(frozen=True, slots=True)
class Timeline:
    """What one timeline panel draws: rows top to bottom, the blocks on them, and where the step ends (ms)."""

    rows: list[Row]
    blocks: list[Block]
    end_ms: float


def _stage_colour(stage: int):
    return plt.get_cmap("tab10")(stage % 10)


def replica_schedules(report: PlanReport, num_microbatches: int) -> dict[int, list[list[tuple[str, int, float, float]]]]:
    """Per replica, per stage (device group), the passes (kind, micro-batch, start ms, end ms) that ``simulate`` runs
    with the report's stage times and transfers, and the replica's own number of micro-batches (its samples
    over its micro-batch size; replicas may differ), else ``num_microbatches``."""
    out = {}
    for pi in sorted({s.pipeline for s in report.stages}):
        stages = sorted((s for s in report.stages if s.pipeline == pi), key=lambda s: s.index)
        timing = PipelineTiming(fwd_ms=tuple(s.fwd_ms for s in stages), bwd_ms=tuple(s.bwd_ms for s in stages),
                                send_fwd_ms=tuple(s.send_fwd_ms for s in stages[:-1]),
                                send_bwd_ms=tuple(s.send_bwd_ms for s in stages[:-1]))
        # An interleaved replica's virtual stages repeat its groups' devices (baton.plan.Pipeline.chunks).
        groups = next((k for k in range(1, len(stages)) if stages[k].devices == stages[0].devices), len(stages))
        sch = interleaved_one_f_one_b(groups, len(stages) // groups, _replica_microbatches(report, pi, num_microbatches))
        out[pi] = [[(kind, i, a, b) for kind, i, _, a, b in runs] for runs in simulate(sch, timing)[1]]
    return out


def _replica_microbatches(report: PlanReport, pipeline: int, default: int) -> int:
    batch = next((d.micro_batch_size for d in report.devices if d.pipeline == pipeline), 0)
    return report.replica_samples[pipeline] // batch if batch and report.replica_samples else default


def timeline_rows(report: PlanReport) -> list[Row]:
    """One row per device of the report, in plan order (replica by replica, stage by stage, TP rank by rank)."""
    stages = {(s.pipeline, s.index): s for s in report.stages}
    multi = len({s.pipeline for s in report.stages}) > 1
    rows = []
    for d in report.devices:
        where = f"r{d.pipeline} s{d.stage}" if multi else f"s{d.stage}"
        rows.append(Row(f"{where}  {d.id} ({d.gpu})", d.stage, d.pipeline, stages[(d.pipeline, d.stage)].devices.index(d.id)))
    return rows


def predicted_timeline(report: PlanReport, num_microbatches: int) -> Timeline:
    """The evaluator's step as blocks: each stage's passes where ``simulate`` runs them (the devices of a
    stage share its schedule), the device's recomputation at the start of each backward pass (its total per
    micro-batch: in the runtime it is spread over the layers), transfers to the neighbouring stage after each
    pass, then after the slowest pipeline the tied-embedding sync (first and last stages), the data-parallel
    sync and each device's optimizer step, as ``baton.evaluate`` adds them."""
    schedules = replica_schedules(report, num_microbatches)
    stages = {(s.pipeline, s.index): s for s in report.stages}
    blocks: list[Block] = []
    for y, dev in enumerate(report.devices):
        st = stages[(dev.pipeline, dev.stage)]
        last = st.index == len(schedules[st.pipeline]) - 1
        prev = stages.get((st.pipeline, st.index - 1))
        for kind, mb, a, b in schedules[st.pipeline][st.index]:
            blocks.append(Block(y, "forward" if kind == "F" else "backward", a, b, f"{kind}{mb}"))
            if kind == "F" and not last and st.send_fwd_ms > 0:
                blocks.append(Block(y, "send activations", b, b + st.send_fwd_ms))
            if kind == "B":
                if dev.recompute_ms > 0:
                    blocks.append(Block(y, "recompute", a, a + min(dev.recompute_ms, b - a)))
                if prev is not None and prev.send_bwd_ms > 0:
                    blocks.append(Block(y, "send gradients", b, b + prev.send_bwd_ms))
        t = report.pipeline_ms
        tied = len(schedules[st.pipeline]) > 1  # a replica of one stage joins no tied all-reduce (eq. 11)
        for name, dur, on in (("embedding sync", report.embedding_sync_ms, tied and (st.index == 0 or last)),
                              ("data-parallel sync", report.dp_sync_ms, True)):
            if dur > 0 and on:
                blocks.append(Block(y, name, t, t + dur))
            t += dur
        blocks.append(Block(y, "optimizer", t, t + dev.optimizer_ms))
    return Timeline(timeline_rows(report), blocks, report.iteration_time_ms)


def _visible(timeline: Timeline) -> tuple[list[int], str]:
    """The rows drawn, and a note when some are left out: all up to ``MAX_ROWS``; beyond that the first
    tensor-parallel rank of each stage (every device of a stage runs the stage's passes) of replica 0 and of
    the replica whose passes end last (replicas may differ in shape and batch), at most ``MAX_ROWS`` of them."""
    rows = timeline.rows
    if len(rows) <= MAX_ROWS:
        return list(range(len(rows))), ""
    ends: dict[int, float] = {}
    for b in timeline.blocks:
        if b.label:
            ends[rows[b.row].pipeline] = max(ends.get(rows[b.row].pipeline, 0.0), b.end_ms)
    slowest = max(ends, key=ends.get) if ends else 0
    shown = sorted({0, slowest})
    keep = [i for i, r in enumerate(rows) if r.pipeline in shown and r.tp_rank == 0]
    which = "replica 0" if shown == [0] else f"replicas 0 and {slowest} (the last to finish its passes)"
    note = (f"showing {min(len(keep), MAX_ROWS)} of {len(rows)} devices: tensor-parallel rank 0 of each stage of "
            f"{which} (the other devices of a stage run the same passes)")
    if len(keep) > MAX_ROWS:
        note += f"; the first {MAX_ROWS} stages"
    return keep[:MAX_ROWS], note


def _draw_panel(ax, timeline: Timeline, keep: list[int], *, x_max: float, end_label: str) -> set[str]:
    """Draw ``timeline``'s blocks on the rows ``keep`` into ``ax``; return the kinds drawn."""
    position = {row: y for y, row in enumerate(keep)}
    blocks = [b for b in timeline.blocks if b.row in position]
    passes = sum(1 for b in blocks if b.kind in ("forward", "backward"))
    label_blocks = passes <= MAX_LABELLED_BLOCKS
    min_label_ms = 0.015 * x_max  # narrower blocks get no text: it would spill over the neighbours
    band = {"full": (-0.4, 0.7), "hatch": (-0.4, 0.7), "under": (0.32, 0.08), "over": (-0.4, 0.08)}
    order = {"full": 0, "hatch": 1, "under": 2, "over": 2}
    for b in sorted(blocks, key=lambda b: order[KINDS[b.kind][0]]):
        y = position[b.row]
        where, colour, alpha, _ = KINDS[b.kind]
        face = colour if colour is not None else _stage_colour(timeline.rows[b.row].stage)
        lo, height = band[where]
        span = [(b.start_ms, b.end_ms - b.start_ms)]
        if where == "hatch":
            ax.broken_barh(span, (y + lo, height), facecolors=face, edgecolor="black", hatch="////", linewidth=0.0)
        elif where == "full":
            edge = "white" if b.kind in ("forward", "backward") else face
            ax.broken_barh(span, (y + lo, height), facecolors=face, alpha=alpha, edgecolor=edge, linewidth=0.4)
        else:  # a hairline at least: short sends and all-reduces stay visible
            ax.broken_barh(span, (y + lo, height), facecolors=face, edgecolor=face, linewidth=0.5)
        if label_blocks and b.label and b.end_ms - b.start_ms >= min_label_ms:
            ax.text((b.start_ms + b.end_ms) / 2, y - 0.05, b.label, ha="center", va="center", fontsize=6,
                    color="white" if b.kind == "backward" else "black", clip_on=True)
    end = timeline.end_ms
    ax.axvline(end, color="black", linestyle="--", linewidth=0.8)
    ax.text(end, -0.9, f" {end_label}", fontsize=8, va="center")
    ax.set_yticks(range(len(keep)), [timeline.rows[i].label for i in keep], fontsize=8)
    ax.set_ylim(len(keep) - 0.4, -1.2)
    ax.set_xlim(0, x_max)
    ax.grid(axis="x", alpha=0.3)
    return {b.kind for b in blocks}


def _legend(ax, rows: list[Row], keep: list[int], kinds: set[str]) -> None:
    legend = [Patch(facecolor=_stage_colour(s), alpha=0.45, label=f"stage {s} forward")
              for s in sorted({rows[i].stage for i in keep})[:10]]
    for kind, (where, colour, alpha, label) in KINDS.items():
        if kind in kinds and label is not None:
            face = "#444444" if colour is None else colour
            legend.append(Patch(facecolor=face, alpha=alpha, edgecolor="black" if where == "hatch" else face,
                                hatch="////" if where == "hatch" else None, label=label))
    ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)


def _note(fig, note: str) -> None:
    if note:
        fig.text(0.01, 0.005, note, fontsize=8, ha="left", va="bottom", style="italic")


def timeline_figure(report: PlanReport, num_microbatches: int, *, title: str):
    """The predicted 1F1B timeline of every replica, one row per device (``predicted_timeline``)."""
    timeline = predicted_timeline(report, num_microbatches)
    keep, note = _visible(timeline)
    fig, ax = plt.subplots(figsize=(14, 1.6 + 0.42 * len(keep) + (0.3 if note else 0)))
    end = timeline.end_ms
    kinds = _draw_panel(ax, timeline, keep, x_max=end * 1.06, end_label=f"{end:.1f} ms")
    ax.set_xlabel("time in one iteration (ms, predicted)")
    ax.set_title(title, fontsize=10)
    _legend(ax, timeline.rows, keep, kinds)
    fig.tight_layout(rect=(0, 0.03 if note else 0, 1, 1))
    _note(fig, note)
    return fig


def comparison_figure(predicted: Timeline, measured: Timeline, *, title: str, predicted_title: str, measured_title: str):
    """Two panels over one time axis (ms from the step's start): the predicted timeline above, the measured
    one below, with the same rows, colours and kinds of block."""
    if [r.label for r in predicted.rows] != [r.label for r in measured.rows]:
        raise ValueError("the predicted and measured timelines must have the same rows")
    keep, note = _visible(predicted)
    x_max = max(predicted.end_ms, measured.end_ms) * 1.06
    panel_in = 0.9 + 0.42 * len(keep)
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(14, 1.2 + 2 * panel_in + (0.3 if note else 0)))
    kinds = _draw_panel(top, predicted, keep, x_max=x_max, end_label=f"{predicted.end_ms:.1f} ms")
    kinds |= _draw_panel(bottom, measured, keep, x_max=x_max, end_label=f"{measured.end_ms:.1f} ms")
    top.set_title(predicted_title, fontsize=9, loc="left")
    bottom.set_title(measured_title, fontsize=9, loc="left")
    bottom.set_xlabel("time from the start of the step (ms)")
    top.tick_params(labelbottom=True)  # both panels keep their time labels
    _legend(top, predicted.rows, keep, kinds)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.03 if note else 0, 1, 1))
    _note(fig, note)
    return fig


MEMORY_TERMS = (("weights", "weights_bytes", "#1f77b4"), ("gradients", "grads_bytes", "#ff7f0e"),
                ("optimizer", "optimizer_bytes", "#2ca02c"), ("activations", "activation_bytes", "#d62728"),
                ("recompute buffer", "transient_bytes", "#9467bd"),
                ("sync staging beyond activations", "sync_staging_excess", "#8c564b"), ("reserve", "reserve_bytes", "#c7c7c7"))
"""The terms of a device's predicted peak (``baton.costmodel.device_memory``), in the order they are stacked."""


def _term_bytes(d, attr: str) -> float:
    if attr == "sync_staging_excess":
        # Eq. 14: the sharded sync's staging and the activations are never alive together; the peak takes the larger.
        return max(0.0, d.sync_buffer_bytes - d.activation_bytes - d.transient_bytes)
    return getattr(d, attr)


def memory_figure(report: PlanReport, *, title: str):
    """Each device's predicted peak memory, term by term, against its capacity (GiB). Beyond ``MAX_ROWS``
    devices, devices whose bars would be identical share one bar, and if that is still too many the fullest
    ``MAX_ROWS`` (against capacity) are drawn, with a note."""
    rows, note = _memory_rows(report)
    fig, ax = plt.subplots(figsize=(12, 1.6 + 0.42 * len(rows)))
    ys = range(len(rows))
    left = [0.0] * len(rows)
    for label, attr, colour in MEMORY_TERMS:
        widths = [_term_bytes(d, attr) / GIB for _, d, _ in rows]
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
    if note:
        _note(fig, note)
    fig.tight_layout()
    return fig


def _memory_rows(report: PlanReport) -> tuple[list, str]:
    rows = [(r.label, d, None) for r, d in zip(timeline_rows(report), report.devices)]
    if len(rows) <= MAX_ROWS:
        return rows, ""
    alike: dict[tuple, list] = {}
    for label, d, _ in rows:
        key = (d.gpu, round(d.capacity_bytes), *(round(_term_bytes(d, attr)) for _, attr, _ in MEMORY_TERMS))
        alike.setdefault(key, []).append((label, d))
    groups = [(f"{m[0][0]} (+{len(m) - 1} alike)" if len(m) > 1 else m[0][0], m[0][1], None) for m in alike.values()]
    note = f"{len(rows)} devices in {len(groups)} bars (devices with identical bars share one)"
    if len(groups) > MAX_ROWS:
        groups = sorted(groups, key=lambda g: -g[1].peak_memory_bytes / max(g[1].capacity_bytes, 1))[:MAX_ROWS]
        note += f"; the {MAX_ROWS} fullest against capacity are drawn"
    return groups, note


def save_figure(fig, path: str | Path) -> None:
    """Write ``fig`` as ``path`` (format from its suffix; PNG by default) via a temporary file and a
    rename, so a failure never leaves half a picture; the figure is closed either way."""
    path = Path(path)
    fmt = path.suffix.lstrip(".").lower() or "png"
    try:
        write_atomically_with(path, lambda fh: fig.savefig(fh, format=fmt, dpi=130))
    finally:
        plt.close(fig)
