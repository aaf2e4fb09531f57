"""Repeated blocks: classes of values alike in each block, moved whole by the greedy plan; the
greedy plan kept back; graphs too large to search take it."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from memcompile import planner
from memcompile.passes.repeated_blocks import BlockPlace, block_place, repeated_block_classes
from memcompile.solver import activations
from memcompile.solver.activations import (
    NOT_SEARCHED,
    ActivationProblem,
    evaluate,
    greedy_plan,
    is_consistent,
    kept_back,
    solve_activation_plan,
    solve_min_peak,
)
from tests.budget_helpers import budget_range, grads, run_step
from tests.models import AttentionStack
from tests.test_activation_solver import problems


@pytest.mark.parametrize("stack, place", [
    (("L['self'].layers.3", "L['self'].layers.3.mlp"),
     BlockPlace("L['self'].layers.# > L['self'].layers.#.mlp", (3, 3))),
    (("L['self'].model.layers[12].self_attn",), BlockPlace("L['self'].model.layers[#].self_attn", (12,))),
    (("L['self']._modules['h']._modules['7'].attn",), BlockPlace("L['self']._modules['h']._modules['#'].attn", (7,))),
    (("L['self'].blocks.2.experts.5",), BlockPlace("L['self'].blocks.#.experts.#", (2, 5))),
    (("L['self'].layers.10", "G['rope'].apply_rotary"), BlockPlace("L['self'].layers.# > G['rope'].apply_rotary", (10,))),
    (("L['self'].head",), None),
    (("L['self'].conv2d",), None),  # digits inside a name are no index
    ((), None),
])
def test_block_place_reads_the_layer_index(stack, place):
    assert block_place(stack) == place


def test_classes_pair_the_kth_value_of_a_kind_in_each_block():
    a0, a1, a2 = (BlockPlace("m.#.a", (b,)) for b in range(3))
    places = [None, a0, a0, a0, a1, a1, a1, a2, BlockPlace("m.#.b", (0,))]
    kinds = ["mm", "mm", "add", "mm", "mm", "add", "mm", "mm", "mm"]
    # block 0: mm(1), add(2), mm(3); block 1: mm(4), add(5), mm(6); block 2: mm(7); b: one only
    assert repeated_block_classes(places, kinds) == (-1, 1, 2, 3, 1, 2, 3, 1, -1)


def _blocks_problem(draw, blocks: int, width: int) -> ActivationProblem:
    """`blocks` identical chains of `width` values each, read in reverse by the backward; the
    first value of block 0 reads nothing, so it is not alike the others."""
    n = blocks * width
    fw_steps, steps = n, 2 * n
    per_position = [dict(nbytes=draw(st.integers(1, 400)), cost=draw(st.floats(1e-6, 1e-3)),
                         read=draw(st.booleans()) or j == width - 1, can_recompute=draw(st.booleans()))
                    for j in range(width)]
    rows: dict[str, list] = {k: [] for k in ("nbytes", "cost", "can_keep", "can_recompute", "first", "last",
                                             "keep_from", "reads")}
    for b, j in itertools.product(range(blocks), range(width)):
        i = b * width + j
        position = per_position[j]
        backward_step = fw_steps + (n - 1 - i)
        rows["nbytes"].append(position["nbytes"])
        rows["cost"].append(position["cost"])
        rows["can_keep"].append(True)
        rows["can_recompute"].append(position["can_recompute"])
        rows["first"].append(backward_step if position["read"] else steps)
        rows["last"].append(backward_step if position["read"] else -1)
        rows["keep_from"].append(i + 1)
        rows["reads"].append((i - 1,) if i else ())
    fixed = tuple(draw(st.integers(0, 300)) for _ in range(steps))
    problem = ActivationProblem(
        names=tuple(f"v{i}" for i in range(n)), nbytes=tuple(rows["nbytes"]), recompute_cost_s=tuple(rows["cost"]),
        can_keep=tuple(rows["can_keep"]), can_recompute=tuple(rows["can_recompute"]),
        first_read=tuple(rows["first"]), last_read=tuple(rows["last"]), keep_from=tuple(rows["keep_from"]),
        recompute_from=(fw_steps,) * n, recompute_reads=tuple(rows["reads"]), view_of=(-1,) * n, fixed_bytes=fixed)
    places = [BlockPlace("m.#", (i // width,)) for i in range(n)]
    kinds = [(i % width, len(problem.recompute_reads[i])) for i in range(n)]
    return dataclasses.replace(problem, same_decision_as=repeated_block_classes(places, kinds))


@st.composite
def blocks_problems(draw):
    blocks = draw(st.integers(2, 4))
    # (two blocks of one value each share no class: the first reads nothing, the second reads it)
    return _blocks_problem(draw, blocks, draw(st.integers(1 if blocks > 2 else 2, 7 // blocks)))


def _plans(problem):
    for choice in itertools.product((None, "keep", "recompute"), repeat=len(problem.names)):
        keep = frozenset(i for i, c in enumerate(choice) if c == "keep")
        recompute = frozenset(i for i, c in enumerate(choice) if c == "recompute")
        if is_consistent(problem, keep, recompute):
            yield keep, recompute


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(blocks_problems(), st.floats(0.0, 1.2))
def test_plans_with_classes_fit_and_are_found_where_any_plan_fits(problem, fraction):
    assert any(g >= 0 for g in problem.same_decision_as)
    plans = list(_plans(problem))
    peaks = [evaluate(problem, *p)[0] for p in plans]
    budget = int(min(peaks) + fraction * (max(peaks) - min(peaks)))
    feasible = [evaluate(problem, *p)[1] for p, peak in zip(plans, peaks) if peak <= budget]
    result = solve_activation_plan(problem, budget, time_limit_s=5)
    if not feasible:
        assert result.status == "infeasible"
        return
    assert is_consistent(problem, result.keep, result.recompute)
    assert evaluate(problem, result.keep, result.recompute)[0] <= budget
    if result.status == "optimal":
        assert abs(result.added_time_s - min(feasible)) <= 1e-9 + 1e-6 * min(feasible)
    least = solve_min_peak(problem, time_limit_s=5)
    assert is_consistent(problem, *least.decisions)
    assert least.model_peak_bytes <= evaluate(problem, *greedy_plan(problem, 0, per_second=False, tied=True))[0]


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(problems(max_candidates=10), st.floats(0.0, 1.0))
def test_keeping_back_fits_and_never_slows(problem, fraction):
    frugal = greedy_plan(problem, 0)
    everything = greedy_plan(problem, 10**12)
    low, high = evaluate(problem, *frugal)[0], evaluate(problem, *everything)[0]
    budget = int(low + fraction * (high - low))
    plan = greedy_plan(problem, budget)
    if evaluate(problem, *plan)[0] > budget:
        return
    back = kept_back(problem, plan, budget, time_limit_s=5)
    assert is_consistent(problem, *back)
    assert evaluate(problem, *back)[0] <= budget
    assert evaluate(problem, *back)[1] <= evaluate(problem, *plan)[1]


def test_a_graph_too_large_to_search_takes_the_greedy_plan_kept_back(monkeypatch):
    """Above SEARCH_MAX_CANDIDATES, no CP-SAT: the greedy plan with recomputations kept back.
    Three values held from the forward, read in reverse by the backward."""
    problem = ActivationProblem(
        names=("a", "b", "c"), nbytes=(100, 60, 60), recompute_cost_s=(3e-3, 1e-3, 1e-3),
        can_keep=(True,) * 3, can_recompute=(True,) * 3, first_read=(6, 5, 4), last_read=(6, 5, 4),
        keep_from=(1, 2, 3), recompute_from=(3, 3, 3), recompute_reads=((), (), ()), view_of=(-1,) * 3,
        fixed_bytes=(0,) * 7)
    budget = 160  # keep-all holds 220 at steps 3-4; recomputing b (or a) fits
    monkeypatch.setattr(activations, "SEARCH_MAX_CANDIDATES", 2)
    result = solve_activation_plan(problem, budget, time_limit_s=5)
    assert result.status == f"fallback ({NOT_SEARCHED})"
    assert result.model_peak_bytes <= budget and is_consistent(problem, *result.decisions)


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(blocks_problems(), st.integers(0, 3000))
def test_greedy_by_class_gives_consistent_plans(problem, budget):
    plan = greedy_plan(problem, budget, tied=True)
    assert is_consistent(problem, *plan)


def test_a_class_must_share_its_bans():
    problem = ActivationProblem(
        names=("a", "b"), nbytes=(10, 10), recompute_cost_s=(1e-3, 1e-3), can_keep=(True, True),
        can_recompute=(True, False), first_read=(3, 2), last_read=(3, 2), keep_from=(1, 2), recompute_from=(2, 2),
        recompute_reads=((), ()), view_of=(-1, -1), fixed_bytes=(0, 0, 0, 0))
    with pytest.raises(ValueError, match="same_decision_as"):
        dataclasses.replace(problem, same_decision_as=(0, 0))
    with pytest.raises(ValueError, match="same_decision_as"):
        dataclasses.replace(problem, same_decision_as=(1, 1))  # the first of a class names itself


class _StackLoss(torch.nn.Module):
    def __init__(self, depth: int):
        super().__init__()
        self.stack = AttentionStack(32, 2, depth)

    def forward(self, x):
        return self.stack(x).square().mean()


def test_a_layer_stack_is_planned_by_class_within_its_budget(monkeypatch):
    """Every layer of a stack contributes a member to the classes; the plan made with them
    runs within the budget with eager's gradients."""
    classed = []
    original = planner.with_repeated_blocks

    def spy(analysis):
        classed.append(original(analysis))
        return classed[-1]

    monkeypatch.setattr(planner, "with_repeated_blocks", spy)
    torch.manual_seed(0)
    depth = 3
    loss, x = _StackLoss(depth), torch.randn(4, 16, 32, requires_grad=True)
    model = loss.stack
    low, high = budget_range(loss, x)
    budget = low + (high - low) // 3
    params = list(model.parameters())
    step = run_step(loss, x, params, budget, seed=0)
    problem = classed[-1].problem
    members = {}
    for i, g in enumerate(problem.same_decision_as):
        if g >= 0:
            members.setdefault(g, []).append(i)
    assert members and all(len(m) <= depth for m in members.values())
    assert any(len(m) == depth for m in members.values())
    assert step.measured_peak_bytes <= budget
    expected = grads(params, lambda: loss(x))
    assert all(torch.allclose(a, b, atol=1e-6, rtol=1e-5) for a, b in zip(step.grads, expected))
