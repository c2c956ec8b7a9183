"""Operations of ``baton train`` as real processes: what a signal to the launcher, a stopped peer and a
damaged checkpoint do. Every test of a signal or a stopped process starts the CLI in a subprocess over gloo and
bounds every wait; the damaged-checkpoint test and the refusals run the command in this process (its ranks are
processes all the same).

These catch: ranks that outlive their launcher (they would train on with nobody watching), a stopped
peer noticed only after torch's 30-minute default, an error line that blames the wrong rank, temporary
directories that pile up, and a damaged checkpoint that ends a run instead of costing a few steps."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from baton.plan import save_plan
from runtime.launch.processes import process_state, sweep_stale_run_directories
from tests.conftest import run_cli
from tests.runtime_helpers import plan_of, tiny

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _plan(tmp_path: Path) -> Path:
    """Two pipeline stages of one device each: the smallest run with point-to-point and collectives."""
    path = tmp_path / "plan.json"
    save_plan(plan_of(tiny(0.0), [[1], [1]], [2, 2], [1, 1], m=2, mbs=1), path)
    return path


def _start(*args, env=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(ROOT / "cli.py"), "train", *map(str, args)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "COLUMNS": "200", **(env or {})})


def _children(pid: int) -> list[int]:
    """Live processes whose parent is ``pid``, oldest first."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if int(fields[1]) == pid:
            out.append((int(fields[19]), int(entry.name)))  # start time, pid
    return [p for _, p in sorted(out)]


def _ranks(launcher: subprocess.Popen, world: int, timeout: float = 60.0) -> list[int]:
    """Pids of the launcher's rank processes once all exist (not its multiprocessing helpers)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ranks = [p for p in _children(launcher.pid) if "spawn_main" in _cmdline(p)]
        if len(ranks) == world:
            return ranks
        assert launcher.poll() is None, launcher.communicate()
        time.sleep(0.1)
    raise TimeoutError("ranks did not start")


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def _gone(pids: list[int], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(process_state(p) in (None, "Z") for p in pids):
            return True
        time.sleep(0.1)
    return False


def _wait_for(path: Path, launcher: subprocess.Popen, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert launcher.poll() is None, launcher.communicate()
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.1)


def _finish(launcher: subprocess.Popen, timeout: float = 60.0) -> tuple[int, str, str]:
    try:
        out, err = launcher.communicate(timeout=timeout)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    return launcher.returncode, out, err


def _kill_all(pids) -> None:
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.long  # test_sigterm_with_a_save_dir_saves_the_current_step sends the same signal (exit 143, ranks gone)
def test_sigterm_stops_the_run_and_its_ranks(tmp_path):
    """SIGTERM to the launcher stops it like Ctrl-C (exit 143, one line) and no rank keeps running."""
    launcher = _start("--plan", _plan(tmp_path), "--steps", 10**6, "--timeout", 30)
    ranks = _ranks(launcher, 2)
    try:
        time.sleep(2)  # inside the training loop
        launcher.send_signal(signal.SIGTERM)
        code, out, err = _finish(launcher, 30)
        assert code == 143, (code, out, err)
        assert "terminated" in err and "Traceback" not in err, err
        assert _gone(ranks, 10), "ranks outlived the launcher"
    finally:
        _kill_all(ranks)


def test_sigkill_of_the_launcher_takes_its_ranks_and_the_next_run_removes_its_directory(tmp_path):
    """SIGKILL cannot be caught: the ranks' parent-death signal ends them, and the run directory the
    launcher could not remove is swept by the next run."""
    launcher = _start("--plan", _plan(tmp_path), "--steps", 10**6, "--timeout", 30)
    ranks = _ranks(launcher, 2)
    try:
        run_dirs = [p for p in Path(tempfile.gettempdir()).glob(f"baton-run-{launcher.pid}-*")]
        assert len(run_dirs) == 1
        time.sleep(1)
        launcher.kill()
        _finish(launcher, 10)
        assert _gone(ranks, 10), "ranks outlived a SIGKILLed launcher"
        assert run_dirs[0].exists()
        sweep_stale_run_directories()
        assert not run_dirs[0].exists()
    finally:
        _kill_all(ranks)


def test_a_stopped_peer_is_noticed_within_the_timeout_and_named(tmp_path):
    """SIGSTOP on rank 1 once training runs: rank 0's own wait ends after --timeout (not torch's 30
    minutes, nor the launcher's no-progress watchdog at --timeout + 60 s), and the line names rank 1 and
    its device rather than the rank that noticed.

    The clock starts at the first step on record, not at a fixed sleep: on a slow machine the ranks may
    still be importing torch seconds later, and that start-up time is no part of the timeout."""
    run = tmp_path / "run"
    launcher = _start("--plan", _plan(tmp_path), "--steps", 10**6, "--timeout", 4, "--run-dir", run)
    ranks = _ranks(launcher, 2)
    try:
        _wait_for(run / "metrics.jsonl", launcher)
        os.kill(ranks[1], signal.SIGSTOP)
        t0 = time.monotonic()
        code, out, err = _finish(launcher, 120)
        elapsed = time.monotonic() - t0
        assert code == 2, (code, out, err)
        lines = [x for x in err.splitlines() if x.strip()]
        assert len(lines) == 1 and "rank 1 (device d0:1)" in err and "stopped" in err, err
        assert "no progress" not in err, err  # the watchdog fired, not the rank's bounded wait
        assert elapsed < 4 + 60, elapsed
        assert _gone(ranks, 10)
    finally:
        _kill_all(ranks)


@pytest.mark.long  # test_a_stopped_peer_is_noticed_within_the_timeout_and_named names the failing rank too
def test_a_killed_rank_is_named_not_the_peer_that_lost_it(tmp_path):
    """SIGKILL on rank 1: rank 0 reports 'connection closed'; the line must blame rank 1."""
    launcher = _start("--plan", _plan(tmp_path), "--steps", 10**6, "--timeout", 30)
    ranks = _ranks(launcher, 2)
    try:
        time.sleep(3)
        os.kill(ranks[1], signal.SIGKILL)
        code, out, err = _finish(launcher, 60)
        assert code == 2, (code, out, err)
        assert "rank 1 (device d0:1) was killed by SIGKILL" in err, err
        assert len([x for x in err.splitlines() if x.strip()]) == 1, err
    finally:
        _kill_all(ranks)


def test_sigterm_with_a_save_dir_saves_the_current_step(tmp_path):
    """With --save-dir, SIGTERM lets the ranks finish the step, save it and stop; resuming continues."""
    ck = tmp_path / "ck"
    launcher = _start("--plan", _plan(tmp_path), "--steps", 10**6, "--timeout", 30, "--save-dir", ck,
                      "--save-every", 5, "--keep", 1)
    ranks = _ranks(launcher, 2)
    try:
        _wait_for(ck / "step-000005", launcher)
        launcher.send_signal(signal.SIGTERM)
        code, out, err = _finish(launcher, 60)
        assert code == 143, (code, out, err)
        assert "saved" in err and "Traceback" not in err, err
        saved = sorted(p.name for p in ck.iterdir() if p.name.startswith("step-"))  # the run dir too (logs, event files)
        assert len(saved) == 1 and saved[0].startswith("step-"), saved  # --keep 1
        step = int(saved[0][5:])
        assert step >= 5
        assert _gone(ranks, 10)
    finally:
        _kill_all(ranks)
    meta = json.loads((ck / saved[0] / "meta.json").read_text())
    assert set(meta["files"]) == {"model.safetensors", "optimizer.safetensors"}

    # Resuming a run that is already there says so (refused before any rank starts: run in this process).
    code, out, err = run_cli("train", "--plan", _plan(tmp_path), "--steps", step, "--save-dir", ck, "--resume")
    assert code == 2 and "already trained" in err and "--steps" in err, err


def test_damaged_checkpoints_fall_back_to_the_newest_intact_one(tmp_path):
    """A flipped byte in the newest checkpoint's tensors: resume says so and uses the one before;
    with nothing intact, one line naming the file. A dead writer's .tmp-step-* is removed."""
    ck = tmp_path / "ck"
    plan = _plan(tmp_path)
    # No signal here: the launcher runs in this process (its ranks are processes), one interpreter start less per run.
    code, out, err = run_cli("train", "--plan", plan, "--steps", 4, "--save-dir", ck, "--save-every", 2, "--timeout", 30)
    assert code == 0, err
    newest = ck / "step-000004" / "model.safetensors"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    leftover = ck / ".tmp-step-000006-999999999-abc"
    leftover.mkdir()

    code, out, err = run_cli("train", "--plan", plan, "--steps", 5, "--save-dir", ck, "--resume", "--timeout", 30)
    assert code == 0, err
    assert "step-000004: corrupt checkpoint: model.safetensors" in err and "resuming from step-000002" in err, err
    assert not leftover.exists()

    for step in ("step-000002", "step-000005"):
        f = ck / step / "optimizer.safetensors"
        f.write_bytes(f.read_bytes()[:-10])
    (ck / "step-000004").rename(ck / "step-000001")  # still corrupt, and older
    code, out, err = run_cli("train", "--plan", plan, "--steps", 8, "--save-dir", ck, "--resume", "--timeout", 30)
    assert code == 2, (code, out, err)
    assert "no intact checkpoint" in err and "optimizer.safetensors" in err, err
    assert len([x for x in err.splitlines() if x.strip()]) == 1, err


# --- the profilers' worker processes and the test helpers' temporary files ------------------------------

_CONCURRENT_PROFILE = ("from baton.model_spec import PRESETS; from runtime.measure.op_profiler import profile_table; "
                       "profile_table(PRESETS['small'], micro_batches=(1,), warmup=0, reps=100000, concurrent=2)")
_COMM_PROFILE = ("from runtime.measure.comm_profiler import measure_links; "
                 "measure_links(world_size=2, sizes=(4096, 65536), reps=10**7, timeout_s=600)")

_EXHAUSTIVE = ("from tests.test_solver_exact import CASES, _instance; from solver.baselines import exhaustive; "
               "i = _instance(CASES[7]); exhaustive(i.spec, i.cluster, i.profiles, global_batch=i.global_batch, "
               "universe=i.universe, shard_grid=2, workers=2)")
_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@pytest.mark.parametrize("script", [
    pytest.param(_CONCURRENT_PROFILE, marks=pytest.mark.long), pytest.param(_COMM_PROFILE, marks=pytest.mark.long),
    pytest.param(_EXHAUSTIVE, marks=pytest.mark.skipif(_CORES < 2, reason="one core: the search starts no workers")),
], ids=["concurrent op profiler", "comm profiler", "exhaustive search"])
def test_profiler_workers_die_with_their_parent(script):
    """SIGKILL to a process measuring (or searching) with worker processes: the workers end too, instead of
    running on for hours and holding the cores."""
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    workers = []
    try:
        workers = _ranks(parent, 2)
        time.sleep(1)
        parent.kill()
        _finish(parent, 10)
        assert _gone(workers, 10), "profiler workers outlived their parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.communicate()
        _kill_all(workers)


def _rank_of(rank, world):
    return rank * 10


def test_run_ranks_removes_its_temporary_directory(tmp_path, monkeypatch):
    """tests/runtime_helpers.run_ranks left a baton-ranks-* directory behind on every call."""
    from tests.runtime_helpers import run_ranks

    # Its own temporary root: other test runs on this machine make baton-ranks-* directories meanwhile.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert run_ranks(_rank_of, 2, timeout=120) == [0, 10]
    assert list(tmp_path.glob("baton-ranks-*")) == []


def test_a_link_fit_without_a_bandwidth_term_writes_the_fastest_measured_rate():
    """Times that do not grow with the message size (flat, or falling within noise) used to give a
    bandwidth of 10^9 GB/s, which the planner then took for a free link."""
    from runtime.measure.comm_profiler import fit_line, link_fit

    flat = [(4096.0, 0.5), (65536.0, 0.49), (1048576.0, 0.51)]  # ms: latency-bound messages over a ~2 GB/s link
    latency, slope = fit_line(flat)
    fastest = max(x / y for x, y in flat) / 1e6  # GB/s: what the largest message achieved, latency included
    assert 1 / (slope * 1e6) == pytest.approx(fastest)
    assert 0 < latency < 0.51
    fields = link_fit("gloo", 2, {"p2p": flat, "allreduce": flat}).link_fields()
    assert fields["bandwidth_gb_per_s"] < 10 and fields["allreduce_bandwidth_gb_per_s"] < 10
    # A real per-byte term is kept as fitted.
    latency, slope = fit_line([(x, 0.05 + x / 2e6) for x in (1e3, 1e5, 1e7)])
    assert latency == pytest.approx(0.05) and 1 / (slope * 1e6) == pytest.approx(2.0)


@pytest.mark.long  # fixed waits (6 s, then the 10 s no-progress limit); a stopped training peer is noticed quick above
def test_a_link_measurement_with_a_stopped_rank_is_given_up_in_one_line():
    """SIGSTOP on a measuring rank: its heartbeat stops (and its peer's, waiting on it in a transfer), and the
    run ends with the no-progress error after ``timeout_s``, its ranks gone. Ten million repetitions per
    size: without the heartbeat's watch the measurement would run for hours, so it cannot end otherwise."""
    script = ("from baton.errors import BatonError; from runtime.measure.comm_profiler import measure_links\n"
              "try:\n    measure_links(world_size=2, sizes=(4096,), reps=10**7, timeout_s=10)\n"
              "except BatonError as e:\n    print(e); raise SystemExit(2)")
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    workers = []
    try:
        workers = _ranks(parent, 2)
        time.sleep(6)  # measuring by now (or still starting: then it is the start that stalls)
        os.kill(workers[1], signal.SIGSTOP)
        code, out, err = _finish(parent, 120)
        assert code == 2 and "made no progress for 10 s" in out, (code, out, err)
        assert _gone(workers, 10), "measuring ranks outlived the run"
    finally:
        _kill_all(workers)
