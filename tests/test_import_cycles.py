"""No import cycles among fagen's modules: a lower layer never imports a higher one.

The graph has an edge A -> B for every ``import`` of fagen module B anywhere in
A's source: function-level imports (deferring an import hides a cycle from the
interpreter, not from the design) and imports under ``if TYPE_CHECKING:`` (an
annotation names a dependency as much as a call does) included. A submodule
importing its own package counts too, and no edge is exempt.
"""
from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import fagen

PACKAGE = Path(fagen.__file__).resolve().parent

def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_in(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement in ``tree``, wherever it stands (``if TYPE_CHECKING:`` included)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in imports_in(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name in files)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    origin = ".".join(base + ([node.module] if node.module else []))
                else:
                    origin = node.module or ""
                for a in node.names:
                    sub = f"{origin}.{a.name}"
                    if sub in files:
                        targets.add(sub)
                    elif origin in files:
                        targets.add(origin)
        graph[name] = {t for t in targets if t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)) is not None:
            return found
    return None


def test_the_graph_sees_fagen_imports() -> None:
    graph = import_graph()
    assert "fagen.emulator.toolchain" in graph["fagen.emulator.builder"]
    assert "fagen.cache" in graph["fagen.compiler"]  # `from . import cache`
    assert "fagen.families.base" in graph["fagen.families.simt"]
    assert "fagen.families" in graph["fagen.spec"] and not any(t.startswith("fagen.spec") for f, ts in graph.items()
                                                               if f.startswith("fagen.families") for t in ts)
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_type_checking_imports_and_own_package_count() -> None:
    """An import under ``if TYPE_CHECKING:`` and a submodule's import of its own package are edges."""
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from fagen.spec import KernelSpec\n")
    assert [n.module for n in imports_in(tree) if isinstance(n, ast.ImportFrom)] == ["typing", "fagen.spec"]
    assert find_cycle({"p": {"p.child"}, "p.child": {"p"}}) == ["p", "p.child", "p"]

