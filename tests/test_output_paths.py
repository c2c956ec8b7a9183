"""An output path that cannot be written is refused before the work, in one line naming the path given.

Catches: ``baton solve --out DIR/plan.json`` into a directory that refuses new files running the whole
solve and then naming '.plan.json.x1y2.tmp' (``os.access`` says yes to root, whom /sys or a read-only
mount still refuses); a write that fails on its temporary file naming that file; a missing directory of
the path refused (it is created, as it always was) or a file left half written.
"""
from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

import pytest

from baton.atomic import write_atomically
from baton.cli_support import check_output_path
from baton.errors import BatonError
from tests.conftest import ROOT, run_cli

CLUSTER = ROOT / "clusters" / "a100x2_t4x2.yaml"


def _refusing(directory: Path):
    """A mkstemp that refuses ``directory`` as a read-only file system would, whoever runs the test."""
    real = tempfile.mkstemp

    def mkstemp(*args, **kwargs):
        if Path(kwargs.get("dir") or args[2]).resolve() == directory.resolve():
            name = os.path.join(str(directory), f"{kwargs.get('prefix', '')}x1y2{kwargs.get('suffix', '')}")
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), name)
        return real(*args, **kwargs)

    return mkstemp


def _solve_must_not_run(monkeypatch):
    import solver.commands

    def run_strategy(*args, **kwargs):
        raise AssertionError("the solve ran before the output path was checked")

    monkeypatch.setattr(solver.commands, "run_strategy", run_strategy)


def test_a_directory_refusing_new_files_is_named_before_the_solve(tmp_path, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    monkeypatch.setattr(tempfile, "mkstemp", _refusing(locked))
    _solve_must_not_run(monkeypatch)
    for out in (locked / "plan.json", locked / "new" / "deeper" / "plan.json"):
        code, stdout, err = run_cli("solve", "--cluster", CLUSTER, "--model", "gpt3-1.3b", "--out", out)
        assert code == 2, (stdout, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in err, err
        assert lines[0].startswith(f"error: {out}: field '--out': ") and "refuses new files" in lines[0], lines[0]
        assert ".tmp" not in lines[0]
    assert list(locked.iterdir()) == []


@pytest.mark.skipif(not Path("/sys/kernel").is_dir(), reason="needs Linux's /sys, which refuses new files even to root")
def test_sys_refuses_new_files_even_to_root(tmp_path, monkeypatch):
    _solve_must_not_run(monkeypatch)
    code, _, err = run_cli("solve", "--cluster", CLUSTER, "--model", "gpt3-1.3b", "--out", "/sys/plan.json")
    assert code == 2 and err.strip().startswith("error: /sys/plan.json: field '--out': cannot be written"), err
    assert len(err.strip().splitlines()) == 1


def test_paths_under_a_regular_file_are_refused_before_the_solve(tmp_path, monkeypatch):
    _solve_must_not_run(monkeypatch)
    afile = tmp_path / "file.txt"
    afile.write_text("x")
    for out in (afile / "plan.json", afile / "missing" / "plan.json"):
        code, _, err = run_cli("solve", "--cluster", CLUSTER, "--model", "gpt3-1.3b", "--out", out)
        assert code == 2 and err.strip() == f"error: {out}: field '--out': cannot be written: {afile} is not a directory", err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt"]


def test_a_missing_directory_is_created(tmp_path):
    out = tmp_path / "new" / "sub" / "plan.json"
    code, stdout, err = run_cli("solve", "--cluster", CLUSTER, "--model", "gpt3-1.3b", "--strategy", "megatron", "--out", out)
    assert code == 0, err
    assert out.is_file() and f"wrote {out}" in stdout.replace("\n", "")


def test_the_probe_leaves_nothing_behind(tmp_path):
    check_output_path(tmp_path / "plan.json", "--out")
    check_output_path(tmp_path / "a" / "b" / "plan.json", "--out")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(BatonError, match="is a directory"):
        check_output_path(tmp_path, "--out")


def test_a_failed_write_names_the_path_given_and_leaves_no_file(tmp_path, monkeypatch):
    target = tmp_path / "plan.json"
    monkeypatch.setattr(tempfile, "mkstemp", _refusing(tmp_path))
    with pytest.raises(OSError) as exc:
        write_atomically(target, "{}")
    assert exc.value.filename == str(target) and exc.value.errno == errno.EROFS
    monkeypatch.undo()

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    target.write_text("old")
    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(OSError) as exc:
        write_atomically(target, "new")
    assert exc.value.filename == str(target) and exc.value.errno == errno.ENOSPC
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]
