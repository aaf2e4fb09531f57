"""The backend by name: `torch.compile(model, backend="memcompile", options={"budget": "20GB"})`.

pyproject.toml registers `compile_by_name` under the `torch_dynamo_backends` entry point, which
Dynamo reads the first time an unknown backend name is looked up. torch 2.13 then calls
it once per captured graph as `compile_by_name(gm, example_inputs, options=...)` (`options` only
when the user passed a non-empty dict, `mode` only when not "default").

The options become `memcompile.budget(options["budget"], **other_options)`. When a tool only lets
you pass the name (Hugging Face `TrainingArguments(torch_compile_backend=...)`), the budget comes
from the `MEMCOMPILE_BUDGET` environment variable (and `reserve` from `MEMCOMPILE_RESERVE`); an
explicit option wins over the environment.

Every graph compiled with equal options goes to one `Backend`, so the plans of a model, of its
separately compiled blocks, or of its DDP buckets collect in one place:
`memcompile.named_backend(options)` returns it, `memcompile.last_named_backend()` the backend the
most recent graph compiled by name used. `torch.compiler.reset()` forgets them, as it forgets
the graphs they planned.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable, Mapping, Sequence

import torch.fx as fx

from memcompile.backend import Backend, watch_skipped_frames
from memcompile.device_budget import parse_relative
from memcompile.options import Options, make_options, parse_bytes

NAME = "memcompile"
BUDGET_ENV = "MEMCOMPILE_BUDGET"
RESERVE_ENV = "MEMCOMPILE_RESERVE"


class MissingBudgetError(TypeError):
    """`backend="memcompile"` was used with no budget in `options` nor in MEMCOMPILE_BUDGET."""


class UnsupportedModeError(ValueError):
    """`torch.compile(mode=...)` names Inductor presets; memcompile takes `options` instead."""


# Dynamo imports this module when it first looks the name up (torch.compile(backend="memcompile")),
# before any frame of that compile is converted: a frame it skips before any graph reaches a
# Backend is noticed too.
watch_skipped_frames()

_named: dict[Options, Backend] = {}
_last: Backend | None = None
_lock = threading.Lock()


def options_from(options: Mapping[str, object] | None, environ: Mapping[str, str] | None = None) -> Options:
    """Validated Options from `torch.compile(options=...)` plus the environment fallbacks."""
    environ = os.environ if environ is None else environ
    if options is not None and not isinstance(options, Mapping):
        raise TypeError(f"options has type {type(options).__name__}: expected a dict such as "
                        '{"budget": "20GB", "reserve": "2GB"}')
    given = dict(options or {})
    limit, source = given.pop("budget", None), 'options["budget"]'
    if limit is None:
        limit, source = environ.get(BUDGET_ENV) or None, BUDGET_ENV
    if limit is None:
        raise MissingBudgetError(
            f'torch.compile(backend="{NAME}") needs a budget: pass options={{"budget": "20GB"}} '
            f"(bytes or a size string; other keys are memcompile.budget()'s options) or set the "
            f"{BUDGET_ENV} environment variable (e.g. {BUDGET_ENV}=20GB) when the tool only takes "
            "the backend's name"
        )
    if "reserve" not in given and environ.get(RESERVE_ENV):
        given["reserve"] = parse_bytes(environ[RESERVE_ENV], name=RESERVE_ENV, allow_zero=True)
    # a size in bytes, or one relative to the device ("90%", "free": resolved at the first graph)
    budget = limit if parse_relative(limit, name=source) else parse_bytes(limit, name=source)
    try:
        return make_options(budget, **given)
    except TypeError as error:  # unknown keys: say where they came from, and that "budget" is one too
        raise TypeError(f'torch.compile(backend="{NAME}", options=...): {error}, plus "budget"') from error


def named_backend(options: Mapping[str, object] | None = None) -> Backend:
    """The Backend that `torch.compile(..., backend="memcompile", options=options)` compiles with.

    Equal options (after the environment fallbacks) give the same Backend, before or after the
    compilation; its `plans` are what `memcompile.dump()` prints.
    """
    parsed = options_from(options)
    with _lock:
        backend = _named.get(parsed)
        if backend is None:
            backend = _named[parsed] = Backend(parsed)
        return backend


def last_named_backend() -> Backend | None:
    """The Backend the most recent graph compiled with `backend="memcompile"` went to, or None."""
    return _last


def compile_by_name(
    gm: fx.GraphModule, example_inputs: Sequence[Any], *, options: Mapping[str, object] | None = None,
    mode: str | None = None,
) -> Callable:
    """The `torch_dynamo_backends` entry point: one captured graph, options from torch.compile."""
    global _last
    try:
        if mode not in (None, "default"):
            raise UnsupportedModeError(
                f"torch.compile(backend=\"{NAME}\", mode={mode!r}): modes are Inductor's presets and "
                f"are not accepted; pass options={{\"budget\": ..., \"codegen\": ...}} instead "
                "(torch.compile forbids mode and options together)"
            )
        backend = named_backend(options)
    except (TypeError, ValueError) as error:
        # Raised from the compiled callable (as Backend does for an infeasible budget), so users
        # catch our typed error rather than Dynamo's BackendCompilerFailed wrapper.
        return _raising(error)
    _last = backend
    return backend(gm, example_inputs)


def forget_named_backends() -> None:
    """Drop the backends made by name; `torch.compiler.reset()` calls this (their graphs are gone too)."""
    global _last
    with _lock:
        _named.clear()
        _last = None


# torch.compiler.reset() calls `reset()` on the backends Dynamo has cached, which for a backend
# given by name forwards to the registered function.
compile_by_name.reset = forget_named_backends  # type: ignore[attr-defined]
# memcompile.backend's watcher of frames Dynamo runs eagerly finds the backend of a by-name
# compile from torch.compile's options through this.
compile_by_name.memcompile_backend = named_backend  # type: ignore[attr-defined]


def _raising(error: Exception) -> Callable:
    def bad_options(*_args: Any, **_kwargs: Any):
        raise error

    return bad_options
