"""Autocast (bf16 / fp16 on CPU) and mixed dtypes: sizes from the real dtypes, budget honoured
(predicted and measured), gradients as eager autocast's.

Tolerances: a compiled autocast step runs the same low-precision ops as eager autocast but in
a decomposed graph, so results differ by low-precision rounding: we compare with the default
`torch.testing` relative tolerance of the low dtype (bf16: rtol 1.6e-2; fp16: rtol 1e-3) and
an absolute tolerance of rtol times the step's largest gradient (rounding is relative to what
is accumulated, not to each small entry). Between memcompile's own plans (everything kept vs a tight budget) gradients must be
bit-identical: recomputing the same ops in the same dtype gives the same bits.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, Phase, example, given, settings, strategies as st

from budget_helpers import assert_within_budget, budget_range, grads, run_step
from models import build, loss_of

TOLERANCE = {torch.bfloat16: 1.6e-2, torch.float16: 1e-3}


def _cpu_autocast_supports(dtype: torch.dtype) -> bool:
    try:
        with torch.autocast("cpu", dtype=dtype):
            return (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == dtype
    except (RuntimeError, AssertionError):
        return False


DTYPES = [d for d in (torch.bfloat16, torch.float16) if _cpu_autocast_supports(d)]


class Autocast(nn.Module):
    def __init__(self, model: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.model, self.dtype = model, dtype

    def forward(self, x):
        with torch.autocast("cpu", dtype=self.dtype):
            out = self.model(x)
        return loss_of(out)


def assert_close_low_precision(got, expected, dtype):
    # atol relative to the largest gradient of the step: some gradients are zero up to rounding
    # (a convolution bias followed by batch norm), and there rounding is all there is.
    scale = max(float(a.abs().max()) for a in expected) or 1.0
    for a, b in zip(expected, got):
        torch.testing.assert_close(b, a, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype] * scale)


@pytest.mark.skipif(not DTYPES, reason="CPU autocast supports neither bf16 nor fp16 here")
@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck),
          phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(arch=st.sampled_from(["mlp", "attention", "convbn"]), dtype=st.sampled_from(DTYPES or [torch.bfloat16]),
       batch=st.integers(4, 16), fraction=st.floats(0.0, 1.0))
# Found by CI on an AMX-BF16 CPU: oneDNN's bf16 convolution scratchpads were not counted (18 KB over).
@(example(arch="convbn", dtype=torch.bfloat16, batch=4, fraction=0.9156276017479172)
  if torch.bfloat16 in DTYPES else (lambda test: test))
# Found by CI (s19): at the floor the MLPs are chunked, and the weight gradients summed over chunks
# differed from the unchunked plan's by one bf16 rounding (1.2e-4), where this compared bit for bit.
@(example(arch="attention", dtype=torch.bfloat16, batch=8, fraction=0.0)
  if torch.bfloat16 in DTYPES else (lambda test: test))
def test_autocast_plans_fit_and_match_eager_autocast(arch, dtype, batch, fraction):
    torch.compiler.reset()
    model, x = build(arch, 16, 2, batch)
    step_module = Autocast(model, dtype)
    params = list(model.parameters()) + [x]
    eager = grads(params, lambda: step_module(x))
    low, high = budget_range(step_module, x)
    free = run_step(step_module, x, params, 10**12)
    budget = int(low + fraction * max(0, high - low))
    tight = run_step(step_module, x, params, budget)
    assert_within_budget(tight, budget)
    assert_close_low_precision(tight.grads, eager, dtype)
    if tight.plan.graph_rewrites:
        # chunked rewrites (MLPs, the loss head) sum weight gradients chunk by chunk, each chunk's
        # product rounded to the low precision: equal to the unchunked plan's up to that rounding
        assert_close_low_precision(tight.grads, free.grads, dtype)
    else:
        for a, b in zip(free.grads, tight.grads):
            torch.testing.assert_close(b, a, rtol=0, atol=0)
    # sizes come from the dtypes the graph really holds: the low-precision activations
    low_precision = [d for d in tight.plan.decisions if d.dtype == str(dtype).replace("torch.", "")]
    assert low_precision, [(d.name, d.dtype) for d in tight.plan.decisions]
    for d in tight.plan.decisions:
        numel = 1
        for s in d.shape:
            numel *= s
        assert d.nbytes == numel * getattr(torch, d.dtype).itemsize


class MixedPrecision(nn.Module):
    """A float32 body, a float64 head and a bfloat16 side branch, without autocast."""

    def __init__(self, d: int = 32):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d, 2 * d), nn.Tanh(), nn.Linear(2 * d, d))
        self.head = nn.Linear(d, d).double()
        self.side = nn.Linear(d, d).to(torch.bfloat16)

    def forward(self, x):
        h = self.body(x)
        out = torch.sigmoid(self.head(h.double())).pow(2).mean()
        side = torch.relu(self.side(h.to(torch.bfloat16))).float().pow(2).mean()
        return out.float() + side


def test_mixed_dtypes_sizes_and_gradients():
    torch.manual_seed(0)
    model, x = MixedPrecision(), torch.randn(256, 32, requires_grad=True)
    params = list(model.parameters()) + [x]
    eager = grads(params, lambda: model(x))
    low, high = budget_range(model, x)
    assert low < high
    seen_dtypes = set()
    for budget in (low, (low + high) // 2):
        step = run_step(model, x, params, budget)
        assert_within_budget(step, budget)
        for d in step.plan.decisions:
            seen_dtypes.add(d.dtype)
            numel = 1
            for s in d.shape:
                numel *= s
            assert d.nbytes == numel * getattr(torch, d.dtype).itemsize
        for a, b in zip(eager, step.grads):
            # float32/float64 parameters take their gradients through the bf16 branch too
            torch.testing.assert_close(b, a, rtol=1.6e-2, atol=1.6e-2 * max(float(g.abs().max()) for g in eager))
    assert {"float64", "bfloat16"} <= seen_dtypes
