"""memcompile: train models under an absolute memory budget with torch.compile.

    backend = memcompile.budget("20GB")              # or "90%" of the device, optimizer=opt
    model = torch.compile(model, backend=backend)
    loss = model(x).sum(); loss.backward()   # the step's peak memory stays under 20 GB
    print(memcompile.dump(backend))
"""

from __future__ import annotations

from memcompile import logs as _logs  # noqa: F401  (the "memcompile" logger's default: memcompile/logs.py)
from memcompile.backend import Backend
from memcompile.batch_search import BatchProbe, MaxBatch, max_batch
from memcompile.plan_dump import dump as _dump_impl
from memcompile.errors import (InfeasibleBudgetError, PlanningFailedError, StepOverrunError, StepOverrunWarning,
                               UnplannedFrameError, UnplannedFrameWarning)
from memcompile.measure import PeakMeasurement, measure_peak
from memcompile.options import Experiments, Options, make_options, parse_bytes
from memcompile.plan import Decision, Plan

__version__ = "0.1.0"

__all__ = [
    "Backend", "Decision", "Experiments", "InfeasibleBudgetError", "Options", "PeakMeasurement", "Plan",
    "PlanningFailedError", "StepOverrunError", "StepOverrunWarning", "UnplannedFrameError", "UnplannedFrameWarning",
    "budget", "dump", "measure_peak", "parse_bytes",
    "BatchProbe", "MaxBatch", "max_batch",
    "MissingBudgetError", "UnsupportedModeError", "last_named_backend", "named_backend",  # backend="memcompile"
]


# The backend by name (memcompile/registration.py), imported when first asked for: importing it
# watches Dynamo's frame conversions (backend.watch_skipped_frames), which a bare `import memcompile`
# must not do to a process that never compiles with memcompile.
_BY_NAME = ("MissingBudgetError", "UnsupportedModeError", "last_named_backend", "named_backend")


def __getattr__(name: str) -> object:
    if name in _BY_NAME:
        from memcompile import registration

        return getattr(registration, name)
    raise AttributeError(f"module 'memcompile' has no attribute {name!r}")


def budget(limit: int | str, **options: object) -> Backend:
    """A torch.compile backend keeping each training step's peak tensor memory <= `limit`.

    limit: bytes (int), a size string ("20GB" = 20e9, "20GiB" = 20*2**30, "1.5 GiB"), or relative
    to the step's device, resolved at the first compiled graph: "90%" of its total memory (on the
    CPU, of physical memory), or "free" (free at the first call, minus 5%); the plan shows the
    bytes and where they came from (memcompile/device_budget.py).
    options: optimizer (a torch.optim optimizer: its state is reserved, memcompile/optimizer_state.py),
    reserve (other bytes held outside the step), time_limit_s (solver), codegen ("inductor" |
    "aot_eager"), device (cost profile), workers, seed, quantize, offload, chunk_loss, chunk_mlp,
    on_unplanned, on_first_step_overrun: see README "Options".
    """
    return Backend(make_options(limit, **options))


def dump(obj: object, format: str = "text", path: str | None = None) -> str:
    """The plans of a backend, a torch.compile result built with one, a plan or a list of plans.

    format: "text" (report), "json" (schema_version 2; `from memcompile.plan_dump import load_plans`
    reads it back, and version 1 files too) or "html" (self-contained picture of live memory before/after).
    Writes to `path` too if given.
    """
    return _dump_impl(obj, format=format, path=path)
