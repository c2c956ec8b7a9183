"""The layers of the project: the planning core (``baton/``) and the solver sit below the runtime.

Anyone can plan without torch, and a change to the runtime cannot alter a plan or a prediction; both
hold only while nothing under ``baton/`` or ``solver/`` imports ``runtime``, at module level or inside
a function. ``baton profile --device`` is the one command of the core that measures; the runtime
installs that branch when it registers its commands.
"""
from __future__ import annotations

import ast

import pytest

from tests.conftest import ROOT, run_cli

LOWER_PACKAGES = ("baton", "solver")
UPPER = "runtime"


def _is_upper(module: str | None) -> bool:
    return module is not None and (module == UPPER or module.startswith(UPPER + "."))


def _upper_imports(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every import of the runtime in ``tree``, nested ones and import_module("...") included."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if _is_upper(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _is_upper(node.module):
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            fn = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if fn in ("import_module", "__import__") and isinstance(node.args[0].value, str) and _is_upper(node.args[0].value):
                found.append((node.lineno, node.args[0].value))
    return found


def _modules():
    for pkg in LOWER_PACKAGES:
        yield from sorted((ROOT / pkg).rglob("*.py"))


def test_the_scan_sees_imports_inside_functions():
    """Catches a scan that reads only module-level imports (the old ``profile --device`` imported lazily)."""
    tree = ast.parse("def f():\n    from runtime.measure.op_profiler import x\n    import runtime.measure.comm_profiler\n"
                     "    importlib.import_module('runtime.parallel.stage')\nimport runtimes\n")
    assert [m for _, m in _upper_imports(tree)] == ["runtime.measure.op_profiler", "runtime.measure.comm_profiler", "runtime.parallel.stage"]


@pytest.mark.parametrize("path", list(_modules()), ids=lambda p: str(p.relative_to(ROOT)))
def test_core_and_solver_import_nothing_from_the_runtime(path):
    bad = _upper_imports(ast.parse(path.read_text(), filename=str(path)))
    assert not bad, f"{path.relative_to(ROOT)} imports the runtime: " + ", ".join(f"line {n}: {m}" for n, m in bad)


def test_profile_device_without_the_runtime_is_one_line(monkeypatch):
    """Catches a core that crashes (or silently does nothing) when no measurer has been installed."""
    import baton.commands
    import cli  # noqa: F401  (registering the commands installs the runtime's measurer; undone below)

    monkeypatch.setattr(baton.commands, "_measure_profile", None)
    code, _, err = run_cli("profile", "--device", "cpu", "--model", "tiny")
    assert code == 2 and "runtime" in err and "Traceback" not in err
