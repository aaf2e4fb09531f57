"""Cases of PyTorch's own activation-budget tests (test/functorch/test_ac.py: a matmul chain,
uneven matmuls; benchmarks/pytorch_budget_cases.py): at a budget equal to the step peak
PyTorch's partition measures, memcompile runs within it. A per-op margin counted at ops whose
memory is known exactly (matrix multiplies, pointwise ops) refused these budgets by 4 KiB
(passes/liveness.op_scratch_bytes)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import memcompile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from pytorch_budget_cases import cases, measured_step_peak  # noqa: E402

CASES = {name: (fn, make) for name, fn, make in cases()}


@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("case,baseline", [
    ("chain x4", "aot_eager"), ("chain x8", "aot_eager"), ("uneven", "aot_eager"),
    # aot_eager runs the softmax backward as one kernel; memcompile's aot_eager mode runs
    # Inductor's decomposition of it, as aot_eager_decomp_partition does
    ("attention vs linear", "aot_eager_decomp_partition")])
def test_a_budget_at_pytorchs_measured_peak_runs_within_it(case, baseline, fraction):
    fn, make = CASES[case]
    torch._dynamo.reset()
    with torch._functorch.config.patch(activation_memory_budget=fraction):
        stock_peak = measured_step_peak(torch.compile(fn, backend=baseline), make())
    torch._dynamo.reset()
    tensors = make()
    expected = torch.autograd.grad(fn(*tensors), tensors)
    peak = measured_step_peak(torch.compile(fn, backend=memcompile.budget(stock_peak, codegen="aot_eager")), tensors)
    assert peak <= stock_peak, (peak, stock_peak)
    for t, e in zip(tensors, expected):
        # float32 sums of 256 products, in another order where a softmax backward is decomposed
        torch.testing.assert_close(t.grad, e, rtol=1e-4, atol=2e-4)
