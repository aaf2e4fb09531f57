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


def step_loads(
    problem: ActivationProblem, keep: frozenset[int], recompute: frozenset[int],
    placed: tuple[list[int], list[int]] | None = None,
) -> list[int]:
    """Modelled peak bytes at every step, on the same fine time grid as the CP-SAT model.

    Recomputed tensors that start at step t run, in topological order, just before t's node (as
    the rewrite places them): slot t*S + i for candidate i, the node at slot t*S + S - 1. A tensor
    is live from its (re)computation or the end of its forward life to its last reader's slot,
    so a chain's members are live one after another. `placed` is `placement(problem, recompute)`
    when the caller has it already.
    """
    start, _ = placed or placement(problem, recompute)
    ends = fine_ends(problem, recompute, start)
    horizon, scale = problem.num_steps, len(problem.names) + 1
    diff: dict[int, int] = {}

    def add(nbytes: int, a: int, b: int) -> None:
        if nbytes and a <= b:
            diff[a] = diff.get(a, 0) + nbytes
            diff[b + 1] = diff.get(b + 1, 0) - nbytes

    for i in keep:
        if problem.keep_from[i] < horizon:
            add(problem.nbytes[i], problem.keep_from[i] * scale, ends[i])
    for i in recompute:
        if problem.recompute_from[i] < horizon:  # else its forward lifetime covers the whole step
            add(problem.nbytes[i], start[i] * scale + i, ends[i])
    slots = sorted(diff)
    loads, running, k = [], 0, 0
    for t in range(horizon):
        while k < len(slots) and slots[k] <= t * scale:
            running += diff[slots[k]]
            k += 1
        most = running
        while k < len(slots) and slots[k] < (t + 1) * scale:
            running += diff[slots[k]]
            most = max(most, running)
            k += 1
        loads.append(problem.fixed_bytes[t] + most)
    return loads


def evaluate(problem: ActivationProblem, keep: frozenset[int], recompute: frozenset[int]) -> tuple[int, float]:
    """(modelled peak bytes, added time) of a decision set."""
    loads = step_loads(problem, keep, recompute)
    return max(loads, default=0), sum(problem.recompute_cost_s[i] for i in recompute)


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


def greedy_plan(problem: ActivationProblem, budget_bytes: int) -> tuple[frozenset[int], frozenset[int]]:
    """Start from keeping everything; while the peak is over budget, recompute the kept tensor
    live at the peak step with the most bytes per second of recompute. Always a consistent plan;
    returns the first under budget, else the one with the least peak seen."""
    prefer: set[int] = set()
    plan = close_decisions(problem, prefer)
    best_plan, best_peak = plan, None
    for _ in range(len(problem.names) + 1):
        placed = placement(problem, plan[1])
        loads = step_loads(problem, *plan, placed=placed)
        end = placed[1]
        t = max(range(len(loads)), key=loads.__getitem__)
        peak = loads[t]
        if best_peak is None or peak < best_peak:
            best_plan, best_peak = plan, peak
        if peak <= budget_bytes:
            return plan
        options = [
            i for i in plan[0]
            if problem.can_recompute[i] and problem.nbytes[i] > 0 and i not in prefer
            and problem.keep_from[i] <= t <= end[i]
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


def fine_ends(problem: ActivationProblem, recompute: frozenset[int], start: list[int]) -> list[int]:
    """End of each candidate's live span on the solver's fine time grid (see `_build_model`)."""
    scale = len(problem.names) + 1
    readers = problem.readers()
    ends = [-1] * len(problem.names)
    for i in reversed(range(len(problem.names))):
        e = problem.last_read[i] * scale + scale - 1 if problem.last_read[i] >= 0 else -1
        for c in readers[i]:
            if c in recompute:
                e = max(e, ends[c] if problem.view_of[c] == i else start[c] * scale + c)
        ends[i] = e
    return ends


def _build_model(problem: ActivationProblem, budget_bytes: int | None):
    """CP-SAT model; with budget None the capacity is a variable to minimise.

    Time is fine-grained so the model matches `step_loads`: step t spans slots
    [t*S, t*S + S) with S = candidates + 1; a candidate i recomputed for step t runs at slot
    t*S + i (candidates are in topological order, so a chain runs in order) and the step's own
    node at slot t*S + S - 1.
    """
    model = cp_model.CpModel()
    n, horizon = len(problem.names), problem.num_steps
    last = horizon - 1
    scale = n + 1
    keep = [model.NewBoolVar(f"keep_{i}") for i in range(n)]
    recompute = [model.NewBoolVar(f"recompute_{i}") for i in range(n)]
    start = [model.NewIntVar(0, last, f"start_{i}") for i in range(n)]  # step of recomputation
    end = [model.NewIntVar(-1, horizon * scale, f"end_{i}") for i in range(n)]  # fine slot
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
        # The rewrite runs a recomputation just before its first reader: start is exactly
        # max(recompute_from, min(first direct read, starts of recomputed readers)), as `placement`.
        first_need = [min(problem.first_read[i], horizon)]
        for c in readers[i]:
            need_c = model.NewIntVar(0, horizon, f"need_{i}_{c}")
            model.Add(need_c == start[c]).OnlyEnforceIf(recompute[c])
            model.Add(need_c == horizon).OnlyEnforceIf(recompute[c].Not())
            first_need.append(need_c)
        earliest = model.NewIntVar(0, horizon, f"earliest_{i}")
        model.AddMinEquality(earliest, first_need)
        placed = model.NewIntVar(0, horizon, f"placed_{i}")
        model.AddMaxEquality(placed, [earliest, min(problem.recompute_from[i], horizon)])
        model.AddMinEquality(start[i], [placed, last])
        if problem.last_read[i] >= 0:
            model.Add(end[i] >= problem.last_read[i] * scale + scale - 1)
        for c in readers[i]:
            reach = end[c] if problem.view_of[c] == i else start[c] * scale + c
            model.Add(end[i] >= reach).OnlyEnforceIf(recompute[c])
        if problem.nbytes[i] == 0:
            continue
        if problem.keep_from[i] <= last:
            first_slot = problem.keep_from[i] * scale
            model.Add(end[i] >= first_slot - 1).OnlyEnforceIf(keep[i])
            size = model.NewIntVar(0, horizon * scale, f"keep_size_{i}")
            intervals.append(model.NewOptionalIntervalVar(first_slot, size, end[i] + 1, keep[i], f"keep_iv_{i}"))
            demands.append(problem.nbytes[i])
        if problem.recompute_from[i] <= last:
            size = model.NewIntVar(0, horizon * scale, f"recompute_size_{i}")
            intervals.append(model.NewOptionalIntervalVar(start[i] * scale + i, size, end[i] + 1, recompute[i],
                                                          f"recompute_iv_{i}"))
            demands.append(problem.nbytes[i])
    for a, b, fixed in _fixed_segments(problem.fixed_bytes):
        if fixed:
            intervals.append(model.NewIntervalVar(a * scale, (b - a + 1) * scale, (b + 1) * scale, f"fixed_{a}"))
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
    best = greedy if greedy_peak <= budget_bytes else None
    best_status, lower_s = "fallback", 0.0
    target = budget_bytes
    # CP-SAT may spread a recompute chain over earlier steps, which `evaluate` (the rewrite's
    # placement) does not: accept its answer only when `evaluate` agrees, else ask for less.
    while time.perf_counter() - began < 0.9 * time_limit_s:
        model, keep, recompute, start, end = _build_model(problem, target)
        hint = best or greedy
        hint_start, _ = placement(problem, hint[1])
        hint_end = fine_ends(problem, hint[1], hint_start)
        for i in range(len(problem.names)):
            model.AddHint(keep[i], i in hint[0])
            model.AddHint(recompute[i], i in hint[1])
            model.AddHint(start[i], hint_start[i])
            model.AddHint(end[i], hint_end[i])
        remaining = time_limit_s - (time.perf_counter() - began)
        outcome = run_model(model, time_limit_s=remaining, workers=workers, seed=seed)
        if not outcome.has_solution:
            if outcome.status == "infeasible" and target == budget_bytes and best is None:
                return ActivationSolution(*greedy, greedy_peak, greedy_added, "infeasible", 0.0, time.perf_counter() - began)
            break
        chosen = _decisions_from(outcome, keep, recompute)
        peak, added = evaluate(problem, *chosen)
        if peak <= budget_bytes:
            if best is None or added <= evaluate(problem, *best)[1]:
                best = chosen
                proven = outcome.status == "optimal" and target == budget_bytes
                best_status = "optimal" if proven else "feasible"
                lower_s = added if proven else max(0.0, outcome.lower_bound) * _TIME_UNIT_S
            break
        target -= peak - budget_bytes
    if best is None:
        return ActivationSolution(*greedy, greedy_peak, greedy_added, "infeasible", 0.0, time.perf_counter() - began)
    peak, added = evaluate(problem, *best)
    return ActivationSolution(*best, peak, added, best_status, min(lower_s, added), time.perf_counter() - began)


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
    # The status speaks of the peak, not of time: this plan minimises memory, then stops.
    status = f"least_peak_{outcome.status if outcome.has_solution and best is options[-1] else 'fallback'}"
    return ActivationSolution(*best, peak, added, status, 0.0, time.perf_counter() - began)
