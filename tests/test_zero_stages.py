"""ZeRO stages 2 and 3 with layered gradient accumulation (runtime/train/layered.py; docs/cost-model.md, section 9,
eq. 16-18), over real gloo processes against the single-device model on the whole global batch.

Every replica is one stage (tensor parallelism inside allowed) and runs its micro-batches layer by layer;
each unit's (edges, layer) gradient is reduce-scattered to its owners after its backward over all
micro-batches and freed; stage 3 keeps only the owned shards of the weights between uses. The plans here
shard by uneven ratios (0.7/0.3, 0/1) over replicas of uneven batches (3 micro-batches beside 1; micro-batches
of 3 beside 2) and of different shapes (TP 3:1 beside one device, with per-operator recomputation).

Tolerances are those of tests/test_data_parallel.py (whose reference and helpers these runs reuse): losses
and global gradient norms 1e-5 relative, weights and first moments after three clipped AdamW steps 1e-4.
Layered accumulation changes only the order in which fp32 gradients are summed (measured: losses and norms
agree to 2e-7, the weights to 3e-5). Memory is compared with the evaluator's DeviceReport (eq. 18) per device;
the runtime cuts whole parameters where the model prices exact shares (``baton.peers.owned_fractions``), so
weights and optimizer state may differ by less than one parameter per unit group, and the gradients' peak is
lower by exactly the position embedding's gradient (see ``test_layered_runs_follow_the_reference...``).
"""
from __future__ import annotations

import math
import shutil

import pytest
import torch

from tests.runtime_helpers import rel_err, replicas_plan, run_ranks, tiny
from tests.test_data_parallel import CLIP, LR, SEED, STEPS, WD, assert_follows_reference, schedule

# Replica 0: one device, 3 micro-batches of 2; replica 1: one device, 1 micro-batch of 2.
SINGLES_3_1 = [dict(stages=[[1]], layers=[4], units=1, m=3, mbs=2), dict(stages=[[1]], layers=[4], units=1, m=1, mbs=2)]
# Micro-batches of different sizes: 2 of 3 beside 1 of 2.
SINGLES_MBS = [dict(stages=[[1]], layers=[4], units=1, m=2, mbs=3), dict(stages=[[1]], layers=[4], units=1, m=1, mbs=2)]
# Replica 0: TP over two devices, 3:1 units, each recomputing other operators; replica 1 one device.
TP_AND_SINGLE = [dict(stages=[[3, 1]], layers=[4], units=4, m=3, mbs=2,
                      recompute={0: ["fc1", "gelu"], 1: ["attn_scores", "softmax", "attn_dropout"]}),
                 dict(stages=[[1]], layers=[4], units=1, m=1, mbs=2)]


def _worker(rank, world, plan, steps):
    from runtime.train.checkpoint import _gather_full_state
    from runtime.data.source import TokenSource
    from runtime.train.engine import Engine
    from runtime.train.precision import storage_bytes

    engine = Engine(plan, rank, seed=SEED, lr=LR, weight_decay=WD, schedule=schedule(), clip_grad=CLIP)
    data = TokenSource(plan.model, seed=SEED, global_batch=plan.global_batch)
    params = list(engine.model.parameters())
    history = [engine.train_step(step, data) for step in range(steps)]
    units = engine.units
    return {"losses": [s.loss for s in history], "norms": [s.grad_norm for s in history],
            "clipped": [s.clipped for s in history], "grads": None, "slices": engine.model.slices(),
            "position": engine.pos, "full": _gather_full_state(engine), "held": engine.precision.state_bytes(),
            "owned": engine.precision.owned_params(), "recomputed": history[0].recomputed_ops, "history": history,
            # What a rank holds between steps: at stage 3 no parameter storage, only the owned shards.
            "rest": {"params": storage_bytes(params), "grads": [p.grad is None for p in params],
                     "weight_shards": sum(t.nbytes for t in units.weight_shards.values() if t is not None),
                     "grad_shards": sum(t.nbytes for t in units.grad_shards.values())},
            "param_dtypes": {p.dtype for p in params},
            "state_dtypes": {t.dtype for s in engine.precision.shards for t in (s.master, s.exp_avg) if t is not None}}


_RUNS: dict = {}


def run(plan):
    key = plan.to_json()
    if key not in _RUNS:
        _RUNS[key] = run_ranks(_worker, len(plan.device_ids()), plan, STEPS)
    return _RUNS[key]


def _prediction(plan):
    from baton.cluster import load_cluster
    from baton.evaluate import evaluate
    from runtime.launch.devices import prediction_profiles
    from tests.conftest import ROOT

    cluster = load_cluster(ROOT / "clusters" / "cpu4.yaml")
    return cluster, prediction_profiles(plan, cluster, None), evaluate(plan, cluster, prediction_profiles(plan, cluster, None))


def _unit_counts(plan):
    """Per device: unit groups held, layer unit groups held, and owned parameters (the runtime's whole shards)."""
    from baton.peers import EDGES, group_shard_sizes, unit_groups

    groups = {d: 0 for d in plan.device_ids()}
    layer_groups = dict(groups)
    owned = dict(groups)
    for unit, gs in unit_groups(plan):
        for g in gs:
            for h, s in zip(g.holders, group_shard_sizes(plan, g)):
                groups[h] += 1
                layer_groups[h] += unit is not EDGES
                owned[h] += s
    return groups, layer_groups, owned


CASES = {
    "stage 2, 3x2 beside 1x2, 0.7/0.3": (2, SINGLES_3_1, [0.7, 0.3]),
    "stage 3, 2x3 beside 1x2, 0/1": (3, SINGLES_MBS, [0.0, 1.0]),
    "stage 3, tp3:1 beside single, 0.7/0.3, recompute": (3, TP_AND_SINGLE, [0.7, 0.7, 0.3]),
    "stage 2, tp3:1 beside single, 0.3/0.7, recompute": (2, TP_AND_SINGLE, [0.3, 0.3, 0.7]),
}


# One case per stage runs by default (stage 3 with TP and recomputation, whose run the report test below reuses);
# the other two under -m long.
@pytest.mark.parametrize("case", [c if c in ("stage 2, 3x2 beside 1x2, 0.7/0.3", "stage 3, tp3:1 beside single, 0.7/0.3, recompute")
                                  else pytest.param(c, marks=pytest.mark.long) for c in CASES])
def test_layered_runs_follow_the_reference_and_hold_the_predicted_state(case):
    """Stage 2 or 3 over uneven shards and batches (and TP with per-operator recomputation inside a replica)
    trains as one device on the whole global batch: losses, global gradient norms (clipping on every step),
    weights and first moments after three AdamW steps, recomputation counted once per layer and micro-batch.
    Between steps a rank holds no full gradient, and at stage 3 no parameter storage at all, only its owned
    shards. The weights, gradients and optimizer state it held at the step's peak are the evaluator's eq. 18:

    * weights: stage 2 all of them (W, exactly); stage 3 the owned shards of its layers, the edges whole and
      one gathered layer (phi L par + E + par), within one parameter per layer unit group (whole parameters
      against exact shares);
    * gradients: the owned shards, the edges' and one layer's full gradient (phi W + E + par), less the position
      embedding's gradient: autograd creates it only in the embedding's backward, after layer 0's gradient was
      reduce-scattered and freed, so it never coexists with a layer's (eq. 18: phi W + E + max(par - s h e, 0)).
      Within one parameter per unit group;
    * activations: every micro-batch's saved tensors of the layers and embedding, one head's at a time (eq. 18),
      exactly;
    * optimizer: fp32 moments of the owned shards, O(phi W), within one parameter per unit group.

    Catches: a layer reduce-scattered before its last micro-batch's backward (or not at all), a micro-batch's loss
    scaled by its replica's tokens, shards of the wrong owner or misaligned padding, a gathered layer holding
    stale or another rank's weights, the edges released before the head's backward, stage 3 weights left whole
    after the step (the bytes show it), gradients not freed after their reduce-scatter, a recomputed segment
    replaying against a released weight (it would read 0-byte storage and crash or differ), and ranks that
    deadlock because their units' collectives run in different orders."""
    stage, replicas, ratios = CASES[case]
    plan = replicas_plan(tiny(0.1), replicas, zero_stage=stage, ratios=ratios)
    results = run(plan)
    assert_follows_reference(plan, results)
    _, _, pred = _prediction(plan)
    by_id = {d.id: d for d in pred.devices}
    groups, layer_groups, owned = _unit_counts(plan)
    spec = plan.model
    for res in results:
        dev = plan.device_ids()[res["position"].rank]
        held, rest, p = res["held"], res["rest"], by_id[dev]
        assert res["owned"] == owned[dev]
        assert all(rest["grads"]), f"{dev}: full gradients left after the step"
        assert rest["grad_shards"] == 4 * owned[dev]
        if stage == 3:
            assert rest["params"] == 0, f"{dev}: {rest['params']} bytes of parameters between steps"
            assert rest["weight_shards"] == 4 * owned[dev]
            assert abs(held.weights_bytes - p.weights_bytes) <= 4 * layer_groups[dev], (dev, held, p.weights_bytes)
        else:
            assert rest["weight_shards"] == 0
            assert held.weights_bytes == p.weights_bytes, (dev, held, p.weights_bytes)
        assert abs(held.grads_bytes - p.grads_bytes) <= 4 * groups[dev], (dev, held, p.grads_bytes)
        # every micro-batch's layers and embedding, one head at a time (eq. 18)
        assert last_saved(res) == pytest.approx(p.activation_bytes, rel=1e-9), (dev, last_saved(res), p.activation_bytes)
        assert held.master_bytes == 0 and held.moments_bytes == 8 * owned[dev]
        assert abs(held.optimizer_bytes - p.optimizer_bytes) <= 8 * groups[dev], (dev, held, p.optimizer_bytes)
        # Per step, one reduce-scatter time per unit (the edges first) and, at stage 3, its gathers.
        last = res["history"][-1]
        assert len(last.unit_reduce_ms) == len(last.unit_gather_ms) == spec.num_layers + 1
        assert last.grad_sync_ms == pytest.approx(sum(last.unit_reduce_ms))
        assert last.gather_ms == pytest.approx(sum(last.unit_gather_ms))


def last_saved(res) -> int:
    """Peak saved-activation bytes of the rank's last step."""
    return res["history"][-1].peak_saved_bytes


def test_report_shows_units_phases_and_state_bytes():
    """``baton train --report`` for a stage 3 run: per-phase measured vs predicted (passes, reduce-scatters,
    gathers, optimizer), one row per unit with its reduce-scatter and gathers next to eq. 16's ring pass (a
    layer gathered twice, the edges once), and the devices' measured weights, gradients and optimizer bytes
    next to the evaluator's."""
    from runtime.measure.report import build_report, summary_rows

    stage, replicas, ratios = CASES["stage 3, tp3:1 beside single, 0.7/0.3, recompute"]
    plan = replicas_plan(tiny(0.1), replicas, zero_stage=stage, ratios=ratios)
    results = run(plan)
    cluster, profiles, pred = _prediction(plan)
    report = build_report(plan, cluster, profiles, {r: res["history"] for r, res in enumerate(results)})
    assert set(report["phases"]) == {"pipeline_ms", "grad_sync_ms", "gather_ms", "optimizer_ms"}
    units = report["units"]
    assert [u["unit"] for u in units] == ["edges", 0, 1, 2, 3]
    for u in units:
        assert u["reduce_scatter_ms"]["measured"] > 0 and u["gather_ms"]["measured"] > 0
        want = u["reduce_scatter_ms"]["predicted"] * (1 if u["unit"] == "edges" else 2)
        assert u["gather_ms"]["predicted"] == pytest.approx(want)
    assert sum(u["reduce_scatter_ms"]["predicted"] + u["gather_ms"]["predicted"] for u in units) == \
        pytest.approx(pred.dp_sync_ms)
    for d in report["devices"]:
        assert d["measured"]["weights_bytes"] > 0 and d["predicted"]["weights_bytes"] > 0
        assert abs(d["state_rel_error"]["weights_bytes"]) < 1e-3
    assert summary_rows(report)


# --- bf16 and fp16 --------------------------------------------------------------------------------------


@pytest.mark.long  # bf16 (emulated on most CPUs) at three stages: bf16 runs quick in test_mixed_precision.py, sharding here in fp32
def test_bf16_stage_3_keeps_fp32_master_shards_and_follows_stages_2_and_1():
    """bf16 at stage 3 (TP 3:1 beside one device, 0.7/0.3): parameters, gradients and collectives in bf16,
    fp32 master weights and moments of the owned shards only (4 + 8 bytes per owned parameter), the weight
    and gradient shards in bf16 (2 bytes). It equals stage 2 of the same plan bit for bit (gathering and
    releasing lose nothing), and follows stage 1: losses within 2e-3 and state within 4e-2, the bounds
    tests/test_data_parallel.py puts on bf16 beside a group of three holders. Layered accumulation adds the
    tied embedding's bf16 gradients in another order (every head's before every embedding backward's): one
    bf16 rounding on some elements, which moves the step-0 norm by 4e-5 and grows through three Adam steps
    (measured: losses 1e-5 apart, state 1.6e-2), except on the attention's input bias, whose key part has an
    exactly zero gradient, so Adam's steps there follow the rounding noise alone (measured 5.4e-2; 1e-1 allowed).

    Catches: masters kept for the whole unit instead of the owned shard, a bf16 weight shard not rounded from
    the updated master, a gather that loses precision (fp32 staging of bf16 values, or the other way)."""
    from tests.test_data_parallel import run_plan

    stage, replicas, ratios = CASES["stage 3, tp3:1 beside single, 0.7/0.3, recompute"]
    plans = {k: replicas_plan(tiny(0.1, dtype="bf16"), replicas, zero_stage=k, ratios=ratios) for k in (3, 2, 1)}
    got, two, base = run(plans[3]), run(plans[2]), run_plan(plans[1])
    _, _, owned = _unit_counts(plans[3])
    for res, ref in zip(got, base):
        dev = plans[3].device_ids()[res["position"].rank]
        assert res["param_dtypes"] == {torch.bfloat16} and res["state_dtypes"] == {torch.float32}
        held = res["held"]
        assert held.master_bytes == 4 * owned[dev] and held.moments_bytes == 8 * owned[dev], dev
        assert res["rest"]["params"] == 0 and res["rest"]["weight_shards"] == 2 * owned[dev]
        assert res["rest"]["grad_shards"] == 2 * owned[dev]
        for a, b in zip(res["losses"], ref["losses"]):
            assert abs(a - b) <= 2e-3, (res["losses"], ref["losses"])
    assert got[0]["losses"][-1] < got[0]["losses"][0] - 1e-3  # it trains
    assert [r["losses"] for r in got] == [r["losses"] for r in two]
    for name, want in base[0]["full"].items():
        assert torch.equal(got[0]["full"][name], two[0]["full"][name]), f"{name}: stage 3 differs from stage 2"
        for k, what in enumerate(("fp32 master", "exp_avg", "exp_avg_sq")):
            err = rel_err(got[0]["full"][name][k], want[k])
            assert err <= (1e-1 if name.endswith("c_attn.bias") else 4e-2), f"{name}: {what} off by {err:.2e} from stage 1"


def _fp16_worker(rank, world, plan):
    from runtime.train.checkpoint import _gather_full_state
    from runtime.data.source import TokenSource
    from runtime.train.engine import Engine
    from runtime.train.precision import LossScaleSettings

    settings = LossScaleSettings(initial_scale=2.0**10, growth_interval_steps=2)
    engine = Engine(plan, rank, seed=SEED, lr=1e-3, loss_scale=settings)
    data = TokenSource(plan.model, seed=SEED, global_batch=plan.global_batch)
    before = _gather_full_state(engine)
    # Only replica 1's device overflows, in its final LayerNorm (an edge: reduce-scattered last).
    hook = engine.model.ln_f.weight.register_hook(lambda g: torch.full_like(g, math.inf)) if engine.pos.pipeline == 1 else None
    stats = [engine.train_step(0, data)]
    after0 = _gather_full_state(engine)
    hook.remove() if hook is not None else None
    stats += [engine.train_step(1, data), engine.train_step(2, data)]
    return {"skipped": [s.skipped for s in stats], "scales": [s.loss_scale for s in stats],
            "losses": [s.loss for s in stats], "steps": engine.optimizer_steps(),
            "before": before, "after0": after0, "end": _gather_full_state(engine)}


# Long: fp16 overflow skipped on every rank runs quick at stage 1 in tests/test_data_parallel.py.
@pytest.mark.long
@pytest.mark.parametrize("stage", [2, 3])
def test_fp16_layered_skips_overflowing_steps_everywhere(stage):
    """fp16 at stage 2 and 3 (0.7/0.3, 3 micro-batches beside 1); step 0 overflows on one rank only, in a
    piece the other rank owns most of. Every rank skips it (state unchanged, scale halved), then steps 1 and 2
    update. Catches an overflow check that reads freed full gradients instead of the owned shards, and an
    owner that steps while its peer skips."""
    plan = replicas_plan(tiny(0.0, dtype="fp16"), SINGLES_3_1, zero_stage=stage, ratios=[0.7, 0.3])
    results = run_ranks(_fp16_worker, 2, plan)
    for r in results:
        assert r["skipped"] == [True, False, False] and r["scales"] == [1024.0, 512.0, 512.0]
        assert r["steps"] == 2 and all(math.isfinite(x) for x in r["losses"])
    first = results[0]
    assert all(torch.equal(first["before"][n], first["after0"][n]) for n in first["before"])
    assert any(not torch.equal(first["end"][n][0], first["before"][n][0]) for n in first["end"])


# --- checkpoints across stages ----------------------------------------------------------------------------


@pytest.mark.long  # a resume chain; tests/test_runtime_train.py resumes under another plan in the default run
def test_resume_across_stages_3_0_2_keeps_the_loss_curve(tmp_path):
    """Six steps at stage 3 (0.7/0.3, 3 micro-batches beside 1), saved at step 2; resumed to step 4 at stage 0
    as a two-stage pipeline beside one device; its step-4 checkpoint resumed to 6 at stage 2 with TP 3:1 beside
    one device and ratios 0/1, and again at stage 3 with that shape and ratios 0.3/0.7. The resumed steps'
    losses equal the uninterrupted run's (1e-5), and the final weights and moments do within 1e-4 per tensor
    (other plans sum in other orders; clipped every step).

    Catches: a stage 3 checkpoint that reads released parameters (zeros) instead of the weight shards, shards
    loaded into the wrong ranges, and a stage 3 load that writes into released storage."""
    from runtime.launch.launcher import TrainConfig, train
    from tests.test_data_parallel import PP_AND_SINGLE, RESUME_OPTS, assert_same_checkpoint, resume_chain

    spec = tiny(0.1)
    x = replicas_plan(spec, SINGLES_3_1, zero_stage=3, ratios=[0.7, 0.3])
    y = replicas_plan(spec, PP_AND_SINGLE)
    z = replicas_plan(spec, TP_AND_SINGLE, zero_stage=2, ratios=[0.0, 0.0, 1.0])
    w = replicas_plan(spec, TP_AND_SINGLE, zero_stage=3, ratios=[0.3, 0.3, 0.7])
    assert x.global_batch == y.global_batch == z.global_batch == w.global_batch == 8
    losses = resume_chain(tmp_path, x, y, z)
    # And back into stage 3 from stage 0's checkpoint, another shape and other ratios.
    shutil.copytree(tmp_path / "y" / "step-000004", tmp_path / "w" / "step-000004")
    back = train(TrainConfig(plan=w, steps=6, save_dir=str(tmp_path / "w"), resume=True, **RESUME_OPTS))
    for got, want in zip([s.loss for s in back], losses[4:]):
        assert got == pytest.approx(want, rel=1e-5)
    for other in ("z", "w"):
        assert_same_checkpoint(tmp_path / "x" / "step-000006", tmp_path / other / "step-000006")


# --- what is refused ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", [2, 3])
def test_layered_stages_refuse_pipelines(stage):
    """A replica of more than one stage cannot run layer by layer: the plan is refused with a message that
    names the replica and the stages that allow pipelines."""
    from tests.test_data_parallel import PP_AND_SINGLE

    with pytest.raises(Exception, match="one stage"):
        replicas_plan(tiny(0.1), PP_AND_SINGLE, zero_stage=stage, ratios=[0.7, 0.7, 0.3])
