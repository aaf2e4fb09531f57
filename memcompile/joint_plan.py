"""One plan per compiled region for the whole step: a small multiple-choice problem (plain data).

A step made of several compiled regions (graph breaks, per-block compilation, DDPOptimizer
buckets) holds, while the region at call position `p` runs, its own peak plus what the other
positions hold (memcompile/ledger.py): the leaf inputs of all others, the saved activations and
activation inputs of earlier positions, and the gradients of later ones. Only the saved bytes
and the own peak depend on the plans, so with each region offering a few plans (`PlanOption`:
own peak, saved bytes, added time) the joint choice is

    choose one option o(r) per region r
    minimise   sum over positions p of added_time(o(region(p)))
    subject to own_peak(o(region(p))) + fixed(p) + sum_{j < p} saved(o(region(j))) <= budget  for every p

where fixed(p) = sum_{j != p} params_j + sum_{j < p} inputs_j + sum_{j > p} grads_j + sum_{j <= p} held_j
(held: gradients accumulated before the step, live from its start; for j > p they are part of
grads_j, the tensors that backward adds into). One compiled
region may be called at several positions (identical blocks share a graph): one option then
serves all of them. Solved exactly with CP-SAT (one worker, fixed seed: deterministic); a few
regions with a few options each is a tiny model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ortools.sat.python import cp_model

from memcompile.solver.cpsat import run_model

_TIME_UNIT_S = 1e-8  # added time enters CP-SAT in units of 10 ns, as in the activation solver
_TIME_LIMIT_S = 5.0


@dataclass(frozen=True)
class PlanOption:
    """One plan a compiled region can run with."""

    own_peak_bytes: int  # its predicted peak alone (parameters, inputs, temporaries, saved...)
    saved_bytes: int  # activations it holds from its forward to its backward
    added_time_s: float  # recomputation (and conversion) time it adds per call


@dataclass(frozen=True)
class Position:
    """One call of a compiled region in the step, and what that call holds regardless of plan."""

    region: int  # index into the menus
    params_bytes: int  # leaf inputs (parameters, buffers, the user's tensors): live all step
    inputs_bytes: int  # activation inputs handed over by an earlier region
    grads_bytes: int  # gradients of its leaf inputs, from its backward to the step's end
    # gradients of its leaf inputs already there when it is called (accumulated over micro-steps):
    # held from the step's start; the same tensors its backward adds into
    held_grads_bytes: int = 0


@dataclass(frozen=True)
class JointChoice:
    option_of: tuple[int, ...]  # per region: the index of its chosen option
    step_peak_bytes: int  # max over positions of own peak + what the others hold then
    added_time_s: float  # summed over positions
    status: str  # "optimal" | "feasible" (CP-SAT ran out of time with a valid choice)


def _validate(positions: Sequence[Position], menus: Sequence[Sequence[PlanOption]]) -> None:
    if not positions:
        raise ValueError("positions is empty: a step has at least one region call")
    for p, position in enumerate(positions):
        if not 0 <= position.region < len(menus):
            raise ValueError(f"positions[{p}].region={position.region}: expected an index into menus "
                             f"(0..{len(menus) - 1})")
    for r, menu in enumerate(menus):
        if not menu:
            raise ValueError(f"menus[{r}] is empty: every region needs at least one plan option")


def fixed_bytes(positions: Sequence[Position], p: int) -> int:
    """What the other positions hold while position p runs, apart from saved activations (and
    the accumulated gradients there since the step began, its own included)."""
    return sum(q.params_bytes for j, q in enumerate(positions) if j != p) \
        + sum(q.inputs_bytes + q.held_grads_bytes for q in positions[:p]) + positions[p].held_grads_bytes \
        + sum(q.grads_bytes for q in positions[p + 1:])


def step_peaks(positions: Sequence[Position], menus: Sequence[Sequence[PlanOption]],
               option_of: Sequence[int]) -> tuple[int, ...]:
    """Per position: own peak + what the others hold then, for one option per region."""
    _validate(positions, menus)
    chosen = [menus[position.region][option_of[position.region]] for position in positions]
    saved_before = 0
    peaks = []
    for p, option in enumerate(chosen):
        peaks.append(option.own_peak_bytes + fixed_bytes(positions, p) + saved_before)
        saved_before += option.saved_bytes
    return tuple(peaks)


def added_time_s(positions: Sequence[Position], menus: Sequence[Sequence[PlanOption]],
                 option_of: Sequence[int]) -> float:
    return sum(menus[q.region][option_of[q.region]].added_time_s for q in positions)


def _model(positions, menus, budget_bytes: int | None):
    model = cp_model.CpModel()
    pick = [[model.new_bool_var(f"r{r}_o{k}") for k in range(len(menu))] for r, menu in enumerate(menus)]
    for row in pick:
        model.add_exactly_one(row)
    loads = []
    for p, position in enumerate(positions):
        load = sum(option.own_peak_bytes * pick[position.region][k]
                   for k, option in enumerate(menus[position.region]))
        for earlier in positions[:p]:
            load += sum(option.saved_bytes * pick[earlier.region][k]
                        for k, option in enumerate(menus[earlier.region]))
        loads.append((load, fixed_bytes(positions, p)))
    return model, pick, loads


def _picked(outcome, pick) -> tuple[int, ...]:
    return tuple(next(k for k, var in enumerate(row) if outcome.solver.Value(var)) for row in pick)


def choose_joint(positions: Sequence[Position], menus: Sequence[Sequence[PlanOption]],
                 budget_bytes: int) -> JointChoice | None:
    """The option per region with the least total added time whose step fits `budget_bytes`;
    None if no combination fits. Ties go to the lowest option indices (deterministic)."""
    _validate(positions, menus)
    model, pick, loads = _model(positions, menus, budget_bytes)
    for load, fixed in loads:
        model.add(load <= budget_bytes - fixed)
    calls = [sum(1 for q in positions if q.region == r) for r in range(len(menus))]
    # Time first; among equal times, lower option indices (weights below one time unit).
    scale = 1 + sum(len(menu) for menu in menus)
    model.minimize(sum(
        (scale * calls[r] * round(option.added_time_s / _TIME_UNIT_S) + k) * pick[r][k]
        for r, menu in enumerate(menus) for k, option in enumerate(menu)))
    outcome = run_model(model, time_limit_s=_TIME_LIMIT_S, workers=1, seed=0)
    if not outcome.has_solution:
        return None
    option_of = _picked(outcome, pick)
    return JointChoice(option_of, max(step_peaks(positions, menus, option_of)),
                       added_time_s(positions, menus, option_of), outcome.status)


def least_step_peak(positions: Sequence[Position], menus: Sequence[Sequence[PlanOption]]) -> JointChoice:
    """The option per region with the smallest step peak (what the budget must at least be)."""
    _validate(positions, menus)
    model, pick, loads = _model(positions, menus, None)
    peak = model.new_int_var(0, sum(max(o.own_peak_bytes + o.saved_bytes for o in m) for m in menus)
                           * len(positions) + sum(fixed for _, fixed in loads), "peak")
    for load, fixed in loads:
        model.add(peak >= load + fixed)
    model.minimize(peak)
    outcome = run_model(model, time_limit_s=_TIME_LIMIT_S, workers=1, seed=0)
    if outcome.has_solution:
        option_of, status = _picked(outcome, pick), outcome.status
    else:  # not seen on models this small; each region's least own peak + saved is a valid answer
        option_of = tuple(min(range(len(m)), key=lambda k: (m[k].own_peak_bytes + m[k].saved_bytes, k))
                          for m in menus)
        status = "fallback"
    return JointChoice(option_of, max(step_peaks(positions, menus, option_of)),
                       added_time_s(positions, menus, option_of), status)
