"""True end-to-end runs through Inductor's C++ code generation: measured peak vs budget."""

from __future__ import annotations

import pytest
import torch

import memcompile
from models import WithLoss, build

pytestmark = pytest.mark.inductor



def _run(model, x, limit):
    """Compile under `limit`, run one warm-up step, then measure one step; returns (plan, peak, grads)."""
    backend = memcompile.budget(limit, time_limit_s=5)
    compiled = torch.compile(WithLoss(model), backend=backend)
    model.zero_grad(set_to_none=True)  # plain steps: gradients already there would count as accumulated
    x.grad = None
    try:
        compiled(x).backward()
        model.zero_grad(set_to_none=True)
        x.grad = None
        measured = memcompile.measure_peak(lambda: compiled(x).backward(), live_at_start=[model, x])
    finally:
        torch.compiler.reset()
    grads = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    return backend.plans[0], measured.peak_bytes, grads


def _eager_grads(model, x):
    model.zero_grad(set_to_none=True)
    x.grad = None
    WithLoss(model)(x).backward()
    return [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]


@pytest.mark.parametrize("arch, size, depth, batch", [("attention", 32, 2, 16), ("convbn", 16, 3, 16)])
def test_measured_peak_honours_budgets_and_gradients_match(arch, size, depth, batch):
    model, x = build(arch, size, depth, batch)
    expected = _eager_grads(model, x)
    free_plan, free_peak, free_grads = _run(model, x, "100GB")
    with pytest.raises(memcompile.InfeasibleBudgetError) as info:
        _run(model, x, 1)  # fails while planning, before any code generation
    low, high = info.value.min_feasible_bytes, free_plan.predicted_peak_before_bytes
    assert low < high
    seen = []
    for fraction in (0.6, 0.0):
        budget = int(low + fraction * (high - low))
        plan, peak, grads = _run(model, x, budget)
        seen.append(plan)
        assert plan.budget_bytes == budget  # planned for this budget, not served from the other's cache
        assert plan.predicted_peak_bytes <= budget
        assert peak <= budget, f"measured {peak} > budget {budget} at {fraction}"
        # Inductor fuses more than the liveness pass assumes: prediction is an upper bound, and close.
        assert peak <= plan.predicted_peak_bytes
        # Over Inductor's schedule (the default check): 1.55x seen on convbn's tightest plan, a
        # spike at the convolution backward's workspace estimate, with every freed buffer of a
        # reused size counted as held (Inductor declines some of those reuses).
        assert plan.predicted_peak_bytes <= 1.7 * peak
        for a, b in zip(expected, grads):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    # Two budgets in one process: each compile planned for its own budget (checked above; the
    # decisions may coincide: on convbn both budgets end at the least-peak plan, whose peak is
    # the convolution backward's workspace).
    assert [p.budget_bytes for p in seen] == sorted({p.budget_bytes for p in seen}, reverse=True)
    assert free_peak <= free_plan.predicted_peak_bytes


def test_the_check_counts_what_inductors_wrapper_holds_to_the_kilobyte(monkeypatch):
    """With the per-step margin (OP_SCRATCH_BYTES) off, the check over Inductor's schedule is the
    measured peak of the attention stack to the kilobyte (the attention kernels' 1 KiB margin),
    never under. Each of these put it under by up to 49 KiB once the attention backward's
    workspace was counted exactly: a saved tensor counted as kept for reuse (the wrapper frees
    graph inputs), attention's unaligned gradients handed to an aligned allocation (the wrapper's
    reuse key has alignment), and the row statistics of a C++ kernel fused over an outer loop
    counted in registers (the wrapper allocates them)."""
    from memcompile.passes import liveness

    monkeypatch.setattr(liveness, "OP_SCRATCH_BYTES", 0)
    model, x = build("attention", 32, 2, 16)
    plan, peak, _ = _run(model, x, "100GB")
    assert peak <= plan.predicted_peak_bytes <= peak + 2048, (plan.predicted_peak_bytes, peak)


def test_a_stock_partition_that_fits_the_budget_is_used_before_solving(monkeypatch):
    """Just below the keep-all peak, PyTorch's own min-cut partition (at the largest
    activation_memory_budget fraction whose checked peak fits) is the plan: measured within the
    budget and its prediction, gradients as eager. Turned off, the solver plans instead."""
    from memcompile import planner

    model, x = build("attention", 32, 2, 16)
    expected = _eager_grads(model, x)
    free_plan, _, _ = _run(model, x, "100GB")
    budget = free_plan.predicted_peak_before_bytes - 1  # keep-all no longer fits
    plan, peak, grads = _run(model, x, budget)
    assert plan.solver_status.startswith("stock_partition (activation_memory_budget=")
    fraction = float(plan.solver_status.split("=")[1].rstrip(")"))
    assert fraction in planner.STOCK_FRACTIONS
    # What the partition saves is in the plan, so the step ledger counts it between this region's
    # forward and backward (other regions plan around it).
    from memcompile.ledger import saved_bytes_of

    assert plan.decisions and all(d.choice == "keep" for d in plan.decisions)
    assert 0 < saved_bytes_of(plan) <= plan.predicted_peak_bytes
    assert peak <= plan.predicted_peak_bytes <= budget
    for a, b in zip(expected, grads):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    monkeypatch.setenv("MEMCOMPILE_STOCK_CANDIDATES", "0")  # read where the backend is made
    plan, peak, grads = _run(model, x, budget)
    assert not plan.solver_status.startswith("stock_partition")
    assert peak <= plan.predicted_peak_bytes <= budget


@pytest.mark.parametrize("arch, size, depth, batch", [("mlp", 64, 3, 256), ("attention", 32, 2, 16)])
def test_at_plain_inductors_measured_peak_its_own_partition_is_the_plan(monkeypatch, arch, size, depth, batch):
    """A user who measured plain Inductor's peak and gives exactly that as the budget gets plain
    Inductor's partition back, not a slower plan: the check predicts it to the byte where its
    peak is at a generated kernel or a matrix multiply (no per-op margin there)."""
    model, x = build(arch, size, depth, batch)
    compiled = torch.compile(WithLoss(model))
    compiled(x).backward()
    model.zero_grad(set_to_none=True)
    x.grad = None
    plain = memcompile.measure_peak(lambda: compiled(x).backward(), live_at_start=[model, x]).peak_bytes
    torch.compiler.reset()
    plan, peak, _ = _run(model, x, plain)
    assert peak <= plan.predicted_peak_bytes <= plain
    if arch == "mlp":  # its peak is at a matrix multiply of the backward
        assert plan.solver_status == "stock_partition (activation_memory_budget=1.0)", plan.summary()
        assert plan.stock_inductor_rules  # compiled as plain Inductor compiles it
        assert peak == plain


def test_with_int8_allowed_a_fitting_partition_still_comes_first(monkeypatch):
    """Lossy formats are opt-in memory savings: where PyTorch's partition fits the budget, it runs
    (no precision lost, and faster than the solver's plans on the models measured); offload
    allowed (CUDA's default), the solver plans, as copies overlapped with compute may cost less."""
    model, x = build("attention", 32, 2, 16)
    free_plan, _, _ = _run(model, x, "100GB")
    budget = free_plan.predicted_peak_before_bytes - 1
    statuses = {}
    for options in ({"quantize": "int8"}, {"offload": True}):
        backend = memcompile.budget(budget, time_limit_s=5, **options)
        torch.compile(WithLoss(model), backend=backend)(x).backward()
        torch.compiler.reset()
        statuses[tuple(options)] = backend.plans[0].solver_status
        assert backend.plans[0].predicted_peak_bytes <= budget
    assert statuses[("quantize",)].startswith("stock_partition"), statuses
    assert not statuses[("offload",)].startswith("stock_partition"), statuses
