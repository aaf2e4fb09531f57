"""memcompile's rules for Inductor in the graphs it planned: the InductorRules record, the marks
the rules read (recomputed nodes, planned graphs), and the scope that puts its fusion, buffer-reuse
and schedule hooks on Inductor's classes (inductor_rules). The hooks read plain facts off Inductor's
scheduler; which fusions to refuse is decided in memcompile/passes/fusion_refusals.py."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import threading
from typing import Any, Callable

import torch.fx as fx

from memcompile.passes import fusion_refusals

# Backward nodes that recompute a forward value (marked by the rewrite, passes/partition.py):
# fusions of a marked node with one far from it are refused (passes/fusion_refusals.py
# RECOMPUTE_FUSION_DISTANCE, RECOMPUTE_VERTICAL_GAP), so a recomputation runs where the rewrite
# put it, not at an earlier layer's kernel.
RECOMPUTED = "memcompile_recomputed"


def mark_recomputed(bw: fx.GraphModule, forward_names: set[str]) -> None:
    """Mark the backward's nodes that recompute a forward node (they keep its name)."""
    for node in bw.graph.nodes:
        if node.op == "call_function" and node.name in forward_names:
            node.meta[RECOMPUTED] = True


def _has_recomputed_origin(snode) -> bool:
    for member in snode.get_nodes():
        origins = getattr(getattr(member, "node", None), "origins", None) or ()
        if any(origin.meta.get(RECOMPUTED) for origin in origins):
            return True
    return False


# Graphs memcompile planned (the partitioner's forward and backward, and the check's copies of
# them), marked in GraphModule.meta: the lifetime and reuse rules apply to these only, so a graph
# compiled without memcompile in the same process fuses as stock Inductor does.
PLANNED_GRAPH = "memcompile_planned"


# Inductor's wrapper keeps a dead buffer allocated until a later allocation of the same size and
# dtype takes it over (codegen/wrapper.py AllocateLine.should_reuse_buffer), wherever its own
# estimate of the graph's peak allows the hold. That estimate is not the step's (it knows neither
# the other graph's tensors nor where our peak is): on Llama small at 9.61 MiB two dead 256 KiB
# attention gradients were held through layer 0's MLP backward, the step's peak. In planned
# graphs only the next kernel's allocation takes a dead buffer over (a hold of no kernel); any
# other is freed when it dies and the later one allocated anew, so no kernel runs with more
# memory held than it needs. Smallest budgets with it: GPT-2 small 9.09 -> 8.45 MiB, Llama small
# 8.50 -> 8.41, ViT small 6.51 -> 6.38 (BERT, ResNet unchanged).


@dataclasses.dataclass(frozen=True)
class InductorRules:
    """memcompile's rules for Inductor in the graphs it planned (each can be turned off for
    comparisons: Options.experiments), and whether a graph is lowered as one it planned:
    `planned=False` models a graph compiled under Inductor's own rules (PyTorch's partition as
    plain Inductor compiles it), which no rule touches."""

    # no horizontal fusion that holds a large dead buffer (passes/fusion_refusals.py)
    lifetime_fusion: bool = True
    adjacent_reuse: bool = True  # a freed buffer is reused only by the next kernel's allocation (above)
    planned: bool = True

    @property
    def adjacent_reuse_applies(self) -> bool:
        """Whether the wrapper's buffer reuse follows the adjacent rule (what the liveness models)."""
        return self.planned and self.adjacent_reuse

    def as_stock(self) -> "InductorRules":
        return dataclasses.replace(self, planned=False)

    def text(self) -> str:
        """For keys: these rules and the constants the rules read."""
        return (f"adjacent_reuse={self.adjacent_reuse} lifetime_fusion={self.lifetime_fusion} planned={self.planned} "
                f"recompute_fusion_distance={fusion_refusals.RECOMPUTE_FUSION_DISTANCE} "
                f"recompute_vertical_gap={fusion_refusals.RECOMPUTE_VERTICAL_GAP}")


PLANNED_RULES = InductorRules()  # the product's rules
# The rules of the innermost inductor_rules() scope, read by the methods it installs.
_ACTIVE_RULES: contextvars.ContextVar[InductorRules] = contextvars.ContextVar(
    "memcompile_inductor_rules", default=PLANNED_RULES)


def _install_reuse_rule() -> Callable[[], None]:
    """In graphs memcompile planned (PLANNED_GRAPH), a freed buffer is reused only by the next
    kernel's allocation (InductorRules.adjacent_reuse); other graphs reuse as before. Returns
    what restores Inductor's own."""
    from torch._inductor.codegen.wrapper import AllocateLine

    original = AllocateLine.__dict__["should_reuse_buffer"]

    def should_reuse_buffer(self, free_line, size):
        if (_ACTIVE_RULES.get().adjacent_reuse and not getattr(self, "comm_buffer", False)
                and _planned_graph_now()):
            return free_line.scheduler_node_index + 1 == self.scheduler_node_index
        return original(self, free_line, size)

    AllocateLine.should_reuse_buffer = should_reuse_buffer

    def restore() -> None:
        AllocateLine.should_reuse_buffer = original

    return restore


# While set: called with each graph (a GraphLowering) Inductor has just scheduled for its code
# generation, by the compile that reads the schedules it builds (lowering.py compile_with_inductor).
_ON_SCHEDULED: contextvars.ContextVar[Callable[[Any], None] | None] = contextvars.ContextVar(
    "memcompile_on_scheduled", default=None)


@contextlib.contextmanager
def on_each_schedule(callback: Callable[[Any], None] | None):
    """While open (with an inductor_rules scope): `callback(graph)` right after Inductor built the
    scheduler of each graph it lowers for code generation; None: nothing is called."""
    token = _ON_SCHEDULED.set(callback)
    try:
        yield
    finally:
        _ON_SCHEDULED.reset(token)


def _install_schedule_capture() -> Callable[[], None]:
    """on_each_schedule's hook on Inductor's lowering; returns what restores Inductor's own."""
    from torch._inductor.graph import GraphLowering

    original = GraphLowering.__dict__["_update_scheduler"]

    def _update_scheduler(self) -> None:
        original(self)
        callback = _ON_SCHEDULED.get()
        if callback is not None:
            callback(self)

    GraphLowering._update_scheduler = _update_scheduler

    def restore() -> None:
        GraphLowering._update_scheduler = original

    return restore


# Scopes of inductor_rules() open now (they may nest: the check lowers graphs inside a compile).
_RULES_LOCK = threading.Lock()
_RULES_DEPTH = 0
_RULES_RESTORE: list[Callable[[], None]] = []


@contextlib.contextmanager
def inductor_rules(rules: InductorRules):
    """memcompile's fusion and buffer-reuse rules (`rules`) on Inductor's classes while memcompile
    lowers or compiles a graph (_install_fusion_rules, _install_reuse_rule); Inductor's own are
    back when the outermost scope ends. Inside a scope, graphs memcompile did not plan still fuse
    and reuse as stock Inductor does (the rules read the planned-graph and recomputed marks)."""
    global _RULES_DEPTH
    with _RULES_LOCK:
        if _RULES_DEPTH == 0:
            _RULES_RESTORE[:] = [_install_fusion_rules(), _install_reuse_rule(), _install_schedule_capture()]
        _RULES_DEPTH += 1
    token = _ACTIVE_RULES.set(rules)
    try:
        yield
    finally:
        _ACTIVE_RULES.reset(token)
        with _RULES_LOCK:
            _RULES_DEPTH -= 1
            if _RULES_DEPTH == 0:
                for restore in reversed(_RULES_RESTORE):
                    restore()
                _RULES_RESTORE.clear()


def mark_planned(rules: InductorRules, *graphs: fx.GraphModule) -> None:
    """Mark graphs as planned by memcompile (see PLANNED_GRAPH), to be compiled under `rules`.
    The mark names the rules' version: GraphModule.meta is part of the key of Inductor's FX graph
    cache, so code compiled under one version of the rules (or under Inductor's own) is never
    reused under another."""
    from memcompile.plan_cache import source_hash

    tag = f"memcompile {source_hash()} {rules.text()}"
    for gm in graphs:
        gm.meta[PLANNED_GRAPH] = tag
def _stored_bytes(buf) -> int:
    from torch._inductor.virtualized import V

    try:
        return int(V.graph.sizevars.optimization_hint(V.graph.get_allocation_storage_size(buf.node))) \
            * buf.node.get_dtype().itemsize
    except Exception:  # noqa: BLE001 - no storage of its own (a view, a tuple, a mutation): nothing to allocate
        return 0


def _fusion_extends_a_lifetime(scheduler, node1, node2) -> bool:
    """fusion_refusals.fusion_extends_a_lifetime of two scheduler nodes, over their results as
    plain facts (readers outside the pair, by the order of the fused node that runs each)."""
    from torch._inductor.virtualized import V

    early, late = sorted((node1, node2), key=lambda n: n.min_order)
    pair = {n.get_name() for n in early.get_nodes()} | {n.get_name() for n in late.get_nodes()}

    def readers_outside(buf) -> list:
        return [u.node for u in buf.users if not u.is_weak and u.node.get_name() not in pair]

    def early_results():  # read only where the later node allocates something large
        graph_outputs = set(V.graph.get_output_names())
        for buf in early.get_outputs():
            nbytes, is_output = _stored_bytes(buf), buf.get_name() in graph_outputs
            if is_output or nbytes < fusion_refusals.LIFETIME_FUSION_MIN_BYTES:
                yield fusion_refusals.FusedResult(nbytes, (), is_output)  # the rule passes it over unread
                continue
            # no min_order: the graph's output node
            orders = tuple(scheduler.get_fused_node(r).min_order if hasattr(r, "min_order") else None
                           for r in readers_outside(buf))
            yield fusion_refusals.FusedResult(nbytes, orders, is_output)

    late_outliving = (_stored_bytes(buf) for buf in late.get_outputs() if readers_outside(buf))
    return fusion_refusals.fusion_extends_a_lifetime(early_results(), late_outliving, late.min_order)


def _planned_graph_now() -> bool:
    from torch._inductor.virtualized import V

    module = getattr(V.graph, "module", None)
    return bool(getattr(module, "meta", {}).get(PLANNED_GRAPH))


def _install_fusion_rules() -> Callable[[], None]:
    """memcompile's fusion rules on Inductor's choices (inductor_rules scopes them; returns what
    restores Inductor's own): refuse fusions of a recomputed node with one far from it (in
    Inductor's node order), and, in graphs memcompile planned (PLANNED_GRAPH), horizontal fusions
    that keep a large dead buffer's memory from the later node. Which ones is decided in
    passes/fusion_refusals.py over the pair's orders and results. Other graphs fuse as before."""
    from torch._inductor.choices import InductorChoices

    saved = InductorChoices.__dict__["can_fuse_horizontal"], InductorChoices.__dict__["can_fuse_vertical"]
    original, original_vertical = InductorChoices.can_fuse_horizontal, InductorChoices.can_fuse_vertical

    def recomputed(node1, node2) -> bool:  # read for far pairs only: most candidates are near
        return _has_recomputed_origin(node1) or _has_recomputed_origin(node2)

    def can_fuse_horizontal(scheduler, node1, node2, shared_data_score):
        if fusion_refusals.horizontal_too_far_for_a_recomputation(
                (node1.min_order, node1.max_order), (node2.min_order, node2.max_order)) and recomputed(node1, node2):
            return False
        if (_ACTIVE_RULES.get().lifetime_fusion and _planned_graph_now()
                and _fusion_extends_a_lifetime(scheduler, node1, node2)):
            return False
        return original(scheduler, node1, node2, shared_data_score)

    def can_fuse_vertical(scheduler, node1, node2, shared_data_score):
        if fusion_refusals.vertical_too_far_for_a_recomputation(
                (node1.min_order, node1.max_order), (node2.min_order, node2.max_order)) and recomputed(node1, node2):
            return False
        return original_vertical(scheduler, node1, node2, shared_data_score)

    InductorChoices.can_fuse_horizontal = staticmethod(can_fuse_horizontal)
    InductorChoices.can_fuse_vertical = staticmethod(can_fuse_vertical)

    def restore() -> None:
        InductorChoices.can_fuse_horizontal, InductorChoices.can_fuse_vertical = saved

    return restore
