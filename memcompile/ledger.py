"""The step ledger: one budget for a whole training step made of several compiled regions.

Graph breaks (and per-block compilation) split a step into regions that Dynamo compiles lazily,
in forward order; each is planned on its own. While region `p` runs (its forward, and later its
backward), other regions hold memory too, so `p` is planned with the step budget reduced by:

- the leaf inputs of every other region: parameters, buffers, the user's inputs (live the whole
  step);
- for each region called before `p` in the step: its saved activations as planned (from its
  forward to its backward, which runs after `p`'s) and its activation inputs (held by the
  caller's frames until the forward returns; the previous region's outputs are `p`'s own
  inputs and are counted in `p`'s own liveness, so no output is counted twice);
- for each region called after `p`: the gradients of its leaf inputs (its backward runs before
  `p`'s and they stay until the optimizer step).

Summing "before" and "after" is an upper bound for both of `p`'s phases (forward: later regions
hold nothing but parameters; backward: earlier inputs may already be freed). Regions are
identified by their position in the step's call order, not by compiled graph, so one compiled
block called 8 times per step has 8 positions. Parameters used at two positions (weight tying)
are counted twice: safe, pessimistic.

Until a step has completed, regions not called yet are unknown. Their parameters are not: the
frames Dynamo compiles hand it their modules (`self`), so the parameters of those modules that
no call of the step has taken yet (a later region's, after a graph break) are counted as held,
with their gradients, by every position of the first step (`note_frame_leaves`).
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch.fx as fx

from memcompile import _torch_private as tp
from memcompile.node_facts import tensor_nbytes
from memcompile.plan import Choice, Plan

# Choices whose bytes leave the device until the backward; any other choice (keep, and ones
# added to Choice later) counts its full size, unless the decision records the device bytes it
# holds (quantize: the compressed copy; offload: 0): safe when a new choice is added.
_NOT_HELD = frozenset({Choice.RECOMPUTE})


@dataclass(frozen=True)
class Footprint:
    """What one compiled region holds for the rest of the step, as planned."""

    own_peak_bytes: int  # its plan's predicted peak (its own inputs, parameters, temporaries...)
    params_bytes: int  # leaf inputs (parameters, buffers, the user's inputs): live the whole step
    inputs_bytes: int  # its non-leaf inputs: activations handed over by an earlier region
    saved_bytes: int  # activations its plan keeps from its forward to its backward
    grads_bytes: int  # gradients of its parameters, from its backward to the end of the step
    # gradients of its leaf inputs already there at the call (accumulated over micro-steps): held
    # all step, the same tensors its backward adds into
    held_grads_bytes: int = 0


@dataclass(frozen=True)
class InputBytes:
    """Per forward input of a joint graph: its bytes, and whether the step produces its gradient."""

    nbytes: tuple[int, ...]
    has_grad: tuple[bool, ...]
    static: tuple[bool, ...]  # parameters/buffers as AOTAutograd marks them (fallback split)


def input_bytes(joint: fx.GraphModule, num_fwd_outputs: int, static_lifetime_input_indices: Sequence[int]) -> InputBytes:
    primals = [n for n in joint.graph.nodes if n.op == "placeholder" and tp.is_primal(n)]
    output = next(n for n in joint.graph.nodes if n.op == "output")
    grads = list(output.args[0])[num_fwd_outputs:]
    static = set(static_lifetime_input_indices)
    return InputBytes(
        nbytes=tuple(tensor_nbytes(p.meta.get("val")) for p in primals),
        has_grad=tuple(i < len(grads) and isinstance(grads[i], fx.Node) for i in range(len(primals))),
        static=tuple(i in static for i in range(len(primals))),
    )


def saved_bytes_of(plan: Plan) -> int:
    return sum(0 if d.choice in _NOT_HELD else (d.held_bytes if d.held_bytes >= 0 else d.nbytes)
               for d in plan.decisions)


def footprint_of(plan: Plan, inputs: InputBytes, held_by_caller: Sequence[bool]) -> Footprint:
    """The region's footprint for one call. `held_by_caller[i]`: forward input i is a leaf held
    by the caller all step (parameter, buffer, the user's input); the others are activations an
    earlier region handed over. If the call's inputs do not line up with the graph's (AOTAutograd
    added some), parameters are the inputs AOTAutograd marks static."""
    if len(held_by_caller) != len(inputs.nbytes):
        held_by_caller = inputs.static
    params = sum(b for b, held in zip(inputs.nbytes, held_by_caller) if held)
    grads = sum(b for b, held, g in zip(inputs.nbytes, held_by_caller, inputs.has_grad) if held and g)
    activations = sum(b for b, held in zip(inputs.nbytes, held_by_caller) if not held)
    return Footprint(plan.predicted_peak_bytes, params, activations, saved_bytes_of(plan), grads)


class StepLedger:
    """Footprints by call position; positions restart when a backward has run since the last call.

    Footprints of the previous step are kept for positions the current step has not reached, so
    a region knows what later regions will hold (after the first step)."""

    def __init__(self) -> None:
        self._slots: list[Footprint | None] = []
        self._planned_outside: list[int] = []  # per position: the outside bytes its plan assumed
        self._regions: list[object] = []  # per position: which compiled region ran there
        self._completed: tuple[tuple[object, Footprint], ...] | None = None
        self._steps_completed = 0
        # (position, () -> (leaf bytes freed since, of which with gradients)): see watch_leaves
        self._watched: list[tuple[int, Callable[[], tuple[int, int]]]] = []
        self._position = 0
        self._backward_seen = False
        # Before a step completes: parameters of the compiled frames' modules (id -> bytes, has a
        # gradient), and the leaf inputs (by id) the calls of the step so far have taken.
        self._frame_leaves: dict[int, tuple[int, bool]] = {}
        self._seen: set[int] = set()
        # Measured: the most the step held outside every plan (memcompile/step_meter.py), and where.
        self._eager_bytes = 0
        self._eager_where = ""
        self._lock = threading.Lock()

    # -- call tracking -------------------------------------------------------------------
    def begin_call(self, leaf_ids: Iterable[int] = ()) -> int:
        """The position of a region call that saves activations (its leaf inputs by id); starts a
        new step if a backward ran since the previous call."""
        with self._lock:
            self._count_freed_leaves()
            if self._backward_seen:
                self._seen = set()
                self._steps_completed += 1
                steps = self._slots[:self._position]
                known = [f for f in steps if f is not None]
                self._completed = tuple(zip(self._regions[:self._position], known)) \
                    if len(known) == len(steps) else None
                # Positions the finished step did not reach belong to an older step shape.
                del self._slots[self._position:], self._planned_outside[self._position:]
                del self._regions[self._position:]
                self._position = 0
                self._backward_seen = False
            if self._position == 0:
                self._seen = set()
            self._seen.update(leaf_ids)
            position = self._position
            self._position += 1
            return position

    def next_position(self) -> int:
        """The position the next call would get (used when a region compiles just before it runs)."""
        with self._lock:
            return 0 if self._backward_seen else self._position

    def cancel_call(self, position: int) -> None:
        """The call at `position` raised before running: it holds nothing."""
        with self._lock:
            if self._position == position + 1:
                self._position = position

    def abort_step(self) -> None:
        """A call of this step raised before it ran (the step stops there): the next call starts
        the step again at position 0. What the calls so far recorded stays known."""
        with self._lock:
            self._position = 0
            self._seen = set()
            self._backward_seen = False

    def note_frame_leaves(self, leaves: dict[int, tuple[int, bool]]) -> None:
        """Parameters (id -> bytes, has a gradient) of a compiled frame's modules, which later
        regions of the first step may take: counted as held until a step has completed."""
        with self._lock:
            if self._completed is None:
                self._frame_leaves.update(leaves)

    def unseen_leaf_bytes(self, also_seen: frozenset[int] = frozenset(), frozen_only: bool = False) -> int:
        """Before a step has completed: the noted frame parameters no call of this step has
        taken yet (nor `also_seen`), with their gradients; with `frozen_only`, only those
        without a gradient. 0 once a step has completed."""
        with self._lock:
            return self._unseen(also_seen, frozen_only)

    def _unseen(self, also_seen: frozenset[int] = frozenset(), frozen_only: bool = False) -> int:
        if self._completed is not None:
            return 0
        return sum(nbytes * (2 if has_grad else 1) for i, (nbytes, has_grad) in self._frame_leaves.items()
                   if i not in self._seen and i not in also_seen and not (frozen_only and has_grad))

    def backward_ran(self) -> None:
        with self._lock:
            self._backward_seen = True

    def record(self, position: int, footprint: Footprint, planned_outside: int, region: object = None) -> bool:
        """Store the footprint at `position`, the outside bytes its plan assumed and the region
        that ran there; True when the footprint changed."""
        with self._lock:
            while len(self._slots) <= position:
                self._slots.append(None)
                self._planned_outside.append(0)
                self._regions.append(None)
            changed = self._slots[position] != footprint
            self._slots[position] = footprint
            self._planned_outside[position] = planned_outside
            self._regions[position] = region
            return changed

    def watch_leaves(self, position: int, freed: Callable[[], tuple[int, int]]) -> None:
        """Leaf inputs of the call at `position` that an engine frees once the call is over
        (FSDP2 gathers a block's parameters for its forward and backward only, and frees its
        full gradients after the reduce-scatter) are not held by the rest of the step. At the
        next call, `freed()` says how many of its leaf bytes were freed by then (storage
        resized to 0), and of those how many have gradients; the footprint drops them."""
        with self._lock:
            self._watched.append((position, freed))

    def _count_freed_leaves(self) -> None:
        for position, freed in self._watched:
            params, grads = freed()
            footprint = self._slots[position] if position < len(self._slots) else None
            if params and footprint is not None:
                self._slots[position] = dataclasses.replace(
                    footprint, params_bytes=max(0, footprint.params_bytes - params),
                    grads_bytes=max(0, footprint.grads_bytes - grads))
        self._watched.clear()

    def calls_before(self, position: int) -> tuple[tuple[object, Footprint | None], ...]:
        """(region, footprint) of this step's calls before `position`."""
        with self._lock:
            return tuple(zip(self._regions[:position], self._slots[:position]))

    def steps_completed(self) -> int:
        """How many steps have ended with a backward and been followed by another call."""
        with self._lock:
            return self._steps_completed

    def completed_step(self) -> tuple[tuple[object, Footprint], ...] | None:
        """(region, footprint) per position of the last step that ended with a backward, once
        the next step has begun (None before; or if a position of it recorded nothing)."""
        with self._lock:
            return self._completed

    def step_starts_next(self) -> bool:
        """True when the next call begins a step after a backward (the previous step is complete)."""
        with self._lock:
            return self._backward_seen

    def earlier_plans_stale(self, position: int) -> bool:
        """True if a region before `position` ran with a plan made for other outside bytes than
        the ledger now knows (regions compiled later in the same step): a transient state."""
        with self._lock:
            slots, planned = list(self._slots), list(self._planned_outside)
            eager = self._eager_bytes
        return any(slots[j] is not None and planned[j] != outside_bytes(slots, j) + eager
                   for j in range(min(position, len(slots))))

    # -- budget --------------------------------------------------------------------------
    def outside_bytes(self, position: int, also_seen: frozenset[int] = frozenset()) -> int:
        """Bytes other regions hold while the region at `position` runs (module docstring), and
        what the step was measured to hold outside every region (eager_bytes); in the first
        step, also the frame parameters not taken yet (but for `also_seen`: the compiling
        region's own)."""
        with self._lock:
            slots = list(self._slots)
            unseen = self._unseen(also_seen)
            eager = self._eager_bytes
        return outside_bytes(slots, position) + unseen + eager

    def measured_outside(self, nbytes: int, where: str) -> None:
        """What a measured step held beyond its plans (step_meter.StepMemory.outside_bytes):
        held beside every region from now on."""
        with self._lock:
            self._eager_bytes, self._eager_where = nbytes, where

    def eager_bytes(self) -> int:
        with self._lock:
            return self._eager_bytes

    def eager_where(self) -> str:
        with self._lock:
            return self._eager_where

    def predicted_step_peak(self) -> int:
        """Max over positions of (own peak + what the others hold then), over the last known step
        (and, in the first step, the frame parameters no call has taken yet)."""
        with self._lock:
            slots = list(self._slots)
            unseen = self._unseen()
            eager = self._eager_bytes
        return predicted_step_peak(slots) + (unseen + eager if any(s is not None for s in slots) else 0)

    def footprints(self) -> tuple[Footprint | None, ...]:
        with self._lock:
            return tuple(self._slots)


def outside_bytes(slots: Sequence[Footprint | None], position: int) -> int:
    """What the positions other than `position` hold while it runs (the module docstring);
    gradients accumulated before the step count from its start (for later positions they are
    the gradients their backward adds into, counted once)."""
    total = 0
    for j, slot in enumerate(slots):
        if slot is None or j == position:
            continue
        total += slot.params_bytes
        if j < position:
            total += slot.saved_bytes + slot.inputs_bytes + slot.held_grads_bytes
        else:
            total += max(slot.grads_bytes, slot.held_grads_bytes)
    return total


def predicted_step_peak(slots: Iterable[Footprint | None]) -> int:
    slots = list(slots)
    return max((s.own_peak_bytes + s.held_grads_bytes + outside_bytes(slots, p)
                for p, s in enumerate(slots) if s is not None), default=0)
