"""fsdp_lite's sends travel on a gloo group of their own (collectives.py, Note [A group for the
sends]): a user's point-to-point message on the data group, with the very tag a unit uses,
reaches the user and never a unit, and the unit's gather reaches the unit.

On the data group itself (the design before), gloo paired the unit's first message with the
user's receive posted earlier on the same tag: the user got the unit's row and the unit waited
for a message that never came.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp_lite
from fsdp_lite.engine import collectives
from fsdp_lite.engine.unit import unit_owners
from tests.ranks import run_ranks


def _users_message_beside_a_gather(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    plain = nn.Linear(6, 4)
    model = nn.Linear(6, 4)
    model.load_state_dict(plain.state_dict())
    fsdp_lite.fully_shard(model)
    unit = unit_owners(model)[0]._unit
    group = dist.group.WORLD
    twin = collectives.sends_group(group)
    # The user's message: as long as the unit's row, on the unit's own tag, to the same peer.
    tag = collectives.p2p_tag("all_gather", unit.name)
    peer = 1 - rank
    received = torch.full((unit.unit_shard_numel,), -1.0)
    receive = dist.irecv(received, peer, tag=tag)
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(1))
    out = model(x)  # the unit's gather by sends: the peer's row must come to the unit
    sent = torch.full((unit.unit_shard_numel,), float(rank + 10))
    dist.isend(sent, peer, tag=tag).wait()
    receive.wait()
    return {
        "twin_is_not_the_group": twin is not group,
        "twin_ranks": (twin.rank(), twin.size()),
        "forward_equal": torch.equal(out, plain(x)),
        "users_message": received.tolist(),
        "expected": [float(peer + 10)] * unit.unit_shard_numel,
    }


def test_a_users_message_on_a_units_tag_reaches_the_user_and_the_gather_the_unit(tmp_path):
    results = run_ranks(_users_message_beside_a_gather, 2, tmp_path, timeout=60)
    for rank, seen in enumerate(results):
        assert seen["twin_is_not_the_group"], seen
        assert seen["twin_ranks"] == (rank, 2), seen
        assert seen["forward_equal"], seen
        assert seen["users_message"] == seen["expected"], seen


def _sends_are_dispatched(twin: dist.ProcessGroup, rank: int) -> list[str]:
    """The c10d ops a dispatch mode sees of a send and a receive on ``twin``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "c10d":
                seen.append(func._opname)
            return func(*args, **(kwargs or {}))

    with Ops():
        works = [twin.send([torch.ones(2)], 1 - rank, 3), twin.recv([torch.empty(2)], 1 - rank, 3)]
        for work in works:
            work.wait()
    return seen


def _twins(rank: int, world_size: int) -> dict:
    group = dist.group.WORLD
    first = collectives.sends_group(group)
    subgroup = dist.new_group([0, 1])
    return {
        "cached": collectives.sends_group(group) is first,
        "own_per_group": collectives.sends_group(subgroup) is not first,
        # torch's private names the twins are made with (collectives.py), pinned here.
        "store": isinstance(collectives._default_store(), dist.Store),
        "dispatched": _sends_are_dispatched(first, rank),
        "timeouts": (
            collectives._timeout_of(group).total_seconds(),
            collectives._timeout_of(first).total_seconds(),
        ),
    }


def test_one_twin_per_data_group_with_the_groups_timeout(tmp_path):
    for seen in run_ranks(_twins, 2, tmp_path, timeout=60):
        assert seen["cached"] and seen["own_per_group"] and seen["store"], seen
        assert seen["dispatched"] == ["send", "recv_"], seen  # as profilers and modes see them
        # tests/ranks.py gives the default group a timeout of its own (60 s here): the twin's too.
        assert seen["timeouts"] == (60.0, 60.0), seen
