"""Measure what the budget promises: the peak bytes held by tensors during one step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from memcompile import _torch_private as tp
from memcompile.step_meter import all_live_cpu_tensors, enclosing_profile, finish_pending_meters, unique_storage_bytes


@dataclass(frozen=True)
class PeakMeasurement:
    peak_bytes: int  # live at start + the largest rise during the step
    live_at_start_bytes: int
    rise_bytes: int
    device: str
    result: Any


def _local(t: torch.Tensor) -> torch.Tensor:
    """This process's part of a distributed tensor (FSDP2's DTensor parameters and their grads
    have no storage of their own); any other tensor as it is."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _tensors_of(things: Iterable[object]) -> Iterable[torch.Tensor]:
    for thing in things:
        if isinstance(thing, torch.nn.Module):
            tensors = list(thing.parameters()) + list(thing.buffers())
        elif isinstance(thing, torch.Tensor):
            tensors = [thing]
        else:
            continue
        for t in tensors:
            yield _local(t)
            if t.grad is not None:
                yield _local(t.grad)


def _check_measure_arguments(fn: object, live_at_start: object, device: object) -> None:
    """TypeError/ValueError naming the argument and what is accepted."""
    if not callable(fn):
        raise TypeError(f"measure_peak(fn=...): fn must be callable (the step to measure), got {type(fn).__name__}")
    if not isinstance(device, str) or not (device == "cpu" or device == "cuda" or device.startswith("cuda:")):
        raise ValueError(f"measure_peak(device={device!r}): expected 'cpu', 'cuda' or 'cuda:N'")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"measure_peak(device={device!r}): CUDA is not available in this process; use device='cpu'")
    if live_at_start is None:
        return
    if isinstance(live_at_start, (torch.Tensor, torch.nn.Module)) or not isinstance(live_at_start, Iterable):
        raise TypeError("measure_peak(live_at_start=...): expected an iterable of modules and tensors "
                        f"(e.g. [model, x]), got {type(live_at_start).__name__}")


def measure_peak(
    fn: Callable[..., Any], *args: Any, live_at_start: Iterable[object] | None = None,
    device: str = "cpu", **kwargs: Any,
) -> PeakMeasurement:
    """Run `fn(*args, **kwargs)` once and report the peak of tensor memory during it.

    CUDA: `torch.cuda.max_memory_allocated()` after a reset (everything allocated counts).
    CPU: the allocator's events during the call (a running sum) on top of what was live at the
    start: `live_at_start` (modules, counting parameters, buffers and grads, and tensors) or, when
    None, every CPU tensor the garbage collector can find.
    """
    _check_measure_arguments(fn, live_at_start, device)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        result = fn(*args, **kwargs)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        return PeakMeasurement(peak, start, peak - start, device, result)
    if live_at_start is not None:
        live_at_start = list(live_at_start)
        wrong = [type(t).__name__ for t in live_at_start if not isinstance(t, (torch.Tensor, torch.nn.Module))]
        if wrong:
            raise TypeError("measure_peak(live_at_start=...): expected modules and tensors only, "
                            f"got {', '.join(sorted(set(wrong)))}")
    tensors = _tensors_of(live_at_start) if live_at_start is not None else all_live_cpu_tensors()
    start = unique_storage_bytes(tensors)
    # memcompile's steps run inside read their memory from this profile (memcompile/step_meter.py);
    # a profile one of them still holds is read first
    finish_pending_meters()
    with enclosing_profile() as meters:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            result = fn(*args, **kwargs)
        for meter in meters:
            meter.delivered(prof, start)
    running = rise = 0
    for _time_ns, delta in tp.profiler_allocation_deltas(prof):
        running += delta
        rise = max(rise, running)
    tp.release_profile(prof)
    return PeakMeasurement(start + rise, start, rise, device, result)
