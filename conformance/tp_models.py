"""A tiny Llama-shaped model and torchtitan's tensor-parallel plan for it (composition tests, scripts).

Separate q, k, v projections (so ColwiseParallel splits whole heads), an MLP, LayerNorms run under
SequenceParallel, and an untied output head: every parallel style the composition tests need.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

VOCAB = 64
SEQ = 16


class Attention(nn.Module):
    def __init__(self, d: int, n_heads: int) -> None:
        super().__init__()
        self.head_dim = d // n_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under TP each rank holds n_heads / tp of them.
        q, k, v = (
            w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, d: int, d_ff: int) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Linear(d, d_ff), nn.Linear(d_ff, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class TPBlock(nn.Module):
    def __init__(self, d: int = 24, n_heads: int = 2, d_ff: int = 40) -> None:
        super().__init__()
        self.attn_norm, self.attn = nn.LayerNorm(d), Attention(d, n_heads)
        self.ffn_norm, self.ff = nn.LayerNorm(d), FeedForward(d, d_ff)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.ff(self.ffn_norm(x))


class TPLM(nn.Module):
    def __init__(self, d: int = 24, n_layers: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList(TPBlock(d) for _ in range(n_layers))
        self.norm = nn.LayerNorm(d)
        self.out = nn.Linear(d, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for block in self.blocks:
            x = block(x)
        return self.out(self.norm(x))


def build_tplm(seed: int = 0) -> TPLM:
    torch.manual_seed(seed)
    return TPLM()


def parallelize(model: TPLM, tp_mesh: DeviceMesh) -> TPLM:
    """torchtitan's Llama plan: sequence-parallel norms, colwise q/k/v/w1, rowwise wo/w2."""
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "out": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    to_replicated = PrepareModuleInput(
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
    )
    for block in model.blocks:
        parallelize_module(
            block,
            tp_mesh,
            {
                "attn_norm": SequenceParallel(),
                "attn": to_replicated,
                "attn.wq": ColwiseParallel(),
                "attn.wk": ColwiseParallel(),
                "attn.wv": ColwiseParallel(),
                "attn.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "ff": to_replicated,
                "ff.w1": ColwiseParallel(),
                "ff.w2": RowwiseParallel(output_layouts=Shard(1)),
            },
        )
    return model


def batch(
    step: int, part: int, parts: int, global_rows: int = 8
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``part`` of ``parts`` of step ``step``'s global batch (inputs, next-token targets)."""
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB, (global_rows, SEQ + 1), generator=g)
    rows = tokens.chunk(parts)[part]
    return rows[:, :-1], rows[:, 1:]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
