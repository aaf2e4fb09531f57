"""Calibrating the solver's memory model to the exact check of one plan (passes/calibration.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from memcompile.passes.calibration import calibrated, step_corrections
from memcompile.solver.activations import close_decisions, step_loads
from test_activation_solver import problems


@st.composite
def checked_plans(draw):
    """A problem, a plan of it, and a check that names a random subset of the steps."""
    problem = draw(problems())
    prefer = draw(st.sets(st.integers(0, len(problem.names) - 1)))
    plan = close_decisions(problem, prefer_recompute=set(prefer))
    loads = step_loads(problem, *plan)
    fw_steps = min(problem.keep_from)  # steps before any candidate is held: call them forward
    keys = [("forward" if t < fw_steps else "backward", f"n{t}") for t in range(problem.num_steps)]
    named = draw(st.lists(st.booleans(), min_size=problem.num_steps, max_size=problem.num_steps))
    # The check sees between 0 and 2x what the model says, plus or minus some absolute bytes.
    checked = [(phase, node, max(0, int(load * draw(st.floats(0.0, 2.0))) + draw(st.integers(-300, 300))))
               for (phase, node), load, is_named in zip(keys, loads, named) if is_named]
    return problem, plan, loads, keys, checked


@settings(max_examples=150, deadline=None)
@given(case=checked_plans())
def test_the_calibrated_model_moves_to_the_check_and_never_below_it(case):
    problem, plan, loads, keys, checked = case
    correction = step_corrections(keys, loads, checked)
    fixed_problem = calibrated(problem, correction)
    after = step_loads(fixed_problem, *plan)
    by_key = {(phase, node): live for phase, node, live in checked}
    for t, key in enumerate(keys):
        if key not in by_key:
            continue
        check = by_key[key]
        # Never below the check (fixed bytes stay >= 0), never further from it than before.
        assert check <= after[t] <= max(loads[t], check)
        delta = correction.delta_bytes[t]
        if problem.fixed_bytes[t] + delta >= 0 and problem.before_node_bytes[t] + delta >= 0:
            assert after[t] == check
    assert all(f >= 0 for f in fixed_problem.fixed_bytes)
    assert all(b <= f for b, f in zip(fixed_problem.before_node_bytes, fixed_problem.fixed_bytes))
    # Decisions do not change: only the bytes no decision moves are corrected.
    assert fixed_problem.nbytes == problem.nbytes and fixed_problem.keep_from == problem.keep_from


def test_unnamed_steps_take_the_larger_neighbour_within_their_phase():
    keys = [("forward", "a"), ("forward", "b"), ("forward", "c"),
            ("backward", "d"), ("backward", "e"), ("backward", "f")]
    model = [100, 100, 100, 100, 100, 100]
    checked = [("forward", "a", 80), ("forward", "c", 130), ("backward", "e", 90), ("backward", "zz", 999)]
    correction = step_corrections(keys, model, checked)
    # b: between 80 and 130 -> 130; d and f: only e (90) in the backward; "zz" names no step.
    assert correction.delta_bytes == (-20, 30, 30, -10, -10, -10)
    assert correction.matched_steps == 3
    assert correction.largest_overcount == 20 and correction.largest_undercount == 30


def test_unnamed_steps_take_their_neighbours_difference_not_their_bytes():
    """A view after a kernel that read saved values the model frees at that kernel: the kernel's
    checked bytes include them, the view's model bytes do not. Taking the kernel's bytes would
    fix those values into the view's step under every plan (GPT-2: 10 MiB at `view_52`)."""
    keys = [("backward", "kernel"), ("backward", "view"), ("backward", "next")]
    model = [2100, 1100, 1200]  # the kernel holds 1000 B of saved values the view no longer does
    checked = [("backward", "kernel", 2130), ("backward", "next", 1350)]
    correction = step_corrections(keys, model, checked)
    assert correction.delta_bytes == (30, 150, 150)  # the view: 1100 + 150, not 2130


def test_a_phase_the_check_never_names_is_left_alone():
    keys = [("forward", "a"), ("backward", "b")]
    correction = step_corrections(keys, [50, 60], [("backward", "b", 40)])
    assert correction.delta_bytes == (0, -20)


def test_a_check_step_named_twice_counts_its_larger_value():
    correction = step_corrections([("backward", "x")], [10], [("backward", "x", 5), ("backward", "x", 25)])
    assert correction.delta_bytes == (15,)


def test_mismatched_lengths_are_rejected():
    with pytest.raises(ValueError, match="2 step keys for 1 modelled loads"):
        step_corrections([("forward", "a"), ("forward", "b")], [1], [])


def test_a_check_step_out_of_the_models_order_is_not_a_match():
    """A fused kernel named after a node the model runs first, scheduled at the forward's end (the
    GPT style file's `iota`): its bytes are the forward's end, not its node's. Matched, they would
    be fixed into the first step under every plan."""
    keys = [("forward", "iota"), ("forward", "a"), ("forward", "b"), ("forward", "c")]
    model = [500, 600, 700, 800]
    checked = [("forward", "a", 610), ("forward", "b", 705), ("forward", "c", 790), ("forward", "iota", 1700)]
    correction = step_corrections(keys, model, checked)
    assert correction.matched_steps == 3
    assert correction.delta_bytes == (10, 10, 5, -10)  # iota takes its neighbour's difference
    assert correction.largest_undercount == 10


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 30), max_size=40), st.randoms(use_true_random=False))
def test_the_steps_kept_are_a_longest_run_in_the_models_order(order, rng):
    """Against brute force on short inputs, and in order on any: what the alignment keeps never
    goes back in the model, and no longer such run exists."""
    from memcompile.passes.calibration import _in_model_order, _longest_not_decreasing

    run = _longest_not_decreasing(order)
    assert run == sorted(run) and all(order[a] <= order[b] for a, b in zip(run, run[1:]))
    if len(order) <= 12:
        from itertools import combinations
        best = max((len(c) for k in range(len(order) + 1) for c in combinations(range(len(order)), k)
                    if all(order[a] <= order[b] for a, b in zip(c, c[1:]))), default=0)
        assert len(run) == best
    keys = [("backward", f"n{t}") for t in range(31)]
    phases = ["forward", "backward"]
    checked = [(rng.choice(phases), f"n{t}", t) for t in order]
    kept = _in_model_order(keys, checked)
    assert all(phase == "backward" for phase, _, _ in kept)  # no forward step of that name
    assert [int(n[1:]) for _, n, _ in kept] == sorted(int(n[1:]) for _, n, _ in kept)
