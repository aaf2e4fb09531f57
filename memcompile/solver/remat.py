"""Rematerialization under a memory budget: problem, loaders, checker and CP-SAT solver.

Semantics (shared by `baseline_schedule`, `simulate` and `solve_remat`):

* A schedule is a sequence of ("compute", v) / ("free", v) events starting from empty memory.
* ("compute", v) needs every predecessor of v resident and v itself not resident; while v runs,
  memory = static_bytes + bytes of resident tensors + size(v); afterwards v is resident.
* The first computation of every node follows the problem's node order (a topological order);
  computing a node again after freeing it (recomputation) is allowed when `recomputable[v]`.
* Peak = max memory over compute events; cost = sum of compute costs over compute events.
* Outputs are not pinned: a sink may be freed right after it is computed (the baseline does so).

Formulation (after Bartan et al., "Moccasin", ICML 2023; written from the paper, not their code):
time is a grid of stages; node i's first computation is at stage (i+1)*K-1 (K = substeps per node,
1 for large graphs). Each node owns up to C "retention intervals" [start, end] of stages: the first
starts at its first stage, later ones are recomputations. An interval may start only at a stage
where every predecessor has an interval covering it. A cumulative constraint bounds the bytes of
intervals covering each stage. The emitted schedule, per stage, computes the starting intervals in
node order, then frees the ending ones, so memory at the stage's last compute is exactly the
cumulative's load at that stage: the model's memory accounting is exact for what we emit.
Because C and the stage grid restrict the schedules, the CP-SAT bound is a lower bound on cost
*within this formulation*; small graphs get a grid fine enough to contain the optimal schedules.
The reported `lower_bound` is the larger of that and `proven_cost_bound`, which holds for every
schedule (per-stage knapsack, an LP covering all over-budget first computations with one
recomputation per window between a tensor's readers, and a CP-SAT "stage-closure" model on the
worst first computations), raised by `input_aware_cover_bound` (an LP that also charges the inputs
of recomputations), computed in a forked process beside the search. Found schedules are polished
event by event (`remat_events.free_early`, `undo_evictions`).
CP-SAT runs in two phases (`_two_phase_solve`): a short one with objective lower-bound search
(proves the Checkmate graphs fast), then default search warm-started from its best solution.
Models with more than `_LARGE_MODEL` input-cover literals skip CP-SAT (building and presolving
alone took ~15 s at 1000 nodes): greedy variants, then a repair search (`_improve_by_repair`),
then CP-SAT on small windows of the model with everything else fixed (`_improve_by_windows`).
When the greedy finds no plan on one stage per node (near the least peak, where recomputation
chains must be freed inside a stage), grids with 2 then 3 substeps per node are tried; when none
yields a schedule, `remat_events` schedules event by event with eviction instead.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence, cast

import networkx as nx
import numpy as np  # installed with ortools
from ortools.sat.python import cp_model

from .cpsat import DEFAULT_SEED, DEFAULT_WORKERS, SolveOutcome, run_model
from .remat_events import best_eviction_schedule, free_early, undo_evictions
from .remat_problem import Event, InvalidSchedule, RematProblem, Schedule, simulate

# ----------------------------------------------------------------------------------- results


@dataclass(frozen=True)
class RematResult:
    """Outcome of `solve_remat`.

    status: "optimal" (proven within the formulation, or the proven bound reaches the cost,
    however the schedule was found), "feasible" (CP-SAT schedule, gap > 0),
    "heuristic" (model too large for CP-SAT in time: greedy + repair search, gap vs proven bound),
    "heuristic_events" (the stage grid found no schedule: event-level eviction schedule from
    `remat_events`, gap vs proven bound),
    "timeout_fallback" (CP-SAT found nothing better in time; greedy schedule returned),
    "infeasible" (budget below a proven lower bound on the minimum peak),
    "infeasible_in_model" (CP-SAT proved no schedule exists within the formulation and the greedy
    failed), "no_schedule" (nothing found before the time limit).
    lower_bound: with a schedule, a lower bound on cost within the formulation (what "optimal" and
    `gap` refer to); without one, the best proven lower bound on the minimum achievable peak.
    proven_lower_bound: a lower bound on the cost of *every* valid schedule under the budget
    (`proven_cost_bound`), not only those the stage grid can express; `proven_gap` is measured
    against it. Both gaps are (cost - bound) / cost.
    """

    schedule: Schedule
    peak: int
    cost: float
    lower_bound: float
    status: str
    solve_s: float
    gap: float
    peak_lower_bound: int = 0
    proven_lower_bound: float = 0.0

    @property
    def proven_gap(self) -> float:
        if not self.schedule:
            return math.inf
        return 0.0 if self.cost == 0 else max(0.0, (self.cost - self.proven_lower_bound) / self.cost)

    @property
    def has_schedule(self) -> bool:
        return bool(self.schedule)


# ----------------------------------------------------------------------------------- loaders

_FORMATS = (
    # (link source key, link target key, compute-cost attribute, bytes attribute)
    ("source", "target", "cost_cpu", "cost_ram"),  # Checkmate export
    ("0", "1", "duration", "out_cost"),  # Moccasin random layered graphs
)


def load_networkx(path: str | Path) -> nx.DiGraph:
    """Read a node-link JSON graph, recognising its link keys from the content."""
    data = json.loads(Path(path).read_text())
    links = data.get("links", data.get("edges", []))
    source, target = ("0", "1") if links and "0" in links[0] else ("source", "target")
    nodes = data.get("nodes", [])
    node_key = "id" if not nodes or "id" in nodes[0] else "name"
    edges_key = "links" if "links" in data else "edges"
    return nx.node_link_graph(data, edges=edges_key, source=source, target=target, name=node_key)


def problem_from_networkx(graph: nx.DiGraph) -> RematProblem:
    """Build a problem from either benchmark format (recognised by node attributes)."""
    cost_attr, size_attr = _detect_attributes(graph)
    order = list(graph.graph["order"]) if "order" in graph.graph else list(nx.topological_sort(graph))
    index = {v: i for i, v in enumerate(order)}
    if len(index) != graph.number_of_nodes() or set(index) != set(graph.nodes):
        raise ValueError("graph order must list every node exactly once")
    preds = []
    for v in order:
        ps = sorted(index[u] for u in graph.predecessors(v))
        if ps and ps[-1] >= index[v]:
            raise ValueError(f"order is not topological at node {v!r}")
        preds.append(tuple(ps))
    attrs = [graph.nodes[v] for v in order]
    return RematProblem(
        names=tuple(str(v) for v in order),
        preds=tuple(preds),
        cost=tuple(_as_number(a[cost_attr]) for a in attrs),
        size=tuple(int(a[size_attr]) for a in attrs),
    )


def load_graph(path: str | Path) -> RematProblem:
    return problem_from_networkx(load_networkx(path))


def _detect_attributes(graph: nx.DiGraph) -> tuple[str, str]:
    for _, _, cost_attr, size_attr in _FORMATS:
        if all(cost_attr in d and size_attr in d for _, d in graph.nodes(data=True)):
            return cost_attr, size_attr
    raise ValueError("unrecognised graph: nodes need cost_cpu/cost_ram or duration/out_cost")


def _as_number(x: object) -> float:
    value = float(x)  # type: ignore[arg-type]
    return int(value) if value.is_integer() else value


# ------------------------------------------------------------------------ checker & baseline


def baseline_schedule(problem: RematProblem) -> Schedule:
    """Node order, no recomputation, every tensor freed right after its last use (sinks at once)."""
    last_use = [max(s, default=v) for v, s in enumerate(problem.succs)]
    events: list[Event] = []
    for v in range(problem.n):
        events.append(("compute", v))
        events.extend(("free", u) for u in problem.preds[v] if last_use[u] == v)
        if last_use[v] == v:
            events.append(("free", v))
    return tuple(events)


def peak_lower_bound(problem: RematProblem) -> int:
    """Proven lower bound on the peak of any valid schedule.

    Computing v needs v's inputs resident; and when the last of those inputs (u) was computed,
    the other inputs of v and all inputs of u were resident too.
    """
    size = problem.size
    best = 0
    for v, ps in enumerate(problem.preds):
        best = max(best, size[v] + sum(size[u] for u in ps))
        if ps:
            last_input = min(size[u] + sum(size[w] for w in set(problem.preds[u]) | (set(ps) - {u})) for u in ps)
            best = max(best, last_input)
    return best + problem.static_bytes


# ------------------------------------------------------------------------- stage-grid plans


@dataclass(frozen=True)
class _Grid:
    """Stage grid: node v is first computed at stage first[v]; horizon stages in total."""

    substeps: int
    max_computations: tuple[int, ...]  # C per node
    horizon: int

    def first(self, v: int) -> int:
        return (v + 1) * self.substeps - 1


@dataclass(frozen=True)
class _Interval:
    node: int
    start: int
    end: int  # inclusive: resident over stages start..end, freed after stage `end`


def _make_grid(problem: RematProblem, substeps: int | None, max_computations: int | None) -> _Grid:
    small = problem.n <= 8  # tiny graphs: a grid fine enough to hold the optimal schedules
    k = substeps or (problem.n if small else 1)
    c = max_computations or (max(2, problem.n) if small else 2)
    k = max(1, k)
    horizon = problem.n * k
    per_node = tuple(_computations_allowed(problem, v, c, (v + 1) * k - 1, horizon) for v in range(problem.n))
    return _Grid(substeps=k, max_computations=per_node, horizon=horizon)


def _computations_allowed(problem: RematProblem, v: int, c: int, first: int, horizon: int) -> int:
    # Presolve: recomputing a sink, a size-0 tensor or a pinned node never helps / is not allowed,
    # and a recomputation needs a free stage between it and the first computation.
    if not problem.may_recompute[v] or not problem.succs[v] or problem.size[v] == 0:
        return 1
    return c if first + 2 <= horizon - 1 else 1


def _intervals_from_computes(problem: RematProblem, computes: Sequence[Sequence[int]]) -> list[_Interval]:
    """Shortest retention intervals for given compute stages (each sorted, first = first stage).

    Every compute of w at stage s is served by the latest compute of each input at stage <= s;
    that input stays resident until its last such use.
    """
    ends = [list(cs) for cs in computes]
    for w, stages in enumerate(computes):
        for u in problem.preds[w]:
            cu = computes[u]
            for s in stages:
                k = bisect.bisect_right(cu, s) - 1
                if ends[u][k] < s:
                    ends[u][k] = s
    return [_Interval(v, s, e) for v, cs in enumerate(computes) for s, e in zip(cs, ends[v])]


def _schedule_from_intervals(intervals: Iterable[_Interval]) -> Schedule:
    """Per stage: compute the starting intervals in node order, then free the ending ones."""
    by_stage: dict[int, tuple[list[int], list[int]]] = {}
    for iv in intervals:
        by_stage.setdefault(iv.start, ([], []))[0].append(iv.node)
        by_stage.setdefault(iv.end, ([], []))[1].append(iv.node)
    events: list[Event] = []
    for stage in sorted(by_stage):
        starts, ends = by_stage[stage]
        events.extend(("compute", v) for v in sorted(starts))
        events.extend(("free", v) for v in sorted(ends))
    return tuple(events)


def _stage_loads(problem: RematProblem, intervals: Iterable[_Interval], horizon: int) -> list[int]:
    diff = [0] * (horizon + 1)
    for iv in intervals:
        diff[iv.start] += problem.size[iv.node]
        diff[iv.end + 1] -= problem.size[iv.node]
    loads, running = [], 0
    for d in diff[:horizon]:
        running += d
        loads.append(running)
    return loads


# ------------------------------------------------------------------------------ greedy plan


def _greedy_computes(
    problem: RematProblem,
    grid: _Grid,
    capacity: int,
    deadline: float,
    thorough: bool,
    start: list[list[int]] | None = None,
    chains: bool = False,
) -> list[list[int]] | None:
    """Repair the no-recompute plan until every stage fits `capacity` (bytes, static excluded).

    Visiting stages from the most loaded down, free a tensor that is idle there and recompute it
    at its next use; pick the split with the least cost per byte-stage of overflow removed (inputs
    that must then live until the recomputation are charged). Returns compute stages per node, or
    None if no split reduces the overflow. `thorough=False` only looks at the most loaded stage
    and at bytes saved there: much faster on large graphs, but it gets stuck more often.
    `start`: repair this plan instead of the no-recompute one. `chains` (thorough only): also
    splits that recompute the inputs along instead of holding them (near the least peak).
    """
    computes = [list(stages) for stages in start] if start else [[grid.first(v)] for v in range(problem.n)]
    while time.monotonic() < deadline:
        intervals = _intervals_from_computes(problem, computes)
        loads = _stage_loads(problem, intervals, grid.horizon)
        overloaded = sorted((t for t in range(grid.horizon) if loads[t] > capacity), key=lambda t: -loads[t])
        if not overloaded:
            return _prune_recomputations(problem, grid, _merge_adjacent(problem, computes), capacity, deadline)
        if thorough:
            split = _first_useful_split(problem, grid, computes, intervals, loads, capacity, overloaded, chains)
        else:
            split = _best_split_at(problem, grid, computes, intervals, overloaded[0])
        if split is None:
            return None
        v, stage, chain = split
        for w in (v, *chain):
            bisect.insort(computes[w], stage)
    return None


def _improve_by_repair(
    problem: RematProblem,
    grid: _Grid,
    plan: list[list[int]],
    capacity: int,
    deadline: float,
    seed: int,
    chains: bool = False,
) -> list[list[int]]:
    """Large-neighbourhood search: drop the recomputations in a random stage window, repair.

    Stops at the deadline or after `_LNS_PATIENCE` windows in a row without a cheaper plan.
    """
    rng = random.Random(seed)
    best, best_cost = plan, _plan_cost(problem, plan)
    stale = 0
    while time.monotonic() < deadline and stale < _LNS_PATIENCE:
        extra = [s for stages in best for s in stages[1:]]
        if not extra:
            break
        centre = rng.choice(extra)
        width = rng.randint(1, max(1, grid.horizon // 10))
        trial = [[s for i, s in enumerate(stages) if i == 0 or abs(s - centre) > width] for stages in best]
        repaired = _greedy_computes(problem, grid, capacity, deadline, True, start=trial, chains=chains)
        if repaired is not None and _plan_cost(problem, repaired) < best_cost - 1e-9:
            best, best_cost, stale = repaired, _plan_cost(problem, repaired), 0
        else:
            stale += 1
    return best


def _merge_adjacent(problem: RematProblem, plan: list[list[int]]) -> list[list[int]]:
    """Drop a recomputation that starts right after the node's previous interval ends.

    Same memory at every stage (the node is resident on both sides), one computation less, and
    the CP-SAT model (which wants a free stage between intervals) accepts the plan as a hint.
    """
    while True:
        intervals = _intervals_from_computes(problem, plan)
        ends: dict[tuple[int, int], int] = {(iv.node, iv.start): iv.end for iv in intervals}
        merged = [
            [s for i, s in enumerate(stages) if i == 0 or ends[(v, stages[i - 1])] < s - 1]
            for v, stages in enumerate(plan)
        ]
        if merged == plan:
            return plan
        plan = merged


def _plan_cost(problem: RematProblem, plan: list[list[int]]) -> float:
    return sum(problem.cost[v] * len(stages) for v, stages in enumerate(plan))


def _prune_recomputations(
    problem: RematProblem, grid: _Grid, computes: list[list[int]], capacity: int, deadline: float
) -> list[list[int]]:
    """Drop recomputations that later splits made redundant (most expensive first)."""
    extra = sorted(
        ((v, s) for v, cs in enumerate(computes) for s in cs[1:]), key=lambda vs: (-problem.cost[vs[0]], vs)
    )
    for v, stage in extra:
        if time.monotonic() > deadline:
            break
        trial = [cs for cs in computes]
        trial[v] = [s for s in computes[v] if s != stage]
        intervals = _intervals_from_computes(problem, trial)
        mine = [iv for iv in intervals if iv.node == v]
        if any(b.start < a.end + 2 for a, b in zip(mine, mine[1:])):
            continue  # the model requires a free stage between intervals; keep the hint feasible
        if max(_stage_loads(problem, intervals, grid.horizon), default=0) <= capacity:
            computes = trial
    return computes


def _first_useful_split(
    problem: RematProblem,
    grid: _Grid,
    computes: list[list[int]],
    intervals: list[_Interval],
    loads: list[int],
    capacity: int,
    overloaded: list[int],
    chains: bool = False,
) -> tuple[int, int, tuple[int, ...]] | None:
    """Cheapest split per byte-stage of overflow removed at one of the worst stages. `chains`:
    also splits whose inputs (freed before that stage) are recomputed along with them."""
    uses = _use_stages(problem, computes)
    by_node: dict[int, list[_Interval]] = {}
    for iv in intervals:
        by_node.setdefault(iv.node, []).append(iv)
    excess = np.asarray(loads, dtype=np.int64) - capacity
    for t in overloaded[:5]:  # the worst stages first; a few suffice to find progress
        best: tuple[float, int, int, tuple[int, ...]] | None = None
        for iv in intervals:
            v = iv.node
            if not (iv.start < t < iv.end) or t in uses[v] or len(computes[v]) >= grid.max_computations[v]:
                continue  # not idle at t, or no recomputation left
            next_use = min(s for s in uses[v] if s > t)
            last_use = max([s for s in uses[v] if iv.start <= s < t], default=iv.start)
            # Recomputing a little before the next use can keep the inputs off that (busy) stage.
            for redo in range(next_use, max(t, next_use - 2), -1):
                options: list[tuple[int, ...]] = [()]
                if chains:
                    chain = _chainable_inputs(problem, grid, by_node, computes, v, t, redo)
                    options += [chain] if chain else []
                for chain in options:
                    removed = _overflow_removed(problem, by_node, computes, excess, v, last_use, redo, chain)
                    if removed > 0:
                        score = (problem.cost[v] + sum(problem.cost[u] for u in chain)) / removed
                        if best is None or (score, v, -redo) < (best[0], best[1], -best[2]):
                            best = (score, v, redo, chain)
        if best is not None:
            return best[1], best[2], best[3]
    return None


def _chainable_inputs(
    problem: RematProblem,
    grid: _Grid,
    by_node: Mapping[int, list[_Interval]],
    computes: list[list[int]],
    v: int,
    t: int,
    redo: int,
) -> tuple[int, ...]:
    """Inputs of v that would have to stay resident over stage t for v's recomputation at `redo`
    and can instead be recomputed at `redo` too (a recomputation chain; near the least peak,
    dragging them is what leaves no split that removes overflow)."""
    chain = []
    for u in problem.preds[v]:
        k = bisect.bisect_right(computes[u], redo) - 1
        held = by_node[u][k]
        if held.end < t and redo not in computes[u] and len(computes[u]) < grid.max_computations[u]:
            chain.append(u)
    return tuple(chain)


def _best_split_at(
    problem: RematProblem, grid: _Grid, computes: list[list[int]], intervals: list[_Interval], t: int
) -> tuple[int, int, tuple[int, ...]] | None:
    """Cheapest split per byte saved at stage t (inputs dragged onto stage t are charged)."""
    uses = _use_stages(problem, computes)
    by_node: dict[int, list[_Interval]] = {}
    for iv in intervals:
        by_node.setdefault(iv.node, []).append(iv)
    best: tuple[float, int, int] | None = None
    for iv in intervals:
        v = iv.node
        if not (iv.start < t < iv.end) or t in uses[v] or len(computes[v]) >= grid.max_computations[v]:
            continue
        next_use = min(s for s in uses[v] if s > t)
        dragged = 0
        for u in problem.preds[v]:
            inp = by_node[u][bisect.bisect_right(computes[u], next_use) - 1]
            if inp.end < t <= next_use and inp.start <= t:
                dragged += problem.size[u]
        saved = problem.size[v] - dragged
        if saved > 0 and (best is None or (problem.cost[v] / saved, v) < (best[0], best[1])):
            best = (problem.cost[v] / saved, v, next_use)
    return None if best is None else (best[1], best[2], ())


def _use_stages(problem: RematProblem, computes: list[list[int]]) -> list[set[int]]:
    uses: list[set[int]] = [set() for _ in range(problem.n)]
    for w, stages in enumerate(computes):
        for u in problem.preds[w]:
            uses[u].update(stages)
    return uses


def _overflow_removed(
    problem: RematProblem,
    by_node: Mapping[int, list[_Interval]],
    computes: list[list[int]],
    excess: np.ndarray,
    v: int,
    last_use: int,
    redo: int,
    chain: tuple[int, ...] = (),
) -> int:
    """Byte-stages over capacity removed by freeing v after `last_use`, recomputing it at `redo`
    (with the inputs in `chain` recomputed at `redo` as well, their own inputs held until then).

    `excess` is load minus capacity per stage (numpy: this runs for every candidate split).
    """
    dragged = []  # inputs must now stay resident until the recomputation
    for u in problem.preds[v]:
        if u in chain:
            dragged.append((redo, problem.size[u]))
            for w in problem.preds[u]:
                k = bisect.bisect_right(computes[w], redo) - 1
                if by_node[w][k].end + 1 <= redo:
                    dragged.append((by_node[w][k].end + 1, problem.size[w]))
            continue
        k = bisect.bisect_right(computes[u], redo) - 1
        if by_node[u][k].end + 1 <= redo:
            dragged.append((by_node[u][k].end + 1, problem.size[u]))
    low = min([last_use + 1] + [start for start, _ in dragged])
    delta = np.zeros(redo + 1 - low, dtype=np.int64)
    delta[last_use + 1 - low : redo - low] -= problem.size[v]
    for start, size in dragged:
        delta[start - low :] += size
    window = excess[low : redo + 1]
    return int(np.maximum(window, 0).sum() - np.maximum(window + delta, 0).sum())


# ---------------------------------------------------------------------------- CP-SAT model


@dataclass(frozen=True)
class _SlotVars:
    node: int
    start: cp_model.IntVar | int
    end: cp_model.IntVar
    present: cp_model.IntVar | bool


@dataclass
class _RematModel:
    model: cp_model.CpModel
    slots: list[list[_SlotVars]]
    cover: dict[tuple[int, int, int, int], cp_model.IntVar] = field(default_factory=dict)  # (v,j,u,k)
    lengths: dict[tuple[int, int], cp_model.IntVar] = field(default_factory=dict)  # (v,j): stages resident


def _build_model(problem: RematProblem, grid: _Grid, capacity: int, cost_scale: int) -> _RematModel:
    model = cp_model.CpModel()
    # Presolve: a sink is freed right after it is computed (nothing reads it).
    slots = [_node_slots(model, grid, v, not problem.succs[v]) for v in range(problem.n)]
    rm = _RematModel(model=model, slots=slots)
    for v in range(problem.n):
        for j, slot in enumerate(slots[v]):
            for u in problem.preds[v]:
                _require_input_resident(rm, slot, j, u)
    _add_memory_limit(problem, rm, capacity, grid.horizon)
    _add_first_compute_covers(problem, rm, capacity)
    model.minimize(
        sum(round(problem.cost[v] * cost_scale) * slot.present for v in range(problem.n) for slot in slots[v][1:])
    )
    return rm


def _node_slots(model: cp_model.CpModel, grid: _Grid, v: int, sink_free_at_once: bool) -> list[_SlotVars]:
    first, last = grid.first(v), grid.horizon - 1
    last_end = first if sink_free_at_once else last
    slots = [_SlotVars(v, first, model.new_int_var(first, last_end, f"e{v}_0"), True)]
    for j in range(1, grid.max_computations[v]):
        present = model.new_bool_var(f"p{v}_{j}")
        start = model.new_int_var(first + 2, last, f"s{v}_{j}")
        end = model.new_int_var(first + 2, last, f"e{v}_{j}")
        prev = slots[-1]
        model.add(end >= start)
        model.add_implication(present, prev.present)
        # A gap of at least one stage: back-to-back intervals are dominated by one longer interval.
        model.add(start >= prev.end + 2).only_enforce_if(present)
        model.add(start == last).only_enforce_if(present.negated())  # pin unused slots (symmetry)
        model.add(end == last).only_enforce_if(present.negated())
        slots.append(_SlotVars(v, start, end, present))
    return slots


def _require_input_resident(rm: _RematModel, slot: _SlotVars, j: int, u: int) -> None:
    """If slot j of v is used, some interval of input u covers its start stage."""
    model = rm.model
    options = []
    for k, inp in enumerate(rm.slots[u]):
        cover = model.new_bool_var(f"c{slot.node}_{j}_{u}_{k}")
        if k > 0:
            model.add_implication(cover, inp.present)
            model.add(inp.start <= slot.start).only_enforce_if(cover)
        model.add(inp.end >= slot.start).only_enforce_if(cover)
        if j > 0:
            model.add_implication(cover, slot.present)
        rm.cover[(slot.node, j, u, k)] = cover
        options.append(cover)
    if j == 0:
        model.add_bool_or(options)
    else:
        model.add_bool_or(options + [cast(cp_model.IntVar, slot.present).negated()])  # a later slot: a variable


def _add_memory_limit(problem: RematProblem, rm: _RematModel, capacity: int, horizon: int) -> None:
    sized = [v for v in range(problem.n) if problem.size[v] > 0]
    unit = math.gcd(*(problem.size[v] for v in sized)) if sized else 1  # smaller numbers, same constraint
    intervals, demands = [], []
    for v in sized:
        for j, slot in enumerate(rm.slots[v]):
            length = rm.model.new_int_var(1, horizon, f"l{v}_{j}")
            rm.lengths[(v, j)] = length
            if j == 0:
                iv = rm.model.new_interval_var(slot.start, length, slot.end + 1, f"i{v}_{j}")
            else:
                iv = rm.model.new_optional_interval_var(slot.start, length, slot.end + 1, slot.present, f"i{v}_{j}")
            intervals.append(iv)
            demands.append(problem.size[v] // unit)
    rm.model.add_cumulative(intervals, demands, capacity // unit)


def _add_first_compute_covers(problem: RematProblem, rm: _RematModel, capacity: int) -> None:
    """Redundant linear cuts that give CP-SAT a real lower bound (the cumulative's LP is weak).

    When node t is first computed, its inputs are resident, and every earlier node that a later
    first computation still reads is resident too unless it gets recomputed (slot 1 present).
    """
    demand_if_never_recomputed = _first_compute_demand(problem)
    for mandatory, optional in demand_if_never_recomputed:
        if mandatory + sum(problem.size[x] for x in optional) <= capacity:
            continue  # the stage fits even if nothing is recomputed
        recomputed = {x: rm.slots[x][1].present for x in optional if len(rm.slots[x]) > 1}
        fixed = sum(problem.size[x] for x in optional if x not in recomputed)
        rm.model.add(
            sum(problem.size[x] * (1 - r) for x, r in recomputed.items()) <= capacity - mandatory - fixed
        )


def _first_compute_demand(problem: RematProblem) -> list[tuple[int, list[int]]]:
    """Per node t: (bytes surely resident at its first computation, nodes resident unless recomputed)."""
    last_use = [max(s, default=v) for v, s in enumerate(problem.succs)]
    live: list[int] = []  # computed before t and read by a first computation after t
    out = []
    for t in range(problem.n):
        inputs = set(problem.preds[t])
        mandatory = problem.size[t] + sum(problem.size[u] for u in inputs)
        out.append((mandatory, [x for x in live if x not in inputs]))
        live = [x for x in live if last_use[x] > t] + ([t] if last_use[t] > t else [])
    return out


def first_compute_cost_bound(problem: RematProblem, budget: int) -> float:
    """Cheap lower bound on cost valid for the real problem (not only the formulation).

    For each first computation separately, the cheapest set of live tensors whose recomputation
    frees enough bytes (fractional knapsack); the maximum over computations, plus one computation
    of every node.
    """
    capacity = budget - problem.static_bytes
    best = 0.0
    for mandatory, optional in _first_compute_demand(problem):
        excess = mandatory + sum(problem.size[x] for x in optional) - capacity
        best = max(best, _fractional_cover_cost(problem, optional, excess))
    return sum(problem.cost) + best


def segment_cover_bound(problem: RematProblem, budget: int) -> float:
    """Lower bound on cost over all first computations at once (LP relaxation; inf: nothing fits).

    A live tensor x that is not resident at node t's first computation must be computed again
    before its next reader r, i.e. between its previous reader (or x) and r. Such windows of one
    tensor are disjoint, so each (x, r) pays cost[x] once however many over-budget first
    computations between them it relieves. Covering every over-budget first computation's excess
    with these recomputations is a relaxation of every schedule under the budget; its LP optimum
    is a lower bound on the recomputation cost. It ignores the inputs a recomputation needs (the
    stage-closure model covers that, one first computation at a time).
    """
    capacity = budget - problem.static_bytes
    readers = [sorted(s) for s in problem.succs]
    rows: list[tuple[int, dict[tuple[int, int], int]]] = []
    for t, (mandatory, live) in enumerate(_first_compute_demand(problem)):
        excess = mandatory + sum(problem.size[x] for x in live) - capacity
        if excess <= 0:
            continue
        relief: dict[tuple[int, int], int] = {}
        for x in live:
            if problem.may_recompute[x] and problem.size[x] > 0:
                next_reader = readers[x][bisect.bisect_right(readers[x], t)]
                relief[(x, next_reader)] = min(problem.size[x], excess)  # one tensor covers at most all
        if sum(relief.values()) < excess:
            return math.inf  # even without every live tensor this first computation does not fit
        rows.append((excess, relief))
    if not rows:
        return float(sum(problem.cost))
    return sum(problem.cost) + _covering_lp_bound(problem, rows)


def _covering_lp_bound(problem: RematProblem, rows: list[tuple[int, dict[tuple[int, int], int]]]) -> float:
    """min sum cost[x] y[x,r] s.t. each row's relief >= its excess, 0 <= y <= 1, bounded via duals.

    GLOP solves the LP; the bound returned is the Lagrangian value of its row duals (any duals
    >= 0 give a valid bound by weak duality), so solver tolerances cannot make it overshoot.
    """
    from ortools.linear_solver import pywraplp  # installed with ortools; only this bound uses it

    solver = pywraplp.Solver.CreateSolver("GLOP")
    chosen: dict[tuple[int, int], pywraplp.Variable] = {}
    constraints = []
    for excess, relief in rows:
        for key in relief:
            if key not in chosen:
                chosen[key] = solver.NumVar(0.0, 1.0, "")
        constraints.append(solver.Add(solver.Sum([b * chosen[key] for key, b in relief.items()]) >= excess))
    solver.Minimize(solver.Sum([problem.cost[x] * var for (x, _), var in chosen.items()]))
    if solver.Solve() not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        return 0.0
    duals = [max(0.0, c.dual_value()) for c in constraints]
    reduced = {key: float(problem.cost[key[0]]) for key in chosen}
    for dual, (_, relief) in zip(duals, rows):
        for key, b in relief.items():
            reduced[key] -= dual * b
    value = sum(dual * excess for dual, (excess, _) in zip(duals, rows)) + sum(min(0.0, r) for r in reduced.values())
    return max(0.0, value * (1 - 1e-9))


def input_aware_cover_bound(
    problem: RematProblem,
    budget: int,
    time_limit_s: float = 5.0,
    rows_per_round: int = 8,
    max_rows: int = 48,
    cascade_depth: int | None = None,
) -> float:
    """Lower bound on cost that also charges the inputs of recomputations (LP relaxation).

    `segment_cover_bound` lets a tensor x, idle at an over-budget first computation t, leave
    memory for the price of one recomputation before its next reader r. But that recomputation
    runs after t, with every input u of x resident; an input that no first computation at or
    after t reads (last reader before t) is then resident at t as well, adding its bytes to t's
    load, or it is computed again after its last reader (a recomputation no segment counts).
    Variables in [0, 1]: y[x, r] (x computed again between its readers around r, cost[x]),
    s[x, t] (x not resident at t; s <= y), k[u, t] (u resident at t after its last reader),
    z[u] (u computed again after its last reader, cost[u]; zt[u, t] <= z[u]: after t). Rows, per
    chosen t: bytes relieved >= excess + bytes of the k[u, t]; s[x, t] <= k[u, t] + zt[u, t] for
    such inputs u. Every schedule
    under the budget gives a 0/1 point with recomputation cost at least the objective, and any
    subset of the rows is a relaxation too. The LP over all over-budget rows is too slow at 1000
    nodes, so rows are added by rounds (cutting planes): start from a few spread over the order,
    then add the rows the LP's current y and z violate most, until `time_limit_s` or `max_rows`.
    `cascade_depth` levels of inputs of those late recomputations are charged the same way
    (`_recomputed_late`); default 1 up to `_CASCADE_NODES` nodes, else 0 (random_layered_n250 at
    0.8: 2.62% -> 3.21% overhead; at n1000 the larger LP reached fewer rows in time: 2.27% -> 1.82%).
    Never returns inf (`segment_cover_bound` detects budgets nothing fits).
    """
    depth = cascade_depth if cascade_depth is not None else int(problem.n <= _CASCADE_NODES)
    started = time.monotonic()
    capacity = budget - problem.static_bytes
    size, cost = problem.size, problem.cost
    readers = [sorted(s) for s in problem.succs]
    demands = _first_compute_demand(problem)
    # Per over-budget row: its excess and, per idle tensor, (x, next reader, inputs dead at t).
    rows: dict[int, tuple[int, list[tuple[int, int, list[int]]]]] = {}
    for t, (mandatory, live) in enumerate(demands):
        excess = mandatory + sum(size[x] for x in live) - capacity
        if excess > 0:
            idle = [
                (x, readers[x][bisect.bisect_right(readers[x], t)], _dead_inputs(problem, x, t))
                for x in live
                if problem.may_recompute[x] and size[x] > 0
            ]
            rows[t] = (excess, idle)
    if not rows:
        return float(sum(cost))
    lp = _LowerBoundLp()
    chosen = _spread(sorted(rows), rows_per_round)
    best = 0.0
    last_round_s = 0.0
    while True:
        for t in chosen:
            _add_input_aware_row(lp, problem, t, *rows[t], depth)
        remaining = time_limit_s - (time.monotonic() - started)
        if remaining <= 1.5 * last_round_s:  # a larger LP than the last one would not finish
            break
        round_started = time.monotonic()
        best = max(best, lp.lower_bound(remaining))
        last_round_s = time.monotonic() - round_started
        if lp.solution is None or len(lp.added_rows) >= max_rows:
            break
        violation = {t: _input_aware_violation(lp, problem, t, *rows[t]) for t in rows if t not in lp.added_rows}
        chosen = sorted((t for t in violation if violation[t] > 0), key=lambda t: -violation[t])[:rows_per_round]
        if not chosen:
            break
    return sum(cost) + best


def _dead_inputs(problem: RematProblem, v: int, t: int) -> list[int]:
    """Inputs of v (with bytes) that no first computation at or after t reads."""
    return [u for u in problem.preds[v] if problem.last_use[u] < t and problem.size[u] > 0]


def _add_input_aware_row(
    lp: "_LowerBoundLp",
    problem: RematProblem,
    t: int,
    excess: int,
    idle: list[tuple[int, int, list[int]]],
    depth: int,
) -> None:
    relief: dict[object, float] = {}
    kept: set[int] = set()  # inputs u with a k[u, t] variable: their bytes join row t
    for x, next_reader, dead_inputs in idle:
        y = lp.var(("y", x, next_reader), problem.cost[x])
        if not dead_inputs:  # s[x, t] = y[x, r] is as good as any smaller s: no s variable
            relief[y] = relief.get(y, 0.0) + problem.size[x]
            continue
        s = lp.var(("s", x, t), 0.0)
        lp.at_least({y: 1.0, s: -1.0}, 0.0)
        relief[s] = float(problem.size[x])
        for u in dead_inputs:
            late = _recomputed_late(lp, problem, u, t, kept, depth)
            lp.at_least({lp.var(("k", u, t), 0.0): 1.0, **late, s: -1.0}, 0.0)
            kept.add(u)
    for u in kept:
        relief[("k", u, t)] = -float(problem.size[u])
    lp.at_least(relief, float(excess))
    lp.added_rows.add(t)


def _input_aware_violation(
    lp: "_LowerBoundLp", problem: RematProblem, t: int, excess: int, idle: list[tuple[int, int, list[int]]]
) -> float:
    """How far row t is from holding at the LP's current y, z (s = y, k as small as allowed)."""
    relief = 0.0
    kept: dict[int, float] = {}
    for x, next_reader, dead_inputs in idle:
        s = lp.value(("y", x, next_reader))
        relief += problem.size[x] * s
        for u in dead_inputs:
            z = lp.value(("zt", u, t)) if ("zt", u, t) in lp.cost else lp.value(("z", u))
            kept[u] = max(kept.get(u, 0.0), s - z)
    return excess - relief + sum(problem.size[u] * k for u, k in kept.items())


def _recomputed_late(
    lp: "_LowerBoundLp", problem: RematProblem, u: int, t: int, kept: set[int], depth: int
) -> dict[object, float]:
    """u computed again after row t (and so after its last reader, which precedes t).

    z[u] pays for it once for all rows; zt[u, t] <= z[u] says "after t". That computation needs
    u's inputs then: one whose last reader precedes t is resident at t (k) or computed again
    after t too (zt, recursively, `depth` levels). Empty where u may not be recomputed.
    """
    if not problem.may_recompute[u]:
        return {}
    key = ("zt", u, t)
    if key not in lp.cost:
        lp.var(key, 0.0)
        lp.at_least({lp.var(("z", u), problem.cost[u]): 1.0, key: -1.0}, 0.0)
        for w in _dead_inputs(problem, u, t) if depth > 0 else ():
            late = _recomputed_late(lp, problem, w, t, kept, depth - 1)
            lp.at_least({lp.var(("k", w, t), 0.0): 1.0, **late, key: -1.0}, 0.0)
            kept.add(w)
    return {key: 1.0}


_CASCADE_NODES = 300  # deeper cascades raised no bound on the benchmark graphs and slow the LP


def _spread(items: Sequence[int], limit: int) -> list[int]:
    """At most `limit` items, evenly spaced (first and last included)."""
    if len(items) <= limit:
        return list(items)
    if limit <= 1:
        return list(items[:limit])
    return sorted({items[round(i * (len(items) - 1) / (limit - 1))] for i in range(limit)})


class _LowerBoundLp:
    """min c.x over 0 <= x <= 1 subject to rows a.x >= b, grown between solves.

    GLOP solves it; the bound returned is the Lagrangian value of its row duals clipped at 0
    (any duals >= 0 give a valid bound by weak duality), so solver tolerances or a time-out
    cannot make it overshoot the LP optimum.
    """

    def __init__(self) -> None:
        from ortools.linear_solver import pywraplp  # installed with ortools; only the bounds use it

        self._pywraplp = pywraplp
        self.solver = pywraplp.Solver.CreateSolver("GLOP")
        self.cost: dict[object, float] = {}
        self.vars: dict[object, Any] = {}  # pywraplp variables
        self.rows: list[tuple[Any, dict[object, float], float]] = []
        self.added_rows: set[int] = set()
        self.solution: dict[object, float] | None = None

    def var(self, key: object, cost: float) -> Any:
        if key not in self.vars:
            self.cost[key] = float(cost)
            self.vars[key] = self.solver.NumVar(0.0, 1.0, "")
        return key

    def value(self, key: object) -> float:
        return 0.0 if self.solution is None else self.solution.get(key, 0.0)

    def at_least(self, coefs: dict[object, float], rhs: float) -> None:
        constraint = self.solver.Add(self.solver.Sum([a * self.vars[k] for k, a in coefs.items()]) >= rhs)
        self.rows.append((constraint, coefs, rhs))

    def lower_bound(self, time_limit_s: float) -> float:
        solver = self.solver
        solver.SetTimeLimit(max(1, int(1000 * time_limit_s)))
        solver.Minimize(solver.Sum([c * self.vars[k] for k, c in self.cost.items() if c]))
        self.solution = None
        if solver.Solve() not in (self._pywraplp.Solver.OPTIMAL, self._pywraplp.Solver.FEASIBLE):
            return 0.0
        self.solution = {k: v.solution_value() for k, v in self.vars.items()}
        reduced = dict(self.cost)
        value = 0.0
        for constraint, coefs, rhs in self.rows:
            dual = max(0.0, constraint.dual_value())
            if dual:
                value += dual * rhs
                for k, a in coefs.items():
                    reduced[k] -= dual * a
        value += sum(min(0.0, r) for r in reduced.values())
        return max(0.0, value * (1 - 1e-9))

def proven_cost_bound(problem: RematProblem, budget: int, time_limit_s: float = 1.0, stages: int = 3) -> float:
    """Lower bound on the cost of every schedule under `budget` (inf: no schedule fits).

    The largest of: the knapsack bound (each first computation alone), the segment-cover bound
    (all first computations together, `segment_cover_bound`), and for the `stages` first
    computations with the largest excess the bound CP-SAT proves for `_stage_closure_model`
    within `time_limit_s` in total.
    """
    capacity = budget - problem.static_bytes
    demands = _first_compute_demand(problem)
    excess = [mandatory + sum(problem.size[x] for x in optional) - capacity for mandatory, optional in demands]
    best = max(first_compute_cost_bound(problem, budget), segment_cover_bound(problem, budget)) - sum(problem.cost)
    if math.isinf(best):
        return math.inf
    worst = sorted((t for t in range(problem.n) if excess[t] > 0), key=lambda t: -excess[t])[:stages]
    scale = _cost_scale(problem.cost)
    deadline = time.monotonic() + time_limit_s
    for i, t in enumerate(worst):
        share = (deadline - time.monotonic()) / (len(worst) - i)
        if share <= 0.01:
            break
        outcome = run_model(_stage_closure_model(problem, t, capacity, scale), time_limit_s=share, workers=1)
        if outcome.status == "infeasible":
            return math.inf
        if outcome.has_solution:
            best = max(best, outcome.lower_bound / scale)
    return sum(problem.cost) + best


def _stage_closure_model(problem: RematProblem, t: int, capacity: int, scale: int) -> cp_model.CpModel:
    """Cheapest way to get past node t's first computation, ignoring every other moment.

    resident[v]: v is resident when t is first computed; again[v]: v is computed after that.
    A node that a later first computation reads is resident or computed again; computing it again
    needs each input resident at t or computed again itself (its own later computation). Every
    `again` node is a computation beyond the first one of each node, so the objective is a lower
    bound on the recomputation cost of any schedule (valid, not only within the stage grid).
    """
    mandatory, waiting = _first_compute_demand(problem)[t]
    inputs = set(problem.preds[t])
    closure: set[int] = set()
    stack = list(waiting)
    while stack:
        v = stack.pop()
        if v not in closure and v not in inputs:
            closure.add(v)
            stack.extend(problem.preds[v])
    model = cp_model.CpModel()
    resident = {v: model.new_bool_var(f"r{v}") for v in sorted(closure)}
    again = {v: model.new_bool_var(f"a{v}") for v in sorted(closure)}
    model.add(sum(problem.size[v] * resident[v] for v in closure) <= capacity - mandatory)
    for v in waiting:
        model.add_bool_or([resident[v], again[v]])
    for v in closure:
        if not problem.may_recompute[v]:
            model.add(again[v] == 0)
        for u in problem.preds[v]:
            if u not in inputs:
                model.add_bool_or([again[v].negated(), resident[u], again[u]])
    model.minimize(sum(round(problem.cost[v] * scale) * again[v] for v in closure))
    return model


def _fractional_cover_cost(problem: RematProblem, candidates: list[int], excess: int) -> float:
    if excess <= 0:
        return 0.0
    paid, left = 0.0, float(excess)
    movable = [x for x in candidates if problem.may_recompute[x] and problem.size[x] > 0]
    for x in sorted(movable, key=lambda x: problem.cost[x] / problem.size[x]):
        take = min(1.0, left / problem.size[x])
        paid += take * problem.cost[x]
        left -= take * problem.size[x]
        if left <= 0:
            return paid
    return math.inf


def _add_hint(problem: RematProblem, rm: _RematModel, grid: _Grid, computes: list[list[int]]) -> None:
    for var, value in _plan_values(problem, rm, grid, computes):
        rm.model.add_hint(var, value)


def _plan_values(
    problem: RematProblem, rm: _RematModel, grid: _Grid, computes: list[list[int]]
) -> list[tuple[cp_model.IntVar, int]]:
    """The model's slot and cover variables for a plan (unused slots pinned to the last stage)."""
    intervals = _intervals_from_computes(problem, computes)
    per_node: dict[int, list[_Interval]] = {}
    for iv in intervals:
        per_node.setdefault(iv.node, []).append(iv)
    last = grid.horizon - 1
    values: list[tuple[cp_model.IntVar, int]] = []
    for v, slots in enumerate(rm.slots):
        for j, slot in enumerate(slots):
            used = j < len(per_node[v])
            start, end = (per_node[v][j].start, per_node[v][j].end) if used else (last, last)
            if j > 0:  # (slot 0 is always present, from its first computation: no variables)
                values.append((cast(cp_model.IntVar, slot.present), int(used)))
                values.append((cast(cp_model.IntVar, slot.start), start))
            values.append((slot.end, end))
            if (v, j) in rm.lengths:
                values.append((rm.lengths[(v, j)], end + 1 - start))
    for (v, j, u, k), var in rm.cover.items():
        used = j < len(computes[v])
        serving = bisect.bisect_right(computes[u], computes[v][j]) - 1 if used else -1
        values.append((var, int(k == serving)))
    return values


def _improve_by_windows(
    problem: RematProblem,
    grid: _Grid,
    plan: list[list[int]],
    capacity: int,
    deadline: float,
    seed: int,
    workers: int,
) -> list[list[int]]:
    """Large-neighbourhood search with CP-SAT on the stage-grid model.

    Rounds alternate two neighbourhoods around a random over-budget stage window [lo, hi]:
    a random sample of the nodes resident there may re-plan all their slots anywhere, or every
    node resident there may move its slot starts and ends into the window (or onto stages its
    slots already use). All other variables are fixed to the current plan, which is also the
    complete hint, so fixed variables presolve away: a round takes ~0.3-1 s where the whole model
    (random_layered_n1000) does not finish presolving in the time limit. Keeps the cheapest plan
    that fits. Gains are small (random_layered_n250 at 0.8: 5.95% -> 5.69% overhead in 15 s;
    n500: 3.19% -> 3.15%); at n=1000 no round improved the repaired plan.
    """
    if deadline - time.monotonic() < _WINDOW_MIN_S + 0.002 * problem.n:  # building: ~1.5 s at n=1000
        return plan
    scale = _cost_scale(problem.cost)
    rm = _build_model(problem, grid, capacity, scale)
    owners: dict[int, tuple[int, ...]] = {}
    for v, slots in enumerate(rm.slots):
        for slot in slots:
            for var in (slot.start, slot.end, slot.present):
                if not isinstance(var, (int, bool)):
                    owners[var.Index()] = (v,)
    for (v, _), var in rm.lengths.items():
        owners[var.Index()] = (v,)
    for (v, _, u, _), var in rm.cover.items():
        owners[var.Index()] = (v, u)
    no_recompute = _intervals_from_computes(problem, [[grid.first(v)] for v in range(problem.n)])
    tight = [t for t, load in enumerate(_stage_loads(problem, no_recompute, grid.horizon)) if load > capacity]
    rng = random.Random(seed)
    best, best_cost = plan, _plan_cost(problem, plan)
    slot_vars = {
        var.Index() for slots in rm.slots for slot in slots for var in (slot.start, slot.end) if not isinstance(var, int)
    }
    rounds = stale = 0
    while tight and deadline - time.monotonic() > _WINDOW_MIN_S and stale < _WINDOW_PATIENCE:
        rounds += 1
        stale += 1
        centre = rng.choice(tight)
        width = rng.randint(_WINDOW_WIDTH[0], _WINDOW_WIDTH[1]) * grid.substeps
        lo, hi = centre - width, centre + width
        intervals = _intervals_from_computes(problem, best)
        touching = sorted({iv.node for iv in intervals if iv.start <= hi + 1 and iv.end >= lo - 1})
        model = rm.model.clone()
        proto = model.Proto()
        values = _plan_values(problem, rm, grid, best)
        if rounds % 2:
            # Node round: a sample of the nodes around the window may move anywhere.
            free = set(rng.sample(touching, min(len(touching), _WINDOW_NODES)))
            for var, value in values:
                if not any(v in free for v in owners[var.Index()]):
                    _fix_variable(proto, var.Index(), value)
        else:
            # Time round: every node may move its interval ends and (re)computations into the
            # window [lo, hi] or back onto stages it already uses; nothing else changes.
            free = set(touching)
            stages: dict[int, set[int]] = {}
            for var, value in values:
                if var.Index() in slot_vars and owners[var.Index()][0] in free:
                    stages.setdefault(owners[var.Index()][0], {grid.horizon - 1}).add(value)
            for var, value in values:
                index = var.Index()
                if not any(v in free for v in owners[index]):
                    _fix_variable(proto, index, value)
                elif index in slot_vars:
                    allowed = stages[owners[index][0]] | set(range(max(0, lo), min(grid.horizon, hi + 1)))
                    _restrict_domain(proto, index, allowed)
        for var, value in values:
            proto.solution_hint.vars.append(var.Index())
            proto.solution_hint.values.append(value)
        slice_s = min(_WINDOW_SLICE_S, deadline - time.monotonic())
        outcome = run_model(model, time_limit_s=slice_s, workers=workers, seed=seed)
        if not outcome.has_solution:
            continue
        found = _computes_from_intervals(problem, _computes_from_solution(rm, outcome.solver))
        cost = _plan_cost(problem, found)
        loads = _stage_loads(problem, _intervals_from_computes(problem, found), grid.horizon)
        if cost < best_cost - 1e-9 and max(loads, default=0) <= capacity:
            best, best_cost, stale = found, cost, 0
    return best


def _fix_variable(proto, index: int, value: int) -> None:
    domain = proto.variables[index].domain
    domain.clear()
    domain.extend([value, value])


def _restrict_domain(proto, index: int, allowed: set[int]) -> None:
    """Intersect a variable's domain with `allowed` (written as disjoint [lo, hi] pairs)."""
    domain = proto.variables[index].domain
    bounds = list(domain)
    keep = sorted(x for x in allowed if any(a <= x <= b for a, b in zip(bounds[::2], bounds[1::2])))
    pairs: list[int] = []
    for x in keep:
        if pairs and pairs[-1] == x - 1:
            pairs[-1] = x
        else:
            pairs.extend([x, x])
    domain.clear()
    domain.extend(pairs)


def _computes_from_intervals(problem: RematProblem, intervals: Iterable[_Interval]) -> list[list[int]]:
    computes: list[list[int]] = [[] for _ in range(problem.n)]
    for iv in intervals:
        computes[iv.node].append(iv.start)
    return [sorted(stages) for stages in computes]


def _computes_from_solution(rm: _RematModel, solver: cp_model.CpSolver) -> list[_Interval]:
    intervals = []
    for slots in rm.slots:
        for slot in slots:
            if slot.present is True or solver.BooleanValue(slot.present):
                start = slot.start if isinstance(slot.start, int) else solver.Value(slot.start)
                intervals.append(_Interval(slot.node, start, solver.Value(slot.end)))
    return intervals


# ------------------------------------------------------------------------------ entry point


def solve_remat(
    problem: RematProblem,
    budget: int,
    time_limit_s: float = 30.0,
    workers: int = DEFAULT_WORKERS,
    seed: int = DEFAULT_SEED,
    *,
    relative_gap: float = 0.0,
    max_computations: int | None = None,
    substeps: int | None = None,
) -> RematResult:
    """Cheapest schedule with peak <= budget (within the formulation), best found in time.

    Every returned schedule has been replayed by `simulate` and fits the budget. The
    input-aware bound (`input_aware_cover_bound`) is computed beside the search, in a forked
    process where the platform allows (its LP holds the GIL), and raises the reported bounds.
    """
    started = time.monotonic()
    # Keep a little time for replaying and emitting the schedule after the search.
    deadline = started + time_limit_s - min(1.0, 0.05 * time_limit_s)
    peak_lb = peak_lower_bound(problem)
    if budget < peak_lb:
        return _no_schedule("infeasible", peak_lb, started)
    bound = _BoundBesideSearch(problem, budget, deadline)
    try:
        result = _search(
            problem, budget, time_limit_s, workers, seed, relative_gap, max_computations, substeps, started, deadline
        )
        if not result.has_schedule:
            return result
        result = _polished(problem, budget, result, deadline + 0.5 * (started + time_limit_s - deadline), started)
        return _with_better_bound(result, bound.result(deadline), started)
    finally:
        bound.stop()


def _search(
    problem: RematProblem,
    budget: int,
    time_limit_s: float,
    workers: int,
    seed: int,
    relative_gap: float,
    max_computations: int | None,
    substeps: int | None,
    started: float,
    deadline: float,
) -> RematResult:
    peak_lb = peak_lower_bound(problem)
    proven = proven_cost_bound(problem, budget, time_limit_s=_BOUND_SHARE * time_limit_s)
    if math.isinf(proven):  # some first computation cannot fit: the least peak exceeds the budget
        return _no_schedule("infeasible", budget + 1, started)
    capacity = budget - problem.static_bytes
    # One stage per node holds a whole recomputation chain at once; when that grid yields no greedy
    # plan (between its limit and the least peak), grids with substeps let chains spread out
    # (random_layered_n250 at 0.76: 682% overhead by events, 9% on two substeps).
    finer = _FINER_SUBSTEPS if substeps is None and problem.n > 8 else ()
    for k in (substeps, *finer):
        large = _cover_literals(problem, _make_grid(problem, k, max_computations)) > _LARGE_MODEL
        grid, greedy, chains = _grid_with_greedy_plan(
            problem,
            capacity,
            k,
            max_computations,
            started + _GREEDY_SHARE * time_limit_s,
            cheapest=large,
            chain_deadline=started + _CHAIN_GREEDY_SHARE * time_limit_s,
        )
        if greedy is not None:
            break
    if large and greedy is not None:
        # CP-SAT would spend the time limit building and presolving: improve the plan by repair.
        plan = _improve_by_repair(problem, grid, greedy, capacity, deadline, seed, chains)
        plan = _improve_by_windows(problem, grid, plan, capacity, deadline, seed, workers)
        schedule = _checked(problem, budget, _intervals_from_computes(problem, plan))
        if schedule is not None:
            return _with_schedule(problem, schedule, proven, proven, "heuristic", started)
    if large and greedy is None:
        # The stage grid found nothing and CP-SAT would not finish building: schedule by events.
        return _event_level_fallback(problem, budget, proven, peak_lb, "no_schedule", deadline, seed, started)
    events_first: RematResult | None = None
    if greedy is None:
        # No grid plan (tight budget): CP-SAT may find none either (random_layered_n250 at 0.7),
        # so first look for an event-level schedule (up to a share of the time, stopping at the
        # first one found); CP-SAT gets the rest and the cheaper schedule wins.
        now = time.monotonic()
        share = now + _EVENTS_SHARE * (deadline - now)
        events_first = _event_level_fallback(
            problem, budget, proven, peak_lb, "no_schedule", share, seed, started, stop_at_first=True
        )
        if not events_first.has_schedule:
            events_first = None
    scale = _cost_scale(problem.cost)
    rm = _build_model(problem, grid, capacity, scale)
    if greedy is not None:
        _add_hint(problem, rm, grid, greedy)
    fallback = _checked(problem, budget, _intervals_from_computes(problem, greedy)) if greedy else None
    outcome = _two_phase_solve(rm.model, deadline, time_limit_s, workers, seed, relative_gap)
    if events_first is not None:
        # The cheaper of the event-level schedule and CP-SAT's (checked as below).
        schedule = _checked(problem, budget, _computes_from_solution(rm, outcome.solver)) if outcome.has_solution else None
        if schedule is None or _cost(problem, schedule) > events_first.cost:
            return events_first

    base_cost = sum(problem.cost)
    # The proven bound holds for every schedule, so also within the formulation.
    if outcome.has_solution:
        schedule = _checked(problem, budget, _computes_from_solution(rm, outcome.solver))
        if schedule is not None and (fallback is None or _cost(problem, schedule) <= _cost(problem, fallback)):
            lower = max(base_cost + outcome.lower_bound / scale, proven)
            return _with_schedule(problem, schedule, lower, proven, outcome.status, started)
    if fallback is not None:
        lower = base_cost + outcome.lower_bound / scale if outcome.has_solution else base_cost
        return _with_schedule(problem, fallback, max(lower, proven), proven, "timeout_fallback", started)
    status = "infeasible_in_model" if outcome.status == "infeasible" else "no_schedule"
    return _event_level_fallback(problem, budget, proven, peak_lb, status, deadline, seed, started)


def _polished(problem: RematProblem, budget: int, result: RematResult, deadline: float, started: float) -> RematResult:
    """Event-level polish of the found schedule: frees as early as possible, then tensors kept
    instead of recomputed where the budget allows (`remat_events.undo_evictions`). A cheaper
    schedule may lie outside the stage grid, so its bound is the proven one and, if the grid's
    optimum was claimed, the status becomes "feasible"."""
    schedule = undo_evictions(problem, free_early(problem, result.schedule), budget, deadline)
    try:
        peak, cost = simulate(problem, schedule)
    except InvalidSchedule:
        return result
    if peak > budget or cost >= result.cost - 1e-9:
        return result
    status = "feasible" if result.status == "optimal" else result.status
    proven = result.proven_lower_bound
    return _with_schedule(problem, schedule, proven, proven, status, started)


def _with_better_bound(result: RematResult, bound: float, started: float) -> RematResult:
    """Raise the result's bounds to `bound` (valid for every schedule); proven optimal when it
    reaches the cost."""
    if bound <= result.proven_lower_bound:
        return result
    proven = min(bound, result.cost)
    lower = max(result.lower_bound, proven)
    closed = proven >= result.cost * (1 - 1e-9)
    return dataclasses.replace(
        result,
        lower_bound=lower,
        proven_lower_bound=proven,
        gap=0.0 if result.cost == 0 else max(0.0, (result.cost - lower) / result.cost),
        status="optimal" if closed else result.status,
        solve_s=time.monotonic() - started,
    )


class _BoundBesideSearch:
    """`input_aware_cover_bound` in a forked process until `deadline`, beside the schedule search.

    GLOP holds the GIL, so a thread would stall the (pure Python) greedy and repair searches;
    the process uses the second core. Without fork (or for graphs whose LP is small) it runs
    inline, with a short time limit. `result` waits for it until `deadline` at most.
    """

    def __init__(self, problem: RematProblem, budget: int, deadline: float) -> None:
        import multiprocessing

        self.value = 0.0
        self._process: Any = None  # a forked multiprocessing.Process
        self._conn: Any = None  # its end of the pipe
        limit = 0.9 * (deadline - time.monotonic())  # room to send the value back before the deadline
        if problem.n <= _INLINE_BOUND_NODES or "fork" not in multiprocessing.get_all_start_methods():
            self.value = input_aware_cover_bound(problem, budget, time_limit_s=_INLINE_BOUND_SHARE * limit)
            return
        context = multiprocessing.get_context("fork")
        self._conn, sender = context.Pipe(duplex=False)
        self._process = context.Process(target=_send_bound, args=(sender, problem, budget, limit), daemon=True)
        self._process.start()
        sender.close()

    def result(self, deadline: float) -> float:
        if self._process is not None and self._conn.poll(max(0.0, deadline - time.monotonic())):
            try:
                self.value = max(self.value, float(self._conn.recv()))
            except (EOFError, OSError):
                pass
        self.stop()
        return self.value

    def stop(self) -> None:
        if self._process is not None:
            if self._process.is_alive():
                self._process.terminate()
            self._process.join()
            self._conn.close()
            self._process = None


def _send_bound(sender, problem: RematProblem, budget: int, time_limit_s: float) -> None:
    try:
        sender.send(input_aware_cover_bound(problem, budget, time_limit_s=time_limit_s))
    finally:
        sender.close()


# Graphs up to this many nodes compute the input-aware bound inline (its LP takes well under a
# second there), with this share of the time limit at most.
_INLINE_BOUND_NODES = 150
_INLINE_BOUND_SHARE = 0.1


def _event_level_fallback(
    problem: RematProblem,
    budget: int,
    proven: float,
    peak_lb: int,
    status_if_none: str,
    deadline: float,
    seed: int,
    started: float,
    stop_at_first: bool = False,
) -> RematResult:
    """Schedules the stage grid cannot express (recomputation chains inside a stage), by eviction.

    Runs until `deadline` (at least one attempt) or, with `stop_at_first`, the first schedule;
    its schedules are replayed and fit the budget.
    """
    schedule = best_eviction_schedule(problem, budget, deadline, seed, stop_at_first=stop_at_first)
    if schedule is None:
        return _no_schedule(status_if_none, peak_lb, started)
    return _with_schedule(problem, schedule, proven, proven, "heuristic_events", started)


# Phase 1 searches with CP-SAT's objective lower-bound search, which proves the Checkmate graphs
# optimal several times faster (ResNet50 at 0.7: ~1.3 s instead of ~4.5 s) but slows the proofs on
# the random layered graphs and can miss feasible solutions there; phase 2 (default parameters,
# warm-started from phase 1's best solution) gets the remaining time when phase 1 is not optimal.
_PHASE1_SHARE = 0.1
# Share of the time limit for the stage-closure bound (solved in ~0.1 s up to a few hundred nodes;
# on the 1000-node graph CP-SAT does not close it and the knapsack bound remains).
_BOUND_SHARE = 0.05
# Share for the greedy variants and their repair search (`_improve_by_repair`): on the largest
# graphs CP-SAT rarely improves on them in time.
_GREEDY_SHARE = 0.5
# Until this share of the time limit, greedy variants with recomputation chains may run when the
# others found no plan (the alternative then is the event-level fallback).
_CHAIN_GREEDY_SHARE = 0.75
# Most of the time left after the greedy that the event-level search may take, before CP-SAT,
# to find a first schedule when the grid greedy found no plan.
_EVENTS_SHARE = 0.5
_LNS_PATIENCE = 40
# Above this many input-cover literals CP-SAT spends ~15 s building and presolving the model
# (random_layered_n1000: 23k) and found no better plan than the greedy's within 30 s on 2 cores;
# random_layered_n500 (10k) got 3.9% overhead from CP-SAT, 3.2% from the repair search. Such
# problems skip CP-SAT and give all the time to the greedy variants and the repair search.
_LARGE_MODEL = 8_000
# Substeps per node tried, in order, when one stage per node yields no greedy plan.
_FINER_SUBSTEPS = (2, 3)


_PHASE1_PARAMS = {"use_objective_lb_search": True}
# CP-SAT window search (`_improve_by_windows`): half-width of the stage window in nodes, seconds
# per round, the least time worth starting a round with, nodes freed by a node round.
_WINDOW_WIDTH = (0, 4)
_WINDOW_SLICE_S = 2.0
_WINDOW_MIN_S = 0.5
_WINDOW_NODES = 40
_WINDOW_PATIENCE = 30  # rounds in a row without a cheaper plan


def _cover_literals(problem: RematProblem, grid: _Grid) -> int:
    c = grid.max_computations
    return sum(c[v] * c[u] for v, ps in enumerate(problem.preds) for u in ps)


def _two_phase_solve(
    model: cp_model.CpModel, deadline: float, time_limit_s: float, workers: int, seed: int, relative_gap: float
) -> SolveOutcome:
    phase1 = min(deadline - time.monotonic(), _PHASE1_SHARE * time_limit_s)
    first = run_model(
        model, time_limit_s=phase1, workers=workers, seed=seed, relative_gap=relative_gap, extra_params=_PHASE1_PARAMS
    )
    remaining = deadline - time.monotonic()
    if first.status in ("optimal", "infeasible") or remaining < 0.05:
        return first
    if first.has_solution:  # warm start: every variable from phase 1's best solution
        model.clear_hints()
        for i in range(len(model.Proto().variables)):
            var = model.get_int_var_from_proto_index(i)
            model.add_hint(var, first.solver.Value(var))
    second = run_model(model, time_limit_s=remaining, workers=workers, seed=seed, relative_gap=relative_gap)
    if not second.has_solution or (first.has_solution and first.objective < second.objective):
        # Keep phase 1's schedule; a bound proven in either phase is valid.
        if not first.has_solution:
            return second
        bound = max(first.lower_bound, second.lower_bound) if second.has_solution else first.lower_bound
        return _with_bound(first, bound)
    if first.has_solution:
        return _with_bound(second, max(first.lower_bound, second.lower_bound))
    return second


def _with_bound(outcome: SolveOutcome, bound: float) -> SolveOutcome:
    status = "optimal" if bound >= outcome.objective else outcome.status
    return dataclasses.replace(outcome, lower_bound=min(bound, outcome.objective), status=status)


def _grid_with_greedy_plan(
    problem: RematProblem,
    capacity: int,
    substeps: int | None,
    max_computations: int | None,
    deadline: float,
    cheapest: bool = False,
    chain_deadline: float | None = None,
) -> tuple[_Grid, list[list[int]] | None, bool]:
    """Cheapest plan among the greedy variants, and the smallest grid that holds it.

    Variants: up to C=2 or C=3 computations per node, fast or thorough split choice. No variant
    dominates (random_layered_n1000 at 0.8: 3.5% / 3.1% / 2.8% / 2.8% overhead), and tight
    budgets on wide graphs need C=3. Fast ones first, each with an equal share of the remaining
    time; `cheapest=False` stops at the first plan (CP-SAT improves it; a smaller C=2 model and
    this hint prove the Checkmate graphs fastest), `cheapest=True` runs all and keeps the best.
    The CP-SAT model uses C=3 only when the plan recomputes a node twice.
    Near the least peak (`cheapest`: when the fast variants find nothing; else when no variant
    does) thorough variants that may also recompute a split's inputs along (`chains`) run until
    `chain_deadline`: random_layered_n1000 at 0.7 gets 7.8% overhead, n500 15% (C=3 only),
    where the eviction fallback got 18% and 96%. Budgets where the fast variants succeed run
    exactly the variants they ran before chains existed.
    Returns the grid, the plan (None if none) and whether it uses chains.
    """
    tiny = problem.n <= 8  # the default grid already allows n computations per node
    cs = [max_computations] if max_computations or tiny else [None, 3]
    chain_choices = [(c, True, True) for c in cs] if chain_deadline is not None and not tiny else []
    best: tuple[float, _Grid, list[list[int]], bool] | None = None

    def run(choices: list[tuple[int | None, bool, bool]], until: float) -> None:
        nonlocal best
        for i, (c, thorough, chains) in enumerate(choices):
            if best is not None and not cheapest:
                return
            grid = _make_grid(problem, substeps, c)
            share = (until - time.monotonic()) / (len(choices) - i)
            plan = _greedy_computes(problem, grid, capacity, time.monotonic() + share, thorough, chains=chains)
            if plan is not None:
                cost = sum(problem.cost[v] * len(stages) for v, stages in enumerate(plan))
                if best is None or cost < best[0]:
                    best = (cost, grid, plan, chains)

    if cheapest:
        run([(c, False, False) for c in cs], time.monotonic() + 0.25 * (deadline - time.monotonic()))
        if best is None:  # the fast variants got stuck: a tight budget, where chains pay most
            run(chain_choices, chain_deadline if chain_deadline is not None else deadline)
        run([(c, True, False) for c in cs], deadline)
    else:
        run([(c, thorough, False) for c in cs for thorough in (False, True)], deadline)
        if best is None:
            run(chain_choices, chain_deadline if chain_deadline is not None else deadline)
    if best is None:
        return _make_grid(problem, substeps, cs[0]), None, False
    _, grid, plan, chains = best
    if not max_computations and not tiny and max(len(stages) for stages in plan) <= 2:
        grid = _make_grid(problem, substeps, None)
    return grid, plan, chains


def _checked(problem: RematProblem, budget: int, intervals: Iterable[_Interval]) -> Schedule | None:
    """Emit the schedule and keep it only if the independent replay says it fits."""
    schedule = _schedule_from_intervals(intervals)
    try:
        peak, _ = simulate(problem, schedule)
    except InvalidSchedule:
        return None
    return schedule if peak <= budget else None


def _cost(problem: RematProblem, schedule: Schedule) -> float:
    return simulate(problem, schedule)[1]


def _with_schedule(
    problem: RematProblem, schedule: Schedule, lower: float, proven: float, status: str, started: float
) -> RematResult:
    peak, cost = simulate(problem, schedule)
    lower = min(lower, cost)  # float round-off in the scaled objective must not overshoot
    proven = min(proven, lower)
    gap = 0.0 if cost == 0 else max(0.0, (cost - lower) / cost)
    if proven >= cost * (1 - 1e-9):  # no schedule under the budget is cheaper
        status = "optimal"
    return RematResult(
        schedule=schedule,
        peak=peak,
        cost=cost,
        lower_bound=lower,
        status=status,
        solve_s=time.monotonic() - started,
        gap=gap,
        peak_lower_bound=peak_lower_bound(problem),
        proven_lower_bound=proven,
    )


def _no_schedule(status: str, peak_lb: int, started: float) -> RematResult:
    return RematResult(
        schedule=(),
        peak=0,
        cost=math.inf,
        lower_bound=float(peak_lb),
        status=status,
        solve_s=time.monotonic() - started,
        gap=math.inf,
        peak_lower_bound=peak_lb,
    )


def _cost_scale(costs: Sequence[float]) -> int:
    """Integer factor making costs integral for CP-SAT (exact for up to 6 decimals)."""
    for scale in (1, 10, 100, 1000, 10**4, 10**5, 10**6):
        if all(abs(c * scale - round(c * scale)) < 1e-9 for c in costs):
            return scale
    return 10**6
