"""Step time of every system of scripts/bench.py, one pytest-benchmark case each (rank 0's steps).

The same seeded model, per-rank batches and wrapping as ``python scripts/bench.py``; pytest-benchmark
times rank 0's forward + backward + AdamW step while the other ranks train beside it. Memory and
communicated bytes are scripts/bench.py's job; each case also records rank 0's state bytes.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from scripts import bench

WORLD_SIZE = 2  # the matrix below; --bench-world-size changes the group, not which cases exist
SPECS = {s.name: s for s in bench.all_systems(WORLD_SIZE)[0]}
CASES = [("fp32", name) for name in SPECS] + [
    ("bf16", name) for name in bench.DEFAULT_BF16 if name in SPECS
]


@pytest.mark.parametrize(
    "precision, name", CASES, ids=[f"{p}-{n.replace('/', '.')}" for p, n in CASES]
)
def test_step(benchmark, ranks, precision, name):
    command = (precision, name, ranks.cfg, ranks.batch, ranks.seed, ranks.warmup + ranks.steps)
    bench.broadcast_command(command)
    built = [bench.build_system(SPECS[name], precision, ranks.cfg, ranks.seed)]
    step = iter(range(ranks.warmup + ranks.steps))

    def one_step() -> float:
        inputs, targets = bench.make_batch(ranks.cfg, ranks.batch, ranks.seed, next(step), 0)
        return bench.train_step(built[0], inputs, targets)

    benchmark.group = precision
    loss = benchmark.pedantic(
        one_step, rounds=ranks.steps, warmup_rounds=ranks.warmup, iterations=1
    )
    state = bench.state_nbytes(built.pop())  # frees the system before the next case
    benchmark.extra_info["world_size"] = ranks.world_size
    benchmark.extra_info.update({f"rank0_{k}_nbytes": v for k, v in state.items()})
    dist.barrier()  # the followers have run the same number of steps
    assert loss == loss, f"{precision} {name}: loss is NaN"
