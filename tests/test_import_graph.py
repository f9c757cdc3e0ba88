"""fsdp_lite's import graph is a DAG, function-level and TYPE_CHECKING imports included.

A function-level import that points up the layers is a cycle in disguise: it works until someone
moves a line. Reading the files with ``ast`` (nothing is imported) sees every import statement.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "fsdp_lite"


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The fsdp_lite modules ``path`` imports anywhere in the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            parts = node.module.split(".")
            if parts[0] != "fsdp_lite":
                continue
            if len(parts) > 1:
                found.add(parts[1])
            else:  # from fsdp_lite import offload, wrap
                found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("fsdp_lite.")}
    return (found & modules) - {path.stem, "__init__"}


def import_graph() -> dict[str, set[str]]:
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    return {p.stem: _imports(p, modules) for p in sorted(PACKAGE.glob("*.py"))}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path ``[a, b, ..., a]``, or None."""
    state: dict[str, str] = {}  # "open" while on the stack, "done" after
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_fsdp_lite_imports_form_a_dag():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle in fsdp_lite/: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle_hidden_in_a_function_level_import(tmp_path):
    (tmp_path / "low.py").write_text("def f():\n    from fsdp_lite.high import g\n")
    (tmp_path / "high.py").write_text("from fsdp_lite import low\n")
    modules = {"low", "high"}
    graph = {name: _imports(tmp_path / f"{name}.py", modules) for name in modules}
    assert find_cycle(graph) == ["high", "low", "high"]
