"""One 2-D (dp 2 x tp 2) training step, traced: fsdp_lite's collectives, TP's, and the layout.

    torchrun --nproc_per_node 4 scripts/tp_trace.py [--png docs/figures/tp2d_timeline.png]

The tiny Llama of conformance/tp_models.py with torchtitan's TP plan on mesh["tp"] and fully_shard
on mesh["dp"]. Step 2 (after the first, which records the order) runs under
``fsdp_lite.trace.record_collectives`` and torch's ``CommDebugMode``; rank 0 prints
``explain()`` for one block, the bytes each fsdp_lite collective moved against the formula, and
the count of TP's collectives, and with ``--png`` draws every rank's timeline (needs matplotlib).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fsdp_lite  # noqa: E402
from conformance.tp_models import batch, build_tplm, loss_fn, parallelize  # noqa: E402
from fsdp_lite.engine.unit import unit_owners  # noqa: E402
from fsdp_lite.tools.launch import leave_together  # noqa: E402
from fsdp_lite.trace import CollectiveTrace, explain, plot_timeline, record_collectives  # noqa: E402


class CountFunctionalBytes(TorchDispatchMode):
    """Bytes this rank sends in DTensor's collectives (the ``_c10d_functional`` ops TP issues),
    by ring volume: an all-gather sends its input to each of g-1 peers, a reduce-scatter
    (g-1)/g of its input, an all-reduce twice that."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "_c10d_functional" and func._opname in _FUNCTIONAL:
            tensor, group_size = args[0], _FUNCTIONAL[func._opname](args)
            nbytes = tensor.numel() * tensor.element_size()
            factor = {
                "all_gather_into_tensor": group_size - 1,
                "reduce_scatter_tensor": (group_size - 1) / group_size,
                "all_reduce": 2 * (group_size - 1) / group_size,
            }[func._opname]
            self.sent[func._opname] = self.sent.get(func._opname, 0) + int(nbytes * factor)
        return func(*args, **(kwargs or {}))


def _group_size_from_name(name: str) -> int:
    return dist.get_world_size(dist.distributed_c10d._resolve_process_group(name))


# op -> its group size from its arguments (tensor, ..., group_size or group_name)
_FUNCTIONAL = {
    "all_gather_into_tensor": lambda args: args[1],
    "reduce_scatter_tensor": lambda args: args[2],
    "all_reduce": lambda args: _group_size_from_name(args[2]),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--png", type=Path, help="write the step's timeline here")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    model = parallelize(build_tplm(), mesh["tp"])
    for block in model.blocks:
        fsdp_lite.fully_shard(block, mesh=mesh["dp"])
    fsdp_lite.fully_shard(model, mesh=mesh["dp"])
    optim = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(i: int) -> None:
        x, y = batch(i, dp_rank, 2)
        loss_fn(model(x), y).backward()
        optim.step()
        optim.zero_grad()

    step(0)
    comm, tp_bytes = CommDebugMode(), CountFunctionalBytes()
    with record_collectives(model, optim) as trace, comm, tp_bytes:
        step(1)
    traces: list = [None] * dist.get_world_size()
    dist.all_gather_object(traces, trace.to_json())
    if rank == 0:
        sections, keep = [], True
        for line in explain(model).splitlines():  # the root and blocks.0; blocks.1 is the same
            if line.startswith("unit "):
                keep = not line.startswith("unit blocks.1")
            if keep:
                sections.append(line)
        print("\n".join(sections))
        units = {(m._unit.name or "<root>"): m._unit for m in unit_owners(model)}
        print("\nfsdp_lite's collectives in step 2 on rank 0 (fp32, over the dp group of 2):")
        print(f"{'unit':<10} {'kind':<15} {'count':>5} {'bytes':>8} {'formula':>8}")
        for name, unit in units.items():
            shard_bytes = unit.unit_shard_numel * 4
            # A reduce-scatter's input: both ranks' rows plus one count per param and rank.
            reduce_bytes = 2 * (unit.unit_shard_numel + len(unit.trainable)) * 4
            for kind, formula in (("all_gather", shard_bytes), ("reduce_scatter", reduce_bytes)):
                mine = [r for r in trace.records if r.kind == kind and (r.unit or "<root>") == name]
                total = sum(r.nbytes for r in mine)
                print(f"{name:<10} {kind:<15} {len(mine):>5} {total:>8} {formula * len(mine):>8}")
        counts = comm.get_comm_counts()
        print("\ntensor parallel's collectives in step 2 (DTensor, over the tp group of 2):")
        for op, n in sorted(counts.items(), key=lambda kv: str(kv[0])):
            name = str(op).split(".")[-1]
            sent = tp_bytes.sent.get(name, 0)
            print(f"  {name:<28} {n:>3}   {sent:>7} bytes sent by this rank")
        if args.png:
            plot_timeline(
                [CollectiveTrace.from_json(t) for t in traces],
                args.png,
                title="dp 2 x tp 2: one step (fsdp_lite's collectives; TP's run inside compute)",
            )
            print(f"\nwrote {args.png}")
    leave_together()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
