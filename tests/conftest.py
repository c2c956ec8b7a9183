"""Shared fixtures: paths of the shipped files and a CLI runner that captures stderr separately."""
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
    instead of the checkout."""
    import os

    dirs = {"BATON_PROFILES": "user-profiles", "BATON_RUNS_DIR": "runs"}
    old = {k: os.environ.get(k) for k in dirs}
    for key, name in dirs.items():
        os.environ[key] = str(tmp_path_factory.mktemp(name))
    yield
    for key, value in old.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
