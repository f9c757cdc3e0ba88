"""The model zoo: tiny models, built from configs, that exercise what sharding can get wrong.

Shapes are chosen so that most dim-0 sizes do not divide by 2, 3 or 4 (padding), some are smaller
than the world size, and the LM ties its embedding to its output projection. Every builder seeds
torch itself, so every rank and every reference builds identical weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["Block", "GPTConfig", "MLP", "Nested", "TinyLM", "build"]


class MLP(nn.Module):
    def __init__(self, d_in: int = 7, d_hidden: int = 13, d_out: int = 3) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, 5)
        self.fc3 = nn.Linear(5, d_out)  # bias of 3 rows: smaller than world size 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 61
    seq_len: int = 16
    d_model: int = 24
    n_heads: int = 2
    n_layers: int = 2
    d_ff: int = 40


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention, then an MLP."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, cfg.d_ff)
        self.out = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.n_heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyLM(nn.Module):
    """A GPT-style decoder whose output projection is tied to the token embedding."""

    def __init__(self, cfg: GPTConfig = GPTConfig()) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Parameter(torch.randn(cfg.seq_len, cfg.d_model) * 0.02)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied: one parameter, two uses in one forward

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.size(1)]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class Nested(nn.Module):
    """Sequentials inside sequentials, of mixed sizes, for size-based wrapping."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(9, 17)
        self.body = nn.Sequential(
            nn.Sequential(nn.Linear(17, 31), nn.Tanh(), nn.Linear(31, 17)),
            nn.Sequential(nn.Linear(17, 11), nn.Tanh(), nn.Linear(11, 17)),
        )
        self.head = nn.Linear(17, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.stem(x))
        for part in self.body:
            x = x + part(x)
        return self.head(x)


def build(name: str, seed: int = 0) -> nn.Module:
    """Build a zoo model by name with fixed weights: 'mlp', 'lm' or 'nested'."""
    torch.manual_seed(seed)
    if name == "mlp":
        return MLP()
    if name == "lm":
        return TinyLM()
    if name == "nested":
        return Nested()
    raise ValueError(f"unknown model {name!r}; choose mlp, lm or nested")
