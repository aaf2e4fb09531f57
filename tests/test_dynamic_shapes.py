"""Dynamic shapes: a graph compiled for symbolic sizes is planned for the largest size seen so far
and re-planned before a larger one runs, so no size the guard admits runs over the budget.

codegen="aot_eager": the FX interpreter frees values as the liveness pass models, so the
measured peak of every call is comparable with the budget.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

import memcompile
from models import WithLoss, build


def _grads(model, x, fn):
    model.zero_grad(set_to_none=True)
    x.grad = None
    fn(x).backward()
    return [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]


def _input(arch: str, size: int, batch: int, length: int, dtype=torch.float32):
    torch.manual_seed(length)
    shape = (batch, length, size) if arch == "attention" else (length, size)
    return torch.randn(*shape, dtype=dtype, requires_grad=True)


def _bounds_at(model, x) -> tuple[int, int]:
    """(smallest feasible budget, the budget of the unconstrained predicted peak: it and the
    reserve) for a static compile at x's size."""
    backend = memcompile.budget(10**12, codegen="aot_eager", time_limit_s=2)
    torch.compile(WithLoss(model), backend=backend, dynamic=False)(x).backward()
    high = backend.plans[-1].predicted_peak_before_bytes + backend.plans[-1].reserve_bytes
    torch.compiler.reset()
    model.zero_grad(set_to_none=True)
    with pytest.raises(memcompile.InfeasibleBudgetError) as info:
        torch.compile(WithLoss(model), backend=memcompile.budget(1, codegen="aot_eager", time_limit_s=2),
                      dynamic=False)(x)
    torch.compiler.reset()
    return info.value.min_feasible_bytes, high


@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck),
          phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(arch=st.sampled_from(["attention", "mlp"]), lengths=st.lists(st.integers(4, 32), min_size=3, max_size=4),
       dynamic=st.sampled_from([True, None]), fraction=st.floats(0.2, 0.8))
def test_every_admitted_size_stays_under_the_budget(arch, lengths, dynamic, fraction):
    """Sequence lengths (attention) or batch sizes (mlp) vary from call to call; dynamic=True, or
    automatic dynamic after the first recompile (dynamic=None)."""
    torch.compiler.reset()
    size = 16
    model, _ = build(arch, size, 2, 2)
    largest = _input(arch, size, 2, max(lengths))
    low, high = _bounds_at(model, largest)
    budget = int(low + fraction * (high - low)) + 1
    backend = memcompile.budget(budget, codegen="aot_eager", time_limit_s=2)
    compiled = torch.compile(WithLoss(model), backend=backend, dynamic=dynamic)
    seen = 0
    for length in lengths:
        x = _input(arch, size, 2, length)
        expected = _grads(model, x, WithLoss(model))
        got = _grads(model, x, compiled)  # compiles / re-plans if needed
        for a, b in zip(expected, got):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
        model.zero_grad(set_to_none=True)
        x.grad = None
        measured = memcompile.measure_peak(lambda: compiled(x).backward(), live_at_start=[model, x])
        assert measured.peak_bytes <= budget, (length, measured.peak_bytes, budget)
        seen = max(seen, length)
        plan = backend.plans[-1]
        assert plan.predicted_peak_bytes <= budget
        # A symbolic plan states the sizes it covers: at least this call's. A length equal to the
        # feature size is no symbol of its own (duck sizing gives both one symbol, and the Linear
        # weights fix it): that graph is specialised to it and only its batch is symbolic.
        if plan.size_bounds and length != size:
            assert max(v for _, v in plan.size_bounds) >= length, plan.size_bounds
    torch.compiler.reset()


def test_larger_size_is_replanned_once_and_smaller_ones_reuse_it():
    model, _ = build("attention", 16, 2, 2)
    low, high = _bounds_at(model, _input("attention", 16, 2, 32))
    budget = (low + high) // 2
    backend = memcompile.budget(budget, codegen="aot_eager", time_limit_s=2)
    compiled = torch.compile(WithLoss(model), backend=backend, dynamic=True)
    counts = []
    for length in (8, 32, 16, 32, 12):
        model.zero_grad(set_to_none=True)  # plain steps (accumulated gradients would count)
        compiled(_input("attention", 16, 2, length)).backward()
        counts.append(len(backend.plans))
    # planned for 8, re-planned for 32; 16, 32 and 12 are covered by the plan for 32
    assert counts[0] == 1 and counts[1] == 2 and counts[-1] == 2, counts
    bounds = dict(backend.plans[-1].size_bounds)
    assert 32 in bounds.values(), bounds
    assert "covers sizes" in backend.plans[-1].summary()
    assert backend.plans[-1].predicted_peak_bytes > backend.plans[0].predicted_peak_bytes


def test_a_size_too_large_for_the_budget_raises_before_running():
    model, _ = build("mlp", 32, 3, 2)
    low_small, high_small = _bounds_at(model, _input("mlp", 32, 2, 16))
    low_large, _ = _bounds_at(model, _input("mlp", 32, 2, 512))
    budget = max(high_small, low_small) + 1
    assert budget < low_large
    backend = memcompile.budget(budget, codegen="aot_eager", time_limit_s=2)
    compiled = torch.compile(WithLoss(model), backend=backend, dynamic=True)
    compiled(_input("mlp", 32, 2, 16)).backward()
    model.zero_grad(set_to_none=True)  # plain steps (accumulated gradients would count)
    with pytest.raises(memcompile.InfeasibleBudgetError) as info:
        compiled(_input("mlp", 32, 2, 512))
    assert info.value.min_feasible_bytes > budget
    # smaller sizes still run under the plan made for them
    compiled(_input("mlp", 32, 2, 8)).backward()


@pytest.mark.inductor
def test_inductor_replans_pytorchs_partitions_at_the_larger_size(monkeypatch):
    """Under Inductor, PyTorch's partitions are candidate plans (planner.StockPartitions); a
    re-plan for a larger size checks them at that size, so the step measured at it stays under
    the budget (with the partition checked only at the traced size it would not)."""
    torch.compiler.reset()
    model, _ = build("attention", 16, 2, 2)
    probe = memcompile.budget(10**12, time_limit_s=2)
    torch.compile(WithLoss(model), backend=probe, dynamic=False)(_input("attention", 16, 2, 32)).backward()
    keep_all_at_32 = probe.plans[-1].predicted_peak_before_bytes
    torch.compiler.reset()
    budget = keep_all_at_32 - 1  # keep-all no longer fits at 32 (it does at 8)
    backend = memcompile.budget(budget, time_limit_s=2)
    compiled = torch.compile(WithLoss(model), backend=backend, dynamic=True)
    for length in (8, 32):
        x = _input("attention", 16, 2, length)
        expected = _grads(model, x, WithLoss(model))
        got = _grads(model, x, compiled)
        for a, b in zip(expected, got):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
        model.zero_grad(set_to_none=True)
        x.grad = None
        measured = memcompile.measure_peak(lambda: compiled(x).backward(), live_at_start=[model, x])
        assert measured.peak_bytes <= backend.plans[-1].predicted_peak_bytes <= budget, (length, measured.peak_bytes)
    statuses = [p.solver_status for p in backend.plans]
    assert len(statuses) == 2 and statuses[0] == "stock_partition (activation_memory_budget=1.0)", statuses
    assert 32 in dict(backend.plans[-1].size_bounds).values()
    assert backend.plans[-1].predicted_peak_bytes > backend.plans[0].predicted_peak_bytes
    torch.compiler.reset()


def test_a_one_region_step_with_room_runs_its_keep_all_plan():
    """Under dynamic=True Dynamo may abandon the first compile from inside the backend and retry
    it (TensorifyScalarRestartAnalysis); the abandoned compile is never called, so the retried
    one is not "compiled ahead of its call" and needs no cautious least-peak plan."""
    torch.compiler.reset()
    model, _ = build("attention", 16, 2, 2)
    backend = memcompile.budget(10**12, codegen="aot_eager", time_limit_s=2)
    compiled = torch.compile(WithLoss(model), backend=backend, dynamic=True)
    for length in (8, 8):
        compiled(_input("attention", 16, 2, length)).backward()
    assert [p.solver_status for p in backend.plans] == ["fits"]
    assert not any(d.choice == "recompute" for d in backend.plans[0].decisions)
    torch.compiler.reset()
