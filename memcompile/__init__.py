"""memcompile: train models under an absolute memory budget with torch.compile.

    backend = memcompile.budget("20GB")
    model = torch.compile(model, backend=backend)
    loss = model(x).sum(); loss.backward()   # the step's peak memory stays under 20 GB
    print(memcompile.dump(backend))
"""

from __future__ import annotations

from memcompile.backend import Backend
from memcompile.errors import InfeasibleBudgetError
from memcompile.measure import PeakMeasurement, measure_peak
from memcompile.options import Options, make_options, parse_bytes
from memcompile.plan import Decision, Plan

__version__ = "0.1.0"

__all__ = [
    "Backend", "Decision", "InfeasibleBudgetError", "Options", "PeakMeasurement", "Plan",
    "budget", "dump", "measure_peak", "parse_bytes",
]


def budget(limit: int | str, **options: object) -> Backend:
    """A torch.compile backend keeping each training step's peak tensor memory <= `limit`.

    limit: bytes (int) or a size string ("20GB" = 20e9, "20GiB" = 20*2**30, "1.5 GiB").
    options: reserve (bytes held outside the step, e.g. optimizer state), time_limit_s (solver),
    codegen ("inductor" | "aot_eager"), device (cost profile), workers, seed.
    """
    return Backend(make_options(limit, **options))


def dump(obj: object) -> str:
    """Text view of the plans of a backend (or of one plan)."""
    if isinstance(obj, Plan):
        return obj.summary()
    if isinstance(obj, Backend):
        if not obj.plans:
            return f"{obj!r}: no graph with a backward pass compiled yet"
        return "\n\n".join(p.summary() for p in obj.plans)
    raise TypeError(f"memcompile.dump() takes a Backend or a Plan, got {type(obj).__name__}")
