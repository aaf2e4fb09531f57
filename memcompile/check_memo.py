"""Checks of planned graphs, remembered by the graphs' content within one process.

A check (planner.predicted_liveness) lowers and schedules a copy of a forward and a backward
with Inductor: a few percent of a plain compile each. The same graphs are checked again where a
region is traced and planned a second time (the rewrite ladder plans a graph for its fastest plan,
then searches it for its least peak), and a candidate plan can rewrite to graphs already checked.
A check's answer depends only on the graphs as data and on what the check reads besides them
(the caller's key parts: the check's mode, the allocator's rounding, Inductor's rules and config,
the CPU's threads), so identical graphs are checked once. A memo lives as long as the backend that
owns it (`remembering`), so that nothing outlives the options and rules it was made under.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import hashlib
from collections.abc import Iterator

import torch.fx as fx

from memcompile.plan_store import graph_text

# A planned graph pair's check is some kilobytes; a ladder checks a few dozen.
_CAPACITY = 256


def graphs_key(graphs: tuple[fx.GraphModule, ...], flagged: str, parts: tuple[object, ...]) -> str | None:
    """The key of a check of `graphs`: their nodes as data (plan_store.graph_text), the nodes
    carrying the `flagged` meta entry, the graphs' own meta, and `parts`; None where a size is
    symbolic (sizes substituted for planning are not in the text)."""
    digest = hashlib.sha256()
    for gm in graphs:
        text = graph_text(gm)
        if text is None:
            return None
        digest.update(text.encode())
        digest.update(repr(sorted((str(k), repr(v)) for k, v in gm.meta.items())).encode())
        digest.update(repr([n.name for n in gm.graph.nodes if n.meta.get(flagged)]).encode())
        digest.update(b"\0")
    digest.update(repr(parts).encode())
    return digest.hexdigest()


class CheckMemo:
    """The latest checks' answers by key, least recently used dropped first."""

    def __init__(self, capacity: int = _CAPACITY) -> None:
        self._capacity = capacity
        self._answers: collections.OrderedDict[str, object] = collections.OrderedDict()

    def get(self, key: str | None) -> object | None:
        if key is None or key not in self._answers:
            return None
        self._answers.move_to_end(key)
        return self._answers[key]

    def put(self, key: str | None, answer: object) -> None:
        if key is None:
            return
        self._answers[key] = answer
        self._answers.move_to_end(key)
        while len(self._answers) > self._capacity:
            self._answers.popitem(last=False)


_CURRENT: contextvars.ContextVar[CheckMemo | None] = contextvars.ContextVar("memcompile_check_memo", default=None)


@contextlib.contextmanager
def remembering(memo: CheckMemo) -> Iterator[None]:
    """Checks made inside the scope are remembered in `memo` (one backend's)."""
    token = _CURRENT.set(memo)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current() -> CheckMemo | None:
    """The memo of the compile under way; None outside one (nothing is remembered)."""
    return _CURRENT.get()
