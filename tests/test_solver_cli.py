"""`baton solve` end to end on the reference cluster, its baselines, and its user errors."""
from __future__ import annotations

import json
import math

import pytest

from baton.cluster import load_cluster
from baton.evaluate import evaluate
from baton.profile import ProfileSet
from baton.model_spec import PRESETS
from baton.plan import load_plan
from tests.conftest import ROOT, run_cli

CLUSTER = ROOT / "clusters" / "a100x2_t4x2.yaml"


@pytest.fixture(scope="module")
def reference_solve(tmp_path_factory):
    """`baton solve` of gpt3-1.3b on the reference cluster with the defaults (global batch 64, --time-limit 60,
    --gap 1e-4, 2 threads): the slowest solve here, run once for the module. The baselines are held against it."""
    out = tmp_path_factory.mktemp("reference-solve") / "plan.json"
    code, stdout, stderr = run_cli("solve", "--cluster", CLUSTER, "--model", "gpt3-1.3b", "--out", out)
    return code, stdout, stderr, out


def test_solve_reference_cluster_writes_a_checked_plan(reference_solve):
    code, stdout, stderr, out = reference_solve
    assert code == 0, stderr
    assert "optimal" in stdout and "proven gap" in stdout and "efficiency vs ideal" in stdout
    assert "among plans of the exact family: every plan with these options" in " ".join(stdout.split())
    plan = load_plan(out)
    assert plan.global_batch == 64
    for key in ("strategy", "objective_ms", "gap", "status", "build_s", "solve_s"):
        assert key in plan.info
    rep = evaluate(plan, load_cluster(CLUSTER), ProfileSet(plan.model))
    assert rep.fits
    assert math.isclose(rep.iteration_time_ms, plan.info["objective_ms"], rel_tol=1e-6)
    # The hand-made example plan takes ~11.9 s; the solver must do better than that and reach 90% of ideal.
    assert rep.iteration_time_ms < 11_000 and rep.efficiency_vs_ideal >= 0.9


def test_a_structured_solve_names_the_space_its_optimum_holds_over():
    """Issue 25: a restriction that stays is part of the problem statement, and the output says so."""
    # 5 s: too little for rule 15's pass over every plan, which would prove this plan optimal over every plan in ~50 s
    code, stdout, stderr = run_cli("solve", "--cluster", ROOT / "clusters" / "poplar_a.yaml", "--model", "gpt3-1.3b",
                                   "--time-limit", "5")
    assert code == 0, stderr
    line = " ".join(stdout.split())
    assert ("optimal (strategy baton; among plans of the structured family: TP groups within one node and GPU type, "
            "a node kind's nodes all or none, replicas of one shape, its batch splits") in line, line
    assert "over every plan: gap" in line, line
    assert "(so far), bound" in stderr, stderr  # the family's gap is printed once every skeleton is in


def test_solve_json_output():
    code, stdout, stderr = run_cli("solve", "--cluster", CLUSTER, "--model", "gpt3-1.3b", "--json", "--micro-batch", "1",
                                   "--gap", "0.01")
    assert code == 0, stderr
    data = json.loads(stdout)
    assert data["solver"]["status"] == "optimal"
    assert data["plan"]["micro_batch_size"] == 1
    assert data["report"]["fits"]


@pytest.mark.parametrize("strategy", ["megatron", pytest.param("hethub", marks=pytest.mark.long), "hap", "poplar", "cephalo"])
def test_baselines_fit_and_are_never_faster_than_baton(strategy, reference_solve):
    """Baton's plan is the reference solve's (the same call as run_strategy("baton", ...) with these arguments);
    hethub's own search takes seconds, the other baselines a fraction of one."""
    from solver.commands import run_strategy

    spec = PRESETS["gpt3-1.3b"]
    cluster = load_cluster(CLUSTER)
    profiles = ProfileSet(spec)
    base = run_strategy(strategy, spec, cluster, profiles, global_batch=64, micro_batch=None, time_limit=60, gap=1e-4, threads=2)
    assert base.report.fits
    code, _, stderr, out = reference_solve
    assert code == 0, stderr
    best = evaluate(load_plan(out), cluster, profiles)
    assert best.iteration_time_ms <= base.report.iteration_time_ms * (1 + 1e-4)
    if strategy == "megatron":
        stages = [s for p in base.plan.pipelines for s in p.stages]
        assert len({s.num_layers for s in stages}) == 1 and len({s.units_per_layer for s in stages}) == 1
    if strategy == "hap":
        assert base.plan.num_stages == 1
    if strategy in ("poplar", "cephalo"):  # pure data parallelism: every device its own replica
        assert len(base.plan.pipelines) == len(cluster.devices)
        assert all(len(p.stages) == 1 and len(p.stages[0].devices) == 1 for p in base.plan.pipelines)
    if strategy == "cephalo":  # FSDP with layered accumulation
        assert base.plan.zero_stage == 3


@pytest.mark.parametrize("args, message", [
    (("--zero-stage", "4"), "sharding stage '4' is not one of 0, 1, 2, 3"),
    (("--zero-stage", "-1"), "sharding stage '-1' is not one of 0, 1, 2, 3"),
    (("--zero-stage", "2", "--strategy", "hethub"), "--zero-stage applies to baton, poplar, exhaustive"),
])
def test_zero_stage_option_refuses_bad_values(args, message):
    code, _, stderr = run_cli("solve", "--cluster", CLUSTER, "--model", "gpt3-1.3b", *args)
    assert code != 0 and message in stderr, stderr


def test_solve_writes_per_replica_batches_sharding_stage_and_ratios(tmp_path):
    """gpt3-2.7b on two A100s and two T4s: two replicas (A100 then T4) fit only at sharding stage 1, each
    device owning half of its peer group's optimizer state; the plan file says so and the evaluator agrees.
    Micro-batches of 2 keep the solve to seconds (the solver's own choice of size takes half a minute)."""
    out = tmp_path / "plan.json"
    code, stdout, stderr = run_cli("solve", "--cluster", CLUSTER, "--model", "gpt3-2.7b", "--out", out, "--threads", "1",
                                   "--micro-batch", "2")
    assert code == 0, stderr
    assert "sharding stage 1" in stdout and "shard ratios" in stdout
    plan = load_plan(out)
    assert plan.zero_stage == 1 and len(plan.pipelines) == 2
    rep = evaluate(plan, load_cluster(CLUSTER), ProfileSet(plan.model))
    assert rep.fits and {d.owned_fraction for d in rep.devices} == {0.5}
    assert math.isclose(rep.iteration_time_ms, plan.info["objective_ms"], rel_tol=1e-6)
    from dataclasses import replace
    assert not evaluate(replace(plan, zero_stage=0), load_cluster(CLUSTER), ProfileSet(plan.model)).fits


def test_shard_grid_option():
    code, stdout, stderr = run_cli("solve", "--cluster", CLUSTER, "--model", "gpt3-1.3b", "--shard-grid", "0")
    assert code == 2 and "--shard-grid" in stderr
    # Micro-batches of 1 and a 1% gap: seconds instead of half a minute; the plan is still two replicas at stage 1.
    code, stdout, stderr = run_cli("solve", "--cluster", CLUSTER, "--model", "gpt3-1.3b", "--shard-grid", "4", "--json",
                                   "--threads", "1", "--micro-batch", "1", "--gap", "0.01")
    assert code == 0, stderr
    assert json.loads(stdout)["report"]["fits"]


@pytest.mark.parametrize("args, needle", [
    (["--strategy", "fastest"], "unknown strategy"),
    # Without --profiles the missing tables are derived (tests/test_derived_tables.py); a --profiles directory is searched alone.
    (["--seq-len", "1024", "--profiles", str(ROOT / "profiles")], "no profile for GPU"),
    (["--micro-batch", "3"], "does not divide"),
    (["--gap", "2"], "--gap"),
    (["--strategy", "exhaustive", "--micro-batch", "4"], "small instances only"),  # one size: the estimate takes 1 s, not 20
    (["--max-chunks", "0"], "--max-chunks': must be in 1..16, got 0"),
    (["--max-chunks", "2", "--strategy", "hethub"], "--max-chunks applies to baton and exhaustive"),
])
def test_user_errors_are_one_line_exit_2(args, needle, tmp_path):
    out = tmp_path / "plan.json"
    code, stdout, stderr = run_cli("solve", "--cluster", CLUSTER, "--model", "gpt3-1.3b", "--out", out, *args)
    assert code == 2
    assert needle in stderr and "Traceback" not in stderr
    assert len(stderr.strip().splitlines()) == 1 or needle in stderr.replace("\n", " ")
    assert not out.exists()


def test_nothing_fits_names_device_and_overflow(tmp_path):
    cluster = tmp_path / "small.yaml"
    cluster.write_text(
        "name: small\nmemory_reserve_gib: 1.0\nnodes:\n  - name: n\n    gpus:\n      - type: t4\n        count: 2\n"
        "        memory_gib: 2\n    intra_node_link: {bandwidth_gb_per_s: 10.0, latency_us: 5.0}\n")
    out = tmp_path / "plan.json"
    code, stdout, stderr = run_cli("solve", "--cluster", cluster, "--model", "gpt3-1.3b", "--out", out, "--time-limit", "30")
    assert code == 2
    assert "n:" in stderr and "over by" in stderr and "GiB" in stderr
    assert not out.exists()


def test_state_that_cannot_fit_is_refused_at_once_saying_why(tmp_path):
    """gpt3-13b's weights, gradients and Adam state (16 B a parameter) exceed the four GPUs' 108 GiB together: proven
    before any search, so the command says so in one line within seconds instead of running out its time limit."""
    out = tmp_path / "plan.json"
    code, stdout, stderr = run_cli("solve", "--cluster", CLUSTER, "--model", "gpt3-13b", "--out", out, "--time-limit", "60")
    assert code == 2 and "Traceback" not in stderr
    assert "no plan fits in memory" in stderr and "time limit" not in stderr
    assert "optimizer state" in stderr and "--offload-optimizer" in stderr and "GiB" in stderr
    assert len(stderr.strip().splitlines()) == 1 or "no plan fits" in stderr.replace("\n", " ")
    assert not out.exists()


def test_max_chunks_lets_the_planner_interleave(tmp_path):
    """a100x2_t4x2 / gpt3-1.3b at micro-batches of 2: offered two chunks per group, the planner returns interleaved
    pipelines faster than its 1F1B optimum, and the evaluator prices the plan file as the solver did."""
    times = {}
    for chunks in ("1", "2"):
        out = tmp_path / f"plan{chunks}.json"
        code, stdout, stderr = run_cli("solve", "--cluster", CLUSTER, "--model", "gpt3-1.3b", "--micro-batch", "2",
                                       "--max-chunks", chunks, "--gap", "0.01", "--threads", "1", "--out", out)
        assert code == 0, stderr
        plan = load_plan(out)
        rep = evaluate(plan, load_cluster(CLUSTER), ProfileSet(plan.model))
        assert rep.fits and math.isclose(rep.iteration_time_ms, plan.info["objective_ms"], rel_tol=1e-6)
        times[chunks] = (rep.iteration_time_ms, [p.chunks for p in plan.pipelines])
    assert set(times["1"][1]) == {1} and 2 in times["2"][1]
    assert times["2"][0] < times["1"][0] * 0.99, times
