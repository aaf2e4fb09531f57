"""Sizes to plan symbolic shapes for.

A graph compiled with dynamic shapes has symbolic sizes (`s0`); by default a plan is made for the
size each symbol had when it was traced (its hint). The backend re-plans a graph for larger
sizes by setting `planning_sizes({s0: 512})` around the compile: every byte count the planner
makes (`node_facts.tensor_nbytes`) then substitutes those values.
"""

from __future__ import annotations

import contextlib
import contextvars
import types
from typing import Iterator, Mapping

import torch

_SIZES: contextvars.ContextVar[Mapping[object, int]] = contextvars.ContextVar(
    "memcompile_sizes", default=types.MappingProxyType({}))
# expression -> int under the current sizes (sympy substitution is slow; planners ask often)
_VALUES: contextvars.ContextVar[dict | None] = contextvars.ContextVar("memcompile_size_values", default=None)


@contextlib.contextmanager
def planning_sizes(sizes: Mapping[object, int]) -> Iterator[None]:
    """Plan with these values for these symbols (sympy symbols of the graph's shape env)."""
    token = _SIZES.set(dict(sizes))
    values_token = _VALUES.set({})
    try:
        yield
    finally:
        _VALUES.reset(values_token)
        _SIZES.reset(token)


def size_value(value: object, unknown: int = 4096) -> int:
    """An int from an int or SymInt: the planning size if one is set, else its trace-time hint."""
    if not isinstance(value, torch.SymInt):
        return int(value)
    sizes = _SIZES.get()
    expr = value.node.expr
    if sizes and hasattr(expr, "xreplace"):
        values = _VALUES.get()
        if values is None:  # sizes set without planning_sizes: nothing remembered
            values = {}
        if expr not in values:
            substituted = expr.xreplace(sizes)
            is_number = isinstance(substituted, int) or getattr(substituted, "is_number", False)
            values[expr] = int(substituted) if is_number else None
        if values[expr] is not None:
            return values[expr]
    elif getattr(expr, "is_number", False) or isinstance(expr, int):
        return int(expr)
    hint = value.node.hint
    return int(hint) if hint is not None else unknown


def planning_sizes_now() -> dict[object, int]:
    """The sizes set by the innermost `planning_sizes`, or {} (trace-time hints)."""
    return dict(_SIZES.get())
