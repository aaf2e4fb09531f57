"""Inference graphs (no_grad, inference_mode, eval with frozen parameters) compile as plain
Inductor / AOT graphs, with no plan: outputs equal eager, and the budget still holds: an
inference graph predicted over it raises InfeasibleBudgetError before it runs."""

from __future__ import annotations

import contextlib

import pytest
import torch

import memcompile
from budget_helpers import compile_under
from models import build


def _frozen(model):
    for p in model.parameters():
        p.requires_grad_(False)
    return contextlib.nullcontext()


MODES = {
    "no_grad": lambda model: torch.no_grad(),
    "inference_mode": lambda model: torch.inference_mode(),
    "eval_no_grad": lambda model: (model.eval(), torch.no_grad())[1],
    "frozen_parameters": _frozen,
}


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("arch", ["mlp", "convbn", "attention", "multi_output"])
def test_inference_compiles_without_a_plan_and_within_the_budget(arch, mode):
    model, x = build(arch, 16, 2, 4)
    x = x.detach()
    with MODES[mode](model):
        expected = model(x)
        backend, compiled = compile_under(model, "1GB")
        got = compiled(x)
        got_again = compiled(x)
        measured = memcompile.measure_peak(lambda: compiled(x), live_at_start=[model, x])
    assert backend.plans == [] and backend.errors == []
    for e, g, h in zip(*(t if isinstance(t, tuple) else (t,) for t in (expected, got, got_again))):
        assert not g.requires_grad
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(h, e, rtol=1e-5, atol=1e-6)
    # Under a budget just above what it measured it runs; far under, it raises before running.
    torch.compiler.reset()
    with MODES[mode](model):
        _, tight = compile_under(model, 1024)
        with pytest.raises(memcompile.InfeasibleBudgetError) as info:
            tight(x)
    assert info.value.min_feasible_bytes >= measured.peak_bytes > 1024
    torch.compiler.reset()
    with MODES[mode](model):
        backend, fits = compile_under(model, info.value.min_feasible_bytes)
        fits(x)  # compiles (outside the measurement)
        assert memcompile.measure_peak(lambda: fits(x), live_at_start=[model, x]).peak_bytes \
            <= info.value.min_feasible_bytes
    torch.compiler.reset()


def test_eval_mode_with_gradients_is_still_a_training_step():
    """model.eval() alone changes batch norm / dropout, not autograd: a backward still runs,
    so that graph is planned (and the budget applies)."""
    model, x = build("convbn", 8, 2, 4)
    model.eval()
    backend, compiled = compile_under(model, "1GB")
    compiled(x).sum().backward()
    assert len(backend.plans) == 1


@pytest.mark.inductor
def test_inference_through_inductor_has_no_plan():
    model, x = build("mlp", 16, 2, 4)
    x = x.detach()
    with torch.no_grad():
        backend, compiled = compile_under(model, "1GB", codegen="inductor")
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-6)
        measured = memcompile.measure_peak(lambda: compiled(x), live_at_start=[model, x])
    assert backend.plans == [] and backend.errors == []
    torch.compiler.reset()
    with torch.no_grad():
        _, tight = compile_under(model, measured.peak_bytes // 2, codegen="inductor")
        with pytest.raises(memcompile.InfeasibleBudgetError) as info:
            tight(x)
    assert info.value.min_feasible_bytes >= measured.peak_bytes
