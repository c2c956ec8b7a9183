"""Ctrl-C in `baton solve` stops the search the way its time limit does (solver/stop.py): the best plan so far, a bound
that still holds, and a second Ctrl-C interrupts as before."""
from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import sys
import threading

import pyomo.environ as pyo
import pytest
from pyomo.contrib.solver.common.results import TerminationCondition

from baton.cluster import load_cluster
from baton.evaluate import evaluate
from baton.model_spec import PRESETS
from baton.plan import load_plan
from baton.profile import ProfileSet
from solver import stop
from solver.milp import highs_solve
from solver.search import search
from tests.conftest import ROOT


@pytest.fixture(autouse=True)
def _no_request_left():
    stop.clear()
    yield
    stop.clear()


def test_a_stop_request_ends_the_search_with_its_best_plan_and_a_bound_that_holds():
    spec = PRESETS["gpt3-6.7b"]
    cluster, profiles = load_cluster(ROOT / "clusters" / "poplar_a.yaml"), ProfileSet(spec)
    full = search(spec, cluster, profiles, global_batch=64, time_limit=120, gap=1e-6, threads=1)
    assert full.status == "optimal"

    def request_at_first_plan(line: str) -> None:  # the structured search goes on for a while after its first plan
        if "(constructive)" in line:
            stop.request()

    res = search(spec, cluster, profiles, global_batch=64, time_limit=120, gap=1e-6, threads=1, log=request_at_first_plan)
    assert res.status == "interrupted"
    assert res.bound_ms <= full.objective_ms * (1 + 1e-9)  # what it claims still holds over the family
    assert res.objective_ms >= full.objective_ms * (1 - 1e-9)
    assert math.isclose(evaluate(res.plan, cluster, profiles).iteration_time_ms, res.objective_ms, rel_tol=1e-9)


def test_a_stop_request_cancels_the_milp_being_solved():
    """A multidimensional knapsack HiGHS does not close in seconds; the request comes from another thread while it runs,
    and the solve returns its incumbent and a dual bound that holds."""
    rng = random.Random(1)
    n, k = 300, 40
    m = pyo.ConcreteModel()
    m.x = pyo.Var(range(n), domain=pyo.Binary)
    m.rows = pyo.ConstraintList()
    for _ in range(k):
        w = [rng.randint(1, 100) for _ in range(n)]
        m.rows.add(sum(w[j] * m.x[j] for j in range(n)) <= sum(w) // 2)
    m.obj = pyo.Objective(expr=sum(rng.randint(1, 100) * m.x[j] for j in range(n)), sense=pyo.maximize)
    timer = threading.Timer(0.5, stop.request)
    timer.start()
    try:
        res = highs_solve(m, threads=1, time_limit=30, rel_gap=0.0)
    finally:
        timer.cancel()
    assert stop.requested()
    # Cancelled: neither solved nor stopped by its own limit.
    assert res.termination_condition not in (TerminationCondition.convergenceCriteriaSatisfied,
                                             TerminationCondition.maxTimeLimit)
    assert res.incumbent_objective is not None and res.objective_bound >= res.incumbent_objective


def test_the_first_ctrl_c_asks_for_a_stop_and_the_second_interrupts(capfd):
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        with stop.on_interrupt("stopping: test"):
            signal.raise_signal(signal.SIGINT)
            assert stop.requested()
            signal.raise_signal(signal.SIGINT)
    assert not stop.requested()
    assert signal.getsignal(signal.SIGINT) is before
    assert "stopping: test" in capfd.readouterr().err


def test_ctrl_c_during_baton_solve_prints_and_writes_the_best_plan(tmp_path):
    """A real process and a real SIGINT, sent while rule 15's pass over every plan runs (about a minute at the
    default limit on poplar_a): the structured family's plan comes out, written and printed, exit code 0."""
    out = tmp_path / "plan.json"
    proc = subprocess.Popen([sys.executable, "-m", "cli", "solve", "--cluster", str(ROOT / "clusters" / "poplar_a.yaml"),
                             "--model", "gpt3-6.7b", "--out", str(out)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        seen = []
        for line in proc.stderr:
            seen.append(line)
            if "searching every plan" in line:
                proc.send_signal(signal.SIGINT)
                break
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = "".join(seen) + stderr
    assert proc.returncode == 0, stderr
    assert "stopping: the best plan so far follows" in stderr
    line = " ".join(stdout.split())
    assert "solver: optimal (strategy baton; among plans of the structured family" in line, line
    assert "(eq. 12b)" in line, line  # the pass stopped while bounding its skeletons: it proves nothing
    plan = load_plan(out)
    cluster = load_cluster(ROOT / "clusters" / "poplar_a.yaml")
    t = evaluate(plan, cluster, ProfileSet(plan.model)).iteration_time_ms
    assert math.isclose(t, plan.info["objective_ms"], rel_tol=1e-6)
    assert json.loads(out.read_text())  # whole, not half written
    assert os.path.getsize(out) > 0


def test_a_search_stopped_after_seeding_a_stage_claims_no_less_than_it_had_proven(monkeypatch):
    """Rule 12's stage entries wait at rule 10's bound of all their splits; once taken, their candidates enter the
    heap at their own cheap bounds, which may lie far lower. A stop right then must keep the stage's bound for them
    (``_Entry.covered_ms``), not fall back to the cheap ones: the bound at the stop is no less than the last one
    printed. The stop is requested right after rule 15's pass seeds its first stage from the heap."""
    import solver.search as S

    spec = PRESETS["gpt3-6.7b"]
    cluster, profiles = load_cluster(ROOT / "clusters" / "poplar_c.yaml"), ProfileSet(spec)
    printed: list[float] = []  # (on this 2-core VM: 8,887.3 ms printed; 8,409.7 ms claimed at the stop without it)

    def log(line: str) -> None:
        if "the bound holds over every plan" in line:
            printed.append(float(line.split(" bound ")[1].split(" ms")[0]))

    seed_stage = S._seed_stage

    def seed_then_stop(inputs, frontier, *args, **kwargs):
        seed_stage(inputs, frontier, *args, **kwargs)
        if inputs.exact and printed:  # rule 15's pass, taking a stage from the heap
            stop.request()

    monkeypatch.setattr(S, "_seed_stage", seed_then_stop)
    res = search(spec, cluster, profiles, global_batch=64, time_limit=300, gap=1e-6, threads=1, every_plan=True,
                 log=log)
    assert stop.requested() and printed
    assert res.space_bound_ms >= printed[-1] - 0.05, (res.space_bound_ms, printed)
