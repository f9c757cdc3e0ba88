"""unit.py's state machine at 2 ranks: SHARDED <-> UNSHARDED, what modules hold, what is allocated.

One spawn of 2 ranks (``_unit_scenarios``) drives the units of a tiny wrapped model through every
transition and sends back what it saw; the tests below judge those observations in the parent, each
with its own name. Driving ``unshard`` / ``wait_for_unshard`` / ``reshard`` by hand, with no forward,
tests the unit alone; the hooks that call them in a step are test_runtime.py's business.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from fsdp_lite import FullyShardedModule, ShardingStrategy
from fsdp_lite.api import STRATEGY_RULES
from fsdp_lite.engine import collectives
from fsdp_lite.engine.unit import ShardedState, ShardedUnit, TrainingState
from fsdp_lite.trace import CollectiveTrace, record_collectives
from tests.ranks import run_ranks

WORLD_SIZE = 2


def _build_model() -> nn.Sequential:
    # Uneven at 2 ranks: 0.weight 5x3 (3 + 2 rows), 2.weight 1x5 and 2.bias (1,) (rank 1 has no rows).
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 1))


def _input(rank: int) -> torch.Tensor:
    return torch.randn(4, 3, generator=torch.Generator().manual_seed(10 + rank))


# ---- what each rank runs ------------------------------------------------------------------------


def _full_name(unit: ShardedUnit, fqn: str) -> str:
    return f"{unit.name}.{fqn}" if unit.name else fqn


def _snapshot(unit: ShardedUnit) -> dict:
    """The unit's state and, per parameter, what its modules hold and what is allocated."""
    params = {}
    for p in unit.params:
        held = [module._parameters[attr] for module, attr in p.locations]
        params[_full_name(unit, p.fqn)] = {
            "holds_sharded_param": all(h is p.sharded_param for h in held),
            "holds_unsharded_param": p.unsharded_param is not None
            and all(h is p.unsharded_param for h in held),
            "holds_dtensor": all(isinstance(h, DTensor) for h in held),
            "unsharded_nbytes": (
                None if p.unsharded_flat is None else p.unsharded_flat.untyped_storage().nbytes()
            ),
            "padded_nbytes": p.padded_numel * p.sharded_flat.element_size(),
            "held_values": [h.to_local() if isinstance(h, DTensor) else h for h in held][0]
            .detach()
            .clone(),
        }
    return {
        "state": unit.state.name,
        "all_gather_in_flight": bool(unit.buffers_in_flight()),
        "params": params,
    }


def _assert_state_message(unit: ShardedUnit, *allowed: TrainingState) -> str | None:
    try:
        unit.assert_state(*allowed)
    except AssertionError as error:
        return str(error)
    return None


def _sharded_unit_scenario(rank: int) -> dict:
    seen: dict = {}
    model = _build_model()
    model[2] = FullyShardedModule(model[2])
    root = FullyShardedModule(model)
    root._lazy_init()  # names the units: root "" and "2"
    inner = model[2]._unit
    units = {"root": root._unit, "inner": inner}
    trace = CollectiveTrace()
    for unit in units.values():
        unit.watch(trace)
    seen["unit_names"] = {key: unit.name for key, unit in units.items()}

    seen["initial"] = {key: _snapshot(unit) for key, unit in units.items()}

    # Transitions that are no-ops: nothing in flight, already sharded.
    inner.wait_for_unshard()
    inner.reshard()
    seen["after_noop_wait_and_reshard"] = _snapshot(inner)

    # unshard + wait_for_unshard, then a second unshard that must not gather again.
    inner.unshard("unshard")
    inner.wait_for_unshard()
    seen["unsharded"] = _snapshot(inner)
    seen["root_while_inner_unsharded"] = _snapshot(root._unit)
    inner.unshard("unshard_again")
    inner.wait_for_unshard()
    seen["inner_forward"] = model[2].module(torch.ones(2, 5)).detach()  # the nn.Linear itself

    inner.reshard()
    seen["resharded"] = _snapshot(inner)

    # A prefetch nobody uses: the all-gather is in flight when reshard comes.
    inner.unshard("prefetch", async_op=True)
    seen["prefetch_in_flight"] = _snapshot(inner)
    inner.unshard("prefetch_again", async_op=True)  # already in flight: must not start another
    inner.reshard()
    seen["after_unused_prefetch"] = _snapshot(inner)
    inner.unshard("after_prefetch")
    inner.wait_for_unshard()
    seen["unsharded_after_prefetch"] = _snapshot(inner)
    inner.reshard()

    seen["all_gathers"] = [
        (r.unit, r.phase, r.numel) for r in trace.records if r.kind == "all_gather"
    ]
    seen["unit_shard_numel"] = {key: unit.unit_shard_numel for key, unit in units.items()}
    seen["other_collectives"] = [r.kind for r in trace.records if r.kind != "all_gather"]

    # assert_state: the hooks' guard.
    seen["assert_state_messages"] = {
        "inner FORWARD or BACKWARD": _assert_state_message(
            inner, TrainingState.FORWARD, TrainingState.BACKWARD
        ),
        "root FORWARD": _assert_state_message(root._unit, TrainingState.FORWARD),
        "inner IDLE": _assert_state_message(inner, TrainingState.IDLE),
    }
    inner.enter(TrainingState.BACKWARD)
    seen["assert_state_messages"]["inner in BACKWARD, IDLE expected"] = _assert_state_message(
        inner, TrainingState.IDLE
    )
    inner.enter(TrainingState.IDLE)
    return seen


def _no_shard_scenario(rank: int) -> dict:
    seen: dict = {}
    model = _build_model()
    orig_params = dict(model.named_parameters())
    wrapped = FullyShardedModule(model, sharding_strategy=ShardingStrategy.NO_SHARD)
    unit = wrapped._unit
    seen["rules_are_no_shard"] = unit.rules == STRATEGY_RULES[ShardingStrategy.NO_SHARD]
    seen["modules_hold_orig_params"] = {
        name: model.get_parameter(name) is orig for name, orig in orig_params.items()
    }
    seen["initial"] = _snapshot(unit)

    all_gather_calls = []
    plain_all_gather = collectives.all_gather

    def counting_all_gather(*args, **kwargs):
        all_gather_calls.append(kwargs.get("async_op", False))
        return plain_all_gather(*args, **kwargs)

    collectives.all_gather = counting_all_gather  # a spy below the trace, in case one bypasses it
    try:
        with record_collectives(wrapped) as trace:
            unit.unshard("unshard")
            unit.wait_for_unshard()
            seen["after_unshard"] = _snapshot(unit)
            unit.reshard()
            seen["after_reshard"] = _snapshot(unit)
            loss = wrapped(_input(rank)).sum()
            loss.backward()
            seen["after_backward"] = _snapshot(unit)
    finally:
        collectives.all_gather = plain_all_gather
    seen["all_gather_calls"] = all_gather_calls
    seen["collectives"] = [(r.kind, r.phase) for r in trace.records]
    seen["grads"] = {name: p.grad.clone() for name, p in orig_params.items()}
    return seen


def _unit_scenarios(rank: int, world_size: int) -> bytes:
    seen = {"sharded": _sharded_unit_scenario(rank), "no_shard": _no_shard_scenario(rank)}
    # torch.save, not the pipe's pickling: a tensor pickled as-is is a shared-memory handle that
    # dies with the rank.
    buffer = io.BytesIO()
    torch.save(seen, buffer)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def ranks_seen(tmp_path_factory) -> list[dict]:
    packed = run_ranks(_unit_scenarios, WORLD_SIZE, tmp_path_factory.mktemp("unit"), timeout=90)
    return [torch.load(io.BytesIO(b), weights_only=True) for b in packed]


@pytest.fixture(scope="module")
def full_params() -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in _build_model().named_parameters()}


def _assert_bitwise(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, msg=lambda m: f"{what}: {m}")


def _assert_sharded(snapshot: dict, full_params: dict, rank: int, what: str) -> None:
    assert snapshot["state"] == ShardedState.SHARDED.name, (
        f"rank {rank} {what}: state {snapshot['state']}"
    )
    assert not snapshot["all_gather_in_flight"], f"rank {rank} {what}: an all-gather is in flight"
    for name, p in snapshot["params"].items():
        where = f"rank {rank} {what} param {name}"
        assert p["holds_sharded_param"], f"{where}: module does not hold sharded_param"
        assert p["holds_dtensor"], f"{where}: module holds a plain tensor"
        assert p["unsharded_nbytes"] == 0, f"{where}: unsharded storage {p['unsharded_nbytes']} B"
        rows = torch.chunk(full_params[name], WORLD_SIZE)
        expected = rows[rank] if rank < len(rows) else full_params[name][:0]
        _assert_bitwise(p["held_values"], expected, f"{where}: sharded_param.to_local()")


def _assert_unsharded(snapshot: dict, full_params: dict, rank: int, what: str) -> None:
    assert snapshot["state"] == ShardedState.UNSHARDED.name, (
        f"rank {rank} {what}: state {snapshot['state']}"
    )
    assert not snapshot["all_gather_in_flight"], f"rank {rank} {what}: an all-gather is in flight"
    for name, p in snapshot["params"].items():
        where = f"rank {rank} {what} param {name}"
        assert p["holds_unsharded_param"], f"{where}: module does not hold unsharded_param"
        assert not p["holds_dtensor"], f"{where}: module holds a DTensor"
        assert p["unsharded_nbytes"] == p["padded_nbytes"], (
            f"{where}: unsharded storage {p['unsharded_nbytes']} B, expected {p['padded_nbytes']} B"
        )
        _assert_bitwise(p["held_values"], full_params[name], f"{where}: unsharded_param")


# ---- SHARDED <-> UNSHARDED ----------------------------------------------------------------------


def test_units_start_sharded_with_modules_holding_sharded_dtensors(ranks_seen, full_params):
    for rank, seen in enumerate(ranks_seen):
        for key, snapshot in seen["sharded"]["initial"].items():
            _assert_sharded(snapshot, full_params, rank, f"initial {key} unit")


def test_units_are_named_by_module_path_root_empty(ranks_seen):
    for rank, seen in enumerate(ranks_seen):
        names = seen["sharded"]["unit_names"]
        assert names == {"root": "", "inner": "2"}, f"rank {rank}: unit names {names}"


def test_wait_and_reshard_without_unshard_change_nothing(ranks_seen, full_params):
    for rank, seen in enumerate(ranks_seen):
        _assert_sharded(
            seen["sharded"]["after_noop_wait_and_reshard"], full_params, rank, "after no-op calls"
        )


def test_unshard_then_wait_gives_modules_the_full_original_params(ranks_seen, full_params):
    for rank, seen in enumerate(ranks_seen):
        _assert_unsharded(seen["sharded"]["unsharded"], full_params, rank, "after unshard + wait")


def test_unsharding_one_unit_leaves_the_other_sharded(ranks_seen, full_params):
    for rank, seen in enumerate(ranks_seen):
        _assert_sharded(
            seen["sharded"]["root_while_inner_unsharded"],
            full_params,
            rank,
            "root, inner unsharded",
        )


def test_unsharded_module_computes_with_the_full_params(ranks_seen, full_params):
    expected = F.linear(torch.ones(2, 5), full_params["2.weight"], full_params["2.bias"])
    for rank, seen in enumerate(ranks_seen):
        _assert_bitwise(seen["sharded"]["inner_forward"], expected, f"rank {rank} unit '2' forward")


def test_reshard_frees_unsharded_storage_and_restores_sharded_params(ranks_seen, full_params):
    for rank, seen in enumerate(ranks_seen):
        _assert_sharded(seen["sharded"]["resharded"], full_params, rank, "after reshard")


def test_async_unshard_leaves_state_sharded_until_waited(ranks_seen, full_params):
    for rank, seen in enumerate(ranks_seen):
        snapshot = seen["sharded"]["prefetch_in_flight"]
        assert snapshot["state"] == ShardedState.SHARDED.name, (
            f"rank {rank} prefetch in flight: {snapshot['state']}"
        )
        assert snapshot["all_gather_in_flight"], f"rank {rank}: prefetch not recorded as in flight"
        for name, p in snapshot["params"].items():
            where = f"rank {rank} prefetch in flight param {name}"
            assert p["holds_sharded_param"], f"{where}: module switched before the wait"
            # In flight, only all_gather_output holds the unit; the unsharded params are
            # allocated when it lands (wait_for_unshard).
            assert p["unsharded_nbytes"] == 0, (
                f"{where}: unsharded storage {p['unsharded_nbytes']} B before the gather landed"
            )


def test_reshard_after_unused_prefetch_frees_everything(ranks_seen, full_params):
    for rank, seen in enumerate(ranks_seen):
        _assert_sharded(
            seen["sharded"]["after_unused_prefetch"], full_params, rank, "after unused prefetch"
        )


def test_unit_unshards_again_after_an_unused_prefetch(ranks_seen, full_params):
    for rank, seen in enumerate(ranks_seen):
        _assert_unsharded(
            seen["sharded"]["unsharded_after_prefetch"], full_params, rank, "unshard after prefetch"
        )


def test_one_all_gather_per_unshard_none_while_unsharded_or_in_flight(ranks_seen):
    for rank, seen in enumerate(ranks_seen):
        numel = seen["sharded"]["unit_shard_numel"]["inner"]
        expected = [("2", phase, numel) for phase in ("unshard", "prefetch", "after_prefetch")]
        assert seen["sharded"]["all_gathers"] == expected, (
            f"rank {rank}: all-gathers {seen['sharded']['all_gathers']}, expected {expected}"
        )
        assert seen["sharded"]["other_collectives"] == [], (
            f"rank {rank}: unshard/reshard issued {seen['sharded']['other_collectives']}"
        )


# ---- assert_state -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "case, expected",
    [
        (
            "inner FORWARD or BACKWARD",
            "unit '2': expected training state FORWARD or BACKWARD, got IDLE",
        ),
        ("root FORWARD", "unit '<root>': expected training state FORWARD, got IDLE"),
        (
            "inner in BACKWARD, IDLE expected",
            "unit '2': expected training state IDLE, got BACKWARD",
        ),
    ],
    ids=["inner-two-allowed", "root", "inner-in-backward"],
)
def test_assert_state_raises_naming_the_unit_and_both_states(ranks_seen, case, expected):
    for rank, seen in enumerate(ranks_seen):
        message = seen["sharded"]["assert_state_messages"][case]
        assert message == expected, f"rank {rank} {case}: assert_state said {message!r}"


def test_assert_state_passes_in_an_allowed_state(ranks_seen):
    for rank, seen in enumerate(ranks_seen):
        message = seen["sharded"]["assert_state_messages"]["inner IDLE"]
        assert message is None, f"rank {rank}: assert_state(IDLE) in IDLE raised {message!r}"


def test_assert_state_raises_assertion_error_in_process():
    unit = ShardedUnit.__new__(ShardedUnit)  # no group needed: assert_state reads two fields
    unit.name, unit.training_state = "blocks.3", TrainingState.SUMMON
    with pytest.raises(
        AssertionError, match=r"unit 'blocks\.3': expected training state IDLE, got SUMMON"
    ):
        unit.assert_state(TrainingState.IDLE)


# ---- NO_SHARD -----------------------------------------------------------------------------------


def test_no_shard_unit_reads_the_no_shard_rules(ranks_seen):
    for rank, seen in enumerate(ranks_seen):
        assert seen["no_shard"]["rules_are_no_shard"], f"rank {rank}: unit.rules is not NO_SHARD's"


# A NO_SHARD unit goes through the same states as a sharded one (unit.py Note [Sharded states]);
# its "unsharded" copy is the parameter itself, so nothing moves and nothing is allocated.
NO_SHARD_STATES = {
    "initial": ShardedState.SHARDED,
    "after_unshard": ShardedState.UNSHARDED,
    "after_reshard": ShardedState.SHARDED,
    "after_backward": ShardedState.SHARDED,
}


def test_no_shard_unit_always_holds_the_original_params(ranks_seen, full_params):
    for rank, seen in enumerate(ranks_seen):
        held = seen["no_shard"]["modules_hold_orig_params"]
        assert all(held.values()), f"rank {rank}: modules do not hold the original params: {held}"
        for when, state in NO_SHARD_STATES.items():
            snapshot = seen["no_shard"][when]
            assert snapshot["state"] == state.name, (
                f"rank {rank} NO_SHARD {when}: {snapshot['state']}, expected {state.name}"
            )
            for name, p in snapshot["params"].items():
                where = f"rank {rank} NO_SHARD {when} param {name}"
                assert p["holds_sharded_param"], f"{where}: module does not hold the original param"
                assert not p["holds_dtensor"], f"{where}: module holds a DTensor"
                assert p["unsharded_nbytes"] is None, f"{where}: has an unsharded copy"
                if when != "after_backward":  # no optimizer step, so unchanged even after
                    _assert_bitwise(p["held_values"], full_params[name], f"{where}: values")


def test_no_shard_unit_never_all_gathers(ranks_seen):
    for rank, seen in enumerate(ranks_seen):
        calls = seen["no_shard"]["all_gather_calls"]
        assert calls == [], (
            f"rank {rank}: NO_SHARD called collectives.all_gather {len(calls)} times"
        )
        kinds = seen["no_shard"]["collectives"]
        assert kinds == [("all_reduce", "backward")], (
            f"rank {rank}: NO_SHARD unshard/reshard/forward/backward issued {kinds}, "
            "expected one all_reduce in backward"
        )


def test_no_shard_backward_averages_grads_over_ranks(ranks_seen):
    model = _build_model()
    per_rank = []
    for rank in range(WORLD_SIZE):
        model.zero_grad()
        model(_input(rank)).sum().backward()
        per_rank.append({name: p.grad.clone() for name, p in model.named_parameters()})
    for rank, seen in enumerate(ranks_seen):
        for name, grad in seen["no_shard"]["grads"].items():
            # 2 ranks: g0 / 2 + g1 / 2 is one rounding, the same as (g0 + g1) / 2: exact.
            expected = (per_rank[0][name] + per_rank[1][name]) / WORLD_SIZE
            _assert_bitwise(grad, expected, f"rank {rank} NO_SHARD param {name}: averaged grad")
