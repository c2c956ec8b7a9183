"""Training tokens: any local file read as bytes (vocabulary 256), or a synthetic stream.

Sample n of the run (n = samples consumed before the step + index in the step) is the window of seq_len + 1 tokens at
an offset that is a hash of (seed, n): every rank, plan and resumed run sees the same samples in the same
order, and the data position in a checkpoint is just a sample count.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from baton.errors import BatonError
from baton.model_spec import ModelSpec
from runtime.rng import _key

SYNTHETIC_TOKENS = 1 << 16


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


class TokenSource:
    """Windows of a token stream addressed by (step, index in the step's global batch)."""

    def __init__(self, spec: ModelSpec, *, path: str | None = None, seed: int = 0, global_batch: int = 1,
                 start_step: int = 0, start_sample: int = 0):
        self.seq_len, self.seed, self.global_batch = spec.seq_len, seed, global_batch
        self.start_step, self.start_sample = start_step, start_sample
        if path is None:
            self.tokens = synthetic_tokens(spec.vocab_size, seed)
        else:
            check_data_file(path, spec)
            self.tokens = np.memmap(path, dtype=np.uint8, mode="r")
        self.span = len(self.tokens) - (self.seq_len + 1)

    def samples_before(self, step: int) -> int:
        """Samples consumed by the steps before ``step`` (a resumed run may have used another batch size)."""
        return self.start_sample + (step - self.start_step) * self.global_batch

    def batch(self, step: int, samples: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets (B, T) for the given sample indices of step ``step``."""
        rows, base = [], self.samples_before(step)
        for k in samples.tolist():
            off = _key(self.seed, base + k) % (self.span + 1)
            rows.append(np.asarray(self.tokens[off: off + self.seq_len + 1], dtype=np.int64))
        w = torch.from_numpy(np.stack(rows))
        return w[:, :-1], w[:, 1:]


def check_data_file(path: str | Path, spec: ModelSpec) -> None:
    """Raise a one-line BatonError unless ``path`` is a readable byte file usable with ``spec``."""
    p = Path(path)
    if not p.is_file():
        raise BatonError("data file not found", source=str(p), field="--data")
    if spec.vocab_size < 256:
        raise BatonError(f"byte-level text needs vocab_size >= 256, the model has {spec.vocab_size}",
                         source=str(p), field="--data")
    size = p.stat().st_size
    if size < spec.seq_len + 2:
        raise BatonError(f"file has {size} bytes, fewer than seq_len + 2 = {spec.seq_len + 2}",
                         source=str(p), field="--data")
