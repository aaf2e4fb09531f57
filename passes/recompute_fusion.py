"""Which activations Inductor inlines into their readers when they are not saved.

A candidate kept for the backward is a saved tensor: a buffer. Recomputed, it is an op of the
backward graph, and Inductor may inline its pointwise body into the kernels that read it
(passes/fusion.py): then it holds no memory of its own, and what it reads stays live until
those kernels run. Charging such a copy as a stored tensor over-counts: GPT-2's tanh-GELU
values recomputed together checked 1.2 MiB lower where the model said 2 MiB higher
(benchmarks/least_peak_probe.py). Likewise in the forward: a value nobody saves is inlined into
its forward readers, so its forward bytes belong to the decision to save it, not to the fixed
bytes.

The fates are predicted once, on the two graphs of the plan that recomputes everything it may
(the rewrite itself, then passes/fusion.py on each). That context gives each recomputed copy the
most readers and its body the most inlined inputs, the two things that make Inductor store a
body (several readers with a heavy op, too many reads): a copy inlined there is inlined in
plans that recompute less too, to the extent these rules decide it. The exact check of each
plan's rewritten graphs stays the judge.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch.fx as fx

from memcompile.passes.activation_analysis import JointAnalysis
from memcompile.passes.fusion import FusionRules, predict_fusion
from memcompile.passes.graph_facts import fusion_facts, graph_device_type
from memcompile.passes.partition import apply_plan
from memcompile.solver.activations import close_decisions
from memcompile.errors import UNREADABLE_GRAPH_ERRORS

log = logging.getLogger("memcompile")


@dataclass(frozen=True)
class RecomputeFates:
    """Per candidate, what Inductor makes of it when it is not saved."""

    fused_in_backward: tuple[bool, ...]  # its recomputed copy is inlined into its backward readers
    fused_in_forward: tuple[bool, ...]  # not saved, it is inlined into its forward readers


def predict_recompute_fates(joint: fx.GraphModule, analysis: JointAnalysis, num_fwd_outputs: int) -> RecomputeFates | None:
    """The fates in the graphs of the plan that recomputes all it may (None when none is
    recomputed, or the prediction cannot be made)."""
    problem = analysis.problem
    keep, recompute, stored = close_decisions(problem, prefer_recompute=set(range(len(problem.names))))
    if not recompute:
        return None
    rules = FusionRules.for_device(graph_device_type(joint))
    try:
        forward, backward = apply_plan(joint, analysis, keep, recompute, num_fwd_outputs, stored)
        in_forward = predict_fusion(fusion_facts(forward), rules).inlined
        in_backward = predict_fusion(fusion_facts(backward), rules).inlined
    except UNREADABLE_GRAPH_ERRORS as error:  # a missed refinement must not fail the compile
        log.warning("memcompile: predicting fusion of recomputed values failed (%s: %s); counting each "
                    "recomputed value as a buffer", type(error).__name__, error)
        return None
    # The rewrite keeps node names: a recomputed node's backward copy is named as the original.
    def flags(inlined: frozenset[str]) -> tuple[bool, ...]:
        return tuple(i in recompute and problem.nbytes[i] > 0 and name in inlined
                     for i, name in enumerate(problem.names))

    return RecomputeFates(flags(in_backward), flags(in_forward))


def with_fused_recomputations(joint: fx.GraphModule, analysis: JointAnalysis, num_fwd_outputs: int) -> JointAnalysis:
    """The analysis with the fates of values that are not saved in its problem: recomputed copies
    inlined in the backward hold no bytes; forward values inlined when not saved hold their
    forward bytes only when saved (moved out of the fixed bytes into the decision)."""
    fates = predict_recompute_fates(joint, analysis, num_fwd_outputs)
    if fates is None:
        return analysis
    problem = analysis.problem
    step = {n: t for t, n in enumerate(analysis.forward_nodes)}
    fixed, before = list(problem.fixed_bytes), list(problem.before_node_bytes)
    forward_from = [-1] * len(problem.names)
    for i, node in enumerate(analysis.candidates):
        born = step.get(node, -1)
        if not fates.fused_in_forward[i] or not 0 <= born < problem.keep_from[i]:
            continue
        forward_from[i] = born
        for t in range(born, problem.keep_from[i]):  # the lifetime the analysis put in the fixed bytes
            fixed[t] -= problem.nbytes[i]
            if t > born:  # at its own step, the bytes before its node never held it
                before[t] -= problem.nbytes[i]
    log.debug("memcompile: not saved, %d candidates are inlined in the forward and %d recomputed copies in "
              "the backward", sum(f >= 0 for f in forward_from), sum(fates.fused_in_backward))
    return dataclasses.replace(analysis, problem=dataclasses.replace(
        problem,
        fixed_bytes=tuple(fixed),
        fixed_before_node_bytes=tuple(before),
        fused_when_recomputed=fates.fused_in_backward if any(fates.fused_in_backward) else (),
        saved_only_forward_from=tuple(forward_from) if any(f >= 0 for f in forward_from) else (),
    ))
