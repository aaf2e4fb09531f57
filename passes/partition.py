"""Rewrite: split the joint graph into forward and backward graphs as the plan says.

Kept activations become forward outputs (saved for backward); recomputed ones are copied into
the backward, each just before its first reader there. Stored ones (quantized, offloaded) are
converted right after the forward op that makes them, the stored form is saved, and the backward
converts it back just before its first reader; recomputations that read a stored tensor read the converted copy.
"""

from __future__ import annotations

import dataclasses

import torch.fx as fx

from memcompile import _torch_private as tp
from memcompile.passes.activation_analysis import JointAnalysis, compute_unit
from memcompile.passes.stored_forms import (
    build_load, build_offload, build_reload, build_store, issue_reloads_early, pin_reload_order,
)
from memcompile.plan import Choice
from memcompile.solver.activations import NOTHING_STORED, Stored, placement, reload_step


def apply_plan(
    joint: fx.GraphModule,
    analysis: JointAnalysis,
    keep: frozenset[int],
    recompute: frozenset[int],
    num_fwd_outputs: int,
    stored: Stored = NOTHING_STORED,
) -> tuple[fx.GraphModule, fx.GraphModule]:
    if stored:
        joint, analysis, saved_forms, reload_anchors = _insert_stored_forms(joint, analysis, recompute, stored)
    else:
        saved_forms, reload_anchors = [], {}
    readers = list(analysis.backward_nodes) + [compute_unit(analysis.candidates[i]) for i in recompute]
    read = {i for r in readers for i in r.all_input_nodes}
    backward = set(analysis.backward_nodes)
    saved_primals = [p for p in analysis.primals if p in read and not tp.is_sym_node(p)]
    saved_sym = [n for n in analysis.forward_nodes + analysis.primals
                 if n in read and n not in backward and tp.is_sym_node(n)]
    saved_values = [analysis.candidates[i] for i in sorted(keep)] + saved_forms + saved_primals
    fw, bw = tp.extract_forward_backward(
        joint, saved_values, saved_sym, num_fwd_outputs, set(analysis.static_lifetime_inputs)
    )
    if reload_anchors:  # the graphs' order is final now: prefetch the reloads, pin the transfers
        issue_reloads_early(bw, reload_anchors)
        pin_reload_order(bw)
    # so Inductor computes each recomputation where the rewrite put it (_torch_private.RECOMPUTED)
    tp.mark_recomputed(bw, {n.name for n in analysis.forward_nodes})
    return fw, bw


def _restore_topological_order(graph: fx.Graph) -> None:
    """Move nodes the insertions above placed ahead of their inputs after them, keeping every
    other node where it is. Joint graphs list some forward-only nodes (computed from parameters,
    read only by the backward) among the backward's, after the point where backward copies are
    inserted: such a node, and what it reads, moves up to just before its first reader."""
    order: list[fx.Node] = []
    placed: set[fx.Node] = set()
    for node in graph.nodes:
        stack = [(node, False)]
        while stack:  # depth first, inputs before the node (iterative: graphs are deep)
            n, inputs_done = stack.pop()
            if n in placed:
                continue
            if inputs_done:
                placed.add(n)
                order.append(n)
                continue
            stack.append((n, True))
            stack.extend((i, False) for i in reversed(n.all_input_nodes) if i not in placed)
    if order == list(graph.nodes):
        return
    output = graph.find_nodes(op="output")[0]
    for n in order:
        if n is not output:
            output.prepend(n)


def _insert_stored_forms(joint, analysis: JointAnalysis, recompute: frozenset[int], stored: Stored):
    """A copy of the joint graph with store/load ops inserted and the backward rewired to them.

    Returns the new graph module, the analysis with its node references mapped onto the copy,
    the stored-form nodes to save, and for each offloaded tensor's reload the name of the backward
    node it is issued before (the solver's prefetch step). The joint graph itself is left
    untouched: the planner rewrites it once per attempt.
    """
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(joint.graph, env)
    graph.output(out)
    new = lambda n: env[n]  # noqa: E731 - tiny mapping helper
    candidates = [new(c) for c in analysis.candidates]
    backward_nodes = [new(b) for b in analysis.backward_nodes]
    first_backward = backward_nodes[0] if backward_nodes else graph.find_nodes(op="output")[0]
    problem = analysis.problem
    fw_position = {n: k for k, n in enumerate(graph.nodes)}

    forward_nodes = [new(n) for n in analysis.forward_nodes]
    forward_set = set(forward_nodes)
    step_node = forward_nodes + backward_nodes  # the solver's steps
    start, _ = placement(problem, recompute)

    saved_forms: list[fx.Node] = []
    reload_anchors: dict[str, str] = {}
    loaded: dict[fx.Node, fx.Node] = {}  # candidate -> its backward copy (converted back / recomputed)
    for i, k in sorted(stored):
        x = candidates[i]
        choice = problem.choices_of(i)[k]
        if choice.kind == Choice.OFFLOAD:
            # The copy starts right after the producer; x stays on the device until the copy's
            # wait, after its last forward reader or the solver's release step if later.
            last_reader = max((u for u in x.users if u in forward_set), key=fw_position.__getitem__, default=x)
            # The analysis makes the release step's node a materialised forward node (or -1).
            release = step_node[choice.release_step] if choice.release_step >= 0 else x
            wait_after = max((last_reader, release, x), key=fw_position.__getitem__)
            _, host = build_offload(graph, x, wait_after, pinned=wait_after is release and release is not x)
            saved_forms.append(host)
            with graph.inserting_before(first_backward):
                copy, loaded[x] = build_reload(graph, host, x)
            reload_anchors[copy.name] = step_node[reload_step(problem, i, choice, start[i])].name
            continue
        # Right after the producer (joint graphs are functional: the value never changes), so a
        # conversion can fuse with it; `inserting_before(next)` keeps the new nodes in order.
        with graph.inserting_before(x.next):
            forms = build_store(graph, x, choice)
        saved_forms.extend(forms)
        with graph.inserting_before(first_backward):
            loaded[x] = build_load(graph, forms, x, choice)

    # Recomputations that (transitively) read a stored tensor get backward copies reading the
    # converted value; the forward keeps the originals.
    stored_nodes = set(loaded)
    units = sorted({compute_unit(candidates[i]) for i in recompute}, key=fw_position.__getitem__)
    recomputed_members = {candidates[i] for i in recompute}
    for unit in units:
        if not any(a in loaded for a in unit.all_input_nodes):
            continue
        with graph.inserting_before(first_backward):
            clone = graph.node_copy(unit, lambda a: loaded.get(a, a))
        loaded[unit] = clone
        for member in recomputed_members:
            if member is not unit and compute_unit(member) is unit:  # tuple members: getitem copies
                with graph.inserting_before(first_backward):
                    loaded[member] = graph.node_copy(member, lambda a: loaded.get(a, a))
    for b in backward_nodes:
        b.args = fx.node.map_arg(b.args, lambda a: loaded.get(a, a))
        b.kwargs = fx.node.map_arg(b.kwargs, lambda a: loaded.get(a, a))
    _restore_topological_order(graph)
    graph.lint()
    module = fx.GraphModule(joint, graph)
    # Candidates are now only what the rewrite still recomputes from forward nodes; stored ones are
    # reached through their saved forms.
    mapped = dataclasses.replace(
        analysis,
        candidates=tuple(loaded.get(c, c) if c not in stored_nodes else c for c in candidates),
        primals=tuple(new(p) for p in analysis.primals),
        forward_nodes=tuple(forward_nodes),
        backward_nodes=tuple(backward_nodes),
        static_lifetime_inputs=frozenset(new(n) for n in analysis.static_lifetime_inputs),
    )
    return module, mapped, saved_forms, reload_anchors
