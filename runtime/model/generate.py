"""Sampling text from a checkpoint with the single-device model (nanoGPT's ``generate``).

Each new token is drawn from the last position's logits divided by the temperature, keeping the
``top_k`` most likely tokens; temperature 0 takes the most likely one. The context is cut to the model's
``seq_len`` (learned positions go no further). Draws come from a generator seeded with ``seed`` only, so
a seed gives the same text on every run. Generation stops early at the end-of-text token, when known.
"""
from __future__ import annotations

import torch

from baton.errors import BatonError
from baton.model_spec import ModelSpec


@torch.no_grad()
def sample(model, spec: ModelSpec, prompt: list[int], *, max_new_tokens: int, temperature: float = 1.0,
           top_k: int | None = None, seed: int = 0, stop_id: int | None = None) -> list[int]:
    """``prompt`` followed by up to ``max_new_tokens`` sampled token ids."""
    if not prompt:
        raise BatonError("the prompt encodes to no tokens", field="--prompt")
    if max(prompt) >= spec.vocab_size:
        raise BatonError(f"the prompt has token id {max(prompt)}, beyond the model's vocabulary of {spec.vocab_size}",
                         field="--prompt")
    model.eval()
    device = next(model.parameters()).device
    gen = torch.Generator(device="cpu").manual_seed(seed)
    idx = torch.tensor([prompt], dtype=torch.long, device=device)  # (1, t)
    for _ in range(max_new_tokens):
        logits, _ = model(idx[:, -spec.seq_len:])
        # (1, V): a padded vocabulary's extra rows are never sampled
        logits = logits[:, -1, : spec.vocab_size].float().cpu()
        if temperature == 0.0:
            nxt = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k is not None and top_k < logits.size(-1):
                kth = torch.topk(logits, top_k).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen)
        idx = torch.cat([idx, nxt.to(device)], dim=1)
        if stop_id is not None and int(nxt) == stop_id:
            break
    return idx[0].tolist()
