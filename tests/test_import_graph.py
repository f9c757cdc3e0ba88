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


# The environment reads fsdp_lite has, each with why it is not a behaviour switch.
ALLOWED_ENVIRONMENT = {
    ("construct.py", "LOCAL_WORLD_SIZE"): "torchrun's ranks per node: HYBRID_SHARD's default group",
    ("launch.py", "OMP_NUM_THREADS"): "a default set for the launched ranks, not read",
    ("demo.py", "RANK"): "whether torchrun (or the demo itself) started this process",
}


def _environment_reads(path: Path) -> set[str]:
    """Names read or set through os.environ / os.getenv in ``path`` ("?" where not a literal)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            on_environ = isinstance(f.value, ast.Attribute) and f.value.attr == "environ"
            if not (on_environ or f.attr == "getenv"):
                continue
            target = node.args[0] if node.args else None
        elif isinstance(node, ast.Subscript) and getattr(node.value, "attr", None) == "environ":
            target = node.slice
        elif isinstance(node, ast.Compare) and any(
            getattr(c, "attr", None) == "environ" for c in node.comparators
        ):
            target = node.left
        else:
            continue
        found.add(target.value if isinstance(target, ast.Constant) else "?")
    return found


def test_no_environment_variable_switches_behaviour_in_fsdp_lite():
    seen = {(p.name, name) for p in PACKAGE.glob("*.py") for name in _environment_reads(p)}
    unexplained = sorted(seen - set(ALLOWED_ENVIRONMENT))
    assert not unexplained, f"environment reads in fsdp_lite/: {unexplained}"


def test_the_environment_scan_finds_a_planted_switch(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text('import os\nif os.environ.get("FSDP_LITE_X") == "1":\n    os.getenv("Y")\n')
    assert _environment_reads(planted) == {"FSDP_LITE_X", "Y"}


def _imported_packages(path: Path) -> set[str]:
    """Top-level packages ``path`` imports anywhere in the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
    return found


def test_fsdp_lite_and_conformance_import_each_other_only_through_the_adapters():
    conformance = PACKAGE.parent / "conformance"
    library_to_suite = [
        p.name for p in PACKAGE.glob("*.py") if "conformance" in _imported_packages(p)
    ]
    assert not library_to_suite, f"fsdp_lite/ imports its test suite: {library_to_suite}"
    suite_to_library = [
        str(p.relative_to(conformance))
        for p in conformance.rglob("*.py")
        if "fsdp_lite" in _imported_packages(p) and p.parent.name != "adapters"
    ]
    assert not suite_to_library, (
        f"conformance/ imports fsdp_lite outside adapters/: {suite_to_library}"
    )
