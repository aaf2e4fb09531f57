"""User options, parsed and validated once, then passed explicitly (a frozen, hashable record)."""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, fields
from typing import Mapping, Sequence, cast

from memcompile.device_budget import device_memory, input_device, parse_relative, resolve_relative
from memcompile.optimizer_state import OptimizerReserve, optimizer_reserve

from memcompile.cost_models.cuda_allocator import EXACT, AllocatorRounding

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
_ACCEPTED = ('an int number of bytes (> 0) or a string such as "20GB" (10^9), "20GiB" (2^30), '
             '"512MB", "1.5 GiB"; units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB (case-insensitive)')


def parse_bytes(value: object, *, name: str = "limit", allow_zero: bool = False) -> int:
    """Bytes from an int or a size string; ValueError naming `name` and what is accepted."""
    if isinstance(value, bool):
        raise ValueError(f"{name}={value!r} is not a size: expected {_ACCEPTED}")
    if isinstance(value, int):
        number = float(value)
        multiplier = 1
    elif isinstance(value, float):
        number, multiplier = value, 1
    elif isinstance(value, str):
        match = _SIZE.match(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(f"{name}={value!r} is not a size: expected {_ACCEPTED}")
        number, multiplier = float(match.group(1)), _UNITS[unit]
    else:
        raise ValueError(f"{name} has type {type(value).__name__}: expected {_ACCEPTED}")
    if math.isnan(number) or math.isinf(number):
        raise ValueError(f"{name}={value!r} is not finite: expected {_ACCEPTED}")
    result = int(number * multiplier)
    if result < 0 or (result == 0 and not allow_zero):
        raise ValueError(f"{name}={value!r} must be {'>= 0' if allow_zero else '> 0'} bytes: expected {_ACCEPTED}")
    return result


CODEGENS = ("inductor", "aot_eager")
UNPLANNED_ACTIONS = ("raise", "warn")


def _is_device_name(device: object) -> bool:
    """A cost profile memcompile has (cost_models/device.py: cpu, cuda, datasheet GPUs)."""
    from memcompile.cost_models.device import DATASHEET_PROFILES

    if not isinstance(device, str):
        return False
    name = device.lower()
    return name in ("cpu", "cuda") or name in DATASHEET_PROFILES or re.fullmatch(r"cuda:[0-9]+", name) is not None


@dataclass(frozen=True)
class Experiments:
    """Switches that turn one of memcompile's models or Inductor rules off, for comparisons in
    benchmarks and tests: the defaults are the product. Read once, from the environment variable
    named on each field, where the options are made (experiments_from_environment), or passed as
    `memcompile.budget(..., experiments=Experiments(...))`; part of the options, so of every key."""

    # The check predicts over the kernels Inductor's scheduler makes of the planned graphs, in its
    # order (passes/inductor_schedule.py); off: every FX node's result a buffer, in graph order.
    fusion_check: bool = True  # MEMCOMPILE_FUSION_CHECK
    # The solver's model counts the values Inductor inlines when they are recomputed as no buffer
    # (passes/recompute_fusion.py); off: each counts as one.
    recompute_fusion: bool = True  # MEMCOMPILE_RECOMPUTE_FUSION
    # PyTorch's own partitions are candidates beside the solver's plans (planner.StockPartitions).
    stock_candidates: bool = True  # MEMCOMPILE_STOCK_CANDIDATES
    # Compute-bound ops are timed on the CPU, not priced by the roofline (cost_models/op_timing.py).
    time_ops: bool = True  # MEMCOMPILE_TIME_OPS
    # In planned graphs Inductor does not fuse kernels where the fusion holds a large buffer
    # longer (passes/fusion_refusals.py, hooked in by _torch_private/inductor_hooks.py).
    lifetime_fusion: bool = True  # MEMCOMPILE_LIFETIME_FUSION
    # In planned graphs Inductor's wrapper reuses a freed buffer only for the next kernel's
    # allocation (_torch_private/inductor_hooks.py: the reuse rule).
    adjacent_reuse: bool = True  # MEMCOMPILE_ADJACENT_REUSE
    # Values that play one part in each repeated block form a class the greedy plans move whole
    # (passes/repeated_blocks.py); off: single values only.
    repeated_blocks: bool = True  # MEMCOMPILE_REPEATED_BLOCKS


_EXPERIMENT_VARIABLES = {f.name: f"MEMCOMPILE_{f.name.upper()}" for f in fields(Experiments)}


def experiments_from_environment(environ: Mapping[str, str]) -> Experiments:
    """Experiments from MEMCOMPILE_<FIELD> variables: "0" turns a switch off, anything else (or
    unset) leaves it on."""
    return Experiments(**{name: environ.get(variable, "1") != "0" for name, variable in _EXPERIMENT_VARIABLES.items()})


@dataclass(frozen=True)
class Options:
    budget_bytes: int  # peak bytes of one forward+backward step (see README: budget semantics); 0: budget_spec
    reserve_bytes: int = 0  # held outside the step (e.g. optimizer state): subtracted from the budget
    time_limit_s: float = 10.0  # solver wall-clock limit per graph; the best plan found is used
    codegen: str = "inductor"  # "inductor" (C++/Triton) or "aot_eager" (FX interpreter, for tests)
    device: str | None = None  # cost profile: "cpu", "a100", "h100", "h200"; None = the inputs' device
    workers: int = 2  # CP-SAT workers; fixed with the seed so the same graph gives the same plan
    seed: int = 0
    quantize: tuple[str, ...] = ()  # lossy formats the user allows: "int8", "fp8", "bf16" (opt-in)
    # None ("auto", the default): where the device has its own memory (CUDA, XPU); True also on the
    # CPU (tests the rewrite: the copy stays in RAM); False: never.
    offload: bool | None = None
    host_link_gbps: float | None = None  # device<->host GB/s for offload costs; None: the device profile's
    # Part of reserve_bytes: the matmul library's workspaces on the step's device (set by the
    # backend from the first graph's inputs; cost_models/device.py blas_workspace_bytes).
    library_workspace_bytes: int = 0
    # Part of reserve_bytes: what compiling a graph during the step allocates on its device (on the
    # CPU, copies of the generator state; cost_models/device.py compile_scratch_bytes). Set like the workspaces.
    compile_scratch_bytes: int = 0
    # What one allocation holds on the step's device: the CUDA caching allocator's blocks (512 B
    # multiples, see cost_models/cuda_allocator.py), exact bytes elsewhere. Set by the backend from
    # the first graph's inputs and the allocator settings in the environment, like the workspaces.
    allocator_rounding: AllocatorRounding = EXACT
    # Chunk linear -> cross_entropy loss heads by token rows (passes/loss_head.py): "auto" when no
    # plan fits without it or it is estimated faster (memcompile/backend.py), True always, False never.
    chunk_loss: bool | str = "auto"
    # Chunk transformer MLPs by token rows (passes/mlp_chunk.py): the same choices as chunk_loss.
    chunk_mlp: bool | str = "auto"
    # A frame Dynamo cannot compile runs eagerly, outside every plan: "raise" (UnplannedFrameError
    # at the call, before it runs) or "warn" (an UnplannedFrameWarning, then eager as Dynamo does).
    on_unplanned: str = "raise"
    # A call that cannot fit beside earlier calls of its step planned before it was known:
    # "raise" (StepOverrunError before it runs) or "warn" (a StepOverrunWarning, then it runs over).
    on_first_step_overrun: str = "raise"
    # budget("90%") / budget("free"): relative to the step's device, resolved into budget_bytes (0
    # until then) from the first graph's inputs (memcompile/device_budget.py); "" for a size in bytes.
    budget_spec: str = ""
    budget_source: str = ""  # where budget_bytes came from, once resolved (shown in the plan)
    # Part of reserve_bytes: the optimizer's state (budget(optimizer=...), memcompile/optimizer_state.py).
    optimizer_reserve_bytes: int = 0
    optimizer_source: str = ""  # how it was counted (shown in the plan)
    plan_store_dir: str = ""  # planning outcomes kept for the next launch here (memcompile/plan_store.py); "": not kept
    # Held by eager code between the forward's return and the backward's start (a loss computed
    # on a returned output), as measured (memcompile/step_meter.py): planned for at that moment.
    boundary_bytes: int = 0
    # Part of reserve_bytes: what eager code was measured to hold beside the step's regions at
    # other times (memcompile/ledger.py eager_bytes); where the larger of the two was seen.
    eager_outside_bytes: int = 0
    eager_where: str = ""
    experiments: Experiments = Experiments()

    @property
    def step_budget_bytes(self) -> int:
        return self.budget_bytes - self.reserve_bytes

    def reserve_text(self) -> str:
        """", reserve N" (and what of it the library holds) for messages; "" without a reserve."""
        if not self.reserve_bytes:
            return ""
        library, optimizer = self.library_workspace_bytes, self.optimizer_reserve_bytes
        parts = ([f"cuBLAS workspaces {library}"] if library else []) + (
            [f"optimizer state {optimizer}"] if optimizer else []) + (
            [f"compile-time copies {self.compile_scratch_bytes}"] if self.compile_scratch_bytes else []) + (
            [f"eager code outside the regions {self.eager_outside_bytes}"] if self.eager_outside_bytes else [])
        return f", reserve {self.reserve_bytes}" + (f" of which {' and '.join(parts)}" if parts else "")

    def describe(self) -> str:
        return ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self))


def make_options(limit: object, **overrides: object) -> Options:
    """Validate `memcompile.budget(limit, **options)` arguments into Options."""
    known = {"reserve", "time_limit_s", "codegen", "device", "workers", "seed", "quantize", "offload", "host_link_gbps",
             "chunk_loss", "chunk_mlp", "on_unplanned", "on_first_step_overrun", "optimizer", "plan_store",
             "experiments"}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise TypeError(f"memcompile.budget() got unknown option(s) {unknown}; accepted: {sorted(known)}")
    budget_spec = parse_relative(limit) or ""
    budget_bytes = 0 if budget_spec else parse_bytes(limit, name="limit")
    reserve_bytes = parse_bytes(overrides.pop("reserve", 0), name="reserve", allow_zero=True)
    optimizer = overrides.pop("optimizer", None)
    held = optimizer_reserve(optimizer) if optimizer is not None else OptimizerReserve(0, "")
    reserve_bytes += held.nbytes
    if not budget_spec:
        _check_reserve(budget_bytes, reserve_bytes, held.nbytes)
    time_limit_s = overrides.pop("time_limit_s", 10.0)
    if not isinstance(time_limit_s, (int, float)) or isinstance(time_limit_s, bool) or not (0 < time_limit_s < math.inf):
        raise ValueError(f"time_limit_s={time_limit_s!r}: expected a positive number of seconds")
    codegen = overrides.pop("codegen", "inductor")
    if codegen not in CODEGENS:
        raise ValueError(f"codegen={codegen!r}: expected one of {CODEGENS}")
    device = overrides.pop("device", None)
    if device is not None and not _is_device_name(device):
        raise ValueError(f"device={device!r}: expected None (the inputs' device), 'cpu', 'cuda', 'cuda:N', "
                         "'a100', 'h100' or 'h200'")
    workers = overrides.pop("workers", 2)
    seed = overrides.pop("seed", 0)
    for key, val in (("workers", workers), ("seed", seed)):
        if not isinstance(val, int) or isinstance(val, bool) or val < (1 if key == "workers" else 0):
            raise ValueError(f"{key}={val!r}: expected an int {'>= 1' if key == 'workers' else '>= 0'}")
    quantize = _parse_quantize(overrides.pop("quantize", None))
    offload = overrides.pop("offload", "auto")
    if not (offload is None or isinstance(offload, bool) or offload == "auto"):  # 1.0 == True: not a flag
        raise ValueError(f"offload={offload!r}: expected 'auto' or None (the default: where the device has its own "
                         "memory), False (never), or True (always; on CPU only useful for testing)")
    link = overrides.pop("host_link_gbps", None)
    if link is not None and (isinstance(link, bool) or not isinstance(link, (int, float)) or not 0 < link < math.inf):
        raise ValueError(f"host_link_gbps={link!r}: expected a positive number of GB/s (e.g. 25 for PCIe 4 x16) or None")
    chunk_loss = overrides.pop("chunk_loss", "auto")
    if not (isinstance(chunk_loss, bool) or chunk_loss == "auto"):
        raise ValueError(f"chunk_loss={chunk_loss!r}: expected 'auto' (the default: chunk a linear -> cross_entropy "
                         "loss head when no plan fits without it or chunking is estimated faster), True (always) "
                         "or False (never)")
    chunk_mlp = overrides.pop("chunk_mlp", "auto")
    if not (isinstance(chunk_mlp, bool) or chunk_mlp == "auto"):
        raise ValueError(f"chunk_mlp={chunk_mlp!r}: expected 'auto' (the default: compute linear -> activation -> "
                         "linear MLPs in token chunks when no plan fits without it or chunking is estimated faster), "
                         "True (always) or False (never)")
    on_unplanned = overrides.pop("on_unplanned", "raise")
    if on_unplanned not in UNPLANNED_ACTIONS:
        raise ValueError(f"on_unplanned={on_unplanned!r}: expected 'raise' (the default: a frame Dynamo cannot compile "
                         "stops the call with UnplannedFrameError, since its memory would not count against the "
                         "budget) or 'warn' (run it eagerly with an UnplannedFrameWarning)")
    on_overrun = overrides.pop("on_first_step_overrun", "raise")
    if on_overrun not in UNPLANNED_ACTIONS:
        raise ValueError(f"on_first_step_overrun={on_overrun!r}: expected 'raise' (the default: a call that cannot fit "
                         "beside regions of its step planned before it was known stops with StepOverrunError) or "
                         "'warn' (run that step over the budget with a StepOverrunWarning)")
    plan_store_dir = _plan_store_dir(overrides.pop("plan_store", True))
    experiments = overrides.pop("experiments", None)
    if experiments is None:
        experiments = experiments_from_environment(os.environ)
    elif not isinstance(experiments, Experiments):
        raise ValueError(f"experiments={experiments!r}: expected None (the default: read from MEMCOMPILE_* "
                         "variables) or a memcompile.options.Experiments")
    # (each value checked above; the casts only tell the type checker so)
    return Options(budget_bytes, reserve_bytes, float(time_limit_s), codegen, cast("str | None", device),
                   cast(int, workers), cast(int, seed), quantize,
                   None if offload == "auto" else cast("bool | None", offload), None if link is None else float(link),
                   chunk_loss=chunk_loss, chunk_mlp=chunk_mlp, on_unplanned=on_unplanned,
                   on_first_step_overrun=on_overrun, budget_spec=budget_spec,
                   optimizer_reserve_bytes=held.nbytes, optimizer_source=held.source, plan_store_dir=plan_store_dir,
                   experiments=experiments)


def _plan_store_dir(value: object) -> str:
    """The plan store's folder: True (the default) is MEMCOMPILE_PLAN_STORE if set (a folder, or
    "0" for none), else memcompile/plan_store.py's default; False: none; a str: that folder."""
    if value is True:
        from memcompile.plan_store import default_directory

        value = os.environ.get("MEMCOMPILE_PLAN_STORE") or default_directory()
        return "" if value == "0" else str(value)
    if value is False:
        return ""
    if isinstance(value, (str, os.PathLike)) and str(value):
        return os.fspath(value)
    raise ValueError(f"plan_store={value!r}: expected True (the default: keep plans on disk for the next launch, "
                     "in MEMCOMPILE_PLAN_STORE or a folder under the temporary directory), False (never), "
                     "or a folder path")


def _check_reserve(budget_bytes: int, reserve_bytes: int, optimizer_bytes: int) -> None:
    if reserve_bytes >= budget_bytes:
        of_which = f" (of which the optimizer's state {optimizer_bytes})" if optimizer_bytes else ""
        raise ValueError(f"reserve={reserve_bytes} bytes{of_which} leaves nothing of limit={budget_bytes} bytes for "
                         "the step; pass a reserve smaller than the limit")


def with_resolved_budget(options: Options, example_inputs: Sequence[object]) -> Options:
    """budget("90%") / budget("free") in bytes of the device of a graph's inputs (read now)."""
    if not options.budget_spec or options.budget_bytes:
        return options
    resolved = resolve_relative(options.budget_spec, device_memory(input_device(example_inputs)))
    try:
        _check_reserve(resolved.budget_bytes, options.reserve_bytes, options.optimizer_reserve_bytes)
    except ValueError as error:
        raise ValueError(f"memcompile.budget({options.budget_spec!r}) = {resolved.budget_bytes} bytes "
                         f"({resolved.source}): {error}") from None
    return dataclasses.replace(options, budget_bytes=resolved.budget_bytes, budget_source=resolved.source)


def with_optimizer(options: Options, optimizer: object) -> Options:
    """The options with `optimizer`'s state as their optimizer reserve (replacing an earlier one)."""
    held = optimizer_reserve(optimizer)
    reserve = options.reserve_bytes - options.optimizer_reserve_bytes + held.nbytes
    if options.budget_bytes:
        _check_reserve(options.budget_bytes, reserve, held.nbytes)
    return dataclasses.replace(options, reserve_bytes=reserve, optimizer_reserve_bytes=held.nbytes,
                               optimizer_source=held.source)


QUANTIZE_FORMATS = ("int8", "fp8", "bf16")


def _parse_quantize(value: object) -> tuple[str, ...]:
    """quantize=None | "int8" | ["int8", "bf16"] -> the allowed lossy formats, in a canonical order."""
    if value is None or value is False:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(v, str) for v in items):
        raise ValueError(f"quantize={value!r}: expected None, one of {QUANTIZE_FORMATS} or a list of them")
    unknown = sorted(set(items) - set(QUANTIZE_FORMATS))
    if unknown:
        raise ValueError(f"quantize={value!r}: unknown format(s) {unknown}; accepted: {QUANTIZE_FORMATS} (lossy, opt-in)")
    return tuple(f for f in QUANTIZE_FORMATS if f in items)
