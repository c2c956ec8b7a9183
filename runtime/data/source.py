"""Training tokens: a prepared token dataset (``baton data prepare``), any local file read as bytes
(vocabulary 256), or a synthetic stream.

Sample n of the run (n = samples consumed before the step + index in the step) is the window of seq_len + 1 tokens at
an offset that is a hash of (seed, n): every rank, plan and resumed run sees the same samples in the same
order, and the data position in a checkpoint is just a sample count.

A dataset directory is memory-mapped (``TokenDataset``): only the windows a rank reads are paged in.
Its vocabulary must fit the model's (``open_dataset``); a model may have more tokens than the data uses
(a padded vocabulary), never fewer. Validation windows are fixed, evenly spaced over the ``val`` split,
and independent of the seed, so validation losses of different runs compare (``ValidationSource``).
"""
from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from baton.errors import BatonError
from baton.model_spec import ModelSpec
from runtime.model.rng import _key
from runtime.data.tokens import FORMAT, is_dataset_dir

SYNTHETIC_TOKENS = 1 << 16
META = "meta.json"


def synthetic_tokens(vocab_size: int, seed: int, length: int = SYNTHETIC_TOKENS) -> np.ndarray:
    """A learnable stream: t[i+1] = (5 t[i] + 3 + r_i) mod V with r_i uniform in {0..3}."""
    rng = np.random.default_rng(seed)
    noise = rng.integers(0, 4, size=length)
    out = np.empty(length, dtype=np.int64)
    t = int(rng.integers(0, vocab_size))
    for i in range(length):
        out[i] = t
        t = (5 * t + 3 + int(noise[i])) % vocab_size
    return out


# --- prepared datasets -----------------------------------------------------------------------------


class TokenDataset:
    """A directory written by ``baton data prepare``: ``meta.json`` checked, splits memory-mapped."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        meta_file = self.path / META
        if not meta_file.is_file():
            raise BatonError("not a token dataset (no meta.json; make one with `baton data prepare`)", source=str(self.path),
                             field="--data")
        try:
            meta = json.loads(meta_file.read_bytes().decode("utf-8"))
        except (ValueError, UnicodeDecodeError, RecursionError):
            raise BatonError("malformed meta.json: not UTF-8 JSON", source=str(meta_file)) from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            got = meta.get("format") if isinstance(meta, dict) else None
            raise BatonError(f"unsupported token dataset format {got!r} (expected '{FORMAT}')", source=str(meta_file), field="format")
        if meta.get("dtype") not in ("uint16", "uint32"):
            raise BatonError(f"must be uint16 or uint32, got {meta.get('dtype')!r}", source=str(meta_file), field="dtype")
        vocab = meta.get("vocab_size")
        if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
            raise BatonError(f"must be a positive integer, got {vocab!r}", source=str(meta_file), field="vocab_size")
        splits = meta.get("splits")
        if not isinstance(splits, dict) or "train" not in splits:
            raise BatonError("has no 'train' split", source=str(meta_file), field="splits")
        self.meta, self.dtype, self.vocab_size = meta, np.dtype(meta["dtype"]), vocab
        self._maps: dict[str, np.ndarray] = {}

    def num_tokens(self, split: str) -> int:
        entry = self.meta["splits"].get(split)
        return int(entry.get("tokens", 0)) if isinstance(entry, dict) else 0

    def split(self, name: str) -> np.ndarray:
        """The split's tokens as a read-only memory map; its size must match meta.json."""
        if name in self._maps:
            return self._maps[name]
        entry = self.meta["splits"].get(name)
        meta_file = str(self.path / META)
        if not isinstance(entry, dict) or not isinstance(entry.get("file"), str) or not isinstance(entry.get("tokens"), int):
            raise BatonError(f"has no usable '{name}' split", source=meta_file, field="splits")
        file = self.path / entry["file"]
        if Path(entry["file"]).name != entry["file"] or not file.is_file():
            raise BatonError(f"split '{name}': {entry['file']} is missing", source=str(self.path), field="splits")
        want = entry["tokens"] * self.dtype.itemsize
        if file.stat().st_size != want:
            raise BatonError(f"{entry['file']} has {file.stat().st_size} bytes, meta.json says {entry['tokens']} "
                             f"{self.dtype.name} tokens ({want} bytes)", source=str(self.path), field="splits")
        tokens = np.memmap(file, dtype=self.dtype, mode="r") if want else np.zeros(0, dtype=self.dtype)
        self._maps[name] = tokens
        return tokens

    @property
    def tokenizer_file(self) -> Path | None:
        """The dataset's tokenizer.json, when it has one."""
        name = (self.meta.get("tokenizer") or {}).get("file") if isinstance(self.meta.get("tokenizer"), dict) else None
        f = self.path / name if isinstance(name, str) and Path(name).name == name else None
        return f if f is not None and f.is_file() else None

    def verify(self) -> None:
        """Re-hash every split against meta.json (reads every token: for a check, not every start)."""
        for name, entry in self.meta["splits"].items():
            tokens, h = self.split(name), hashlib.sha256()
            for start in range(0, len(tokens), 1 << 22):
                h.update(np.ascontiguousarray(tokens[start: start + (1 << 22)]).tobytes())
            if h.hexdigest() != entry.get("sha256"):
                raise BatonError(f"{entry['file']} does not match its SHA-256 in meta.json", source=str(self.path), field="splits")


def open_dataset(path: str | Path, spec: ModelSpec, *, need_val: bool = False) -> TokenDataset:
    """The dataset at ``path``, checked against the model: its vocabulary fits the model's, and the
    train split (and, with ``need_val``, the val split) holds at least one window of seq_len + 1 tokens."""
    ds = TokenDataset(path)
    if ds.vocab_size > spec.vocab_size:
        raise BatonError(f"the data's tokenizer has {ds.vocab_size} tokens, more than the model's vocab_size {spec.vocab_size} "
                         f"(model '{spec.name}'); use a model with vocab_size >= {ds.vocab_size}",
                         source=str(ds.path / META), field="vocab_size")
    for split in ("train", "val") if need_val else ("train",):
        n = ds.num_tokens(split)
        if n < spec.seq_len + 1:
            raise BatonError(f"the {split} split has {n} tokens, fewer than seq_len + 1 = {spec.seq_len + 1}",
                             source=str(ds.path / META), field="splits")
        ds.split(split)  # sizes checked now, not in a rank
    return ds


def check_data_file(path: str | Path, spec: ModelSpec) -> None:
    """Raise a one-line BatonError unless ``path`` is a token dataset or a readable byte file usable with ``spec``."""
    p = Path(path)
    if p.is_dir():
        open_dataset(p, spec)
        return
    if not p.is_file():
        raise BatonError("data file not found", source=str(p), field="--data")
    _refuse_token_ids(p)
    if spec.vocab_size < 256:
        raise BatonError(f"byte-level text needs vocab_size >= 256, the model has {spec.vocab_size}",
                         source=str(p), field="--data")
    size = p.stat().st_size
    if size < spec.seq_len + 2:
        raise BatonError(f"file has {size} bytes, fewer than seq_len + 2 = {spec.seq_len + 2}",
                         source=str(p), field="--data")


BINARY_PROBE_BYTES = 1 << 16
"""How much of a --data file is read to tell text from binary token ids."""


def _refuse_token_ids(p: Path) -> None:
    """A file of token ids (a split of a prepared dataset, or nanoGPT's uint16 ``train.bin``) read as bytes
    would train on the halves of its numbers without a word; text has no NUL byte, token ids almost always do
    (every id below 256, or a multiple of 256, holds one)."""
    if is_dataset_dir(p.parent):
        raise BatonError(f"is one split of a prepared dataset: give its directory, --data {p.parent}",
                         source=str(p), field="--data")
    with open(p, "rb") as fh:
        head = fh.read(BINARY_PROBE_BYTES)
    if b"\0" in head:
        raise BatonError("is binary (NUL bytes), not text: token ids such as nanoGPT's train.bin are not read "
                         "as text; give a text file, or a directory made by `baton data prepare`",
                         source=str(p), field="--data")


def data_fingerprint(path: str | Path | None) -> dict:
    """What identifies the training data in a checkpoint: None for synthetic tokens; for a dataset its
    ``content_sha256`` (from meta.json) and token counts; for a byte file its size and a SHA-256 of its
    first and last MiB (cheap for any size, and any edit of a text file shows there)."""
    if path is None:
        return {"path": None}
    p = Path(path)
    if p.is_dir():
        ds = TokenDataset(p)
        return {"path": str(path), "kind": "tokens", "fingerprint": ds.meta.get("content_sha256"),
                "tokens": {s: ds.num_tokens(s) for s in ds.meta["splits"]}, "vocab_size": ds.vocab_size}
    size = p.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(p, "rb") as fh:
        h.update(fh.read(1 << 20))
        if size > 1 << 20:
            fh.seek(max(size - (1 << 20), 1 << 20))
            h.update(fh.read(1 << 20))
    return {"path": str(path), "bytes": size, "fingerprint": h.hexdigest()}


# --- what the engine reads -------------------------------------------------------------------------


def _windows(tokens: np.ndarray, offsets, length: int) -> torch.Tensor:
    return torch.from_numpy(np.stack([np.asarray(tokens[o: o + length], dtype=np.int64) for o in offsets]))


class TokenSource:
    """Windows of a token stream addressed by (step, index in the step's global batch)."""

    def __init__(self, spec: ModelSpec, *, path: str | None = None, seed: int = 0, global_batch: int = 1,
                 start_step: int = 0, start_sample: int = 0):
        self.seq_len, self.seed, self.global_batch = spec.seq_len, seed, global_batch
        self.start_step, self.start_sample = start_step, start_sample
        if path is None:
            self.tokens = synthetic_tokens(spec.vocab_size, seed)
        elif Path(path).is_dir():
            self.tokens = open_dataset(path, spec).split("train")
        else:
            check_data_file(path, spec)
            self.tokens = np.memmap(path, dtype=np.uint8, mode="r")
        self.span = len(self.tokens) - (self.seq_len + 1)

    def samples_before(self, step: int) -> int:
        """Samples consumed by the steps before ``step`` (a resumed run may have used another batch size)."""
        return self.start_sample + (step - self.start_step) * self.global_batch

    def offset(self, sample: int) -> int:
        """Where sample ``sample`` of the run starts: a function of (seed, sample) only."""
        return _key(self.seed, sample) % (self.span + 1)

    def batch(self, step: int, samples: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets (B, T) for the given sample indices of step ``step``."""
        base = self.samples_before(step)
        w = _windows(self.tokens, [self.offset(base + k) for k in samples.tolist()], self.seq_len + 1)
        return w[:, :-1], w[:, 1:]


class ValidationSource:
    """Fixed windows of a dataset's ``val`` split, in batches of ``global_batch`` samples.

    Window j starts at ``j * stride`` with the stride spreading ``num_windows`` windows evenly over the
    split (non-overlapping when the split is long enough). The windows do not depend on the seed or the
    plan; ``batch(i, samples)`` has ``TokenSource.batch``'s signature, so the engine's forward pass reads
    batch i of validation as it reads step i of training."""

    def __init__(self, spec: ModelSpec, path: str | Path, *, global_batch: int, max_windows: int | None = None):
        self.seq_len, self.global_batch = spec.seq_len, global_batch
        self.tokens = open_dataset(path, spec, need_val=True).split("val")
        span = len(self.tokens) - (self.seq_len + 1)
        fit = max(1, len(self.tokens) // (self.seq_len + 1))
        self.num_windows = min(fit, max_windows) if max_windows else fit
        self.stride = span // max(1, self.num_windows - 1) if self.num_windows > 1 else 0
        self.num_batches = math.ceil(self.num_windows / global_batch)

    def batch(self, index: int, samples: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets (B, T) of samples ``samples`` of validation batch ``index`` (the last batch
        wraps around to the first windows so every batch is full)."""
        rows = [(index * self.global_batch + k) % self.num_windows for k in samples.tolist()]
        w = _windows(self.tokens, [j * self.stride for j in rows], self.seq_len + 1)
        return w[:, :-1], w[:, 1:]


def validation_loss(loss_of: Callable[[torch.Tensor, torch.Tensor], float], source: ValidationSource) -> float:
    """Mean cross-entropy over every validation window: ``loss_of(inputs, targets)`` returns the mean loss of
    one batch (a single-device model's forward, or a plan's forward pass); windows counted once each."""
    total, seen = 0.0, 0
    for i in range(source.num_batches):
        n = min(source.global_batch, source.num_windows - i * source.global_batch)
        x, y = source.batch(i, torch.arange(n))
        total += float(loss_of(x, y)) * n
        seen += n
    return total / seen


@torch.no_grad()
def model_validation_loss(model, source: ValidationSource) -> float:
    """``validation_loss`` of a single-device ``runtime.model.gpt.GPT`` (evaluation mode: no dropout)."""
    was = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        return validation_loss(lambda x, y: model(x.to(device), y.to(device))[1].item(), source)
    finally:
        model.train(was)


def is_token_dataset(path: str | Path | None) -> bool:
    """Whether ``--data path`` names a prepared dataset (rather than a byte file)."""
    return path is not None and is_dataset_dir(path)
