"""Low-precision GEMM scratch on CPU (oneDNN): the count is never under what the allocator sees."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

import memcompile
from memcompile.cost_models.transient_memory import kernel_workspace_bytes

OPS = {
    "mm": (lambda a, b, c: torch.mm(a, b), False),
    "addmm": (lambda a, b, c: torch.addmm(c, a, b), False),
    "bmm": (lambda a, b, c: torch.bmm(a, b), True),
}


# Skinny sides (a few rows or columns) take oneDNN's GEMV-like kernels, whose scratch grows with k
# alone: draw them as often as general shapes.
SIDE = st.one_of(st.integers(1, 8), st.integers(1, 300))


@settings(max_examples=30, deadline=None)
@given(op=st.sampled_from(sorted(OPS)), m=SIDE, k=st.one_of(st.integers(1, 800), st.integers(800, 4096)), n=SIDE,
       batch=st.integers(1, 4), dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]))
def test_low_precision_gemm_scratch_is_counted_from_above(op, m, k, n, batch, dtype):
    fn, batched = OPS[op]
    lead = (batch,) if batched else ()
    a, b = torch.randn(*lead, m, k, dtype=dtype), torch.randn(*lead, k, n, dtype=dtype)
    c = torch.randn(n, dtype=dtype)
    (node,) = [x for x in make_fx(fn, tracing_mode="fake")(a, b, c).graph.nodes if x.op == "call_function"
               and x.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)]
    fn(a, b, c)  # first-call allocations (oneDNN primitive caches) are not per-step scratch
    measured = memcompile.measure_peak(lambda: fn(a, b, c), live_at_start=[a, b, c])
    scratch = measured.rise_bytes - measured.result.numel() * measured.result.element_size()
    counted = kernel_workspace_bytes(node)
    assert counted >= scratch, (counted, scratch)
    if dtype == torch.float32:
        assert counted == 0
