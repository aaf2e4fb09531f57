"""Same graph + same budget + same options -> the same plan, solved once per process."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

import memcompile
from memcompile import plan_cache
from memcompile.solver.activations import ActivationProblem
from models import Attention, WithLoss, build


def _clear(model, x) -> None:
    """Plain steps: gradients left by one would count as accumulated in the next."""
    model.zero_grad(set_to_none=True)
    x.grad = None


def _mid_budget(model, x) -> int:
    backend = memcompile.budget(10**12, codegen="aot_eager", time_limit_s=2)
    torch.compile(WithLoss(model), backend=backend)(x).backward()
    _clear(model, x)
    high = backend.plans[0].predicted_peak_before_bytes + backend.plans[0].reserve_bytes
    torch.compiler.reset()
    try:
        torch.compile(WithLoss(model), backend=memcompile.budget(1, codegen="aot_eager", time_limit_s=2))(x)
    except memcompile.InfeasibleBudgetError as error:
        low = error.min_feasible_bytes
    torch.compiler.reset()
    return (low + high) // 2


def _compile_once(model, x, budget, **options):
    backend = memcompile.budget(budget, codegen="aot_eager", time_limit_s=2, **options)
    torch.compile(WithLoss(model), backend=backend)(x).backward()
    _clear(model, x)
    torch.compiler.reset()
    return backend.plans[0]


def _same_plan(a, b) -> None:
    assert a.decisions == b.decisions
    assert a.predicted_peak_bytes == b.predicted_peak_bytes
    assert a.live_bytes_after == b.live_bytes_after


def test_recompiling_after_reset_gives_the_same_plan_without_solving():
    model, x = build("attention", 16, 3, 8)
    budget = _mid_budget(model, x)
    plan_cache.clear()
    first = _compile_once(model, x, budget)
    assert first.decisions and any(d.choice == "recompute" for d in first.decisions)
    misses = plan_cache.stats()["misses"]
    assert misses >= 1
    second = _compile_once(model, x, budget)
    _same_plan(first, second)
    assert plan_cache.stats()["misses"] == misses  # nothing solved again
    assert plan_cache.stats()["hits"] >= 1


def test_cache_key_separates_budget_and_options():
    model, x = build("mlp", 32, 3, 64)
    budget = _mid_budget(model, x)
    plan_cache.clear()
    _compile_once(model, x, budget)
    solved = plan_cache.stats()["misses"]
    _compile_once(model, x, budget - 4096)  # another budget: solved again
    assert plan_cache.stats()["misses"] > solved
    solved = plan_cache.stats()["misses"]
    _compile_once(model, x, budget, seed=1)  # another seed: solved again
    assert plan_cache.stats()["misses"] > solved


def test_identical_blocks_compiled_one_by_one_are_solved_once():
    """Per-block compilation: eight compiles of structurally identical blocks (different weights,
    different node names after re-tracing) share one solve per distinct budget they see."""
    torch.manual_seed(0)
    blocks = nn.ModuleList(Attention(16, 2) for _ in range(3))
    x = torch.randn(8, 8, 16, requires_grad=True)
    plan_cache.clear()
    budget = _mid_budget(blocks[0], x)
    plan_cache.clear()
    plans = [_compile_once(block, x, budget) for block in blocks]  # same problem each time
    stats = plan_cache.stats()
    assert any(d.choice == "recompute" for d in plans[0].decisions)
    assert stats["misses"] >= 1 and stats["hits"] >= 2 * stats["misses"], stats
    for plan in plans[1:]:
        _same_plan(plans[0], plan)


def test_problem_text_ignores_node_names_only():
    problem = ActivationProblem(
        names=("a", "b"), nbytes=(8, 16), recompute_cost_s=(1e-6, 2e-6), can_keep=(True, True),
        can_recompute=(True, True), first_read=(3, 4), last_read=(4, 5), keep_from=(2, 2),
        recompute_from=(3, 3), recompute_reads=((), (0,)), view_of=(-1, -1), fixed_bytes=(10, 10, 10, 10, 10, 10))
    renamed = dataclasses.replace(problem, names=("x", "y"))
    bigger = dataclasses.replace(problem, nbytes=(8, 32))
    assert plan_cache.problem_text(problem) == plan_cache.problem_text(renamed)
    assert plan_cache.problem_text(problem) != plan_cache.problem_text(bigger)


def test_solver_without_cache_is_repeatable_when_it_proves_optimality():
    """Where CP-SAT proves optimality on a small graph, two solves agree even without the cache
    (with a wall-clock limit it may not: docs/design.md)."""
    model, x = build("mlp", 32, 2, 64)
    budget = _mid_budget(model, x)
    with plan_cache.disabled():
        first = _compile_once(model, x, budget, workers=1)
        second = _compile_once(model, x, budget, workers=1)
    if first.solver_status in ("optimal", "fits") and second.solver_status == first.solver_status:
        _same_plan(first, second)
    assert first.predicted_peak_bytes <= first.step_budget_bytes and second.predicted_peak_bytes <= second.step_budget_bytes
