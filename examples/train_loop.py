"""A plain PyTorch training loop under a device budget, with AdamW's state reserved (`optimizer=`).

    python examples/train_loop.py [--codegen inductor|aot_eager] [--steps 3]

The budget is what the whole device may hold. The compiled step (parameters, gradients,
activations, temporaries) gets the budget minus the reserve; AdamW's two moment buffers per
parameter live outside the step, so they are the reserve: `memcompile.budget(..., optimizer=opt)`
counts them (before the first step, from the algorithm). The script trains an eager copy and a
memcompile copy on the same batches, prints both losses and the measured peak of every compiled
iteration (forward + backward + optimizer step, with the optimizer state counted as
live) against the budget.
"""

from __future__ import annotations

import argparse
import copy
from dataclasses import dataclass

import torch
from torch import nn

import memcompile


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Regressor(nn.Module):
    """Residual MLP blocks with the loss inside forward, so the whole step is one compiled graph."""

    def __init__(self, d: int, depth: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block(d) for _ in range(depth)))

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.blocks(x), target)


@dataclass(frozen=True)
class LoopResult:
    budget_bytes: int
    reserve_bytes: int  # AdamW state, measured after the first step created it
    eager_losses: tuple[float, ...]
    compiled_losses: tuple[float, ...]
    eager_first_grads: tuple[torch.Tensor, ...]
    compiled_first_grads: tuple[torch.Tensor, ...]
    eager_peak_bytes: int  # one eager iteration, same accounting
    compiled_peak_bytes: tuple[int, ...]  # every compiled iteration after the first (compiling) one
    plans: tuple[memcompile.Plan, ...]


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(t.untyped_storage().nbytes() for s in optimizer.state.values() for t in s.values()
               if isinstance(t, torch.Tensor))


def adamw_state_bytes(model: nn.Module) -> int:
    """What AdamW will hold: exp_avg and exp_avg_sq per parameter, plus a scalar step each."""
    return sum(2 * p.nbytes + 4 for p in model.parameters())


def batches(steps: int, batch: int, seq: int, d: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, seq, d, generator=gen), torch.randn(batch, seq, d, generator=gen))
            for _ in range(steps)]


def iteration(model, step_fn, optimizer, x, target) -> torch.Tensor:
    loss = step_fn(x, target)
    loss.backward()
    optimizer.step()
    return loss.detach()


def measured_iteration(model, step_fn, optimizer, x, target):
    # Gradients are dropped before the measurement starts: frees of tensors allocated before it
    # are invisible to the CPU profiler, so they would count twice.
    optimizer.zero_grad(set_to_none=True)
    live = [model, x, target] + [t for s in optimizer.state.values() for t in s.values()]
    return memcompile.measure_peak(iteration, model, step_fn, optimizer, x, target, live_at_start=live)


def run(d: int = 64, depth: int = 8, batch: int = 8, seq: int = 64, steps: int = 3,
        budget_fraction: float = 0.7, codegen: str = "inductor", time_limit_s: float = 10.0) -> LoopResult:
    torch.manual_seed(0)
    eager_model = Regressor(d, depth)
    model = copy.deepcopy(eager_model)
    data = batches(steps, batch, seq, d)

    eager_opt = torch.optim.AdamW(eager_model.parameters(), lr=1e-2, foreach=False)
    eager_losses, eager_grads, eager_peak = [], (), 0
    for i, (x, target) in enumerate(data):
        m = measured_iteration(eager_model, eager_model, eager_opt, x, target)
        eager_losses.append(m.result.item())
        eager_peak = max(eager_peak, m.peak_bytes)
        if i == 0:
            eager_grads = tuple(p.grad.clone() for p in eager_model.parameters())

    # The device budget: AdamW's state plus a step budget below what eager needs for the step,
    # so that memcompile has to recompute activations to fit.
    reserve = adamw_state_bytes(model)
    budget = reserve + int(budget_fraction * (eager_peak - reserve))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    backend = memcompile.budget(budget, optimizer=optimizer, codegen=codegen, time_limit_s=time_limit_s)
    compiled = torch.compile(model, backend=backend)

    losses, grads, peaks = [], (), []
    for i, (x, target) in enumerate(data):
        if i == 0:  # compiles; the optimizer state appears in this iteration
            optimizer.zero_grad(set_to_none=True)
            losses.append(iteration(model, compiled, optimizer, x, target).item())
            grads = tuple(p.grad.clone() for p in model.parameters())
            assert state_bytes(optimizer) <= reserve, "the reserve must cover the optimizer state"
            continue
        m = measured_iteration(model, compiled, optimizer, x, target)
        losses.append(m.result.item())
        peaks.append(m.peak_bytes)
    return LoopResult(budget, reserve, tuple(eager_losses), tuple(losses), eager_grads, grads, eager_peak,
                      tuple(peaks), tuple(backend.plans))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--codegen", default="inductor", choices=["inductor", "aot_eager"])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    r = run(steps=args.steps, codegen=args.codegen)
    print(f"budget {r.budget_bytes:,} B = AdamW state (reserve) {r.reserve_bytes:,} B + step "
          f"{r.budget_bytes - r.reserve_bytes:,} B")
    print(f"eager iteration peak {r.eager_peak_bytes:,} B; memcompile iteration peaks "
          f"{', '.join(f'{p:,}' for p in r.compiled_peak_bytes)} B (<= budget: "
          f"{all(p <= r.budget_bytes for p in r.compiled_peak_bytes)})")
    print(f"losses eager    {[round(v, 6) for v in r.eager_losses]}")
    print(f"losses compiled {[round(v, 6) for v in r.compiled_losses]}")
    print(memcompile.dump(list(r.plans)))


if __name__ == "__main__":
    main()
