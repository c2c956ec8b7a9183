"""Fused attention and the vocabulary-parallel embedding, head and cross-entropy (issue 9), on CPU.

Checked: fused and eager attention give the same model; a layer keeps exactly the bytes of the tensor
model (baton.memory's liveness rule over baton.operators' sizes) for either attention, every recompute
choice tried and uneven shares; the embedding and head keep and hold exactly what
``baton.profile.analytic_edge_cost`` says at every valid vocabulary share, padding included; split runs
over gloo follow the single-device model (fused and eager, vocabulary padded, the first and last stage
split differently); a Hugging Face GPT-2 with an odd vocabulary loads into a vocabulary-parallel plan;
checkpoints keep the full unpadded embedding.
"""
from __future__ import annotations

import pytest
import torch

from baton.catalog import CATALOG
from baton.memory import is_held, layer_order, tensor_roles
from baton.model_spec import unit_counts
from baton.operators import operator_names, padded_vocab, tensor_sizes, vocab_rows
from baton.profile import analytic_edge_cost
from runtime.measure.meters import SavedBytes
from runtime.model.family import init_parameter
from runtime.model.gpt import GPT
from runtime.parallel.slicing import put_slice, take_slice, vocab_range
from runtime.parallel.stage import StageModel
from runtime.parallel.tp_layer import MicroBatch
from tests.runtime_helpers import assert_parity, plan_of, rel_err, run_ranks, tiny

ODD_VOCAB = 250  # tiny allows U in {1, 2, 4}: padded to 252 rows, the last 2 padding


# --- one process ---------------------------------------------------------------------------------


def test_fused_and_eager_attention_are_the_same_model():
    """Without dropout the two implementations compute the same function: same loss, same gradients.

    Catches: a fused call without the causal mask or with another scale, q/k/v views in the wrong
    layout, and an out_proj that reads the fused output's heads in the wrong order."""
    idx = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    out = {}
    for attention in ("eager", "fused"):
        model = GPT(tiny(0.0, attention=attention))
        _, loss = model(idx, idx)
        loss.backward()
        out[attention] = loss.item(), {n: p.grad for n, p in model.named_parameters()}
    assert out["fused"][0] == pytest.approx(out["eager"][0], rel=1e-6)
    for name, g in out["eager"][1].items():
        assert rel_err(out["fused"][1][name], g) < 1e-5, name


def _layer_saved_bytes(spec, heads, recompute, B=2):
    """Peak bytes one layer at heads ``heads`` keeps for backward, measured as the engine measures."""
    nf = spec.ffn_dim * len(heads) // spec.num_heads
    cols = range(heads.start * spec.ffn_dim // spec.num_heads, heads.start * spec.ffn_dim // spec.num_heads + nf)
    model = StageModel(spec, layers=range(1), heads=heads, ffn_cols=cols, first=False, last=False,
                       recompute=frozenset(recompute))
    model.load_full(lambda name: init_parameter(spec, name, 0))
    x = torch.randn(B, spec.seq_len, spec.hidden_dim, generator=torch.Generator().manual_seed(1), requires_grad=True)
    saved = SavedBytes(model.parameters())
    model.meter.saved = saved
    with saved.record(0):
        y = model(x, MicroBatch(seed=0, step=0, samples=torch.arange(B)))
    model.meter.in_backward = True
    y.sum().backward()
    return saved.peak


def _predicted_layer_bytes(spec, share, recompute, B=2):
    """Eq. 3 with analytic sizes: the tensors baton.memory says stay held."""
    roles, order, sizes = tensor_roles(spec), layer_order(spec), tensor_sizes(spec, B)
    return sum(sizes[t].bytes(share) for t, role in roles.items() if is_held(role, frozenset(recompute), order))


RECOMPUTE_SETS = {
    "fused": [[], ["attn_core"], ["qkv", "attn_core"], ["ln1", "qkv", "attn_core", "out_proj"], ["attn_core", "out_proj", "resid1"],
              ["gelu", "fc2"], "all"],
    "eager": [[], ["softmax"], ["attn_scores", "softmax", "attn_dropout"], ["qkv", "attn_scores"], "all"],
}


@pytest.mark.parametrize("attention", ["fused", "eager"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_layer_keeps_exactly_the_bytes_of_the_tensor_model(attention, dropout):
    """Every recompute choice tried, at shares 1 and 3/4 (heads 1..3 of 4): measured saved bytes equal
    the prediction to the byte (fp32).

    Catches: a fused kernel that copies q, k, v or its output (transposed layouts), out_proj keeping a
    second copy of ctx, the fused op's log-sum-exp missing from the model, dropout masks kept as fp32
    instead of the counted bytes, the causal mask kept by softmax, and segments that keep more than
    their inputs."""
    spec = tiny(dropout, attention=attention)
    for recompute in RECOMPUTE_SETS[attention]:
        recompute = operator_names(spec) if recompute == "all" else recompute
        for heads in (range(4), range(1, 4)):
            share = len(heads) / spec.num_heads
            want = _predicted_layer_bytes(spec, share, recompute)
            assert _layer_saved_bytes(spec, heads, recompute) == want, (recompute, share)


def _edge(spec, heads, first):
    model = StageModel(spec, layers=range(0), heads=heads, ffn_cols=range(0), first=first, last=not first)
    model.load_full(lambda name: init_parameter(spec, name, 0))
    return model


@pytest.mark.parametrize("vocab", [256, ODD_VOCAB])
def test_embedding_and_head_keep_and_hold_what_the_cost_model_says(vocab):
    """At every valid (U, units before, units) of tiny, the embedding's and the head's saved bytes and
    parameter bytes equal ``analytic_edge_cost`` at share u/U exactly (padding rows included).

    Catches: a full-vocabulary head or softmax on every rank, a gathered logits tensor, an index or mask
    the model does not count, a lookup of the positions that keeps an index tensor."""
    assert_edges_keep_and_hold_what_the_cost_model_says(tiny(0.0, vocab_size=vocab))


def assert_edges_keep_and_hold_what_the_cost_model_says(spec, B=2):
    """The embedding's and the head's saved and held bytes against ``analytic_edge_cost`` at every valid
    (U, units before, units) of ``spec``: the head holds what is not the embedding's (``wte``) rows."""
    vocab = spec.vocab_size
    tokens = torch.randint(vocab, (B, spec.seq_len), generator=torch.Generator().manual_seed(2))
    for U in unit_counts(spec):
        hpu = spec.num_heads // U
        for u0 in range(U):
            for u in range(1, U - u0 + 1):
                heads = range(u0 * hpu, (u0 + u) * hpu)
                for first, name in ((True, "embedding"), (False, "head")):
                    model = _edge(spec, heads, first)
                    x = tokens if first else torch.randn(B, spec.seq_len, spec.hidden_dim, requires_grad=True)
                    saved = SavedBytes(model.parameters())
                    with saved.record(0):
                        y = model(x, MicroBatch(seed=0, step=0, samples=torch.arange(B)), targets=tokens)
                    y.sum().backward()
                    cost = analytic_edge_cost(spec, CATALOG["cpu"], name, B, share=u / U)
                    held = sum(p.numel() for n, p in model.named_parameters() if first or not n.startswith("wte.")) * 4
                    assert saved.peak == cost.saved_bytes, (name, U, u0, u)
                    assert held == cost.param_bytes, (name, U, u0, u)


@pytest.mark.parametrize("attention", ["eager", "fused"])
def test_measured_table_has_both_attentions_and_the_derived_bytes(attention):
    """``baton profile --device`` on either attention measures the other's operators too (one table serves
    both, as a derived one does), and every row's saved and parameter bytes equal the derivation's
    (fp32, vocabulary padded, edges at every share).

    Catches: a measured table without attn_core (no measured tables for fused models), edge rows only at
    share 1, and any tensor the runtime keeps that the derivation does not count."""
    from baton.profile import derive_table
    from runtime.measure.op_profiler import profile_table

    spec = tiny(0.1, attention=attention, vocab_size=ODD_VOCAB)
    shares = (0.25, 0.75, 1.0)
    measured = profile_table(spec, micro_batches=(2,), shares=shares, warmup=0, reps=1)
    derived = derive_table(spec, "cpu", micro_batches=(2,), shares=shares)
    assert {"attn_core", "attn_scores", "softmax", "attn_dropout", "attn_v"} <= set(measured["op"])
    joined = measured.merge(derived, on=["op", "micro_batch", "tp_share"], suffixes=("_m", "_d"))
    assert len(joined) == len(measured) - 1  # every row but the optimizer's
    for col in ("saved_bytes", "param_bytes"):
        bad = joined[joined[f"{col}_m"] != joined[f"{col}_d"]]
        assert bad.empty, bad[["op", "tp_share", f"{col}_m", f"{col}_d"]].to_string()


def test_vocabulary_rows_follow_the_units_and_slices_pad_with_zeros():
    """``vocab_range`` (from a rank's heads) is ``baton.operators.vocab_rows`` (from its units) for every
    split; the ranks of a stage tile the padded vocabulary; a full (V, h) tensor round-trips through the
    padded slices. Catches rows that disagree with the cost model, gaps or overlaps between ranks, and
    checkpoints that would store padding rows (or fail on them)."""
    spec = tiny(0.0, vocab_size=ODD_VOCAB)
    assert padded_vocab(spec) == 252
    full = torch.randn(ODD_VOCAB, spec.hidden_dim)
    for U in unit_counts(spec):
        hpu = spec.num_heads // U
        for split in ([U], [1] * U, [U - 1, 1] if U > 1 else [1]):
            rebuilt, start = torch.zeros_like(full), 0
            for u in split:
                rows = vocab_range(spec, range(start * hpu, (start + u) * hpu))
                assert rows == vocab_rows(spec, start, u, U)
                where = (0, [(rows.start, rows.stop)])
                local = take_slice(full, where)
                assert local.shape == (len(rows), spec.hidden_dim)
                assert not local[max(0, ODD_VOCAB - rows.start):].any()  # padding rows are zero
                put_slice(rebuilt, local, where)
                start += u
            assert torch.equal(rebuilt, full)


def test_vocabulary_parallel_loss_equals_cross_entropy_on_one_rank():
    """One rank holding the whole padded vocabulary: the stage's summed loss and its input gradient are
    ``F.cross_entropy``'s on the single-device head (padding rows never take part)."""
    spec = tiny(0.0, vocab_size=ODD_VOCAB)
    model = _edge(spec, range(spec.num_heads), first=False)
    ref = GPT(spec)
    x = torch.randn(2, spec.seq_len, spec.hidden_dim, generator=torch.Generator().manual_seed(3), requires_grad=True)
    targets = torch.randint(ODD_VOCAB, (2, spec.seq_len), generator=torch.Generator().manual_seed(4))
    loss = model(x, MicroBatch(seed=0, step=0, samples=torch.arange(2)), targets=targets)
    loss.backward()
    x2 = x.detach().clone().requires_grad_()
    logits = ref.ln_f(x2) @ ref.wte.weight.t()
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, ODD_VOCAB), targets.reshape(-1), reduction="sum")
    want.backward()
    assert loss.item() == pytest.approx(want.item(), rel=1e-6)
    assert rel_err(x.grad, x2.grad) < 1e-5
    assert rel_err(model.wte.weight.grad[:ODD_VOCAB], ref.wte.weight.grad) < 1e-5
    assert not model.wte.weight.grad[ODD_VOCAB:].any()


# --- real processes over gloo --------------------------------------------------------------------


def test_fused_tensor_parallel_one_stage_with_padded_vocabulary():
    """TP 3:1 in one stage, fused attention, residual dropout on, the vocabulary padded 250 -> 252 (the
    3-unit rank holds 189 rows, the 1-unit rank 63 of which 2 are padding); one rank recomputes the fused
    operator with qkv, the other the MLP.

    Catches: a fused split that mixes heads, the vocabulary-parallel loss or its three all-reduces
    wrong, padding rows that take part in the softmax, the embedding's all-reduce missing."""
    plan = plan_of(tiny(0.1, attention="fused", vocab_size=ODD_VOCAB), [[3, 1]], [4], 4, m=2,
                   recompute={0: ["qkv", "attn_core"], 1: ["fc1", "gelu", "fc2", "resid2"]})
    assert_parity(plan)


@pytest.mark.long  # the same ends (1:1 and 3:1, fused) train a step against one device in the checkpoint test below
def test_fused_pipeline_first_and_last_stage_split_differently():
    """PP=2: the first stage split 1:1 (U=2, rows 0-125 and 126-251), the last 3:1 (U=4, rows 0-188 and
    189-251), fused attention, vocabulary padded.

    Catches: the tied embedding's gradient summed by rank instead of by row (the two stages hold
    different rows), and a pipeline of vocabulary-parallel ends that diverges from one device."""
    plan = plan_of(tiny(0.1, attention="fused", vocab_size=ODD_VOCAB), [[1, 1], [3, 1]], [2, 2], [2, 4], m=3,
                   recompute={2: ["attn_core"]})
    assert_parity(plan)


@pytest.mark.long  # vocabulary-parallel ends run quick in the fused tests around it, three stages in test_runtime_parity.py
def test_eager_pipeline_with_vocabulary_parallel_ends_and_a_middle_stage():
    """PP=3, eager attention with dropout: the first stage split 1:3, a single-rank middle stage, the last
    stage split 1:1; the vocabulary padded. Catches the same mistakes for eager models and ends that
    are not neighbours."""
    plan = plan_of(tiny(0.1, vocab_size=ODD_VOCAB), [[1, 3], [1], [1, 1]], [1, 2, 1], [4, 1, 2], m=3)
    assert_parity(plan)


def _hf_worker(rank, world, plan, hf_dir):
    from runtime.data.source import TokenSource
    from runtime.train.engine import Engine
    from runtime.model.hf_import import load_gpt2

    full = load_gpt2(hf_dir, plan.model)
    engine = Engine(plan, rank, seed=0, full=full.__getitem__)
    data = TokenSource(plan.model, seed=0, global_batch=plan.global_batch)
    return engine.forward_backward(0, data).loss


@pytest.mark.long  # GPT-2 import runs quick in test_runtime_train.py, into split plans in test_llama_hf.py; padding rows above
def test_hugging_face_gpt2_with_odd_vocabulary_in_a_vocabulary_parallel_plan(tmp_path):
    """A GPT2LMHeadModel with 250 tokens loaded into a plan whose last stage is split 3:1 (its padded rows
    are zeros): the loss of the first batch is Hugging Face's. Catches an import that does not pad, or
    a padding row that enters the softmax."""
    transformers = pytest.importorskip("transformers")
    from runtime.data.source import TokenSource

    spec = tiny(0.0, vocab_size=ODD_VOCAB, attention="fused")
    config = transformers.GPT2Config(n_embd=64, n_layer=4, n_head=4, n_positions=32, vocab_size=ODD_VOCAB,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(config).eval()
    hf.save_pretrained(tmp_path / "hf")
    plan = plan_of(spec, [[1], [3, 1]], [2, 2], [1, 4], m=2)
    x, y = TokenSource(spec, seed=0, global_batch=plan.global_batch).batch(0, torch.arange(plan.global_batch))
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(hf(x).logits.reshape(-1, ODD_VOCAB), y.reshape(-1)).item()
    losses = run_ranks(_hf_worker, 3, plan, str(tmp_path / "hf"))
    assert losses[0] == pytest.approx(want, rel=1e-5)


def _checkpoint_worker(rank, world, plan_a, plan_b, ckpt_dir):
    from runtime.train.checkpoint import CheckpointReader, save_checkpoint
    from runtime.data.source import TokenSource
    from runtime.train.engine import Engine

    engine = Engine(plan_a, rank, seed=0, lr=1e-3)
    data = TokenSource(plan_a.model, seed=0, global_batch=plan_a.global_batch)
    engine.train_step(0, data)
    path = save_checkpoint(engine, ckpt_dir, step=1, samples_seen=data.samples_before(1), extra={})
    other = Engine(plan_b, rank, seed=1, lr=1e-3)
    CheckpointReader(path, plan_b.model).load_into(other)
    return {"path": str(path), "wte": other.model.wte.weight.detach().clone() if hasattr(other.model, "wte") else None,
            "slice": other.model.slices().get("wte.weight")}


def test_checkpoint_stores_the_full_unpadded_embedding_and_loads_under_another_split(tmp_path):
    """Train one step under a plan whose ends are split 1:1 and 3:1, save, load into a plan of three
    stages whose first is split 1:3. The checkpoint's ``wte.weight`` is (250, h) and equals the single-device model after the
    same step; each rank of the new plan holds its rows of it (padding rows zero).

    Catches: padding rows written to the checkpoint, a gather that takes the first stage's rows from the
    wrong rank, and an embedding that cannot be loaded under another vocabulary split."""
    from safetensors.torch import load_file

    spec = tiny(0.0, vocab_size=ODD_VOCAB, attention="fused")
    plan_a = plan_of(spec, [[1, 1], [3, 1]], [2, 2], [2, 4], m=2)
    plan_b = plan_of(spec, [[1, 3], [1], [1]], [2, 1, 1], [4, 1, 1], m=4, mbs=1)
    results = run_ranks(_checkpoint_worker, 4, plan_a, plan_b, str(tmp_path / "ck"))
    saved = load_file(f"{results[0]['path']}/model.safetensors")
    assert tuple(saved["wte.weight"].shape) == (ODD_VOCAB, spec.hidden_dim)

    from runtime.data.source import TokenSource
    from runtime.train.engine import ADAM_BETAS, ADAM_EPS

    ref = GPT(spec, seed=0)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, betas=ADAM_BETAS, eps=ADAM_EPS, weight_decay=0.0)
    x, y = TokenSource(spec, seed=0, global_batch=plan_a.global_batch).batch(0, torch.arange(plan_a.global_batch))
    ref(x, y)[1].backward()
    opt.step()
    assert rel_err(saved["wte.weight"], ref.wte.weight.detach()) < 1e-5
    for res in results:
        if res["wte"] is not None:  # the middle stage holds no embedding
            assert torch.equal(res["wte"], take_slice(saved["wte.weight"], res["slice"]))
