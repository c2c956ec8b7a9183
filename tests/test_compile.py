"""``baton train --compile``: each layer's operators as torch.compile graphs (``ParallelBlock.compile_operators``).

The compiled layer must train with the uncompiled layer's numbers (fp32, within 1e-5 relative), with the same
recomputation (counted per operator, as the parity tests count it), the same tensor-parallel all-reduces and the
same dropout masks; a plan it cannot run (activation offload) is refused before any rank starts, in one line.

Inductor compiles C++ on a CPU, minutes on a busy 2-core machine before its cache is warm, so the runs with the
run's own backend are long; the quick one compiles with ``aot_eager`` (the same Dynamo graphs, graph breaks,
guards and autograd, without generated kernels), the others compile nothing.
"""
from __future__ import annotations

import json
from functools import partial

import pytest
import torch

from tests.runtime_helpers import assert_parity, plan_of, rel_err, tiny

ATTN_CORE = ["attn_scores", "softmax", "attn_dropout"]
COMPILE_TIMEOUT_S = 900.0
"""Bound of a compiling rank run (inductor's C++ compilation from a cold cache on a busy 2-core machine)."""


def _steps(plan, *, compiled: bool, backend: str = "inductor", steps: int = 3, seed: int = 0):
    """An engine of a one-rank plan (this process's group), compiled or not: its losses, step-0 gradients and stats."""
    from runtime.data.source import TokenSource
    from runtime.train.engine import Engine

    engine = Engine(plan, 0, seed=seed, lr=1e-3)
    if compiled:
        engine.model.compile_layers(backend)
    data = TokenSource(plan.model, seed=seed, global_batch=plan.global_batch)
    losses, grads, stats = [], None, []
    for step in range(steps):
        s = engine.train_step(step, data)
        if step == 0:
            grads = {n: p.grad.clone() for n, p in engine.model.named_parameters() if p.grad is not None}
        losses.append(s.loss)
        stats.append(s)
    return losses, grads, stats


def _assert_same_training(plan, backend: str) -> None:
    eager_losses, eager_grads, eager_stats = _steps(plan, compiled=False)
    losses, grads, stats = _steps(plan, compiled=True, backend=backend)
    for i, (got, want) in enumerate(zip(losses, eager_losses)):
        assert abs(got - want) <= 1e-5 * abs(want), f"step {i}: compiled loss {got} != uncompiled {want}"
    for name, want in eager_grads.items():
        assert rel_err(grads[name], want) <= 1e-5, f"grad of {name} off by {rel_err(grads[name], want):.2e}"
    for got, want in zip(stats, eager_stats):
        assert got.recomputed_ops == want.recomputed_ops  # the replays run, and the meter sees them
    rec = plan.pipelines[0].stages[0].devices[0].recompute
    if rec:
        assert all(ms > 0 for ms in stats[-1].recompute_ms), "recomputation of the compiled graphs was not timed"


@pytest.mark.long  # one rank; compiled layers against the single device, TP and recomputation: test_tensor_parallel_3_to_1_compiled_aot_eager
def test_compiled_layers_train_as_uncompiled_aot_eager(one_rank_group):
    """One rank, dropout on, attention core and gelu recomputed, graphs through aot_eager.

    Catches: dropout masks keyed by a traced Python step (every step a new graph, then eager past the limit, or
    the masks of the step traced first), a recomputed segment whose replay skips the meter, and a run of kept
    operators that hands the next one a tensor it did not return."""
    plan = plan_of(tiny(0.1, num_layers=2), [[1]], [2], 1, m=2, recompute={0: [*ATTN_CORE, "gelu"]})
    _assert_same_training(plan, "aot_eager")


@pytest.mark.long  # through inductor (the run's backend); the graphs through aot_eager: test_tensor_parallel_3_to_1_compiled_aot_eager
def test_compiled_layers_train_as_uncompiled_inductor(one_rank_group):
    """The loss curve of four layers, no recomputation and then recomputation, compiled by inductor, within 1e-5 of
    the uncompiled one (fp32). Catches what the aot_eager test catches, in the kernels the run executes."""
    _assert_same_training(plan_of(tiny(0.1), [[1]], [4], 1, m=2), "inductor")
    _assert_same_training(plan_of(tiny(0.1), [[1]], [4], 1, m=2, recompute={0: [*ATTN_CORE, "gelu"]}), "inductor")


def _compiled_worker(rank, world, plan, steps, seed, lr, *, backend):
    """``tests.runtime_helpers.parallel_worker`` with the stage's layers compiled (and the step's all-reduce count)."""
    from runtime.data.source import TokenSource
    from runtime.parallel.tensor_parallel import AllReduceClock
    from runtime.train.engine import Engine

    # A rank whose peer compiles other graphs (its own recomputation) waits at the all-reduces in between.
    engine = Engine(plan, rank, seed=seed, lr=lr, timeout_s=COMPILE_TIMEOUT_S)
    engine.model.compile_layers(backend)
    data = TokenSource(plan.model, seed=seed, global_batch=plan.global_batch)
    stats = engine.forward_backward(0, data)
    calls = AllReduceClock.calls
    grads = {n: p.grad.clone() for n, p in engine.model.named_parameters()}
    losses = [stats.loss]
    engine.optimizer.step()
    engine.model.zero_grad(set_to_none=True)
    for step in range(1, steps):
        losses.append(engine.train_step(step, data).loss)
    from torch._dynamo.utils import counters

    return {"grads": grads, "slices": engine.model.slices(), "losses": losses, "stats": stats, "position": engine.pos,
            "gathered": None, "allreduces": calls, "graph_breaks": dict(counters["graph_break"])}


def _tp_parity(backend: str, monkeypatch) -> None:
    import tests.runtime_helpers as helpers

    plan = plan_of(tiny(0.1, num_layers=2), [[3, 1]], [2], 4, m=2,
                   recompute={0: ATTN_CORE, 1: ["fc1", "gelu", "fc2", "resid2", "ln1"]})
    # assert_parity's ranks run the compiled worker (a partial of a module function: the ranks unpickle it), given
    # the time a cold compilation takes.
    monkeypatch.setattr(helpers, "parallel_worker", partial(_compiled_worker, backend=backend))
    monkeypatch.setattr(helpers, "run_ranks", partial(helpers.run_ranks, timeout=COMPILE_TIMEOUT_S))
    results = assert_parity(plan)
    # Per layer: out_proj's and fc2's forward all-reduces, qkv's and fc1's backward ones; the embedding's and the
    # head's besides. Compiled, every one still runs outside the graphs, on this process's clock.
    assert results[0]["allreduces"] == results[1]["allreduces"] > 4 * plan.num_microbatches * 2
    # A break inside an operator made Dynamo give up on its whole run, which then ran eagerly, numbers unchanged.
    assert all(not r["graph_breaks"] for r in results), [r["graph_breaks"] for r in results]


def test_tensor_parallel_3_to_1_compiled_aot_eager(monkeypatch):
    """TP 3:1 over gloo, each rank recomputing other operators, compiled (aot_eager): parity with one device.

    Catches: an all-reduce traced into a graph (ranks then disagree on what runs, or the clock misses it), a
    copy_to_tp whose backward all-reduce is lost in the graph, a graph break inside an operator (Dynamo then runs the
    whole run eagerly), and dropout masks drawn for local heads."""
    _tp_parity("aot_eager", monkeypatch)


@pytest.mark.long  # inductor's kernels; the graphs and collectives through aot_eager: test_tensor_parallel_3_to_1_compiled_aot_eager
def test_tensor_parallel_3_to_1_compiled_inductor(monkeypatch):
    """The same TP 3:1 parity with inductor's kernels."""
    _tp_parity("inductor", monkeypatch)


def test_refuses_offload_in_one_line(tmp_path):
    """A plan that offloads activations: one line naming --compile and why, exit code 2, before any rank starts."""
    from dataclasses import replace

    from baton.plan import save_plan
    from runtime.parallel.stage import check_compile
    from tests.conftest import run_cli

    plan = plan_of(tiny(0.1), [[1]], [4], 1, m=2)
    stage = plan.pipelines[0].stages[0]
    device = replace(stage.devices[0], offload=("layer_input",))
    plan = replace(plan, pipelines=(replace(plan.pipelines[0], stages=(replace(stage, devices=(device,)),)),))
    path = tmp_path / "offload.json"
    save_plan(plan, path)
    code, out, err = run_cli("train", "--plan", path, "--steps", "1", "--compile", "--run-dir", tmp_path / "run")
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2, (code, out, err)
    assert len(lines) == 1 and "--compile" in lines[0] and "offload" in lines[0], err
    assert "Traceback" not in out + err
    check_compile(plan_of(tiny(0.1), [[1]], [4], 1, m=2))  # the plan without offload is taken


def test_compiled_program_runs_between_allreduces():
    """The compiled program: kept operators in runs that end at every all-reduce and segment, each returning only
    what is read after it. Catches a run that swallows an all-reduce (the graph would then hold a collective) and
    one that returns every intermediate (kept alive, so the graph saves nothing)."""
    from runtime.parallel.tp_layer import ParallelBlock

    spec = tiny(0.1)
    block = ParallelBlock(spec, 0, heads=range(4), ffn_cols=range(256), recompute=frozenset({"gelu"}))
    block.compile_operators("aot_eager")
    program = [("allreduce",) if isinstance(item, tuple) else (type(item).__name__, [o.name for o in item.ops], item.outputs)
               for item in block.program]
    assert program == [
        ("_Run", ["ln1", "qkv", "attn_scores", "softmax", "attn_dropout", "attn_v", "out_proj"], ("attn_partial",)),
        ("allreduce",),
        ("_Run", ["resid1", "ln2", "fc1"], ("x_mid", "fc1_out")),
        ("_Segment", ["gelu"], ("gelu_out",)),
        ("_Run", ["fc2"], ("mlp_partial",)),
        ("allreduce",),
        ("_Run", ["resid2"], ("layer_output",)),
    ], program


def test_dropout_masks_of_a_tensor_key():
    """The masks a compiled graph draws (its key a tensor) are the uncompiled layer's, bit for bit."""
    from runtime.model.rng import DropoutKey, TensorKey, attention_keep, residual_keep

    key = DropoutKey(7, 123456, 3)
    samples = torch.tensor([5, 9, 2])
    table = TensorKey(key.bases())
    assert torch.equal(attention_keep(key, samples, range(1, 3), 16, 0.1), attention_keep(table, samples, range(1, 3), 16, 0.1))
    for op in ("resid1", "resid2"):
        assert torch.equal(residual_keep(key, op, samples, 16, 8, 0.1), residual_keep(table, op, samples, 16, 8, 0.1))


def test_train_notes_tables_profiled_otherwise(tmp_path):
    """A measured table that predicts the plan, profiled uncompiled: --compile says so in one line; a table whose
    settings say compiled: the uncompiled run says so; matching settings: nothing."""
    from baton.profile import derive_table, table_filename, write_table
    from runtime.commands.profile import compile_mismatch, settings_path

    plan = plan_of(tiny(0.1), [[1]], [4], 1, m=2)
    cluster = tmp_path / "c.yaml"
    cluster.write_text("name: c\nnodes:\n  - name: d0\n    gpus:\n      - type: a100-80gb\n        count: 1\n")
    table = derive_table(plan.model, "a100-80gb", micro_batches=(1, 2))
    table["source"] = "measured"
    path = tmp_path / "profiles" / "measured" / table_filename("a100-80gb", plan.model.profile_name, plan.model.seq_len)
    path.parent.mkdir(parents=True)
    write_table(table, path)
    assert compile_mismatch(plan, False, cluster, tmp_path / "profiles") is None
    line = compile_mismatch(plan, True, cluster, tmp_path / "profiles")
    assert line is not None and "--compile" in line and "without --compile" in line and "\n" not in line
    settings_path(path).write_text(json.dumps({"compile": True}))
    assert compile_mismatch(plan, True, cluster, tmp_path / "profiles") is None
    assert "with --compile" in compile_mismatch(plan, False, cluster, tmp_path / "profiles")


@pytest.mark.long  # compiles inductor kernels for a table; the note on the table's setting: test_train_notes_tables_profiled_otherwise
def test_profile_times_compiled_layers_and_records_it(tmp_path):
    """``baton profile --device cpu --compile``'s measurer: a valid table whose layers ran compiled, and beside it
    the setting, which the note of ``baton train`` reads back."""
    from dataclasses import asdict

    from baton.commands import MeasureRequest
    from baton.profile import read_table
    from runtime.commands.profile import measure, table_compiled
    from runtime.parallel.tp_layer import _GRAPHS

    out = tmp_path / "cpu__tiny__s32.csv"
    request = MeasureRequest(model="tiny", device="cpu", gpu=None, seq_len=None, micro_batches=(2,), tp_shares=None,
                             warmup=1, reps=2, threads=None, comm=False, comm_ranks=2, concurrent=1, out=out)
    # The core's request with a compile field (the measurer reads it where the core's option sets it).
    compiled_request = type("Request", (), {**asdict(request), "compile": True})()
    measure(compiled_request)
    assert len(read_table(out)) > 0 and table_compiled(out)
    assert _GRAPHS, "the layers timed were not compiled"
    measure(request)
    assert not table_compiled(out)
