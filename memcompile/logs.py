"""What memcompile says, and when: `logging.getLogger("memcompile")`.

At INFO, the level it starts at (printed to stderr unless the application logs on its own):

- one line per planned region, when it is first compiled: predicted peak against the budget,
  the plan's status in words, solve and check time (region_line);
- while a region's first compile has taken more than PROGRESS_AFTER_S, a progress line (then
  every PROGRESS_EVERY_S): which region, which rung of the rewrite ladder (the graph as traced,
  the loss head chunked, the MLPs chunked) and which step of the planner;
- one summary when the first step's backward starts: the predicted step peak against the budget
  (step_summary).

Warnings (a step that may run over the budget while its regions are first compiled, fallbacks)
and errors too; everything else is DEBUG, so a training loop stays quiet once compiled.

More or less: `logging.getLogger("memcompile").setLevel(logging.DEBUG)` (or WARNING), or
MEMCOMPILE_LOGS=debug|info|warning|error|off, read once at import. The default handler prints
only while no handler of the application's would get the record (logging.basicConfig, pytest's
capture): then that one prints it, once.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

from memcompile.plan import Plan, format_bytes, status_words

if TYPE_CHECKING:
    from memcompile.options import Options

NAME = "memcompile"
log = logging.getLogger(NAME)

PROGRESS_AFTER_S = 10.0  # a first compile this long gets a progress line ...
PROGRESS_EVERY_S = 30.0  # ... and another one this often while it lasts
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR,
           "off": logging.CRITICAL + 1}


class _DefaultHandler(logging.StreamHandler):
    """stderr, unless another handler on the way up from the memcompile logger gets the record."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        self.setFormatter(logging.Formatter("%(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        if not _application_handles():
            self.stream = sys.stderr  # the current one (pytest and notebooks replace it)
            super().emit(record)


def _application_handles() -> bool:
    logger: logging.Logger | None = log
    while logger is not None:
        if any(not isinstance(h, _DefaultHandler) for h in logger.handlers):
            return True
        if not logger.propagate:
            return False
        logger = logger.parent
    return False


def _install_default() -> None:
    level = _LEVELS.get(os.environ.get("MEMCOMPILE_LOGS", "info").strip().lower(), logging.INFO)
    if log.level == logging.NOTSET:
        log.setLevel(level)
    if not any(isinstance(h, _DefaultHandler) for h in log.handlers):
        log.addHandler(_DefaultHandler())


_install_default()


# -- progress of a first compile -----------------------------------------------------------------

@dataclass
class _Progress:
    what: str  # "region 0"
    started: float
    rung: str = "the graph as traced"
    stage: str = ""


_ACTIVE: contextvars.ContextVar[_Progress | None] = contextvars.ContextVar("memcompile_progress", default=None)


@contextlib.contextmanager
def progress(what: str) -> Iterator[_Progress]:
    """While the block runs longer than PROGRESS_AFTER_S, say what it is doing (INFO)."""
    state = _Progress(what, time.monotonic())
    done = threading.Event()

    def report() -> None:
        wait = PROGRESS_AFTER_S
        while not done.wait(wait):
            log.info("%s", progress_line(state, time.monotonic() - state.started))
            wait = PROGRESS_EVERY_S

    token = _ACTIVE.set(state)
    thread = threading.Thread(target=report, name="memcompile-progress", daemon=True)
    thread.start()
    try:
        yield state
    finally:
        done.set()
        _ACTIVE.reset(token)
        thread.join(timeout=1.0)


def progress_line(state: _Progress, elapsed_s: float) -> str:
    return (f"memcompile: still planning {state.what} after {elapsed_s:.0f} s: rung {state.rung}"
            + (f"; {state.stage}" if state.stage else ""))


def rung(text: str) -> None:
    """The rung of the rewrite ladder the current first compile is on."""
    state = _ACTIVE.get()
    if state is not None:
        state.rung, state.stage = text, ""


def stage(text: str) -> None:
    """What the planner is doing within the current rung."""
    state = _ACTIVE.get()
    if state is not None:
        state.stage = text


# -- the lines a user sees -----------------------------------------------------------------------

def region_line(what: str, plan: Plan, wall_s: float) -> str:
    """One planned region: predicted peak against the step budget, status in words, times."""
    reserve = f" = budget {format_bytes(plan.budget_bytes)} - reserve {format_bytes(plan.reserve_bytes)}" \
        if plan.reserve_bytes else ""
    rewrites = f"; rewrites: {'; '.join(plan.graph_rewrites)}" if plan.graph_rewrites else ""
    return (f"memcompile: {what} ({plan.graph_id}) planned in {wall_s:.1f} s: predicted peak "
            f"{format_bytes(plan.predicted_peak_bytes)} of the step budget {format_bytes(plan.step_budget_bytes)}"
            f"{reserve}; {status_words(plan.solver_status, plan.gap)}; added ~{plan.total_added_time_s * 1e3:.2f} ms "
            f"(estimate); solve {plan.solve_s:.2f} s, check {plan.check_s:.2f} s{rewrites}")


def step_summary(step_peak_bytes: int, options: "Options", regions: int, calls: int, compile_s: float) -> str:
    """The first step's end: its predicted peak against the budget, and where the budget came from."""
    budget, step_budget = options.budget_bytes, options.step_budget_bytes
    source = f" ({options.budget_source})" if options.budget_source else ""
    parts = []
    if options.optimizer_reserve_bytes:
        parts.append(f"optimizer state {format_bytes(options.optimizer_reserve_bytes)}")
    if options.library_workspace_bytes:
        parts.append(f"cuBLAS workspaces {format_bytes(options.library_workspace_bytes)}")
    if options.compile_scratch_bytes:
        parts.append(f"compile-time copies {format_bytes(options.compile_scratch_bytes)}")
    other = (options.reserve_bytes - options.optimizer_reserve_bytes - options.library_workspace_bytes
             - options.compile_scratch_bytes)
    if other:
        parts.append(f"reserve= {format_bytes(other)}")
    reserve = f", reserve {format_bytes(options.reserve_bytes)} ({', '.join(parts)})" if options.reserve_bytes else ""
    verdict = ("within it" if step_peak_bytes <= step_budget else
               f"OVER it by {format_bytes(step_peak_bytes - step_budget)}: the step's regions are re-planned "
               "together at the next step")
    return (f"memcompile: first step: predicted peak {format_bytes(step_peak_bytes)} of the step budget "
            f"{format_bytes(step_budget)}, {verdict} (budget {format_bytes(budget)}{source}{reserve}); "
            f"{regions} compiled region(s), {calls} call(s) per step, compiled in {compile_s:.1f} s")
