"""The rematerialization problem (Checkmate / Moccasin): a DAG of tensors with sizes and costs,
schedules of compute and free events over it, and the checker that replays one. Shared by the
solver (`remat.py`) and its event-level heuristics (`remat_events.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Iterable

Event = tuple[str, int]
Schedule = tuple[Event, ...]


class InvalidSchedule(ValueError):
    """A schedule violates the rematerialization semantics."""


# ----------------------------------------------------------------------------------- problem


@dataclass(frozen=True)
class RematProblem:
    """A DAG in topological order; node i's predecessors all have indices < i."""

    names: tuple[str, ...]
    preds: tuple[tuple[int, ...], ...]
    cost: tuple[float, ...]
    size: tuple[int, ...]
    recomputable: tuple[bool, ...] | None = None  # None: every node may be recomputed
    static_bytes: int = 0  # memory held throughout (weights, optimizer state, ...)

    def __post_init__(self) -> None:
        n = len(self.names)
        if not (len(self.preds) == len(self.cost) == len(self.size) == n):
            raise ValueError("names, preds, cost and size must have one entry per node")
        if self.recomputable is None:
            object.__setattr__(self, "recomputable", (True,) * n)
        elif len(self.recomputable) != n:
            raise ValueError("recomputable must have one entry per node")
        for v, ps in enumerate(self.preds):
            if any(not 0 <= u < v for u in ps) or len(set(ps)) != len(ps):
                raise ValueError(f"preds of node {v} must be distinct indices of earlier nodes")
        if any(s < 0 for s in self.size) or any(c < 0 for c in self.cost) or self.static_bytes < 0:
            raise ValueError("sizes, costs and static_bytes must be non-negative")

    @property
    def n(self) -> int:
        return len(self.names)

    @property
    def may_recompute(self) -> tuple[bool, ...]:
        """Per node, whether it may be computed again (`recomputable`, filled in when None)."""
        return self.recomputable if self.recomputable is not None else (True,) * self.n

    @cached_property
    def last_use(self) -> tuple[int, ...]:
        """Index of each node's last reader (the node itself for sinks), in first-computation order."""
        return tuple(max(s, default=v) for v, s in enumerate(self.succs))

    @cached_property
    def succs(self) -> tuple[tuple[int, ...], ...]:
        out: list[list[int]] = [[] for _ in range(self.n)]
        for v, ps in enumerate(self.preds):
            for u in ps:
                out[u].append(v)
        return tuple(tuple(s) for s in out)


def simulate(problem: RematProblem, schedule: Iterable[Event]) -> tuple[int, float]:
    """Replay `schedule`; return (peak, cost) or raise InvalidSchedule."""
    resident = [False] * problem.n
    computed_once = 0  # first computations must follow node order: next new node is this index
    memory = problem.static_bytes
    peak, cost = problem.static_bytes, 0.0
    for step, (kind, v) in enumerate(schedule):
        if not 0 <= v < problem.n:
            raise InvalidSchedule(f"event {step}: unknown node {v}")
        if kind == "compute":
            if resident[v]:
                raise InvalidSchedule(f"event {step}: node {v} computed while resident")
            if v > computed_once:
                raise InvalidSchedule(f"event {step}: node {v} computed before node {computed_once}")
            if v < computed_once and not problem.may_recompute[v]:
                raise InvalidSchedule(f"event {step}: node {v} may not be recomputed")
            missing = [u for u in problem.preds[v] if not resident[u]]
            if missing:
                raise InvalidSchedule(f"event {step}: node {v} needs non-resident {missing}")
            peak = max(peak, memory + problem.size[v])
            memory += problem.size[v]
            resident[v] = True
            cost += problem.cost[v]
            computed_once = max(computed_once, v + 1)
        elif kind == "free":
            if not resident[v]:
                raise InvalidSchedule(f"event {step}: free of non-resident node {v}")
            resident[v] = False
            memory -= problem.size[v]
        else:
            raise InvalidSchedule(f"event {step}: unknown event kind {kind!r}")
    if computed_once != problem.n:
        raise InvalidSchedule(f"only {computed_once} of {problem.n} nodes were computed")
    return peak, cost
