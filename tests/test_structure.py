"""Structure the rest of the code relies on: the floors of mkport's packages, imported in one direction only (no
arrow back up, no import cycle), a kernel floor without torch, and docs that name only module paths that exist."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import mkport

PACKAGE = Path(mkport.__file__).parent
ROOT = PACKAGE.parent

# The pipeline, bottom up: a module imports its own floor or lower ones, never a higher one. check and bench share
# a floor. mkport/__init__.py (the version) and mkport/errors.py belong to every floor.
FLOORS = {"kernel": 0, "runtime": 1, "check": 2, "bench": 2, "tts": 3, "serve": 4, "integrations": 5, "cli": 6}
EVERY_FLOOR = {"mkport", "mkport.errors"}


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
    return graph


def _mkport_graph() -> dict[str, set[str]]:
    graph = _import_graph()
    return {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}


def _floor(module: str) -> int | None:
    parts = module.split(".")
    return FLOORS[parts[1]] if len(parts) > 1 and parts[1] in FLOORS else None


def test_every_module_has_a_floor():
    """A new module lands in a floor's package (or is errors.py): the direction test then covers it."""
    loose = sorted(m for m in _mkport_graph() if _floor(m) is None and m not in EVERY_FLOOR)
    assert loose == []


def _upward(graph: dict[str, set[str]]) -> list[str]:
    """The imports of a higher floor, as 'module -> imported'."""
    return sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps
                  if d not in EVERY_FLOOR and _floor(m) is not None and _floor(d) > _floor(m))


def test_no_arrow_back_up():
    graph = _mkport_graph()
    assert {"mkport.runtime.decoder", "mkport.kernel.render", "mkport.cli"} <= set(graph)
    assert _upward(graph) == []


def test_an_arrow_back_up_is_found():
    """The rule on a made-up graph: tts importing serve and the kernel importing the runtime are arrows up; the
    same floor (bench -> check), a lower one and errors.py are not."""
    graph = {"mkport.tts.pipeline": {"mkport.serve.client", "mkport.runtime.decoder", "mkport.errors"},
             "mkport.kernel.render": {"mkport.runtime.torch_model", "mkport.kernel.spec"},
             "mkport.bench.decode": {"mkport.check.reference"}}
    assert _upward(graph) == ["mkport.kernel.render -> mkport.runtime.torch_model",
                              "mkport.tts.pipeline -> mkport.serve.client"]


def test_no_import_cycles():
    graph = _mkport_graph()
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


def test_kernel_imports_no_torch():
    """The kernel floor renders and compiles on a machine without torch (and imports only itself below it)."""
    kernel = {m: deps for m, deps in _import_graph().items() if _floor(m) == FLOORS["kernel"]}
    assert "mkport.kernel.render" in kernel
    torch = sorted(f"{m} -> {d}" for m, deps in kernel.items() for d in deps if d.split(".")[0] == "torch")
    assert torch == []


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MODULE_PATH = re.compile(r"(?<![\w./~-])mkport/[\w/.]*\w")  # mkport/... not inside another path (~/.cache/mkport/...)


def _missing_paths(name: str, text: str) -> list[str]:
    return sorted({f"{name}: {path}" for path in MODULE_PATH.findall(text) if not (ROOT / path).exists()})


def test_docs_name_only_module_paths_that_exist():
    assert sum(len(MODULE_PATH.findall(doc.read_text())) for doc in DOCS) > 20  # the pattern finds the docs' paths
    assert [m for doc in DOCS for m in _missing_paths(doc.name, doc.read_text())] == []


def test_a_missing_module_path_is_found():
    text = "see `mkport/runtime/decoder.py`, `mkport/runtime.py` and mkport/kernel/cuda/; ~/.cache/mkport/builds/"
    assert _missing_paths("page.md", text) == ["page.md: mkport/runtime.py"]
