"""No import cycles inside Baton's packages.

A cycle works only while every module of it is imported in one order, and breaks (half-initialised
module, ImportError) when a new caller enters it elsewhere; one hidden behind an import inside a function
breaks the first time that function runs. So the graph counts every ``import`` and ``from ... import``
of a module, at module level and inside functions and conditionals alike, with relative imports resolved
and ``from pkg import name`` pointing at the module ``pkg.name`` where there is one.

Catches: baton/peers.py and baton/plan.py importing each other (plan's validation used the peer sets,
the peer sets rebuilt the plan's stages), or any new cycle of the same kind.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import ROOT

PACKAGES = ("baton", "solver", "runtime")
"""Packages whose modules make up the graph; imports of anything else are not edges."""


def module_names(root: Path, packages=PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under the packages (a package is its __init__.py)."""
    found = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _package_of(module: str, path: Path) -> str:
    """The package a relative import in ``module`` starts from."""
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def imported_modules(module: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``module`` (file ``path``) imports anywhere in its text."""
    out: set[str] = set()

    def nearest_known(name: str) -> str | None:
        # 'import a.b.c' of a module not in the graph (a data file, a typo) still depends on its package.
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _package_of(module, path).split(".")
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            # 'from pkg import mod' depends on the module pkg.mod; 'from mod import name' on mod.
            targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in known else source for a in node.names]
        else:
            continue
        for t in targets:
            hit = nearest_known(t)
            if hit is not None and hit != module:
                out.add(hit)
    return out


def import_graph(root: Path = ROOT, packages=PACKAGES) -> dict[str, set[str]]:
    modules = module_names(root, packages)
    return {m: imported_modules(m, p, set(modules)) for m, p in modules.items()}


def find_cycle(graph: dict[str, set[str]], through=lambda module: True) -> list[str] | None:
    """A cycle (``[a, b, ..., a]``) that passes through a module for which ``through`` holds, or None.

    Strongly connected components (Tarjan, iterative: the runtime's graph is deep enough to matter) hold
    every cycle; within a component that has such a module, a breadth-first search from it back to
    itself gives the shortest cycle through it, the easiest to read in a failure.
    """
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[set[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                components.append(component)
    for component in components:
        starts = sorted(m for m in component if through(m))
        if not starts or (len(component) == 1 and starts[0] not in graph.get(starts[0], ())):
            continue
        start = starts[0]
        came_from: dict[str, str] = {}
        frontier = [start]
        while frontier:
            nxt = []
            for node in frontier:
                for child in sorted(graph.get(node, ())):
                    if child == start:
                        path = [node]
                        while path[-1] != start:
                            path.append(came_from[path[-1]])
                        return path[::-1] + [start]
                    if child in component and child not in came_from:
                        came_from[child] = node
                        nxt.append(child)
            frontier = nxt
    return None


# --- the finder itself: it must be able to fail ------------------------------------------------------------


def test_the_finder_finds_a_cycle_in_a_small_graph():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle(graph, through=lambda m: m == "c") == ["c", "a", "b", "c"]
    assert find_cycle(graph, through=lambda m: m in ("d", "e")) is None  # they reach the cycle, are not on it
    assert find_cycle({"a": {"a"}}) == ["a", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_graph_resolves_relative_imports_function_imports_and_submodules(tmp_path):
    pkg = tmp_path / "p"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import leaf\n")
    (pkg / "sub" / "leaf.py").write_text("def f():\n    from ..top import x\n")
    (pkg / "top.py").write_text("import p.sub.leaf\nfrom p import other\nfrom p.sub import leaf as l2\n")
    (pkg / "other.py").write_text("if True:\n    from .top import y\nimport os\n")
    graph = import_graph(tmp_path, packages=("p",))
    assert graph == {"p": set(), "p.sub": {"p.sub.leaf"}, "p.sub.leaf": {"p.top"}, "p.top": {"p.sub.leaf", "p.other"},
                     "p.other": {"p.top"}}
    assert find_cycle(graph) == ["p.other", "p.top", "p.other"]
    assert find_cycle(graph, through=lambda m: m == "p.sub.leaf") == ["p.sub.leaf", "p.top", "p.sub.leaf"]


# --- the project ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle_through_the_package(graph, package):
    mine = [m for m in graph if m == package or m.startswith(package + ".")]
    assert mine, f"no modules found under {package}/"
    cycle = find_cycle(graph, through=lambda m: m == package or m.startswith(package + "."))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
