"""The skeleton of the Dynamo-graph chunking rewrites: find a pattern's matches, copy the graph,
rewrite each match into one chunked custom op.

A pattern (`ChunkPattern`) supplies what differs: where a match is (`match`, called on every node
with the graph's inputs and outputs), which nodes its rewrite erases (`replaced`), and the rewrite
itself (`rewrite`). The patterns: the loss head (passes/loss_head.py, `LOSS_HEAD`) and the MLPs
(passes/mlp_chunk.py, `MLP`). Their matches are frozen records (`LossHead`, `MlpBlock`) with the
node names, the chunk count and the estimates the backend weighs (`describe`, `added_time_s`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Generic, Mapping, Protocol, Sequence, TypeVar

import torch
from torch import fx

from memcompile.cost_models.device import DeviceProfile
from memcompile.passes.graph_facts import rewritten_copy


class ChunkMatch(Protocol):
    """What a pattern's match record holds: how many chunks, and what the backend reports and weighs."""

    @property
    def chunks(self) -> int: ...

    def describe(self) -> str: ...

    def added_time_s(self, profile: DeviceProfile) -> float: ...


Match = TypeVar("Match", bound=ChunkMatch)


def coarsened(matches: tuple[Match, ...], max_chunks: int) -> tuple[Match, ...]:
    """The matches as `apply_chunking` splits them into at most `max_chunks` chunks."""
    return tuple(dataclasses.replace(m, chunks=max(1, min(m.chunks, max_chunks)))  # type: ignore[type-var]
                 for m in matches)


@dataclass(frozen=True)
class GraphBoundary:
    """A graph's placeholders by position, and its output node's values (None: not a flat tuple)."""

    inputs: Mapping[fx.Node, int]
    outputs: tuple | None


@dataclass(frozen=True)
class ChunkPattern(Generic[Match]):
    """One chunking rewrite: how it finds its matches and rewrites one."""

    match: Callable[[fx.Node, GraphBoundary], Match | None]
    # The names of the nodes the rewrite of a match erases: no two matches may share one.
    replaced: Callable[[Match], frozenset[str]]
    # rewrite(graph, match, nodes by name): the match's nodes replaced by the chunked op.
    rewrite: Callable[[fx.Graph, Match, dict[str, fx.Node]], None]
    # What the matches need from each other before the rewrite (the loss head: the positions of
    # the outputs its rewrites append); None: nothing.
    prepare: Callable[[fx.Graph, tuple[Match, ...]], tuple[Match, ...]] | None = None


def chunk_count(tokens: int, wanted: int, most: int, min_rows: int) -> int:
    """`wanted` chunks, at most `most`, none under `min_rows` token rows; at least 1."""
    return max(1, min(most, wanted, tokens // min_rows))


def cast_nodes(add: Callable[..., fx.Node], values: Sequence[object], dtype: torch.dtype | None) -> list[object]:
    """`values` with each node among them cast to `dtype` by a new node (`add`: graph_facts.node_adder),
    as autocast casts a linear's inputs; as they are where `dtype` is None."""
    if dtype is None:
        return list(values)
    return [add("call_method", "to", (v, dtype)) if isinstance(v, fx.Node) else v for v in values]


def graph_boundary(graph: fx.Graph) -> GraphBoundary:
    inputs = {n: i for i, n in enumerate(graph.find_nodes(op="placeholder"))}
    (output,) = graph.find_nodes(op="output")
    outputs = tuple(output.args[0]) if isinstance(output.args[0], (tuple, list)) else None
    return GraphBoundary(inputs, outputs)


def find_matches(graph: fx.Graph, pattern: ChunkPattern[Match]) -> tuple[Match, ...]:
    """The pattern's matches in a Dynamo graph that chunking would split into more than one chunk,
    no two sharing a node the rewrite erases (in a stack of linear -> activation layers every
    linear is both the down projection of one MLP and the up projection of the next): the first
    match in graph order wins."""
    boundary = graph_boundary(graph)
    matches: list[Match] = []
    taken: set[str] = set()
    for node in graph.nodes:
        found = pattern.match(node, boundary)
        if found is not None and not (pattern.replaced(found) & taken):
            matches.append(found)
            taken |= pattern.replaced(found)
    return tuple(matches)


def apply_chunking(gm: fx.GraphModule, pattern: ChunkPattern[Match],
                   max_chunks: int | None = None) -> tuple[fx.GraphModule, tuple[Match, ...]]:
    """A copy of `gm` with every match of `pattern` chunked, and the matches; with `max_chunks`,
    into at most that many chunks each (fewer, larger chunks: less overhead, more memory).
    Returns `gm` itself and () when nothing matches."""
    matches = find_matches(gm.graph, pattern)
    if max_chunks is not None:
        matches = coarsened(matches, max_chunks)
    if not matches:
        return gm, ()
    if pattern.prepare is not None:
        matches = pattern.prepare(gm.graph, matches)
    return rewritten_copy(gm, matches, pattern.rewrite), matches
