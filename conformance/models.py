"""The model zoo: tiny models, built from configs, that exercise what sharding can get wrong.

Shapes are chosen so that most dim-0 sizes do not divide by 2, 3 or 4 (padding), some are smaller
than the world size, and the LM ties its embedding to its output projection. ConvNet brings
BatchNorm (buffers, batch-coupled statistics), FrozenMLP parameters that take no gradient, and
``build("hf_llama")`` a tiny transformers model when that package is installed. Every builder seeds
torch itself, so every rank and every reference builds identical weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

__all__ = [
    "MODEL_NAMES",
    "Block",
    "BufNet",
    "ConvNet",
    "FrozenMLP",
    "GPTConfig",
    "MLP",
    "Nested",
    "TinyLM",
    "SpikyMLP",
    "UnusedMLP",
    "build",
]


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
    tie_embeddings: bool = True  # the output projection is the token embedding's parameter


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
        # Activation checkpointing: keep no activations in forward, recompute them in backward.
        # Inside the block, so every FSDP sees the same module tree with or without it.
        self.checkpoint = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpoint and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(self._block, x, use_reentrant=False)
        return self._block(x)

    def _block(self, x: torch.Tensor) -> torch.Tensor:
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
    """A GPT-style decoder whose output projection is tied to the token embedding (unless
    ``cfg.tie_embeddings`` is False)."""

    def __init__(self, cfg: GPTConfig = GPTConfig()) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Parameter(torch.randn(cfg.seq_len, cfg.d_model) * 0.02)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
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


class ConvNet(nn.Module):
    """Conv + BatchNorm blocks and a linear classifier, on (batch, 3, 8, 8) images.

    BatchNorm normalizes with the statistics of the batch it sees, so the result depends on how
    the global batch is split across ranks, and its running statistics are buffers that no
    gradient reduction keeps in sync.
    """

    def __init__(self, channels: tuple[int, ...] = (3, 5, 7), num_classes: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            # No conv bias: BatchNorm subtracts the mean right after, so its exact gradient is 0
            # and what autograd returns is rounding noise, different under every reduction order.
            nn.Sequential(
                nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU()
            )
            for c_in, c_out in zip(channels[:-1], channels[1:])
        )
        self.head = nn.Linear(channels[-1], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=(2, 3)))  # global average pool: (batch, channels)


class FrozenMLP(nn.Module):
    """An MLP with a frozen first layer and a middle part that mixes frozen and trainable params."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(7, 13)
        self.mid = nn.Sequential(nn.Linear(13, 11), nn.Tanh(), nn.Linear(11, 13))
        self.head = nn.Linear(13, 3)
        self.stem.requires_grad_(False)  # a whole unit without gradients
        self.mid[0].weight.requires_grad_(False)  # one unit, trainable and frozen side by side

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.stem(x))
        return self.head(x + self.mid(x))


class BufNet(nn.Module):
    """An MLP whose hidden layer is scaled by a persistent float buffer: under
    MixedPrecision(buffer_dtype=...) the buffer computes in that dtype, and a state dict must
    still save it in its own (fp32) dtype. An integer buffer rides along, never cast."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(7, 13)
        self.fc2 = nn.Linear(13, 3)
        self.register_buffer("scale", torch.rand(13) + 0.5)  # persistent, float
        self.register_buffer("version", torch.tensor([3]))  # persistent, integer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)) * self.scale)


class UnusedMLP(nn.Module):
    """An MLP with a unit no forward uses (``spare``) and an unused parameter in a used unit
    (``fc2.spare_bias``): no rank computes a gradient for either, so both must keep grad None
    (DDP with find_unused_parameters=True)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(7, 13)
        self.fc2 = nn.Linear(13, 5)
        self.fc2.spare_bias = nn.Parameter(torch.randn(5) * 0.1)
        self.spare = nn.Linear(5, 5)
        self.fc3 = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class _SpikeGrad(torch.autograd.Function):
    """Identity on ``spike`` in forward; in backward, an inf in element 3 of its gradient when
    the batch was marked (SpikyMLP), wherever that element's rows live."""

    @staticmethod
    def forward(ctx, spike: torch.Tensor, marked: torch.Tensor) -> torch.Tensor:
        ctx.marked = bool(marked)
        return spike.view_as(spike)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.marked:
            grad = grad.clone()
            grad[3] = float("inf")
        return grad, None


class SpikyMLP(nn.Module):
    """An MLP with a 4-element parameter ``spike`` whose gradient gets an inf in element 3 when
    the batch carries a mark (an input above 1e3: zoo.py marks rank 0's at step 2).

    Sharded, element 3 lives on one rank only (rows 2-3 of 4 at 2 ranks), so only that rank's
    gradient scaler finds the inf: every rank must still skip the step together.
    """

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(7, 13)
        self.fc2 = nn.Linear(13, 3)
        self.spike = nn.Parameter(torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        marked = x.abs().amax() > 1e3
        y = self.fc2(torch.tanh(self.fc1(x.clamp(-10, 10))))
        return y + _SpikeGrad.apply(self.spike, marked).sum() * 0.0


def _build_hf_llama() -> nn.Module:
    """A tiny ``LlamaForCausalLM`` built from a config (no download); needs ``transformers``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=61,
        hidden_size=24,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = "eager"  # plain matmuls: the same kernels under every wrapper
    return LlamaForCausalLM(cfg)


# name -> builder; build() seeds first, so each builder may draw random numbers freely.
_BUILDERS = {
    "mlp": MLP,
    "lm": TinyLM,
    "lm_untied": lambda: TinyLM(GPTConfig(tie_embeddings=False)),
    "nested": Nested,
    "convnet": ConvNet,
    "frozen": FrozenMLP,
    "hf_llama": _build_hf_llama,
    "bufnet": BufNet,
    "unused": UnusedMLP,
    "spiky": SpikyMLP,
    # Wide enough that every embedding and MLP weight is at least 1 MiB per rank at 2 ranks in bf16:
    # DeepSpeed's NVMe offload never writes a smaller tensor to disk (swap_tensor MIN_AIO_BYTES).
    "wide_lm": lambda: TinyLM(
        GPTConfig(vocab_size=4099, d_model=256, d_ff=4096, tie_embeddings=False)
    ),
}
MODEL_NAMES = tuple(_BUILDERS)


def build(name: str, seed: int = 0) -> nn.Module:
    """Build a zoo model by name with fixed weights: one of ``MODEL_NAMES``.

    'mlp', 'lm' and 'nested' are the core engine's test models; 'lm_untied' is 'lm' without the
    tied head, 'convnet' has BatchNorm, 'frozen' has frozen parameters, 'hf_llama' needs the
    optional ``transformers`` package, and 'wide_lm' (6.8M parameters) is big enough for disk
    offload to write it.
    """
    if name not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}")
    torch.manual_seed(seed)
    return _BUILDERS[name]()
