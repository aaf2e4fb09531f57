"""The check rides on the compile that runs (issue 40): where PyTorch's default partition fits the
budget even counted in graph order with every value a buffer, it is compiled without a separate
lowering of a copy, and the schedule the compile builds checks it; where that schedule is over the
budget, or none was built (a cached compile), the region is planned again with checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import memcompile
from models import WithLoss, build
from memcompile import _torch_private as tp
from memcompile import backend as backend_module
from memcompile import planner
from memcompile.cost_models.cuda_allocator import EXACT


def _model(arch: str = "mlp") -> tuple[nn.Module, torch.Tensor]:
    """A model whose output is the loss; the attention stack's plan peaks at the attention
    backward, where the wrapper's buffer reuse decides the peak (Inductor's own rule there)."""
    if arch == "attention":
        model, x = build("attention", 32, 2, 16)
        return WithLoss(model), x
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 8))
    return model, torch.randn(128, 64)


def _step(model: nn.Module, x: torch.Tensor, backend) -> None:
    model.zero_grad(set_to_none=True)
    torch.compile(model, backend=backend)(x).sum().backward()


def _planned_with_checks(budget: int, arch: str) -> memcompile.Plan:
    """The plan as a separate check makes it (plan-only compiles never defer the check)."""
    backend = memcompile.Backend(memcompile.make_options(budget))
    backend.plan_only = True
    model, x = _model(arch)
    with pytest.raises(memcompile.errors.PlannedOnly) as planned:
        _step(model, x, backend)
    torch._dynamo.reset()
    return planned.value.plan


@pytest.mark.inductor
@pytest.mark.parametrize("arch", ["mlp", "attention"])
def test_a_loose_budget_compiles_pytorchs_partition_once_and_its_schedule_checks_it(monkeypatch, arch):
    budget = 4_000_000
    checked = _planned_with_checks(budget, arch)
    lowered = []
    real_schedule = tp.inductor_schedule
    monkeypatch.setattr(tp, "inductor_schedule", lambda *a, **k: lowered.append(a) or real_schedule(*a, **k))
    model, x = _model(arch)
    backend = memcompile.budget(budget)
    with torch._inductor.config.patch(fx_graph_cache=False):  # a cached compile lowers nothing
        compiled = torch.compile(model, backend=backend)
        compiled(x).sum().backward()
        model.zero_grad(set_to_none=True)
        x.grad = None  # plain steps: a gradient already there would be an accumulated one
        measured = memcompile.measure_peak(lambda: compiled(x).sum().backward(), live_at_start=[model, x])
    assert lowered == []  # no copy of the graphs was lowered to check them
    assert backend.deferred_checks_failed == 0
    (plan,) = backend.plans
    assert plan.solver_status.startswith("stock_partition") and plan.stock_inductor_rules
    # the compiled schedule's liveness is the separate check's, step by step
    assert plan.predicted_peak_bytes == checked.predicted_peak_bytes
    assert plan.live_bytes_after == checked.live_bytes_after
    assert measured.peak_bytes <= plan.predicted_peak_bytes <= budget


@pytest.mark.inductor
def test_a_plan_its_compiled_schedule_does_not_confirm_is_planned_again_with_checks(monkeypatch):
    refused = []

    def refuse_once(deferred, schedules, plan):
        if not refused:
            refused.append(plan)
            return None
        return planner.confirm_on_compile(deferred, schedules, plan)

    monkeypatch.setattr(backend_module, "confirm_on_compile", refuse_once)
    budget = 4_000_000
    model, x = _model()
    backend = memcompile.budget(budget)
    with torch._inductor.config.patch(fx_graph_cache=False):
        compiled = torch.compile(model, backend=backend)
        compiled(x).sum().backward()
        model.zero_grad(set_to_none=True)
        x.grad = None  # plain steps: a gradient already there would be an accumulated one
        measured = memcompile.measure_peak(lambda: compiled(x).sum().backward(), live_at_start=[model, x])
    assert len(refused) == 1 and backend.deferred_checks_failed == 1
    (plan,) = backend.plans  # the refused plan is not listed
    assert plan is not refused[0] and plan.check_s > 0  # planned again, with a separate check
    assert measured.peak_bytes <= plan.predicted_peak_bytes <= budget


def test_without_the_compiles_schedules_nothing_is_confirmed():
    deferred = planner.DeferredCheck(num_fwd_outputs=1, rounding=EXACT, boundary_bytes=0, budget_bytes=10**9)
    assert planner.confirm_on_compile(deferred, [], plan=None) is None
