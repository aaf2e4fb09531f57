"""Tiny model definitions shared by the benchmarks (CPU-sized, deterministic from a seed)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        assert d_model % n_heads == 0, "d_model must be divisible by n_heads"
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, d_model: int, expansion: int = 4) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, expansion * d_model)
        self.out = nn.Linear(expansion * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A GPT-style stack on float inputs of shape (batch, seq, d_model) (no token embedding)."""

    def __init__(self, n_blocks: int, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_blocks))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def make_gpt(n_blocks: int = 8, d_model: int = 128, n_heads: int = 4, seed: int = 0) -> GPT:
    """A GPT stack with weights fixed by `seed` (same seed -> identical weights)."""
    gen_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = GPT(n_blocks, d_model, n_heads)
    finally:
        torch.random.set_rng_state(gen_state)
    return model


def make_input(batch: int, seq: int, d_model: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, seq, d_model, generator=g)


def make_target(batch: int, seq: int, d_model: int, seed: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, seq, d_model, generator=g) / math.sqrt(d_model)


class WithMSELoss(nn.Module):
    """model + MSE loss in one module, so the compiled graph holds the whole training step."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.model(x), target)
