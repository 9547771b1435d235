"""Structure the rest of the code relies on: no import cycles between mkport's modules."""

from __future__ import annotations

import ast
from pathlib import Path

import mkport

PACKAGE = Path(mkport.__file__).parent


def _import_graph() -> dict[str, set[str]]:
    """module -> the mkport modules it imports, at the top or inside a function."""
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if path.name == "__init__.py" else parts)
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(max(node.level - 1, 0)):
                    base = base.rsplit(".", 1)[0]
                target = (f"{base}.{node.module}" if node.module else base) if node.level else node.module or ""
                deps |= {target} | {f"{target}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
        graph[module] = deps
    return {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}


def test_no_import_cycles():
    graph = _import_graph()
    assert {"mkport.runtime.decoder", "mkport.runtime.weights", "mkport.runtime.torch_model"} <= set(graph)
    cycles = []

    def visit(module, path):
        for dep in graph[module]:
            if dep == path[0]:
                cycles.append(path + [dep])
            elif dep not in path and dep > path[0]:  # each cycle once, from its smallest module
                visit(dep, path + [dep])

    for module in graph:
        visit(module, [module])
    assert cycles == []
