"""The host's launch time in the cost model (eq. 2h) and in measured tables.

* A table whose host times exceed its device times prices every pass at the host time, the evaluator and
  the MILP alike; a recomputed segment adds its host cost to the backward of the block it ends in.
* A table without host columns (derived, or measured before them) gives exactly eq. 2.
* Each offloaded tensor adds the table's host cost per tensor to its block's host time (eq. 2o), which prices
  the pass where the host bounds it, and hides behind the kernels where it does not.
* The CPU profiler writes the host columns, equal to the device times (a CPU runs its operators inside
  the calls), and a table round-trips through its CSV with them.
"""
from __future__ import annotations

import dataclasses
import math
import random

import pandas as pd
import pytest
import torch

from baton.cluster import from_mapping
from baton.costmodel import BLOCKS, layer_cost, layer_prices, layer_tensor_bytes, segments_per_block
from baton.evaluate import evaluate
from baton.memory import held_tensors, recompute_space, tensor_blocks
from baton.model_spec import PRESETS, ModelSpec
from baton.operators import layer_operators, operator_names
from baton.plan import simple_plan
from baton.profile import COLUMNS, HOST_COLUMNS, Profile, ProfileSet, derive_table, read_table, write_table
from runtime.measure.op_profiler import Measurement, offload_host_ms, profile_table, segment_host_ms
from solver.baselines import exhaustive
from solver.search import search
from tests.test_priced_plan import _agree_term_by_term, _random_plan
from tests.test_solver_helpers import random_instance

SPEC = ModelSpec(name="host", num_layers=3, hidden_dim=32, num_heads=2, ffn_dim=128, seq_len=32, vocab_size=128,
                 dtype="fp16", dropout=0.1, attention="eager")
GPU = "a100-40gb"
TINY = PRESETS["tiny"]


def with_host(df: pd.DataFrame, *, fwd: float | dict = 3.0, bwd: float | dict = 3.0, segment_ms: float | dict = 0.0,
              offload_ms: tuple[float, float] = (0.0, 0.0)) -> pd.DataFrame:
    """``df`` with host columns: each row's device times times ``fwd``/``bwd``, ``segment_ms`` as the cost of a
    segment ending at the row's operator (each one number, or one per operator), and ``offload_ms`` as the host cost
    per offloaded tensor in the forward and in the backward on every row."""
    out = df.copy()
    per_op = lambda f: out["op"].map(f).fillna(0.0).astype(float) if isinstance(f, dict) else f  # noqa: E731
    out["fwd_host_ms"] = out["fwd_ms"] * per_op(fwd)
    out["bwd_host_ms"] = out["bwd_ms"] * per_op(bwd)
    out["seg_host_ms"] = per_op(segment_ms)
    out["off_fwd_host_ms"], out["off_bwd_host_ms"] = offload_ms
    return out


def _one_gpu():
    return from_mapping({"name": "one", "nodes": [{"name": "n", "gpus": [{"type": GPU, "count": 1}]}]}, source="<one>")


def _iteration_ms(df: pd.DataFrame, recompute=(), num_microbatches: int = 2) -> float:
    plan = simple_plan(SPEC, cluster="one", stages=[[("n:0", 1)]], layers=[SPEC.num_layers], units_per_layer=1,
                       micro_batch_size=1, num_microbatches=num_microbatches, recompute={"n:0": tuple(recompute)})
    return evaluate(plan, _one_gpu(), ProfileSet(SPEC, tables={GPU: Profile(df)})).iteration_time_ms


@pytest.fixture(scope="module")
def derived():
    return derive_table(SPEC, GPU, micro_batches=(1, 2), shares=(0.5, 1.0))


@pytest.mark.parametrize("recompute", [(), ("attn_scores", "softmax", "attn_dropout", "attn_v"), tuple(operator_names(SPEC))],
                         ids=["none", "attention", "all"])
def test_host_time_above_device_time_sets_the_iteration_time(derived, recompute):
    """Host three times the device: every pass (layers, embedding, head, recomputed forwards) costs its host
    time, so the iteration is that of a table whose device times are three times larger and has no host
    columns. Catches a max taken on the wrong side, or a term (edges, recomputation) left on device time."""
    slow = derived.assign(fwd_ms=derived["fwd_ms"] * 3.0, bwd_ms=derived["bwd_ms"] * 3.0)
    hosted = _iteration_ms(with_host(derived), recompute)
    assert hosted == pytest.approx(_iteration_ms(slow, recompute), rel=1e-9)
    assert hosted > _iteration_ms(derived, recompute) * 1.5


def test_host_time_below_device_time_changes_nothing(derived):
    for recompute in ((), tuple(operator_names(SPEC))):
        assert _iteration_ms(with_host(derived, fwd=0.5, bwd=0.5), recompute) == pytest.approx(_iteration_ms(derived, recompute),
                                                                                               rel=1e-12)


def test_each_recomputed_segment_adds_its_host_cost_where_the_host_bounds_the_backward(derived):
    """Full recomputation replays three segments per layer (the two all-reduces split it: ln1..out_proj,
    resid1..fc2, resid2); with the host bounding the backward each adds ``segh`` of the operator it ends at, per
    layer and micro-batch."""
    everything = frozenset(operator_names(SPEC))
    attn, mlp = segments_per_block(SPEC, recompute_space(SPEC, (everything,)))
    assert (attn[0], mlp[0]) == (1, 2)
    m = 2
    seg = {o: 0.01 * (k + 1) for k, o in enumerate(operator_names(SPEC))}
    base = _iteration_ms(with_host(derived), everything, m)
    more = _iteration_ms(with_host(derived, segment_ms=seg), everything, m)
    assert more - base == pytest.approx(m * SPEC.num_layers * (seg["out_proj"] + seg["fc2"] + seg["resid2"]), rel=1e-9)
    # Nothing recomputed: no segment, no cost.
    assert _iteration_ms(with_host(derived, segment_ms=seg)) == _iteration_ms(with_host(derived))
    # Device-bound backward (host a tenth of the device): a small segment cost hides behind the kernels.
    assert (_iteration_ms(with_host(derived, fwd=0.1, bwd=0.1, segment_ms=1e-6), everything, m)
            == pytest.approx(_iteration_ms(derived, everything, m), rel=1e-12))


@pytest.mark.parametrize("recompute", [(), tuple(operator_names(SPEC))], ids=["none", "all"])
def test_each_offloaded_tensor_adds_its_host_cost_where_the_host_bounds_the_pass(derived, recompute):
    """Eq. 2o's host side: a block offloading n tensors over a link fast enough to hide the copies costs n x the
    table's per-tensor host cost more in each pass where the host bounds it (host three times the device), and
    nothing more where the kernels outlast it; a slow link still costs its copies. Catches the host's offload work
    left out (the 2026-11-27 GPU run: +479 ms measured at 350m, micro-batch 2, where +49 ms was predicted)."""
    recompute = frozenset(recompute)
    offload = frozenset(held_tensors(SPEC, recompute))
    blocks = tensor_blocks(SPEC)
    count = [sum(blocks[t] == b for t in offload) for b in BLOCKS]
    assert min(count) > 0
    per_tensor = (0.01, 0.02)
    prof = Profile(with_host(derived, offload_ms=per_tensor))
    plain = layer_cost(prof, SPEC, 1, 1.0, recompute)
    off = layer_cost(prof, SPEC, 1, 1.0, recompute, offload, 1e9)
    for k in range(2):
        assert off.block_fwd_ms()[k] - plain.block_fwd_ms()[k] == pytest.approx(count[k] * per_tensor[0], rel=1e-9)
        assert off.block_bwd_ms()[k] - plain.block_bwd_ms()[k] == pytest.approx(count[k] * per_tensor[1], rel=1e-9)
    # Device-bound (host a tenth of the device): a small cost per tensor hides behind the kernels.
    quiet = Profile(with_host(derived, fwd=0.1, bwd=0.1, offload_ms=(1e-6, 1e-6)))
    assert (layer_cost(quiet, SPEC, 1, 1.0, recompute, offload, 1e9).block_fwd_ms()
            == pytest.approx(layer_cost(quiet, SPEC, 1, 1.0, recompute).block_fwd_ms(), rel=1e-12))
    # A link slow enough that the copies outlast the host's work: the copies price the pass, as without host costs.
    slow = layer_cost(prof, SPEC, 1, 1.0, recompute, offload, 1e-4)
    sizes = layer_tensor_bytes(prof, SPEC, 1, 1.0)
    for k, b in enumerate(BLOCKS):
        copy_ms = sum(sizes[t] for t in offload if blocks[t] == b) / 1e-4 / 1e9 * 1e3
        assert slow.block_fwd_ms()[k] == pytest.approx(copy_ms, rel=1e-9)
    # A table without the columns: no host cost per tensor, as before them.
    old = Profile(with_host(derived).drop(columns=["off_fwd_host_ms", "off_bwd_host_ms"]))
    assert (layer_cost(old, SPEC, 1, 1.0, recompute, offload, 1e9).block_fwd_ms()
            == pytest.approx(layer_cost(old, SPEC, 1, 1.0, recompute).block_fwd_ms(), rel=1e-12))


def test_offload_host_cost_makes_eq_2o_give_the_measured_layer():
    """Measured in a step: plain layer 1 ms forward + 2 ms backward of host time, every one of its 4 held tensors
    offloaded 1.4 + 2.8: 0.1 and 0.2 ms per tensor; noise that makes it negative gives 0."""
    def m(f, b):
        return Measurement(fwd_ms=f, bwd_ms=b, saved_bytes=0, output_bytes=0, fwd_host_ms=f, bwd_host_ms=b)

    names = ("layer_input", "attn_out", "x_mid", "mlp_out")
    assert offload_host_ms(names, m(1.0, 2.0), m(1.4, 2.8)) == pytest.approx((0.1, 0.2))
    assert offload_host_ms(names, m(1.0, 2.0), m(0.9, 2.0)) == (0.0, 0.0)


def test_segments_are_the_runtimes_checkpoints():
    """Counted as ``runtime/parallel/tp_layer._program`` wraps them: runs of recomputed operators that no kept
    operator or all-reduce interrupts, each in the block of its last operator."""
    from runtime.parallel.tp_layer import _program, _Segment

    names = operator_names(SPEC)
    rng = random.Random(5)
    sets = [frozenset(rng.sample(names, rng.randint(0, len(names)))) for _ in range(60)]
    space = recompute_space(SPEC, tuple(sets))
    attn, mlp = segments_per_block(SPEC, space)
    block = {o.name: o.block for o in layer_operators(SPEC)}
    for i in range(len(space)):
        segs = [item for item in _program(layer_operators(SPEC), space.recompute_set(i)) if isinstance(item, _Segment)]
        assert (attn[i], mlp[i]) == (sum(block[s.ops[-1].name] == "attn" for s in segs),
                                     sum(block[s.ops[-1].name] == "mlp" for s in segs))


def test_table_without_host_columns_gives_exactly_eq_2(derived, tmp_path):
    """No host columns: eq. 2 by hand, to the last bit; an old measured table (no host columns) reads as host 0."""
    prof = Profile(derived)
    assert not prof.has_host and prof.cost("fc1", 1, 1.0).seg_host_ms == 0.0
    space = recompute_space(SPEC, (frozenset(), frozenset({"softmax", "fc1", "gelu"}), frozenset(operator_names(SPEC))))
    for mb, share in ((1, 1.0), (2, 0.5), (3, 0.75)):
        p = layer_prices(prof, SPEC, mb, share, space)
        ops = layer_operators(SPEC)
        cost = {o.name: prof.cost(o.name, mb, share if o.tp_split else 1.0) for o in ops}
        assert p.fwd_ms == tuple(sum(cost[o.name].fwd_ms for o in ops if o.block == b) for b in BLOCKS)
        assert p.bwd_ms == tuple(sum(cost[o.name].bwd_ms for o in ops if o.block == b) for b in BLOCKS)
        for i in range(len(space)):
            r = space.recompute_set(i)
            by_block = [sum(cost[o.name].fwd_ms * (o.name in r) for o in ops if o.block == b) for b in BLOCKS]
            assert (p.rec_attn_ms[i], p.rec_mlp_ms[i]) == pytest.approx(by_block, rel=1e-15)
    old = derived.assign(source="measured")[COLUMNS]
    write_table(old, tmp_path / "old.csv")
    assert list(pd.read_csv(tmp_path / "old.csv").columns) == COLUMNS
    back = Profile(read_table(tmp_path / "old.csv"))
    assert not back.has_host and back.cost("fc1", 1, 0.5).fwd_host_ms == 0.0 and back.cost("fc1", 1, 0.5).bwd_host_ms == 0.0


def test_host_times_hold_flat_beyond_the_table(derived):
    """A launch does not grow with the work: host times are not extended linearly past the table's ends."""
    prof = Profile(with_host(derived, segment_ms=0.04))
    at2 = prof.cost("fc1", 2, 1.0)
    at8 = prof.cost("fc1", 8, 1.0)
    assert at8.fwd_host_ms == at2.fwd_host_ms and at8.fwd_ms > at2.fwd_ms
    assert prof.cost("fc1", 2, 0.25).bwd_host_ms == prof.cost("fc1", 2, 0.5).bwd_host_ms
    assert prof.cost("gelu", 1, 0.5).seg_host_ms == prof.cost("gelu", 16, 0.5).seg_host_ms == 0.04


def test_a_cpu_tables_host_times_grow_with_the_work(derived):
    """On a CPU the host's time is the work's own (the operators run inside their calls), so beyond the table it
    is extended as the device time is: a table measured at micro-batch 2 prices micro-batch 1 below it."""
    cpu = with_host(derived, fwd=1.0, bwd=1.0).assign(gpu="cpu")
    cpu = cpu[cpu["micro_batch"] == 2]
    prof = Profile(cpu)
    at1, at2 = prof.cost("fc1", 1, 1.0), prof.cost("fc1", 2, 1.0)
    assert at1.fwd_host_ms == pytest.approx(at1.fwd_ms) and at1.fwd_host_ms < at2.fwd_host_ms
    assert prof.cost("fc1", 2, 0.25).bwd_host_ms < prof.cost("fc1", 2, 0.5).bwd_host_ms


def test_a_host_time_falling_with_the_share_is_not_monotone(derived):
    """The equal-split reduction for identical devices needs every time to grow with the share (solver/options.py);
    a host column that falls with it must turn that off, as a device column does."""
    from solver.options import monotone_in_share

    hosted = with_host(derived, fwd=1.0, bwd=1.0)
    assert monotone_in_share(Profile(hosted))
    falling = hosted.assign(fwd_host_ms=hosted["fwd_host_ms"] / hosted["tp_share"] ** 2)
    assert not monotone_in_share(Profile(falling))


def _hosted_instance(seed: int, inst):
    """``inst`` with host columns on every table: per operator a random factor around 1 (some blocks host-bound,
    some device-bound) and a segment cost."""
    rng = random.Random(seed + 404)
    tables = {}
    for gpu in {d.gpu.name for d in inst.cluster.devices}:
        df = inst.profiles[gpu].df
        ops = sorted(df["op"].unique())
        tables[gpu] = Profile(with_host(df, fwd={o: rng.uniform(0.3, 3.0) for o in ops}, bwd={o: rng.uniform(0.3, 3.0) for o in ops},
                                        segment_ms=rng.uniform(0.001, 0.05)), source=f"<hosted {gpu}>")
    return dataclasses.replace(inst, profiles=ProfileSet(inst.spec, tables=tables))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_milp_and_evaluator_agree_with_host_times(seed):
    """The MILP's instance reads eq. 2h through the cost model's functions: term by term, and the MILP with
    every decision fixed prices the plan as the evaluator does (tests/test_priced_plan.py)."""
    rng = random.Random(seed)
    inst = _hosted_instance(seed, random_instance(seed, num_devices=rng.choice([2, 3]), num_layers=rng.choice([2, 3]), heads=4,
                                                  universe_size=3, global_batch=4, memory_scale=(50.0, 60.0)))
    assert all(inst.profiles[d.gpu.name].has_host for d in inst.cluster.devices)
    _agree_term_by_term(inst, _random_plan(inst, rng))


def test_planner_equals_exhaustive_search_with_host_times():
    """One device, every recompute set with every block-level offload choice, memory between the full- and
    no-recompute peaks, host times and segment costs in the table: the planner, with its pruning, finds the
    exhaustive optimum, and
    the evaluator prices the plan as the MILP does."""
    inst = random_instance(4, num_devices=1, num_layers=3, heads=2, universe_size=1, global_batch=2, memory_scale=(50.0, 60.0),
                           dropout=0.0)
    inst = _hosted_instance(4, inst)
    spec, dev = inst.spec, inst.cluster.devices[0]
    peaks = [evaluate(simple_plan(spec, cluster=inst.cluster.name, stages=[[(dev.id, 1)]], layers=[spec.num_layers],
                                  units_per_layer=1, micro_batch_size=1, num_microbatches=2,
                                  recompute={dev.id: rec}), inst.cluster, inst.profiles).devices[0].peak_memory_bytes
             for rec in (operator_names(spec), ())]
    capacity = int(peaks[0] + 0.4 * (peaks[1] - peaks[0]))
    cluster = dataclasses.replace(inst.cluster, devices=(dataclasses.replace(dev, memory_bytes=capacity),))
    oracle = exhaustive(spec, cluster, inst.profiles, global_batch=2, max_plans=10**5, offload=True)
    got = search(spec, cluster, inst.profiles, global_batch=2, gap=0.0, time_limit=120, threads=1, offload=True)
    assert math.isclose(got.objective_ms, oracle.objective_ms, rel_tol=1e-6), (got.plan.to_json(), oracle.plan.to_json())
    assert math.isclose(evaluate(got.plan, cluster, inst.profiles).iteration_time_ms, got.objective_ms, rel_tol=1e-6)


def test_segment_host_cost_makes_eq_2h_give_the_measured_layer():
    """Measured in a step: plain layer 1 ms + 2 ms of host time, fully recomputed 1.3 + 3.6. Eq. 2h charges the
    recomputed layer 1 + (2 + 1 + 3 segh), so segh is 0.3 ms; noise that makes it negative gives 0."""
    def m(f, b):
        return Measurement(fwd_ms=f, bwd_ms=b, saved_bytes=0, output_bytes=0, fwd_host_ms=f, bwd_host_ms=b)

    assert segment_host_ms(TINY, m(1.0, 2.0), m(1.3, 3.6)) == pytest.approx(0.3)
    assert segment_host_ms(TINY, m(1.0, 2.0), m(1.0, 2.5)) == 0.0


@pytest.fixture(scope="module")
def measured():
    torch.set_num_threads(1)
    return profile_table(TINY, micro_batches=(1, 2), shares=(0.5, 1.0), warmup=1, reps=2)


def test_cpu_profiler_writes_host_columns_equal_to_device_times(measured, tmp_path):
    """On a CPU the operators run inside the calls, so each host time is the device time's own reading (the
    bookkeeping a GPU run follows with two clocks); the segment row has host time only; the table
    round-trips through its CSV."""
    assert all(c in measured.columns for c in HOST_COLUMNS)
    timed = measured[measured["op"] != "optimizer"]
    assert (timed["fwd_host_ms"] == timed["fwd_ms"]).all() and (timed["bwd_host_ms"] == timed["bwd_ms"]).all()
    assert (timed["fwd_ms"] > 0).all()
    # One segment cost per micro-batch, on every row of the layer's operators (either attention's); none elsewhere.
    layer = measured["op"].isin(operator_names(TINY) + ["attn_core"])
    assert (measured[~layer]["seg_host_ms"] == 0).all() and (measured[layer]["seg_host_ms"] >= 0).all()
    assert (measured[layer].groupby("micro_batch")["seg_host_ms"].nunique() == 1).all()
    # The same for the host cost per offloaded tensor, each pass.
    for col in ("off_fwd_host_ms", "off_bwd_host_ms"):
        assert (measured[~layer][col] == 0).all() and (measured[layer][col] >= 0).all()
        assert (measured[layer].groupby("micro_batch")[col].nunique() == 1).all()
    write_table(measured, tmp_path / "m.csv")
    back = read_table(tmp_path / "m.csv")
    key = ["op", "micro_batch", "tp_share"]
    a, b = measured.set_index(key).sort_index(), back.set_index(key).sort_index()
    for col in ("fwd_ms", "bwd_ms", *HOST_COLUMNS):
        assert (a[col] - b[col]).abs().max() <= 1e-9 * a[col].abs().max(), col
    prof = Profile(back)
    prof.check_model(TINY)
    assert prof.has_host


def test_profiler_without_in_step_writes_the_old_table():
    torch.set_num_threads(1)
    old = profile_table(TINY, micro_batches=(1,), shares=(1.0,), warmup=0, reps=1, in_step=False)
    assert list(old.columns) == COLUMNS
    assert not Profile(old).has_host
