"""Typed errors users can catch."""

from __future__ import annotations


class InfeasibleBudgetError(ValueError):
    """No plan keeps the step's peak under the budget.

    `min_feasible_bytes` is the smallest budget for which memcompile found a plan (a raise of the
    budget to at least this, or a smaller batch/model, is what to do). `whole_step` is False when
    it was raised in the first step of several compiled regions before the later ones were seen:
    then it is the smallest budget for the regions seen so far, and a later one may need more.
    """

    def __init__(self, message: str, *, budget_bytes: int, min_feasible_bytes: int,
                 contributors: tuple[tuple[str, int], ...] = (), whole_step: bool = True) -> None:
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.min_feasible_bytes = min_feasible_bytes
        self.contributors = contributors
        self.whole_step = whole_step

    def __reduce__(self):
        return (_rebuild_infeasible, (str(self), self.budget_bytes, self.min_feasible_bytes, self.contributors,
                                      self.whole_step))


def _rebuild_infeasible(message, budget_bytes, min_feasible_bytes, contributors, whole_step=True):
    return InfeasibleBudgetError(message, budget_bytes=budget_bytes, min_feasible_bytes=min_feasible_bytes,
                                 contributors=contributors, whole_step=whole_step)


class UnplannedFrameError(RuntimeError):
    """Dynamo could not compile a frame of a model compiled with memcompile and would run it
    eagerly, outside every plan: the step's memory would not be bounded by the budget.

    `frame` names the function (`name`, `location`) and Dynamo's `reason`. Fix the cause (a graph
    break inside a loop is the usual one), or pass `on_unplanned="warn"` to `memcompile.budget()`
    to run such frames eagerly with a warning.
    """

    def __init__(self, message: str, *, frame: object) -> None:
        super().__init__(message)
        self.frame = frame

    def __reduce__(self):
        return (_rebuild_unplanned, (str(self), self.frame))


def _rebuild_unplanned(message, frame):
    return UnplannedFrameError(message, frame=frame)


class UnplannedFrameWarning(UserWarning):
    """`on_unplanned="warn"`: a frame runs eagerly, outside the budget (see UnplannedFrameError)."""


class StepOverrunError(RuntimeError):
    """A call would take the step over the budget because regions called before it in the same
    step run plans made before it was known (the first run of a step's regions, or a region
    compiled after the plan for the whole step was chosen). `needed_bytes` is what the step
    would need with this region at its least peak. `on_first_step_overrun="warn"` runs the step
    anyway, with a StepOverrunWarning; the next step is planned as a whole.
    """

    def __init__(self, message: str, *, budget_bytes: int, needed_bytes: int) -> None:
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.needed_bytes = needed_bytes

    def __reduce__(self):
        return (_rebuild_overrun, (str(self), self.budget_bytes, self.needed_bytes))


def _rebuild_overrun(message, budget_bytes, needed_bytes):
    return StepOverrunError(message, budget_bytes=budget_bytes, needed_bytes=needed_bytes)


class StepOverrunWarning(UserWarning):
    """`on_first_step_overrun="warn"`: a step runs over the budget (see StepOverrunError)."""


class PlanningFailedError(RuntimeError):
    """memcompile could not plan a graph (a bug, or an op its passes cannot read), and PyTorch's
    own partition, its fallback, is not predicted within the budget. `on_unplanned="warn"` runs
    that partition anyway, with a warning. The original error is the `__cause__`."""


class PlannedOnly(Exception):
    """A graph was planned by a backend in plan-only mode (memcompile.max_batch): its plan, and no
    compiled code. Raised from the compiled callable instead of running the step."""

    def __init__(self, plan: object) -> None:
        super().__init__(f"memcompile: planned {getattr(plan, 'graph_id', 'a graph')} only (no step run)")
        self.plan = plan


# What reading a graph raises where memcompile, a cost formula or torch cannot handle it (an op a
# pass or torch's partitioner does not know, an unsupported value, a schedule Inductor cannot
# build). A caller with a conservative answer that needs no such reading catches these and logs
# it; an AssertionError (a broken invariant: a bug, or a test's sentinel) is not among them and
# propagates, as does anything else.
UNREADABLE_GRAPH_ERRORS: tuple[type[Exception], ...] = (
    ValueError, TypeError, NotImplementedError, RuntimeError, KeyError, IndexError, AttributeError)
