"""Per-block compilation, as torchtitan does it: each transformer block is compiled on its own.

    python examples/per_block.py [--codegen inductor|aot_eager]

torchtitan compiles `model.layers[i]` one by one with the backend named in its config
(`--compile.backend`), so the backend is used by name here; the budget comes from `options` (or
`MEMCOMPILE_BUDGET` when a launcher can only pass the name). All blocks compiled with equal
options share one memcompile Backend (`memcompile.named_backend(options)`), whose `plans` hold one
plan per distinct graph (blocks of equal shapes may reuse one compiled graph).

The budget is meant for the whole step: the step ledger plans each block with what the other
blocks hold. It plans them greedily in call order, so at budgets below the uncompiled peak the
early blocks keep activations the last one needs room for, and it raises InfeasibleBudgetError
(here at 0.75 and 0.9 of the eager peak) where a joint plan across blocks could fit: a known
limitation until the ledger plans all regions of a step together.
"""

from __future__ import annotations

import argparse
import copy
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import memcompile


class Block(nn.Module):
    """Pre-norm transformer block (causal attention + MLP)."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        x = x + self.proj(attn)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Transformer(nn.Module):
    def __init__(self, d: int, heads: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): Block(d, heads) for i in range(depth)})  # torchtitan's layout
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return F.mse_loss(self.norm(x), target)


def compile_blocks(model: Transformer, options: dict) -> None:
    """torchtitan's apply_compile: each block replaced by its compiled self, same backend."""
    for name, block in model.layers.named_children():
        model.layers.register_module(name, torch.compile(block, backend="memcompile", options=dict(options),
                                                         fullgraph=True))


@dataclass(frozen=True)
class PerBlockResult:
    budget_bytes: int
    eager_peak_bytes: int
    compiled_peak_bytes: int
    eager_grads: tuple[torch.Tensor, ...]
    compiled_grads: tuple[torch.Tensor, ...]
    plans: tuple[memcompile.Plan, ...]


def step(model, x, target) -> None:
    model(x, target).backward()


def measured_step(model, x, target) -> int:
    model.zero_grad(set_to_none=True)
    return memcompile.measure_peak(step, model, x, target, live_at_start=[model, x, target]).peak_bytes


def run(d: int = 64, heads: int = 4, depth: int = 4, batch: int = 4, seq: int = 64,
        budget_fraction: float = 0.75, codegen: str = "inductor", time_limit_s: float = 10.0) -> PerBlockResult:
    torch.manual_seed(0)
    eager = Transformer(d, heads, depth)
    model = copy.deepcopy(eager)
    gen = torch.Generator().manual_seed(1)
    x, target = torch.randn(batch, seq, d, generator=gen), torch.randn(batch, seq, d, generator=gen)

    eager_peak = measured_step(eager, x, target)
    budget = math.floor(budget_fraction * eager_peak)
    options = {"budget": budget, "codegen": codegen, "time_limit_s": time_limit_s}
    compile_blocks(model, options)
    model.zero_grad(set_to_none=True)
    step(model, x, target)  # compiles
    peak = measured_step(model, x, target)
    return PerBlockResult(
        budget, eager_peak, peak,
        tuple(p.grad.clone() for p in eager.parameters()), tuple(p.grad.clone() for p in model.parameters()),
        tuple(memcompile.named_backend(options).plans),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--codegen", default="inductor", choices=["inductor", "aot_eager"])
    args = parser.parse_args()
    r = run(codegen=args.codegen)
    worst = max((a - b).abs().max().item() for a, b in zip(r.eager_grads, r.compiled_grads))
    print(f"budget {r.budget_bytes:,} B; eager step peak {r.eager_peak_bytes:,} B; "
          f"per-block memcompile step peak {r.compiled_peak_bytes:,} B "
          f"({'within' if r.compiled_peak_bytes <= r.budget_bytes else 'OVER'} the budget)")
    print(f"{len(r.plans)} plan(s), predicted peaks "
          f"{[p.predicted_peak_bytes for p in r.plans]}; largest |grad - eager grad| = {worst:.2e}")
    print(memcompile.dump(list(r.plans)))


if __name__ == "__main__":
    main()
