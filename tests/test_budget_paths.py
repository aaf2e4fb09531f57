"""Every way a step can run over the budget either stays within it or raises a typed error first
(issue 31, item 4): gradient accumulation, a recompile after Dynamo's guards fail, a region first
compiled after the plan for the whole step was chosen, a backward run twice. (Sizes beyond the
planned maximum: tests/test_dynamic_shapes.py; inference calls: tests/test_inference.py; frames
Dynamo skips: tests/test_unplanned_frames.py; the first step of several regions:
tests/test_step_sweep.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import memcompile
from budget_helpers import compile_under
from models import WithLoss, build


def _keep_all_peak(module, x) -> int:
    backend, compiled = compile_under(module, 10**12)
    compiled(x).backward()
    torch.compiler.reset()
    module.zero_grad(set_to_none=True)
    x.grad = None
    return backend.plans[0].predicted_peak_before_bytes


def _measured(compiled, module, x, step=None) -> int:
    step = step or (lambda: compiled(x).backward())
    return memcompile.measure_peak(step, live_at_start=[module, x]).peak_bytes


def test_gradient_accumulation_counts_the_gradients_already_there():
    """Micro-steps without zero_grad start with the gradients of the last: a plan made for a step
    whose gradients appear in its backward would run over by their size. The call counts them:
    it re-plans for them or raises InfeasibleBudgetError, whose floor then holds."""
    torch.manual_seed(0)
    model, x = build("mlp", 256, 6, 512)
    module = WithLoss(model)
    budget = int(0.9 * _keep_all_peak(module, x))
    backend, compiled = compile_under(module, budget)
    module.zero_grad(set_to_none=True)
    assert _measured(compiled, module, x) <= budget  # no gradients yet: the plan as made
    with pytest.raises(memcompile.InfeasibleBudgetError, match="gradients this call's inputs already hold") as info:
        compiled(x)
    floor = info.value.min_feasible_bytes
    assert floor > budget
    torch.compiler.reset()
    backend, compiled = compile_under(module, floor)
    for _cycle in range(2):
        module.zero_grad(set_to_none=True)
        x.grad = None
        peaks = [_measured(compiled, module, x) for _micro in range(3)]
        assert all(peak <= floor for peak in peaks), peaks
    assert 1 < len(backend.plans) <= 3  # one plan without gradients there, one (or two) with
    torch.compiler.reset()


class Scaled(nn.Module):
    """A Python attribute Dynamo guards on: changing it recompiles the frame."""

    def __init__(self) -> None:
        super().__init__()
        self.model, _ = build("mlp", 128, 4, 256)
        self.scale = 1.0

    def forward(self, x):
        return (self.model(x) * self.scale).pow(2).mean()


def test_a_recompile_after_a_guard_fails_is_planned_within_the_budget():
    torch.manual_seed(0)
    module, x = Scaled(), torch.randn(256, 128, requires_grad=True)
    budget = int(0.9 * _keep_all_peak(module, x))
    backend, compiled = compile_under(module, budget)
    compiled(x).backward()
    peaks = []
    for scale in (1.0, 2.0, 2.0, 3.0):
        module.scale = scale
        module.zero_grad(set_to_none=True)
        x.grad = None
        compiled(x).backward()  # a new scale compiles a new graph, outside the measurement
        module.zero_grad(set_to_none=True)
        x.grad = None
        peaks.append(_measured(compiled, module, x))
    assert len(backend.plans) >= 2  # a new scale recompiled (Dynamo may turn the float into an input)
    assert all(peak <= budget for peak in peaks), (peaks, budget)
    torch.compiler.reset()


class GrowingChain(nn.Module):
    """Two blocks with a graph break between them; once `extra` is set, a third block after a
    second break, a region the step plan chosen before did not know."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(build("mlp", 128, 2, 256)[0] for _ in range(3))
        self.extra = False

    def forward(self, x):
        x = self.blocks[0](x)
        torch._dynamo.graph_break()
        x = self.blocks[1](x)
        if self.extra:
            torch._dynamo.graph_break()
            x = self.blocks[2](x)
        return x.pow(2).mean()


@pytest.mark.parametrize("fraction", [1.0, 0.8])
def test_a_region_compiled_after_the_step_plan_was_chosen_keeps_the_budget_or_raises_first(fraction):
    torch.manual_seed(0)
    module, x = GrowingChain(), torch.randn(256, 128, requires_grad=True)
    module.extra = True
    backend, compiled = compile_under(module, 10**12)
    for _ in range(3):
        compiled(x).backward()
    budget = int(fraction * backend.predicted_step_peak())
    torch.compiler.reset()
    module.extra = False
    backend, compiled = compile_under(module, budget)
    outcomes = []
    for step in range(7):
        module.extra = step >= 3
        module.zero_grad(set_to_none=True)
        x.grad = None
        try:
            outcomes.append(_measured(compiled, module, x))
        except memcompile.StepOverrunError as error:
            # raised before the call that would run over; the step run again fits
            assert error.needed_bytes > budget
            outcomes.append("overrun")
    assert all(o == "overrun" or o <= budget for o in outcomes), (outcomes, budget)
    assert outcomes.count("overrun") <= 1 and all(o != "overrun" for o in outcomes[-3:]), outcomes
    assert len(backend.ledger.footprints()) == 3
    torch.compiler.reset()


def test_a_second_backward_of_a_compiled_step_is_refused_by_torch():
    """backward(retain_graph=True) then backward() would hold every saved activation through
    both (a plan frees them as its backward reads them): AOTAutograd refuses it for graphs with
    donated buffers, before the second backward allocates anything."""
    torch.manual_seed(0)
    model, x = build("mlp", 128, 4, 256)
    module = WithLoss(model)
    backend, compiled = compile_under(module, int(0.9 * _keep_all_peak(module, x)))
    compiled(x).backward()
    module.zero_grad(set_to_none=True)
    x.grad = None
    loss = compiled(x)
    with pytest.raises(RuntimeError, match="retain_graph=False"):
        loss.backward(retain_graph=True)
    torch.compiler.reset()
