"""Public seams: no fagen module imports another module's private (``_name``) names."""
from __future__ import annotations

import ast

from import_graph import PACKAGE, imports_in, module_name


def private_imports() -> list[tuple[str, str, str]]:
    """(importing module, imported module, name) for every ``_name`` one fagen module imports from another."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    out = []
    for name, path in sorted(files.items()):
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in imports_in(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            if origin not in files or origin == name:
                continue
            out += [(name, origin, a.name) for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
    return out


def test_no_private_name_crosses_modules() -> None:
    found = sorted(private_imports())
    assert found == [], f"private names imported from another module: {found}"
