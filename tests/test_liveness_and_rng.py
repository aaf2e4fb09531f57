"""Liveness on hand-built graphs, and random ops never being recomputed."""

from __future__ import annotations

import pytest
import torch

import memcompile
from memcompile.passes.liveness import OP_SCRATCH_BYTES, analyze_liveness


def _graphs(fn, *inputs):
    """The (forward, backward) graphs AOTAutograd makes for fn, as memcompile partitions them."""
    captured = {}
    backend = memcompile.budget("10GB", codegen="aot_eager")
    from memcompile import planner

    original = planner.apply_plan

    def spy(*args, **kwargs):
        fw, bw = original(*args, **kwargs)
        captured["graphs"] = (fw, bw)
        return fw, bw

    planner.apply_plan = spy
    try:
        torch.compile(fn, backend=backend)(*inputs).backward()
    finally:
        planner.apply_plan = original
    return captured["graphs"], backend.plans[0]


def test_views_are_counted_once_and_grads_live_to_the_end():
    w = torch.randn(256, 256, requires_grad=True)  # 256 KiB

    def f(w):
        t = w.t()  # a view: no new storage
        return (t * 2).sum()

    (fw, bw), plan = _graphs(f, w)
    timeline = analyze_liveness(fw, bw, 1)
    mib = 256 * 1024
    # Static: w. Forward peak: w + (t*2). Backward: w + grad of w (+ scalars).
    assert timeline.static_bytes == mib
    assert timeline.peak_bytes < 3 * mib + OP_SCRATCH_BYTES + 64
    assert timeline.peak_bytes >= 2 * mib
    assert plan.predicted_peak_bytes == timeline.peak_bytes
    assert timeline.steps[-1].live_bytes >= 2 * mib  # gradient held to the end of the step


def test_fused_pointwise_chains_hold_no_buffer():
    x = torch.randn(512, 128, requires_grad=True)

    def f(x):
        return (torch.tanh(x * 3 + 1) * 2).exp().sum()

    (fw, bw), _ = _graphs(f, x)
    def forward_peak(timeline):
        return max(s.live_bytes for s in timeline.steps if s.phase == "forward")

    plain = forward_peak(analyze_liveness(fw, bw, 1))
    fused = forward_peak(analyze_liveness(fw, bw, 1, fuse_pointwise=True))
    assert fused < plain


@pytest.mark.parametrize("fraction", [0.0, 0.5])
def test_dropout_is_kept_never_recomputed(fraction):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.Dropout(0.5), torch.nn.GELU(),
        torch.nn.Linear(256, 256), torch.nn.Dropout(0.5), torch.nn.GELU(), torch.nn.Linear(256, 64),
    )
    x = torch.randn(256, 64)

    def grads(limit):
        backend = memcompile.budget(limit, codegen="aot_eager")
        compiled = torch.compile(lambda x: model(x).pow(2).mean(), backend=backend)
        model.zero_grad(set_to_none=True)
        torch.manual_seed(123)
        compiled(x).backward()
        torch.compiler.reset()
        return [p.grad.clone() for p in model.parameters()], backend.plans[0]

    reference, free_plan = grads("10GB")
    with pytest.raises(memcompile.InfeasibleBudgetError) as info:
        grads(1)
    low, high = info.value.min_feasible_bytes, free_plan.predicted_peak_before_bytes
    tight, plan = grads(int(low + fraction * (high - low)))
    assert plan.predicted_peak_bytes < free_plan.predicted_peak_bytes
    assert any(d.choice == "recompute" for d in plan.decisions)
    # Same seed, same masks: recomputing a random op would draw new ones and change the grads.
    for a, b in zip(reference, tight):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_attention_without_dropout_may_be_recomputed():
    from memcompile.passes.graph_facts import is_random_op

    attention = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default

    def f(q, k, v):
        return attention(q, k, v, 0.0, True), attention(q, k, v, 0.1, True), torch.ops.aten.rand_like.default(q)

    graph = torch.fx.symbolic_trace(f).graph
    calls = [n for n in graph.nodes if n.op == "call_function" and n.target is not getattr]
    by_target = [(str(n.target), n.args[3] if len(n.args) > 3 else None, is_random_op(n)) for n in calls]
    assert (str(attention), 0.0, False) in by_target
    assert (str(attention), 0.1, True) in by_target
    assert any("rand_like" in t and random for t, _, random in by_target)
