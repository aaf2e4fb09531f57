"""Calibrate the solver's memory model against the exact check of the keep-all plan.

The solver's linear model counts each joint-graph node's outputs and scratch as if every node ran
its own kernel; the check of the rewritten graphs follows Inductor's schedule (fused kernels,
reused buffers) and is exact. On Hugging Face BERT (small) the two differ by +8 MiB at the loss
backward (logits-sized temporaries Inductor fuses away) and by -4 MiB through the rest of the
backward (a buffer Inductor's reuse pool holds), so the model's least-peak plan checked 1.3 MiB
above plans it rated worse. The keep-all plan is checked anyway: its per-step difference is the
part of the model's error that no decision changes, and is moved into the fixed bytes.

What stays approximate: steps the check names differently (nodes fused into a kernel named after
another node) take the larger of the neighbouring matched steps' differences, and errors that
depend on the decisions (a recomputed tensor Inductor inlines) are left to the check and the
planner's tightening loop.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence

from memcompile.solver.activations import ActivationProblem


@dataclasses.dataclass(frozen=True)
class StepCorrection:
    """Bytes added to the model's fixed bytes at each step (negative: the model over-counted)."""

    delta_bytes: tuple[int, ...]
    matched_steps: int  # steps whose node the check named

    @property
    def largest_overcount(self) -> int:
        return max((-d for d in self.delta_bytes), default=0)

    @property
    def largest_undercount(self) -> int:
        return max(self.delta_bytes, default=0)


def step_corrections(
    step_keys: Sequence[tuple[str, str]],
    model_loads: Sequence[int],
    checked_steps: Sequence[tuple[str, str, int]],
) -> StepCorrection:
    """Per model step, checked bytes minus modelled bytes of the same plan.

    `step_keys`: (phase, node name) of each model step; `model_loads`: the model's bytes at each
    step for the plan that was checked; `checked_steps`: (phase, node name, live bytes) of the
    check's timeline. A step the check does not name (a view, a node fused into a kernel named
    after another) takes the larger difference of its phase's nearest named steps before and
    after it: the differences, not the checked bytes, since those include tensors the model
    frees in between as the plan decides (GPT-2's saved GELU values, read by the kernel just
    before a view: taking that kernel's 21.6 MiB put 10 MiB of them into the view's fixed
    bytes, under every plan). A phase the check names nowhere is left uncorrected. A check step out
    of the model's order is not a match (_in_model_order)."""
    if len(step_keys) != len(model_loads):
        raise ValueError(f"{len(step_keys)} step keys for {len(model_loads)} modelled loads")
    checked: dict[tuple[str, str], int] = {}
    for phase, node, live in _in_model_order(step_keys, checked_steps):
        key = (phase, node)
        checked[key] = max(checked.get(key, 0), live)
    known: list[int | None] = [None if checked.get(key) is None else checked[key] - load
                               for key, load in zip(step_keys, model_loads)]
    # The nearest named difference before and after each step within its phase: one pass each way.
    before: list[int | None] = []
    last: dict[str, int | None] = {}
    for (phase, _), value in zip(step_keys, known):
        before.append(last.get(phase))
        if value is not None:
            last[phase] = value
    after: list[int | None] = [None] * len(known)
    last = {}
    for t in range(len(known) - 1, -1, -1):
        phase = step_keys[t][0]
        after[t] = last.get(phase)
        if known[t] is not None:
            last[phase] = known[t]
    filled = [value if value is not None else
              max((v for v in (b, a) if v is not None), default=None)
              for value, b, a in zip(known, before, after)]
    delta = tuple(0 if d is None else d for d in filled)
    return StepCorrection(delta_bytes=delta, matched_steps=sum(v is not None for v in known))


def _in_model_order(step_keys: Sequence[tuple[str, str]],
                    checked_steps: Sequence[tuple[str, str, int]]) -> list[tuple[str, str, int]]:
    """The check's steps that name a model step, less those out of the model's order: per phase,
    the longest run of them whose model steps do not go back. A fused kernel is named after one of
    its nodes, which Inductor's schedule may run far from where the model does (the GPT style
    file's position `iota`, named by a kernel at the forward's end: matched there, it put the
    forward's last live bytes, 1.19 GB over the model, into the fixed bytes of its first step, so
    that no plan of the calibrated model peaked below the keep-all plan's forward end)."""
    index = {key: t for t, key in enumerate(step_keys)}
    by_phase: dict[str, list[tuple[int, tuple[str, str, int]]]] = {}
    for step in checked_steps:
        t = index.get((step[0], step[1]))
        if t is not None:
            by_phase.setdefault(step[0], []).append((t, step))
    kept: list[tuple[str, str, int]] = []
    for named in by_phase.values():
        kept += [named[i][1] for i in _longest_not_decreasing([t for t, _ in named])]
    return kept


def _longest_not_decreasing(values: Sequence[int]) -> list[int]:
    """Indices of a longest subsequence of `values` that never decreases (patience sorting)."""
    tails: list[int] = []  # tails[k]: the least last value of a run of length k + 1
    tail_at: list[int] = []  # its index in `values`
    before: list[int] = [-1] * len(values)
    for i, value in enumerate(values):
        k = bisect.bisect_right(tails, value)
        before[i] = tail_at[k - 1] if k else -1
        if k == len(tails):
            tails.append(value)
            tail_at.append(i)
        else:
            tails[k], tail_at[k] = value, i
    run = []
    i = tail_at[-1] if tail_at else -1
    while i >= 0:
        run.append(i)
        i = before[i]
    return run[::-1]


def calibrated(problem: ActivationProblem, correction: StepCorrection) -> ActivationProblem:
    """`problem` with its fixed bytes moved by the correction (never below zero)."""
    if len(correction.delta_bytes) != problem.num_steps:
        raise ValueError(f"{len(correction.delta_bytes)} corrections for {problem.num_steps} steps")
    fixed = tuple(max(0, f + d) for f, d in zip(problem.fixed_bytes, correction.delta_bytes))
    before = tuple(min(f, max(0, b + d))
                   for f, b, d in zip(fixed, problem.before_node_bytes, correction.delta_bytes))
    return dataclasses.replace(problem, fixed_bytes=fixed, fixed_before_node_bytes=before)
