"""The graph rewrites a region may apply before it compiles (a chunked loss head, chunked MLPs),
and the record of what it has applied so far.

A region that no plan fits tries the rewrites one at a time (backend._Region's ladder) and goes
back to an earlier record where a rewritten graph does not fit either: the record
(`RewriteState`) is frozen and replaced whole, so saving it is keeping a reference.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Mapping, cast

from torch import fx

from memcompile import loss_ops
from memcompile.cost_models.device import DeviceProfile
from memcompile.options import Options
from memcompile.passes.chunking import ChunkMatch, ChunkPattern, apply_chunking, find_matches
from memcompile.passes.loss_head import LOSS_HEAD, LossHead, chunked_heads_workspace_bytes
from memcompile.passes.mlp_chunk import MLP
from memcompile.plan import TextEnum


class RewriteKind(TextEnum):
    """The rewrites, by the names the plan store's ladders record them under."""

    LOSS_HEAD = "loss_heads"
    MLPS = "mlps"


@dataclass(frozen=True)
class Rewrite:
    """A graph rewrite a region may apply before compiling, under an option True / False / "auto"."""

    kind: RewriteKind
    what: str  # for messages
    setting: Callable[[Options], bool | str]  # its option: True, False or "auto"
    pattern: ChunkPattern  # what it matches and how it rewrites a match (passes/chunking.py)
    # Also tried where a plan fits without it, if estimated faster. Not for MLPs: their chunked
    # backward recomputes the up / gate projections, measured 1.25 ms a layer on Llama small
    # (benchmarks/mlp_chunk_cost.py) where estimated 0.6: applied only where no plan fits without it.
    when_faster: bool = True
    # Chunk limits tried first, coarsest first, where no plan fits without the rewrite (as
    # apply_chunking's max_chunks): the fewest chunks that fit cost the least.
    coarse_first: tuple[int, ...] = ()
    # Chunk limits, fewest chunks first, taken where the rewritten graph's plan leaves room under
    # the budget for their larger working set (`workspace_bytes(graph, limit)`): each chunk of a
    # loss head streams its weight again (16 chunks of the 24-layer Llama's head: ~6% of the step).
    room_limits: tuple[int, ...] = ()
    workspace_bytes: Callable[[fx.Graph, int | None], int] | None = None
    # The op whose working set a coarser limit enlarges: where the plan has no room for it, the
    # plan recomputing more to make it is weighed (Replanner.fit_with_workspace).
    workspace_op: object | None = None

    def is_auto(self, options: Options) -> bool:
        return self.setting(options) == "auto"


# In the order "auto" tries them where no plan fits: the loss head first (cheap to chunk).
REWRITES = (Rewrite(RewriteKind.LOSS_HEAD, "the loss head", lambda options: options.chunk_loss, LOSS_HEAD,
                    room_limits=(1, 2, 4, 8), workspace_bytes=chunked_heads_workspace_bytes,
                    workspace_op=loss_ops.FORWARD),
            Rewrite(RewriteKind.MLPS, "the MLPs", lambda options: options.chunk_mlp, MLP,
                    when_faster=False, coarse_first=(2,)))


def rewrite_named(name: str) -> Rewrite | None:
    """The rewrite a stored ladder names (RewriteKind's value); None for a name not known."""
    return next((rewrite for rewrite in REWRITES if rewrite.kind.value == name), None)


@dataclass(frozen=True)
class RewriteState:
    """A region's graph as rewritten so far, and how. The mappings are never changed in place:
    each change is a new record (dataclasses.replace)."""

    gm: fx.GraphModule  # the graph every later compile starts from
    pristine_graph: fx.Graph  # a copy of gm's graph that no compile has touched: each compile copies it
    # what each rewrite applied rewrote (matches with describe() and added_time_s())
    found: Mapping[RewriteKind, tuple[ChunkMatch, ...]] = field(default_factory=dict)
    reasons: Mapping[RewriteKind, str] = field(default_factory=dict)  # why "auto" applied a rewrite (for the plan)
    # the chunk limit each rewrite the ladder applied took (None: finest)
    chunk_limits: Mapping[RewriteKind, int | None] = field(default_factory=dict)
    searched_least_peak: bool = True  # the request the kept compile made (a ladder replays it)

    def matches(self, kind: RewriteKind) -> tuple[ChunkMatch, ...]:
        return self.found.get(kind, ())

    @property
    def loss_heads(self) -> tuple[LossHead, ...]:
        return cast("tuple[LossHead, ...]", self.matches(RewriteKind.LOSS_HEAD))

    def fresh_graph(self) -> fx.GraphModule:
        """A graph module of the rewritten graph for one compile (which changes its graph)."""
        return fx.GraphModule(self.gm, copy.deepcopy(self.pristine_graph))

    def with_reason(self, kind: RewriteKind, reason: str) -> RewriteState:
        return dataclasses.replace(self, reasons={**self.reasons, kind: reason})

    def described(self) -> tuple[str, ...]:
        """What the rewrites changed in the graph, and why, for the plan."""
        described: list[str] = []
        for rewrite in REWRITES:
            reason = self.reasons.get(rewrite.kind, "")
            described += [x.describe() + (f" ({reason})" if reason else "") for x in self.matches(rewrite.kind)]
        return tuple(described)

    def added_time_s(self, profile: DeviceProfile) -> float:
        """What the rewrites are estimated to add to the step by themselves."""
        return sum(x.added_time_s(profile) for rewrite in REWRITES for x in self.matches(rewrite.kind))

    def ladder_moves(self, options: Options) -> tuple[tuple[str, int | None, str], ...]:
        """The "auto" rewrites applied, as the plan store's ladder records them (plan_store.StoredLadder)."""
        return tuple((rewrite.kind.value, self.chunk_limits.get(rewrite.kind), self.reasons.get(rewrite.kind, ""))
                     for rewrite in REWRITES if self.matches(rewrite.kind) and rewrite.is_auto(options))


def initial_rewrites(gm: fx.GraphModule, options: Options) -> RewriteState:
    """The graph with the rewrites whose option is True applied."""
    found: dict[RewriteKind, tuple[ChunkMatch, ...]] = {}
    for rewrite in REWRITES:
        if rewrite.setting(options) is True:
            gm, found[rewrite.kind] = apply_chunking(gm, rewrite.pattern)
    return RewriteState(gm, copy.deepcopy(gm.graph), found)


def apply_rewrite(state: RewriteState, rewrite: Rewrite, max_chunks: int | None = None) -> RewriteState | None:
    """The state with `rewrite` applied (passes/chunking.py) to its graph, into at most
    `max_chunks` chunks where given; None if it finds nothing to rewrite."""
    gm, found = apply_chunking(state.fresh_graph(), rewrite.pattern, max_chunks)
    if not found:
        return None
    return dataclasses.replace(state, gm=gm, pristine_graph=copy.deepcopy(gm.graph),
                               found={**state.found, rewrite.kind: found},
                               chunk_limits={**state.chunk_limits, rewrite.kind: max_chunks})


def pending_rewrites(state: RewriteState, options: Options) -> list[Rewrite]:
    """The "auto" rewrites not applied yet that would change the graph."""
    return [r for r in REWRITES if r.is_auto(options) and not state.matches(r.kind)
            and find_matches(state.gm.graph, r.pattern)]
