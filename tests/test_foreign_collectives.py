"""Collectives fsdp_lite does not own (fsdp_lite/tools/order.py, Note [Foreign collectives]).

HF Trainer called ``model.state_dict()`` (a full state dict: an all-gather) on rank 0 only, and
rank 1 went on into Trainer's own ``dist.all_gather``: both sat in gloo for 10 minutes. Here rank 0
raises ``CollectiveOrderError`` within seconds, naming its collective, the rank that did not come
and where that rank is; rank 1, whose torch collective nothing can interrupt, logs the same
diagnosis at ERROR level and, once rank 0 has left, raises it as a CollectiveOrderError
(gloo's "Connection closed" its context). What does
not hold within seconds is tested too: where rank 0's wait is direct (a step it has run before),
both ranks log the diagnosis, and neither raises until the wait fails.

Ranks are plain processes (tests/ranks.py), not under torchrun's agent, which would kill the
survivors.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fsdp_lite
from fsdp_lite.tools.order import Foreign, OrderLog, foreign_collective
from tests.parity import build_model, loss_fn, rank_batch
from tests.ranks import run_ranks

HERE = Path(__file__).name
BOUND = 30  # seconds: the bound for every rank


def _recorded() -> list[tuple[float, str, str]]:
    """fsdp_lite's log records from now on: (time.monotonic(), level, message)."""
    records: list[tuple[float, str, str]] = []

    class Recorder(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append((time.monotonic(), record.levelname, record.getMessage()))

    logging.getLogger("fsdp_lite").addHandler(Recorder(logging.WARNING))
    return records


def _build(front: str) -> torch.nn.Module:
    model = build_model("lm_untied")
    if front == "FullyShardedDataParallel":
        return fsdp_lite.FullyShardedDataParallel(
            model, auto_wrap_policy=fsdp_lite.wrap.ModuleWrapPolicy({type(model.blocks[0])})
        )
    for block in model.blocks:
        fsdp_lite.fully_shard(block)
    fsdp_lite.fully_shard(model)
    return model


def _train_step(model: torch.nn.Module, rank: int, world_size: int, step: int) -> None:
    x, y = rank_batch("lm", step, rank, world_size)
    loss_fn("lm", model(x), y).backward()


def _full_state_dict(model: torch.nn.Module, front: str) -> dict:
    if front == "FullyShardedDataParallel":
        return model.state_dict()  # FULL_STATE_DICT, the wrapper's default
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def _trainer_all_gather(world_size: int) -> None:
    """What Trainer does next on every rank: an all-gather of its own (of metrics)."""
    out = [torch.zeros(3) for _ in range(world_size)]
    dist.all_gather(out, torch.ones(3))


def _ended(start: float, error: BaseException | None, records: list) -> dict:
    return {
        "error": None if error is None else f"{type(error).__name__}: {error}",
        "context": None if error is None else repr(error.__context__),
        "seconds": time.monotonic() - start,
        "logs": [(at - start, level, message) for at, level, message in records],
    }


def _state_dict_on_rank_0_only(rank: int, world_size: int, front: str) -> dict:
    records = _recorded()
    model = _build(front)
    _train_step(model, rank, world_size, 1)
    start = time.monotonic()
    try:
        if rank == 0:  # "only rank 0 saves"
            _full_state_dict(model, front)
        _trainer_all_gather(world_size)
    except RuntimeError as e:
        return _ended(start, e, records)
    return _ended(start, None, records)


@pytest.mark.parametrize("front", ["FullyShardedDataParallel", "fully_shard"])
def test_a_full_state_dict_on_rank_0_only_while_rank_1_all_gathers_is_named(tmp_path, front):
    rank_0, rank_1 = run_ranks(
        _state_dict_on_rank_0_only, 2, tmp_path, args=(front,), timeout=60, in_step=False
    )
    error = rank_0["error"]
    assert error is not None and error.startswith(
        "CollectiveOrderError: fsdp_lite: rank 0 waits on collective "
    ), rank_0
    for expected in (
        "(all-gathered unit ",
        " in state_dict of step ",
        "which rank 1 did not issue: rank 1 is in torch.distributed.all_gather (group [0, 1]) "
        "called from ",
        f"{HERE}:",
        " in _trainer_all_gather, a collective fsdp_lite does not own",
        "rank 1's last fsdp_lite collective of this group was ",
        "in backward of step 1",
        "state_dict called on rank 0 only",
    ):
        assert expected in error, error
    assert rank_0["seconds"] < BOUND, rank_0
    # Rank 1's all_gather cannot be interrupted: it fails when rank 0 leaves, and raises (and
    # logs) why, with rank 0's finding; gloo's error is its context.
    assert rank_1["seconds"] < BOUND, rank_1
    errors = [message for _, level, message in rank_1["logs"] if level == "ERROR"]
    assert len(errors) == 1, rank_1["logs"]
    assert errors[0].startswith(
        "fsdp_lite: rank 1 cannot leave torch.distributed.all_gather (group [0, 1]) called from "
    ), errors
    assert "rank 0 waits for it in one of fsdp_lite's collectives, and raises" in errors[0]
    assert error.removeprefix("CollectiveOrderError: ") in errors[0]
    assert rank_1["error"] == f"CollectiveOrderError: {errors[0]}", rank_1
    assert rank_1["context"] is not None and "CollectiveOrderError" not in rank_1["context"]


def _user_barrier(module, args, output) -> None:
    """A module of the user's that calls a collective of its own, on some ranks only."""
    dist.barrier()


def _barrier_in_rank_1_forward(rank: int, world_size: int) -> dict:
    records = _recorded()
    model = _build("FullyShardedDataParallel")
    if rank == 1:
        model.module.blocks[0].module.register_forward_hook(_user_barrier)
    start = time.monotonic()
    try:
        _train_step(model, rank, world_size, 1)
    except RuntimeError as e:
        return _ended(start, e, records)
    return _ended(start, None, records)


def test_a_forward_all_gather_while_a_peer_is_in_a_barrier_is_named(tmp_path):
    rank_0, rank_1 = run_ranks(_barrier_in_rank_1_forward, 2, tmp_path, timeout=60, in_step=False)
    error = rank_0["error"]
    assert error is not None and error.startswith("CollectiveOrderError: fsdp_lite: rank 0"), rank_0
    for expected in (
        " in forward of step 1 ",
        "which rank 1 did not issue: rank 1 is in torch.distributed.barrier (group [0, 1]) "
        "called from ",
        f"{HERE}:",
        " in _user_barrier, a collective fsdp_lite does not own",
        "rank 1's last fsdp_lite collective of this group was ",
    ):
        assert expected in error, error
    assert rank_0["seconds"] < BOUND, rank_0
    assert rank_1["seconds"] < BOUND, rank_1
    errors = [message for _, level, message in rank_1["logs"] if level == "ERROR"]
    assert len(errors) == 1 and "rank 1 cannot leave torch.distributed.barrier" in errors[0], errors
    assert rank_1["error"] == f"CollectiveOrderError: {errors[0]}", rank_1


def _barrier_before_a_repeated_step(rank: int, world_size: int) -> dict:
    records = _recorded()
    model = _build("FullyShardedDataParallel")
    for step in (1, 2):
        _train_step(model, rank, world_size, step)
    store = dist.distributed_c10d._get_default_store()

    def logged(level: str) -> bool:
        return any(lvl == level for _, lvl, _ in records)

    def rank_0_ends_it() -> None:
        # The test's way out of the deadlock: the barrier rank 1 waits in, from another thread,
        # once both ranks have logged.
        while not (logged("ERROR") and store.check(["test/rank-1-logged"])):
            time.sleep(0.05)
        dist.barrier()

    def rank_1_says_it_logged() -> None:
        while not logged("ERROR"):
            time.sleep(0.05)
        store.set("test/rank-1-logged", "1")

    threading.Thread(target=rank_0_ends_it if rank == 0 else rank_1_says_it_logged).start()
    start = time.monotonic()
    try:
        if rank == 1:
            dist.barrier()  # rank 0 is in step 3's first all-gather, a direct wait
        _train_step(model, rank, world_size, 3)
    except RuntimeError as e:
        return _ended(start, e, records)
    return _ended(start, None, records)


def test_a_direct_wait_cannot_raise_but_both_ranks_log_the_diagnosis(tmp_path):
    """Not within seconds: rank 0 has run this step before, so it waits directly in its own
    thread (Note [Watched and direct waits]), which nothing can interrupt. Both ranks log the
    diagnosis at ERROR level within seconds; a rank raises only when the wait fails (a peer
    exits, or the process group's timeout). Here the test ends the deadlock itself."""
    rank_0, rank_1 = run_ranks(_barrier_before_a_repeated_step, 2, tmp_path, timeout=60)
    assert rank_0["error"] is None and rank_1["error"] is None, (rank_0, rank_1)
    errors = [(at, message) for at, level, message in rank_0["logs"] if level == "ERROR"]
    assert len(errors) == 1, rank_0["logs"]
    at, message = errors[0]
    assert at < BOUND, at
    for expected in (
        "fsdp_lite: rank 0 waits on collective ",
        "in forward of step 3",
        "which rank 1 did not issue: rank 1 is in torch.distributed.barrier (group [0, 1]) ",
        " in _barrier_before_a_repeated_step, a collective fsdp_lite does not own",
        "a direct wait",
        "it raises CollectiveOrderError when the wait fails",
    ):
        assert expected in message, message
    warnings = [m for _, level, m in rank_0["logs"] if level == "WARNING"]
    assert any("completed after all" in m for m in warnings), rank_0["logs"]
    errors = [(at, m) for at, level, m in rank_1["logs"] if level == "ERROR"]
    assert len(errors) == 1 and errors[0][0] < BOUND, rank_1["logs"]
    assert "rank 1 cannot leave torch.distributed.barrier" in errors[0][1], errors
    assert "cannot raise either (its wait is direct)" in errors[0][1], errors


def _slow_peer(rank: int, world_size: int, seconds: float) -> dict:
    records = _recorded()
    model = _build("FullyShardedDataParallel")
    _train_step(model, rank, world_size, 1)
    start = time.monotonic()
    if rank == 1:
        time.sleep(seconds)  # user code, no collective: slow, not stuck
    model.state_dict()  # both ranks; rank 0 waits for rank 1 in its first gather, watched
    return _ended(start, None, records)


def test_a_slow_peer_is_not_a_divergence(tmp_path):
    rank_0, rank_1 = run_ranks(_slow_peer, 2, tmp_path, args=(5.0,), timeout=60)
    assert rank_0["seconds"] >= 4.5, rank_0  # it did wait, and looked each second
    for r in (rank_0, rank_1):
        assert not [entry for entry in r["logs"] if entry[1] == "ERROR"], r["logs"]


# ---- in one process ----------------------------------------------------------------------------


def _record(where: Foreign, issued: int, record_id: str = "7.1") -> str:
    return json.dumps(
        {
            "id": record_id,
            "where": {"call": where.call, "site": where.site, "group": where.group},
            "issued": {"0-1-2": issued},
            "last": {"0-1-2": f"{issued - 1} (...)"} if issued else {},
        }
    )


def test_only_a_peer_whose_foreign_collective_waits_for_this_rank_is_a_divergence():
    log = OrderLog((0, 1, 2))
    for unit in ("", "blocks.0", "blocks.1"):
        log.issued(1, "all_gather", unit, "forward", 8)
    store = dist.HashStore()
    mine = {"watching": True}
    tensor_parallel = Foreign("torch.distributed.all_reduce", "tp.py:3 in f", (1, 2))
    functional = Foreign("torch.distributed.tensor.DTensor.full_tensor", "x.py:1 in g", None)
    barrier = Foreign("torch.distributed.barrier", "train.py:9 in main", (0, 1, 2))

    store.set("fsdp_lite/where/1/record", _record(tensor_parallel, 2))
    store.set("fsdp_lite/where/2/record", _record(functional, 2))
    # May complete without rank 0; a group the frame does not say: no divergence, even at once.
    assert log.foreign(store, 0, 2, None, {0: mine}) is None

    store.set("fsdp_lite/where/1/record", _record(barrier, 3))  # it issued collective 2 first
    assert log.foreign(store, 0, 2, None, {0: mine}) is None

    store.set("fsdp_lite/where/1/record", _record(barrier, 2))
    seen: dict[int, str] = {}
    assert log.foreign(store, 0, 2, seen, {0: mine}) is None, "the first look only remembers"
    message, stuck = log.foreign(store, 0, 2, seen, {0: mine})
    assert list(stuck) == [1]
    assert message.startswith(
        "fsdp_lite: rank 0 waits on collective 2 of group [0, 1, 2] (all-gathered unit "
        "'blocks.1' in forward of step 1 (8 elements)), which rank 1 did not issue: rank 1 is in "
        "torch.distributed.barrier (group [0, 1, 2]) called from train.py:9 in main, a collective "
        "fsdp_lite does not own that waits for rank 0 in turn; rank 1's last fsdp_lite "
        "collective of this group was 1 (...). No rank may enter another collective"
    ), message
    store.set("fsdp_lite/where/1/record", _record(barrier, 2, record_id="7.2"))
    assert log.foreign(store, 0, 2, seen, {0: mine}) is None, "a new stall: seen once"
    assert log.foreign(store, 0, 2, None, {0: mine}) is not None, "a failed wait: at once"


def _fake(module: str, source: str) -> dict:
    """Functions defined as if in ``module`` (what a frame's module name is read from)."""
    namespace = {"__name__": module}
    exec(source, namespace)  # noqa: S102 - the test's own code
    return namespace


def _stack_of(target, *args) -> tuple:
    """What ``foreign_collective`` says of a thread blocked in ``target(lock, *args)``."""
    lock = threading.Lock()
    lock.acquire()
    thread = threading.Thread(target=target, args=(lock, *args))
    thread.start()
    try:
        time.sleep(0.2)
        import sys

        frame = sys._current_frames()[thread.ident]
        try:
            return foreign_collective(frame)
        finally:
            del frame
    finally:
        lock.release()
        thread.join()


_C10D = _fake(
    "torch.distributed.distributed_c10d",
    "def all_gather(lock, group=None):\n    lock.acquire()\n",
)
_LOGGER = _fake(
    "torch.distributed.c10d_logger",
    "def wrapper(*args, **kwargs):\n    return func(*args, **kwargs)\n",
)
_LOGGER["func"] = _C10D["all_gather"]
_OPS = _fake("torch._ops", "def __call__(lock):\n    lock.acquire()\n")
_FUNCOL = _fake(
    "torch.distributed._functional_collectives",
    "def wait_tensor(lock):\n    return op(lock)\n",
)
_FUNCOL["op"] = _OPS["__call__"]
_DTENSOR = _fake(
    "torch.distributed.tensor._api",
    "def full_tensor(lock):\n    return wait(lock)\n",
)
_DTENSOR["wait"] = _FUNCOL["wait_tensor"]


def _users_all_gather(lock) -> None:
    _LOGGER["wrapper"](lock)


def _users_full_tensor(lock) -> None:
    _DTENSOR["full_tensor"](lock)


def _users_sleep(lock) -> None:
    lock.acquire()


def test_foreign_collective_names_the_call_and_its_caller():
    at, where = _stack_of(_users_all_gather)
    assert where.call == "torch.distributed.all_gather"
    assert where.site.endswith(" in _users_all_gather") and f"{HERE}:" in where.site, where
    assert where.group is None  # no process group in this process: unknown
    at, where = _stack_of(_users_full_tensor)
    assert where.call == "torch.distributed.tensor._api.full_tensor", where
    assert where.site.endswith(" in _users_full_tensor"), where
    assert _stack_of(_users_sleep) is None  # user code is no collective
