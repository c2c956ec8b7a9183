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
def _own_profile_directory(tmp_path_factory):
    """Every test reads the shipped tables and an empty user directory of its own, never the developer's
    ~/.local/share/baton (a table left there would shadow the shipped ones and change results)."""
    import os

    old = os.environ.get("BATON_PROFILES")
    os.environ["BATON_PROFILES"] = str(tmp_path_factory.mktemp("user-profiles"))
    yield
    if old is None:
        os.environ.pop("BATON_PROFILES", None)
    else:
        os.environ["BATON_PROFILES"] = old


@pytest.fixture(autouse=True, scope="session")
def _own_runs_directory(tmp_path_factory):
    """`baton train` without --run-dir or --save-dir makes runs/<time> in the working directory; tests
    send those to a temporary directory instead of the checkout (BATON_RUNS_DIR)."""
    import os

    old = os.environ.get("BATON_RUNS_DIR")
    os.environ["BATON_RUNS_DIR"] = str(tmp_path_factory.mktemp("runs"))
    yield
    if old is None:
        os.environ.pop("BATON_RUNS_DIR", None)
    else:
        os.environ["BATON_RUNS_DIR"] = old
