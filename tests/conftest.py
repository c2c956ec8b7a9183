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
