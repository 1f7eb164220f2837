"""No import cycles between clawrl's modules: the graph is read from the source with `ast`, nothing is imported.

    .venv/bin/pytest tests/unit/test_import_cycles.py -q

Which imports count: every `import x` / `from x import y` in a module, at module level AND inside functions or
classes. A function-local import that only dodges a cycle at import time still ties the two modules together
(each needs the other to work), so it counts. Only imports under `if TYPE_CHECKING:` are left out: they never
run. `from pkg import name` is an edge to `pkg` (its `__init__`: the name is looked up in the package's
namespace, which may still be half-built) and, when `pkg.name` is a module of ours, to that module too; write
`from pkg.sub import name` to depend on the submodule alone. Parent packages that Python runs on the way to
`import pkg.sub` are not edges: a package `__init__` that re-exports its submodules would otherwise form a
cycle with each of them, which Python handles fine.

A strongly connected component (Tarjan's algorithm, iterative) of more than one module is a cycle; a failure
prints one path through each, `a -> b -> a`, with the line of every import on it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[2] / "clawrl"


def module_files(package_dir: Path = PACKAGE_DIR) -> dict[str, Path]:
    """Dotted module name -> source file, for every .py under the package (`__init__` names the package)."""
    root = package_dir.parent
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement in the tree, at any depth, except the bodies of `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)  # the else branch does run
            continue
        stack.extend(ast.iter_child_nodes(node))


def _resolve_from(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module a `from ... import` reads from (relative imports resolved against `module`)."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_edges(module: str, path: Path, known: set[str]) -> dict[str, int]:
    """Modules of ours that `module` imports -> line of the first such import."""
    edges: dict[str, int] = {}
    is_package = path.name == "__init__.py"
    for node in _import_nodes(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            source = _resolve_from(node, module, is_package)
            # `from pkg import sub` reads the package's namespace AND loads the submodule: both count
            targets = [source, *(f"{source}.{alias.name}" for alias in node.names)]
        for target in targets:
            if target in known and target != module:
                edges.setdefault(target, node.lineno)
    return edges


def import_graph(package_dir: Path = PACKAGE_DIR) -> dict[str, dict[str, int]]:
    """module -> {imported module -> line}, over every module of the package."""
    files = module_files(package_dir)
    known = set(files)
    return {module: import_edges(module, path, known) for module, path in files.items()}


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iteratively (no recursion limit on deep chains)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
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
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
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
                components.append(sorted(component))
    return components


def cycle_path(graph: dict[str, dict[str, int]], component: list[str]) -> list[str]:
    """One cycle through the component's first module (breadth-first, so a shortest one)."""
    members = set(component)
    start = component[0]
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node]):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if child in members and child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"component {component} has no cycle through {start}")


def describe_cycles(graph: dict[str, dict[str, int]]) -> list[str]:
    """One line per import cycle: `a -> b -> a`, each arrow with the importing line."""
    lines = []
    for component in strongly_connected(graph):
        if len(component) < 2:
            continue
        path = cycle_path(graph, component)
        steps = [f"{a} (line {graph[a][b]})" for a, b in zip(path, path[1:], strict=False)]
        lines.append(" -> ".join([*steps, path[-1]]) + f"   [{len(component)} modules in the cycle]")
    return lines


def _write_package(root: Path, sources: dict[str, str]) -> Path:
    for relative, text in sources.items():
        path = root / "pkg" / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_clawrl_has_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 100 and "clawrl.engine.weight_receiver" in graph  # the walk found the package
    cycles = describe_cycles(graph)
    assert not cycles, "import cycles between clawrl modules:\n" + "\n".join(cycles)


def test_the_finder_sees_function_local_relative_and_submodule_imports(tmp_path):
    package = _write_package(tmp_path, {
        "__init__.py": "from pkg import a\n",                              # re-exports a: not a cycle with a
        "a.py": "import pkg.b\n",
        "b.py": "def late():\n    from pkg.c import x\n",                # function-local
        "c.py": "from pkg.sub import d\n",                                 # the package and its submodule
        "sub/__init__.py": "from pkg.sub.k import name\n",
        "sub/d.py": "from ..a import x\n",                                 # relative, two levels up
        "sub/k.py": "from . import j\n",                                   # reads pkg.sub's namespace
        "sub/j.py": "",
        "e.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.f\n",
        "f.py": "import pkg.e\n",                                          # e -> f only for type checkers
    })  # fmt: skip
    graph = import_graph(package)
    assert graph["pkg.b"] == {"pkg.c": 2}
    assert graph["pkg.c"] == {"pkg.sub": 1, "pkg.sub.d": 1}
    assert graph["pkg.sub.d"] == {"pkg.a": 1}
    assert graph["pkg.sub.k"] == {"pkg.sub": 1, "pkg.sub.j": 1}
    assert graph["pkg.e"] == {}
    assert describe_cycles(graph) == [
        "pkg.sub (line 1) -> pkg.sub.k (line 1) -> pkg.sub   [2 modules in the cycle]",
        "pkg.a (line 1) -> pkg.b (line 2) -> pkg.c (line 1) -> pkg.sub.d (line 1) -> pkg.a   [4 modules in the cycle]",
    ]


@pytest.mark.parametrize("depth", [3, 3000])
def test_tarjan_finds_each_component_once_even_on_long_chains(depth):
    # a chain 0 -> 1 -> ... -> depth-1 -> 0 plus a tail that hangs off it: one cycle of `depth` modules
    graph = {f"m{i}": {f"m{(i + 1) % depth}": 1} for i in range(depth)}
    graph["tail"] = {"m0": 1}
    components = strongly_connected(graph)
    assert sorted(map(len, components)) == [1, depth]
    assert describe_cycles(graph)[0].startswith("m0 (line 1) -> m1 (line 1) -> ")
