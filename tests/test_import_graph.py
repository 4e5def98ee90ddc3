"""Every import inside src/ellm runs one way: no module reaches, directly or through
others, back to itself.

The graph is read from the source with ``ast`` (nothing is imported), so it also sees
the imports a function makes when it runs -- the ones that hide a circle from Python's
import machinery. Imports under ``if TYPE_CHECKING:`` are left out: they never run.
Relative imports are resolved against the importing module's package, and
``from pkg import name`` points at the submodule ``pkg.name`` when there is one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = "ellm"


def module_files(src: Path = SRC, package: str = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the package."""
    modules: dict[str, Path] = {}
    for path in sorted((src / package).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, at any depth, outside ``if TYPE_CHECKING:`` bodies."""
    found: list[ast.Import | ast.ImportFrom] = []
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)  # the body never runs; an else branch does
            continue
        stack.extend(ast.iter_child_nodes(node))
    return found


def _resolve_base(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    package = module if is_package else module.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def import_graph(src: Path = SRC, package: str = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (anywhere in its code)."""
    files = module_files(src, package)
    graph: dict[str, set[str]] = {name: set() for name in files}
    for module, path in files.items():
        is_package = path.name == "__init__.py"
        for node in _imports(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = _resolve_base(module, is_package, node)
                # `from pkg import x` imports the submodule pkg.x when x is one,
                # otherwise takes a name from pkg itself.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for target in targets:
                # `import ellm.a.b` with no module ellm.a.b on disk (a compiled
                # extension, say) still runs its nearest package above.
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target and target != module:
                    graph[module].add(target)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0

    def visit(root: str) -> None:
        nonlocal counter
        # iterative depth-first search (the graph is small, but recursion limits
        # should never decide a test's outcome)
        work: list[tuple[str, list[str]]] = [(root, sorted(graph[root]))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, todo = work[-1]
            if todo:
                nxt = todo.pop()
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, sorted(graph[nxt])))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return sorted(components)


def a_circle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest path from the component's first module back to itself."""
    start = min(component)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & component):
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start] if node != start else [start, start]
                if nxt not in came_from:
                    came_from[nxt] = node
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"no circle through {start} in {sorted(component)}")


@pytest.mark.skipif(not (SRC / PACKAGE).is_dir(), reason="no source tree beside tests/ (a wheel's test run)")
def test_no_import_cycles() -> None:
    graph = import_graph()
    cycles = find_cycles(graph)
    assert not cycles, "import circles in src/ellm (each arrow must run down):\n" + "\n".join(
        f"  {' -> '.join(a_circle(graph, set(c)))}   (modules in this knot: {', '.join(c)})" for c in cycles
    )


# -- the walker itself, on small packages written here ---------------------------------


def _write_package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_walker_sees_lazy_relative_and_submodule_imports(tmp_path: Path) -> None:
    src = _write_package(
        tmp_path,
        {
            "__init__.py": "from . import low\n",
            "low.py": "def f():\n    from .sub import high\n    return high\n",
            "sub/__init__.py": "",
            "sub/high.py": "from ..low import f\n",
        },
    )
    graph = import_graph(src, "pkg")
    assert graph["pkg"] == {"pkg.low"}
    assert graph["pkg.low"] == {"pkg.sub.high"}
    assert graph["pkg.sub.high"] == {"pkg.low"}
    assert find_cycles(graph) == [["pkg.low", "pkg.sub.high"]]
    assert a_circle(graph, {"pkg.low", "pkg.sub.high"}) == ["pkg.low", "pkg.sub.high", "pkg.low"]


def test_walker_leaves_out_type_checking_imports(tmp_path: Path) -> None:
    src = _write_package(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n",
            "b.py": "import typing\nfrom . import a\nif typing.TYPE_CHECKING:\n    from pkg import a as again\n",
        },
    )
    graph = import_graph(src, "pkg")
    assert graph["pkg.a"] == set()
    assert graph["pkg.b"] == {"pkg.a"}
    assert find_cycles(graph) == []


@pytest.mark.parametrize("spelling", ["import pkg.a", "from pkg import a", "from .a import name"])
def test_walker_resolves_each_spelling(tmp_path: Path, spelling: str) -> None:
    src = _write_package(tmp_path, {"__init__.py": "", "a.py": "from . import b\n", "b.py": spelling + "\n"})
    assert find_cycles(import_graph(src, "pkg")) == [["pkg.a", "pkg.b"]]
