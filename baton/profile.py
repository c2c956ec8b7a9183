"""Operator-level profile tables: schema, loading, validation, interpolation, analytic derivation.

One long-form table per (device type, model, sequence length). A row gives one operator's cost on
one device type at one micro-batch size and one tensor-parallel share. Measured rows (from
``baton profile --device``) and derived rows (from the catalog, ``--analytic``) share the schema.
"""
from __future__ import annotations

import bisect
import functools
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from baton.atomic import write_atomically
from baton.catalog import GpuType, gpu_type
from baton.errors import BatonError
from baton.model_spec import PRESETS, ModelSpec, preset_differences, split_profile_name
from baton.operators import (EMBEDDING, HEAD, RUNTIME_SCORE_PASSES, Operator, dims, layer_operators, operator_bytes_moved,
                             operator_flops, operator_param_bytes, operator_param_count, padded_vocab, score_pass_bytes,
                             score_passes, table_operators, tensor_sizes)
from baton.peers import final_norm_param_count, position_param_count

COLUMNS = [
    "gpu", "model", "op", "micro_batch", "seq_len", "tp_share",
    "fwd_ms", "bwd_ms", "saved_bytes", "output_bytes", "param_bytes", "source",
]
"""The table schema, in column order."""

HOST_COLUMNS = ["fwd_host_ms", "bwd_host_ms", "seg_host_ms", "off_fwd_host_ms", "off_bwd_host_ms"]
"""Optional columns after ``COLUMNS`` (eq. 2h, 2o): the host's time to launch the operator's forward and backward,
the host's cost of a recomputed segment that ends at this operator beyond its operators' own launches (the
checkpoint's wrapping in the forward and its replay in the backward, both charged to the backward), and the
host's cost per offloaded tensor of a layer in its forward (gathering it, its share of the layer's copy out) and
in its backward (its share of the copy back, its reads), the same on every operator row of a micro-batch size.
Measured tables have them (``baton profile --device``); a column absent (derived tables, tables measured
before them) means 0, so the device times alone decide, as they did."""

NUMERIC = ["micro_batch", "seq_len", "tp_share", "fwd_ms", "bwd_ms", "saved_bytes", "output_bytes", "param_bytes"]
SOURCES = ("measured", "derived")

OPTIMIZER = "optimizer"
"""Row of a measured table holding one timed step after the passes (the gradient norm and the AdamW update):
fwd_ms for param_bytes of weights (eq. 10)."""

DEFAULT_MICRO_BATCHES = (1, 2, 4, 8)
DEFAULT_SHARES = tuple(sorted({1 / 64, 1 / 32, 1 / 40, 1 / 20, 1 / 10, 3 / 40} | {k / 16 for k in range(1, 17)} | {k / 8 for k in range(1, 9)}))


@dataclass(frozen=True, kw_only=True, slots=True)
class OpCost:
    """One operator's cost for one micro-batch on one device."""

    fwd_ms: float
    """Forward time."""
    bwd_ms: float
    """Backward time (not counting recomputation)."""
    saved_bytes: float
    """Activation bytes the operator keeps for its backward when it is not recomputed."""
    output_bytes: float
    """Bytes of the tensors the operator creates."""
    param_bytes: float
    """Parameter bytes the device holds for this operator (one layer)."""
    fwd_host_ms: float = 0.0
    """Host time to launch the forward (0 where the table has no host columns)."""
    bwd_host_ms: float = 0.0
    """Host time to launch the backward."""
    seg_host_ms: float = 0.0
    """Host cost of a recomputed segment ending at this operator, beyond its operators' launches."""
    off_fwd_host_ms: float = 0.0
    """Host cost per offloaded tensor of a layer in its forward (eq. 2o; 0 where the table has no such column)."""
    off_bwd_host_ms: float = 0.0
    """Host cost per offloaded tensor of a layer in its backward (eq. 2o)."""


PROFILES_ENV = "BATON_PROFILES"
"""Environment variable naming the user's profile directory."""


def profiles_dir() -> Path:
    """The user's tables: where ``baton profile`` writes (``derived/``, ``measured/``), searched ahead of
    the shipped tables. $BATON_PROFILES, else the platform's user data directory: on Windows
    %LOCALAPPDATA%\\baton\\profiles, on macOS ~/Library/Application Support/baton/profiles, elsewhere
    $XDG_DATA_HOME/baton/profiles (~/.local/share/baton/profiles). Never inside the package or the
    checkout, so a new table cannot overwrite a shipped one."""
    env = os.environ.get(PROFILES_ENV)
    if env:
        return Path(env).expanduser()
    if sys.platform == "win32" and os.environ.get("LOCALAPPDATA"):
        root = Path(os.environ["LOCALAPPDATA"])
    elif sys.platform == "darwin":
        root = Path.home() / "Library" / "Application Support"
    else:
        root = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    return root / "baton" / "profiles"


def shipped_profiles_dir() -> Path:
    """The tables that come with Baton: the checkout's profiles/, else (an installed wheel) the copy
    shipped inside the package. Read only."""
    checkout = Path(__file__).resolve().parent.parent / "profiles"
    return checkout if checkout.is_dir() else Path(__file__).resolve().parent / "shipped" / "profiles"


def table_filename(gpu: str, model: str, seq_len: int) -> str:
    return f"{gpu}__{model}__s{seq_len}.csv"


def user_derived_path(gpu: str, spec: ModelSpec, seq_len: int | None = None) -> Path:
    """Where ``baton profile --analytic`` files the table of (gpu, model, seq_len): the user's derived/."""
    return profiles_dir() / "derived" / table_filename(gpu, spec.profile_name, seq_len or spec.seq_len)


class MissingProfile(BatonError):
    """No directory searched has the table of (gpu, model, seq_len)."""


# ---------------------------------------------------------------------------------------------
# Validation and I/O


def validate_table(df: pd.DataFrame, *, source: str) -> pd.DataFrame:
    """Check columns, types and ranges; return the table with numeric columns as numbers."""
    missing = [c for c in COLUMNS if c not in df.columns]
    if missing:
        raise BatonError(f"missing column(s) {', '.join(missing)}", source=source, field=missing[0])
    if df.empty:
        raise BatonError("table has no rows", source=source)
    host = [c for c in HOST_COLUMNS if c in df.columns]
    df = df[COLUMNS + host].copy()
    for col in NUMERIC + host:
        values = pd.to_numeric(df[col], errors="coerce")
        bad = values.isna() | ~np.isfinite(values.astype(float))
        if bad.any():
            row = int(np.flatnonzero(bad.to_numpy())[0])
            raise BatonError(f"row {row + 1}: not a finite number: {df[col].iloc[row]!r}", source=source, field=col)
        df[col] = values.astype(float)
    for col in ("micro_batch", "seq_len"):
        if (df[col] <= 0).any() or (df[col] != df[col].round()).any():
            raise BatonError("must be a positive integer in every row", source=source, field=col)
        df[col] = df[col].astype(int)
    if ((df["tp_share"] <= 0) | (df["tp_share"] > 1)).any():
        raise BatonError("must be in (0, 1] in every row", source=source, field="tp_share")
    for col in ("fwd_ms", "bwd_ms", "saved_bytes", "output_bytes", "param_bytes", *host):
        if (df[col] < 0).any():
            raise BatonError("must be >= 0 in every row", source=source, field=col)
    bad_src = ~df["source"].isin(SOURCES)
    if bad_src.any():
        raise BatonError(f"must be one of {SOURCES}, got {df['source'][bad_src].iloc[0]!r}", source=source, field="source")
    for col in ("gpu", "model", "op", "source"):
        df[col] = df[col].astype(str)
    timed = df[~df["op"].isin([OPTIMIZER])]
    if len(timed) and float((timed["fwd_ms"] + timed["bwd_ms"]).max()) <= 0.0:
        # Every time zero: rates and ratios built from it divide by zero; no device runs in no time.
        raise BatonError("every operator takes 0 ms: not a timing table", source=source, field="fwd_ms")
    dup = df.duplicated(subset=["gpu", "model", "op", "micro_batch", "seq_len", "tp_share"])
    if dup.any():
        row = int(np.flatnonzero(dup.to_numpy())[0])
        raise BatonError(f"row {row + 1} repeats an (op, micro_batch, seq_len, tp_share) key", source=source, field="op")
    return df.reset_index(drop=True)


def read_table(path: str | Path) -> pd.DataFrame:
    path = Path(path)
    if not path.is_file():
        raise BatonError("profile table not found", source=str(path))
    try:
        df = pd.read_csv(path)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
        raise BatonError(f"not a readable CSV table: {str(exc).splitlines()[0]}", source=str(path)) from None
    return validate_table(df, source=str(path))


def write_table(df: pd.DataFrame, path: str | Path) -> None:
    df = validate_table(df, source=str(path))
    df = df.sort_values(["op", "micro_batch", "tp_share"], kind="stable")
    write_atomically(path, df.to_csv(index=False, float_format="%.12g"))


# ---------------------------------------------------------------------------------------------
# Interpolation


def _interp(xs: list[float], ys: list[float], x: float, *, flat: bool = False) -> float:
    """Piecewise-linear through (xs, ys), extended linearly beyond both ends (``flat``: held at the end's value)."""
    if flat and (x <= xs[0] or x >= xs[-1]):
        return ys[0] if x <= xs[0] else ys[-1]
    if len(xs) == 1:
        return ys[0] * (x / xs[0]) if xs[0] else ys[0]
    i = bisect.bisect_left(xs, x)
    if i < len(xs) and xs[i] == x:
        return ys[i]
    i = min(max(i, 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


class Profile:
    """The table of one device type for one model and sequence length, with interpolating lookups."""

    VALUE_COLUMNS = ("fwd_ms", "bwd_ms", "saved_bytes", "output_bytes", "param_bytes", *HOST_COLUMNS)
    FLAT = tuple(c in HOST_COLUMNS for c in VALUE_COLUMNS)
    """Columns held flat beyond the table's shares and micro-batches: a launch does not grow with the work. Not on
    a ``SYNCHRONOUS`` device, where the host's time is the work's own and is extended like it."""
    SYNCHRONOUS = ("cpu",)
    """Devices whose operators run inside the call that launches them: their host times are their device times
    (``runtime.measure.op_profiler``), so they grow with the micro-batch and the share as the device times do."""

    def __init__(self, df: pd.DataFrame, *, source: str = "<table>"):
        df = validate_table(df, source=source)
        gpus, models, seqs = df["gpu"].unique(), df["model"].unique(), df["seq_len"].unique()
        if len(gpus) != 1 or len(models) != 1 or len(seqs) != 1:
            raise BatonError("a profile table holds one gpu, one model and one seq_len", source=source, field="gpu")
        self.source = source
        self.gpu = str(gpus[0])
        self.model = str(models[0])
        self.seq_len = int(seqs[0])
        self.df = df
        self.measured = bool((df["source"] == "measured").any())
        self.has_host = any(c in df.columns for c in HOST_COLUMNS)
        """Whether the table times the host's launches (eq. 2h); a column absent counts 0."""
        self._flat = tuple(f and self.gpu not in self.SYNCHRONOUS for f in self.FLAT)
        df = df.assign(**{c: 0.0 for c in HOST_COLUMNS if c not in df.columns})
        self._grid: dict[str, dict[int, tuple[list[float], np.ndarray]]] = {}
        for op, rows in df.groupby("op"):
            per_mb = {}
            for mb, g in rows.groupby("micro_batch"):
                g = g.sort_values("tp_share")
                per_mb[int(mb)] = (g["tp_share"].tolist(), g[list(self.VALUE_COLUMNS)].to_numpy(dtype=float))
            self._grid[str(op)] = per_mb

    @property
    def ops(self) -> list[str]:
        return list(self._grid)

    def micro_batches(self, op: str) -> list[int]:
        return sorted(self._grid[op])

    @functools.lru_cache(maxsize=None)
    def cost(self, op: str, micro_batch: int, share: float = 1.0) -> OpCost:
        """Interpolate over the table's shares, then over its micro-batch sizes."""
        if op not in self._grid:
            raise BatonError(f"no rows for operator '{op}'", source=self.source, field="op")
        per_mb = self._grid[op]
        mbs = sorted(per_mb)

        def at(mb: int) -> list[float]:
            shares, values = per_mb[mb]
            return [_interp(shares, list(values[:, c]), share, flat=self._flat[c]) for c in range(values.shape[1])]

        if micro_batch in per_mb:
            vals = at(micro_batch)
        else:
            cols = [at(mb) for mb in mbs]
            vals = [_interp([float(m) for m in mbs], [c[i] for c in cols], float(micro_batch), flat=self._flat[i])
                    for i in range(len(self.VALUE_COLUMNS))]
            # Parameters do not grow with the batch: a table of one micro-batch size would otherwise scale
            # them with it, as it rightly scales times and activations.
            vals[self.VALUE_COLUMNS.index("param_bytes")] = cols[0][self.VALUE_COLUMNS.index("param_bytes")]
        return OpCost(**{k: float(v) for k, v in zip(self.VALUE_COLUMNS, vals)})

    def optimizer_sample(self) -> tuple[float, float] | None:
        """(param_bytes, ms) of the timed optimizer step, if the table has one (the row is the same at
        every micro-batch: the step does not depend on it)."""
        if OPTIMIZER not in self._grid:
            return None
        per_mb = self._grid[OPTIMIZER]
        _, values = per_mb[min(per_mb)]
        ms, param_bytes = float(values[-1, 0]), float(values[-1, 4])
        return (param_bytes, ms) if param_bytes > 0 else None

    def check_model(self, spec: ModelSpec) -> None:
        """Refuse a table made for a model of a different shape."""
        needed = {o.name for o in layer_operators(spec)} | {EMBEDDING, HEAD}
        missing = sorted(needed - set(self._grid))
        if missing:
            raise BatonError(f"no rows for operator(s) {', '.join(missing)} of model '{spec.name}'", source=self.source, field="op")
        expect = operator_param_count(spec, next(o for o in layer_operators(spec) if o.name == "qkv")) * spec.dtype_bytes
        got = self.cost("qkv", self.micro_batches("qkv")[0], 1.0).param_bytes
        if not math.isclose(expect, got, rel_tol=1e-3):
            raise BatonError(f"made for a different model: qkv holds {got:.0f} parameter bytes, model '{spec.name}' needs {expect}",
                             source=self.source, field="param_bytes")


def load_profile(gpu: str, spec: ModelSpec, *, directory: str | Path | None = None, seq_len: int | None = None) -> Profile:
    """Find the table for (gpu, model, seq_len) in ``directory``, or else in the user's directory
    (``profiles_dir``) and then the shipped tables; within each, measured tables win over derived ones.

    Tables are named by ``spec.profile_name``, so a TF32 model finds only TF32 tables; a table whose own
    ``model`` column says the other setting (a file renamed by hand) is refused.
    """
    roots = [Path(directory)] if directory else [profiles_dir(), shipped_profiles_dir()]
    seq = seq_len or spec.seq_len
    name = table_filename(gpu, spec.profile_name, seq)
    for path in (p for root in roots for p in (root / "measured" / name, root / name, root / "derived" / name)):
        if path.is_file():
            prof = Profile(read_table(path), source=str(path))
            _, table_tf32 = split_profile_name(prof.model)
            if table_tf32 != spec.tf32:
                raise BatonError(f"made for tf32: {str(table_tf32).lower()} (model column '{prof.model}'), but model "
                                 f"'{spec.name}' has tf32: {str(spec.tf32).lower()}; derive a table for this setting",
                                 source=str(path), field="model")
            prof.check_model(spec)
            return prof
    # The preset's own table serves it at any attention (a derived table holds both); TF32 needs a YAML.
    preset = PRESETS.get(spec.name)
    model_arg = spec.name if preset is not None and preset.tf32 == spec.tf32 and not preset_differences(spec) else "<model YAML>"
    # A directory given is searched alone, so the table must go there (--out); the line already starts
    # with that directory, and says it once more only where the command needs it.
    where = "this directory" if directory else " and then ".join(map(str, roots))
    out = f" --out {Path(directory) / 'derived' / name}" if directory else ""
    raise MissingProfile(
        f"no profile for GPU '{gpu}', model '{spec.profile_name}', seq_len {seq} "
        f"(looked for {name} in measured/, ./ and derived/ of {where}); "
        f"create it with: baton profile --analytic --gpu {gpu} --model {model_arg} --seq-len {seq}{out}",
        source=str(roots[0]), field="profile",
    )


# ---------------------------------------------------------------------------------------------
# Analytic derivation

# Fraction of a GPU's achievable rates (``GpuType.matmul_tflops``, ``vector_tflops``,
# ``achievable_bandwidth_gb_per_s``: datasheet peaks times the catalog's per-generation fractions and
# sustained clock) that each operator kind reaches. The GPU figures say what large GEMMs and streaming
# kernels reach on that GPU; these say how far the layer's own shapes fall short of them (thin GEMMs
# of one micro-batch, batched per-head attention GEMMs, reductions). They are the same on every GPU;
# everything that differs between GPUs lives in the catalog, with its source.
COMPUTE_EFFICIENCY = {"matmul": 0.75, "bmm": 0.55, "attention": 0.55, "norm": 0.3, "softmax": 0.3, "dropout": 0.3, "elementwise": 0.3, "embedding": 0.3, "head": 0.75}
MEMORY_EFFICIENCY = {"matmul": 0.95, "bmm": 0.95, "attention": 0.95, "norm": 0.85, "softmax": 0.85, "dropout": 0.85, "elementwise": 0.9, "embedding": 0.7, "head": 0.85}
BACKWARD_FACTOR = {"matmul": 2.0, "bmm": 2.0, "attention": 2.5, "norm": 2.0, "softmax": 1.5, "dropout": 1.0, "elementwise": 1.5, "embedding": 1.5, "head": 2.0}
SMALL_OP_KINDS = ("norm", "softmax")
"""Kinds whose kernels never take less than the generation's ``small_op_us`` (row reductions)."""
MATRIX_KINDS = ("matmul", "bmm", "attention", "head")
DEFAULT_TF32 = False
"""Whether fp32 matmuls run on TF32 tensor cores when a run does not say: PyTorch's default
(``torch.backends.cuda.matmul.allow_tf32`` is False since 1.12)."""


class ProfileSet:
    """Profiles of every GPU type of a cluster for one model, loaded on first use.

    With ``derive_missing`` (a function taking one line of text), a table that no directory has is derived
    from the catalog into the user's profile directory (``derive_user_table``), the line saying so goes to
    ``derive_missing``, and later runs find it there like any table of the user's; a measured table, where
    there is one, is still found first. Never into a ``directory`` (``--profiles``): that is searched alone
    and may be shipped or shared tables, so a table missing there stays an error that says how to make it.
    """

    def __init__(self, spec: ModelSpec, *, directory: str | Path | None = None, tables: dict[str, Profile] | None = None,
                 derive_missing: Callable[[str], None] | None = None):
        self.spec = spec
        self.directory = directory
        self.derive_missing = derive_missing
        self._tables: dict[str, Profile] = dict(tables or {})

    def __getitem__(self, gpu: str) -> Profile:
        if gpu not in self._tables:
            try:
                self._tables[gpu] = load_profile(gpu, self.spec, directory=self.directory)
            except MissingProfile as missing:
                if self.derive_missing is None:
                    raise
                if self.directory is not None:
                    raise MissingProfile(f"{missing.message} (--profiles is searched alone, so Baton derives nothing into it)",
                                         source=missing.source, field=missing.field) from None
                path = derive_user_table(gpu, self.spec)
                self.derive_missing(f"derived the analytic table for {gpu} x {self.spec.profile_name} (seq {self.spec.seq_len}) "
                                    f"into {path}")
                self._tables[gpu] = load_profile(gpu, self.spec)
        return self._tables[gpu]

    def __getstate__(self) -> dict:
        # Worker processes of a solve receive the tables already loaded; the reporter may be a closure.
        return {**self.__dict__, "derive_missing": None}


def derive_user_table(gpu: str, spec: ModelSpec, seq_len: int | None = None) -> Path:
    """Write the analytic table ``baton profile --analytic --gpu gpu --model spec`` writes (default micro-batch
    sizes and shares) to ``user_derived_path``, atomically, and return that path."""
    path = user_derived_path(gpu, spec, seq_len)
    table = derive_table(spec, gpu_type(gpu), micro_batches=DEFAULT_MICRO_BATCHES, seq_len=seq_len or spec.seq_len)
    try:
        write_table(table, path)
    except OSError as exc:
        raise BatonError(f"no table for GPU '{gpu}', model '{spec.profile_name}', and the analytic one cannot be written "
                         f"there ({exc.strerror or exc}); set ${PROFILES_ENV} to a directory you may write",
                         source=str(path), field="profile") from None
    return path


def _time_ms(flops: float, bytes_moved: float, kind: str, gpu: GpuType, dtype: str, tf32: bool = DEFAULT_TF32) -> float:
    """Roofline of one kernel on the GPU's achievable rates, with the generation's floor for small reductions."""
    rate = gpu.matmul_tflops(dtype, tf32=tf32) if kind in MATRIX_KINDS else gpu.vector_tflops()
    compute = flops / (rate * 1e12 * COMPUTE_EFFICIENCY[kind])
    memory = bytes_moved / (gpu.achievable_bandwidth_gb_per_s() * 1e9 * MEMORY_EFFICIENCY[kind])
    floor = gpu.architecture.small_op_us * 1e-6 if kind in SMALL_OP_KINDS else 0.0
    return max(compute, memory, floor) * 1e3


def launch_ms(gpu: GpuType) -> float:
    """Fixed cost of one operator and pass on this GPU's generation (launch plus framework dispatch)."""
    return gpu.architecture.launch_us * 1e-3


def kernel_ms(flops: float, bytes_moved: float, kind: str, gpu: GpuType, dtype: str, tf32: bool = DEFAULT_TF32) -> float:
    """One kernel of one pass as the derivation prices it: its roofline (``kind`` picks the efficiencies) plus
    the generation's launch. Every derived operator is a sum of these; ``bench/reference_layers.py`` prices the
    layers of published figures that are not a model Baton plans with it too."""
    return _time_ms(flops, bytes_moved, kind, gpu, dtype, tf32) + launch_ms(gpu)


def kernel_passes_ms(flops: float, bytes_moved: float, kind: str, gpu: GpuType, dtype: str,
                     tf32: bool = DEFAULT_TF32) -> tuple[float, float]:
    """(forward, backward) of one kernel whose forward does ``flops`` and moves ``bytes_moved``: its backward does
    ``BACKWARD_FACTOR[kind]`` times both, as one kernel of its own."""
    factor = BACKWARD_FACTOR[kind]
    return (kernel_ms(flops, bytes_moved, kind, gpu, dtype, tf32),
            kernel_ms(flops * factor, bytes_moved * factor, kind, gpu, dtype, tf32))


def analytic_layer_cost(spec: ModelSpec, gpu: GpuType, op: Operator, micro_batch: int, share: float, seq_len: int | None = None,
                        *, tf32: bool = DEFAULT_TF32, score_pass_impl: str = RUNTIME_SCORE_PASSES) -> OpCost:
    """Roofline estimate of one layer operator: max(FLOPs / compute, bytes / bandwidth, floor) + launch, plus
    the separate elementwise passes an eager attention operator makes over its scores in ``score_pass_impl``
    (``baton.operators.SCORE_PASSES``; Baton's runtime by default), each a streaming kernel with its own launch."""
    s = seq_len or spec.seq_len
    r = share if op.tp_split else 1.0
    flops = operator_flops(spec, op, micro_batch, s) * r
    moved = operator_bytes_moved(spec, op, micro_batch, s) * r
    fwd, bwd = kernel_passes_ms(flops, moved, op.kind, gpu, spec.dtype, tf32)
    fwd_passes, bwd_passes = score_passes(op, score_pass_impl)
    if fwd_passes or bwd_passes:
        pass_bytes = score_pass_bytes(dims(spec, micro_batch, s)) * r
        one_pass = kernel_ms(pass_bytes / (2 * spec.dtype_bytes), pass_bytes, "elementwise", gpu, spec.dtype)
        fwd += fwd_passes * one_pass
        bwd += bwd_passes * one_pass
    sizes = tensor_sizes(spec, micro_batch, s)
    saved = sum(sizes[t].bytes(share) for t in op.saves)
    out = sum(sizes[t].bytes(share) for t in op.outputs)
    params = operator_param_bytes(spec, op, share)
    return OpCost(fwd_ms=fwd, bwd_ms=bwd, saved_bytes=saved, output_bytes=out, param_bytes=params)


def analytic_edge_cost(spec: ModelSpec, gpu: GpuType, name: str, micro_batch: int, seq_len: int | None = None,
                       *, share: float = 1.0, tf32: bool = DEFAULT_TF32) -> OpCost:
    """Embedding (first stage) or final LayerNorm + LM head + cross-entropy (last stage) on a rank that
    holds ``share`` of the padded vocabulary (its share of the stage's units; the runtime's
    ``runtime/parallel/vocab_parallel.py``). Bytes are exactly what that code keeps and holds:

    * embedding: its rows of the token embedding (``V_pad * share`` x h) and the whole position embedding
      (s x h) as parameters; it keeps the (b, s) int64 local token indices. Forward writes the full
      (b, s, h) output (zeros for tokens other ranks hold); backward writes the dense gradient of its
      rows and adds it into the gradient buffer.
    * head: the final norm (replicated) as parameters, and an untied head's rows (``V_pad * share`` x h);
      a tied head's rows are charged by the evaluator (to the embedding row on the first stage, again on
      a last stage that is not the first). It keeps the norm's input, statistics and output, the fp32
      softmax of its logits shard (b, s, V_pad * share) and the (b, s) int64 local targets.
    * Llama: the embedding has no position rows (rotary positions have no parameters); the final norm is
      an RMSNorm (one fp32 statistic per token, a gain and no bias).

    The all-reduces (one of (b, s, h) in the embedding's forward, three of (b, s) fp32 in the loss's
    forward and one of (b, s, h) in the head's backward) are not part of these times: the cost model
    prices them on the stage's links.
    """
    s = seq_len or spec.seq_len
    b, h, e = micro_batch, spec.hidden_dim, spec.dtype_bytes
    vd = padded_vocab(spec) * share  # vocabulary rows this rank holds
    tokens = b * s
    index_bytes = tokens * 8  # int64 per token: the local token indices, or the local targets
    if name == EMBEDDING:
        moved = 3 * tokens * h * e
        grad_rows = 4 * vd * h * e  # zero-filled, rows added in, then accumulated into the gradient buffer
        fwd = _time_ms(tokens * h, moved, "embedding", gpu, spec.dtype) + launch_ms(gpu)
        bwd = _time_ms(tokens * h, moved * BACKWARD_FACTOR["embedding"] + grad_rows, "embedding", gpu, spec.dtype) + launch_ms(gpu)
        return OpCost(fwd_ms=fwd, bwd_ms=bwd, saved_bytes=index_bytes, output_bytes=tokens * h * e,
                      param_bytes=(vd * h + position_param_count(spec)) * e)
    if name == HEAD:
        flops = 2 * tokens * h * vd + 5 * tokens * h + 5 * tokens * vd
        moved = vd * h * e + 2 * tokens * h * e + tokens * vd * (e + 8)
        fwd = _time_ms(flops, moved, "head", gpu, spec.dtype, tf32) + 3 * launch_ms(gpu)
        bwd = _time_ms(2 * flops, 2 * moved, "head", gpu, spec.dtype, tf32) + 3 * launch_ms(gpu)
        sizes = tensor_sizes(spec, micro_batch, s)  # the final norm keeps what a layer's first norm keeps
        norm = "rms1" if spec.llama else "ln1"
        ln = sizes["layer_input"].bytes(1.0) + sizes[f"{norm}_stats"].bytes(1.0) + sizes[f"{norm}_out"].bytes(1.0)
        saved = ln + tokens * vd * 4 + index_bytes
        own_rows = 0.0 if spec.tie_embeddings else vd * h
        return OpCost(fwd_ms=fwd, bwd_ms=bwd, saved_bytes=saved, output_bytes=tokens * vd * e,
                      param_bytes=(final_norm_param_count(spec) + own_rows) * e)
    raise ValueError(name)


def derive_table(spec: ModelSpec, gpu: GpuType | str, *, micro_batches=DEFAULT_MICRO_BATCHES, shares=DEFAULT_SHARES,
                 seq_len: int | None = None, tf32: bool | None = None, score_pass_impl: str = RUNTIME_SCORE_PASSES) -> pd.DataFrame:
    """The analytic table of one GPU type for one model: every operator at every (micro-batch, share).

    Whether fp32 matmuls use TF32 tensor cores follows ``spec.tf32`` (it changes nothing for fp16/bf16
    models or GPUs without TF32); ``tf32`` derives for the spec with that setting instead. Either way the
    table's ``model`` column is the derived-for spec's ``profile_name``, so the table says its setting.

    ``score_pass_impl`` names how eager attention scales and masks its scores (``baton.operators.SCORE_PASSES``).
    Tables for planning keep the default, Baton's own runtime; another value derives someone else's code, as
    ``bench/bench_profiles.py`` does to compare a published figure with the derivation of what it ran.
    """
    if tf32 is not None and tf32 != spec.tf32:
        spec = spec.with_overrides(tf32=tf32)
    tf32 = spec.tf32
    gpu = gpu_type(gpu) if isinstance(gpu, str) else gpu
    gpu.peak_tflops(spec.dtype)  # rejects bf16 on GPUs without it before we build anything
    s = seq_len or spec.seq_len
    rows = []
    for mb in micro_batches:
        for op in table_operators(spec):
            for share in (shares if op.tp_split else (1.0,)):
                c = analytic_layer_cost(spec, gpu, op, mb, share, s, tf32=tf32, score_pass_impl=score_pass_impl)
                rows.append((gpu.name, spec.name, op.name, mb, s, share, c.fwd_ms, c.bwd_ms, c.saved_bytes, c.output_bytes, c.param_bytes, "derived"))
        for name in (EMBEDDING, HEAD):  # at the vocabulary share of a rank of the first / last stage
            for share in shares:
                c = analytic_edge_cost(spec, gpu, name, mb, s, share=share, tf32=tf32)
                rows.append((gpu.name, spec.name, name, mb, s, share, c.fwd_ms, c.bwd_ms, c.saved_bytes, c.output_bytes, c.param_bytes,
                             "derived"))
    return validate_table(pd.DataFrame(rows, columns=COLUMNS).assign(model=spec.profile_name), source=f"<derived {gpu.name}/{spec.name}>")


def calibrate(target: pd.DataFrame, measured: pd.DataFrame, measured_as_derived: pd.DataFrame) -> pd.DataFrame:
    """Scale a derived table by how far measurement departs from derivation on a similar device.

    For every operator, the median over shared (micro-batch, share) rows of measured / derived time on
    the measured device (separately for forward and backward) multiplies the target's derived times.
    The derivation captures the GPUs' differences in peaks, clocks and bandwidth; the ratio carries what
    it misses on this code (kernel choice, launch overhead, framework time), which is similar across
    GPUs of one architecture and only roughly so across architectures. Bytes are structural and are
    taken from the measurement's ratios as well, so a runtime that keeps more than the formulas (fp32
    dropout masks) is reflected. ``out.attrs["calibration"]`` records the factors;
    ``calibration_summary`` says them in one line.
    """
    key = ["op", "micro_batch", "tp_share"]
    joined = measured.merge(measured_as_derived, on=key, suffixes=("_m", "_d"))
    if joined.empty:
        raise BatonError("the measured table shares no (op, micro_batch, tp_share) rows with its derivation", field="--calibrate-from")
    ratios = {}
    for op, g in joined.groupby("op"):
        ratios[op] = {col: float(np.median(g[f"{col}_m"] / g[f"{col}_d"].where(g[f"{col}_d"] > 0)).item())
                      if (g[f"{col}_d"] > 0).any() else 1.0
                      for col in ("fwd_ms", "bwd_ms", "saved_bytes")}
    out = target.copy()
    before = float(out["fwd_ms"].sum() + out["bwd_ms"].sum())
    for col in ("fwd_ms", "bwd_ms", "saved_bytes"):
        factor = out["op"].map(lambda o: ratios.get(o, {}).get(col, 1.0)).astype(float).fillna(1.0)
        out[col] = out[col] * factor
    out = validate_table(out, source="<calibrated>")
    src, dst = str(measured["gpu"].iloc[0]), str(target["gpu"].iloc[0])
    out.attrs["calibration"] = {
        "from_gpu": src, "to_gpu": dst,
        "from_arch": _arch_of(src), "to_arch": _arch_of(dst),
        "same_architecture": _arch_of(src) is not None and _arch_of(src) == _arch_of(dst),
        "time_factor": float(out["fwd_ms"].sum() + out["bwd_ms"].sum()) / before if before > 0 else 1.0,
        "op_factors": {op: {k: v for k, v in r.items() if k != "saved_bytes"} for op, r in ratios.items()},
    }
    return out


def _arch_of(gpu: str) -> str | None:
    try:
        return gpu_type(gpu).arch
    except BatonError:
        return None


def same_architecture(a: str, b: str) -> bool:
    """True when two catalog GPUs share an architecture key: a measured table of one calibrates the other well."""
    return _arch_of(a) is not None and _arch_of(a) == _arch_of(b)


def calibration_summary(df: pd.DataFrame) -> str:
    """One line on what ``calibrate`` did to a table: overall factor, range over operators, architecture match."""
    c = df.attrs.get("calibration")
    if not c:
        return "not calibrated"
    factors = [v for r in c["op_factors"].values() for v in r.values()]
    lo, hi = (min(factors), max(factors)) if factors else (1.0, 1.0)
    match = (f"same architecture ({c['to_arch']})" if c["same_architecture"] else
             f"different architectures ({c['from_arch']} -> {c['to_arch']}): the factors carry runtime overheads only roughly")
    return (f"calibrated {c['to_gpu']} from a measured {c['from_gpu']} table: layer time x{c['time_factor']:.2f} "
            f"(operators x{lo:.2f} to x{hi:.2f}); {match}")
