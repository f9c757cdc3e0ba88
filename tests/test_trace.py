"""explain(): the sharding plan as text, pinned."""

from __future__ import annotations

import tempfile

import expecttest
import torch

from fsdp_lite import FullyShardedDataParallel as FSDP
from fsdp_lite import MixedPrecision
from fsdp_lite.trace import explain
from tests.parity import POLICIES, build_model
from tests.ranks import run_ranks


def _explain_rank(rank: int, world_size: int) -> str:
    model = FSDP(
        build_model("lm"),
        auto_wrap_policy=POLICIES["lm"],
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    )
    return explain(model)


class TestExplain(expecttest.TestCase):
    def test_explain_lists_units_params_rows_and_padding(self):
        with tempfile.TemporaryDirectory() as tmp:
            texts = run_ranks(_explain_rank, 3, tmp, timeout=60)
        self.assertExpectedInline(
            texts[2],
            """\
unit <root>: FULL_SHARD, rank 2 of 3, 4 params, unit_shard_numel 664, padding 96, shard float32 / compute bfloat16 / reduce float32
  pos                                 16x24  rows    4/6    shard_numel     144  padding 48
  tok.weight                          61x24  rows   19/21   shard_numel     504  padding 48
  ln_f.weight                            24  rows    8/8    shard_numel       8  padding 0
  ln_f.bias                              24  rows    8/8    shard_numel       8  padding 0
unit blocks.0: FULL_SHARD, rank 2 of 3, 12 params, unit_shard_numel 1510, padding 50, shard float32 / compute bfloat16 / reduce float32
  ln1.weight                             24  rows    8/8    shard_numel       8  padding 0
  ln1.bias                               24  rows    8/8    shard_numel       8  padding 0
  qkv.weight                          72x24  rows   24/24   shard_numel     576  padding 0
  qkv.bias                               72  rows   24/24   shard_numel      24  padding 0
  proj.weight                         24x24  rows    8/8    shard_numel     192  padding 0
  proj.bias                              24  rows    8/8    shard_numel       8  padding 0
  ln2.weight                             24  rows    8/8    shard_numel       8  padding 0
  ln2.bias                               24  rows    8/8    shard_numel       8  padding 0
  fc.weight                           40x24  rows   12/14   shard_numel     336  padding 48
  fc.bias                                40  rows   12/14   shard_numel      14  padding 2
  out.weight                          24x40  rows    8/8    shard_numel     320  padding 0
  out.bias                               24  rows    8/8    shard_numel       8  padding 0
unit blocks.1: FULL_SHARD, rank 2 of 3, 12 params, unit_shard_numel 1510, padding 50, shard float32 / compute bfloat16 / reduce float32
  ln1.weight                             24  rows    8/8    shard_numel       8  padding 0
  ln1.bias                               24  rows    8/8    shard_numel       8  padding 0
  qkv.weight                          72x24  rows   24/24   shard_numel     576  padding 0
  qkv.bias                               72  rows   24/24   shard_numel      24  padding 0
  proj.weight                         24x24  rows    8/8    shard_numel     192  padding 0
  proj.bias                              24  rows    8/8    shard_numel       8  padding 0
  ln2.weight                             24  rows    8/8    shard_numel       8  padding 0
  ln2.bias                               24  rows    8/8    shard_numel       8  padding 0
  fc.weight                           40x24  rows   12/14   shard_numel     336  padding 48
  fc.bias                                40  rows   12/14   shard_numel      14  padding 2
  out.weight                          24x40  rows    8/8    shard_numel     320  padding 0
  out.bias                               24  rows    8/8    shard_numel       8  padding 0""",
        )
