"""Parallel runs over gloo match the single-device model: loss and every gradient after one step, and
the losses of three AdamW steps, within 1e-5 relative (fp32 tiny GPT, real processes).

Every run also checks that each rank recomputed exactly the operators its plan entry lists (counted per
operator) and that an uneven all-gather reassembles a weight split 3:1 or 1:2:1.
"""
from __future__ import annotations

import pytest

from tests.runtime_helpers import assert_parity, plan_of, tiny

ATTN_CORE = ["attn_scores", "softmax", "attn_dropout"]


def test_tensor_parallel_3_to_1_one_stage():
    """TP 3:1 in one stage, dropout on, each rank recomputing different operators.

    Catches: uneven head/column slicing (q, k, v rows of c_attn are three separate ranges), a row-parallel
    bias added on every rank, dropout masks indexed by local instead of global head, a missing all-reduce
    in backward of the column-parallel input, and a deadlock from ranks recomputing different operators.
    """
    plan = plan_of(tiny(0.1), [[3, 1]], [4], 4, m=2,
                   recompute={0: ATTN_CORE, 1: ["fc1", "gelu", "fc2", "resid2", "ln1"]})
    assert_parity(plan)


@pytest.mark.long  # a TP stage inside a pipeline, recomputing across out_proj's all-reduce: test_embedding_only_and_head_only_stages
def test_two_stages_1_2_1_split_recompute_across_allreduce():
    """PP=2: stage 0 split 1:2:1 over three ranks (3 layers), stage 1 one rank (1 layer), m=3.

    Catches: wrong pairing between stages of different sizes (three senders, one receiver, and back),
    the tied embedding's gradient not summed between the first and last stage, and a recomputed segment
    that swallows the out_proj all-reduce (qkv..ln2 recomputed must be split around it).
    """
    plan = plan_of(tiny(0.1), [[1, 2, 1], [1]], [3, 1], [4, 1], m=3,
                   recompute={1: ["qkv", "attn_scores", "softmax", "attn_dropout", "attn_v", "out_proj", "resid1", "ln2"],
                              3: ["gelu"]})
    assert_parity(plan)


@pytest.mark.long  # three stages (1F1B warm-up and cool-down), one split, run quick in test_embedding_only_and_head_only_stages
def test_three_stages_uneven_layers_no_dropout():
    """PP=3 with 1/2/1 layers, the middle stage split 3:1, four micro-batches, dropout off.

    Catches: a wrong 1F1B warm-up (min(p-s-1, m)) or cool-down order (deadlock or mixed-up
    micro-batches), uneven layer ranges, and the dropout-free operator list (no attn_dropout).
    """
    plan = plan_of(tiny(0.0), [[1], [3, 1], [1]], [1, 2, 1], [1, 4, 1], m=4, recompute={2: ["ln1", "qkv"]})
    assert_parity(plan)


def test_embedding_only_and_head_only_stages():
    """Three stages: embedding only, all 4 layers split 1:3, head only; widths 1 -> 2 -> 1.

    Catches: stages that hold no layer (first sends embeddings, last receives from two ranks' pairing
    and sends its gradient back to both), and a rank recomputing every operator of its layers.
    """
    everything = ["ln1", "qkv", "attn_scores", "softmax", "attn_dropout", "attn_v", "out_proj", "resid1",
                  "ln2", "fc1", "gelu", "fc2", "resid2"]
    plan = plan_of(tiny(0.1), [[1], [1, 3], [1]], [0, 4, 0], [1, 4, 1], m=2, recompute={2: everything})
    assert_parity(plan)


@pytest.mark.long  # replicas (with dropout) run quick in test_data_parallel.py (tp3:1+pp2)
def test_data_parallel_replicas():
    """Two pipelines of two single-rank stages (3 + 1 layers).

    Catches: replica gradients not all-reduced, the loss normalised per replica instead of by the global
    batch, and replicas reading the same samples or drawing the same dropout masks.
    """
    plan = plan_of(tiny(0.1), [[1], [1]], [3, 1], 1, m=2, replicas=2)
    assert_parity(plan)
