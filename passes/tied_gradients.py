"""Tied embeddings: the embedding's gradient accumulated into the head's, not beside it.

A weight used by an embedding and by a linear head (GPT-2's tied `wte`) gets the sum of two
gradients. Decomposed for Inductor, the embedding's part is rows scattered into a buffer of zeros
of its own (`_unsafe_masked_index_put_accumulate(zeros, mask, [ids], rows)`), then added to the
head's part: on GPT-2 (50304 x 768, float32) a 147 MiB buffer live beside the head's gradient, at
the top of the step's floor. Here the rows are scattered into the head's gradient instead, which
Inductor then updates in place where nothing else reads it. The same sum, added in another order
(float rounding only).
"""

from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten
_ZEROS = (aten.full.default, aten.zeros.default, aten.new_zeros.default)


def _is_zeros(node: object) -> bool:
    """A fresh buffer of zeros that only the scatter reads."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target in _ZEROS
            and len(node.users) == 1):
        return False
    return node.target is not aten.full.default or node.args[1] == 0


def _tied_sum(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(the head's gradient, the embedding's scatter into zeros) of an add summing the two."""
    if node.op != "call_function" or node.target is not aten.add.Tensor or len(node.args) != 2 or node.kwargs:
        return None
    for other, scatter in (node.args, node.args[::-1]):
        if not (isinstance(other, fx.Node) and isinstance(scatter, fx.Node)
                and scatter.target is aten._unsafe_masked_index_put_accumulate.default
                and len(scatter.users) == 1 and _is_zeros(scatter.args[0])):
            continue
        ours, theirs = other.meta.get("val"), scatter.meta.get("val")
        if (isinstance(ours, torch.Tensor) and isinstance(theirs, torch.Tensor) and ours.shape == theirs.shape
                and ours.dtype == theirs.dtype and ours.device == theirs.device):
            return other, scatter
    return None


def accumulate_tied_embedding_gradients(joint: fx.GraphModule) -> fx.GraphModule:
    """`joint` with each tied weight's embedding gradient scattered into its head gradient."""
    graph = joint.graph
    changed = False
    for node in list(graph.nodes):
        found = _tied_sum(node)
        if found is None:
            continue
        head_grad, scatter = found
        zeros = scatter.args[0]
        scatter.args = (head_grad, *scatter.args[1:])
        # the scatter now runs where the add did, after the head's gradient exists
        node.prepend(scatter)
        node.replace_all_uses_with(scatter)
        graph.erase_node(node)
        graph.erase_node(zeros)
        changed = True
    if changed:
        graph.lint()
        joint.recompile()
    return joint
