"""One owner per piece of state, and strategies chosen once (docs/engine.md).

A ``ShardedUnit`` holds fewer than 30 attributes, and only engine/unit.py assigns them: checked
statically over fsdp_lite/ and at run time while both fronts train through the calls that touch a
unit (FSDP2's setters, no_sync, summon_full_params, the trace, the order check, state dicts). The
step's unit methods and the parameters' constructors hold no ``if`` on strategy flags: what a
strategy changes is chosen when the unit is built (param.new_param, unit._reduction).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
import torch

import fsdp_lite
from fsdp_lite import FullyShardedDataParallel as FSDP
from fsdp_lite import ShardingStrategy
from fsdp_lite.engine.unit import ShardedUnit
from fsdp_lite.trace import record_collectives
from tests.parity import POLICIES, build_model, loss_fn, rank_batch
from tests.ranks import run_ranks

PACKAGE = Path(__file__).resolve().parents[1] / "fsdp_lite"
UNIT_FILE = PACKAGE / "engine" / "unit.py"
MAX_ATTRIBUTES = 30

# Names a unit goes by in fsdp_lite/: `unit.x = ...`, `u.x = ...`, `owner._unit.x = ...`.
UNIT_NAMES = {"unit", "u", "target", "inner"}


def _unit_field_assignments(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            for t in ast.walk(target) if isinstance(target, ast.Tuple) else [target]:
                while isinstance(t, ast.Subscript):  # unit.buffer_dtypes[k] = ...: its dict too
                    t = t.value
                if not isinstance(t, ast.Attribute):
                    continue
                owner = t.value
                named = isinstance(owner, ast.Name) and owner.id in UNIT_NAMES
                via_module = isinstance(owner, ast.Attribute) and owner.attr == "_unit"
                if named or via_module:
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {ast.unparse(t)}")
    return found


def test_only_unit_py_assigns_a_units_fields_statically():
    outside = [
        hit
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != UNIT_FILE
        for hit in _unit_field_assignments(path)
    ]
    assert not outside, "unit fields assigned outside engine/unit.py:\n" + "\n".join(outside)


def test_the_static_check_finds_a_planted_assignment(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(
        "def f(m, unit):\n    m._unit.reduced = True\n    unit.state += 1\n"
        "    unit.settings.is_last_backward = False\n    unit.buffer_dtypes[0] = 1\n"
    )
    global PACKAGE
    saved, PACKAGE = PACKAGE, tmp_path
    try:
        hits = _unit_field_assignments(planted)
    finally:
        PACKAGE = saved
    # The settings are the front's (UnitSettings): setting them is no assignment to the unit.
    assert [h.split(": ", 1)[1] for h in hits] == [
        "m._unit.reduced",
        "unit.state",
        "unit.buffer_dtypes",
    ], hits


# The step's unit methods and the parameters' constructors: no `if` on these.
STRATEGY_FLAGS = {
    "rules",
    "shard_params",
    "grad_reduce",
    "replicate",
    "replicate_group",
    "is_sharded",
    "uses_unsharded_copy",
    "reshard_after_forward",
    "reshard_after_backward",
}
CHOSEN_ONCE = {
    "engine/unit.py": ["unshard", "start_reduce", "_issue_reduce", "advance_reduce", "_land"],
    "engine/param.py": ["__init__"],
}


def _branches_on_strategy(path: Path, functions: list[str]) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.FunctionDef) or node.name not in functions:
            continue
        for branch in ast.walk(node):
            if isinstance(branch, (ast.If, ast.IfExp)):
                names = {n.attr for n in ast.walk(branch.test) if isinstance(n, ast.Attribute)}
                names |= {n.id for n in ast.walk(branch.test) if isinstance(n, ast.Name)}
                if names & STRATEGY_FLAGS:
                    found.append(f"{path.name}:{branch.lineno} in {node.name}: "
                                 f"{ast.unparse(branch.test)}")  # fmt: skip
    return found


def test_no_strategy_branches_in_the_steps_unit_methods_or_param_constructors():
    found = [
        hit
        for relative, functions in CHOSEN_ONCE.items()
        for hit in _branches_on_strategy(PACKAGE / relative, functions)
    ]
    assert not found, "branches on strategy flags:\n" + "\n".join(found)


# ---- at run time ---------------------------------------------------------------------------------


def _owned_run(rank: int, world_size: int) -> dict:
    """Train both fronts through every call that touches a unit, recording who assigns its fields."""
    outsiders: list[str] = []
    original = ShardedUnit.__setattr__

    def guarded(self, name, value):
        caller = sys._getframe(1).f_code.co_filename
        if not caller.endswith(str(Path("engine") / "unit.py")):
            outsiders.append(f"{name} from {caller}:{sys._getframe(1).f_lineno}")
        original(self, name, value)

    ShardedUnit.__setattr__ = guarded
    try:
        sizes = _exercise_both_fronts(rank, world_size)
    finally:
        ShardedUnit.__setattr__ = original
    return {"outsiders": outsiders, "sizes": sizes}


def _exercise_both_fronts(rank: int, world_size: int) -> dict[str, int]:
    sizes = {}
    fsdp1 = FSDP(
        build_model("lm"),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        auto_wrap_policy=POLICIES["lm"],
    )
    model = build_model("lm")
    for block in model.blocks:
        fsdp_lite.fully_shard(block)
    fsdp_lite.fully_shard(model)
    for name, wrapped in (("fsdp1", fsdp1), ("fsdp2", model)):
        optim = torch.optim.SGD(wrapped.parameters(), lr=0.1)
        with record_collectives(wrapped):
            for step in range(2):
                x, y = rank_batch("lm", step, rank, world_size)
                loss_fn("lm", wrapped(x), y).backward()
                optim.step()
                optim.zero_grad()
        fsdp_lite.set_collective_order_check(wrapped, False)
        fsdp_lite.set_collective_order_check(wrapped, True)
        wrapped.state_dict()
        sizes[name] = max(len(vars(m._unit)) for m in wrapped.modules() if "_unit" in vars(m))
    with fsdp1.no_sync():
        x, y = rank_batch("lm", 5, rank, world_size)
        loss_fn("lm", fsdp1(x), y).backward()
    with FSDP.summon_full_params(fsdp1):
        pass
    model.set_reshard_after_forward(False)
    model.set_reshard_after_backward(False)
    model.set_requires_gradient_sync(False)
    model.set_requires_gradient_sync(True)
    model.set_modules_to_forward_prefetch([model.blocks[0]])
    model.set_gradient_divide_factor(2.0)
    x, y = rank_batch("lm", 6, rank, world_size)
    loss_fn("lm", model(x), y).backward()
    model.set_reshard_after_backward(True)
    model.reshard()
    return sizes


@pytest.fixture(scope="module")
def owned(tmp_path_factory):
    return run_ranks(_owned_run, 2, tmp_path_factory.mktemp("owned"), timeout=120)


def test_only_unit_py_assigns_a_units_fields_while_both_fronts_train(owned):
    for rank, seen in enumerate(owned):
        assert not seen["outsiders"], f"rank {rank}: {seen['outsiders']}"


def test_a_unit_holds_fewer_than_30_attributes(owned):
    for rank, seen in enumerate(owned):
        for front, size in seen["sizes"].items():
            assert size < MAX_ATTRIBUTES, f"rank {rank} {front}: a unit holds {size} attributes"
