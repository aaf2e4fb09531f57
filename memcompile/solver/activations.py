"""The compiler's choice per saved activation: keep it, or recompute it in backward.

A plain problem object (no torch types). Candidates are forward tensors the backward may need;
steps are the forward-then-backward execution order. The CP-SAT model (docs/design.md):

    k_i, r_i in {0,1}          candidate i is kept (saved from forward) / recomputed in backward
    k_i + r_i = 1              if backward reads i directly;  k_i + r_i <= 1 otherwise
    k_i + r_i >= r_c           for every c whose recomputation reads i
    s_i <= first_read_i        a recomputed i is live from step s_i ...
    s_i <= s_c   if r_c        ... which precedes every recomputed reader c
    e_i >= last_read_i         ... until step e_i, after its last reader:
    e_i >= s_c   if r_c        (e_i >= e_c when c is a view of i: the view pins i's storage)
    kept i:       optional interval [keep_from_i, e_i], presence k_i, demand bytes_i
    recomputed i: optional interval [s_i, e_i],         presence r_i, demand bytes_i
    cumulative(intervals + fixed_bytes profile) <= budget          at every step
    minimise  sum_i r_i * recompute_cost_i

`evaluate` computes the tightest s/e for given decisions (recompute placed just before its
first reader, as the rewrite does), so the model never claims less memory than that placement.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ortools.sat.python import cp_model

from memcompile.solver.cpsat import run_model

# Recompute costs enter CP-SAT as integers in units of 10 ns; each recompute also costs one unit
# so free recomputes (views) are not chosen gratuitously.
_TIME_UNIT_S = 1e-8


@dataclass(frozen=True)
class ActivationProblem:
    names: tuple[str, ...]  # in topological order
    nbytes: tuple[int, ...]  # storage each candidate owns (0 for views)
    recompute_cost_s: tuple[float, ...]
    can_keep: tuple[bool, ...]
    can_recompute: tuple[bool, ...]
    first_read: tuple[int, ...]  # first backward step reading i directly; num_steps if none
    last_read: tuple[int, ...]  # last backward step reading i or an alias of it; -1 if none
    keep_from: tuple[int, ...]  # first step a kept i is live beyond its forward lifetime
    recompute_from: tuple[int, ...]  # earliest step a recomputed i can start being live extra
    recompute_reads: tuple[tuple[int, ...], ...]  # candidates that recomputing i reads
    view_of: tuple[int, ...]  # index of the candidate whose storage i views, or -1
    fixed_bytes: tuple[int, ...]  # live bytes per step that no decision changes

    def __post_init__(self) -> None:
        n = len(self.names)
        for name in ("nbytes", "recompute_cost_s", "can_keep", "can_recompute", "first_read",
                     "last_read", "keep_from", "recompute_from", "recompute_reads", "view_of"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"ActivationProblem.{name} has {len(getattr(self, name))} entries, expected {n}")

    @property
    def num_steps(self) -> int:
        return len(self.fixed_bytes)

    def needed_by_backward(self, i: int) -> bool:
        return self.first_read[i] < self.num_steps

    def readers(self) -> list[list[int]]:
        """For each candidate, the candidates whose recomputation reads it."""
        out: list[list[int]] = [[] for _ in self.names]
        for c, reads in enumerate(self.recompute_reads):
            for i in reads:
                out[i].append(c)
        return out


@dataclass(frozen=True)
class ActivationSolution:
    keep: frozenset[int]
    recompute: frozenset[int]
    model_peak_bytes: int  # peak under the model with the tightest placement
    added_time_s: float
    status: str  # "fits" | "optimal" | "feasible" | "fallback" | "infeasible"
    lower_bound_s: float
    solve_s: float

    @property
    def gap(self) -> float:
        if self.added_time_s <= 0:
            return 0.0
        return max(0.0, (self.added_time_s - self.lower_bound_s) / self.added_time_s)


def placement(problem: ActivationProblem, recompute: frozenset[int]) -> tuple[list[int], list[int]]:
    """Tightest (start, end) step of every candidate given what is recomputed: a recomputed
    tensor starts just before its first reader (direct, or a recomputed candidate reading it)
    and ends at its last one. Defined for all candidates so it can seed the solver too."""
    readers = problem.readers()
    last = problem.num_steps - 1
    start = [0] * len(problem.names)
    end = [0] * len(problem.names)
    for i in reversed(range(len(problem.names))):  # readers come after what they read
        s, e = problem.first_read[i], problem.last_read[i]
        for c in readers[i]:
            if c in recompute:
                s = min(s, start[c])
                e = max(e, end[c] if problem.view_of[c] == i else start[c])
        start[i] = min(max(s, problem.recompute_from[i]), last)
        end[i] = min(e, last)
    return start, end


def live_spans(problem: ActivationProblem, keep: frozenset[int], recompute: frozenset[int]) -> dict[int, tuple[int, int]]:
    """Extra live step range of each chosen candidate, recomputation placed as late as possible."""
    start, end = placement(problem, recompute)
    spans = {i: (problem.keep_from[i], end[i]) for i in keep}
    # A recompute that could only start after the end (forward lifetime covers it) adds nothing.
    spans.update({i: ((start[i], end[i]) if problem.recompute_from[i] < problem.num_steps else (1, 0))
                  for i in recompute})
    return spans


def evaluate(problem: ActivationProblem, keep: frozenset[int], recompute: frozenset[int]) -> tuple[int, float]:
    """(modelled peak bytes, added time) of a decision set."""
    diff = [0] * (problem.num_steps + 1)
    for i, (a, b) in live_spans(problem, keep, recompute).items():
        if a <= b:
            diff[a] += problem.nbytes[i]
            diff[b + 1] -= problem.nbytes[i]
    peak = running = 0
    for t, fixed in enumerate(problem.fixed_bytes):
        running += diff[t]
        peak = max(peak, fixed + running)
    return peak, sum(problem.recompute_cost_s[i] for i in recompute)


def is_consistent(problem: ActivationProblem, keep: frozenset[int], recompute: frozenset[int]) -> bool:
    """Every needed candidate is kept or recomputed, once, only where allowed, nothing extra."""
    if keep & recompute:
        return False
    needed = {i for i in range(len(problem.names)) if problem.needed_by_backward(i)}
    for c in recompute:
        needed.update(problem.recompute_reads[c])
    return (
        needed == set(keep | recompute)
        and all(problem.can_keep[i] for i in keep)
        and all(problem.can_recompute[i] for i in recompute)
    )


def close_decisions(problem: ActivationProblem, prefer_recompute: set[int]) -> tuple[frozenset[int], frozenset[int]]:
    """Complete a preference into a consistent plan: needed candidates in `prefer_recompute` (or
    that cannot be kept) are recomputed, the rest kept. Walks readers before what they read."""
    needed = {i for i in range(len(problem.names)) if problem.needed_by_backward(i)}
    keep: set[int] = set()
    recompute: set[int] = set()
    for i in reversed(range(len(problem.names))):
        if i not in needed:
            continue
        if (i in prefer_recompute or not problem.can_keep[i]) and problem.can_recompute[i]:
            recompute.add(i)
            needed.update(problem.recompute_reads[i])
        else:
            keep.add(i)
    return frozenset(keep), frozenset(recompute)


def _peak_step(problem: ActivationProblem, spans: dict[int, tuple[int, int]]) -> tuple[int, int]:
    diff = [0] * (problem.num_steps + 1)
    for i, (a, b) in spans.items():
        if a <= b:
            diff[a] += problem.nbytes[i]
            diff[b + 1] -= problem.nbytes[i]
    best_t, best, running = 0, -1, 0
    for t, fixed in enumerate(problem.fixed_bytes):
        running += diff[t]
        if fixed + running > best:
            best_t, best = t, fixed + running
    return best_t, best


def greedy_plan(problem: ActivationProblem, budget_bytes: int) -> tuple[frozenset[int], frozenset[int]]:
    """Start from keeping everything; while the peak is over budget, recompute the kept tensor
    live at the peak step with the most bytes per second of recompute. Always a consistent plan;
    returns the first under budget, else the one with the least peak seen."""
    prefer: set[int] = set()
    plan = close_decisions(problem, prefer)
    best_plan, best_peak = plan, None
    for _ in range(len(problem.names) + 1):
        spans = live_spans(problem, *plan)
        t, peak = _peak_step(problem, spans)
        if best_peak is None or peak < best_peak:
            best_plan, best_peak = plan, peak
        if peak <= budget_bytes:
            return plan
        options = [
            i for i in plan[0]
            if problem.can_recompute[i] and problem.nbytes[i] > 0 and i not in prefer
            and spans[i][0] <= t <= spans[i][1]
        ]
        if not options:
            break
        pick = max(options, key=lambda i: (problem.nbytes[i] / (problem.recompute_cost_s[i] + 1e-9), -i))
        prefer.add(pick)
        plan = close_decisions(problem, prefer)
    return best_plan


def _fixed_segments(fixed: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """Maximal runs of equal fixed bytes: (start, end, bytes)."""
    runs: list[tuple[int, int, int]] = []
    for t, b in enumerate(fixed):
        if runs and runs[-1][2] == b and runs[-1][1] == t - 1:
            runs[-1] = (runs[-1][0], t, b)
        else:
            runs.append((t, t, b))
    return runs


def _build_model(problem: ActivationProblem, budget_bytes: int | None):
    """CP-SAT model; with budget None the capacity is a variable to minimise."""
    model = cp_model.CpModel()
    n, horizon = len(problem.names), problem.num_steps
    last = horizon - 1
    keep = [model.NewBoolVar(f"keep_{i}") for i in range(n)]
    recompute = [model.NewBoolVar(f"recompute_{i}") for i in range(n)]
    start = [model.NewIntVar(0, last, f"start_{i}") for i in range(n)]
    end = [model.NewIntVar(-1, last, f"end_{i}") for i in range(n)]
    readers = problem.readers()
    intervals, demands = [], []
    for i in range(n):
        if not problem.can_keep[i]:
            model.Add(keep[i] == 0)
        if not problem.can_recompute[i]:
            model.Add(recompute[i] == 0)
        if problem.needed_by_backward(i):
            model.Add(keep[i] + recompute[i] == 1)
        else:
            model.Add(keep[i] + recompute[i] <= sum(recompute[c] for c in readers[i]))
            for c in readers[i]:
                model.Add(keep[i] + recompute[i] >= recompute[c])
        if problem.recompute_from[i] <= last:
            model.Add(start[i] >= problem.recompute_from[i]).OnlyEnforceIf(recompute[i])
        if problem.first_read[i] < horizon:
            model.Add(start[i] <= problem.first_read[i]).OnlyEnforceIf(recompute[i])
        model.Add(end[i] >= problem.last_read[i])
        for c in readers[i]:
            model.Add(start[i] <= start[c]).OnlyEnforceIf(recompute[c])
            reach = end[c] if problem.view_of[c] == i else start[c]
            model.Add(end[i] >= reach).OnlyEnforceIf(recompute[c])
        if problem.nbytes[i] == 0:
            continue
        if problem.keep_from[i] <= last:
            # A kept i ends no earlier than where its extra span starts (end=start-1: empty span).
            model.Add(end[i] >= problem.keep_from[i] - 1).OnlyEnforceIf(keep[i])
            size = model.NewIntVar(0, horizon, f"keep_size_{i}")
            intervals.append(model.NewOptionalIntervalVar(problem.keep_from[i], size, end[i] + 1, keep[i], f"keep_iv_{i}"))
            demands.append(problem.nbytes[i])
        if problem.recompute_from[i] <= last:
            size = model.NewIntVar(0, horizon, f"recompute_size_{i}")
            intervals.append(model.NewOptionalIntervalVar(start[i], size, end[i] + 1, recompute[i], f"recompute_iv_{i}"))
            demands.append(problem.nbytes[i])
    for a, b, fixed in _fixed_segments(problem.fixed_bytes):
        if fixed:
            intervals.append(model.NewIntervalVar(a, b - a + 1, b + 1, f"fixed_{a}"))
            demands.append(fixed)
    if budget_bytes is None:
        capacity = model.NewIntVar(0, sum(problem.nbytes) + max(problem.fixed_bytes, default=0), "peak")
        model.Minimize(capacity)
    else:
        capacity = budget_bytes
        model.Minimize(sum((int(round(problem.recompute_cost_s[i] / _TIME_UNIT_S)) + 1) * recompute[i] for i in range(n)))
    model.AddCumulative(intervals, demands, capacity)
    return model, keep, recompute, start, end


def _decisions_from(outcome, keep, recompute) -> tuple[frozenset[int], frozenset[int]]:
    value = outcome.solver.Value
    return (frozenset(i for i, v in enumerate(keep) if value(v)),
            frozenset(i for i, v in enumerate(recompute) if value(v)))


def solve_activation_plan(
    problem: ActivationProblem, budget_bytes: int, *, time_limit_s: float = 10.0, workers: int = 2, seed: int = 0,
) -> ActivationSolution:
    """Least added time with modelled peak <= budget; status "infeasible" when none exists."""
    began = time.perf_counter()
    if problem.fixed_bytes and max(problem.fixed_bytes) > budget_bytes:
        return ActivationSolution(frozenset(), frozenset(), max(problem.fixed_bytes), 0.0, "infeasible", 0.0, 0.0)
    greedy = greedy_plan(problem, budget_bytes)
    greedy_peak, greedy_added = evaluate(problem, *greedy)
    model, keep, recompute, start, end = _build_model(problem, budget_bytes)
    if greedy_peak <= budget_bytes:  # warm start from a complete, feasible assignment
        hint_start, hint_end = placement(problem, greedy[1])
        for i in range(len(problem.names)):
            model.AddHint(keep[i], i in greedy[0])
            model.AddHint(recompute[i], i in greedy[1])
            model.AddHint(start[i], hint_start[i])
            model.AddHint(end[i], hint_end[i])
    outcome = run_model(model, time_limit_s=time_limit_s, workers=workers, seed=seed)
    if outcome.has_solution:
        chosen = _decisions_from(outcome, keep, recompute)
        peak, added = evaluate(problem, *chosen)
        if greedy_peak <= budget_bytes and (greedy_added, greedy_peak) < (added, peak):
            chosen, peak, added = greedy, greedy_peak, greedy_added
        bound = added if outcome.status == "optimal" else max(0.0, outcome.lower_bound) * _TIME_UNIT_S
        return ActivationSolution(*chosen, peak, added, outcome.status, min(bound, added), time.perf_counter() - began)
    if greedy_peak <= budget_bytes:  # CP-SAT found nothing in time: the greedy plan is valid
        return ActivationSolution(*greedy, greedy_peak, greedy_added, "fallback", 0.0, time.perf_counter() - began)
    return ActivationSolution(*greedy, greedy_peak, greedy_added, "infeasible", 0.0, time.perf_counter() - began)


def solve_min_peak(problem: ActivationProblem, *, time_limit_s: float = 10.0, workers: int = 2, seed: int = 0) -> ActivationSolution:
    """The decisions with the least modelled peak: the smallest budget this model can meet."""
    began = time.perf_counter()
    model, keep, recompute, _start, _end = _build_model(problem, None)
    # One worker and a deterministic-time limit: the smallest budget we report must be the one
    # a later compile at exactly that budget finds again.
    outcome = run_model(model, time_limit_s=2 * time_limit_s, workers=1, seed=seed,
                        extra_params={"max_deterministic_time": time_limit_s})
    frugal = close_decisions(problem, prefer_recompute=set(range(len(problem.names))))
    options = [frugal, greedy_plan(problem, 0)] + ([_decisions_from(outcome, keep, recompute)] if outcome.has_solution else [])
    best = min(options, key=lambda d: evaluate(problem, *d))
    peak, added = evaluate(problem, *best)
    status = outcome.status if outcome.has_solution and best is options[-1] else "fallback"
    return ActivationSolution(*best, peak, added, status, 0.0, time.perf_counter() - began)
