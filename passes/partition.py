"""Rewrite: split the joint graph into forward and backward graphs as the plan says.

Kept activations become forward outputs (saved for backward); recomputed ones are copied into
the backward, each just before its first reader there.
"""

from __future__ import annotations

import torch.fx as fx

from memcompile import _torch_private as tp
from memcompile.passes.activation_analysis import JointAnalysis, compute_unit


def apply_plan(
    joint: fx.GraphModule,
    analysis: JointAnalysis,
    keep: frozenset[int],
    recompute: frozenset[int],
    num_fwd_outputs: int,
) -> tuple[fx.GraphModule, fx.GraphModule]:
    readers = list(analysis.backward_nodes) + [compute_unit(analysis.candidates[i]) for i in recompute]
    read = {i for r in readers for i in r.all_input_nodes}
    backward = set(analysis.backward_nodes)
    saved_primals = [p for p in analysis.primals if p in read and not tp.is_sym_node(p)]
    saved_sym = [n for n in analysis.forward_nodes + analysis.primals
                 if n in read and n not in backward and tp.is_sym_node(n)]
    saved_values = [analysis.candidates[i] for i in sorted(keep)] + saved_primals
    return tp.extract_forward_backward(
        joint, saved_values, saved_sym, num_fwd_outputs, set(analysis.static_lifetime_inputs)
    )
