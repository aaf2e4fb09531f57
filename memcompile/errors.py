"""Typed errors users can catch."""

from __future__ import annotations


class InfeasibleBudgetError(ValueError):
    """No plan keeps the step's peak under the budget.

    `min_feasible_bytes` is the smallest budget for which memcompile found a plan (a raise of the
    budget to at least this, or a smaller batch/model, is what to do).
    """

    def __init__(self, message: str, *, budget_bytes: int, min_feasible_bytes: int,
                 contributors: tuple[tuple[str, int], ...] = ()) -> None:
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.min_feasible_bytes = min_feasible_bytes
        self.contributors = contributors

    def __reduce__(self):
        return (_rebuild_infeasible, (str(self), self.budget_bytes, self.min_feasible_bytes, self.contributors))


def _rebuild_infeasible(message, budget_bytes, min_feasible_bytes, contributors):
    return InfeasibleBudgetError(message, budget_bytes=budget_bytes,
                                 min_feasible_bytes=min_feasible_bytes, contributors=contributors)
