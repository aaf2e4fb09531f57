"""The step plan's chooser (memcompile/joint_plan.py) on plain data, against brute force, and the
step plan around it (memcompile/step_plan.py)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings, strategies as st

from memcompile.joint_plan import (
    PlanOption,
    Position,
    choose_joint,
    fixed_bytes,
    least_step_peak,
    step_peaks,
)
from memcompile.ledger import Footprint
from memcompile.options import Options
from memcompile.step_plan import NoStepPlan, StepBudget, choose_step_plan, no_step_plan_error, step_positions


def _brute_force(positions, menus, budget):
    """(least added time, least step peak) over every combination; time None if none fits."""
    best_time, best_peak = None, None
    for option_of in itertools.product(*(range(len(m)) for m in menus)):
        peak = max(step_peaks(positions, menus, option_of))
        time = sum(menus[q.region][option_of[q.region]].added_time_s for q in positions)
        best_peak = peak if best_peak is None else min(best_peak, peak)
        if peak <= budget and (best_time is None or time < best_time):
            best_time = time
    return best_time, best_peak


@st.composite
def _steps(draw):
    regions = draw(st.integers(1, 3))
    menus = []
    for _ in range(regions):
        size = draw(st.integers(1, 4))
        # Options as a region's planner offers them: less saved, less peak, more time.
        peaks = sorted(draw(st.lists(st.integers(1_000, 100_000), min_size=size, max_size=size)), reverse=True)
        menus.append([PlanOption(p, draw(st.integers(0, p)), float(draw(st.integers(0, 50))) * 1e-6)
                      for p in peaks])
    calls = draw(st.lists(st.integers(0, regions - 1), min_size=regions, max_size=6))
    positions = [Position(r, draw(st.integers(0, 20_000)), draw(st.integers(0, 5_000)), draw(st.integers(0, 20_000)))
                 for r in calls]
    return positions, menus, draw(st.integers(10_000, 600_000))


@settings(max_examples=60, deadline=None)
@given(_steps())
def test_the_choice_is_the_least_time_that_fits_and_the_least_peak_is_the_least(step):
    positions, menus, budget = step
    best_time, best_peak = _brute_force(positions, menus, budget)
    choice = choose_joint(positions, menus, budget)
    if best_time is None:
        assert choice is None
    else:
        assert choice is not None and choice.status == "optimal"
        assert max(step_peaks(positions, menus, choice.option_of)) == choice.step_peak_bytes <= budget
        assert choice.added_time_s == pytest.approx(best_time, abs=1e-8 * len(positions))
    least = least_step_peak(positions, menus)
    assert least.step_peak_bytes == best_peak
    # A budget of exactly the least step peak always has a choice.
    assert choose_joint(positions, menus, best_peak) is not None


def test_a_shared_region_serves_every_position_with_one_option():
    """Two calls of one region: its saved bytes count at both, one option for both."""
    menu = [PlanOption(100, 60, 0.0), PlanOption(80, 10, 1e-3)]
    positions = [Position(0, 5, 0, 5), Position(0, 5, 7, 5)]
    # keep-all: call 0 runs with call 1's params and grads; call 1 with call 0's params and saved
    # bytes (its own inputs, 7, are in its own peak)
    assert step_peaks(positions, [menu], (0,)) == (100 + 5 + 5, 100 + 5 + 0 + 60)
    assert fixed_bytes(positions, 1) == 5
    assert choose_joint(positions, [menu], 165).option_of == (0,)
    choice = choose_joint(positions, [menu], 164)
    assert choice.option_of == (1,) and choice.added_time_s == pytest.approx(2e-3)


def test_an_early_region_recomputes_so_that_a_later_one_fits():
    """The greedy order would keep everything in region 0; the joint choice makes it recompute."""
    first = [PlanOption(50, 40, 0.0), PlanOption(30, 5, 1e-4)]
    last = [PlanOption(60, 0, 0.0)]
    positions = [Position(0, 0, 0, 0), Position(1, 0, 0, 0)]
    choice = choose_joint(positions, [first, last], 70)
    assert choice.option_of == (1, 0) and choice.step_peak_bytes == 65
    assert choose_joint(positions, [first, last], 64) is None
    assert least_step_peak(positions, [first, last]).step_peak_bytes == 65


def test_equal_choices_are_broken_towards_the_first_option_deterministically():
    menu = [PlanOption(10, 5, 1e-6), PlanOption(9, 5, 1e-6)]
    positions = [Position(0, 0, 0, 0), Position(0, 0, 0, 0)]
    assert {choose_joint(positions, [menu], 100).option_of for _ in range(3)} == {(0,)}


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="positions"):
        choose_joint([], [[PlanOption(1, 1, 0.0)]], 10)
    with pytest.raises(ValueError, match=r"positions\[0\].region"):
        choose_joint([Position(3, 0, 0, 0)], [[PlanOption(1, 1, 0.0)]], 10)
    with pytest.raises(ValueError, match=r"menus\[0\]"):
        choose_joint([Position(0, 0, 0, 0)], [[]], 10)


def test_step_positions_index_the_regions_in_the_order_first_called():
    footprint = Footprint(own_peak_bytes=9, params_bytes=1, inputs_bytes=2, saved_bytes=8, grads_bytes=3,
                          held_grads_bytes=4)
    regions, positions = step_positions([("a", footprint), ("b", footprint), ("a", footprint)])
    assert regions == ("a", "b")
    assert positions == (Position(0, 1, 2, 3, 4), Position(1, 1, 2, 3, 4), Position(0, 1, 2, 3, 4))


def test_the_step_plan_fits_what_the_budget_leaves_and_says_what_each_region_runs_beside():
    """The example above, with a reserve, a compile's scratch and eager memory around the regions."""
    first = [PlanOption(50, 40, 0.0), PlanOption(30, 5, 1e-4)]
    last = [PlanOption(60, 0, 0.0)]
    positions = [Position(0, 0, 0, 0), Position(1, 0, 0, 0)]
    budget = StepBudget(step_budget_bytes=80, reserve_bytes=20, compile_scratch_bytes=4, eager_bytes=6)
    plan = choose_step_plan(positions, [first, last], budget)
    assert plan.option_of == (1, 0) and plan.step_peak_bytes == 65 and plan.regions_bytes == 70
    # beside region 0: nothing of region 1 yet; beside region 1: region 0's 5 saved bytes; both beside eager memory
    assert plan.outside_bytes == (0 + 6, 5 + 6)
    tight = StepBudget(step_budget_bytes=74, reserve_bytes=20, compile_scratch_bytes=4, eager_bytes=6)
    no_plan = choose_step_plan(positions, [first, last], tight)
    assert no_plan == NoStepPlan(min_feasible_bytes=65 + 20 + 4 + 6)
    error = no_step_plan_error(no_plan, positions, Options(budget_bytes=99, reserve_bytes=20))
    assert error.min_feasible_bytes == 95 and "2 region calls (2 compiled region(s))" in str(error)
