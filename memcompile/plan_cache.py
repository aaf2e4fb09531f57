"""In-process cache of solver answers: the same problem under the same budget is solved once.

A recompile of the same graph, a second identical region (one compiled transformer block per
layer), the same graph after `torch.compiler.reset()`, or a region re-planned for a ledger value
it has seen before all build the same `ActivationProblem` and get the cached answer: no solve,
and the same plan every time (CP-SAT with several workers and a wall-clock limit is not
deterministic by itself: docs/design.md, "Determinism and caching").

Key: SHA-256 of the problem's content (every field but the node names, which differ between
traces of the same code), the solver entry point and its arguments (budget target, time limit,
workers, seed), the torch version and a hash of memcompile's source. The problem is what the
solver sees of the joint graph: its structure (who reads whom, in what order), byte sizes from
shapes and dtypes, recompute costs from the device profile, user constraints. Answers are
decisions by candidate index; the planner rewrites and checks the graphs exactly on every use,
so a hit can never produce a plan over the budget.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import hashlib
import pathlib
import threading
from typing import Any, Callable, Iterator

import torch

_MAX_ENTRIES = 512
_lock = threading.Lock()
_entries: "collections.OrderedDict[str, Any]" = collections.OrderedDict()
_stats = {"hits": 0, "misses": 0}
_enabled = True


@functools.lru_cache(maxsize=1)
def source_hash() -> str:
    """Changes whenever memcompile's code does: part of every cache key."""
    root = pathlib.Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.read_bytes())
    for sub in ("passes", "cost_models"):
        # installed layout: memcompile/passes; editable layout resolves to the repo's folders
        pkg = __import__(f"memcompile.{sub}", fromlist=["_"])
        for path in sorted(pathlib.Path(pkg.__file__).parent.glob("*.py")):
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def problem_text(problem: Any) -> str:
    """Canonical text of a solver problem: every dataclass field except `names`."""
    return ";".join(f"{f.name}={getattr(problem, f.name)!r}" for f in dataclasses.fields(problem) if f.name != "names")


def cache_key(solve: Callable, problem: Any, args: tuple, kwargs: dict) -> str:
    digest = hashlib.sha256()
    for part in (f"{solve.__module__}.{solve.__qualname__}", problem_text(problem), repr(args),
                 repr(sorted(kwargs.items())), torch.__version__, source_hash()):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()


def solve_cached(solve: Callable, problem: Any, *args: Any, **kwargs: Any) -> Any:
    """`solve(problem, *args, **kwargs)`, or its earlier answer for an equal problem.

    A hit returns the first answer unchanged (also its solve time, so a planner loop that
    budgets time replays the same way)."""
    if not _enabled:
        return solve(problem, *args, **kwargs)
    key = cache_key(solve, problem, args, kwargs)
    with _lock:
        if key in _entries:
            _entries.move_to_end(key)
            _stats["hits"] += 1
            return _entries[key]
    answer = solve(problem, *args, **kwargs)
    with _lock:
        _stats["misses"] += 1
        _entries[key] = answer
        while len(_entries) > _MAX_ENTRIES:
            _entries.popitem(last=False)
    return answer


def stats() -> dict[str, int]:
    """Hits and misses since the process started (or the last `clear()`)."""
    with _lock:
        return dict(_stats, entries=len(_entries))


def clear() -> None:
    with _lock:
        _entries.clear()
        _stats.update(hits=0, misses=0)


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Solve every time (for measuring the solver itself)."""
    global _enabled
    previous, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = previous
