"""No import cycles among fagen's modules: a lower layer never imports a higher one.

The graph has an edge A -> B for every ``import`` of fagen module B anywhere in
A's source: function-level imports (deferring an import hides a cycle from the
interpreter, not from the design) and imports under ``if TYPE_CHECKING:`` (an
annotation names a dependency as much as a call does) included. A submodule
importing its own package counts too, and no edge is exempt.
"""
from __future__ import annotations

import ast

from import_graph import find_cycle, import_graph, imports_in


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

