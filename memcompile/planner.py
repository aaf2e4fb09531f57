"""The compiler's planning step: joint graph in, (forward, backward, Plan) out.

analyze (passes/activation_analysis) -> solve (solver/activations) -> rewrite (passes/partition)
-> check (passes/liveness). The check runs the exact liveness of the rewritten graphs; when it
disagrees with the solver's linear model, the solver's target is tightened by the difference
and it solves again, so the plan returned always has predicted peak <= budget.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.fx as fx

from memcompile import _torch_private as tp
from memcompile.cost_models.device import profile_for
from memcompile.errors import InfeasibleBudgetError
from memcompile.options import Options
from memcompile.passes.activation_analysis import JointAnalysis, analyze_joint_graph
from memcompile.passes.liveness import LivenessTimeline, analyze_liveness
from memcompile.passes.partition import apply_plan
from memcompile.passes.stored_forms import StoreOptions
from memcompile.plan import Decision, Plan, format_bytes
from memcompile.solver.activations import (
    ActivationSolution,
    close_decisions,
    evaluate,
    greedy_plan,
    solve_activation_plan,
    solve_min_peak,
)

log = logging.getLogger("memcompile")

_MAX_TIGHTENINGS = 4


@dataclass(frozen=True)
class _Attempt:
    solution: ActivationSolution
    forward: fx.GraphModule
    backward: fx.GraphModule
    timeline: LivenessTimeline


def _device_of(joint_inputs) -> str:
    for x in joint_inputs:
        if isinstance(x, torch.Tensor):
            return x.device.type
    return "cpu"


def _store_options(options: Options, device: str) -> tuple[StoreOptions, bool]:
    """(what the solver may offer besides keep/recompute, whether offload copies stay on this host)."""
    has_own_memory = device.startswith(("cuda", "xpu"))
    offload = has_own_memory if options.offload is None else options.offload
    link = (options.host_link_gbps or 0.0) * 1e9
    return StoreOptions(options.quantize, offload, link), offload and not has_own_memory


def _rewrite_and_check(joint, analysis, solution, num_fwd_outputs, offload_on_host: bool = False) -> _Attempt:
    # Every node's result counted as a buffer, even under Inductor: modelling its fusion
    # (fuse_pointwise=True) fell below the measured peak by up to 9% (Inductor also hoists and
    # reorders allocations), while counting every buffer stayed above it in every run we measured.
    fw, bw = apply_plan(joint, analysis, solution.keep, solution.recompute, num_fwd_outputs, solution.stored,
                        offload_on_host=offload_on_host)
    return _Attempt(solution, fw, bw, analyze_liveness(fw, bw, num_fwd_outputs))


def _user_line(stack_trace: str) -> str:
    """The user's source line from an FX stack trace (Python 3.11 adds ^^^ marker lines)."""
    lines = [ln.strip() for ln in stack_trace.splitlines() if ln.strip().strip("^~ ")]
    return lines[-1] if lines else ""


def _decisions(analysis: JointAnalysis, solution: ActivationSolution) -> tuple[Decision, ...]:
    problem = analysis.problem
    stored = dict(solution.stored)
    rows = []
    for i in sorted(solution.keep | solution.recompute | set(stored), key=lambda i: -problem.nbytes[i]):
        if problem.nbytes[i] == 0 or (i in solution.recompute and problem.recompute_cost_s[i] == 0):
            continue  # views, and values only the backward reads (computed there once either way)
        node = analysis.candidates[i]
        val = node.meta.get("val")
        recomputed = i in solution.recompute
        if recomputed:
            reason = "" if problem.can_keep[i] else "view of an activation: keeping it would pin its base"
        else:
            reason = analysis.cannot_recompute_reason[i]
        if i in solution.keep and analysis.not_stored_reason and analysis.not_stored_reason[i]:
            reason = "; ".join(r for r in (reason, analysis.not_stored_reason[i]) if r)
        if i in stored:
            choice = problem.choices_of(i)[stored[i]]
            kind, fmt, held, cost = choice.kind, choice.format, choice.stored_bytes, choice.time_cost_s
        elif recomputed:
            kind, fmt, held, cost = "recompute", "", 0, problem.recompute_cost_s[i]
        else:
            kind, fmt, held, cost = "keep", "", problem.nbytes[i], 0.0
        trace = node.meta.get("stack_trace") or ""
        rows.append(Decision(
            name=node.name,
            op=str(getattr(node.target, "__name__", node.target)),
            shape=tuple(int(s) for s in getattr(val, "shape", ())),
            dtype=str(getattr(val, "dtype", "")).replace("torch.", ""),
            nbytes=problem.nbytes[i],
            choice=kind,
            time_cost_s=cost,
            reason=reason,
            source=_user_line(trace),
            format=fmt,
            held_bytes=held,
        ))
    return tuple(rows)


def plan_joint_graph(
    joint: fx.GraphModule,
    joint_inputs,
    *,
    num_fwd_outputs: int,
    static_lifetime_input_indices: list[int] | None,
    options: Options,
    graph_id: str,
) -> tuple[fx.GraphModule, fx.GraphModule, Plan]:
    joint = tp.prepare_joint_graph(joint)
    device = options.device or _device_of(joint_inputs)
    profile = profile_for(device)
    store, offload_on_host = _store_options(options, device)
    analysis = analyze_joint_graph(joint, num_fwd_outputs, list(static_lifetime_input_indices or []), profile, store)
    problem = analysis.problem
    budget = options.step_budget_bytes

    keep_all = close_decisions(problem, prefer_recompute=set())
    model_peak, _ = evaluate(problem, *keep_all)
    baseline = _rewrite_and_check(
        joint, analysis, ActivationSolution(*keep_all, model_peak, 0.0, "fits", 0.0, 0.0), num_fwd_outputs
    )
    before = baseline.timeline
    chosen = baseline if before.peak_bytes <= budget else None
    solve_s = 0.0
    target = budget
    for _ in range(_MAX_TIGHTENINGS if chosen is None else 0):
        # All solves of one graph share the time limit (each gets at least a second).
        remaining = max(1.0, options.time_limit_s - solve_s)
        solution = _solve_or_greedy(problem, target, remaining, options)
        solve_s += solution.solve_s
        if solution.status == "infeasible":
            break
        attempt = _rewrite_and_check(joint, analysis, solution, num_fwd_outputs, offload_on_host)
        log.debug("target %d: model peak %d, graph peak %d (%s)", target, solution.model_peak_bytes,
                  attempt.timeline.peak_bytes, solution.status)
        if attempt.timeline.peak_bytes <= budget:
            chosen = attempt
            break
        # The model under-estimated the real graphs: ask it for that much less.
        target -= attempt.timeline.peak_bytes - budget
    if chosen is None:
        # The least-peak plan is deterministic, so the min_feasible_bytes we report is met by
        # the same plan when the user compiles again at exactly that budget.
        chosen, min_peak_s = _least_peak_attempt(joint, analysis, num_fwd_outputs, options, offload_on_host)
        solve_s += min_peak_s
        if chosen.timeline.peak_bytes > budget:
            raise _infeasible(options, chosen, analysis)

    after = chosen.timeline
    sol = chosen.solution
    plan = Plan(
        graph_id=graph_id,
        budget_bytes=options.budget_bytes,
        reserve_bytes=options.reserve_bytes,
        predicted_peak_before_bytes=before.peak_bytes,
        predicted_peak_bytes=after.peak_bytes,
        peak_phase=after.peak_step.phase,
        peak_node=after.peak_step.node,
        peak_breakdown=after.peak_breakdown,
        decisions=_decisions(analysis, sol),
        added_time_s=sol.added_time_s,
        solver_status=sol.status,
        solve_s=solve_s,
        gap=sol.gap,
        live_bytes_before=tuple(s.live_bytes for s in before.steps),
        live_bytes_after=tuple(s.live_bytes for s in after.steps),
    )
    log.info("%s", plan.summary())
    return chosen.forward, chosen.backward, plan


def _solve_or_greedy(problem, target: int, time_limit_s: float, options: Options) -> ActivationSolution:
    """The solver's plan; if the solver itself fails (a bug, an OR-Tools error), the greedy plan,
    with a warning: a crash here would kill the user's run."""
    try:
        return solve_activation_plan(problem, target, time_limit_s=time_limit_s,
                                     workers=options.workers, seed=options.seed)
    except Exception as error:  # noqa: BLE001 - any solver failure must degrade, not abort
        log.warning("memcompile: the solver failed (%s: %s); using the greedy plan", type(error).__name__, error)
        plan = greedy_plan(problem, target)
        peak, added = evaluate(problem, *plan)
        return ActivationSolution(*plan, peak, added, "fallback" if peak <= target else "infeasible", 0.0, 0.0)


def _least_peak_attempt(joint, analysis, num_fwd_outputs, options, offload_on_host) -> tuple[_Attempt, float]:
    """The plan with the least peak we can find (deterministically): min-peak under the model."""
    least = solve_min_peak(analysis.problem, time_limit_s=options.time_limit_s,
                           workers=options.workers, seed=options.seed)
    attempt = _rewrite_and_check(joint, analysis, least, num_fwd_outputs, offload_on_host)
    return attempt, least.solve_s


def _infeasible(options: Options, attempt: _Attempt, analysis: JointAnalysis) -> InfeasibleBudgetError:
    need = attempt.timeline.peak_bytes + options.reserve_bytes
    breakdown = attempt.timeline.peak_breakdown
    kept = sorted(((analysis.problem.nbytes[i], analysis.candidates[i].name) for i in attempt.solution.keep), reverse=True)[:5]
    parts = ", ".join(f"{cat} {format_bytes(b)}" for cat, b in sorted(breakdown, key=lambda x: -x[1]))
    tops = ", ".join(f"{name} {format_bytes(b)}" for b, name in kept if b)
    message = (
        f"memcompile: no plan fits the budget of {format_bytes(options.budget_bytes)} "
        f"({options.budget_bytes} bytes"
        + (f", reserve {options.reserve_bytes}" if options.reserve_bytes else "")
        + f"). The smallest budget that works is {format_bytes(need)} (min_feasible_bytes={need}). "
        f"At its peak ({attempt.timeline.peak_step.phase} node {attempt.timeline.peak_step.node}): {parts}."
        + (f" Largest activations still kept by that plan: {tops}." if tops else "")
        + " Raise the budget, or reduce batch size / model size."
    )
    return InfeasibleBudgetError(message, budget_bytes=options.budget_bytes, min_feasible_bytes=need,
                                 contributors=tuple(breakdown))
