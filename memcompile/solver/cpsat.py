"""Shared CP-SAT plumbing: one place that fixes seeds, workers and status names.

Both solvers (the published remat benchmark problem and the compiler's activation plan) run
through `run_model`, so determinism and time-limit handling behave the same everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from ortools.sat.python import cp_model

# Fixed seed and worker count: same problem + same options -> same answer (CP-SAT is
# deterministic for a fixed number of workers when interleave_search is off).
DEFAULT_SEED = 0
DEFAULT_WORKERS = 2


@dataclass(frozen=True)
class SolveOutcome:
    """What a CP-SAT run produced; values are only meaningful when `has_solution`."""

    status: str  # "optimal" | "feasible" | "infeasible" | "unknown" (timeout, no solution) | "invalid"
    objective: float
    lower_bound: float
    wall_s: float
    solver: cp_model.CpSolver

    @property
    def has_solution(self) -> bool:
        return self.status in ("optimal", "feasible")

    @property
    def gap(self) -> float:
        """Relative optimality gap (0 when proven optimal)."""
        if not self.has_solution:
            return float("inf")
        if self.objective == 0:
            return 0.0
        return max(0.0, (self.objective - self.lower_bound) / abs(self.objective))


_STATUS_NAMES = {
    cp_model.OPTIMAL: "optimal",
    cp_model.FEASIBLE: "feasible",
    cp_model.INFEASIBLE: "infeasible",
    cp_model.UNKNOWN: "unknown",
    cp_model.MODEL_INVALID: "invalid",
}


def run_model(
    model: cp_model.CpModel,
    *,
    time_limit_s: float,
    workers: int = DEFAULT_WORKERS,
    seed: int = DEFAULT_SEED,
    relative_gap: float = 0.0,
    extra_params: Mapping[str, object] | None = None,
) -> SolveOutcome:
    """Solve `model` with a hard wall-clock limit; never raises on timeout.

    `extra_params` sets further CpSolverParameters fields by name (e.g. presolve effort);
    solution hints go on the model itself (`model.AddHint`).
    """
    solver = cp_model.CpSolver()
    params = solver.parameters
    for name, value in (extra_params or {}).items():
        setattr(params, name, value)
    params.max_time_in_seconds = max(0.01, float(time_limit_s))
    params.num_workers = max(1, int(workers))
    params.random_seed = int(seed)
    params.relative_gap_limit = float(relative_gap)
    status = solver.Solve(model)
    name = _STATUS_NAMES.get(status, "unknown")
    has = name in ("optimal", "feasible")
    return SolveOutcome(
        status=name,
        objective=solver.ObjectiveValue() if has else float("nan"),
        lower_bound=solver.BestObjectiveBound() if has else float("nan"),
        wall_s=solver.WallTime(),
        solver=solver,
    )
