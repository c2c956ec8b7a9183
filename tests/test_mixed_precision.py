"""Mixed precision as docs/cost-model.md eq. 7/8 counts it (runtime/train/precision.py), on CPU.

bf16 weights, activations and gradients; fp32 master weights and Adam moments; fp16 adds a dynamic loss
scale. Checked: the bytes every part takes, parity of split bf16 runs with the single-device bf16 run
(real gloo processes), the fp16 overflow protocol across ranks and through a checkpoint, and the
activation bytes ``baton train --report`` measures against a table profiled in bf16.
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from baton.costmodel import optimizer_bytes
from baton.plan import save_plan, simple_plan
from tests.conftest import ROOT
from tests.runtime_helpers import plan_of, rel_err, run_ranks, tiny

STEPS, LR = 4, 1e-3


# --- bytes and the update, one process ------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_master_weights_take_the_bytes_of_eq7(dtype):
    """Weights and gradients in the compute dtype, master weights and moments in fp32: the measured
    bytes are exactly eq. 7's O_d = (W_d / e) * (8 + 4 [e < 4]) for the measured W_d, and the update
    reaches the compute-dtype weights as the masters rounded.

    Catches: moments or masters kept in the compute dtype, gradients promoted to fp32 (a second copy),
    masters copied after the cast (initial values already rounded), weights not refreshed after a step."""
    from runtime.model.gpt import init_parameter
    from runtime.train.precision import MasterWeights, compute_dtype
    from runtime.parallel.stage import StageModel
    from runtime.parallel.tp_layer import MicroBatch

    spec = tiny(0.0, dtype=dtype)
    model = StageModel(spec, layers=range(2), heads=range(spec.num_heads), ffn_cols=range(spec.ffn_dim), first=True, last=True)
    model.load_full(lambda name: init_parameter(spec, name, 0))
    exact = {n: p.detach().clone() for n, p in model.named_parameters()}
    mw = MasterWeights(model, dtype, lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    want = compute_dtype(dtype)
    assert {p.dtype for p in model.parameters()} == {want}
    assert all(m.dtype == torch.float32 for m in mw.masters)
    assert all(torch.equal(m, exact[n]) for (n, _), m in zip(model.named_parameters(), mw.masters))  # not rounded

    tokens = torch.randint(spec.vocab_size, (2, spec.seq_len), generator=torch.Generator().manual_seed(0))
    logits = model(tokens, MicroBatch(seed=0, step=0, samples=torch.arange(2)))
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, spec.vocab_size), tokens.reshape(-1))
    (loss * mw.loss_scale).backward()
    assert {p.grad.dtype for p in model.parameters()} == {want}
    assert mw.step() is True

    held = mw.state_bytes()
    n = sum(p.numel() for p in model.parameters())
    assert held.weights_bytes == held.grads_bytes == n * spec.dtype_bytes
    assert held.optimizer_bytes == optimizer_bytes(held.weights_bytes, spec)  # eq. 7, the cost model's own function
    assert held.master_bytes == (4 * n if dtype != "fp32" else 0) and held.moments_bytes == 8 * n
    for p, m in zip(mw.params, mw.masters):
        assert torch.equal(p.detach(), m.detach().to(want))  # the weights are the updated masters, rounded
    moved = max(float((m.detach() - exact[name]).abs().max()) for (name, _), m in zip(model.named_parameters(), mw.masters))
    assert moved > LR / 2  # Adam's first step moves every weight with a gradient by about lr


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_chunked_master_step_equals_one_adamw_step_over_all_masters(dtype):
    """The mixed-precision step unscales and updates a chunk of parameters at a time (the fp32 gradients
    never exist whole), each chunk's gradients unscaled and its weights rounded back in one call. It must equal, bit for
    bit, one AdamW step (the same kernel) over every master with every gradient unscaled: weight-decay groups split across
    chunks, a parameter without a gradient, gradient clipping's factor and fp16's loss scale included; and
    the optimizer's groups are whole again afterwards (checkpoints and the learning rate read them)."""
    from runtime.train.precision import CPU_ADAMW_KERNEL, MasterWeights, compute_dtype

    g = torch.Generator().manual_seed(0)
    shapes = [(48,), (96, 48), (96,), (48, 48), (48,), (192, 48), (48, 192), (300, 48)] * 3
    full = [torch.randn(s, generator=g) for s in shapes]
    decays = [len(s) > 1 for s in shapes]
    grads = [[(torch.randn(s, generator=g) * 1e-2) for s in shapes] for _ in range(3)]
    mw = MasterWeights(torch.nn.ParameterList([torch.nn.Parameter(t.clone()) for t in full]), dtype, lr=LR,
                       betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, decays=decays)
    assert len(mw._chunks) > 2 and [len(c) for c in mw._chunks].count(1) >= 3  # the (300, 48) weights stand alone
    ref = [torch.nn.Parameter(t.clone()) for t in full]
    opt = torch.optim.AdamW([{"params": [r for r, d in zip(ref, decays) if d]},
                             {"params": [r for r, d in zip(ref, decays) if not d], "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, **CPU_ADAMW_KERNEL)
    want, clip = compute_dtype(dtype), 0.5
    sizes = [len(group["params"]) for group in mw.optimizer.param_groups]
    for step, gs in enumerate(grads):
        for i, (p, r, gr) in enumerate(zip(mw.params, ref, gs)):
            skip = (step == 1 and i == 4) or (step == 2 and shapes[i] == (300, 48))  # the last: a chunk of its own
            p.grad = None if skip else (gr * mw.loss_scale).to(want)
            r.grad = None if skip else p.grad.float() * (clip / mw.loss_scale)
        assert mw.step(grad_factor=clip) is True
        opt.step()
        assert [len(group["params"]) for group in mw.optimizer.param_groups] == sizes
    for p, m, r in zip(mw.params, mw.masters, ref):
        assert torch.equal(m.detach(), r.detach()) and torch.equal(p.detach(), r.detach().to(want))
        assert all(torch.equal(mw.optimizer.state[m][k], opt.state[r][k]) for k in ("exp_avg", "exp_avg_sq"))


def test_loss_scaler_backs_off_grows_and_round_trips():
    """Catches a scale that does not halve on overflow, grows too early (or never), forgets its clean
    steps across a restore, or accepts a non-finite scale from a checkpoint."""
    from runtime.train.precision import LossScaler, LossScaleSettings

    s = LossScaler(LossScaleSettings(initial_scale=1024.0, growth_interval_steps=3))
    s.update(True)
    assert (s.scale, s.skipped_steps, s.clean_steps) == (512.0, 1, 0)
    s.update(False)
    s.update(False)
    assert s.scale == 512.0
    copy = LossScaler(s.settings)
    copy.load_state_dict(json.loads(json.dumps(s.state_dict())))
    for scaler in (s, copy):
        scaler.update(False)
        assert (scaler.scale, scaler.clean_steps, scaler.skipped_steps) == (1024.0, 0, 1)
    floor = LossScaler(LossScaleSettings(initial_scale=2.0, min_scale=1.0))
    for _ in range(3):
        floor.update(True)
    assert floor.scale == 1.0 and floor.skipped_steps == 3
    with pytest.raises(ValueError):
        copy.load_state_dict({"scale": math.inf})


# --- bf16 plans over real processes ---------------------------------------------------------------


def bf16_worker(rank, world, plan, steps, lr):
    """Step 0's gradients (as fp32), the losses of ``steps`` steps, and the dtypes held."""
    from runtime.data.source import TokenSource
    from runtime.train.engine import Engine

    engine = Engine(plan, rank, seed=0, lr=lr)
    data = TokenSource(plan.model, seed=0, global_batch=plan.global_batch)
    stats = [engine.train_step(0, data)]
    grads = {n: p.grad.float().clone() for n, p in engine.model.named_parameters()}
    for step in range(1, steps):
        stats.append(engine.train_step(step, data))
    return {"losses": [s.loss for s in stats], "grads": grads, "slices": engine.model.slices(), "position": engine.pos,
            "param_dtypes": {p.dtype for p in engine.model.parameters()},
            "grad_dtypes": {p.grad.dtype for p in engine.model.parameters()},
            "master_dtypes": {m.dtype for m in engine.master_parameters().values()},
            "recomputed": stats[0].recomputed_ops}


@pytest.fixture(scope="module")
def bf16_reference():
    """The same model, data and micro-batching on one device, in bf16 (one run per attention kind)."""
    runs = {}

    def get(attention: str):
        if attention not in runs:
            plan = plan_of(tiny(0.1, dtype="bf16", attention=attention), [[1]], [4], 1, m=2)
            runs[attention] = run_ranks(bf16_worker, 1, plan, STEPS, LR)[0]
        return runs[attention]
    return get


# TP 3:1 with recomputation (two processes) runs by default; the others under -m long.
@pytest.mark.parametrize("attention,stages,layers,units,recompute", [
    ("eager", [[3, 1]], [4], 4, {1: ["fc1", "gelu"]}),  # TP 3:1, 2 processes
    pytest.param("eager", [[1], [1]], [3, 1], 1, {0: ["attn_scores", "softmax", "attn_dropout"]}, marks=pytest.mark.long),  # PP 2, 2 processes
    pytest.param("eager", [[1, 1], [2, 2]], [2, 2], [2, 4], {1: ["qkv", "gelu"], 2: ["ln2"]},
                 marks=pytest.mark.long),  # PP 2 x TP 2, 4 processes
    pytest.param("fused", [[2, 2], [1, 3]], [2, 2], [4, 4], {0: ["attn_core"], 3: ["qkv", "attn_core", "out_proj"]},
                 marks=pytest.mark.long),  # 4 processes
], ids=["tp3:1", "pp2", "pp2xtp2", "fused-pp2xtp2"])
def test_bf16_plans_follow_the_single_device_bf16_run(bf16_reference, attention, stages, layers, units, recompute):
    """A bf16 plan split over 2-4 processes (TP, PP, recomputation, dropout 0.1) follows the single-device
    bf16 run, with eager and with fused attention (the vocabulary split over the first and last stage's
    ranks like their units).

    Tolerances: bf16 keeps 8 significant bits (unit roundoff 2^-9 = 2e-3). A split changes the order of
    some bf16 sums and adds roundings: a TP group rounds each rank's partial sum to bf16 before the
    all-reduce adds them, and a pipeline sums the tied embedding's two gradients once, after each was
    accumulated over the micro-batches in bf16, where one device adds them micro-batch by micro-batch.
    A few such roundings per tensor give step-0 gradients within about 1e-2 relative (measured: at
    most 1.5e-2, PP 2 x TP 2; 1.3e-2 fused); we allow 4e-2. The loss is a mean over 128 tokens of fp32 log-probabilities,
    so it moves far less (measured: at most 3.2e-4 over four steps); we allow 2e-3, which one missed or
    doubled update (a loss change of about 4e-2 per step here) or a wrongly scaled gradient exceeds. The
    same plans in fp32 agree to 1e-6 (test_runtime_parity.py)."""
    from runtime.parallel.slicing import take_slice

    plan = plan_of(tiny(0.1, dtype="bf16", attention=attention), stages, layers, units, m=2, recompute=recompute)
    results = run_ranks(bf16_worker, len(plan.device_ids()), plan, STEPS, LR)
    ref = bf16_reference(attention)
    assert ref["param_dtypes"] == ref["grad_dtypes"] == {torch.bfloat16} and ref["master_dtypes"] == {torch.float32}
    for res in results:
        pos = res["position"]
        assert res["param_dtypes"] == res["grad_dtypes"] == {torch.bfloat16}, pos
        assert res["master_dtypes"] == {torch.float32}, pos
        stage = plan.pipelines[0].stages[pos.stage]
        assert res["recomputed"] == {op: plan.num_microbatches * stage.num_layers for op in pos.recompute}
        for got, want in zip(res["losses"], ref["losses"]):
            assert abs(got - want) <= 2e-3, (res["losses"], ref["losses"])
        for name, g in res["grads"].items():
            err = rel_err(g, take_slice(ref["grads"][name], res["slices"][name]))
            assert err <= 4e-2, f"rank {pos.rank}: grad of {name} off by {err:.2e}"
    assert results[0]["losses"][-1] < results[0]["losses"][0] - 1e-2  # it trains


def test_bf16_with_dropout_keeps_activations_in_bf16():
    """Catches dropout masks that change the activations' dtype (an fp32 mask times a bf16 tensor is fp32,
    and the next layer's bf16 weights then refuse it)."""
    from runtime.model.gpt import init_parameter
    from runtime.parallel.stage import StageModel
    from runtime.parallel.tp_layer import MicroBatch

    spec = tiny(0.1, dtype="bf16")
    model = StageModel(spec, layers=range(1), heads=range(spec.num_heads), ffn_cols=range(spec.ffn_dim), first=False, last=False)
    model.load_full(lambda name: init_parameter(spec, name, 0))
    model.to(torch.bfloat16)
    x = torch.randn(2, spec.seq_len, spec.hidden_dim, dtype=torch.bfloat16)
    assert model(x, MicroBatch(seed=0, step=0, samples=torch.arange(2))).dtype == torch.bfloat16


# --- fp16 loss scaling over real processes --------------------------------------------------------


def fp16_worker(rank, world, plan, ckpt_dir):
    """Step 0 overflows on the last stage only; steps 1 and 2 are clean (growth after 2); then a
    checkpoint is written and read into a fresh engine."""
    from runtime.train.checkpoint import CheckpointReader, save_checkpoint
    from runtime.data.source import TokenSource
    from runtime.train.engine import Engine
    from runtime.train.precision import LossScaleSettings

    settings = LossScaleSettings(initial_scale=2.0**10, growth_interval_steps=2)
    engine = Engine(plan, rank, seed=0, lr=LR, loss_scale=settings)
    data = TokenSource(plan.model, seed=0, global_batch=plan.global_batch)
    start = {n: m.detach().clone() for n, m in engine.master_parameters().items()}
    hook = engine.model.ln_f.weight.register_hook(lambda g: torch.full_like(g, math.inf)) if engine.last else None
    s0 = engine.train_step(0, data)
    finite0 = bool(torch.isfinite(engine.grad_buffer).all())
    after0 = {n: m.detach().clone() for n, m in engine.master_parameters().items()}
    scale_after0 = engine.precision.loss_scale
    if hook is not None:
        hook.remove()
    s1, s2 = engine.train_step(1, data), engine.train_step(2, data)
    path = save_checkpoint(engine, ckpt_dir, step=3, samples_seen=data.samples_before(3), extra={})
    fresh = Engine(plan, rank, seed=1, lr=LR, loss_scale=settings)
    CheckpointReader(path, plan.model).load_into(fresh)
    return {"skipped": [s0.skipped, s1.skipped, s2.skipped], "scales": [s0.loss_scale, s1.loss_scale, s2.loss_scale],
            "scale_after0": scale_after0, "scale_end": engine.precision.loss_scale, "finite0": finite0,
            "unchanged0": all(torch.equal(start[n], after0[n]) for n in start),
            "moved_later": any(not torch.equal(after0[n], m) for n, m in engine.master_parameters().items()),
            "finite_end": all(bool(torch.isfinite(m).all()) for m in engine.master_parameters().values()),
            "restored_scale": fresh.precision.scaler.state_dict(), "saved_scale": engine.precision.scaler.state_dict(),
            "restored_masters": all(torch.equal(m, fresh.master_parameters()[n]) for n, m in engine.master_parameters().items()),
            "meta_scale": json.loads((path / "meta.json").read_text()).get("loss_scale") if rank == 0 else None}


@pytest.mark.long  # fp16 overflow, skip everywhere and the checkpointed scale run quick in test_data_parallel.py (with shards)
def test_fp16_overflow_skips_the_step_on_every_rank_and_the_scale_is_checkpointed(tmp_path):
    """Two pipeline stages in fp16; the last stage's gradient of ln_f overflows in step 0, the first
    stage's gradients stay finite.

    Catches: a rank that updates while its peer skips (the replicas would diverge), a skipped step that
    still moves the weights (or leaves inf in them), a scale that does not halve after the overflow or
    double after growth_interval clean steps, and a scale (or its clean-step count, or the fp32
    masters) lost through a checkpoint."""
    plan = plan_of(tiny(0.0, dtype="fp16"), [[1], [1]], [3, 1], 1, m=2)
    results = run_ranks(fp16_worker, 2, plan, str(tmp_path))
    assert [r["finite0"] for r in results] == [True, False]  # only the last stage overflowed
    for r in results:
        assert r["skipped"] == [True, False, False]
        assert r["unchanged0"] and r["moved_later"] and r["finite_end"]
        assert r["scales"] == [1024.0, 512.0, 512.0] and r["scale_after0"] == 512.0 and r["scale_end"] == 1024.0
        assert r["restored_scale"] == r["saved_scale"] == {"scale": 1024.0, "clean_steps": 0, "skipped_steps": 1}
        assert r["restored_masters"]
    assert results[0]["meta_scale"] == {"scale": 1024.0, "clean_steps": 0, "skipped_steps": 1}


# --- baton profile + train --report in bf16 -------------------------------------------------------


@pytest.mark.long  # a profile and a four-process run; tests/test_report.py checks the report's bytes in fp32 by default
def test_bf16_report_measures_what_the_bf16_table_predicts(tmp_path):
    """``baton profile --device cpu`` on a bf16 model writes a bf16 table; a bf16 plan trained over four
    gloo processes (pipeline of three stages, the middle one split 3:1, recomputation on three ranks)
    keeps exactly the activation bytes that table predicts on every device (0.1%, as in
    test_report.py), and weights, gradients and optimizer state measure eq. 7/8.

    Weights equal the prediction exactly on single-rank stages; on the split stage every rank holds
    the row-parallel biases (2h per layer) in full, where the cost model charges its share of them,
    so the measured weights are up to 1% larger there.

    No rank recomputes a LayerNorm: on CPU, LayerNorm keeps the statistics of a bf16 input in bf16 (the
    cost model counts fp32, as CUDA keeps them), so a measured table spreads its bytes over the wrong
    tensors and a plan recomputing ln1 or ln2 is predicted up to 0.5% off."""
    import subprocess
    import sys

    model = tmp_path / "tiny-bf16.yaml"
    model.write_text("base: tiny\nname: tiny-bf16\ndtype: bf16\ndropout: 0.1\nattention: eager\n")

    def baton(*args):
        return subprocess.run([sys.executable, "-m", "cli", *map(str, args)], cwd=ROOT, capture_output=True, text=True, timeout=300)

    table = tmp_path / "profiles" / "measured" / "cpu__tiny-bf16__s32.csv"
    res = baton("profile", "--device", "cpu", "--model", model, "--micro-batch", "2", "--tp-shares", "0.25,0.75,1",
                "--reps", "1", "--warmup", "0", "--threads", "1", "--out", table)
    assert res.returncode == 0, res.stderr
    from runtime.train.precision import cpu_runs_natively

    # A CPU without bf16 instructions runs the model in an emulation: both commands say so, once.
    emulated = cpu_runs_natively("bf16") is False
    assert res.stderr.count("no bf16 instructions") == int(emulated), res.stderr
    from baton.model_files import load_model
    from baton.profile import read_table

    spec = load_model(model)
    rows = read_table(table)
    qkv = rows[(rows.op == "qkv") & (rows.tp_share == 1.0)].iloc[0]
    assert qkv.param_bytes == (3 * spec.hidden_dim**2 + 3 * spec.hidden_dim) * 2  # bf16 parameters
    assert qkv.saved_bytes == 2 * spec.seq_len * spec.hidden_dim * 2  # keeps ln1_out, bf16 (b = 2)

    plan = simple_plan(spec, cluster="cpu4", stages=[[("local:0", 1)], [("local:1", 3), ("local:2", 1)], [("local:3", 1)]],
                       layers=[1, 2, 1], units_per_layer=[1, 4, 1], micro_batch_size=2, num_microbatches=3,
                       recompute={"local:0": ["attn_scores", "softmax", "attn_dropout", "attn_v"], "local:2": ["qkv", "attn_scores", "softmax"],
                                  "local:3": ["gelu", "fc2"]})
    save_plan(plan, tmp_path / "plan.json")
    out = tmp_path / "report.json"
    res = baton("train", "--plan", tmp_path / "plan.json", "--steps", "2", "--report", out, "--cluster",
                ROOT / "clusters" / "cpu4.yaml", "--profiles", tmp_path / "profiles", "--timeout", "120")
    assert res.returncode == 0, res.stderr
    assert res.stderr.count("no bf16 instructions") == int(emulated), res.stderr
    rep = json.loads(out.read_text())
    assert rep["precision"] == {"dtype": "bf16", "loss_scale": 1.0, "skipped_steps": 0}
    for d in rep["devices"]:
        m, p = d["measured"], d["predicted"]
        assert m["peak_saved_bytes"] == pytest.approx(p["activation_bytes"], rel=1e-3), d["id"]
        assert m["grads_bytes"] == m["weights_bytes"] and m["master_bytes"] == 2 * m["weights_bytes"]
        assert m["moments_bytes"] == 4 * m["weights_bytes"]  # (W / 2) * 8: fp32 moments
        split = d["id"] in ("local:1", "local:2")
        assert m["weights_bytes"] == pytest.approx(p["weights_bytes"], rel=1e-2 if split else 1e-9), d["id"]
        assert m["optimizer_bytes"] == pytest.approx(p["optimizer_bytes"], rel=1e-2 if split else 1e-9), d["id"]
    tp = rep["throughput"]
    assert tp["tokens_per_s"] > 0 and tp["peak_tflops"] == pytest.approx(4 * 0.2)
    assert tp["mfu"]["measured"] == pytest.approx(tp["model_tflops_per_s"] / tp["peak_tflops"])
    assert "tokens/s" in res.stdout and "MFU" in res.stdout


def test_emulation_note_only_for_low_precision_on_a_cpu_without_its_instructions():
    """The note names the dtype on a CPU that lacks it; fp32, a GPU, a CPU that has the instructions and a
    torch that cannot tell stay silent."""
    from runtime.train.precision import emulation_note

    for dtype in ("bf16", "fp16"):
        note = emulation_note(dtype, "cpu", native=False)
        assert note is not None and f"no {dtype} instructions" in note and "emulates" in note
        assert emulation_note(dtype, "cpu", native=True) is None
        assert emulation_note(dtype, "cpu", native=None) is None
        assert emulation_note(dtype, "cuda", native=False) is None
    assert emulation_note("fp32", "cpu", native=False) is None
