"""Budgets in the device's terms: `budget("90%")` and `budget("free")`.

    parse_relative("90%")                  # -> "90%" (validated); None for a size in bytes
    memory = device_memory(torch.device("cuda", 0))
    resolve_relative("90%", memory)        # -> ResolvedBudget(bytes, "90% of cuda:0's 139.81 GiB total ...")

A relative budget resolves once the step's device is known: the device of the first compiled
graph's inputs (memcompile/backend.py). What it resolves to, and from which figures, is kept in
the plan (`Plan.budget_source`) and its dump.

- `"N%"` (0 < N <= 100): of the device's total memory: `torch.cuda.mem_get_info` (the XPU
  equivalent on XPU); on the CPU, of physical memory (`os.sysconf`), or of the cgroup's
  `memory.max` where that is lower (a container's limit).
- `"free"`: what is free at the first call, minus FREE_MARGIN of it. On CUDA/XPU "free" is the
  driver's free memory plus what this process's caching allocator already holds (the tensors in
  it, the model's parameters among them, count in the budget too); on the CPU it is the kernel's
  MemAvailable (/proc/meminfo), which does not add back what this process holds: smaller, safe.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Sequence

import torch

from memcompile.plan import format_bytes

FREE = "free"
# Kept free below "free": allocator fragmentation, and what other processes allocate meanwhile.
FREE_MARGIN = 0.05
_PERCENT = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*%\s*$")
_ACCEPTED = ('a percentage of the device\'s total memory ("90%", more than 0 and at most 100) or "free" '
             "(what is free at the first call, minus 5%)")


def parse_relative(limit: object, *, name: str = "limit") -> str | None:
    """The canonical spelling of a relative budget ("90%", "free"), or None for anything else
    (a size in bytes, validated by options.parse_bytes). ValueError for a bad percentage."""
    if not isinstance(limit, str):
        return None
    text = limit.strip().lower()
    if text == FREE:
        return FREE
    if "%" not in text:
        return None
    match = _PERCENT.match(text)
    if match is None:
        raise ValueError(f"{name}={limit!r} is not a percentage: expected {_ACCEPTED}")
    percent = float(match.group(1))
    if not 0 < percent <= 100 or not math.isfinite(percent):
        raise ValueError(f"{name}={limit!r}: a percentage of the device's memory must be more than 0% "
                         f"and at most 100%; expected {_ACCEPTED}")
    return f"{percent:g}%"


@dataclass(frozen=True)
class DeviceMemory:
    """What a device has, in bytes, and where the figures came from."""

    device: str  # "cuda:0", "cpu"
    total_bytes: int
    free_bytes: int  # free now, plus what this process's allocator holds (see the module docstring)
    total_source: str  # what total_bytes is and how it was read, for the plan
    free_source: str  # likewise for free_bytes


@dataclass(frozen=True)
class ResolvedBudget:
    budget_bytes: int
    source: str  # "90% of cuda:0's 139.81 GiB total memory (torch.cuda.mem_get_info)"


def resolve_relative(spec: str, memory: DeviceMemory) -> ResolvedBudget:
    """Bytes of a relative budget (parse_relative's spelling) on a device."""
    if spec == FREE:
        margin = int(FREE_MARGIN * memory.free_bytes)
        budget = memory.free_bytes - margin
        where = "the CPU" if memory.device == "cpu" else memory.device
        source = (f"free at the first call on {where}: {format_bytes(memory.free_bytes)} ({memory.free_source}) "
                  f"minus a {FREE_MARGIN:.0%} margin of {format_bytes(margin)}")
    else:
        fraction = float(spec.rstrip("%")) / 100
        budget = int(fraction * memory.total_bytes)
        owner = "the CPU's" if memory.device == "cpu" else f"{memory.device}'s"
        source = f"{spec} of {owner} {format_bytes(memory.total_bytes)} {memory.total_source}"
    if budget <= 0:
        raise ValueError(f"memcompile.budget({spec!r}) resolves to {budget} bytes on {memory.device} "
                         f"({source}): pass a budget in bytes")
    return ResolvedBudget(budget, source)


def input_device(example_inputs: Sequence[object]) -> torch.device:
    """The device of the first non-CPU tensor among a graph's inputs, else the CPU."""
    pending = list(example_inputs)
    while pending:
        x = pending.pop(0)
        if isinstance(x, torch.Tensor):
            if x.device.type != "cpu":
                return x.device
        elif isinstance(x, (list, tuple)):
            pending[:0] = x
    return torch.device("cpu")


def device_memory(device: torch.device) -> DeviceMemory:
    """Total and free memory of `device` (CUDA, XPU or the CPU), read now."""
    if device.type in ("cuda", "xpu"):
        return _accelerator_memory(device)
    if device.type != "cpu":
        raise ValueError(f"memcompile: a budget relative to the device is not supported on {device.type} "
                         "(CUDA, XPU and the CPU are); pass a budget in bytes")
    return _host_memory()


def _accelerator_memory(device: torch.device) -> DeviceMemory:
    module = getattr(torch, device.type)
    index = device.index if device.index is not None else module.current_device()
    name = f"{device.type}:{index}"
    held = module.memory_reserved(index)
    if hasattr(module, "mem_get_info"):
        free, total = module.mem_get_info(index)
        how = f"torch.{device.type}.mem_get_info"
    else:  # a build without mem_get_info: the total; nothing allocated but by this process assumed
        total = module.get_device_properties(index).total_memory
        free = total - held
        how = f"torch.{device.type}.get_device_properties().total_memory, minus memory_reserved()"
    return DeviceMemory(name, int(total), int(free + held), f"total memory ({how})",
                        f"{how}: {format_bytes(free)} free + {format_bytes(held)} held by this process's allocator")


def _host_memory() -> DeviceMemory:
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    total, how = physical, "physical memory (os.sysconf)"
    limit = _cgroup_limit()
    if limit is not None and limit < physical:
        total, how = limit, "memory limit (the cgroup's memory.max, below physical memory)"
    available = _mem_available()
    if available is None:
        available, free_how = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"), "os.sysconf free pages"
    else:
        free_how = "MemAvailable of /proc/meminfo; what this process holds is not added back"
    return DeviceMemory("cpu", int(total), int(min(available, total)), how, free_how)


def _cgroup_limit() -> int | None:
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = open(path, encoding="ascii").read().strip()
        except OSError:
            continue
        if text.isdigit():
            return int(text)
    return None


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
