"""Inference graphs (no_grad, inference_mode, eval with frozen parameters) compile as plain
Inductor / AOT graphs: no plan, no error (whatever the budget), outputs equal eager."""

from __future__ import annotations

import contextlib

import pytest
import torch

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
def test_inference_compiles_without_a_plan_whatever_the_budget(arch, mode):
    model, x = build(arch, 16, 2, 4)
    x = x.detach()
    with MODES[mode](model):
        expected = model(x)
        backend, compiled = compile_under(model, 1)  # a budget no training step could meet
        got = compiled(x)
        got_again = compiled(x)
    assert backend.plans == [] and backend.errors == []
    for e, g, h in zip(*(t if isinstance(t, tuple) else (t,) for t in (expected, got, got_again))):
        assert not g.requires_grad
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(h, e, rtol=1e-5, atol=1e-6)


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
        backend, compiled = compile_under(model, 1, codegen="inductor")
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-6)
    assert backend.plans == [] and backend.errors == []
