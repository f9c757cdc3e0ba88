"""3-D parallelism on 8 gloo ranks: pp 2 x dp 2 (fully_shard) x tp 2, the run of scripts/composition_3d.py."""

from __future__ import annotations

import pytest

from scripts.composition_3d import TOLERANCE, train_3d
from tests.ranks import run_ranks


@pytest.mark.slow
def test_pp2_dp2_tp2_trains_to_the_single_process_model(tmp_path):
    for rank, diffs in enumerate(run_ranks(train_3d, 8, tmp_path, timeout=240)):
        assert max(diffs) <= TOLERANCE, f"rank {rank}: differences per step {diffs}"
