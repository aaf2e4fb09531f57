"""Per-block compilation, as torchtitan does it: each transformer block is compiled on its own.

    python examples/per_block.py [--codegen inductor|aot_eager] [--fraction 0.8] [--steps 3]

torchtitan compiles `model.layers[i]` one by one with the backend named in its config
(`--compile.backend`), so the backend is used by name here; the budget comes from `options` (or
`MEMCOMPILE_BUDGET` when a launcher can only pass the name). All blocks compiled with equal
options share one memcompile Backend (`memcompile.named_backend(options)`), whose `plans` hold one
plan per distinct graph (blocks of equal shapes may reuse one compiled graph).

The budget is meant for the whole step. After the first step the backend knows every block
call of the step and chooses one plan per compiled graph for all of them together (identical
blocks share a graph, hence a plan): the least added time with every call's peak, plus what the
other calls hold then, within the budget (memcompile/joint_plan.py). In the first step every
block (called with the embedding's activations) runs its least-peak plan, and every call is
checked against what the step holds before it runs. Code between compiled regions runs eagerly and
is not seen by memcompile: torchtitan leaves the output norm and the loss uncompiled, whose
temporaries would come on top of the budget, so here that head is compiled with the same
backend too (or pass its bytes as `reserve`).
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


class Head(nn.Module):
    """Output norm and loss."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.norm(x), target)


class Transformer(nn.Module):
    def __init__(self, d: int, heads: int, depth: int) -> None:
        super().__init__()
        self.embed = nn.Linear(d, d)  # the input projection (torchtitan: the token embedding)
        self.layers = nn.ModuleDict({str(i): Block(d, heads) for i in range(depth)})  # torchtitan's layout
        self.head = Head(d)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers.values():
            x = layer(x)
        return self.head(x, target)


def compile_blocks(model: Transformer, options: dict) -> None:
    """torchtitan's apply_compile: each block replaced by its compiled self, same backend; and
    the input projection and the head, so that no eager code holds memory the budget does not know of."""
    for name, block in model.layers.named_children():
        model.layers.register_module(name, torch.compile(block, backend="memcompile", options=dict(options),
                                                         fullgraph=True))
    model.embed = torch.compile(model.embed, backend="memcompile", options=dict(options), fullgraph=True)
    model.head = torch.compile(model.head, backend="memcompile", options=dict(options), fullgraph=True)


@dataclass(frozen=True)
class PerBlockResult:
    budget_bytes: int
    eager_peak_bytes: int
    compiled_peak_bytes: int  # the last step's
    eager_grads: tuple[torch.Tensor, ...]
    compiled_grads: tuple[torch.Tensor, ...]  # of the last step
    plans: tuple[memcompile.Plan, ...]
    step_peaks_bytes: tuple[int, ...]  # measured, steps 2.. (the first step compiles)
    compiles_per_step: tuple[int, ...]  # graphs compiled during each step, from the first
    predicted_step_peak_bytes: int


def step(model, x, target) -> None:
    model(x, target).backward()


def measured_step(model, x, target) -> int:
    model.zero_grad(set_to_none=True)
    return memcompile.measure_peak(step, model, x, target, live_at_start=[model, x, target]).peak_bytes


def run(d: int = 64, heads: int = 4, depth: int = 4, batch: int = 4, seq: int = 64,
        budget_fraction: float = 0.8, codegen: str = "inductor", time_limit_s: float = 10.0,
        steps: int = 3, budget_bytes: int | None = None) -> PerBlockResult:
    """Eager step, then `steps` compiled steps under `budget_fraction` of the eager step's peak
    (or exactly `budget_bytes`)."""
    torch.manual_seed(0)
    eager = Transformer(d, heads, depth)
    model = copy.deepcopy(eager)
    gen = torch.Generator().manual_seed(1)
    x, target = torch.randn(batch, seq, d, generator=gen), torch.randn(batch, seq, d, generator=gen)

    eager_peak = measured_step(eager, x, target)
    budget = math.floor(budget_fraction * eager_peak) if budget_bytes is None else budget_bytes
    options = {"budget": budget, "codegen": codegen, "time_limit_s": time_limit_s}
    compile_blocks(model, options)
    backend = memcompile.named_backend(options)
    model.zero_grad(set_to_none=True)
    step(model, x, target)  # compiles (its peak includes compile-time allocations: not measured)
    compiles, peaks = [backend.compiles], []
    for _ in range(steps - 1):
        before = backend.compiles
        peaks.append(measured_step(model, x, target))
        compiles.append(backend.compiles - before)
    return PerBlockResult(
        budget, eager_peak, peaks[-1],
        tuple(p.grad.clone() for p in eager.parameters()), tuple(p.grad.clone() for p in model.parameters()),
        tuple(backend.plans), tuple(peaks), tuple(compiles), backend.predicted_step_peak(),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--codegen", default="inductor", choices=["inductor", "aot_eager"])
    parser.add_argument("--fraction", type=float, default=0.8, help="budget as a fraction of the eager step peak")
    parser.add_argument("--steps", type=int, default=3, help="training steps (>= 2; the first compiles)")
    args = parser.parse_args()
    r = run(codegen=args.codegen, budget_fraction=args.fraction, steps=max(2, args.steps))
    worst = max((a - b).abs().max().item() for a, b in zip(r.eager_grads, r.compiled_grads))
    print(f"budget {r.budget_bytes:,} B; eager step peak {r.eager_peak_bytes:,} B; "
          f"per-block memcompile step peaks {', '.join(f'{p:,}' for p in r.step_peaks_bytes)} B (steps 2..) "
          f"({'within' if max(r.step_peaks_bytes) <= r.budget_bytes else 'OVER'} the budget; "
          f"predicted {r.predicted_step_peak_bytes:,} B)")
    print(f"graphs compiled per step: {list(r.compiles_per_step)}")
    print(f"{len(r.plans)} plan(s), predicted peaks "
          f"{[p.predicted_peak_bytes for p in r.plans]}; largest |grad - eager grad| = {worst:.2e}")
    print(memcompile.dump(list(r.plans)))


if __name__ == "__main__":
    main()
