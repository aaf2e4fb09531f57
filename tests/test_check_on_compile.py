"""The check rides on the compile that runs (issue 40): where PyTorch's default partition fits the
budget even counted in graph order with every value a buffer, it is compiled without a separate
lowering of a copy, and the schedule the compile builds checks it; so are PyTorch's other
partitions within the budget on their count, and solver plans both estimates put under it; where
that schedule is over the budget, or none was built (a cached compile), the region is planned
again with checks."""

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


def _measured_plain_peak(step, live) -> int:
    torch.compiler.reset()
    return memcompile.measure_peak(step, live_at_start=live).peak_bytes


@pytest.mark.inductor
def test_another_partition_within_the_budget_on_its_count_is_compiled_without_a_lowering(monkeypatch):
    """Where the default partition is over the budget, PyTorch's other partitions are made and
    the largest whose graph-order count is within the budget (less the margin) is compiled with
    no separate lowering, its compile's schedule checking it. (At unit scale their estimated
    recomputations are above STOCK_SOLVE_ABOVE of the step, where the solver plans instead: the
    bar is raised so that the rule itself is what is tested.)"""
    monkeypatch.setattr(planner, "STOCK_SOLVE_ABOVE", 10.0)
    model, x = build("attention", 32, 2, 16, seed=3)
    step = WithLoss(model)
    plain = torch.compile(step, backend="inductor")
    peak = _measured_plain_peak(lambda: plain(x).backward(), [model, x])
    budget = int(0.9 * peak)
    lowered, counted = [], []
    real_schedule, real_within = tp.inductor_schedule, planner.StockPartitions.within_on_graph_order
    monkeypatch.setattr(tp, "inductor_schedule", lambda *a, **k: lowered.append(a) or real_schedule(*a, **k))
    monkeypatch.setattr(planner.StockPartitions, "within_on_graph_order",
                        lambda self, *a, **k: counted.append(real_within(self, *a, **k)) or counted[-1])
    model.zero_grad(set_to_none=True)
    x.grad = None
    torch.compiler.reset()
    backend = memcompile.budget(budget, plan_store=False)
    with torch._inductor.config.patch(fx_graph_cache=False):
        compiled = torch.compile(step, backend=backend)
        compiled(x).backward()
        model.zero_grad(set_to_none=True)
        x.grad = None
        measured = memcompile.measure_peak(lambda: compiled(x).backward(), live_at_start=[model, x])
    (chosen,) = [c for c in counted if c is not None]
    assert not chosen.checked and chosen.solution.fraction < 1.0
    assert chosen.timeline.peak_bytes <= budget * (1 - planner._DEFER_MARGIN)
    assert lowered == []  # neither it nor the default partition was lowered to check it
    assert backend.deferred_checks_failed == 0
    (plan,) = backend.plans
    assert plan.solver_status == chosen.solution.status and plan.stock_inductor_rules
    # the compile's schedule replaced the count as the plan's peak
    assert plan.predicted_peak_bytes < chosen.timeline.peak_bytes
    assert measured.peak_bytes <= plan.predicted_peak_bytes <= budget


@pytest.mark.inductor
def test_a_solver_plan_both_estimates_fit_is_compiled_unchecked_and_its_schedule_checks_it(monkeypatch):
    """Llama small (benchmarks/hf_models.py) at 0.7x plain Inductor's peak: the solver's plan,
    which the calibrated model and the graph-order count scaled as keep-all's check scaled both
    put under the budget, is compiled without a separate check of its own graphs; the compiled
    schedule confirms it and the step runs within it."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import hf_models

    bench = hf_models.build("llama", "small")
    model, inputs = bench.module, list(bench.inputs)
    plain = torch.compile(model, backend="inductor")
    peak = _measured_plain_peak(lambda: plain(*inputs).backward(), [model, *inputs])
    budget = int(0.7 * peak)
    deferred, checked = [], []
    real_fit, real_check = planner.Replanner._fit_on_model, planner._rewrite_and_check
    monkeypatch.setattr(planner.Replanner, "_fit_on_model",
                        lambda self, *a: deferred.append(real_fit(self, *a)[0]) or (deferred[-1], 0.0))
    monkeypatch.setattr(planner, "_rewrite_and_check",
                        lambda j, a, solution, *r, **k: checked.append(solution.decisions) or real_check(j, a, solution, *r, **k))
    model.zero_grad(set_to_none=True)
    torch.compiler.reset()
    backend = memcompile.budget(budget, plan_store=False)
    with torch._inductor.config.patch(fx_graph_cache=False):
        compiled = torch.compile(model, backend=backend)
        compiled(*inputs).backward()
        model.zero_grad(set_to_none=True)
        measured = memcompile.measure_peak(lambda: compiled(*inputs).backward(), live_at_start=[model, *inputs])
    chosen = [a for a in deferred if a is not None]
    assert chosen and not chosen[-1].checked
    assert chosen[-1].solution.decisions not in checked  # its graphs were lowered only by the compile
    assert backend.deferred_checks_failed == 0
    plan = backend.plans[-1]
    assert plan.predicted_peak_before_bytes > plan.predicted_peak_bytes  # keep-all's check stays "before"
    assert measured.peak_bytes <= plan.predicted_peak_bytes <= budget


@pytest.mark.inductor
def test_a_solver_plan_is_checked_before_its_compile_where_the_scaled_count_is_over(monkeypatch):
    """A small attention stack where the calibrated model put the solver's plan 5% under its
    compiled schedule (on the model alone it was compiled, refused and planned again): the
    graph-order count scaled as keep-all's does not fit, so no plan is left to the compile's
    check, and the compile that runs needs no second try."""
    deferred = []
    real_fit = planner.Replanner._fit_on_model
    monkeypatch.setattr(planner.Replanner, "_fit_on_model",
                        lambda self, *a: deferred.append(real_fit(self, *a)) or deferred[-1])
    model, x = build("attention", 16, 2, 8, seed=3)
    backend = memcompile.budget(88_290, time_limit_s=2, plan_store=False)
    with torch._inductor.config.patch(fx_graph_cache=False):
        compiled = torch.compile(WithLoss(model), backend=backend)
        compiled(x).backward()
        model.zero_grad(set_to_none=True)
        x.grad = None
        measured = memcompile.measure_peak(lambda: compiled(x).backward(), live_at_start=[model, x])
    assert deferred and all(attempt is None for attempt, _ in deferred)
    assert backend.deferred_checks_failed == 0
    plan = backend.plans[-1]
    assert measured.peak_bytes <= plan.predicted_peak_bytes <= 88_290


@pytest.mark.inductor
def test_the_default_partition_over_on_its_count_is_checked_once_as_plain_inductor_compiles_it(monkeypatch):
    """Where the default partition's graph-order count is over the budget and no partition is
    within it on its count, the partitions are checked from the default one (its count near the
    budget), as plain Inductor compiles it: where that fits, it is the plan, after that one
    lowering and none under other rules; its check, not its count, is the plan's "before"."""
    model, x = build("attention", 32, 2, 16, seed=3)
    step = WithLoss(model)
    backend = memcompile.Backend(memcompile.make_options(10**9))
    backend.plan_only = True
    with pytest.raises(memcompile.errors.PlannedOnly) as planned:
        torch.compile(step, backend=backend)(x).backward()
    torch._dynamo.reset()
    budget = planned.value.plan.predicted_peak_bytes  # the default partition's check: it just fits
    counts = []
    real_plain = planner._plain_inductor_partition
    monkeypatch.setattr(planner, "_plain_inductor_partition",
                        lambda *a, **k: counts.append(real_plain(*a, **k)) or counts[-1])
    monkeypatch.setattr(planner.StockPartitions, "within_on_graph_order", lambda self, *a, **k: None)
    lowered = []
    real_schedule = tp.inductor_schedule
    monkeypatch.setattr(tp, "inductor_schedule", lambda *a, **k: lowered.append(a) or real_schedule(*a, **k))
    model.zero_grad(set_to_none=True)
    x.grad = None
    backend = memcompile.budget(budget, plan_store=False)
    with torch._inductor.config.patch(fx_graph_cache=False):
        compiled = torch.compile(step, backend=backend)
        compiled(x).backward()
        assert len(lowered) == 2  # one lowering (forward and backward) before the compile's own
        model.zero_grad(set_to_none=True)
        x.grad = None
        measured = memcompile.measure_peak(lambda: compiled(x).backward(), live_at_start=[model, x])
    (count,) = counts
    assert not count.checked and count.timeline.peak_bytes > budget  # over on its count
    plan = backend.plans[-1]
    assert plan.solver_status == planner.StockSolution(1.0, 0.0, 0, ()).status and plan.stock_inductor_rules
    assert plan.predicted_peak_before_bytes == plan.predicted_peak_bytes == budget
    assert measured.peak_bytes <= budget
