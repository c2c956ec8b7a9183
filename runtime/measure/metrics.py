"""The run directory's metrics: one JSON line per step (``metrics.jsonl``), and TensorBoard event files
with the same numbers (tags ``train/<key>`` and ``val/loss``, step as in the record) when ``tensorboard``
is installed (the optional extra ``baton[tensorboard]``: without it they are silently not written).

The log is written by the process that hears rank 0's steps (the launcher, or rank 0 under torchrun)
whether or not the output is a terminal, and flushed every line, so ``tail -f`` and a crashed run both
see every finished step. A resumed run appends to the same file; its records carry the step, so a
reader can tell where it resumed.

A record::

    {"step": 12, "loss": 3.71, "lr": 0.0006, "grad_norm": 0.84, "clipped": false, "tokens_per_s": 5310.2,
     "mfu": 0.012, "step_ms": 98.7, "skipped": false, "skipped_steps": 0, "loss_scale": 1.0,
     "memory_bytes": {"a100:0": 123456, ...}, "val_loss": 3.80, "time": 1763890000.1}

``step`` counts optimizer steps done (1 after the first); ``skipped_steps`` counts the steps of this
process whose fp16 update was skipped; ``memory_bytes`` is every device's peak (CUDA allocated, or a CPU
rank's peak resident set); ``val_loss`` appears on evaluation steps only; non-finite numbers are null.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

from baton.costmodel import model_flops_per_s
from baton.plan import Plan

METRICS_FILE = "metrics.jsonl"


def _number(x):
    """JSON has no inf/NaN: write them as null (an overflowing fp16 step's grad norm)."""
    return x if x is None or math.isfinite(x) else None


class MetricsLog:
    """Appends one record per step to ``run_dir/metrics.jsonl`` (and TensorBoard scalars when possible)."""

    def __init__(self, run_dir: str | Path, plan: Plan, peak_flops: float | None = None):
        self.dir = Path(run_dir)
        self.plan, self.peak_flops = plan, peak_flops
        self.devices = plan.device_ids()
        self.skipped_steps = 0
        self.last: dict | None = None
        """The latest record written."""
        self._file = None
        self._board = None
        # Imported now, before any rank starts: at the first step the import (about a second on a loaded
        # machine) would hold up the launcher, and an interrupt landing in it would cost that step's line.
        self._writer_class = _summary_writer_class()

    def record(self, s) -> dict:
        """The JSON record of ``s`` (a ``runtime.train.engine.StepStats`` of rank 0)."""
        self.skipped_steps += int(s.skipped)
        flops = model_flops_per_s(self.plan.model, self.plan.global_batch, s.iteration_ms) if s.iteration_ms > 0 else 0.0
        rec = {"step": s.step + 1, "loss": _number(s.loss), "lr": s.lr, "grad_norm": _number(s.grad_norm),
               "clipped": s.clipped, "tokens_per_s": _number(s.tokens_per_s),
               "mfu": _number(flops / self.peak_flops) if self.peak_flops else None, "step_ms": s.iteration_ms,
               "skipped": s.skipped, "skipped_steps": self.skipped_steps, "loss_scale": s.loss_scale,
               "memory_bytes": dict(zip(self.devices, (int(b) for b in s.memory_bytes)))}
        if s.val_loss is not None:
            rec["val_loss"] = _number(s.val_loss)
        rec["time"] = round(time.time(), 3)
        return rec

    def write(self, s) -> dict:
        rec = self.record(s)
        if self._file is None:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._file = open(self.dir / METRICS_FILE, "a", encoding="utf-8")
            self._board = self._writer_class(log_dir=str(self.dir)) if self._writer_class is not None else None
        self._file.write(json.dumps(rec) + "\n")
        self._file.flush()
        if self._board is not None:
            for key in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "step_ms", "val_loss"):
                if rec.get(key) is not None:
                    self._board.add_scalar(f"train/{key}" if key != "val_loss" else "val/loss", rec[key], rec["step"])
            self._board.flush()
        self.last = rec
        return rec

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._board is not None:
            self._board.close()


def _summary_writer_class():
    """torch's TensorBoard ``SummaryWriter`` when tensorboard is installed, else None (it is optional)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter


def readable(rec: dict, total_steps: int, eta_s: float | None) -> str:
    """One log line for a record, for logs that are not a terminal."""
    parts = [f"step {rec['step']}/{total_steps}", f"loss {_fmt(rec['loss'], '.4f')}"]
    if "val_loss" in rec:
        parts.append(f"val {_fmt(rec['val_loss'], '.4f')}")
    parts += [f"lr {rec['lr']:.3g}", f"grad norm {_fmt(rec['grad_norm'], '.3g')}{' (clipped)' if rec['clipped'] else ''}",
              f"{_fmt(rec['tokens_per_s'], ',.0f')} tok/s", f"{rec['step_ms']:.0f} ms/step"]
    if rec["mfu"] is not None:
        parts.append(f"MFU {rec['mfu']:.1%}")
    if rec["skipped_steps"]:
        parts.append(f"{rec['skipped_steps']} skipped")
    if eta_s is not None:
        parts.append(f"ETA {_duration(eta_s)}")
    return "  ".join(parts)


def _fmt(x, spec: str) -> str:
    return "nan" if x is None else format(x, spec)


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"
