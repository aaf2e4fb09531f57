"""What a training step holds outside its compiled regions, measured.

The step users write is bigger than what memcompile compiles: `pred = model(x); loss =
criterion(pred, y)` computes the loss eagerly between the compiled forward and its backward (a
full-vocabulary log-softmax and its gradient), and per-block compilation runs the embedding, the
final norm and the output projection eagerly between blocks. No plan counts that memory, so the
step's first runs are measured:

- the step is cut into compiled calls and the eager windows between them (a window opens when a
  compiled forward or backward returns and closes when the next one starts, or the backward
  pass ends);
- at each compiled call's start, the gap between the memory measured and what the plans count
  then (the ledger's outside bytes, the call's inputs, the reserve) is memory nobody planned
  (parameters of eager modules, what earlier windows left behind);
- in each window, the rise of memory above its start (the eager loss's temporaries).

`outside_bytes` is the most the step held beyond its plans at any point: the largest gap plus
what windows since then left behind plus a window's rise. Every region is then planned with it
held beside it (the step ledger, memcompile/ledger.py), which bounds every moment of the step:
each moment's memory is what its plan counts plus at most `outside_bytes`.

Measured how: on the CPU, by the profiler's allocator events (`torch.profiler`, memory events)
with markers at the window bounds, in the step's own profile when the step runs inside
`memcompile.measure_peak`, else in one memcompile starts for the step (not when another profiler
runs: then nothing is measured, and a warning says so). In a profile of its own, what was live
before the step's first compiled call is taken as what that call holds (its parameters, their
gradients, its inputs: the CPU allocator does not say what is live; measure_peak is told), so
parameters of modules that run eagerly are not seen; their gradients are. On CUDA, by the caching allocator's
counters read at the bounds (`memory_allocated`, and `max_memory_allocated` without resetting
it: where it did not grow in a window, the window's rise is bounded by the earlier maximum).
"""

from __future__ import annotations

import contextlib
import contextvars
import gc
import time
import weakref
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

import torch

from memcompile import _torch_private as tp

MARK = "memcompile::step_meter"  # the profiler marker at each bound (its payload is kept here)
BACKWARD_STARTS = "a compiled backward starts"  # the label of a "close" bound there
# A measured step given up unread past these (no backward came): its profiler must not run on.
MAX_BOUNDS = 20_000
MAX_SECONDS = 900.0


@dataclass(frozen=True)
class Bound:
    """One bound of the step's compiled calls and eager windows."""

    # "call": a compiled call starts; "open": a window opens; "close": a window closes; "pause" /
    # "resume": memcompile itself works (compiles, re-plans): what it allocates is not the step's
    kind: str
    label: str  # for messages: which region and phase
    planned_bytes: int = 0  # "call": what the plans count as held when it starts
    # "call": of planned_bytes, the reserve the user declared for memory outside the graphs (an
    # engine's buckets, shards): eager memory up to it is covered, no other room below the plans
    # is (on the CPU the measure's start need not hold everything the plans count)
    covered_bytes: int = 0
    handed_bytes: int = 0  # "close" before a compiled backward: the gradients handed to it (its plan counts them)
    position: int = -1  # "open" after a compiled forward: its step position
    # "open" after a compiled backward: how far below its plan's peak the region holds by then
    # (its saved activations and temporaries are gone): room eager code takes without exceeding it
    slack_bytes: int = 0


@dataclass(frozen=True)
class StepMemory:
    """The measured memory of one step, against what its plans count."""

    peak_bytes: int  # the step's measured peak (on the CPU: of tensor memory, as measure_peak counts it)
    outside_bytes: int  # the most it held beyond what the plans count, but for the boundary below
    where: str  # where that was seen
    windows: int  # eager windows measured
    # The rise of the window between the last compiled forward and the first compiled backward
    # (a loss computed outside the model): held beside that call's plan as its backward starts,
    # where the plan holds what it saved (Options.boundary_bytes), not all step.
    boundary_bytes: int = 0
    boundary_position: int = -1  # the step position whose forward it follows
    boundary_where: str = ""


def step_memory(events: Sequence[tuple[int, int]], marks: Sequence[int], bounds: Sequence[Bound],
                live_at_start_bytes: int | None) -> StepMemory:
    """The step's memory from its allocator events ((time_ns, bytes), frees negative) and the
    times of its bounds (`marks[i]` is the time of `bounds[i]`): see the module docstring.
    `live_at_start_bytes`: what was live when the events began; None: what the plans count at
    the first bound (a compiled call), that is, no gap there."""
    if len(marks) != len(bounds):
        raise ValueError(f"step_memory: {len(marks)} marks for {len(bounds)} bounds")
    if live_at_start_bytes is None:
        live_at_start_bytes = bounds[0].planned_bytes if bounds else 0
        events = [(t, delta) for t, delta in events if not marks or t >= marks[0]]
    # what runs after the step's last bound (the optimizer's step, the next batch) is not the step's
    events = [(t, delta) for t, delta in events if not marks or t <= marks[-1]]
    timeline = sorted([(t, 1, i) for i, t in enumerate(marks)] + [(t, 0, delta) for t, delta in events])
    level = peak = live_at_start_bytes
    # memory no plan counts, at the latest call start (negative: room left in what they count)
    gap: int | None = None
    carried = outside = 0
    where = ""
    window: list | None = None  # [level at its start, its rise so far, label, position, slack]
    windows = 0
    boundary: tuple[int, int, str] = (0, -1, "")

    def count(amount: int, seen: str) -> None:
        nonlocal outside, where
        if amount > outside:
            outside, where = amount, seen

    def close(handed_bytes: int, starts_backward: bool) -> None:
        nonlocal window, carried, windows, boundary
        start, rise, label, position, slack = window
        windows += 1
        gap_now = gap or 0
        if starts_backward and position >= 0 and boundary[1] < 0:
            # the gradients handed to the backward are in the window's rise and in its plan
            boundary = (max(0, rise - handed_bytes + min(0, gap_now + carried)), position, label)
            count(gap_now + carried, label)
        else:
            count(gap_now + carried + max(0, rise - slack), label)
        carried += max(0, level - start - handed_bytes)
        count(gap_now + carried, f"left by {label}")
        window = None

    paused_at: int | None = None
    for _time, is_mark, value in timeline:
        if not is_mark:
            level += value
            peak = max(peak, level)
            if window is not None and paused_at is None:
                window[1] = max(window[1], level - window[0])
            continue
        bound = bounds[value]
        if bound.kind == "pause":
            paused_at = level if paused_at is None else paused_at
            continue
        if bound.kind == "resume":
            if paused_at is not None and window is not None:
                window[0] += level - paused_at  # what the pause left is not the window's
            paused_at = None
            continue
        if window is not None and bound.kind in ("call", "close"):
            close(bound.handed_bytes, bound.kind == "close" and bound.label == BACKWARD_STARTS)
        if bound.kind == "call":
            here = max(level - bound.planned_bytes, -bound.covered_bytes)
            gap = here if gap is None else max(gap, here)
            count(gap, f"at the start of {bound.label}")
            carried = 0  # the gap measured here holds what earlier windows left
        elif bound.kind == "open":
            window = [level, 0, bound.label, bound.position, bound.slack_bytes]
    return StepMemory(peak, max(0, outside), where, windows, *boundary)


class StepMeter:
    """The bounds of one measured step, and how its memory is read (see step_memory)."""

    def __init__(self, device: torch.device, on_measured: Callable[[StepMemory], None]) -> None:
        self.device = device
        self.on_measured = on_measured
        self.bounds: list[Bound] = []
        self._counters: list[tuple[int, int]] = []  # CUDA: (allocated, max allocated) per bound
        self._profile: object | None = None  # the profiler this meter started (CPU)
        self.finished = False
        self.backward_seen = False  # the step's backward pass has started (its end is then awaited)
        self.backward_done = False  # ... and has ended: the step's bounds are complete
        self._end_index = -1  # the index of that bound
        self.read = False  # the step's memory was read (on_measured called)
        self._live_at_start: int | None = None
        self._unwatch: Callable[[], None] | None = None
        self._began = time.monotonic()
        self._graphs: list[weakref.ref] = []  # the autograd graphs of the step's calls (see graphs_gone)

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"

    def start(self, first_call_tensors: Sequence[torch.Tensor] = ()) -> bool:
        """Begin measuring (at the step's first compiled call, `first_call_tensors` its tensor
        arguments); False where it cannot."""
        if not self._start(first_call_tensors):
            return False
        # Dynamo compiling a later region mid-step allocates (its state copies): not the step's
        self._unwatch = tp.watch_dynamo_compiles(self._compile_starts, lambda: self.bound(Bound("resume", "")))
        return True

    def _compile_starts(self) -> None:
        """Dynamo compiles mid-step. Under a profile of this meter's own the step is given up
        unread (its backend measures the next one): compiling under a running profiler is not
        safe (Dynamo's tracer crashed in GC under one); elsewhere the compile is paused out."""
        if self._profile is not None:
            self.abandon()
        else:
            self.bound(Bound("pause", ""))

    def _start(self, first_call_tensors: Sequence[torch.Tensor]) -> bool:
        if self.on_cuda:
            return True
        enclosing = _ENCLOSING.get()
        if enclosing is not None:
            enclosing.append(self)  # measure_peak hands its profile over when it stops
            return True
        if tp.profiler_running():
            return False
        # What the first call holds: its parameters, their gradients and its inputs.
        self._live_at_start = unique_storage_bytes(
            [t for t in first_call_tensors] + [t.grad for t in first_call_tensors if t.grad is not None])
        # Nothing compiles under this profile (Dynamo's tracer crashed in GC under a running
        # profiler): a frame conversion, even after torch._dynamo.reset(), stops it first.
        tp.before_each_frame_conversion(finish_pending_meters)
        self._profile = tp.start_memory_profile()
        _RUNNING.append(self)
        return True

    def note_graph(self, grad_fn: object) -> None:
        """A call's output's backward node (a compiled function's: it lives as long as the graph)."""
        try:
            self._graphs.append(weakref.ref(grad_fn))
        except TypeError:  # a node of torch's own (a view of the output): no weak reference
            pass

    def graphs_gone(self) -> bool:
        """Every autograd graph the step's calls built was freed before any backward ran: the
        step ended with its forward calls (evaluation under grad mode)."""
        return (not self.backward_seen and not self.finished and bool(self._graphs)
                and all(ref() is None for ref in self._graphs))

    def bound(self, bound: Bound) -> None:
        if self.finished:
            return
        if len(self.bounds) >= MAX_BOUNDS or time.monotonic() - self._began > MAX_SECONDS:
            # a "step" that never reaches its backward (forward calls under grad mode alone)
            # would keep a profiler running: give it up, unread
            self.abandon()
            return
        self.bounds.append(bound)
        if self.on_cuda:
            self._counters.append((torch.cuda.memory_allocated(self.device), torch.cuda.max_memory_allocated(self.device)))
        else:
            tp.profiler_mark(MARK)

    def backward_ended(self) -> None:
        """The step's backward pass has ended: close the last window; read the step where this
        meter profiles it (else when the enclosing measure_peak stops)."""
        if self.finished:
            return
        self.bound(Bound("close", "the end of the backward"))
        self.backward_done = True
        self._end_index = len(self.bounds) - 1
        if self.on_cuda:
            self._finish(_from_counters(self.bounds, self._counters))
        elif self._profile is not None:
            # A profiler stopped inside the backward is enabled again when it returns (autograd
            # restores the thread's state): stop it once the backward call has returned (else,
            # under another profile function, at the next compiled call or measure_peak).
            tp.after_backward_returns(self.read_own_profile)

    def read_own_profile(self) -> None:
        """Stop the profile this meter started and read the step (after the backward returned)."""
        if self._profile is None or self.finished:
            return
        profile, self._profile = self._profile, None
        tp.stop_memory_profile(profile)
        if self in _RUNNING:
            _RUNNING.remove(self)
        measured = self._read(profile, self._live_at_start)
        tp.release_profile(profile)
        self._finish(measured)

    def _read(self, profile: object, live_at_start_bytes: int | None) -> StepMemory:
        marks = tp.profiler_mark_times(profile, MARK)
        # the step ends with its backward: bounds after it (the next step's) are not its own
        count = min(len(marks), self._end_index + 1 if self._end_index >= 0 else len(self.bounds))
        return step_memory(tp.profiler_allocation_deltas(profile), marks[:count], self.bounds[:count],
                           live_at_start_bytes)

    def delivered(self, profile: object, live_at_start_bytes: int) -> None:
        """The enclosing measure_peak's profile, once it has stopped."""
        if not self.finished and self.backward_done:
            self._finish(self._read(profile, live_at_start_bytes))

    def abandon(self) -> None:
        """The step stopped before its backward (an error): nothing is read. A step whose
        backward ended but whose profile was not read yet is read now."""
        if self.backward_done:
            self.read_own_profile()
        self._stop_watching()
        self.finished = True
        if self._profile is not None:
            profile, self._profile = self._profile, None
            tp.stop_memory_profile(profile)
            tp.release_profile(profile)
            if self in _RUNNING:
                _RUNNING.remove(self)

    def _stop_watching(self) -> None:
        if self._unwatch is not None:
            unwatch, self._unwatch = self._unwatch, None
            unwatch()

    def _finish(self, measured: StepMemory) -> None:
        self._stop_watching()
        self.finished = self.read = True
        self.on_measured(measured)


def _from_counters(bounds: Sequence[Bound], counters: Sequence[tuple[int, int]]) -> StepMemory:
    """CUDA: the allocator's counters at each bound turned into events. Between two bounds the
    peak is the later maximum where it grew; where it did not, at most the earlier maximum."""
    events: list[tuple[int, int]] = []
    marks: list[int] = []
    level = counters[0][0] if counters else 0
    for i, (allocated, maximum) in enumerate(counters):
        if i:
            high = maximum if maximum > counters[i - 1][1] else counters[i - 1][1]
            events += [(3 * i - 2, high - level), (3 * i - 1, allocated - high)]
            level = allocated
        marks.append(3 * i)
    return step_memory(events, marks, bounds, counters[0][0] if counters else 0)


def unique_storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def all_live_cpu_tensors() -> list[torch.Tensor]:
    gc.collect()
    return [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.device.type == "cpu"]


# The measure_peak running in this context, if any: meters started inside it read its profile.
_ENCLOSING: contextvars.ContextVar[list[StepMeter] | None] = contextvars.ContextVar(
    "memcompile_enclosing_profile", default=None)


@contextlib.contextmanager
def enclosing_profile() -> Iterator[list[StepMeter]]:
    """Around measure_peak's CPU profile: the meters of steps run inside it, to hand it to."""
    meters: list[StepMeter] = []
    token = _ENCLOSING.set(meters)
    try:
        yield meters
    finally:
        _ENCLOSING.reset(token)


# Meters whose own profile is still running (read when the backward call returns, or here).
_RUNNING: list[StepMeter] = []


def finish_pending_meters() -> None:
    """Stop the profiles memcompile's meters still hold, before another profiler starts: one
    whose step's backward has ended is read; one whose step never reached its backward (a
    forward alone, or an abandoned step) is dropped unread."""
    for meter in list(_RUNNING):
        if meter.backward_done:
            meter.read_own_profile()
        else:
            meter.abandon()
