"""Small models of the architectures the property tests draw from."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, d: int, depth: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class ConvBN(nn.Module):
    def __init__(self, channels: int, depth: int):
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(channels, channels, 3, padding=1) for _ in range(depth))
        self.norms = nn.ModuleList(nn.BatchNorm2d(channels) for _ in range(depth))

    def forward(self, x):
        for conv, norm in zip(self.convs, self.norms):
            x = F.relu(norm(conv(x))) + x
        return x


class Attention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm(x)).split(d, dim=-1)
        q, k, v = (t.reshape(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / (d // self.heads) ** 0.5
        out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, d)
        x = x + self.proj(out)
        return x + self.mlp(x)


class AttentionStack(nn.Module):
    def __init__(self, d: int, heads: int, depth: int):
        super().__init__()
        self.blocks = nn.ModuleList(Attention(d, heads) for _ in range(depth))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class MultiOutputViews(nn.Module):
    """Two outputs, a non-contiguous view (transpose) and a slice feeding the backward."""

    def __init__(self, d: int):
        super().__init__()
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d)

    def forward(self, x):
        h = torch.sigmoid(self.a(x))
        t = h.t()  # non-contiguous view
        y = self.b((t * 2).t().contiguous())
        return y, h[:, : h.shape[1] // 2].exp()


def build(arch: str, size: int, depth: int, batch: int, dtype=torch.float32, seed: int = 0):
    """(model, input) for an architecture name; sizes kept small for the CPU."""
    torch.manual_seed(seed)
    if arch == "mlp":
        model, x = MLP(size, depth), torch.randn(batch, size)
    elif arch == "convbn":
        model, x = ConvBN(4, depth), torch.randn(batch, 4, size, size)
    elif arch == "attention":
        model, x = AttentionStack(size, 2, depth), torch.randn(batch, 8, size)
    elif arch == "multi_output":
        model, x = MultiOutputViews(size), torch.randn(batch, size)
    else:
        raise ValueError(arch)
    model = model.to(dtype)
    return model, x.to(dtype).requires_grad_(True)


def loss_of(out):
    if isinstance(out, tuple):
        return sum(o.float().pow(2).mean() for o in out)
    return out.float().pow(2).mean()


class WithLoss(nn.Module):
    """The loss inside the compiled graph, so the whole step is under the budget."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        return loss_of(self.model(x))
