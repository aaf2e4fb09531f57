"""The step plan: once a step of several region calls has ended, one plan per compiled region for
the whole step (plain data).

Backend.settle reads the completed step from the ledger (which region ran at each call position,
and what each call held regardless of plan), asks each region for the plans it offers
(`PlanOption`s with their decisions), and applies what `choose_step_plan` returns: each region
compiles its chosen plan at its next call, beside what the rest of the step holds then. The
choice itself is the joint solver's (memcompile/joint_plan.py); this module adds the step's
budget as the regions see it and what each region's plan is compiled beside.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence, TypeVar

from memcompile.errors import InfeasibleBudgetError
from memcompile.joint_plan import PlanOption, Position, choose_joint, least_step_peak, step_peaks
from memcompile.ledger import Footprint
from memcompile.options import Options
from memcompile.plan import format_bytes

Region = TypeVar("Region", bound=Hashable)


@dataclass(frozen=True)
class StepBudget:
    """What the regions' plans have of the budget once the step's other holdings are set aside."""

    step_budget_bytes: int  # the budget less the reserve (Options.step_budget_bytes)
    reserve_bytes: int  # the reserve set aside (Options.reserve_bytes)
    compile_scratch_bytes: int  # what compiling a plan at a call holds beside the step
    eager_bytes: int  # what the step was measured to hold outside every region

    @property
    def regions_bytes(self) -> int:
        """The regions compile their chosen plans at their next calls, beside what the step
        holds and beside what it was measured to hold outside every region."""
        return self.step_budget_bytes - self.compile_scratch_bytes - self.eager_bytes


@dataclass(frozen=True)
class StepPlan:
    """One option per region, and what each region's plan is compiled beside."""

    option_of: tuple[int, ...]  # per region: the index of its chosen option in its menu
    # per region: the most the rest of the step holds at any of its calls, eager memory included
    outside_bytes: tuple[int, ...]
    step_peak_bytes: int  # predicted, of the regions' calls (eager memory and the scratch aside)
    added_time_s: float  # summed over the calls
    status: str  # the joint solver's ("optimal" | "feasible")
    regions_bytes: int  # what the choice had to fit (StepBudget.regions_bytes)


@dataclass(frozen=True)
class NoStepPlan:
    """No combination of the regions' options fits: the smallest budget that works."""

    min_feasible_bytes: int  # the least step peak plus the reserve, the compile's scratch and eager memory


def step_positions(calls: Sequence[tuple[Region, Footprint]]) -> tuple[tuple[Region, ...], tuple[Position, ...]]:
    """The step's compiled regions, in the order first called, and its calls as positions (their
    `region`: an index into those regions) with what each held regardless of plan."""
    regions = tuple(dict.fromkeys(region for region, _ in calls))
    positions = tuple(Position(regions.index(region), f.params_bytes, f.inputs_bytes, f.grads_bytes,
                               f.held_grads_bytes) for region, f in calls)
    return regions, positions


def choose_step_plan(positions: Sequence[Position], menus: Sequence[Sequence[PlanOption]],
                     budget: StepBudget) -> StepPlan | NoStepPlan:
    """The option per region with the least added time whose step fits the budget (choose_joint),
    with what the rest of the step holds beside each region; or the floor no choice fits under."""
    choice = choose_joint(positions, menus, budget.regions_bytes)
    if choice is None:
        least = least_step_peak(positions, menus)
        return NoStepPlan(least.step_peak_bytes + budget.reserve_bytes + budget.compile_scratch_bytes
                          + budget.eager_bytes)
    peaks = step_peaks(positions, menus, choice.option_of)
    outside = []
    for r, menu in enumerate(menus):
        own = menu[choice.option_of[r]].own_peak_bytes
        outside.append(max(peak - own for peak, q in zip(peaks, positions) if q.region == r) + budget.eager_bytes)
    return StepPlan(choice.option_of, tuple(outside), choice.step_peak_bytes, choice.added_time_s, choice.status,
                    budget.regions_bytes)


def no_step_plan_error(no_plan: NoStepPlan, positions: Sequence[Position], options: Options) -> InfeasibleBudgetError:
    """The error that says no plan of the step fits, and the smallest budget that does."""
    need = no_plan.min_feasible_bytes
    regions = len({q.region for q in positions})
    return InfeasibleBudgetError(
        f"memcompile: no plan of this step's {len(positions)} region calls ({regions} compiled "
        f"region(s)) fits the budget of {format_bytes(options.budget_bytes)} "
        f"({options.budget_bytes} bytes"
        + options.reserve_text()
        + f"). The smallest budget that works is {format_bytes(need)} (min_feasible_bytes={need}), "
        "with every region at its least peak where that helps. Raise the budget, or reduce batch "
        "size / model size.", budget_bytes=options.budget_bytes, min_feasible_bytes=need)
