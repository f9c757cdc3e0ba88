"""What the collective-order check's wait costs: one exchange of sends waited directly, or through
fsdp_lite/tools/order.py's helper thread.

    torchrun --nproc_per_node 2 scripts/bench_order_wait.py

Each rank sends 1,000 floats to the other and receives theirs, 2,000 times per mode, modes in
turn twice; rank 0 prints microseconds per exchange.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fsdp_lite.tools import order  # noqa: E402
from fsdp_lite.tools.launch import leave_together  # noqa: E402

EXCHANGES = 2000


def main() -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    peer = 1 - rank
    received, sent = torch.zeros(1000), torch.ones(1000)
    for mode in ("direct", "order.wait", "direct", "order.wait"):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(EXCHANGES):
            works = [dist.isend(sent, peer, tag=1), dist.irecv(received, peer, tag=1)]
            if mode == "direct":
                for work in works:
                    work.wait()
            else:
                order.wait(works, lambda: None)
        if rank == 0:
            us = (time.perf_counter() - start) / EXCHANGES * 1e6
            print(f"{mode:<11} {us:7.1f} us per exchange", flush=True)
    leave_together()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
