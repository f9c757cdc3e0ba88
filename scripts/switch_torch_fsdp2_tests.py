"""Point one of torch's own FSDP2 test files at fsdp_lite, changing only its imports.

torch's tests (pytorch/pytorch ``test/distributed/_composable/fsdp/test_fully_shard_*.py``) are
never copied into this repository: this script reads one from wherever it was put (outside the
repo) and writes the switched copy beside it, or where ``-o`` says.

    python scripts/switch_torch_fsdp2_tests.py /tmp/torch_fsdp_tests/native/test_fully_shard_training.py \
        -o /tmp/torch_fsdp_tests/switched/test_fully_shard_training.py

What changes, and nothing else:

1. Each ``from torch.distributed.fsdp import ...`` and ``from torch.distributed._composable.fsdp
   import ...`` (and ``from torch.distributed.fsdp._fully_shard._fully_shard import FSDPModule``)
   is split in two: the names fsdp_lite exports (``fully_shard``, ``FSDPModule``,
   ``MixedPrecisionPolicy``, ``OffloadPolicy``, ``CPUOffloadPolicy``, ``UnshardHandle``,
   ``register_fsdp_forward_method``) come from ``fsdp_lite``; any other name (``share_comm_ctx``)
   stays torch's. Imports of torch's private modules (``_fsdp_param_group``, ``_fsdp_collectives``,
   ...) are left as they are: tests that patch or read them test torch's internals.
2. Two lines after the imports bind the same name where torch's test utilities look it up at run
   time, so that they too shard with fsdp_lite:
   * ``common_fsdp.fully_shard``: ``MLPStack.parallelize`` (the 2-D/3-D tests) calls it;
   * ``torch.distributed.fsdp.fully_shard``: ``compiled_fsdp_test`` re-binds the test module's
     global ``fully_shard`` to it in its eager mode (without this, a test under that decorator
     would silently run torch's FSDP2).
   Nothing else of torch's test utilities or reference models (``replicate``, ``MLP``,
   ``Transformer``, ``check_sharded_parity``) changes.

The script contains no test code of torch's; it prints what it switched.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

# The names fsdp_lite's FSDP2 front exports (fsdp_lite/__init__.py).
FSDP_LITE_NAMES = {
    "fully_shard",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "CPUOffloadPolicy",
    "UnshardHandle",
    "register_fsdp_forward_method",
}

# Modules whose public FSDP2 names are switched.
SWITCHED_MODULES = {
    "torch.distributed.fsdp",
    "torch.distributed._composable.fsdp",
    "torch.distributed.fsdp._fully_shard",
    "torch.distributed.fsdp._fully_shard._fully_shard",
}

RUNTIME_BINDINGS = """\
# --- added by fsdp_lite's scripts/switch_torch_fsdp2_tests.py: torch's test utilities look
# --- fully_shard up at run time; bind fsdp_lite's there too.
import fsdp_lite as _fsdp_lite_switch
import torch.distributed.fsdp as _torch_fsdp_switch
import torch.testing._internal.common_fsdp as _common_fsdp_switch

_common_fsdp_switch.fully_shard = _fsdp_lite_switch.fully_shard
_torch_fsdp_switch.fully_shard = _fsdp_lite_switch.fully_shard
# --- end of switch
"""
BINDING_LOG = (
    "common_fsdp.fully_shard and torch.distributed.fsdp.fully_shard bound to fsdp_lite.fully_shard"
)


def _format_import(module: str, names: list[ast.alias], indent: str) -> str:
    parts = [a.name if a.asname is None else f"{a.name} as {a.asname}" for a in names]
    return f"{indent}from {module} import {', '.join(parts)}\n"


def switch(
    source: str,
    names: dict[str, set[str]] | None = None,
    bindings: str = RUNTIME_BINDINGS,
    binding_log: str = BINDING_LOG,
) -> tuple[str, list[str]]:
    """Return the switched source and a line per change.

    ``names`` maps each torch module whose imports are switched to {name: fsdp_lite module}
    (default: the FSDP2 names of SWITCHED_MODULES, from ``fsdp_lite``); ``bindings`` is the text
    put after the last top-level import (scripts/switch_torch_fsdp1_tests.py passes its own).
    """
    if names is None:
        names = {module: dict.fromkeys(FSDP_LITE_NAMES, "fsdp_lite") for module in SWITCHED_MODULES}
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    edits: list[tuple[int, int, str]] = []  # (first line, last line, replacement), 1-based
    log: list[str] = []
    last_top_import = 0
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and node in tree.body:
            last_top_import = max(last_top_import, node.end_lineno)
        if not isinstance(node, ast.ImportFrom) or node.module not in names:
            continue
        targets = names[node.module]
        ours = [a for a in node.names if a.name in targets]
        if not ours:
            continue
        theirs = [a for a in node.names if a.name not in targets]
        first = lines[node.lineno - 1]
        indent = first[: len(first) - len(first.lstrip())]
        text = ""
        for target in dict.fromkeys(targets[a.name] for a in ours):
            text += _format_import(target, [a for a in ours if targets[a.name] == target], indent)
        if theirs:
            text += _format_import(node.module, theirs, indent)
        edits.append((node.lineno, node.end_lineno, text))
        log.append(
            f"line {node.lineno}: "
            + "; ".join(f"{a.name} from {targets[a.name]}" for a in ours)
            + (f"; kept from {node.module}: {', '.join(a.name for a in theirs)}" if theirs else "")
        )
    if not edits:
        raise SystemExit("no import to switch in this file")
    # The bindings go after the last top-level import (the file's own code follows).
    edits.append((last_top_import + 1, last_top_import, bindings))
    for first, last, text in sorted(edits, key=lambda e: e[0], reverse=True):
        lines[first - 1 : last] = [text]
    log.append(f"after line {last_top_import}: {binding_log}")
    return "".join(lines), log


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("test_file", type=Path, help="one of torch's test_fully_shard_*.py")
    parser.add_argument("-o", "--output", type=Path, help="where to write (default: stdout)")
    args = parser.parse_args(argv)
    switched, log = switch(args.test_file.read_text())
    write(args.test_file, args.output, switched, log)
    return 0


def write(test_file: Path, output: Path | None, text: str, log: list[str]) -> None:
    """Write ``text`` to ``output`` (stdout when None) and the log lines to stderr."""
    if output is None:
        sys.stdout.write(text)
    else:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(text)
    for line in log:
        print(f"{test_file.name}: {line}", file=sys.stderr)


if __name__ == "__main__":
    raise SystemExit(main())
