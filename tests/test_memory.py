"""Memory accounting against values worked out by hand for the tiny model (fp32, dropout 0.1).

Tiny: h=64, a=4, f=256, s=32, V=256; with micro-batch b=2 one (b,s,h) fp32 tensor is 16384 bytes, one
(b,a,s,s) fp32 tensor 32768 bytes, a (b,s,f) tensor 65536 bytes, a (b,a,s,s) byte mask 8192, a (b,s,h)
byte mask 4096 and LayerNorm statistics 2*32*8 = 512 bytes.
"""
from __future__ import annotations

import pytest

from baton.costmodel import layer_cost, optimizer_bytes
from baton.evaluate import evaluate
from baton.profile import ProfileSet
from baton.cluster import homogeneous_cpu_cluster
from baton.memory import recompute_space, tensor_bytes
from baton.model_spec import PRESETS
from baton.operators import layer_operators
from baton.plan import simple_plan
from baton.profile import Profile, derive_table

TINY = PRESETS["tiny"]
BSH, BASS, BSF, MASK_ASS, MASK_SH, STATS = 16384, 32768, 65536, 8192, 4096, 512
# No recompute: 8 (b,s,h) tensors (layer input, ln1_out, q, k, v, ctx, x_mid, ln2_out), probs and
# probs_dropped, fc1_out and gelu_out, three masks, two LayerNorm statistics.
FULL = 8 * BSH + 2 * BASS + 2 * BSF + MASK_ASS + 2 * MASK_SH + 2 * STATS


@pytest.fixture(scope="module")
def profile():
    return Profile(derive_table(TINY, "cpu", micro_batches=(1, 2)))


def held(profile, recompute, share=1.0):
    c = layer_cost(profile, TINY, 2, share, frozenset(recompute))
    return c.held_bytes, c.transient_bytes


def test_no_recompute_keeps_every_saved_tensor(profile):
    assert held(profile, set()) == (FULL, 0)


def test_recomputing_softmax_alone_saves_nothing(profile):
    """Softmax keeps its output; recomputing it needs its input (scores) kept instead: same bytes."""
    h, transient = held(profile, {"softmax"})
    assert h == FULL and transient == BASS


def test_recomputing_scores_and_softmax_frees_probs_but_keeps_q_k(profile):
    h, transient = held(profile, {"attn_scores", "softmax"})
    assert h == FULL - BASS and transient == BASS


def test_output_is_freed_only_when_its_consumer_is_recomputed_too(profile):
    """The pair rule: gelu's output is kept by fc2 unless fc2 is recomputed as well."""
    assert held(profile, {"gelu"})[0] == FULL
    assert held(profile, {"gelu", "fc2"})[0] == FULL - BSF


def test_recomputing_everything_keeps_only_the_layer_input_and_allreduce_results(profile):
    everything = {o for o in ["ln1", "qkv", "attn_scores", "softmax", "attn_dropout", "attn_v", "out_proj", "resid1",
                              "ln2", "fc1", "gelu", "fc2", "resid2"]}
    h, transient = held(profile, everything)
    # The layer input, attn_out and mlp_out (the all-reduce is never re-run), and x_mid, which resid2's
    # segment reads across the mlp all-reduce: exactly what the runtime's checkpoints keep.
    assert h == 4 * BSH
    assert transient == FULL - 2 * BSH  # x_mid is kept, so ln2 re-reads it instead of re-creating it


def test_recomputed_producer_and_consumer_in_different_segments_keep_the_tensor(profile):
    """qkv and attn_v recomputed with the ops between them kept: two segments, so v stays (attn_v's
    segment starts from it), and q, k stay for attn_scores: nothing is freed."""
    assert held(profile, {"qkv", "attn_v"})[0] == FULL
    # With every op from qkv to attn_v recomputed they form one segment and v, q, k, probs, probs_dropped go.
    h, _ = held(profile, {"qkv", "attn_scores", "softmax", "attn_dropout", "attn_v"})
    assert h == FULL - 3 * BSH - 2 * BASS - MASK_ASS


def test_tensor_parallel_share_shrinks_only_split_tensors(profile):
    h, _ = held(profile, set(), share=0.5)
    split = 4 * BSH + 2 * BASS + 2 * BSF + MASK_ASS  # q, k, v, ctx, probs x2, fc1/gelu, attention mask
    assert h == FULL - split / 2


def test_static_memory_is_16_bytes_per_parameter_and_matches_hand_count(profile):
    """One device holding the whole tiny model: weights, grads and Adam state for every parameter."""
    per_layer = 4 * 64 + (3 * 64 * 64 + 3 * 64) + (64 * 64 + 64) + (64 * 256 + 256) + (256 * 64 + 64)
    params = 4 * per_layer + 256 * 64 + 32 * 64 + 2 * 64
    assert params == TINY.num_params()
    plan = simple_plan(TINY, cluster="cpu", stages=[[("local:0", 4)]], layers=[4], units_per_layer=4,
                       micro_batch_size=2, num_microbatches=3)
    rep = evaluate(plan, homogeneous_cpu_cluster(1), ProfileSet(TINY, tables={"cpu": profile}))
    d = rep.devices[0]
    assert d.weights_bytes == params * 4
    assert d.weights_bytes + d.grads_bytes + d.optimizer_bytes == 16 * params
    # One stage: one micro-batch in flight: 4 layers + embedding's token ids + head's saved tensors
    # (LayerNorm input, statistics and output, the fp32 softmax, the int64 targets).
    head_saved = 2 * BSH + 2 * 32 * 8 + 2 * 32 * 256 * 4 + 2 * 32 * 8
    assert d.activation_bytes == 4 * FULL + 2 * 32 * 8 + head_saved


def test_pipeline_stages_hold_min_p_minus_s_m_microbatches(profile):
    cluster = homogeneous_cpu_cluster(3)
    plan = simple_plan(TINY, cluster="cpu", stages=[[("local:0", 1)], [("local:1", 1)], [("local:2", 1)]],
                       layers=[2, 1, 1], units_per_layer=1, micro_batch_size=2, num_microbatches=8)
    rep = evaluate(plan, cluster, ProfileSet(TINY, tables={"cpu": profile}))
    acts = [d.activation_bytes for d in rep.devices]
    assert acts[0] == 3 * (2 * FULL + 2 * 32 * 8)
    assert acts[1] == 2 * FULL


def test_mixed_precision_optimizer_state():
    spec = PRESETS["gpt3-1.3b"]
    assert optimizer_bytes(2.0 * 1000, spec) == 1000 * 12  # fp32 master + two moments per fp16 parameter


def test_measured_totals_rescale_tensor_sizes():
    """A measured table that reports twice the analytic saved bytes for fc1 doubles ln2_out only."""
    sizes = tensor_bytes(TINY, 2, 1.0, _analytic_saved(), _analytic_out())
    assert sizes["ln2_out"] == BSH  # analytic totals: unchanged
    scaled = _analytic_saved() | {"fc1": 2 * BSH}
    sizes = tensor_bytes(TINY, 2, 1.0, scaled, _analytic_out())
    assert sizes["ln2_out"] == 2 * BSH and sizes["fc1_out"] == BSF
    space = recompute_space(TINY, (frozenset(),))
    h = sum(sizes[t] * space.held[0, j] for j, t in enumerate(space.tensors))
    assert h == FULL + BSH


def _analytic_saved():
    p = Profile(derive_table(TINY, "cpu", micro_batches=(2,)))
    return {o.name: p.cost(o.name, 2, 1.0).saved_bytes for o in layer_operators(TINY)}


def _analytic_out():
    p = Profile(derive_table(TINY, "cpu", micro_batches=(2,)))
    return {o.name: p.cost(o.name, 2, 1.0).output_bytes for o in layer_operators(TINY)}
