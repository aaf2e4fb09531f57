"""The largest batch whose plan fits a budget, by bisection over plans: `memcompile.max_batch`.

    def make_step(batch, backend):
        compiled = torch.compile(model, backend=backend, dynamic=False)
        x = torch.randn(batch, 128)
        return lambda: compiled(x).sum().backward()

    found = memcompile.max_batch(make_step, "16GB")
    found.batch, found.limit          # 14, "batch 15 needs a budget of at least 16.75 GiB ..."

Each probe compiles the step for one batch with a backend in plan-only mode: the graph is traced
and planned (the rewrite ladder included) and the plan is the answer; no code is generated and
no step runs, so nothing but the step's inputs and the model is ever allocated. A batch fits
when a plan within the budget is found; one that does not fit raises InfeasibleBudgetError,
whose min_feasible_bytes and peak contributors say what limits it.

The step should compile to one graph (`fullgraph=True` helps to be sure): only the first
graph of a step is planned before the probe stops. Each probe starts from `torch.compiler.reset()`
(a fresh Dynamo, no recompile limit reached, no shape marked dynamic by an earlier probe), and
so does the end of the search: compile the model you train after max_batch returns.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch

from memcompile.backend import Backend
from memcompile.errors import InfeasibleBudgetError, PlannedOnly
from memcompile.options import Options, make_options
from memcompile.plan import Plan, StatusKind, format_bytes

log = logging.getLogger("memcompile")

_UNBOUNDED_HI = 2**16  # where doubling stops with hi=None


@dataclass(frozen=True)
class BatchProbe:
    batch: int
    fits: bool
    need_bytes: int  # the budget this batch needs at least: its plan's peak plus the reserve, or min_feasible_bytes
    status: str  # the plan's solver status, or StatusKind.INFEASIBLE
    seconds: float  # the probe's wall time (trace and plan)


@dataclass(frozen=True)
class MaxBatch:
    """The answer of max_batch: the largest fitting batch, its plan, and what stops the next one."""

    batch: int
    budget_bytes: int
    plan: Plan  # the plan of the step at `batch`
    limit: str  # why `batch + 1` is not the answer
    probes: tuple[BatchProbe, ...]  # in the order they ran

    @property
    def seconds(self) -> float:
        return sum(p.seconds for p in self.probes)


def _options_of(budget: object, options: dict) -> Options:
    if isinstance(budget, Backend):
        if options:
            raise TypeError(f"max_batch(budget=<Backend>, ...) takes no other options (got {sorted(options)}): "
                            "the backend's own are used")
        return budget.options
    return make_options(budget, **options)


def _check_bounds(lo: object, hi: object) -> None:
    for name, value in (("lo", lo), ("hi", hi)):
        if value is None and name == "hi":
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            expected = "an int >= 1" + (" or None" if name == "hi" else "")
            raise ValueError(f"max_batch: {name}={value!r}: expected {expected}")
    if hi is not None and hi < lo:
        raise ValueError(f"max_batch: hi={hi} is below lo={lo}")


def _probe(make_step: Callable[[int, Backend], Callable[[], object]], batch: int, options: Options,
           ) -> tuple[BatchProbe, Plan | InfeasibleBudgetError]:
    torch.compiler.reset()
    backend = Backend(options)
    backend.plan_only = True
    began = time.perf_counter()
    step = make_step(batch, backend)
    if not callable(step):
        raise TypeError(f"max_batch: make_step({batch}, backend) returned {type(step).__name__}: expected the "
                        "step to run (a callable taking no arguments)")
    try:
        step()
    except PlannedOnly as planned:
        plan = planned.plan
        seconds = time.perf_counter() - began
        if plan.status_kind is StatusKind.STOCK_FALLBACK:
            raise RuntimeError(f"max_batch: planning batch {batch} failed ({plan.solver_status}); "
                               "no plan to judge it by") from None
        fits = plan.predicted_peak_bytes <= plan.step_budget_bytes
        return BatchProbe(batch, fits, plan.predicted_peak_bytes + plan.reserve_bytes, plan.solver_status,
                          seconds), plan
    except InfeasibleBudgetError as error:
        seconds = time.perf_counter() - began
        return BatchProbe(batch, False, error.min_feasible_bytes, StatusKind.INFEASIBLE, seconds), error
    raise RuntimeError(f"max_batch: the step for batch {batch} ran without compiling a graph with the backend "
                       "max_batch passed to make_step (compile the step with torch.compile(..., backend=backend))")


def _limit_text(batch: int, failed: tuple[BatchProbe, InfeasibleBudgetError | Plan] | None,
                budget_bytes: int, hi: int, plan: Plan) -> str:
    at = (f"batch {batch}'s plan peaks at {format_bytes(plan.predicted_peak_bytes)} of the step budget "
          f"{format_bytes(plan.step_budget_bytes)}")
    if failed is None:
        return f"{at}; hi={hi} reached, larger batches not tried"
    probe, why = failed
    if isinstance(why, InfeasibleBudgetError):
        largest = sorted(why.contributors, key=lambda cb: -cb[1])
        parts = ", ".join(f"{c.replace('_', ' ')} {format_bytes(b)}" for c, b in largest if b)
        return (f"{at}; batch {probe.batch} needs a budget of at least {format_bytes(probe.need_bytes)} "
                f"(budget {format_bytes(budget_bytes)})" + (f"; at its least peak: {parts}" if parts else ""))
    return f"{at}; batch {probe.batch}'s plan peaks at {format_bytes(why.predicted_peak_bytes)}, over the step budget"


def max_batch(make_step: Callable[[int, Backend], Callable[[], object]], budget: object, lo: int = 1,
              hi: int | None = None, **options: object) -> MaxBatch:
    """The largest batch in [lo, hi] whose step memcompile can plan within `budget`.

    make_step(batch, backend) builds the step for `batch`, compiled with `backend`, and returns it
    (a callable running forward and backward once). budget: what memcompile.budget() takes (bytes,
    "16GB", "90%") with its options, or a Backend from it. hi=None doubles from lo until a batch
    does not fit (at most 2**16). Bisection over plans: no step runs (see the module docstring).
    Raises InfeasibleBudgetError if even `lo` does not fit.
    """
    if not callable(make_step):
        raise TypeError(f"max_batch: make_step has type {type(make_step).__name__}: expected a function "
                        "(batch, backend) -> step")
    _check_bounds(lo, hi)
    opts = _options_of(budget, dict(options))
    probes: list[BatchProbe] = []
    results: dict[int, tuple[BatchProbe, Plan | InfeasibleBudgetError]] = {}

    def fits(batch: int) -> bool:
        if batch not in results:
            results[batch] = _probe(make_step, batch, opts)
            probe = results[batch][0]
            probes.append(probe)
            log.info("memcompile: max_batch: batch %d %s (needs %s of %s; planned in %.1f s)", batch,
                     "fits" if probe.fits else "does not fit", format_bytes(probe.need_bytes),
                     format_bytes(results[batch][1].budget_bytes), probe.seconds)
        return results[batch][0].fits

    try:
        if not fits(lo):
            why = results[lo][1]
            if isinstance(why, InfeasibleBudgetError):
                raise why
            raise InfeasibleBudgetError(f"memcompile.max_batch: batch lo={lo} does not fit: its plan peaks at "
                                        f"{format_bytes(why.predicted_peak_bytes)}", budget_bytes=why.budget_bytes,
                                        min_feasible_bytes=results[lo][0].need_bytes)
        good, bad = lo, None
        top = hi if hi is not None else _UNBOUNDED_HI
        if hi is not None and fits(hi):
            good = hi
        else:
            bad = hi
            while bad is None:  # doubling (hi=None)
                nxt = min(2 * good, top)
                if nxt == good:
                    break
                if fits(nxt):
                    good = nxt
                else:
                    bad = nxt
        while bad is not None and bad - good > 1:
            mid = (good + bad) // 2
            if fits(mid):
                good = mid
            else:
                bad = mid
    finally:
        torch.compiler.reset()
    plan = results[good][1]
    budget_bytes = plan.budget_bytes
    limit = _limit_text(good, results[bad] if bad is not None else None, budget_bytes, top, plan)
    return MaxBatch(good, budget_bytes, plan, limit, tuple(probes))
