"""A rank holding the whole vocabulary takes the unmasked path of the vocabulary-parallel embedding and loss
(``runtime.parallel.vocab_parallel``): the same numbers, bit for bit, as the masked path every other rank takes,
forward and backward, with and without vocabulary padding."""
from __future__ import annotations

import pytest
import torch

from runtime.parallel.vocab_parallel import _VocabEmbedding, _VocabParallelCrossEntropy, holds_every_row, \
    vocab_embedding, vocab_parallel_cross_entropy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padding", [0, 5])
def test_whole_vocabulary_path_equals_the_masked_one(dtype, padding):
    torch.manual_seed(0)
    vocab, hidden, B, T = 37, 8, 3, 11
    rows = vocab + padding
    weight = torch.randn(rows, hidden, dtype=dtype)
    # Columns of a wider batch, as a recomputed or sliced micro-batch may hand them over: not contiguous.
    tokens = torch.randint(0, vocab, (B, 2 * T))[:, ::2]
    targets = torch.randint(0, vocab, (B, 2 * T))[:, 1::2]
    assert not tokens.is_contiguous()
    results = {}
    for whole in (False, True):
        w = weight.clone().requires_grad_()
        x = _VocabEmbedding.apply(w, tokens, 0, whole)
        logits = x @ w.t()  # a tied head over every row, padding included
        loss = _VocabParallelCrossEntropy.apply(logits, targets, 0, vocab, None, whole)
        loss.backward()
        results[whole] = (x.detach(), loss.detach(), w.grad)
    for a, b in zip(results[False], results[True]):
        assert torch.equal(a, b)


def test_only_a_rank_alone_with_every_row_takes_the_whole_path():
    """The whole path's loss is the summed cross-entropy; a rank with some of the rows (of a larger group, or
    profiled alone at a share of the units) keeps the masks."""
    torch.manual_seed(1)
    weight = torch.randn(20, 4, requires_grad=True)
    tokens = torch.randint(0, 20, (2, 5))
    x = vocab_embedding(weight, tokens, 0, whole=holds_every_row(range(0, 20), 20, None))
    assert x.grad_fn is not None and torch.equal(x, weight[tokens])
    logits = torch.randn(2, 5, 20)
    targets = torch.randint(0, 20, (2, 5))
    want = torch.nn.functional.cross_entropy(logits.view(-1, 20), targets.view(-1), reduction="sum")
    assert torch.allclose(vocab_parallel_cross_entropy(logits, targets, 0, 20, None, whole=True), want, rtol=1e-6)
    assert holds_every_row(range(0, 20), 20, None)
    assert not holds_every_row(range(0, 10), 20, None)  # alone, but a share of the rows
    assert not holds_every_row(range(10, 20), 20, None)
    shifted = vocab_embedding(weight, tokens, 10)  # rows 10..29: tokens below 10 are another rank's
    assert torch.equal(shifted[tokens < 10], torch.zeros_like(shifted[tokens < 10]))
