"""Cases of PyTorch's own activation-budget tests (test/functorch/test_ac.py: a matmul chain,
uneven matmuls), written anew: at a budget equal to the step peak PyTorch's partition measures,
memcompile runs within it. A per-op margin counted at ops whose memory is known exactly (matrix
multiplies, pointwise ops) refused these budgets by 4 KiB (passes/liveness.op_scratch_bytes)."""

from __future__ import annotations

import pytest
import torch

import memcompile


def _chain(x, ws):
    for w in ws:
        x = torch.mm(x, w).cos()
    return x.sum()


def _uneven(x, a, b):
    y = torch.mm(x, a).cos()
    z = torch.mm(y, b).cos()
    return torch.mm(z, b.t()).cos().sum()


def _inputs(case: str) -> list:
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g, requires_grad=True)

    if case == "chain4":
        return [r(128, 128)] + [r(128, 128) for _ in range(4)]
    if case == "chain8":
        return [r(64, 256)] + [r(256, 256) for _ in range(8)]
    return [r(256, 64), r(64, 512), r(512, 512)]


def _step(fn, case: str, tensors: list) -> None:
    loss = fn(tensors[0], tensors[1:]) if case.startswith("chain") else fn(*tensors)
    loss.backward()


def _measured(compiled, case: str, tensors: list) -> int:
    _step(compiled, case, tensors)  # compiles (not under the profiler)
    for t in tensors:
        t.grad = None
    return memcompile.measure_peak(lambda: _step(compiled, case, tensors), live_at_start=tensors).peak_bytes


@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("case", ["chain4", "chain8", "uneven"])
def test_a_budget_at_pytorchs_measured_peak_runs_within_it(case, fraction):
    fn = _chain if case.startswith("chain") else _uneven
    torch._dynamo.reset()
    with torch._functorch.config.patch(activation_memory_budget=fraction):
        stock_peak = _measured(torch.compile(fn, backend="aot_eager"), case, _inputs(case))
    torch._dynamo.reset()
    tensors = _inputs(case)
    expected = torch.autograd.grad(fn(tensors[0], tensors[1:]) if case.startswith("chain") else fn(*tensors), tensors)
    peak = _measured(torch.compile(fn, backend=memcompile.budget(stock_peak, codegen="aot_eager")), case, tensors)
    assert peak <= stock_peak, (peak, stock_peak)
    for t, e in zip(tensors, expected):
        torch.testing.assert_close(t.grad, e)
