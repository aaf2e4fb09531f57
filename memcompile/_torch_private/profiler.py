"""The torch profiler's allocator events and markers, and the autograd engine's end of a backward."""

from __future__ import annotations

from typing import Any, Callable

import torch

def profiler_allocation_deltas(prof: Any) -> list[tuple[int, int]]:
    """(time_ns, bytes) of every CPU/CUDA allocator event a `torch.profiler.profile(
    profile_memory=True)` recorded; frees are negative. Frees of blocks allocated before the
    profile started are not reported by the allocator, so they never appear here."""
    allocation = torch._C._profiler._EventType.Allocation
    deltas: list[tuple[int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        kind, extra = event.typed
        if kind == allocation:
            deltas.append((event.start_time_ns, int(extra.alloc_size)))
        stack.extend(event.children)
    deltas.sort()
    return deltas


def profiler_running() -> bool:
    """A torch profiler is recording in this process (a second one would break the first)."""
    return bool(torch._C._autograd._profiler_enabled())


def start_memory_profile() -> Any:
    """A started CPU profiler recording allocator events (stop it with stop_memory_profile)."""
    profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
    profile.__enter__()
    return profile


def stop_memory_profile(profile: Any) -> None:
    profile.__exit__(None, None, None)


def release_profile(profile: Any) -> None:
    """Free a stopped profile's recorded results now. A torch.profiler.profile holds a reference
    cycle, so they are otherwise freed whenever the garbage collector reaches it: a collection
    freeing them inside a later compile crashed the process (in the results' destructor)."""
    inner = getattr(profile, "profiler", None)
    if inner is not None:
        inner.kineto_results = None
        inner._function_events = None
        inner._old_function_events = None
        profile.profiler = None


def profiler_mark(name: str) -> None:
    """An instant marker named `name` in the running profile (nothing where none runs)."""
    with torch.profiler.record_function(name):
        pass


def profiler_mark_times(prof: Any, name: str) -> list[int]:
    """The times (ns, the clock of profiler_allocation_deltas) of the markers named `name`, in order."""
    times: list[int] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.name == name:
            times.append(event.start_time_ns)
        stack.extend(event.children)
    return sorted(times)


def after_backward_returns(callback: Callable[[], None]) -> bool:
    """From inside a backward pass on this thread: run `callback` once the engine's call has
    returned to Python (the thread's state autograd saved is then restored), through a profile
    function (sys.setprofile, this thread, removed after). False, and nothing done, where a
    profile function is already set (cProfile, a debugger's): it is left alone."""
    import sys

    from torch.autograd.graph import _engine_run_backward

    if sys.getprofile() is not None:
        return False
    code = _engine_run_backward.__code__
    nested = 0  # backward passes started inside this one (a reentrant checkpoint)

    def watch(frame, event, arg):
        nonlocal nested
        if frame.f_code is not code:
            return
        if event == "call":
            nested += 1
        elif event == "return" and nested:
            nested -= 1
        elif event == "return":
            sys.setprofile(None)
            callback()

    sys.setprofile(watch)
    return True


def call_when_backward_ends(callback: Callable[[], None]) -> None:
    """From inside a backward pass (a hook): run `callback` once the whole pass has ended."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)
