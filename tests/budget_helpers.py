"""Helpers shared by the robustness tests: compile a step under a budget, find a model's
budget range, run one measured step, collect gradients."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pytest
import torch

import memcompile


def compile_under(module: torch.nn.Module, limit, **options) -> tuple[memcompile.Backend, Callable]:
    """`module` (which returns the loss) compiled with memcompile, FX-interpreter codegen."""
    options.setdefault("codegen", "aot_eager")
    options.setdefault("time_limit_s", 5)
    backend = memcompile.budget(limit, **options)
    return backend, torch.compile(module, backend=backend)


def grads(params: list[torch.Tensor], step: Callable[[], torch.Tensor], seed: int | None = None) -> list[torch.Tensor]:
    """Gradients of `params` after one `step().backward()`, seeded when `seed` is given."""
    for p in params:
        p.grad = None
    if seed is not None:
        torch.manual_seed(seed)
    step().backward()
    got = [p.grad.clone() for p in params]
    for p in params:  # the next step starts without them, as a training step does after zero_grad
        p.grad = None
    return got


def budget_range(module: torch.nn.Module, x: torch.Tensor, **options) -> tuple[int, int]:
    """(min_feasible_bytes, the budget that keeps every activation: its predicted peak and the
    reserve) of `module(x)`."""
    backend, compiled = compile_under(module, 10**12, **options)
    compiled(x).backward()
    high = backend.plans[0].predicted_peak_before_bytes + backend.plans[0].reserve_bytes
    torch.compiler.reset()
    # A plain step's floor: gradients left from this step would count as accumulated ones.
    module.zero_grad(set_to_none=True)
    x.grad = None
    _, compiled = compile_under(module, 1, **options)
    with pytest.raises(memcompile.InfeasibleBudgetError) as info:
        compiled(x)
    torch.compiler.reset()
    return info.value.min_feasible_bytes, high


@dataclass(frozen=True)
class Step:
    plan: memcompile.Plan
    measured_peak_bytes: int
    grads: list[torch.Tensor]


def run_step(module: torch.nn.Module, x: torch.Tensor, params: list[torch.Tensor], limit,
             seed: int | None = None, **options) -> Step:
    """Compile under `limit`, run one warm-up step, then one measured step (seeded)."""
    backend, compiled = compile_under(module, limit, **options)
    try:
        # Plain steps: gradients already there (of the input too) would count as accumulated.
        module.zero_grad(set_to_none=True)
        x.grad = None
        grads(params, lambda: compiled(x), seed)
        module.zero_grad(set_to_none=True)
        x.grad = None
        for p in params:
            p.grad = None
        if seed is not None:
            torch.manual_seed(seed)
        measured = memcompile.measure_peak(lambda: compiled(x).backward(), live_at_start=[module, x])
    finally:
        torch.compiler.reset()
    return Step(backend.plans[0], measured.peak_bytes, [p.grad.clone() for p in params])


def assert_within_budget(step: Step, budget: int) -> None:
    assert step.plan.predicted_peak_bytes <= budget
    assert step.measured_peak_bytes <= budget, f"measured {step.measured_peak_bytes} > budget {budget}"


def spy_analyses(monkeypatch) -> list:
    """Record every JointAnalysis the planner makes (returned list fills as models compile)."""
    from memcompile import planner

    seen = []
    original = planner.analyze_joint_graph

    def spy(*args, **kwargs):
        seen.append(original(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(planner, "analyze_joint_graph", spy)
    return seen


def with_threads(threads: int, check: Callable[[], None]) -> None:
    """Run `check` with torch's intra-op thread count set to `threads` (restored after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        check()
    finally:
        torch.set_num_threads(before)
