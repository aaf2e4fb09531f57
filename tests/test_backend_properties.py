"""Property tests: random architectures, shapes, dtypes and budgets through the whole pipeline.

The rewritten graphs run in the FX interpreter (codegen="aot_eager"), which frees every value
after its last use, so the liveness pass's prediction must match the allocator's measurement.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, Phase, example, given, settings, strategies as st

import memcompile
from memcompile.passes.liveness import OP_SCRATCH_BYTES
from models import WithLoss, build, loss_of

SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck),
                    phases=[Phase.explicit, Phase.reuse, Phase.generate])  # shrinking recompiles: too slow



def _grads(model, x, fn):
    model.zero_grad(set_to_none=True)
    x.grad = None
    fn(x).backward()
    return [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]


def _compile(model, limit):
    backend = memcompile.budget(limit, codegen="aot_eager", time_limit_s=5)
    return backend, torch.compile(WithLoss(model), backend=backend)


def _bounds(model, x) -> tuple[int, int]:
    """(smallest feasible budget, the budget of the unconstrained predicted peak: it and the
    reserve) for this model and input."""
    backend, compiled = _compile(model, 10**12)
    compiled(x).backward()
    unconstrained = backend.plans[0].predicted_peak_before_bytes + backend.plans[0].reserve_bytes
    torch.compiler.reset()
    model.zero_grad(set_to_none=True)  # plain steps: gradients left here would count as accumulated
    x.grad = None
    backend, compiled = _compile(model, 1)
    with pytest.raises(memcompile.InfeasibleBudgetError) as info:
        compiled(x)
    torch.compiler.reset()
    return info.value.min_feasible_bytes, unconstrained


architectures = st.sampled_from(["mlp", "convbn", "attention", "multi_output"])


@SETTINGS
@given(arch=architectures, size=st.sampled_from([8, 16, 32]), depth=st.integers(1, 3),
       batch=st.integers(2, 16), dtype=st.sampled_from([torch.float32, torch.float64]),
       fraction=st.floats(0.0, 1.0))
# The convolution backward's oneDNN workspace was counted from 8-channel blocks: measured 412,720 B
# for 355,064 B predicted (see test_convbn_plan_covers_the_convolution_backwards_blocked_copies).
@example(arch="convbn", size=16, depth=3, batch=7, dtype=torch.float32, fraction=0.4772467141549809)
def test_lossless_plans_match_eager_and_respect_the_budget(arch, size, depth, batch, dtype, fraction):
    torch.compiler.reset()  # each example from scratch (else Dynamo turns on dynamic shapes)
    model, x = build(arch, size, depth, batch, dtype)
    expected = _grads(model, x, WithLoss(model))
    low, high = _bounds(model, x)
    budget = int(low + fraction * max(0, high - low)) + 1
    backend, compiled = _compile(model, budget)

    def step():
        compiled(x).backward()

    model.zero_grad(set_to_none=True)
    x.grad = None
    step()  # compile
    got_warm = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    model.zero_grad(set_to_none=True)
    x.grad = None
    measured = memcompile.measure_peak(step, live_at_start=[model, x])
    got = [p.grad for p in model.parameters()] + [x.grad]
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-9, atol=1e-10)
    for a, b, c in zip(expected, got_warm, got):
        torch.testing.assert_close(b, a, **tol)
        torch.testing.assert_close(c, a, **tol)
    plan = backend.plans[0]
    assert plan.predicted_peak_bytes <= budget
    assert measured.peak_bytes <= budget
    # The interpreter frees exactly as modelled: prediction and measurement agree closely, but
    # for the allowance for scratch and kernel workspaces (estimated high on purpose).
    assert measured.peak_bytes <= plan.predicted_peak_bytes
    allowance = dict(plan.peak_breakdown).get("op_scratch_and_workspace", OP_SCRATCH_BYTES)
    assert measured.peak_bytes >= 0.9 * (plan.predicted_peak_bytes - allowance)


def test_convbn_plan_covers_the_convolution_backwards_blocked_copies():
    """4-channel convolutions, batch 7, 16x16 (28 KiB activations): oneDNN's backward holds the
    blocked grad_output, weights and input gradient at once, channels padded to blocks of 16 on
    AVX-512 (4x each: 233 KiB). Counted as 4x the input + 32 KiB (8-channel blocks), the plan
    for 381,094 B predicted 355,064 and measured 412,720. No plan fits that budget (the
    least-peak plan measures 383,984): it must say so, or be measured within it; unconstrained,
    the keep-all plan (441,080 predicted, 498,736 measured before) must cover its measurement."""
    model, x = build("convbn", 16, 3, 7, torch.float32)
    for budget in (381_094, 10**12):
        torch.compiler.reset()
        backend, compiled = _compile(model, budget)
        try:
            compiled(x).backward()
        except memcompile.InfeasibleBudgetError as error:
            assert budget < 10**12 and error.min_feasible_bytes > budget
            continue
        model.zero_grad(set_to_none=True)
        x.grad = None
        measured = memcompile.measure_peak(lambda: compiled(x).backward(), live_at_start=[model, x])
        plan = backend.plans[0]
        assert measured.peak_bytes <= plan.predicted_peak_bytes <= budget
        allowance = dict(plan.peak_breakdown).get("op_scratch_and_workspace", OP_SCRATCH_BYTES)
        assert measured.peak_bytes >= 0.9 * (plan.predicted_peak_bytes - allowance)
    torch.compiler.reset()


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(arch=architectures, batch=st.integers(2, 8))
def test_tighter_budget_never_predicts_more_memory(arch, batch):
    model, x = build(arch, 16, 2, batch)
    low, high = _bounds(model, x)
    peaks = []
    for budget in sorted({high + 1, (low + high) // 2 + 1, low}, reverse=True):
        backend, compiled = _compile(model, budget)
        compiled(x).backward()
        model.zero_grad(set_to_none=True)
        x.grad = None
        peaks.append(backend.plans[0].predicted_peak_bytes)
        assert peaks[-1] <= budget
        torch.compiler.reset()
    assert peaks == sorted(peaks, reverse=True)


def test_infeasible_budget_names_the_smallest_that_works():
    model, x = build("mlp", 32, 3, 64)
    backend, compiled = _compile(model, "1KB")
    with pytest.raises(memcompile.InfeasibleBudgetError) as info:
        compiled(x)
    error = info.value
    assert isinstance(error, ValueError)
    assert error.min_feasible_bytes > 1000
    assert str(error.min_feasible_bytes) in str(error)
    assert backend.errors and backend.errors[0] is error
    torch.compiler.reset()
    # ... and that budget does work.
    backend, compiled = _compile(model, error.min_feasible_bytes)
    compiled(x).backward()
    assert backend.plans[0].predicted_peak_bytes <= error.min_feasible_bytes


def test_inference_graphs_pass_through_without_a_plan():
    model, x = build("mlp", 16, 2, 4)
    backend, compiled = _compile(model, "1GB")
    with torch.no_grad():
        out = compiled(x)
    torch.testing.assert_close(out, loss_of(model(x)))
    assert backend.plans == []


def test_plan_records_decisions_and_summary():
    model, x = build("attention", 16, 2, 4)
    low, high = _bounds(model, x)
    backend, compiled = _compile(model, (low + high) // 2)
    compiled(x).backward()
    plan = backend.plans[0]
    assert plan.decisions and {d.choice for d in plan.decisions} <= {"keep", "recompute"}
    assert plan.predicted_peak_bytes <= plan.predicted_peak_before_bytes
    assert len(plan.live_bytes_after) > 0 and max(plan.live_bytes_after) == plan.predicted_peak_bytes
    text = memcompile.dump(backend)
    assert "predicted peak" in text and plan.graph_id in text


@pytest.mark.parametrize("arch", ["convbn", "attention"])
def test_dynamic_shapes_compile_and_match_eager(arch):
    """Symbolic sizes (dynamic=True): symint inputs are saved as symbols, not tensors. The plan
    is made for the sizes seen at trace time (planning for every admissible size is open)."""
    model, x = build(arch, 8, 2, 6)
    expected = _grads(model, x, WithLoss(model))
    backend = memcompile.budget("1GB", codegen="aot_eager")
    compiled = torch.compile(WithLoss(model), backend=backend, dynamic=True)
    got = _grads(model, x, compiled)
    for a, b in zip(expected, got):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    assert backend.plans and backend.plans[0].predicted_peak_bytes <= 10**9


def test_solver_failure_falls_back_to_a_valid_plan(monkeypatch, caplog):
    from memcompile import planner

    def broken(*_args, **_kwargs):
        raise RuntimeError("solver exploded")

    model, x = build("attention", 16, 2, 4)
    low, high = _bounds(model, x)
    monkeypatch.setattr(planner, "solve_activation_plan", broken)
    budget = (low + high) // 2
    backend, compiled = _compile(model, budget)
    expected = _grads(model, x, WithLoss(model))
    got = _grads(model, x, compiled)
    for a, b in zip(expected, got):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    plan = backend.plans[0]
    assert plan.predicted_peak_bytes <= budget
    assert plan.solver_status in ("fallback", "least_peak_optimal", "least_peak_feasible", "least_peak_fallback")
    assert "solver failed" in caplog.text
