"""No import cycles inside ``scaletrain``.

Every ``import`` statement of every module counts as an edge, those inside functions too (a cycle
"held together by function-level imports" is still a cycle: it only works while nobody imports
the modules in the other order); only imports under ``if TYPE_CHECKING:`` are left out (they never
run). ``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to ``pkg``
(its ``__init__``); ``import a.b`` is an edge to ``a.b``. The parent packages Python initialises on
the way are not edges: a package whose ``__init__`` re-exports its submodules would otherwise always
be a "cycle", while the import that really breaks, a submodule importing a name from its
half-initialised parent, is an explicit ``from pkg import name`` edge and is counted. Imports by
``importlib`` (``scaletrain.commands`` registers its modules that way) are not seen.
"""
from __future__ import annotations

import ast
from pathlib import Path

from helpers import ROOT


def module_names(root: Path, package: str) -> dict[str, Path]:
    """Dotted name -> file of every module of ``package`` (a directory under ``root``)."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(node: ast.AST):
    """Import / ImportFrom nodes anywhere under ``node``, except the bodies of ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for sub in child.orelse:
                yield from _import_nodes(ast.Module(body=[sub], type_ignores=[]))
        else:
            yield from _import_nodes(child)


def _base(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` names (resolving relative imports)."""
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    if not is_package:
        parts = parts[:-1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def import_graph(root: Path, package: str) -> dict[str, dict[str, int]]:
    """module -> {imported module of the package: line of the first such import}."""
    mods = module_names(root, package)
    graph: dict[str, dict[str, int]] = {}
    for mod, path in mods.items():
        edges: dict[str, int] = {}
        is_package = path.name == "__init__.py"
        for node in _import_nodes(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                for a in node.names:
                    name = a.name
                    while name and name not in mods:  # `import a.b.c`: the longest module prefix
                        name = name.rpartition(".")[0]
                    targets.append(name)
            else:
                base = _base(mod, is_package, node)
                for a in node.names:
                    targets.append(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base)
            for t in targets:
                if t in mods and t != mod:
                    edges.setdefault(t, node.lineno)
        graph[mod] = edges
    return graph


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    comps: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(comps)


def a_cycle(graph: dict[str, dict[str, int]], comp: list[str]) -> list[str]:
    """One shortest cycle through the first module of a component: [m0, m1, ..., m0]."""
    start, members = comp[0], set(comp)
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w not in members:
                    continue
                if w == start:
                    path = [v]  # back from v to start along prev, then reversed
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return path[::-1] + [start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")  # pragma: no cover - a component always has one


def describe_cycles(root: Path, package: str) -> list[str]:
    """One entry per import cycle of ``package``: the modules of the component, one cycle through
    them with the file:line of each import, then every import between them (all must go)."""
    graph = import_graph(root, package)
    mods = module_names(root, package)

    def at(a: str, b: str) -> str:
        return f"{mods[a].relative_to(root)}:{graph[a][b]}"

    out = []
    for comp in strongly_connected(graph):
        cyc = a_cycle(graph, comp)
        steps = " -> ".join(f"{a} ({at(a, b)})" for a, b in zip(cyc, cyc[1:]))
        edges = [f"{a} -> {b} ({at(a, b)})" for a in comp for b in sorted(graph[a]) if b in comp]
        out.append(f"{', '.join(comp)}: {steps} -> {cyc[-1]}\n    imports inside: " + "; ".join(edges))
    return out


# ---------------------------------------------------------------------------------------------
def test_scaletrain_has_no_import_cycles():
    cycles = describe_cycles(ROOT, "scaletrain")
    assert not cycles, "import cycles in scaletrain:\n  " + "\n  ".join(cycles)


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def test_cycle_finder_on_a_planted_cycle(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "from pkg.sub import thing\n",  # a package re-exporting its submodule: no cycle
        "pkg/a.py": "import os\nfrom pkg import b\n",
        "pkg/b.py": "def f():\n    from .c import x\n",  # function-level, relative: still an edge
        "pkg/c.py": "from pkg.a import y\n",  # closes a -> b -> c -> a
        "pkg/sub/__init__.py": "from .leaf import thing\n",
        "pkg/sub/leaf.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.sub import thing\n"
                           "import pkg.a.nothing as q\n",  # leaf -> a, not part of a cycle
        "pkg/d.py": "import pkg.e\n",
        "pkg/e.py": "from pkg.d import z\n",  # d <-> e
    })
    g = import_graph(tmp_path, "pkg")
    assert g["pkg"] == {"pkg.sub": 1}
    assert g["pkg.b"] == {"pkg.c": 2}
    assert g["pkg.sub.leaf"] == {"pkg.a": 4}  # the TYPE_CHECKING import is no edge
    assert strongly_connected(g) == [["pkg.a", "pkg.b", "pkg.c"], ["pkg.d", "pkg.e"]]
    lines = describe_cycles(tmp_path, "pkg")
    assert lines[0] == ("pkg.a, pkg.b, pkg.c: pkg.a (pkg/a.py:2) -> pkg.b (pkg/b.py:2) -> pkg.c (pkg/c.py:1) "
                        "-> pkg.a\n    imports inside: pkg.a -> pkg.b (pkg/a.py:2); pkg.b -> pkg.c (pkg/b.py:2); "
                        "pkg.c -> pkg.a (pkg/c.py:1)")
    assert lines[1].startswith("pkg.d, pkg.e: pkg.d (pkg/d.py:1) -> pkg.e (pkg/e.py:1) -> pkg.d\n")


def test_cycle_finder_counts_a_submodule_importing_its_parent(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "from pkg.sub import thing\nHELPER = 1\n",
        "pkg/sub.py": "from pkg import HELPER\n",  # the import that breaks at run time: counted
    })
    assert strongly_connected(import_graph(tmp_path, "pkg")) == [["pkg", "pkg.sub"]]


def test_cycle_finder_accepts_a_tree(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg import b, c\n",
        "pkg/b.py": "from . import c\n",
        "pkg/c.py": "import json\n",
    })
    assert describe_cycles(tmp_path, "pkg") == []
