"""passes/fusion.py against Inductor itself: lower the graphs memcompile hands to Inductor (lowering
only, no code generation) and check that no node predicted inlined becomes a buffer there, and
that the fusion-aware prediction keeps measured peaks under budgets end to end."""

from __future__ import annotations

import pytest
import torch

import memcompile
from memcompile import _torch_private as tp
from memcompile import planner
from memcompile.passes.fusion import INLINED, FusionRules, predict_fusion
from memcompile.passes.graph_facts import fusion_facts
from models import WithLoss, build

pytestmark = pytest.mark.inductor


def _planned_graphs(module, inputs, limit):
    """The (forward, backward) memcompile plans for `module`, captured from the planner."""
    seen = []
    original = planner._plan_joint_graph

    def spy(*args, **kwargs):
        fw, bw, plan = original(*args, **kwargs)
        seen.append((fw, bw))
        return fw, bw, plan

    planner._plan_joint_graph = spy
    try:
        compiled = torch.compile(module, backend=memcompile.budget(limit, codegen="aot_eager", time_limit_s=5))
        compiled(*inputs).backward()
    finally:
        planner._plan_joint_graph = original
        torch.compiler.reset()
    return seen[-1]


def _inductor_buffers(gm: torch.fx.GraphModule, is_backward: bool) -> set[str]:
    """Names of the FX nodes Inductor's lowering realizes as buffers (torch 2.13 internals)."""
    from torch._inductor.graph import GraphLowering
    from torch._inductor.virtualized import V

    example = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    fake_mode = next(v.fake_mode for v in example if hasattr(v, "fake_mode"))
    graph = GraphLowering(gm, example_inputs=example, is_backward=is_backward)
    with V.set_graph_handler(graph), V.set_fake_mode(fake_mode):
        graph.run(*example)
    return {buf.origin_node.name for buf in graph.buffers if getattr(buf, "origin_node", None) is not None}


@pytest.mark.parametrize("arch, size, depth, batch", [("attention", 32, 2, 8), ("convbn", 8, 2, 4),
                                                      ("mlp", 32, 3, 8), ("multi_output", 32, 2, 8)])
@pytest.mark.parametrize("tight", [False, True])
def test_nothing_predicted_inlined_is_a_buffer_in_inductor(arch, size, depth, batch, tight):
    model, x = build(arch, size, depth, batch)
    limit = 10**12
    if tight:  # the smallest budget: the backward recomputes activations, other graphs to check
        with pytest.raises(memcompile.InfeasibleBudgetError) as info:
            _planned_graphs(WithLoss(model), (x,), 1)
        limit = info.value.min_feasible_bytes
    fw, bw = _planned_graphs(WithLoss(model), (x,), limit)
    checked = 0
    for graph, is_backward in ((fw, False), (bw, True)):
        gm = tp.inductor_post_grad_copy(graph)  # what Inductor lowers
        prediction = predict_fusion(fusion_facts(gm), FusionRules.for_device("cpu"))
        buffers = _inductor_buffers(gm, is_backward)
        wrong = sorted(n for n in buffers if prediction.fate(n) == INLINED)
        assert not wrong, f"predicted inlined, but Inductor stores: {wrong}"
        checked += len(prediction.inlined)
    assert checked > 0  # the models do have inlined bodies


def _measured_step(module, x, limit):
    """Compile with Inductor under `limit`, warm up, measure one step: (plan, measured peak)."""
    backend = memcompile.budget(limit, time_limit_s=5)
    compiled = torch.compile(module, backend=backend)
    try:
        compiled(x).backward()
        module.zero_grad(set_to_none=True)
        x.grad = None
        measured = memcompile.measure_peak(lambda: compiled(x).backward(), live_at_start=[module, x])
    finally:
        torch.compiler.reset()
    return backend.plans[-1], measured.peak_bytes


@pytest.mark.parametrize("arch, size, depth, batch", [("attention", 32, 2, 16), ("convbn", 16, 2, 8)])
def test_fusion_aware_prediction_bounds_measured_peaks_under_budgets(arch, size, depth, batch, monkeypatch):
    monkeypatch.setattr(planner, "FUSION_CHECK_ALONE", True)  # MEMCOMPILE_FUSION_CHECK=1
    model, x = build(arch, size, depth, batch)
    module = WithLoss(model)
    free_plan, free_peak = _measured_step(module, x, 10**12)
    assert free_peak <= free_plan.predicted_peak_bytes
    with pytest.raises(memcompile.InfeasibleBudgetError) as info:
        torch.compile(module, backend=memcompile.budget(1, time_limit_s=5))(x)  # fails while planning
    torch.compiler.reset()
    low, high = info.value.min_feasible_bytes, free_plan.predicted_peak_bytes
    for fraction in (0.0,):  # the tightest: benchmarks/prediction_accuracy.py covers more budgets
        budget = int(low + fraction * (high - low))
        plan, peak = _measured_step(module, x, budget)
        assert plan.predicted_peak_bytes <= budget
        assert peak <= plan.predicted_peak_bytes, f"under-predicted at {fraction}: {peak} > {plan.predicted_peak_bytes}"
        assert peak <= budget
