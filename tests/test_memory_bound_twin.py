"""The memory-bound case's small twin, trained on CPU processes.

``baton solve --cluster clusters/a100x2_t4x2.yaml --model gpt3-2.7b`` (docs/data-parallel.md) proves
optimal two replicas, each an A100 with layers 0-28 followed by a T4 with layers 29-31, 32 micro-batches of
1 sample each, with the optimizer state sharded between the two replicas (``zero_stage`` 1, no shard ratios:
equal parts, each device owning half of its peer group's state). tests/test_solver_cli.py checks that the
solver returns this plan; here ``full_plan`` writes it out, and the tests check that

* at full size it fits only with sharded state: the evaluator puts each A100 over its 40 GiB at stage 0 and
  every device within capacity at stage 1 (the fits-only-sharded property the twin is meant to exercise);
* its twin (``twin_of``: the same replicas, stages, devices per stage, batch split and shard ratios, on 4
  CPU processes of clusters/cpu4.yaml, with a 10-layer tiny model cut 9 + 1, the nearest to 29 : 3) trains
  on real gloo processes as the single-device model does on the whole global batch of 64, and every
  rank keeps exactly the optimizer state the evaluator predicts for its owned half.

Tolerances are those tests/test_data_parallel.py justifies for fp32, so the twin trains in fp32 (the full plan
is fp16, whose state, fp32 master weights besides the moments, is checked too, after one more step of the
same twin in fp16 in the same processes):
* losses, global gradient norms 1e-5 relative (a split changes only the order of fp32 sums; measured here at
  most 1e-7 and 1.4e-6);
* first moments after three clipped AdamW steps 1e-4 relative per tensor (measured: at most 1.7e-5);
* weights after three steps 1e-4 relative per tensor, over the elements whose step-0 gradient is above
  rounding noise (1e-4 of its tensor's rms). The twin sums 32 micro-batches of one sample per replica where
  the reference sums one batch of 64, and Adam's step follows the sign of a gradient near its eps whatever
  its rounding (test_data_parallel.py's docstring): one element of h.5.attn.c_proj.bias, whose step-0
  gradient is 5e-7 against a median of 1e-2 (cancellation over the batch), lands 4.8e-6 from the reference,
  1.3e-4 of that zero-initialised bias's norm, while every other element of that tensor is within 5e-8.
  Such elements (the key bias, whose gradient is exactly zero, and a few cancelled ones: 0.3% of the model)
  only have to stay within one step (lr) of the reference; a misplaced or unsummed shard moves whole ranges
  by about lr per step.
"""
from __future__ import annotations

from dataclasses import replace

import pytest

from baton.model_spec import PRESETS
from baton.plan import Pipeline, Plan, simple_plan, validate
from tests.runtime_helpers import rel_err, run_ranks, tiny
from tests.test_data_parallel import CLIP, LR, STEPS, _worker, reference


def full_plan(zero_stage: int = 1) -> Plan:
    """The solver's plan for gpt3-2.7b on clusters/a100x2_t4x2.yaml (global batch 64)."""
    spec = PRESETS["gpt3-2.7b"]
    pipes = [simple_plan(spec, cluster="a100x2_t4x2", stages=[[(f"a100:{i}", 1)], [(f"t4:{i}", 1)]], layers=[29, 3],
                         units_per_layer=1, micro_batch_size=1, num_microbatches=32).pipelines[0] for i in range(2)]
    return validate(Plan(model=spec, cluster="a100x2_t4x2", micro_batch_size=1, num_microbatches=32,
                         pipelines=tuple(pipes), zero_stage=zero_stage))


def twin_layers(counts: list[int], num_layers: int) -> list[int]:
    """``counts`` (layers per stage) scaled to ``num_layers``, by largest remainder, at least one per stage."""
    total = sum(counts)
    exact = [c * num_layers / total for c in counts]
    out = [max(1, int(x)) for x in exact]
    order = sorted(range(len(counts)), key=lambda i: exact[i] - int(exact[i]), reverse=True)
    for i in order[:num_layers - sum(out)]:
        out[i] += 1
    assert sum(out) == num_layers and min(out) >= 1
    return out


def twin_of(plan: Plan, spec, *, cluster: str = "cpu4") -> Plan:
    """``plan``'s structure on CPU processes ``local:0..`` in rank order: the same replicas, stages, devices per
    stage with their units, recomputation, shard ratios and every replica's micro-batch size and count; the
    layers of each replica scaled to ``spec``'s layer count."""
    it = iter(f"local:{i}" for i in range(len(plan.device_ids())))
    pipes = []
    for r, pipe in enumerate(plan.pipelines):
        layers = twin_layers([s.num_layers for s in pipe.stages], spec.num_layers)
        one = simple_plan(spec, cluster=cluster, stages=[[(next(it), d.units) for d in s.devices] for s in pipe.stages],
                          layers=layers, units_per_layer=[s.units_per_layer for s in pipe.stages])
        stages = tuple(replace(s, devices=tuple(replace(d, recompute=src.recompute, shard_ratio=src.shard_ratio)
                                                for d, src in zip(s.devices, full.devices)))
                       for s, full in zip(one.pipelines[0].stages, pipe.stages))
        b, m = plan.batch(r)
        pipes.append(Pipeline(stages=stages, micro_batch_size=b, num_microbatches=m))
    return validate(Plan(model=spec, cluster=cluster, micro_batch_size=plan.micro_batch_size,
                         num_microbatches=plan.num_microbatches, pipelines=tuple(pipes), zero_stage=plan.zero_stage))


TWIN_SPEC = tiny(0.1).with_overrides(name="tiny-twin", num_layers=10)


def _twin_worker(rank, world, plan, plan16):
    """test_data_parallel's run (three clipped AdamW steps, the full state gathered), then one step of the fp16
    twin on fresh groups: what each rank keeps at each precision."""
    from runtime.data.source import TokenSource
    from runtime.train.engine import Engine

    out = _worker(rank, world, plan, STEPS)
    engine = Engine(plan16, rank, seed=0, lr=1e-3)
    engine.train_step(0, TokenSource(plan16.model, seed=0, global_batch=plan16.global_batch))
    out["held16"], out["owned16"] = engine.precision.state_bytes(), engine.precision.owned_params()
    return out


def assert_twin_follows_reference(plan, results) -> None:
    """Losses, norms (clipped every step), gathered first moments and weights against the single-device run on
    the whole global batch, with the tolerances of the module docstring."""
    ref = reference(plan.model, plan.global_batch)
    for res in results:
        assert res["clipped"] == [True] * STEPS, res["norms"]  # every norm above CLIP: clipping acts each step
        assert res["losses"] == pytest.approx(ref["losses"], rel=1e-5), (res["position"], res["losses"], ref["losses"])
        assert res["norms"] == pytest.approx(ref["norms"], rel=1e-5), (res["position"], res["norms"], ref["norms"])
    full, noise, total = results[0]["full"], 0, 0
    for name, want in ref["weights"].items():
        assert rel_err(full[name][1], ref["exp_avg"][name]) <= 1e-4, f"{name}: exp_avg after {STEPS} steps"
        g = ref["grads"][name]
        quiet = g.abs() < 1e-4 * g.pow(2).mean().sqrt()
        got = full[name][0]
        assert rel_err(got[~quiet], want[~quiet]) <= 1e-4, f"{name}: weights after {STEPS} steps"
        if quiet.any():
            off = float((got[quiet] - want[quiet]).abs().max())
            assert off <= LR, f"{name}: a rounding-noise element {off:.2e} off, more than a step"
        noise, total = noise + int(quiet.sum()), total + g.numel()
    assert noise <= 0.01 * total, f"{noise} of {total} elements have rounding-noise gradients"
    assert CLIP < min(ref["norms"])


def test_full_plan_fits_only_with_sharded_state():
    """The A100s (29 layers, the embedding, unsharded fp16 Adam state) are over 40 GiB at zero_stage 0 and fit at
    stage 1, halving the state; the T4s fit either way. Catches a twin of a plan that does not need sharding."""
    from baton.cluster import load_cluster
    from baton.evaluate import evaluate
    from baton.profile import ProfileSet
    from tests.conftest import ROOT

    cluster = load_cluster(ROOT / "clusters" / "a100x2_t4x2.yaml")
    sharded, plain = full_plan(1), full_plan(0)
    rep1 = evaluate(sharded, cluster, ProfileSet(sharded.model))
    rep0 = evaluate(plain, cluster, ProfileSet(plain.model))
    assert rep1.fits and {d.owned_fraction for d in rep1.devices} == {0.5}
    assert not rep0.fits
    assert sorted(d.id for d in rep0.over_capacity()) == ["a100:0", "a100:1"]
    for d0, d1 in zip(rep0.devices, rep1.devices):
        assert d1.optimizer_bytes == pytest.approx(d0.optimizer_bytes / 2, rel=1e-9)
        if d0.gpu.startswith("a100"):
            assert d0.peak_memory_bytes > d0.capacity_bytes >= d1.peak_memory_bytes, d0.id


def test_twin_has_the_full_plans_structure():
    """Same replicas, stages, devices, batch split (32 x 1 each), sharding stage and owned fractions; layers 9 + 1."""
    from baton.peers import owned_fractions, peer_groups

    full, twin = full_plan(), twin_of(full_plan(), TWIN_SPEC)
    assert [[s.num_layers for s in p.stages] for p in twin.pipelines] == [[9, 1], [9, 1]]
    assert [twin.batch(r) for r in range(2)] == [full.batch(r) for r in range(2)] == [(1, 32), (1, 32)]
    assert twin.zero_stage == full.zero_stage == 1
    assert [[len(s.devices) for s in p.stages] for p in twin.pipelines] == [[len(s.devices) for s in p.stages]
                                                                            for p in full.pipelines]
    shares = [sorted(owned_fractions(p, g)) for p in (full, twin) for g in peer_groups(p)]
    assert shares and all(s == [0.5, 0.5] for s in shares)


@pytest.mark.long  # four ranks, 32 micro-batches each; the twin's plan is checked quick above, its machinery in test_data_parallel.py
def test_twin_trains_as_one_device_and_keeps_the_predicted_state():
    """The twin on 4 gloo processes (two pipelines of two stages, 32 micro-batches of 1 each, state sharded in
    halves): losses, gradient norms and, gathered from the owners, the weights and both moments after three
    clipped AdamW steps follow the single-device model on the whole batch of 64 (tests/test_data_parallel.py's
    tolerances). Every rank keeps AdamW moments (and in fp16 fp32 master weights) for exactly its owned shards:
    8 (12 in fp16) bytes per owned parameter, the evaluator's optimizer bytes to within one parameter per group.

    Catches: the 9 + 1 cut or the 32 x 1 split of either replica reading the wrong samples, the embedding tied
    across the first and last stage summed wrongly before the replicas' sync, an owner stepping with unsummed
    gradients, and state kept for the whole group (2x the prediction) instead of the owned half."""
    from baton.cluster import load_cluster
    from baton.evaluate import evaluate
    from baton.peers import group_shard_sizes, peer_groups
    from runtime.launch.devices import prediction_profiles
    from tests.conftest import ROOT

    twin = twin_of(full_plan(), TWIN_SPEC)
    twin16 = twin_of(full_plan(), TWIN_SPEC.with_overrides(dtype="fp16"))
    assert twin.global_batch == 64
    results = run_ranks(_twin_worker, len(twin.device_ids()), twin, twin16, timeout=120.0)
    assert_twin_follows_reference(twin, results)

    cluster = load_cluster(ROOT / "clusters" / "cpu4.yaml")
    for plan, key, per_param in ((twin, "held", 8), (twin16, "held16", 12)):
        report = evaluate(plan, cluster, prediction_profiles(plan, cluster, None))
        by_id = {d.id: d for d in report.devices}
        owned = {d: 0 for d in plan.device_ids()}
        groups = {d: 0 for d in plan.device_ids()}
        for g in peer_groups(plan):
            for h, s in zip(g.holders, group_shard_sizes(plan, g)):
                owned[h] += s
                groups[h] += 1
        for res in results:
            dev = plan.device_ids()[res["position"].rank]
            held = res[key]
            assert res["owned" if key == "held" else "owned16"] == owned[dev], dev
            assert by_id[dev].owned_fraction == 0.5
            assert held.moments_bytes == 8 * owned[dev], (dev, held)
            assert held.master_bytes == (per_param - 8) * owned[dev], (dev, held)
            predicted = by_id[dev].optimizer_bytes
            # Whole parameters against the cost model's exact shares: at most one parameter per group apart.
            assert abs(held.optimizer_bytes - predicted) <= per_param * groups[dev], (dev, held.optimizer_bytes, predicted)
