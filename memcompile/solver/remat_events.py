"""Event-level schedules by eviction, for budgets the stage grid of `remat.py` cannot express.

The stage grid keeps every recomputation of a stage resident until the stage's first computation
is done, so a chain of recomputations (u recomputed only to recompute its successor w) holds u
and w at once. Near the least peak that leaves the grid without any schedule
(random_layered_n500 and n1000 at 0.7 P0). This module works on events directly, in the spirit of
Dynamic Tensor Rematerialization (Kirisame et al., ICLR 2021; written from the idea, not code),
with the future known:

* First computations run in node order. Before computing a node, its inputs are made resident,
  missing ones recomputed recursively; an input stays pinned until its reader is computed. The
  order: the input whose recomputation needs the most memory beyond its own result first
  (Sethi-Ullman, re-ordered after each input), or in some variants the costliest first.
* When a computation does not fit, an unpinned tensor is freed: one that nothing can read again
  if any, else the one with the least `recompute cost / (bytes * distance to its next need)`.
  The recompute cost includes missing ancestors (a few levels); a tensor's next need is its next
  first-computation reader or the next need of a missing successor it would feed. Some variants
  also prefer the least recently used tensor (recency_power).
  One variant evicts what the current stage still reads (to recompute its inputs) only when
  nothing else fits.
* `undo_evictions` then drops recomputations whose tensor can instead stay resident in between,
  most expensive first, while the peak stays within the budget.
* After the variants: jittered restarts, alternating with suffix restarts that keep the best
  schedule up to a stage shortly before one where it recomputes a lot and schedule the rest.

Every schedule is replayed by `simulate` before it is returned.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import random
import sys
import time
from dataclasses import dataclass

import numpy as np

from .remat_problem import Event, InvalidSchedule, RematProblem, Schedule, simulate


@dataclass(frozen=True)
class EvictionWeights:
    """Victim score = recompute cost / (bytes**size_power * distance**distance_power); noise: jitter."""

    distance_power: float = 1.0
    size_power: float = 1.0
    noise: float = 0.0
    recency_power: float = 0.0  # divide by (computations since last use + 1) ** power: least recently used first
    input_order: str = "memory"  # missing inputs: "memory" (largest working set first) or "cost" (costliest first)
    protect_stage: bool = False  # evict what the current stage still reads only when nothing else fits

    def __post_init__(self) -> None:
        if self.input_order not in ("memory", "cost"):
            raise ValueError(f"input_order must be 'memory' or 'cost', got {self.input_order!r}")


# Least-recently-used first among equally scored victims stops much of the thrashing in deep
# recomputation chains (random_layered_n500 at 0.7: 344% overhead instead of 917-1193%), but
# costs more elsewhere (n1000 at 0.7: 23% instead of 19%). Making the input with the largest
# working set resident first ("memory" order) is what finds any schedule for random_layered_n250
# at 0.7 (every "cost"-order variant gets stuck at its 44-input node) and gives n500 at 0.7 142%
# instead of 337%; n1000 at 0.7 is about even (19% vs 18%). No variant dominates: each runs once
# (tight budgets first), then jittered restarts, and the cheapest schedule wins.
_VARIANTS = (
    EvictionWeights(2.0, 2.0),
    EvictionWeights(2.0, 2.0, recency_power=1.0, input_order="cost"),
    EvictionWeights(2.0, 1.0, recency_power=0.5, input_order="cost"),
    EvictionWeights(2.0, 2.0, recency_power=1.0, protect_stage=True),
    EvictionWeights(1.0, 2.0),
    EvictionWeights(2.0, 2.0, input_order="cost"),
    EvictionWeights(1.0, 1.0, input_order="cost"),
    EvictionWeights(2.0, 1.0),
)
_RESTART_REACH = 40  # stages before a costly one that a suffix restart may start at
_ANCESTRY_DEPTH = 4  # levels of missing ancestors charged to a victim's recompute cost


class _Stuck(Exception):
    """Every resident tensor is pinned and the next computation does not fit."""


class _OutOfTime(Exception):
    pass


def eviction_schedule(
    problem: RematProblem,
    budget: int,
    weights: EvictionWeights,
    deadline: float,
    seed: int = 0,
    prefix: Schedule = (),
) -> Schedule | None:
    """One eviction run; None when it gets stuck, runs past `deadline` or exceeds the budget.

    `prefix`: a valid start of a schedule that ends just before a first computation; the run
    continues from the state it leaves (the result starts with it).
    """
    limit = sys.getrecursionlimit()
    # Recomputation chains recurse once per node (a few frames each); the default limit of 1000
    # would cut chains on the 1000-node benchmark graphs.
    sys.setrecursionlimit(max(limit, 4 * problem.n + 1000))
    try:
        evictor = _Evictor(problem, budget, weights, deadline, random.Random(seed))
        events = evictor.run(evictor.replay(prefix))
        peak, _ = simulate(problem, events)
    except (_Stuck, _OutOfTime, RecursionError, InvalidSchedule):
        return None
    finally:
        sys.setrecursionlimit(limit)
    return events if peak <= budget else None


def best_eviction_schedule(
    problem: RematProblem, budget: int, deadline: float, seed: int = 0, stop_at_first: bool = False
) -> Schedule | None:
    """Cheapest schedule over the weight variants, then jittered restarts, each polished by
    `undo_evictions`, until `deadline` (at least one run, so tiny graphs always get a try) or,
    with `stop_at_first`, the first schedule found."""
    rng = random.Random(seed)
    best: tuple[float, Schedule] | None = None
    failures = 0
    for attempt in range(10_000):
        if attempt and time.monotonic() >= deadline:
            break
        prefix: Schedule = ()
        if attempt < len(_VARIANTS):
            # Looking for any schedule: the variant that finds one nearest the least peak first.
            weights = _VARIANTS[(attempt + 3) % len(_VARIANTS) if stop_at_first and attempt < 4 else attempt]
        else:
            if best is None and failures >= 3 * len(_VARIANTS):
                break  # nothing fits: jitter will not help either
            base = _VARIANTS[rng.randrange(len(_VARIANTS))]
            weights = dataclasses.replace(base, noise=rng.uniform(0.1, 1.0))
            if best is not None and attempt % 2:
                # Large-neighbourhood step: keep the best schedule up to a stage shortly before
                # one where it recomputes a lot, and schedule the rest again.
                prefix = _prefix_before(problem, best[1], _restart_stage(problem, best[1], rng))
        now = time.monotonic()
        # One thrashing variant must not take all the time: each run gets at most half of it
        # (a stuck run often thrashes for long before it gives up).
        run_deadline = min(deadline, now + max(1.0, 0.5 * (deadline - now)))
        if not attempt:
            run_deadline = max(run_deadline, now + 1.0)
        schedule = eviction_schedule(problem, budget, weights, run_deadline, seed=seed + attempt, prefix=prefix)
        if schedule is None:
            failures += 1
            continue
        schedule = undo_evictions(problem, schedule, budget, deadline)
        cost = simulate(problem, schedule)[1]
        if best is None or cost < best[0]:
            best = (cost, schedule)
        if stop_at_first:
            break
    return None if best is None else best[1]


def _restart_stage(problem: RematProblem, schedule: Schedule, rng: random.Random) -> int:
    """A stage up to `_RESTART_REACH` before one drawn by the cost of the recomputations that
    precede its first computation."""
    spent = [0.0] * problem.n
    computed: set[int] = set()
    pending = 0.0
    for kind, v in schedule:
        if kind != "compute":
            continue
        if v in computed:
            pending += problem.cost[v]
        else:
            computed.add(v)
            spent[v], pending = pending, 0.0
    if not any(spent):
        return rng.randrange(problem.n)
    costly = rng.choices(range(problem.n), weights=spent)[0]
    return rng.randint(max(0, costly - _RESTART_REACH), costly)


def _prefix_before(problem: RematProblem, schedule: Schedule, stage: int) -> Schedule:
    """The events before the first computation of node `stage`."""
    for k, (kind, v) in enumerate(schedule):
        if kind == "compute" and v == stage:
            return schedule[:k]
    return schedule


def undo_evictions(problem: RematProblem, schedule: Schedule, budget: int, deadline: float) -> Schedule:
    """Keep tensors resident instead of freeing and recomputing them, where the budget allows.

    A recomputation of v at event j whose previous free of v is at event i: dropping both holds v
    over (i, j), which is valid (no other event of v lies between) and removes a computation; it
    is kept when every computation in between still fits with v's bytes added. Costliest first.
    Then recomputations that nothing reads before they are freed are dropped. Repeats while
    anything changes; the result is replayed and the input returned if the replay disagrees.
    """
    events = list(schedule)
    alive = np.ones(len(events), dtype=bool)
    load = _compute_loads(problem, events)  # memory during each compute event, -inf for frees
    changed = True
    while changed and time.monotonic() < deadline:
        changed = False
        for i, j in _eviction_pairs(problem, events, alive):
            if time.monotonic() >= deadline:
                break
            size = problem.size[events[j][1]]
            if load[i + 1 : j].max(initial=-np.inf) + size <= budget:
                load[i + 1 : j] += size
                load[j] = -np.inf
                alive[i] = alive[j] = False
                changed = True
        changed |= _drop_unread_recomputations(problem, events, alive, load)
    result = tuple(e for e, keep in zip(events, alive) if keep)
    return result if _fits(problem, result, budget) else tuple(schedule)


def _compute_loads(problem: RematProblem, events: list[Event]) -> np.ndarray:
    load = np.full(len(events), -np.inf)
    memory = problem.static_bytes
    for k, (kind, v) in enumerate(events):
        if kind == "compute":
            memory += problem.size[v]
            load[k] = memory
        else:
            memory -= problem.size[v]
    return load


def _eviction_pairs(problem: RematProblem, events: list[Event], alive: np.ndarray) -> list[tuple[int, int]]:
    """(free index, recompute index) pairs among live events, the costliest recomputation first."""
    last_free: dict[int, int] = {}
    computed: set[int] = set()
    pairs = []
    for k in np.flatnonzero(alive).tolist():
        kind, v = events[k]
        if kind == "free":
            last_free[v] = k
        elif v in computed and v in last_free:
            pairs.append((last_free.pop(v), k))
        else:
            computed.add(v)
    return sorted(pairs, key=lambda ij: (-problem.cost[events[ij[1]][1]], ij))


def _drop_unread_recomputations(
    problem: RematProblem, events: list[Event], alive: np.ndarray, load: np.ndarray
) -> bool:
    """Drop a recomputation (and its free) when no computation reads it before the free."""
    computed: set[int] = set()
    open_compute: dict[int, int] = {}  # node -> index of its live recomputation not read yet
    dropped = False
    for k in np.flatnonzero(alive).tolist():
        kind, v = events[k]
        if kind == "compute":
            for u in problem.preds[v]:
                open_compute.pop(u, None)
            if v in computed:
                open_compute[v] = k
            computed.add(v)
        elif v in open_compute:
            c = open_compute.pop(v)
            load[c + 1 : k] -= problem.size[v]
            load[c] = -np.inf
            alive[c] = alive[k] = False
            dropped = True
    return dropped


def _fits(problem: RematProblem, events: Schedule, budget: int) -> bool:
    try:
        peak, _ = simulate(problem, events)
    except InvalidSchedule:
        return False
    return peak <= budget


class _Evictor:
    def __init__(
        self,
        problem: RematProblem,
        budget: int,
        weights: EvictionWeights,
        deadline: float,
        rng: random.Random,
    ):
        self.p = problem
        self.budget = budget
        self.w = weights
        self.deadline = deadline
        self.rng = rng
        self.readers = [sorted(s) for s in problem.succs]  # first computations that read each node
        self.resident: set[int] = set()
        self.pins = [0] * problem.n
        self.memory = problem.static_bytes
        self.events: list[Event] = []
        self.frontier = 0  # the node whose first computation is under way
        self.stage_needed: set[int] = set()  # read while computing the frontier (recomputations included)
        self.clock = 0  # computations so far
        self.last_used = [0] * problem.n  # clock when each tensor was last computed or read

    def replay(self, prefix: Schedule) -> int:
        """Take over the state after `prefix`; returns the next node to compute first."""
        first = 0
        for kind, v in prefix:
            if kind == "free":
                self._free(v)
                continue
            self.events.append((kind, v))
            self.clock += 1
            self.last_used[v] = self.clock
            for u in self.p.preds[v]:
                self.last_used[u] = self.clock
            self.resident.add(v)
            self.memory += self.p.size[v]
            first = max(first, v + 1)
        return first

    def run(self, start: int = 0) -> Schedule:
        for t in range(start, self.p.n):
            self.frontier = t
            self.stage_needed = self._stage_closure(t) if self.w.protect_stage else set()
            self._ensure(t)
            needs: dict[int, float] = {}
            for u in (t, *self.p.preds[t]):
                if u in self.resident and not self.pins[u] and self._next_need(u, needs) == math.inf:
                    self._free(u)
        return tuple(self.events)

    def _next_reader(self, v: int) -> float:
        readers = self.readers[v]
        i = bisect.bisect_left(readers, self.frontier)
        return readers[i] if i < len(readers) else math.inf

    def _next_need(self, v: int, memo: dict[int, float]) -> float:
        """Next first computation that needs v: as an input, or to recompute a missing successor."""
        if v in memo:
            return memo[v]
        memo[v] = math.inf  # guards the recursion; the DAG has no cycles
        need = self._next_reader(v)
        for w in self.p.succs[v]:
            if w < self.frontier and w not in self.resident:
                need = min(need, self._next_need(w, memo))
        memo[v] = need
        return need

    def _recompute_cost(self, v: int, memo: dict[int, float], depth: int) -> float:
        if v in self.resident:
            return 0.0
        if v not in memo:
            inputs = sum(self._recompute_cost(u, memo, depth - 1) for u in self.p.preds[v]) if depth else 0.0
            memo[v] = self.p.cost[v] + inputs
        return memo[v]

    def _ensure(self, v: int) -> None:
        """Make v resident: inputs first (pinned until v is computed), then room, then compute."""
        if v in self.resident:
            return
        if time.monotonic() > self.deadline:
            raise _OutOfTime
        if v < self.frontier and not self.p.may_recompute[v]:
            raise _Stuck
        self.pins[v] += 1
        inputs = []
        pending = list(self.p.preds[v])
        while pending:
            # Re-ordered after each input: recomputing one may have evicted another.
            u = self._input_order(pending)[0]
            pending.remove(u)
            self._ensure(u)
            self.pins[u] += 1
            inputs.append(u)
        while self.memory + self.p.size[v] > self.budget:
            victim = self._pick_victim()
            if victim is None:
                raise _Stuck
            self._free(victim)
        self.events.append(("compute", v))
        self.clock += 1
        self.last_used[v] = self.clock
        for u in self.p.preds[v]:
            self.last_used[u] = self.clock
        self.resident.add(v)
        self.memory += self.p.size[v]
        self.pins[v] -= 1
        for u in inputs:
            self.pins[u] -= 1

    def _input_order(self, preds: list[int]) -> list[int]:
        """Inputs in the order to make them resident: missing ones first, the one whose
        recomputation needs the most memory beyond its own result first (Sethi-Ullman order: an
        input made resident early stays pinned while the later ones are recomputed)."""
        if self.w.input_order == "cost":
            costs: dict[int, float] = {}
            key = lambda u: (u in self.resident, -self._recompute_cost(u, costs, _ANCESTRY_DEPTH), u)  # noqa: E731
            return sorted(preds, key=key)
        working: dict[int, int] = {}
        return sorted(
            preds, key=lambda u: (u in self.resident, self.p.size[u] - self._working_set(u, working), u)
        )

    def _working_set(self, v: int, memo: dict[int, int]) -> int:
        """Bytes beyond the resident tensors needed to make v resident (0 if it is): the peak of
        recomputing its missing ancestors in Sethi-Ullman order, ignoring evictions."""
        if v in self.resident:
            return 0
        if v not in memo:
            memo[v] = self.p.size[v]  # guards the recursion; the DAG has no cycles
            missing = [u for u in self.p.preds[v] if u not in self.resident]
            needs = sorted(((self._working_set(u, memo), self.p.size[u]) for u in missing), key=lambda ws: ws[1] - ws[0])
            peak, held = 0, 0
            for need, size in needs:
                peak = max(peak, held + need)
                held += size
            memo[v] = max(peak, held + self.p.size[v])
        return memo[v]

    def _free(self, u: int) -> None:
        self.events.append(("free", u))
        self.resident.discard(u)
        self.memory -= self.p.size[u]

    def _stage_closure(self, v: int) -> set[int]:
        """Tensors the computation of v reads, directly or to recompute missing ancestors."""
        needed: set[int] = set()
        stack = [v]
        while stack:
            x = stack.pop()
            for u in self.p.preds[x]:
                if u not in needed:
                    needed.add(u)
                    if u not in self.resident:
                        stack.append(u)
        return needed

    def _pick_victim(self) -> int | None:
        victim = self._pick_victim_among(spare_stage=self.w.protect_stage)
        if victim is None and self.w.protect_stage:
            victim = self._pick_victim_among(spare_stage=False)
            if victim is not None:  # its recomputation in this stage needs its own inputs
                self.stage_needed |= self._stage_closure(victim)
        return victim

    def _pick_victim_among(self, spare_stage: bool) -> int | None:
        needs: dict[int, float] = {}
        costs: dict[int, float] = {}
        best: tuple[float, int] | None = None
        for v in sorted(self.resident):
            if self.pins[v] or self.p.size[v] == 0:
                continue
            if spare_stage and v in self.stage_needed:
                continue  # evicting it would mean recomputing it within this stage: thrashing
            need = self._next_need(v, needs)
            if need == math.inf:
                return v  # nothing can read it again
            if not self.p.may_recompute[v]:
                continue
            cost = self.p.cost[v] + sum(self._recompute_cost(u, costs, _ANCESTRY_DEPTH - 1) for u in self.p.preds[v])
            score = cost / (self.p.size[v] ** self.w.size_power * (need - self.frontier + 1) ** self.w.distance_power)
            if self.w.recency_power:
                score /= (self.clock - self.last_used[v] + 1) ** self.w.recency_power
            if self.w.noise:
                score *= 1.0 + self.w.noise * self.rng.random()
            if best is None or score < best[0]:
                best = (score, v)
        return None if best is None else best[1]


def free_early(problem: RematProblem, schedule: Schedule) -> Schedule:
    """Move every free to right after the last event that reads the tensor (same peak or lower).

    A computation whose result nothing reads before it is freed is dropped with its free. The
    stage-grid schedules free a stage's tensors only after the stage's last computation; freeing
    them at once leaves room that `undo_evictions` can spend on keeping tensors instead of
    recomputing them.
    """
    events = list(schedule)
    last_read: dict[int, int] = {}  # node -> index of its live computation, or of its last reader since
    moved: dict[int, list[Event]] = {}  # index -> frees to emit right after that event
    dropped: set[int] = set()
    for k, (kind, v) in enumerate(events):
        if kind == "compute":
            for u in problem.preds[v]:
                last_read[u] = k
            last_read[v] = k
            continue
        anchor = last_read.pop(v)
        if events[anchor] == ("compute", v) and anchor not in dropped and _is_recomputation(events, anchor):
            dropped.add(anchor)  # read by nothing: neither compute nor free it
            continue
        moved.setdefault(anchor, []).append(("free", v))
    out: list[Event] = []
    for k, event in enumerate(events):
        if event[0] == "compute" and k not in dropped:
            out.append(event)
        out.extend(moved.get(k, ()))
    return tuple(out)


def _is_recomputation(events: list[Event], k: int) -> bool:
    return ("compute", events[k][1]) in events[:k]
