"""Shared fixtures: paths of the shipped files and a CLI runner that captures stderr separately.

What is marked ``long`` (``@pytest.mark.long``; ``python3 -m pytest tests`` skips it through pyproject.toml's
addopts, ``python3 -m pytest tests -m long`` runs only it, ``-m ''`` runs everything, and .ci/run runs both):

* sweeps: of a test run over many seeds, instances or values, one or a few representative parameters stay in
  the default run (the exhaustive-search oracle on one random instance, the first seeds of each sweep); the
  other parameters are long;
* many-plan parity: each capability keeps one quick plan (pipeline, stages without layers, uneven TP,
  recomputation, replicas of different shapes, ZeRO 1/2/3, bf16, fp16, fused vocabulary-parallel, a checkpoint
  under another split, resume under another plan); further plans checking the same capability are long;
* resume chains (a checkpoint resumed under plan after plan) and further resumes are long; one resume under
  another plan stays quick (test_runtime_train.py);
* tests of real runs (training processes, signals, measurements, reports) whose capability a quicker test
  covers, or that wait out fixed timeouts, are long; every operational capability keeps one quick test
  (SIGTERM saves, SIGKILL cleans up, a stopped peer is named, a damaged checkpoint falls back, workers die
  with their parent);
* runs across namespaced machines (tests/test_machines.py's harness) and long trainings.

A long test says beside its marker which quick test covers its capability. A quick test is never made quick
by weakening its assertions: its set-up is made cheaper instead (a smaller instance or solve that asserts the
same, a module fixture shared by its tests, the CLI in this process where no process boundary is tested).
"""
from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def root() -> Path:
    return ROOT


@pytest.fixture
def cluster_path() -> Path:
    return ROOT / "clusters" / "a100x2_t4x2.yaml"


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


def run_cli(*args: str):
    """Invoke the baton app in-process; returns (exit_code, stdout, stderr)."""
    from cli import app

    result = CliRunner().invoke(app, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture(autouse=True, scope="session")
def _own_user_directories(tmp_path_factory):
    """Tests never touch the developer's directories: profile lookups see the shipped tables and an empty
    user directory (a table left in ~/.local/share/baton would shadow the shipped ones and change results),
    and `baton train` without --run-dir or --save-dir writes runs/<time> into a temporary directory
    instead of the checkout. The processes tests start put their temporary files under pytest's own temporary
    root (TMPDIR), which pytest prunes: a process a test kills on purpose (SIGKILL to a trainer, a torchrun agent,
    a searching parent) cannot remove its own, and they piled up in /tmp, dozens a day."""
    import os
    import tempfile

    dirs = {"BATON_PROFILES": "user-profiles", "BATON_RUNS_DIR": "runs", "TMPDIR": "tmp"}
    old = {k: os.environ.get(k) for k in dirs}
    for key, name in dirs.items():
        os.environ[key] = str(tmp_path_factory.mktemp(name))
    old_tempdir, tempfile.tempdir = tempfile.tempdir, os.environ["TMPDIR"]  # this process looks where they write
    yield
    tempfile.tempdir = old_tempdir
    for key, value in old.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture
def one_rank_group(tmp_path):
    """A real process group of this process alone (gloo, file rendezvous): an engine's collectives run over one rank."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
