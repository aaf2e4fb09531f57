"""Repeated blocks: the candidates that play the same part in each of several identical blocks.

A 12-48 layer model is one block repeated, and Dynamo records the module each forward node
came from ("L['self'].layers.3.mlp"). A candidate's place is that path with its layer indices
taken out ("L['self'].layers.#.mlp") and the indices ("3"); candidates of the same place, op,
value and decision shape, the k-th such in each block, form one class
(ActivationProblem.same_decision_as). A greedy plan moves a class whole, so its moves follow the
block, not the depth; every member keeps its own constraints, so a class of values that are not
truly alike makes a slower plan, never one over the budget.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from typing import Hashable, Sequence

import torch
import torch.fx as fx

from memcompile import _torch_private as tp
from memcompile.passes.activation_analysis import JointAnalysis

# A layer index in a module path: "layers.3", "layers[3]", "_modules['3']".
_INDEX = re.compile(r"\.(\d+)(?=[.\[]|$)|\[(\d+)\]|'(\d+)'")


@dataclasses.dataclass(frozen=True)
class BlockPlace:
    path: str  # the module stack's paths, each layer index replaced by "#", joined by " > "
    block: tuple[int, ...]  # those indices, outermost first


def block_place(stack: tuple[str, ...]) -> BlockPlace | None:
    """Where in which block a module stack lies (its paths outermost first: Dynamo's
    nn_module_stack); None for a stack outside every indexed module."""
    indices: list[int] = []

    def hide(match: re.Match) -> str:
        digits = next(g for g in match.groups() if g is not None)
        indices.append(int(digits))
        return match.group(0).replace(digits, "#")

    general = " > ".join(_INDEX.sub(hide, path) for path in stack)
    return BlockPlace(general, tuple(indices)) if indices else None


def repeated_block_classes(places: Sequence[BlockPlace | None], kinds: Sequence[Hashable]) -> tuple[int, ...]:
    """Per candidate (in topological order), the first candidate of its class, itself for that
    one, -1 where it has none: candidates of one place and kind, the k-th of each block."""
    seen_in_block: collections.Counter = collections.Counter()
    classes: dict[tuple, list[int]] = {}
    for i, (place, kind) in enumerate(zip(places, kinds)):
        if place is None:
            continue
        role = (place.path, kind)
        ordinal = seen_in_block[(role, place.block)]
        seen_in_block[(role, place.block)] += 1
        classes.setdefault((role, ordinal), []).append(i)
    first = [-1] * len(places)
    for members in classes.values():
        if len(members) > 1:
            for i in members:
                first[i] = members[0]
    return tuple(first)


def _value_kind(node: fx.Node) -> Hashable:
    value = node.meta.get("val")
    if isinstance(value, torch.Tensor):
        return (tuple(str(s) for s in value.shape), str(value.dtype))
    return type(value).__name__


def _op_role(problem, i: int) -> int:
    """-1 alone, 0 first result of a multi-result op, 1 another of its results."""
    g = problem.same_op_as[i] if problem.same_op_as else -1
    return -1 if g < 0 else int(g != i)


def _stacks(candidates: tuple[fx.Node, ...]) -> list[tuple[str, ...]]:
    """Each candidate's module stack; a node Dynamo did not record (a backward op the partitioner
    may move forward, a decomposition) takes that of the forward op with its autograd sequence
    number."""
    by_sequence: dict[int, tuple[str, ...]] = {}
    for node in (candidates[0].graph.nodes if candidates else ()):
        stack, sequence = tp.module_stack(node), tp.autograd_sequence_number(node)
        if stack and sequence is not None:
            by_sequence.setdefault(sequence, stack)
    out = []
    for c in candidates:
        sequence = tp.autograd_sequence_number(c)
        out.append(tp.module_stack(c) or (by_sequence.get(sequence, ()) if sequence is not None else ()))
    return out


def with_repeated_blocks(analysis: JointAnalysis) -> JointAnalysis:
    """The analysis with its problem's candidates classed by repeated block (none where the
    graph repeats nothing Dynamo recorded by module)."""
    problem = analysis.problem
    places = [block_place(stack) for stack in _stacks(analysis.candidates)]
    kinds = [(str(c.target), _value_kind(c), problem.nbytes[i], problem.decision_shape(i), problem.fused(i),
              problem.view_of[i] >= 0, _op_role(problem, i), len(problem.recompute_reads[i]))
             for i, c in enumerate(analysis.candidates)]
    classes = repeated_block_classes(places, kinds)
    if all(g < 0 for g in classes):
        return analysis
    return dataclasses.replace(analysis, problem=dataclasses.replace(problem, same_decision_as=classes))
