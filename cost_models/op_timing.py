"""Measured times of the compute-bound ops a plan may recompute (matmuls, convolutions, attention).

A roofline over one matmul rate misprices some of them on CPU: Llama small's causal attention
(4 x 4 heads, 128 tokens, head dim 32) was estimated at 148 us a call from its FLOPs (the s14
plan at 9.91 MiB), where one recomputed call added 508 us to a step (`python
benchmarks/step_profile.py --model llama --budget 10389253`); alone it runs in about twice its
roofline (`python benchmarks/op_timing_check.py`: 162 us roofline, 352 us median). The solver
traded memory for time with those prices. So, where the profile says so
(the measured CPU profile), each distinct op call (op, shapes, strides, dtypes, other arguments,
thread count) is run on random inputs once per process and its fastest time is the estimate.

Only ops with a FLOP formula are timed (pointwise ops stay on the bandwidth roofline: Inductor
fuses them, so a lone op's time says little). Not timed, the roofline stays: symbolic sizes,
inputs and result above MAX_BYTES together (what a run allocates) or above the budget's headroom
at the compile (`timing_allocation_limit`), and ops that fail on random inputs. A first call
slower than MAX_CALL_S is not repeated. A process spends at most TIME_BUDGET_S measuring.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import time

import torch

from memcompile import _torch_private as tp
from memcompile.errors import UNREADABLE_GRAPH_ERRORS

log = logging.getLogger(__name__)

MAX_BYTES = 64 * 2**20
MAX_CALL_S = 0.05
TIME_BUDGET_S = 2.0
MIN_REPEATS, MAX_REPEATS, REPEATS_FOR_S = 3, 30, 0.02  # ~20 ms of runs an op, 4 to 31 runs

_measured: dict[tuple, float | None] = {}
_spent_s = [0.0]
# What a timing run may allocate now: it runs inside the step's first call, beside the step's
# tensors, so it must stay within the budget's headroom (set by the backend per compile).
_allocation_limit: contextvars.ContextVar[int | None] = contextvars.ContextVar("timing_allocation_limit", default=None)


@contextlib.contextmanager
def timing_allocation_limit(limit_bytes: int):
    """Ops timed inside allocate (inputs and result together) at most `limit_bytes`."""
    token = _allocation_limit.set(max(0, limit_bytes))
    try:
        yield
    finally:
        _allocation_limit.reset(token)


def _describe(value: object) -> object:
    """A hashable description of one argument: tensors by shape, strides and dtype."""
    if isinstance(value, torch.Tensor):
        return ("tensor", _concrete(value.shape), _concrete(value.stride()), value.dtype, value.device.type)
    if isinstance(value, (list, tuple)):
        return tuple(_describe(v) for v in value)
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        raise TypeError("symbolic")
    return repr(value)


def _concrete(sizes) -> tuple[int, ...]:
    if any(isinstance(s, torch.SymInt) for s in sizes):
        raise TypeError("symbolic")
    return tuple(sizes)


def _inputs_generator() -> torch.Generator:
    """A generator of the timing inputs' own: timing inside a training step must not draw from
    the step's random stream (its dropout masks would change)."""
    if not _generator:
        _generator.append(torch.Generator().manual_seed(0))
    return _generator[0]


_generator: list[torch.Generator] = []


def _real(value: object) -> object:
    """A real CPU tensor like `value` (fake or meta), random where it is floating point; its
    storage filled first, so broadcast (stride 0) layouts are made as they are."""
    if isinstance(value, torch.Tensor):
        extent = 1 + sum((size - 1) * stride for size, stride in zip(value.shape, value.stride())) if value.numel() else 0
        storage = torch.empty(extent, dtype=value.dtype)
        storage = storage.normal_(generator=_inputs_generator()) if storage.is_floating_point() else storage.zero_()
        return storage.as_strided(tuple(value.shape), tuple(value.stride()))
    if isinstance(value, (list, tuple)):
        return type(value)(_real(v) for v in value)
    return value


def _limit() -> int:
    limit = _allocation_limit.get()
    return MAX_BYTES if limit is None else limit


def measured_op_time_s(op: object, args: tuple, kwargs: dict, result: object = None) -> float | None:
    """The fastest of a few runs of `op` on random CPU inputs like `args` and `kwargs` (a node's
    arguments, tensors as their fake values; `result` its fake result, for the bytes a run
    allocates), or None where it is not timed (see the module's docstring). Cached per distinct call."""
    if not hasattr(op, "_overloadpacket"):  # ATen ops only
        return None
    try:
        key = (str(op), _describe(args), _describe(tuple(sorted(kwargs.items()))), torch.get_num_threads())
    except TypeError:
        return None
    if key in _measured:
        return _measured[key]
    tensors = list(_flat(args, kwargs))
    if _spent_s[0] >= TIME_BUDGET_S or any(t.device.type != "cpu" for t in tensors) \
            or sum(t.numel() * t.itemsize for t in [*tensors, *_flat(result)]) > min(MAX_BYTES, _limit()):
        return None  # not cached: a later compile with more headroom may time it
    measured = _time(op, args, kwargs)
    # two significant digits: timings jitter; plans (and their cache keys) should not
    _measured[key] = None if measured is None else float(f"{measured:.2g}")
    return _measured[key]


def _flat(*values: object):
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from _flat(*value)
        elif isinstance(value, dict):
            yield from _flat(*value.values())


def _time(op, args, kwargs) -> float | None:
    started = time.perf_counter()
    try:
        with tp.outside_tracing_modes(), torch.no_grad():
            real_args, real_kwargs = _real(args), {k: _real(v) for k, v in kwargs.items()}
            first = time.perf_counter()
            op(*real_args, **real_kwargs)
            best = time.perf_counter() - first
            if best <= MAX_CALL_S:
                # the fastest of several: other work on the core only slows a run down (with the
                # test suite running on the same core, the fastest of 4 runs of a 240 us matmul read 500 us)
                for _ in range(min(MAX_REPEATS, max(MIN_REPEATS, int(REPEATS_FOR_S / max(best, 1e-6))))):
                    start = time.perf_counter()
                    op(*real_args, **real_kwargs)
                    best = min(best, time.perf_counter() - start)
    # a real op on random inputs: its own checks (asserts), its arithmetic, memory may fail
    except (*UNREADABLE_GRAPH_ERRORS, AssertionError, ArithmeticError, MemoryError) as error:  # the roofline stays
        log.debug("memcompile: %s could not be timed (%s: %s)", op, type(error).__name__, error)
        return None
    finally:
        _spent_s[0] += time.perf_counter() - started
    return best
