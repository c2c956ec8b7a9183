"""The Llama layer in the runtime (issue 24): what it keeps, and parallel runs against the single device.

Checked: a Llama layer keeps exactly the bytes of the tensor model (baton.memory's liveness rule over
baton.operators' Llama sizes) for every recompute choice tried, at shares 1 and 3/4 (grouped-query
attention: 8 query heads over 4 KV heads, units of one KV head); the embedding and the head (tied and
untied) keep and hold what ``analytic_edge_cost`` says at every valid vocabulary share; runs over 1, 2 and
4 gloo processes follow the single-device ``runtime.model.llama.Llama`` (loss and every gradient slice
after one step, then the losses of AdamW steps) for plans with uneven TP, pipelines, recomputation,
replicas, sharded state (ZeRO 1-3), bf16 and the tied head's gradient sum.
"""
from __future__ import annotations

import pytest
import torch

from baton.model_spec import PRESETS
from baton.operators import operator_names
from runtime.model.family import init_parameter, reference_model
from runtime.parallel.stage import StageModel
from runtime.parallel.tp_layer import MicroBatch
from tests.runtime_helpers import assert_parity, plan_of, rel_err
from tests.test_fused_vocab_parallel import (_layer_saved_bytes, _predicted_layer_bytes,
                                             assert_edges_keep_and_hold_what_the_cost_model_says)

UNTIED, TIED = PRESETS["tiny-llama"], PRESETS["tiny-llama-tied"]


RECOMPUTE_SETS = [[], ["rms1"], ["rope"], ["qkv", "rope"], ["rope", "attn_core"], ["rms1", "qkv", "rope", "attn_core", "out_proj"],
                  ["attn_core", "out_proj", "resid1"], ["swiglu"], ["gate_up", "swiglu"], ["swiglu", "down"],
                  ["rms2", "gate_up", "swiglu", "down", "resid2"], "all"]


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_llama_layer_keeps_exactly_the_bytes_of_the_tensor_model(dropout):
    """Measured saved bytes equal the prediction to the byte (fp32), shares 1 and 3/4.

    Catches: an RMSNorm keeping its fp32 copy or normalised output, rope keeping its tables or inputs, a
    SwiGLU keeping the SiLU output, v pinning a fused qkv storage, k and v counted at the query width, and
    out_proj copying a fused output laid out (B, heads, T, hs)."""
    spec = UNTIED.with_overrides(dropout=dropout)
    for recompute in RECOMPUTE_SETS:
        recompute = operator_names(spec) if recompute == "all" else recompute
        for heads in (range(8), range(2, 8)):
            share = len(heads) / spec.num_heads
            assert _layer_saved_bytes(spec, heads, recompute) == _predicted_layer_bytes(spec, share, recompute), (recompute, share)


@pytest.mark.parametrize("spec", [UNTIED, TIED], ids=["untied", "tied"])
def test_llama_edges_keep_and_hold_what_the_cost_model_says(spec):
    """At every valid (U, units before, units), the embedding's and the head's saved and parameter bytes equal
    ``analytic_edge_cost`` at share u/U (an untied head's own rows in the head's row; a tied head's are the
    embedding's). Catches: a position embedding on a Llama, the RMSNorm's statistics miscounted, an untied
    head's rows left out or a tied head holding two copies."""
    assert_edges_keep_and_hold_what_the_cost_model_says(spec)


def test_parallel_layer_on_one_rank_is_the_reference_model():
    """A one-stage StageModel holding everything computes the reference model's loss and gradients.
    Catches: custom RMSNorm, rotary or SwiGLU backward formulas that are wrong, q/k/v heads read in another
    order than the reference's grouped-query attention."""
    spec = UNTIED
    ref = reference_model(spec, seed=0)
    model = StageModel(spec, layers=range(spec.num_layers), heads=range(spec.num_heads), ffn_cols=range(spec.ffn_dim),
                       first=True, last=True)
    model.load_full(lambda n: init_parameter(spec, n, 0))
    idx = torch.randint(spec.vocab_size, (2, spec.seq_len), generator=torch.Generator().manual_seed(3))
    _, loss = ref(idx, idx)
    loss.backward()
    total = model(idx, MicroBatch(seed=0, step=0, samples=torch.arange(2)), targets=idx)
    (total / idx.numel()).backward()
    assert total.item() / idx.numel() == pytest.approx(loss.item(), rel=1e-6)
    grads = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        assert rel_err(grads[name].grad, p.grad) < 1e-5, name


# --- gloo processes ------------------------------------------------------------------------------


@pytest.mark.long  # the layer above checks one rank's model in this process, the TP test below a run of two ranks
def test_one_process():
    assert_parity(plan_of(UNTIED, [[1]], [4], 1, m=2))


def test_uneven_tensor_parallel_3_to_1_with_recompute():
    """TP 3:1 over KV-head units (6 and 2 query heads), each rank recomputing different operators.
    Catches: k/v rows cut by query heads instead of KV heads, a rank's KV heads paired with another's query
    heads, rope recomputed with other tables, and a deadlock from ranks recomputing different operators."""
    plan = plan_of(UNTIED, [[3, 1]], [4], 4, m=2,
                   recompute={0: ["rope", "attn_core"], 1: ["gate_up", "swiglu", "down", "rms1"]})
    assert_parity(plan)


@pytest.mark.long  # a tied head summed over the pipeline's ends runs quick on GPT-2 (test_fused_vocab_parallel.py's checkpoint test)
def test_pipeline_1_2_1_then_one_rank_tied_head():
    """Two stages (1:2:1 over three ranks with 3 layers, one rank with 1 layer), tied head: the embedding's
    gradient summed between the first and last stage. Catches: the tied sum skipped for Llama, a head on the
    last stage without the embedding's rows, recompute segments across the out_proj all-reduce."""
    plan = plan_of(TIED, [[1, 2, 1], [1]], [3, 1], [4, 1], m=3,
                   recompute={1: ["qkv", "rope", "attn_core", "out_proj", "resid1", "rms2"], 3: ["swiglu"]})
    assert_parity(plan)


@pytest.mark.long  # replicas with an untied head run quick in test_sharded_state_follows_the_single_device_run (zero1, untied)
def test_replicas_of_two_stage_pipelines_untied_head():
    """Two replicas of two single-rank stages, untied head (no tied sum; the head's rows are a peer piece of
    their own). Catches: an untied head's gradient never summed over replicas, or summed with the embedding's."""
    plan = plan_of(UNTIED, [[1], [1]], [3, 1], 1, m=2, replicas=2)
    assert_parity(plan)


@pytest.mark.long  # uneven TP over KV heads runs quick in test_uneven_tensor_parallel_3_to_1_with_recompute
def test_four_ranks_tp_2_1_1_dropout():
    """TP 2:1:1 on four KV heads, residual dropout on: masks drawn by global position, as the reference."""
    spec = UNTIED.with_overrides(dropout=0.1)
    plan = plan_of(spec, [[2, 1, 1]], [4], 4, m=2, recompute={1: ["out_proj", "resid1"], 2: ["rms2", "gate_up"]})
    assert_parity(plan)


@pytest.mark.parametrize("spec", [UNTIED, TIED], ids=["untied", "tied"])
def test_measured_table_has_the_derived_bytes(spec):
    """``baton profile --device`` on a Llama measures its operators, and every row's saved and parameter bytes
    equal the derivation's (edges at every share, the untied head's rows included)."""
    from baton.profile import derive_table
    from runtime.measure.op_profiler import profile_table

    shares = (0.25, 0.75, 1.0)
    measured = profile_table(spec, micro_batches=(2,), shares=shares, warmup=0, reps=1)
    derived = derive_table(spec, "cpu", micro_batches=(2,), shares=shares)
    assert set(operator_names(spec)) <= set(measured["op"])
    joined = measured.merge(derived, on=["op", "micro_batch", "tp_share"], suffixes=("_m", "_d"))
    assert len(joined) == len(measured) - 1  # every row but the optimizer's
    for col in ("saved_bytes", "param_bytes"):
        bad = joined[joined[f"{col}_m"] != joined[f"{col}_d"]]
        assert bad.empty, bad[["op", "tp_share", f"{col}_m", f"{col}_d"]].to_string()


# --- sharded state, bf16, resume (the GPT tests' machinery, on Llama plans) ---------------------------

LLAMA_PP_AND_SINGLE = [dict(stages=[[1], [1]], layers=[3, 1], units=1, m=3, mbs=2),
                       dict(stages=[[1]], layers=[4], units=1, m=1, mbs=2)]
"""A two-stage replica beside a single device (3 x 2 and 1 x 2 samples)."""
LLAMA_TP_AND_SINGLE = [dict(stages=[[3, 1]], layers=[4], units=4, m=3, mbs=2,
                            recompute={0: ["gate_up", "swiglu"], 1: ["rope", "attn_core"]}),
                       dict(stages=[[1]], layers=[4], units=1, m=1, mbs=2)]
"""Replica 0: TP 3:1 over KV-head units, each rank recomputing other operators; replica 1 one device."""


# Under -m long: the tied head (Hugging Face's tied Llama is imported quick in test_llama_hf.py), and stages 2 and 3
# (layer by layer; GPT-2 at stages 2 and 3, with TP beside a single device, runs quick in test_zero_stages.py).
@pytest.mark.parametrize("spec", [UNTIED, pytest.param(TIED, marks=pytest.mark.long)], ids=["untied", "tied"])
@pytest.mark.parametrize("stage,replicas,ratios", [(1, LLAMA_PP_AND_SINGLE, [0.7, 0.7, 0.3]),
                                                  pytest.param(2, LLAMA_TP_AND_SINGLE, [0.0, 0.0, 1.0], marks=pytest.mark.long),
                                                  pytest.param(3, LLAMA_TP_AND_SINGLE, [0.3, 0.3, 0.7], marks=pytest.mark.long)],
                         ids=["zero1-pp2+single", "zero2-tp3:1+single", "zero3-tp3:1+single"])
def test_sharded_state_follows_the_single_device_run(spec, stage, replicas, ratios):
    """ZeRO 1 (a pipeline beside a single device), ZeRO 2 and 3 (layer by layer, TP 3:1 beside a single device),
    shard ratios uneven (0/1 at stage 2), weight decay, clipping and a schedule: losses, norms and the gathered final weights
    and moments follow the single device (``tests/test_data_parallel.py``'s checks). Catches an untied head's
    rows missing from the peer pieces or the unit of the edges, and KV rows gathered into the wrong place."""
    from tests.runtime_helpers import replicas_plan
    from tests.test_data_parallel import assert_follows_reference, run_plan

    plan = replicas_plan(spec.with_overrides(dropout=0.1), replicas, zero_stage=stage, ratios=ratios)
    assert_follows_reference(plan, run_plan(plan))


@pytest.mark.long  # bf16 TP 3:1 with recomputation runs quick on GPT-2 (test_mixed_precision.py); this is Llama's RMSNorm, SwiGLU, rope
def test_bf16_tp_3_1_follows_the_single_device_bf16_run():
    """bf16 weights and activations with fp32 masters, TP 3:1 with recomputation, against the single-device
    bf16 run (tolerances of tests/test_mixed_precision.py: losses 2e-3 absolute, step-0 gradients 4e-2 relative).
    Catches an RMSNorm or SwiGLU backward that loses precision in bf16 and rotary tables left in fp32."""
    from runtime.parallel.slicing import take_slice
    from tests.runtime_helpers import run_ranks
    from tests.test_mixed_precision import LR, STEPS, bf16_worker

    spec = UNTIED.with_overrides(dtype="bf16")
    ref = run_ranks(bf16_worker, 1, plan_of(spec, [[1]], [4], 1, m=2), STEPS, LR)[0]
    plan = plan_of(spec, [[3, 1]], [4], 4, m=2, recompute={1: ["rms2", "gate_up", "swiglu"]})
    for res in run_ranks(bf16_worker, 2, plan, STEPS, LR):
        assert res["param_dtypes"] == res["grad_dtypes"] == {torch.bfloat16} and res["master_dtypes"] == {torch.float32}
        for got, want in zip(res["losses"], ref["losses"]):
            assert abs(got - want) <= 2e-3, (res["losses"], ref["losses"])
        for name, g in res["grads"].items():
            assert rel_err(g, take_slice(ref["grads"][name], res["slices"][name])) <= 4e-2, name
    assert ref["losses"][-1] < ref["losses"][0]


@pytest.mark.long  # a resume chain; tests/test_runtime_train.py resumes under another plan in the default run
def test_resume_under_other_plans_keeps_the_loss_curve(tmp_path):
    """Saved under ZeRO 1 (pipeline beside a single device), resumed under TP 3:1 beside a single device at
    stage 0, then under ZeRO 3: the resumed steps' losses equal the uninterrupted run's (1e-5). Catches a
    checkpoint holding KV rows or the untied head's rows in a plan's local layout."""
    from tests.runtime_helpers import replicas_plan
    from tests.test_data_parallel import resume_chain

    spec = UNTIED.with_overrides(dropout=0.1)
    x = replicas_plan(spec, LLAMA_PP_AND_SINGLE, zero_stage=1, ratios=[0.7, 0.7, 0.3])
    y = replicas_plan(spec, LLAMA_TP_AND_SINGLE)
    z = replicas_plan(spec, LLAMA_TP_AND_SINGLE, zero_stage=3, ratios=[0.3, 0.3, 0.7])
    resume_chain(tmp_path, x, y, z)
