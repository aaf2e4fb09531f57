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


class PlannedOnly(Exception):
    """A graph was planned by a backend in plan-only mode (memcompile.max_batch): its plan, and no
    compiled code. Raised from the compiled callable instead of running the step."""

    def __init__(self, plan: object) -> None:
        super().__init__(f"memcompile: planned {getattr(plan, 'graph_id', 'a graph')} only (no step run)")
        self.plan = plan
