"""The compiler's planning step: joint graph in, (forward, backward, Plan) out.

analyze (passes/activation_analysis) -> solve (solver/activations) -> rewrite (passes/partition)
-> check (passes/liveness). The check runs the exact liveness of the rewritten graphs; when it
disagrees with the solver's linear model, the solver's target is tightened by the difference
and it solves again, so the plan returned always has predicted peak <= budget.
"""

from __future__ import annotations

import contextvars
import copy
from typing import Callable
import dataclasses
import logging
import time
from dataclasses import dataclass

import torch
import torch.fx as fx

from memcompile import _torch_private as tp
from memcompile import logs
from memcompile.cost_models.cuda_allocator import EXACT, AllocatorRounding
from memcompile.cost_models.device import DeviceProfile, profile_for
from memcompile.cost_models.node_cost import estimate_node_time_s
from memcompile.errors import UNREADABLE_GRAPH_ERRORS, InfeasibleBudgetError, PlanningFailedError
from memcompile.options import Options
from memcompile.passes.activation_analysis import (
    MUST_RECOMPUTE_REASON,
    MUST_SAVE,
    JointAnalysis,
    analyze_joint_graph,
)
from memcompile.passes.calibration import calibrated, step_corrections
from memcompile.node_facts import is_aliasing_op, tensor_nbytes
from memcompile.passes.graph_facts import is_random_op, step_device
from memcompile.passes.tied_gradients import accumulate_tied_embedding_gradients
from memcompile.passes.liveness import (SAVED, LivenessTimeline, analyze_liveness, analyze_scheduled_liveness,
                                        with_held_at_backward_start, with_scratch_at)
from memcompile.passes.partition import apply_plan
from memcompile.passes.recompute_fusion import with_fused_recomputations
from memcompile.passes.repeated_blocks import with_repeated_blocks
from memcompile.passes.stored_forms import StoreOptions
from memcompile.plan import Choice, Decision, Plan, StatusKind, format_bytes, status_text
from memcompile import plan_store
from memcompile import check_memo
from memcompile.plan_cache import solve_cached, source_hash
from memcompile.sizes import size_value
from memcompile.solver.activations import (
    KEEP_BACK_SHARE,
    ActivationProblem,
    ActivationSolution,
    close_decisions,
    evaluate,
    greedy_plan,
    recomputed_further,
    solve_activation_plan,
    solve_min_peak,
    step_loads,
    with_fixed_bytes_at,
)

log = logging.getLogger("memcompile")

_MAX_TIGHTENINGS = 4
_MAX_RAISES = 1  # re-solves at a higher model target when the check leaves room under the budget
_RAISE_MIN_SLACK = 0.02  # ... of at least this fraction of the budget
_REPAIR_TRIES = 6  # checks spent repairing an overshooting plan before the least-peak fallback


@dataclass(frozen=True)
class _Attempt:
    solution: ActivationSolution | StockSolution
    forward: fx.GraphModule
    backward: fx.GraphModule
    timeline: LivenessTimeline
    # False: `timeline` is a bound in graph order, not the schedule check; the compile's own
    # schedule checks it (PlanRequest.defer_check)
    checked: bool = True
    stock_rules: bool = False  # (a PyTorch partition) checked under Inductor's own rules


def _store_options(options: Options, device: str) -> StoreOptions:
    """What the solver may offer besides keep/recompute. Offload ("auto", the default) only where
    the device has memory of its own; forced on elsewhere (a test switch) its copies stay there."""
    has_own_memory = device.startswith(("cuda", "xpu"))
    offload = has_own_memory if options.offload is None else options.offload
    link = (options.host_link_gbps or 0.0) * 1e9
    return StoreOptions(options.quantize, offload, link)


def _runs_under_inductor(options: Options) -> bool:
    """The graphs go to Inductor (fusion matters to what they hold), not the FX interpreter."""
    return options.codegen == "inductor"


def cost_profile(options: Options, device: str) -> DeviceProfile:
    """The cost profile of `device` as these options price ops (the time_ops experiment off: by
    the roofline only)."""
    profile = profile_for(device)
    return profile if options.experiments.time_ops else dataclasses.replace(profile, times_ops=False)


def inductor_rules_for(options: Options) -> tp.InductorRules:
    """The rules Inductor compiles the graphs memcompile planned under (its experiments may turn
    each off)."""
    return tp.InductorRules(lifetime_fusion=options.experiments.lifetime_fusion,
                            adjacent_reuse=options.experiments.adjacent_reuse)


def _checks_schedule(options: Options) -> tp.InductorRules | None:
    """The rules under which the check predicts over the kernels Inductor's scheduler makes of
    the planned graphs, in its order (passes/inductor_schedule.py, passes/liveness.py
    analyze_scheduled_liveness): under Inductor, unless the fusion_check experiment is off. None:
    every FX node's result counts as a buffer, in graph order (above every peak we measured, by
    up to 1.45x)."""
    return inductor_rules_for(options) if _runs_under_inductor(options) and options.experiments.fusion_check else None


def _stock_rules(rules: tp.InductorRules | None) -> tp.InductorRules | None:
    """The check's rules for a graph compiled under Inductor's own (PyTorch's partition as plain
    Inductor compiles it: not marked planned, so no rule of ours applies)."""
    return rules.as_stock() if rules is not None else None


def _rewrite_and_check(joint, analysis, solution, num_fwd_outputs, fuse: tp.InductorRules | None = None,
                       rounding: AllocatorRounding = EXACT) -> _Attempt:
    # `fuse`: the check predicts over Inductor's schedule (_checks_schedule); without, every FX
    # node's result is stored, as the FX interpreter (aot_eager) stores it. `rounding`: what
    # each allocation holds on the step's device (Options.allocator_rounding).
    fw, bw = apply_plan(joint, analysis, solution.keep, solution.recompute, num_fwd_outputs, solution.stored)
    return _Attempt(solution, fw, bw, predicted_liveness(fw, bw, num_fwd_outputs, fuse, rounding,
                                                         analysis.boundary_bytes))


def _has_symbolic_sizes(gm: fx.GraphModule) -> bool:
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if isinstance(val, torch.SymInt) or (
                isinstance(val, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in val.shape)):
            return True
    return False


def predicted_inference_peak(graph: fx.GraphModule, rounding: AllocatorRounding = EXACT) -> int:
    """Peak bytes of an inference graph (AOTAutograd's, one phase, every output the user's), in
    graph order with every value a buffer: an upper bound of what Inductor's fused kernels hold."""
    outputs = graph.graph.find_nodes(op="output")[0].args[0]
    return analyze_liveness(graph, None, len(outputs), rounding=rounding).peak_bytes


# Seconds the checks of the planning under way have taken (Plan.check_s); None outside one.
_CHECK_S: contextvars.ContextVar[list[float] | None] = contextvars.ContextVar("memcompile_check_s", default=None)


def predicted_liveness(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int,
                       inductor: tp.InductorRules | None, rounding: AllocatorRounding = EXACT,
                       boundary_bytes: int = 0) -> LivenessTimeline:
    """_predicted_liveness, its time added to the current planning's check time; with
    `boundary_bytes` held by eager code as the backward starts (Options.boundary_bytes)."""
    began = time.perf_counter()
    try:
        memo = check_memo.current()
        key = None if memo is None else check_memo.graphs_key(
            (fw, bw), tp.RECOMPUTED, (num_fwd_outputs, inductor.text() if inductor else None, repr(rounding),
                                      torch.get_num_threads(), tp.inductor_config_text()))
        timeline = memo.get(key) if memo is not None else None
        if timeline is None:
            timeline = _predicted_liveness(fw, bw, num_fwd_outputs, inductor, rounding)
            if memo is not None:
                memo.put(key, timeline)
            log.debug("memcompile: checked a plan%s: peak %s in %.1f s", " on Inductor's schedule" if inductor else "",
                      format_bytes(timeline.peak_bytes), time.perf_counter() - began)
        return with_held_at_backward_start(timeline, boundary_bytes)
    finally:
        spent = _CHECK_S.get()
        if spent is not None:
            spent[0] += time.perf_counter() - began


def _predicted_liveness(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int,
                        inductor: tp.InductorRules | None, rounding: AllocatorRounding = EXACT) -> LivenessTimeline:
    """The liveness of the graphs as they will run. With `inductor`, the rules Inductor compiles
    them under (_checks_schedule): of copies
    after Inductor's post-grad passes (they move ops: `mm + add` becomes one addmm at the add,
    holding the mm's inputs until then), over the kernels Inductor's scheduler makes of them, in
    its order (fusing nodes far apart runs them early; a fused kernel's results coexist); if
    scheduling fails, the larger of graph order with fusion modelled (passes/fusion.py) and every
    FX node a buffer; if the post-grad passes fail, or without Inductor, the latter. Each
    allocation holds what `rounding` says its block holds (cost_models/cuda_allocator.py)."""
    unfused = analyze_liveness(fw, bw, num_fwd_outputs, rounding=rounding)
    if not inductor:
        return unfused
    try:
        fw_seen, bw_seen = tp.inductor_post_grad_copy(fw), tp.inductor_post_grad_copy(bw)
    except UNREADABLE_GRAPH_ERRORS as error:  # the prediction must not fail the compile
        log.warning("memcompile: Inductor's post-grad passes failed on a copy of the graphs (%s: %s); "
                    "predicting without fusion", type(error).__name__, error)
        return unfused
    # The backward's placeholders keep the names the post-grad passes may change in the forward.
    saved_names = tuple(a.name if isinstance(a, fx.Node) else None
                        for a in fw.graph.find_nodes(op="output")[0].args[0])
    if _has_symbolic_sizes(fw) or _has_symbolic_sizes(bw):
        # Dynamic shapes: Inductor's lowering needs Dynamo's ShapeEnv; lowered in a fork of it,
        # the schedule's prediction for a larger planned size was under the measured peak
        # (attention stack at 32 after tracing at 8: 139,400 B predicted, 143,368 measured), so
        # graph order (an upper bound: 156,680 there) is used until that is understood.
        log.debug("memcompile: symbolic sizes: predicting in graph order, not over Inductor's schedule")
    else:
        try:
            schedules = (tp.inductor_schedule(fw_seen, is_backward=False, rules=inductor),
                         tp.inductor_schedule(bw_seen, is_backward=True, rules=inductor))
            return analyze_scheduled_liveness(fw_seen, bw_seen, num_fwd_outputs, *schedules, saved_names=saved_names,
                                              rounding=rounding, adjacent_reuse=inductor.adjacent_reuse_applies)
        except UNREADABLE_GRAPH_ERRORS as error:  # the prediction must not fail the compile
            log.warning("memcompile: scheduling a copy of the graphs with Inductor failed (%s: %s); "
                        "predicting in graph order", type(error).__name__, error)
    # Graph order misses what Inductor's schedule moves: the larger of both counts.
    fused = analyze_liveness(fw_seen, bw_seen, num_fwd_outputs, fuse_pointwise=True, saved_names=saved_names,
                             rounding=rounding)
    return fused if fused.peak_bytes > unfused.peak_bytes else unfused


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
            reason = "" if problem.can_keep[i] else analysis.cannot_keep_reason[i]
        else:
            reason = analysis.cannot_recompute_reason[i]
        if i in solution.keep and analysis.not_stored_reason and analysis.not_stored_reason[i]:
            reason = "; ".join(r for r in (reason, analysis.not_stored_reason[i]) if r)
        if i in stored:
            choice = problem.choices_of(i)[stored[i]]
            kind, fmt, held, cost = choice.kind, choice.format, choice.stored_bytes, choice.time_cost_s
        elif recomputed:
            kind, fmt, held, cost = Choice.RECOMPUTE, "", 0, problem.recompute_cost_s[i]
        else:
            kind, fmt, held, cost = Choice.KEEP, "", problem.nbytes[i], 0.0
        trace = node.meta.get("stack_trace") or ""
        rows.append(Decision(
            name=node.name,
            op=str(getattr(node.target, "__name__", node.target)),
            shape=tuple(size_value(s) for s in getattr(val, "shape", ())),  # int() would specialise a SymInt
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


def _analyse(joint: fx.GraphModule, num_fwd_outputs: int, static_lifetime_input_indices, options: Options,
             device: str) -> tuple[JointAnalysis, object]:
    """The joint graph's plain problem (and the device profile it was costed with)."""
    profile = cost_profile(options, device)
    store = _store_options(options, device)
    model_fusion = _checks_schedule(options)
    analysis = analyze_joint_graph(joint, num_fwd_outputs, list(static_lifetime_input_indices or []), profile, store,
                                   fuse=model_fusion is not None)
    if model_fusion is not None and options.experiments.recompute_fusion:
        analysis = with_fused_recomputations(joint, analysis, num_fwd_outputs)
    if options.experiments.repeated_blocks:
        analysis = with_repeated_blocks(analysis)
    if options.boundary_bytes:
        analysis = dataclasses.replace(analysis, boundary_bytes=options.boundary_bytes,
                                       problem=with_fixed_bytes_at(analysis.problem, len(analysis.forward_nodes),
                                                                   options.boundary_bytes))
    return analysis, profile


def _stock_candidates(options: Options, device: str) -> bool:
    # PyTorch's own partitions are candidates unless offload is allowed (on a device with its own
    # memory, copies overlapped with compute may cost less than any recomputation; not measured
    # yet). With lossy formats allowed they still come first: where one fits, it loses no
    # precision and was faster than the solver's plans (Llama small at 13.53 MiB with int8
    # allowed: 1.28x the step, with nothing quantized, where the 0.4 partition ran at 1.15x).
    return (_runs_under_inductor(options) and options.experiments.stock_candidates
            and not _store_options(options, device).offload)


def _new_replanner(joint, joint_inputs, analysis: JointAnalysis, profile, num_fwd_outputs: int,
                   static_lifetime_input_indices, options: Options, device: str,
                   plain: "_Attempt | None" = None, stock: "StockPartitions | None" = None) -> "Replanner":
    """`plain`: PyTorch's default partition if already made (its graphs are the 1.0 candidate's);
    `stock`: PyTorch's partitions if already made (else made here)."""
    problem = analysis.problem
    fuse = _checks_schedule(options)
    keep_all = close_decisions(problem, prefer_recompute=set())
    model_peak, _ = evaluate(problem, *keep_all)
    baseline = _rewrite_and_check(
        joint, analysis, ActivationSolution(*keep_all, model_peak, 0.0, StatusKind.FITS, 0.0, 0.0), num_fwd_outputs,
        fuse=fuse, rounding=options.allocator_rounding,
    )
    if stock is None:
        stock = _stock_partitions(joint, joint_inputs, analysis, profile, num_fwd_outputs,
                                  static_lifetime_input_indices, options, device, plain)
    return Replanner(joint, _calibrated_to(analysis, baseline), num_fwd_outputs, options, baseline, problem,
                     stock=stock)


def _stock_partitions(joint, joint_inputs, analysis: JointAnalysis, profile, num_fwd_outputs: int,
                      static_lifetime_input_indices, options: Options, device: str,
                      plain: "_Attempt | None" = None) -> "StockPartitions | None":
    """PyTorch's partitions of the joint graph where they are candidates (_stock_candidates)."""
    if not _stock_candidates(options, device):
        return None
    stock = StockPartitions(joint, joint_inputs, num_fwd_outputs, static_lifetime_input_indices, profile,
                            {n.name for n in analysis.forward_nodes}, options.allocator_rounding,
                            _headroom_bytes(options.step_budget_bytes, joint_inputs),
                            boundary_bytes=options.boundary_bytes, rules=_checks_schedule(options))
    if plain is not None:
        # its graph-order count (scatters in place) where it was counted over the budget unchecked
        over_on_count = not plain.checked and plain.timeline.peak_bytes > options.step_budget_bytes
        stock.seed(1.0, plain.forward, plain.backward, plain.timeline if over_on_count else None)
    return stock


def planning_environment(device: str) -> str:
    """Everything besides the graph and the options that planning reads (a stored plan's key)."""
    # the rules' constants (the experiments among the rules are in the options)
    return (f"{torch.__version__} {source_hash()} {plan_store.machine_text(device)} "
            f"{tp.PLANNED_RULES.text()} {tp.inductor_config_text()}")


def _plan_joint_graph(
    joint: fx.GraphModule,
    joint_inputs,
    *,
    num_fwd_outputs: int,
    static_lifetime_input_indices: list[int] | None,
    options: Options,
    graph_id: str,
    request: "PlanRequest | None" = None,
) -> tuple[fx.GraphModule, fx.GraphModule, Plan]:
    """The plan of one joint graph: read from the plan store where an earlier launch made it for
    the same graph, options and machine (memcompile/plan_store.py), else searched and stored."""
    joint = accumulate_tied_embedding_gradients(tp.prepare_joint_graph(joint))
    device = options.device or step_device(joint_inputs)
    key = None
    if options.plan_store_dir and (request is None or request.decisions is None):
        flags = "-" if request is None else (f"least_peak={request.least_peak} search={request.search_least_peak}"
                                             + (" partitions_only" if request.partitions_only else "")
                                             # asked, not the estimate: a measured profile moves it
                                             # between launches, and the key must not
                                             + (" rewrite_first" if request.rewrite_first_s is not None else ""))
        key = plan_store.outcome_key(
            joint, num_fwd_outputs=num_fwd_outputs, static_lifetime_input_indices=static_lifetime_input_indices,
            options_text=options.describe(), request_text=flags,
            environment_text=planning_environment(device))
    if key is not None:
        stored = plan_store.load(options.plan_store_dir, key)
        if stored is not None:
            replayed = _replay(stored, joint, joint_inputs, num_fwd_outputs, static_lifetime_input_indices, options,
                               graph_id, request, device)
            if replayed is not None:
                return replayed
    if request is not None and request.planned is not None:
        planned = request.planned
        replayed = _replay(planned.as_stored(), joint, joint_inputs, num_fwd_outputs, static_lifetime_input_indices,
                           options, graph_id, request, device, from_store=False)
        if replayed is not None:
            if planned.deferred is not None:
                request.deferred = dataclasses.replace(planned.deferred, store=None if key is None else (
                    options.plan_store_dir, key, replayed[2], planned.solution, planned.candidate_names))
            elif key is not None:
                plan_store.save(options.plan_store_dir, key, dataclasses.replace(planned.as_stored(), plan=replayed[2]))
            return replayed
        log.debug("memcompile: %s: the estimate's plan does not apply to this trace; planning it again", graph_id)
    asked = request if request is not None else PlanRequest()  # the same asks as none
    try:
        fw, bw, plan = _search(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs,
                               static_lifetime_input_indices=static_lifetime_input_indices, options=options,
                               graph_id=graph_id, request=asked, device=device)
    except InfeasibleBudgetError as error:
        if key is not None:
            plan_store.save(options.plan_store_dir, key, plan_store.StoredOutcome(
                plan_store.Outcome.INFEASIBLE, error_message=str(error), min_feasible_bytes=error.min_feasible_bytes,
                contributors=tuple(error.contributors)))
        raise
    except NoSolverPlanFits as no_fit:
        if key is not None:
            plan_store.save(options.plan_store_dir, key,
                            plan_store.StoredOutcome(plan_store.Outcome.NO_FIT, min_feasible_bytes=no_fit.floor_at_least))
        raise
    solution, replanner = asked.solution, asked.replanner
    names: tuple[str, ...] = ()
    if isinstance(solution, ActivationSolution):
        made = replanner.made if isinstance(replanner, DeferredReplanner) else replanner
        names = tuple(made.analysis.problem.names) if made is not None else ()
    if isinstance(solution, StockSolution) or names:
        asked.made = PlannedGraph(plan, solution, names, asked.deferred)
    if key is None:
        return fw, bw, plan
    if asked.deferred is not None:
        # stored once the compile's schedule has checked it (confirm_on_compile)
        asked.deferred = dataclasses.replace(asked.deferred, store=(options.plan_store_dir, key, plan, solution, names))
    else:
        if isinstance(solution, StockSolution) or names:
            plan_store.save(options.plan_store_dir, key, plan_store.StoredOutcome(
                plan_store.Outcome.PLAN, plan=plan, solution=solution, candidate_names=names))
    return fw, bw, plan


def _replay(stored: "plan_store.StoredOutcome", joint, joint_inputs, num_fwd_outputs: int,
            static_lifetime_input_indices, options: Options, graph_id: str, request: "PlanRequest | None",
            device: str, from_store: bool = True) -> tuple[fx.GraphModule, fx.GraphModule, Plan] | None:
    """A stored outcome, as it happened the first time; None if it no longer applies (then plan).
    Not `from_store`: a plan this launch made (PlanRequest.planned), its search time its own."""
    def replanner() -> Replanner:
        analysis, profile = _analyse(joint, num_fwd_outputs, static_lifetime_input_indices, options, device)
        return _new_replanner(joint, joint_inputs, analysis, profile, num_fwd_outputs,
                              static_lifetime_input_indices, options, device)

    if request is not None:
        request.replanner = DeferredReplanner(replanner)
    if stored.kind == plan_store.Outcome.INFEASIBLE:
        raise InfeasibleBudgetError(stored.error_message, budget_bytes=options.budget_bytes,
                                    min_feasible_bytes=stored.min_feasible_bytes, contributors=stored.contributors)
    if stored.kind == plan_store.Outcome.NO_FIT:
        raise NoSolverPlanFits(options.step_budget_bytes, stored.min_feasible_bytes)
    solution = stored.solution
    if isinstance(solution, StockSolution):
        fw, bw = tp.stock_partition(copy.deepcopy(joint), joint_inputs, memory_budget=solution.fraction,
                                    num_fwd_outputs=num_fwd_outputs,
                                    static_lifetime_input_indices=static_lifetime_input_indices)
    elif isinstance(solution, ActivationSolution):
        analysis, _ = _analyse(joint, num_fwd_outputs, static_lifetime_input_indices, options, device)
        if tuple(analysis.problem.names) != stored.candidate_names:
            return None
        fw, bw = apply_plan(joint, analysis, solution.keep, solution.recompute, num_fwd_outputs, solution.stored)
    else:
        return None
    if request is not None:
        request.solution = solution
    if not from_store:
        logs.stage(f"{graph_id}: the plan chosen on its estimate, compiled without searching again")
        return fw, bw, dataclasses.replace(stored.plan, graph_id=graph_id)
    logs.stage(f"{graph_id}: the plan an earlier launch made for this graph, read from the plan store")
    return fw, bw, plan_store.as_loaded(stored.plan, graph_id)


def _search(
    joint: fx.GraphModule,
    joint_inputs,
    *,
    num_fwd_outputs: int,
    static_lifetime_input_indices: list[int] | None,
    options: Options,
    graph_id: str,
    request: "PlanRequest",
    device: str,
) -> tuple[fx.GraphModule, fx.GraphModule, Plan]:
    check_s = _CHECK_S.get() or [0.0]
    profile = cost_profile(options, device)
    analysed: list[JointAnalysis] = []

    def analysis_now() -> JointAnalysis:
        # The joint graph's plain problem, made where a candidate besides PyTorch's default
        # partition is asked for: where that partition is the plan, nothing reads it.
        if not analysed:
            logs.stage(f"{graph_id}: analysing the joint graph")
            analysed.append(_analyse(joint, num_fwd_outputs, static_lifetime_input_indices, options, device)[0])
        return analysed[0]

    budget = options.step_budget_bytes
    fuse = _runs_under_inductor(options)
    stock_candidates = _stock_candidates(options, device)

    made_plain: list[_Attempt] = []  # plain Inductor's partition once made: the 1.0 candidate's graphs
    made_stock: list[StockPartitions | None] = []  # PyTorch's partitions, once asked for

    def stock_now() -> StockPartitions | None:
        if not made_stock:
            made_stock.append(_stock_partitions(joint, joint_inputs, analysis_now(), profile, num_fwd_outputs,
                                                static_lifetime_input_indices, options, device,
                                                made_plain[0] if made_plain else None))
        return made_stock[0]

    def make_replanner() -> Replanner:
        return _new_replanner(joint, joint_inputs, analysis_now(), profile, num_fwd_outputs, static_lifetime_input_indices,
                              options, device, made_plain[0] if made_plain else None, stock_now())

    plain, plain_over = None, False  # plain_over: PyTorch's default partition checked over the budget
    partition_on_count: _Attempt | None = None  # another partition within the budget on its count
    partition_checked: _Attempt | None = None  # else one that its check puts within the budget
    beyond_plans = 0  # bytes no plan of this graph lowers (0: not known)
    # The rewrite the ladder tries next costs less than any plan of this graph could save
    # (STOCK_SOLVE_ABOVE): where PyTorch's default partition is over the budget, its graph is
    # planned first (below), and "over" is taken from the graph-order count without lowering a
    # copy: if that count is wrong, the rewrite costs no more than noise.
    rewrite_is_cheap = (request.rewrite_first_s is not None and not request.least_peak
                        and request.decisions is None and not request.search_least_peak
                        and request.rewrite_first_s <= STOCK_SOLVE_ABOVE * estimated_step_s(joint, profile))
    if stock_candidates and request.decisions is None and not request.least_peak and not request.partitions_only:
        # Where plain Inductor's own partition fits under its own rules, it is the plan: the
        # fastest we measured at that memory, found with one check instead of three (keep-all,
        # the partition under memcompile's rules, then under Inductor's), each a lowering and
        # schedule of the whole graph (70 of GPT-2 124M's 400 s first call, each, on a busy core).
        logs.stage(f"{graph_id}: checking plain Inductor's partition")
        plain = _plain_inductor_partition(joint, joint_inputs, num_fwd_outputs, static_lifetime_input_indices,
                                          options.allocator_rounding, options.boundary_bytes,
                                          budget if request.defer_check else None,
                                          unchecked_if_over=request.defer_check,
                                          rules=_checks_schedule(options))
        made_plain.extend([plain] if plain is not None else [])
        if (plain is not None and not plain.checked and plain.timeline.peak_bytes > budget and not rewrite_is_cheap
                and plain.timeline.held_by_every_plan() <= budget):
            # Over the budget on its count: another of PyTorch's partitions within the budget on
            # its own count, at a cost within noise of the step, is taken without lowering either;
            # only where there is none are the partitions checked (a lowering each).
            logs.stage(f"{graph_id}: counting PyTorch's partitions")
            stock = stock_now()
            partition_on_count = stock.within_on_graph_order(budget) if stock is not None else None
            if partition_on_count is None and stock is not None:
                # None within the budget on its count: checked from the least count (the default
                # partition first where its count is near the budget); each check a lowering.
                # Below the floor (GPT style file, 12 layers, 4 x 512) the default partition's
                # check was one lowering per graph of the ladder for nothing.
                logs.stage(f"{graph_id}: checking PyTorch's partitions")
                fitted = stock.fitting(budget, counted_first=True)
                default = stock.checked_as_plain_inductor()
                if default is not None:
                    # checked as plain Inductor compiles it: the plan where it fits, and where
                    # it is over, the liveness before planning (not its count)
                    plain = dataclasses.replace(plain, timeline=default.timeline, checked=True)
                    made_plain[:] = [plain]
                if fitted is not None and fitted.solution.added_time_s <= STOCK_SOLVE_ABOVE * stock.step_time_s():
                    partition_checked = fitted
        if plain is not None and plain.timeline.peak_bytes > budget:
            beyond_plans = plain.timeline.held_by_every_plan()
            plain, plain_over = None, True
    floor_at_least = beyond_plans + options.reserve_bytes if beyond_plans else 0  # (NoSolverPlanFits)
    if plain_over and rewrite_is_cheap:
        # PyTorch's default partition is over the budget, and the rewrite the ladder tries next
        # costs less than any plan could save (STOCK_SOLVE_ABOVE): its graph is planned first.
        # A search of this one would take a keep-all check, PyTorch's partitions and the solver,
        # a lowering each, for a plan at best within noise of the rewritten graph's.
        logs.stage(f"{graph_id}: PyTorch's partition is over the budget; the cheaper rewrite is planned first")
        raise NoSolverPlanFits(budget, floor_at_least, rewrite_first=True)
    if beyond_plans > budget and not request.least_peak:
        # Parameters, inputs, gradients and returned outputs alone are over the budget: no plan
        # of this graph fits, so no other candidate is made or checked.
        logs.stage(f"{graph_id}: no plan of this graph fits: its parameters, inputs, gradients and outputs "
                   f"hold {format_bytes(beyond_plans)}")
        if not request.search_least_peak:
            raise NoSolverPlanFits(budget, floor_at_least)
    replanner = DeferredReplanner(make_replanner)  # made where a candidate besides plain's is asked for
    chosen = plain
    solve_s = 0.0
    request.replanner = replanner
    if request.decisions is not None and not request.least_peak and request.fingerprint == replanner.fingerprint:
        forced = replanner.attempt_for(request.decisions)
        if forced is not None and forced.timeline.peak_bytes <= budget:
            chosen = forced
    fitting = chosen is None and not (request.least_peak or request.partitions_only) and beyond_plans <= budget
    if fitting and partition_on_count is not None:
        chosen = partition_on_count  # the compile's schedule checks it
    if fitting and partition_checked is not None:
        chosen = partition_checked
    if fitting and chosen is None:
        logs.stage(f"{graph_id}: finding the fastest plan within {format_bytes(budget)}")
        chosen, solve_s = replanner.fit(budget, options.time_limit_s, defer=request.defer_check)
    if chosen is None and not (request.search_least_peak or request.least_peak):
        partitions_least = made_stock[0].least_peak_at_least() if made_stock and made_stock[0] is not None else 0
        raise NoSolverPlanFits(budget, max(floor_at_least, partitions_least + options.reserve_bytes
                                           if partitions_least else 0))
    if chosen is None and request.partitions_only and stock_candidates and request.decisions is None:
        # A graph of the ladder before the one the solver searched: the least peak of PyTorch's
        # partitions, taken as its smallest fraction's (one lowering; on the GPT style file its
        # default partition's peaked as high or higher on every rung), the default partition's
        # where that one cannot be made.
        logs.stage(f"{graph_id}: the least peak of PyTorch's partitions")
        chosen = _stock_partitions(joint, joint_inputs, analysis_now(), profile, num_fwd_outputs,
                                   static_lifetime_input_indices, options, device).at(STOCK_FRACTIONS[-1])
        if chosen is None:
            chosen = _plain_inductor_partition(joint, joint_inputs, num_fwd_outputs, static_lifetime_input_indices,
                                               options.allocator_rounding, options.boundary_bytes,
                                               rules=_checks_schedule(options))
            made_plain.extend([chosen] if chosen is not None else [])
        if chosen is not None and chosen.timeline.peak_bytes > budget:
            raise _infeasible(options, chosen, analysis_now())
    if chosen is None:
        # The least-peak plan is deterministic, so the min_feasible_bytes we report is met by
        # the same plan when the user compiles again at exactly that budget.
        logs.stage(f"{graph_id}: searching the least-peak plan")
        # Where a budget is asked for (not the least peak for its own sake), the search ends at the
        # first plan within it: the descent's further checks (a lowering each) only lower a peak
        # that already fits. Below the floor it runs whole, so the floor it names is exact.
        within = None if request.least_peak else budget
        chosen, min_peak_s = replanner.least_peak_and_solve_s(within=within)
        solve_s += min_peak_s
        if chosen.timeline.peak_bytes > budget:
            raise _infeasible(options, chosen, analysis_now())
    if plain is None and replanner.made is None and made_plain:
        before = made_plain[0].timeline  # (a count: no keep-all check was made)
    else:
        before = plain.timeline if plain is not None else replanner.keep_all.timeline
    # the calibrated model the solver's decisions were made on
    analysis = replanner.analysis if plain is None and isinstance(chosen.solution, ActivationSolution) else None

    # a partition chosen on a count above every schedule fits under Inductor's own rules too
    chosen_on_count = chosen is plain or (isinstance(chosen.solution, StockSolution) and not chosen.checked)
    chosen, stock_rules = _under_stock_rules_where_it_fits(chosen, chosen_on_count or chosen.stock_rules, fuse,
                                                           num_fwd_outputs, options)
    request.solution = chosen.solution
    request.deferred = None if chosen.checked else DeferredCheck(
        num_fwd_outputs, options.allocator_rounding, options.boundary_bytes, budget,
        adjacent_reuse=inductor_rules_for(options).adjacent_reuse,
        is_default_partition=isinstance(chosen.solution, StockSolution) and chosen.solution.fraction >= 1.0)
    decisions = (chosen.solution.rows if isinstance(chosen.solution, StockSolution)
                 else _decisions(analysis or analysis_now(), chosen.solution))
    plan = _plan_record(graph_id, options, chosen, before, decisions, solve_s, stock_rules, check_s[0])
    log.debug("%s", plan.summary())
    return chosen.forward, chosen.backward, plan


def _under_stock_rules_where_it_fits(chosen: _Attempt, stock_rules: bool, fuse: bool, num_fwd_outputs: int,
                                     options: Options) -> tuple[_Attempt, bool]:
    """PyTorch's partition under memcompile's Inductor rules is not PyTorch's compile: BERT
    small at the 0.8 partition's peak, 1.019x [1.007-1.030] the step where PyTorch's ran 0.997x
    (`benchmarks/decisive_points.py`, bert: --variants amb:0.8,mc:16104072, the results'
    decisive_bert_small_asfast). Where it fits under Inductor's own rules, it runs under them:
    (the attempt checked so, True); else as it was."""
    if not isinstance(chosen.solution, StockSolution) or not fuse or stock_rules:
        return chosen, stock_rules
    as_stock = predicted_liveness(chosen.forward, chosen.backward, num_fwd_outputs,
                                  _stock_rules(_checks_schedule(options)), options.allocator_rounding,
                                  options.boundary_bytes)
    if as_stock.peak_bytes <= options.step_budget_bytes:
        return dataclasses.replace(chosen, timeline=as_stock), True
    return chosen, stock_rules


def _plan_record(graph_id: str, options: Options, chosen: _Attempt, before: LivenessTimeline,
                 decisions: tuple[Decision, ...], solve_s: float, stock_rules: bool, check_s: float) -> Plan:
    """The plan a graph runs with, as the user reads it (memcompile.dump)."""
    sol, after = chosen.solution, chosen.timeline
    return Plan(
        graph_id=graph_id,
        budget_bytes=options.budget_bytes,
        reserve_bytes=options.reserve_bytes,
        library_workspace_bytes=options.library_workspace_bytes,
        compile_scratch_bytes=options.compile_scratch_bytes,
        predicted_peak_before_bytes=before.peak_bytes,
        predicted_peak_bytes=after.peak_bytes,
        peak_phase=after.peak_step.phase,
        peak_node=after.peak_step.node,
        peak_breakdown=after.peak_breakdown,
        decisions=decisions,
        added_time_s=sol.added_time_s,
        solver_status=sol.status,
        solve_s=solve_s,
        gap=sol.gap,
        live_bytes_before=tuple(s.live_bytes for s in before.steps),
        live_bytes_after=tuple(s.live_bytes for s in after.steps),
        stock_inductor_rules=stock_rules,
        budget_source=options.budget_source,
        optimizer_reserve_bytes=options.optimizer_reserve_bytes,
        optimizer_source=options.optimizer_source,
        check_s=check_s,
        live_categories_after=after.category_series(),
        peak_tensors=after.peak_tensors,
        backward_from_step=after.backward_start(),
        eager_at_backward_start_bytes=options.boundary_bytes,
        eager_outside_bytes=options.eager_outside_bytes,
        eager_where=options.eager_where,
    )


# PyTorch's own min-cut partition, at these activation_memory_budget fractions, is a candidate
# plan: the largest fraction whose partition the check puts within the budget is used instead of
# solving. Measured side by side (benchmarks/results/pareto_small*.md, quiet machine), at the peak
# of each of these partitions our plans were slower on GPT-2, Llama and BERT (e.g. GPT-2 at
# 15.03 MiB: Inductor at 0.8 added 3.8% to the step, our plan 11-14%) while our cost model
# predicted them cheap: what Inductor fuses into the backward kernels when the partitioner
# recomputes is cheaper than the same recomputation in our rewrite, and the model does not see
# that. Below the smallest of these peaks the solver plans as before. The partitions are options
# of the Replanner like the solver's plans, so re-plans (dynamic sizes, the step ledger) and the
# step plan of several regions choose among them too, each checked at the sizes planned for.
# The stock_candidates experiment (Options.experiments) turns this off.
STOCK_FRACTIONS = (1.0, 0.8, 0.6, 0.4)
# A fitting partition is not always cheap: BERT small at 12.08 MiB (in a run of
# `python benchmarks/pareto.py --models bert --size small --threads 1`) took the
# 0.6 partition, estimated at +4.55 ms, measured 1.355x the step, where the solver's plan for
# 10.07 MiB, estimated at 0.81 ms, measured 1.049x. So where a partition's recomputations are
# estimated above STOCK_SOLVE_ABOVE of the step (under it, no plan can save more than noise),
# the solver plans as well, and its plan replaces the partition when estimated STOCK_MARGIN
# times cheaper: our plans measured 1.6-5x their estimates there, PyTorch's 2x.
STOCK_SOLVE_ABOVE = 0.02
STOCK_MARGIN = 4.0


@dataclass(frozen=True)
class StockSolution:
    """A plan that is PyTorch's min-cut partition at one activation_memory_budget fraction (the
    counterpart of ActivationSolution for the backend: `decisions` identifies it)."""

    fraction: float
    added_time_s: float  # its recomputations, estimated, beyond those of the partition at 1.0
    held_bytes: int  # what it saves from forward to backward (views hold none)
    rows: tuple[Decision, ...]  # what it saves, as the plan lists it
    gap: float = 0.0

    @property
    def decisions(self) -> tuple[str, float]:
        return ("stock_partition", self.fraction)

    @property
    def status(self) -> str:
        return status_text(StatusKind.STOCK_PARTITION, f"activation_memory_budget={self.fraction}")


def knapsack_scratch_bytes(fraction: float) -> int:
    """What PyTorch's linear-memory knapsack allocates as tensors at `activation_memory_budget=
    fraction`, at most: a few float rows of one column per 1/10,000 of the activations' memory
    (measured: 4 rows and a flip of 16,004 B at 0.4); none at 1.0, which runs no knapsack."""
    return 0 if fraction >= 1.0 else 6 * 4 * (round(fraction * 10_000) + 1)


def _headroom_bytes(budget: int, joint_inputs: object) -> int | None:
    """The step budget less the primal inputs' bytes (live while the graph is planned at its first
    call); None where sizes are symbolic."""
    primals = joint_inputs[0] if isinstance(joint_inputs, (list, tuple)) and joint_inputs else ()
    tensors = [a for a in primals if isinstance(a, torch.Tensor)]
    counts = [a.numel() for a in tensors]
    if any(isinstance(n, torch.SymInt) for n in counts):
        return None  # reading symbolic sizes as ints would guard on them
    return budget - sum(n * a.element_size() for n, a in zip(counts, tensors))


@dataclass
class StockPartitions:
    """PyTorch's partitions of one joint graph, each made and checked once (at the sizes planned for)."""

    joint: fx.GraphModule
    joint_inputs: object
    num_fwd_outputs: int
    static_lifetime_input_indices: list[int] | None
    profile: object
    forward_names: set[str]  # forward ops found in the backward are recomputations
    rounding: AllocatorRounding = EXACT  # what each allocation holds on the step's device
    headroom_bytes: int | None = None  # what the step budget leaves beside the graph's inputs now
    boundary_bytes: int = 0  # held by eager code as the backward starts (Options.boundary_bytes)
    rules: tp.InductorRules | None = tp.PLANNED_RULES  # the schedule check's (_checks_schedule)
    _made: dict = dataclasses.field(default_factory=dict, repr=False)
    _partitions: dict = dataclasses.field(default_factory=dict, repr=False)
    _counts: dict = dataclasses.field(default_factory=dict, repr=False)
    _held_at_forward_end: dict = dataclasses.field(default_factory=dict, repr=False)  # (_over_without_check)
    _ruled_out: set = dataclasses.field(default_factory=set, repr=False)  # fractions _over_without_check spared
    _fitted: dict = dataclasses.field(default_factory=dict, repr=False)  # fitting's answer per (budget, fractions)
    _made_as_stock: dict = dataclasses.field(default_factory=dict, repr=False)  # checked under Inductor's own rules
    _step_time_s: float | None = dataclasses.field(default=None, repr=False)

    def at(self, fraction: float) -> _Attempt | None:
        """The checked partition at `fraction`; None if it could not be made or checked. Its
        added time counts from plain Inductor (the partition at 1.0, which recomputes some
        pointwise ops too), as the solver's plans count from keep-all, which was no faster."""
        attempt = self._made_at(fraction)
        return self.added_from_default(attempt) if attempt is not None else None

    def added_from_default(self, attempt: _Attempt) -> _Attempt:
        """`attempt` (its added time all its recomputations) with its added time counted from the
        default partition's."""
        base = self._partition(1.0)
        recomputed_s = attempt.solution.added_time_s
        added = max(0.0, recomputed_s - base[2]) if base is not None else recomputed_s
        return dataclasses.replace(attempt, solution=dataclasses.replace(attempt.solution, added_time_s=added))

    def _made_at(self, fraction: float) -> _Attempt | None:
        """The checked partition, its added time all its recomputations (not yet from 1.0)."""
        if fraction not in self._made:
            self._made[fraction] = self._make(fraction)
        return self._made[fraction]

    def _partition(self, fraction: float) -> tuple[fx.GraphModule, fx.GraphModule, float] | None:
        """(forward, backward, its recomputations' estimated time), made once; None where PyTorch's
        partitioner cannot make it here or it is not a candidate."""
        if fraction not in self._partitions:
            self._partitions[fraction] = self._make_partition(fraction)
        return self._partitions[fraction]

    def seed(self, fraction: float, forward: fx.GraphModule, backward: fx.GraphModule,
             count: LivenessTimeline | None = None) -> None:
        """The partition at `fraction` made elsewhere (plain Inductor's, at 1.0), and its graph-order
        count where that was made too (_count_at's): not made again."""
        if fraction not in self._partitions:
            self._partitions[fraction] = self._screened(fraction, forward, backward)
        if count is not None and self._partitions[fraction] is not None and fraction not in self._counts:
            self._counts[fraction] = count.peak_bytes
            self._held_at_forward_end[fraction] = count.held_as_forward_ends()

    def _make_partition(self, fraction: float) -> tuple[fx.GraphModule, fx.GraphModule, float] | None:
        scratch = knapsack_scratch_bytes(fraction)
        if self.headroom_bytes is not None and self.headroom_bytes < scratch:
            # PyTorch's knapsack allocates its rows as tensors while the step's inputs are live
            log.debug("memcompile: no stock partition at %s: %s of headroom, its knapsack needs %s", fraction,
                      format_bytes(self.headroom_bytes), format_bytes(scratch))
            return None
        try:
            fw, bw = tp.stock_partition(copy.deepcopy(self.joint), self.joint_inputs, memory_budget=fraction,
                                        num_fwd_outputs=self.num_fwd_outputs,
                                        static_lifetime_input_indices=self.static_lifetime_input_indices)
        except UNREADABLE_GRAPH_ERRORS as error:  # a candidate only: plan as before
            log.debug("memcompile: the stock partition at %s could not be made (%s: %s)", fraction,
                      type(error).__name__, error)
            return None
        return self._screened(fraction, fw, bw)

    def _screened(self, fraction: float, fw: fx.GraphModule, bw: fx.GraphModule
                  ) -> tuple[fx.GraphModule, fx.GraphModule, float] | None:
        redrawn = [n.name for n in bw.graph.nodes if n.op == "call_function" and n.name in self.forward_names
                   and (is_random_op(n) or tp.is_inductor_random_op(n.target))]
        if redrawn:
            # PyTorch's partitions below 1.0 may draw random ops again in the backward (on the
            # CPU: other dropout masks than the forward's, so other gradients than the seed's)
            log.debug("memcompile: no stock partition at %s: it recomputes random ops %s", fraction, redrawn)
            return None
        # Forward ops the partitioner placed in the backward are its recomputations.
        recomputed_s = sum(estimate_node_time_s(n, self.profile) for n in bw.graph.nodes
                           if n.op == "call_function" and n.name in self.forward_names)
        return fw, bw, recomputed_s

    def _make(self, fraction: float, as_stock: bool = False) -> _Attempt | None:
        """The partition checked under the planned rules, or with `as_stock` under Inductor's own."""
        made = self._partition(fraction)
        if made is None:
            return None
        fw, bw, recomputed_s = made
        try:
            timeline = predicted_liveness(fw, bw, self.num_fwd_outputs, _stock_rules(self.rules) if as_stock
                                          else self.rules, self.rounding, self.boundary_bytes)
        except UNREADABLE_GRAPH_ERRORS as error:  # a candidate only: plan as before
            log.debug("memcompile: the stock partition at %s could not be checked (%s: %s)", fraction,
                     type(error).__name__, error)
            return None
        log.debug("memcompile: stock partition at activation_memory_budget=%s: checked peak %s%s", fraction,
                 format_bytes(timeline.peak_bytes), " under Inductor's own rules" if as_stock else "")
        rows = _stock_decisions(fw, fraction, self.num_fwd_outputs)
        return _Attempt(StockSolution(fraction, recomputed_s, sum(r.held_bytes for r in rows), rows), fw, bw, timeline,
                        stock_rules=as_stock)

    def within_on_graph_order(self, budget: int, fractions: tuple[float, ...] = STOCK_FRACTIONS[1:]
                              ) -> _Attempt | None:
        """The partition at the largest of `fractions` (descending) that the graph-order count puts
        within `budget` (_within_on_graph_order), unchecked (the compile's schedule checks it), if
        its recomputations are within STOCK_SOLVE_ABOVE of the step (no plan of ours could save
        more than noise against it); else None. Partitions are made, not lowered: on the GPT style
        file (12 layers, 4 x 512, chunked loss head) the count was 5% above the 0.8 partition's
        check, and the 0.4 partition checked 21% above the 0.8 one (`fitting`, which lowers the
        smallest first, ruled them all out)."""
        for fraction in fractions:
            made = self._partition(fraction)
            if made is None:
                continue
            fw, bw, _ = made
            try:
                # (with room: the every-value count was 0.3% under the 0.4 partition's check there)
                within, count = _within_on_graph_order(fw, bw, self.num_fwd_outputs, self.rounding,
                                                       self.boundary_bytes, int(budget * (1 - _DEFER_MARGIN)))
            except UNREADABLE_GRAPH_ERRORS as error:  # a candidate only: plan as before
                log.debug("memcompile: the stock partition at %s could not be counted (%s: %s)", fraction,
                          type(error).__name__, error)
                continue
            if not within or count is None:
                continue
            rows = _stock_decisions(fw, fraction, self.num_fwd_outputs)
            attempt = self.added_from_default(_Attempt(StockSolution(fraction, made[2], sum(r.held_bytes for r in rows),
                                                                     rows), fw, bw, count, checked=False))
            if attempt.solution.added_time_s <= STOCK_SOLVE_ABOVE * self.step_time_s():
                log.debug("memcompile: stock partition at activation_memory_budget=%s: graph-order count %s, "
                          "its check left to the compile", fraction, format_bytes(count.peak_bytes))
                return attempt
        return None

    def step_time_s(self) -> float:
        """The joint graph's estimated time: forward and backward, no recomputation."""
        if self._step_time_s is None:
            self._step_time_s = estimated_step_s(self.joint, self.profile)
        return self._step_time_s

    def fitting(self, budget: int, fractions: tuple[float, ...] = STOCK_FRACTIONS,
                counted_first: bool = False) -> _Attempt | None:
        """The partition at the largest of `fractions` (descending) whose checked peak fits, or
        None; found once per budget. Each check is a lowering and schedule of the whole graph
        (GPT-2 124M at 1 x 256 tokens: 5-16 s), so few are made. The smallest fraction is checked
        first; where it fits, the larger ones by bisection. Partition peaks do not fall with the
        fraction, though (GPT style file, 12 layers, 4 x 512, chunked head: 0.8 checked 1.91 GB,
        0.6 2.22 GB, 0.4 2.30 GB): where the smallest is over the budget by at most
        _SMALLEST_CHECK_GAP, the others are made (not lowered) and the one with the least
        graph-order count is checked; where it fits, the larger fractions from the largest down,
        skipping those whose count, scaled as its check scaled its count, is over the budget by
        more than _SCALED_COUNT_SLACK. Far below every partition (tight budgets, below the floor)
        that is one partition made and one check. With `counted_first` (the partitions are made
        and counted already: within_on_graph_order) the least count is checked first, after the
        default partition where its count is within _COUNT_OVER_CHECK of the budget."""
        key = (budget, fractions)
        if key not in self._fitted:
            self._fitted[key] = (self._fitting_by_count(budget, fractions, default_first=True) if counted_first
                                 else self._fitting(budget, fractions))
        return self._fitted[key]

    def _fitting(self, budget: int, fractions: tuple[float, ...]) -> _Attempt | None:
        fits = len(fractions) - 1
        if self._over_without_check(fractions[fits], budget):
            if self._held_at_forward_end[fractions[fits]] > budget * (1 + _SMALLEST_CHECK_GAP):
                return None
            return self._fitting_by_count(budget, fractions[:-1])
        smallest = self._made_at(fractions[fits])
        if smallest is None or smallest.timeline.peak_bytes > budget:
            if smallest is not None and smallest.timeline.peak_bytes > budget * (1 + _SMALLEST_CHECK_GAP):
                return None
            return self._fitting_by_count(budget, fractions[:-1])
        low, high = 0, fits - 1
        while low <= high:
            middle = (low + high) // 2
            made = None if self._over_without_check(fractions[middle], budget) else self._made_at(fractions[middle])
            if made is not None and made.timeline.peak_bytes <= budget:
                fits, high = middle, middle - 1
            else:
                low = middle + 1
        return self.at(fractions[fits])

    def _fitting_by_count(self, budget: int, fractions: tuple[float, ...],
                          default_first: bool = False) -> _Attempt | None:
        counted = [f for f in fractions if self._count_at(f) is not None and not self._over_without_check(f, budget)]
        if not counted:
            return None
        if default_first and counted[0] >= 1.0 and self._count_at(1.0) <= budget * (1 + _COUNT_OVER_CHECK):
            # the default partition, the fastest, where its check may be within the budget: as
            # plain Inductor compiles it, which is then the plan with no second check
            if 1.0 not in self._made_as_stock:
                self._made_as_stock[1.0] = self._make(1.0, as_stock=True)
            default = self._made_as_stock[1.0]
            if default is not None and default.timeline.peak_bytes <= budget:
                return self.added_from_default(default)
        least = min(counted, key=lambda f: (self._count_at(f), -f))
        if least not in self._made and self._count_at(least) > budget * (1 + _COUNT_OVER_CHECK):
            # each count over by more than any count was seen over its check: none is lowered (GPT
            # style file, 12 layers, 4 x 512, head chunked: the 0.4 partition counted 1.55x a budget
            # near the floor and checked 1.0x its count)
            log.debug("memcompile: PyTorch's partitions count at least %s, over %s by more than a count "
                      "exceeds its check: none checked", format_bytes(self._count_at(least)), format_bytes(budget))
            return None
        fitting = self._made_at(least)
        if fitting is None:
            return None
        if fitting.timeline.peak_bytes > budget:
            return self._fitting_after_least_over(budget, counted)
        scale = fitting.timeline.peak_bytes / max(1, self._count_at(least))
        for fraction in counted:
            if fraction <= least:
                break
            if fraction not in self._made and self._count_at(fraction) * scale > budget * (1 + _SCALED_COUNT_SLACK):
                continue  # (one checked already, at this budget or another, costs nothing to look at)
            made = self._made_at(fraction)
            if made is not None and made.timeline.peak_bytes <= budget:
                return self.at(fraction)
        return self.at(least)

    def _fitting_after_least_over(self, budget: int, counted: list[float]) -> _Attempt | None:
        """The least count's partition checked over the budget: a partition's check is not its
        count's order (Llama 24 layers, 2 x 512, head whole: 0.4, the least count, checked 1.05
        GiB where PyTorch's 0.8 measured 1,111,034,120 B), so the others whose estimate
        (_estimated_at_least, from the checks so far) is within the budget are checked too, the
        largest fraction first (the fastest), until one fits."""
        for fraction in counted:
            checked = self._checked_peaks()
            if fraction in checked or self._over_without_check(fraction, budget):
                continue
            estimate = self._estimated_at_least(fraction, checked, make=False)
            if estimate is None or estimate > budget:
                continue
            made = self._made_at(fraction)
            log.debug("memcompile: stock partition at %s estimated at least %d B: checked after the least count's "
                      "was over", fraction, estimate)
            if made is not None and made.timeline.peak_bytes <= budget:
                return self.at(fraction)
        return None

    def checked_as_plain_inductor(self) -> _Attempt | None:
        """The default partition, where it was checked under Inductor's own rules (fitting's
        counted_first); else None."""
        return self._made_as_stock.get(1.0)

    def least_peak_at_least(self) -> int:
        """A peak below which none of these partitions is expected (0: not known): the least of
        the checked peaks and of the others' lower ends (the larger of their estimate,
        _estimated_at_least, and what every schedule of them holds as the forward ends); 0 where
        a partition neither checked nor counted could be lower."""
        checked = self._checked_peaks()
        lows = list(checked.values())
        for fraction in STOCK_FRACTIONS:
            if fraction in checked or self._partitions.get(fraction, 0) is None:
                continue  # checked, or not a candidate here
            low = max(self._estimated_at_least(fraction, checked, make=False) or 0,
                      self._held_at_forward_end.get(fraction, 0))
            if not low:
                return 0
            lows.append(low)
        return min(lows, default=0)

    def least_peak_partition(self, below: int) -> _Attempt | None:
        """The partition with the least checked peak, checking first those not checked yet whose
        estimate (_estimated_at_least) is below `below` and every checked peak; the smallest
        fraction's where none was checked before (None where it cannot be made). A candidate for
        a graph's least peak: on the GPT style file (12 layers, loss head chunked) PyTorch's 0.4
        partition peaked 150 MB below the solver's least-peak plan."""
        checked = self._checked_peaks()
        below = min([below, *checked.values()])
        if not checked and not self._over_without_check(STOCK_FRACTIONS[-1], below - 1):
            self._made_at(STOCK_FRACTIONS[-1])
        for fraction in STOCK_FRACTIONS if checked else ():
            if (fraction in self._made or self._made_as_stock.get(fraction) is not None
                    or self._partitions.get(fraction, 0) is None or self._over_without_check(fraction, below - 1)):
                continue  # (checked as plain Inductor compiles it: a candidate as it is, not lowered again)
            estimate = self._estimated_at_least(fraction, checked, make=True)
            if estimate is not None and estimate < below:
                self._made_at(fraction)
        made = {f: a for f, a in self._made.items() if a is not None}
        for f, a in self._made_as_stock.items():
            if a is not None and (f not in made or a.timeline.peak_bytes < made[f].timeline.peak_bytes):
                made[f] = a  # compiled under Inductor's own rules where chosen (_Attempt.stock_rules)
        if not made:
            return None
        return self.added_from_default(made[min(made, key=lambda f: (made[f].timeline.peak_bytes, -f))])

    def _checked_peaks(self) -> dict[float, int]:
        """Each checked partition's peak (the default partition's: the lower of its checks under
        the planned rules and Inductor's own)."""
        checked = {f: a.timeline.peak_bytes for f, a in self._made.items() if a is not None}
        for f, a in self._made_as_stock.items():
            if a is not None:
                checked[f] = min(checked.get(f, a.timeline.peak_bytes), a.timeline.peak_bytes)
        return checked

    def _estimated_at_least(self, fraction: float, checked: dict[float, int], make: bool) -> int | None:
        """The least `fraction`'s partition is expected to check at: its graph-order count scaled
        as the `checked` ones scaled their own (the least such scale), less
        _PARTITION_ESTIMATE_SLACK; None where no checked one or this one is counted (with `make`,
        this one is made and counted first). A partition ruled out without its check scaled its
        count at least as what it holds as its forward ends does: that scale stands in for the
        check it was spared, so sparing it never raises another's estimate (checks {1.0: 51, 0.8:
        50, 0.6: 51}, counts {1.0: 51, 0.8: 50, 0.6: 25}, budget 50: 0.6's check alone puts 0.8 at
        85, the spared 1.0's at 41)."""
        scales = [peak / self._counts[f] for f, peak in checked.items() if self._counts.get(f)]
        scales += [self._held_at_forward_end[f] / self._counts[f] for f in self._ruled_out
                   if f not in checked and self._counts.get(f)]
        count = self._count_at(fraction) if make else self._counts.get(fraction)
        if not scales or count is None:
            return None
        return int(count * min(scales) / (1 + _PARTITION_ESTIMATE_SLACK))

    def _count_at(self, fraction: float) -> int | None:
        """The partition's peak counted in graph order (every value a buffer but a scatter's copy
        of a dying input), made once; None where the partition is not made or not counted."""
        if fraction not in self._counts:
            made = self._partition(fraction)
            count = None
            if made is not None:
                try:
                    timeline = _graph_order_count(made[0], made[1], self.num_fwd_outputs, self.rounding,
                                                  self.boundary_bytes)
                    count = timeline.peak_bytes
                    self._held_at_forward_end[fraction] = timeline.held_as_forward_ends()
                except UNREADABLE_GRAPH_ERRORS as error:  # a candidate only: plan as before
                    log.debug("memcompile: the stock partition at %s could not be counted (%s: %s)", fraction,
                              type(error).__name__, error)
            self._counts[fraction] = count
        return self._counts[fraction]

    def _over_without_check(self, fraction: float, budget: int) -> bool:
        """Whether the partition is over `budget` on what every schedule of it holds as its forward
        ends (its inputs, saved tensors and outputs: LivenessTimeline.held_as_forward_ends), so
        its check, a lowering, is not needed to rule it out. On the GPT style file (12 layers, 4 x
        512) that held part was within 8 B of each check's forward end, and ruled out 5 of the 17
        checks of a budget near the floor."""
        if fraction in self._made or fraction in self._made_as_stock or self._count_at(fraction) is None:
            return False  # (one checked already is judged on its check)
        held = self._held_at_forward_end.get(fraction, 0)
        if held > budget:
            self._ruled_out.add(fraction)
            log.debug("memcompile: stock partition at activation_memory_budget=%s: its forward ends holding %s, "
                      "over %s: not checked", fraction, format_bytes(held), format_bytes(budget))
            return True
        return False


# A partition larger than a fitting one is checked unless its graph-order count, scaled as the
# fitting one's check scaled its own count, is this far over the budget (partitions' checks were
# 0.95-1.0x their counts on the GPT style file at 4 x 512, 0.6-0.9x on GPT-2/Llama/BERT small).
_SCALED_COUNT_SLACK = 0.05
# Where the smallest fraction's partition checks this far over the budget, no other is made or
# checked: the largest gap seen between it and the lowest partition was 21% (GPT style file, 12
# layers, 4 x 512: 0.4 at 2.30 GB, 0.8 at 1.91 GB); below the floor each is a lowering for nothing.
_SMALLEST_CHECK_GAP = 0.25
# The default partition's graph-order count was up to 43% above its check (GPT-2 and Llama
# small: 24.6 MB counted, 17.2 MB checked): within this of the budget it is checked first.
_COUNT_OVER_CHECK = 0.45
# A partition's check, against its count scaled as another partition's check of the same graph
# scaled its own: 0.83-1.22x (GPT-2, Llama, BERT, ViT small, each graph of their ladders; the GPT
# style file at 6 layers): an estimate this far under is taken as the least it may check at.
_PARTITION_ESTIMATE_SLACK = 0.2


def estimated_step_s(joint: fx.GraphModule, profile) -> float:
    """The joint graph's estimated time: forward and backward, no recomputation."""
    return sum(estimate_node_time_s(n, profile) for n in joint.graph.nodes if n.op == "call_function")


def _stock_decisions(forward: fx.GraphModule, fraction: float, num_fwd_outputs: int) -> tuple[Decision, ...]:
    """What the partition saves for the backward, as "keep" rows: the plan shows it, and the step
    ledger counts these bytes as held by this region between its forward and backward (views
    hold none; parameters and inputs are counted as inputs)."""
    saved = forward.graph.find_nodes(op="output")[0].args[0][num_fwd_outputs:]
    rows, seen = [], set()
    for node in saved:
        if not isinstance(node, fx.Node) or not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        root = node
        while is_aliasing_op(root) and root.args and isinstance(root.args[0], fx.Node):
            root = root.args[0]
        if root.op == "placeholder":
            continue
        val = node.meta["val"]
        held = 0 if root in seen else tensor_nbytes(root.meta.get("val"))  # a view holds its base
        seen.add(root)
        rows.append(Decision(
            name=node.name, op=str(getattr(node.target, "__name__", node.target)),
            shape=tuple(size_value(d) for d in val.shape), dtype=str(val.dtype).replace("torch.", ""),
            nbytes=tensor_nbytes(val), choice=Choice.KEEP, time_cost_s=0.0,
            reason=f"saved by PyTorch's partition (activation_memory_budget={fraction})",
            source=_user_line(node.meta.get("stack_trace") or ""), held_bytes=held,
        ))
    return tuple(rows)


def _model_steps(analysis: JointAnalysis) -> list[tuple[str, str]]:
    """The model's steps as the check names them: (phase, node name), forward then backward."""
    return ([("forward", n.name) for n in analysis.forward_nodes]
            + [("backward", n.name) for n in analysis.backward_nodes])


def _held_across(problem: ActivationProblem, i: int, t: int | None) -> bool:
    """Whether candidate `i`, kept, is held at model step `t` (the step of a check's peak; None
    where the check's peak names no step of the model: then it may be)."""
    return t is None or problem.keep_from[i] <= t and (problem.last_read[i] < 0 or t <= problem.last_read[i])


def _calibrated_to(analysis: JointAnalysis, checked: _Attempt) -> JointAnalysis:
    """The analysis with its model's fixed bytes corrected by the exact check of `checked`
    (passes/calibration.py): the error no decision changes is taken out before solving."""
    problem = analysis.problem
    steps = _model_steps(analysis)
    if len(steps) != problem.num_steps:
        return analysis  # defensive: the model's steps are these nodes; never guess an alignment
    solution = checked.solution
    loads = step_loads(problem, solution.keep, solution.recompute, solution.stored)
    correction = step_corrections(steps, loads, [(s.phase, s.node, s.live_bytes) for s in checked.timeline.steps])
    log.debug("calibration: %d of %d steps named by the check; model over-counted by up to %d B, "
              "under-counted by up to %d B", correction.matched_steps, len(steps),
              correction.largest_overcount, correction.largest_undercount)
    return dataclasses.replace(analysis, problem=calibrated(problem, correction))


class NoSolverPlanFits(Exception):
    """No PyTorch partition or solver plan fits; the least-peak search (which may still find one,
    and otherwise names the smallest budget) was not run, as PlanRequest.search_least_peak asked.
    `floor_at_least`: a budget below which no plan of this graph fits (0: not known), so that a
    ladder need not search this graph's least peak where another graph's is already lower; where
    PyTorch's partitions were checked, the least they are expected at (least_peak_at_least: what
    a ladder's search of a graph before the last one looks for).
    `rewrite_first`: only PyTorch's default partition was tried (PlanRequest.rewrite_first_s)."""

    def __init__(self, budget_bytes: int, floor_at_least: int = 0, rewrite_first: bool = False) -> None:
        super().__init__(budget_bytes)
        self.budget_bytes = budget_bytes
        self.floor_at_least = floor_at_least
        self.rewrite_first = rewrite_first  # not searched: PlanRequest.rewrite_first_s asked for the rewrite first


@dataclass
class PlanRequest:
    """What the backend asks of one planning beyond the budget, and what it gets back."""

    least_peak: bool = False  # plan the least peak even where more would fit (a cautious first step)
    # where no solver plan fits: search the least-peak plan (which may fit, else names the
    # smallest budget), or raise NoSolverPlanFits at once (the backend tries a rewritten graph first)
    search_least_peak: bool = True
    decisions: ActivationSolution | StockSolution | None = None  # run these decisions (an option chosen for the whole step)
    fingerprint: tuple | None = None  # of the problem `decisions` index; ignored if this graph differs
    # PyTorch's default partition may be chosen on a bound, its check left to the compile's own
    # schedule (confirm_on_compile), where the compile that follows builds one (Inductor)
    defer_check: bool = False
    # a graph of the ladder before the one searched, known not to fit: no fit is searched, and its
    # least peak is PyTorch's partition's at its smallest fraction (its default partition's where
    # that cannot be made; the solver's search where neither is a candidate)
    partitions_only: bool = False
    # the estimated added time of the rewrite a ladder tries next (a chunked loss head): where
    # this graph's default partition is over the budget and that is within STOCK_SOLVE_ABOVE of
    # the step, NoSolverPlanFits at once (with search_least_peak False): no plan of this graph can
    # save more than noise against the rewritten one
    rewrite_first_s: float | None = None
    # a plan an earlier planning of the same graph made (one the region weighed before lowering
    # it: backend._CompileRecord.stop_above_s, stop_if): compiled as it is, its check deferred as it was
    planned: "PlannedGraph | None" = None
    replanner: "Replanner | None" = None  # out: plans this graph at other budgets without tracing again
    solution: ActivationSolution | StockSolution | None = None  # out: the decisions the plan runs
    deferred: "DeferredCheck | None" = None  # out: the plan awaits the compile's check
    made: "PlannedGraph | None" = None  # out: what this planning made, to compile it later as `planned`


@dataclass(frozen=True)
class PlannedGraph:
    """One planning's outcome, enough to compile the same graph to the same plan without
    searching again (PlanRequest.planned)."""

    plan: Plan
    solution: "ActivationSolution | StockSolution"
    candidate_names: tuple[str, ...]  # the problem's candidates the solution's indices refer to
    deferred: "DeferredCheck | None"  # the check the compile's schedule makes (None: checked)

    def as_stored(self) -> "plan_store.StoredOutcome":
        return plan_store.StoredOutcome(plan_store.Outcome.PLAN, plan=self.plan, solution=self.solution,
                                        candidate_names=self.candidate_names)


@dataclass(frozen=True)
class DeferredCheck:
    """A plan chosen on a bound, to be checked on the schedule its compile builds."""

    num_fwd_outputs: int
    rounding: AllocatorRounding
    boundary_bytes: int
    budget_bytes: int  # the step budget its checked peak must be within
    # (folder, key, plan as planned, solution, candidate names): a plan store entry once checked
    store: tuple | None = None
    # the compile's rules reuse a dead buffer only for the next kernel (InductorRules.adjacent_reuse)
    adjacent_reuse: bool = True
    # PyTorch's default partition: its schedule is the liveness before planning too (nothing of
    # ours changed it); a solver plan keeps the keep-all check's as its "before"
    is_default_partition: bool = True


def planned_with(made: PlannedGraph, replanner: "Replanner", attempt: _Attempt) -> PlannedGraph:
    """`made` with `attempt`'s decisions instead (Replanner.fit_with_workspace: the same graph,
    an op's working set larger): the plan's decisions, time and liveness (its count, the op's
    working set grown) from the attempt; the compile's schedule checks it (as it would
    have checked `made`, or as a deferred plan of this graph where `made` was checked)."""
    solution = attempt.solution
    deferred = made.deferred if made.deferred is not None else replanner.deferred_check()
    plan = _with_timeline(made.plan, attempt.timeline, as_before=False)
    plan = dataclasses.replace(plan, decisions=_decisions(replanner.analysis, solution),
                               added_time_s=solution.added_time_s, solver_status=solution.status, gap=solution.gap,
                               solve_s=made.plan.solve_s + solution.solve_s)
    return dataclasses.replace(made, plan=plan, solution=solution, deferred=deferred)


def confirm_on_compile(deferred: DeferredCheck, schedules: list, plan: Plan) -> Plan | None:
    """`plan` with the liveness of the schedules its compile built (tp.compile_with_inductor's
    `schedules`), where that peak is within the budget; None where it is not, or where the
    compile built no schedule (Inductor's FX graph cache had the code): then plan with checks."""
    forward = next((s for s in schedules if not s.is_backward), None)
    backward = next((s for s in schedules if s.is_backward), None)
    if forward is None or backward is None:
        return None
    # the liveness models the wrapper's buffer reuse as the rules the graphs compiled under
    timeline = with_held_at_backward_start(
        analyze_scheduled_liveness(forward.as_checked(), backward.as_checked(), deferred.num_fwd_outputs,
                                   forward.schedule, backward.schedule, saved_names=forward.output_names,
                                   rounding=deferred.rounding,
                                   adjacent_reuse=deferred.adjacent_reuse and not plan.stock_inductor_rules),
        deferred.boundary_bytes)
    log.debug("memcompile: %s: the compiled schedule peaks at %s (graph-order bound %s, step budget %s)",
              plan.graph_id, format_bytes(timeline.peak_bytes), format_bytes(plan.predicted_peak_bytes),
              format_bytes(deferred.budget_bytes))
    if timeline.peak_bytes > deferred.budget_bytes:
        return None
    if deferred.store is not None:
        folder, key, planned, solution, names = deferred.store
        plan_store.save(folder, key, plan_store.StoredOutcome(
            plan_store.Outcome.PLAN, plan=_with_timeline(planned, timeline, deferred.is_default_partition),
            solution=solution, candidate_names=names))
    return _with_timeline(plan, timeline, deferred.is_default_partition)


def _with_timeline(plan: Plan, timeline: LivenessTimeline, as_before: bool = True) -> Plan:
    """`plan` with `timeline` as its liveness after planning, and (`as_before`: graphs planned as
    they are, nothing recomputed by us) before it too."""
    after = dataclasses.replace(
        plan, predicted_peak_bytes=timeline.peak_bytes,
        peak_phase=timeline.peak_step.phase, peak_node=timeline.peak_step.node,
        peak_breakdown=timeline.peak_breakdown,
        live_bytes_after=tuple(s.live_bytes for s in timeline.steps),
        live_categories_after=timeline.category_series(), peak_tensors=timeline.peak_tensors,
        backward_from_step=timeline.backward_start())
    if not as_before:
        return after
    return dataclasses.replace(after, predicted_peak_before_bytes=timeline.peak_bytes,
                               live_bytes_before=tuple(s.live_bytes for s in timeline.steps))


def held_bytes(problem, solution: ActivationSolution | StockSolution) -> int:
    """Device bytes a solution holds from forward to backward (what the ledger's saved_bytes
    counts from the plan's decisions: kept tensors, stored forms, nothing for recomputed ones)."""
    if isinstance(solution, StockSolution):
        return solution.held_bytes
    return sum(problem.nbytes[i] for i in solution.keep) + sum(
        problem.choices_of(i)[k].stored_bytes for i, k in solution.stored)


# The status detail of a plan recomputed further from a graph's plan (Replanner.fit_with_workspace)
RECOMPUTED_FURTHER = "recomputed further from the graph's plan, for a larger working set of an op"
_DEFER_MARGIN = 0.02  # room a plan is deferred with where its graph-order estimate is not a bound
# room under the budget a solver plan's model peak leaves where its check is left to the compile
# (Replanner._fit_on_model): above the model's largest under-count we saw (1.7%)
_DEFER_MODEL_MARGIN = 0.03


def _graph_order_count(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int, rounding: AllocatorRounding,
                       boundary_bytes: int, scatters_in_place: bool = True) -> LivenessTimeline:
    """The graphs' liveness in graph order, every value a buffer (but, with `scatters_in_place`, a
    scatter's copy of a dying input, which takes that input's buffer as Inductor's does)."""
    return with_held_at_backward_start(analyze_liveness(fw, bw, num_fwd_outputs, rounding=rounding,
                                                        scatters_in_place=scatters_in_place), boundary_bytes)


def _within_on_graph_order(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int, rounding: AllocatorRounding,
                           boundary_bytes: int, budget: int) -> tuple[bool, LivenessTimeline | None]:
    """(whether the graphs peak within `budget` on a count that every Inductor schedule we
    measured stayed under, that count; else the count with scatters in place). The count: in
    graph order with every value a buffer; or within _DEFER_MARGIN under the budget with a
    scatter's copy of a dying input taking that input's buffer, as Inductor's does (counted
    apart, the GPT style file's tied embedding gradient was held twice at the backward's end,
    147 MiB over the schedule; so counted, 0.1% under it). (False, None) for symbolic sizes: the
    compile schedules at the trace's sizes, not those planned for."""
    if _has_symbolic_sizes(fw) or _has_symbolic_sizes(bw):
        return False, None
    in_place = _graph_order_count(fw, bw, num_fwd_outputs, rounding, boundary_bytes)
    if in_place.peak_bytes <= int(budget * (1 - _DEFER_MARGIN)):
        return True, in_place
    every_value = _graph_order_count(fw, bw, num_fwd_outputs, rounding, boundary_bytes, scatters_in_place=False)
    if every_value.peak_bytes <= budget:
        return True, every_value
    return False, in_place


def _plain_inductor_partition(joint, joint_inputs, num_fwd_outputs, static_lifetime_input_indices,
                              rounding: AllocatorRounding, boundary_bytes: int = 0,
                              screen_budget: int | None = None, unchecked_if_over: bool = False,
                              rules: tp.InductorRules | None = tp.PLANNED_RULES) -> "_Attempt | None":
    """PyTorch's default partition (activation_memory_budget=1.0), checked as plain Inductor
    compiles it (its own fusion and buffer-reuse rules); None if it cannot be made or checked.
    With `screen_budget`: where the graphs peak within it in graph order with every value a
    buffer (a bound above every schedule we measured), or within _DEFER_MARGIN under it with a
    scatter's copy of a dying input taking that input's buffer (as Inductor's does: counted
    apart, the GPT style file's tied embedding gradient was held twice at the backward's end,
    147 MiB over the schedule; so counted, 0.1% under it), they are not checked here (the
    attempt is unchecked: the compile's own schedule checks it, and a plan over is planned again).
    With `unchecked_if_over` too, where even the count with scatters in place is over
    `screen_budget`, that count is returned (unchecked) instead of lowering a copy: the caller
    needs only to know it is over."""
    try:
        fw, bw = tp.stock_partition(copy.deepcopy(joint), joint_inputs, memory_budget=1.0,
                                    num_fwd_outputs=num_fwd_outputs,
                                    static_lifetime_input_indices=static_lifetime_input_indices)
        rows = _stock_decisions(fw, 1.0, num_fwd_outputs)
        # added time 0: the 1.0 partition is the baseline the other partitions' added times count from
        solution = StockSolution(1.0, 0.0, sum(r.held_bytes for r in rows), rows)
        if screen_budget is not None:
            within, count = _within_on_graph_order(fw, bw, num_fwd_outputs, rounding, boundary_bytes, screen_budget)
            if within or (unchecked_if_over and count is not None):
                return _Attempt(solution, fw, bw, count, checked=False)
        timeline = predicted_liveness(fw, bw, num_fwd_outputs, _stock_rules(rules), rounding, boundary_bytes)
    except UNREADABLE_GRAPH_ERRORS as error:  # a candidate only: plan as before
        log.debug("memcompile: plain Inductor's partition could not be checked (%s: %s)", type(error).__name__, error)
        return None
    return _Attempt(solution, fw, bw, timeline)


class DeferredReplanner:
    """A Replanner made on first use: where plain Inductor's partition is the plan, the keep-all
    check and the rest are needed only if a step plan of several regions asks for options."""

    def __init__(self, make: Callable[[], "Replanner"]) -> None:
        self._make = make
        self._made: Replanner | None = None

    @property
    def made(self) -> "Replanner | None":
        """The Replanner if something asked for it, else None (nothing was made)."""
        return self._made

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        if self._made is None:
            self._made = self._make()
        return getattr(self._made, name)


@dataclass
class Replanner:
    """A planned joint graph kept for planning it again at other budgets: the fake-tensor graph
    and its plain problem, so no second trace is needed (the backend's joint step plan asks
    each region for a few options, memcompile/joint_plan.py)."""

    joint: fx.GraphModule
    analysis: JointAnalysis
    num_fwd_outputs: int
    options: Options
    keep_all: _Attempt
    uncalibrated: ActivationProblem | None = None  # the model before calibration (for least_peak)
    stock: StockPartitions | None = None  # PyTorch's partitions, where they are candidates
    _least_peak: tuple[_Attempt, float] | None = dataclasses.field(default=None, repr=False, compare=False)
    _keep_all_count: int | None = dataclasses.field(default=None, repr=False, compare=False)
    _plan_counts: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    @property
    def fingerprint(self) -> tuple:
        problem = self.analysis.problem
        return problem.names, problem.nbytes

    def fit(self, budget: int, time_limit_s: float, defer: bool = False) -> tuple[_Attempt | None, float]:
        """The least-time plan whose checked peak is <= budget, or None; and the solve time.
        With `defer` (the compile that follows checks its own schedule: PlanRequest.defer_check),
        a solver plan the calibrated model puts _DEFER_MODEL_MARGIN under the budget is returned
        unchecked (_fit_on_model).
        PyTorch's partition at the largest fraction that fits comes first (STOCK_FRACTIONS; only
        1.0, plain Inductor, where keep-all fits: keeping everything was slower than it, 1.10x
        the step on BERT). Where that partition's recomputations are estimated at more than
        STOCK_SOLVE_ABOVE of the step, the solver plans too, and its plan is taken if estimated
        STOCK_MARGIN times cheaper. Else the solver: when the rewritten graphs peak above what the model
        said, the target is lowered by the excess and it solves again (at most _MAX_TIGHTENINGS
        times, sharing the time limit); when they peak well below the budget, the target is
        raised once by the room left and the faster of the fitting plans is kept."""
        keep_all_fits = self.keep_all.timeline.peak_bytes <= budget
        stock, stock_s = None, 0.0
        if self.stock is not None:
            started = time.monotonic()
            stock = self.stock.fitting(budget, STOCK_FRACTIONS[:1] if keep_all_fits else STOCK_FRACTIONS)
            stock_s = time.monotonic() - started
            if stock is not None and stock.solution.added_time_s <= STOCK_SOLVE_ABOVE * self.stock.step_time_s():
                return stock, stock_s
        if keep_all_fits and stock is None:
            return self.keep_all, 0.0
        attempt, solve_s = self._fit_on_model(budget, time_limit_s) if defer else (None, 0.0)
        if attempt is None:
            attempt, more_s = self._fit_with(self.analysis.problem, budget, max(1.0, time_limit_s - solve_s))
            solve_s += more_s
        if attempt is None and self.uncalibrated is not None and self.uncalibrated != self.analysis.problem:
            # Calibration moves only the error no decision changes; where its model finds no plan
            # that checks under the budget, the uncalibrated model's plans may (a DDP-split MLP).
            attempt, more_s = self._fit_with(self.uncalibrated, budget, max(1.0, time_limit_s - solve_s))
            solve_s += more_s
        if stock is not None and not (attempt is not None
                                      and attempt.solution.added_time_s * STOCK_MARGIN < stock.solution.added_time_s):
            return stock, stock_s + solve_s
        return attempt, stock_s + solve_s

    def _fit_on_model(self, budget: int, time_limit_s: float) -> tuple[_Attempt | None, float]:
        """The solver's plan for the calibrated model at _DEFER_MODEL_MARGIN under `budget`,
        unchecked: the compile's own schedule checks it (confirm_on_compile), and a plan over is
        planned again with checks. Each check here is a lowering of the whole graph, as much as
        the compile's (GPT style file, 12 layers, 4 x 512: about 6 s of a 75 s first call). The
        calibrated model put solver plans 0-10% above their checks on GPT-2, Llama and BERT small
        and the 12-layer GPT style file, once 1.7% under; on small attention stacks 3-7% under,
        hence a second estimate. None (and the solve time) where either estimate is over that
        target, or the graphs have symbolic sizes (the compile schedules them at the trace's
        sizes, not those planned for)."""
        target = int(budget * (1 - _DEFER_MODEL_MARGIN))
        solution = _solve_or_greedy(self.analysis.problem, target, time_limit_s, self.options)
        if solution.status == StatusKind.INFEASIBLE or solution.model_peak_bytes > target:
            return None, solution.solve_s
        fw, bw = apply_plan(self.joint, self.analysis, solution.keep, solution.recompute, self.num_fwd_outputs,
                            solution.stored)
        if _has_symbolic_sizes(fw) or _has_symbolic_sizes(bw):
            return None, solution.solve_s
        count = _graph_order_count(fw, bw, self.num_fwd_outputs, self.options.allocator_rounding,
                                   self.analysis.boundary_bytes)
        # The plan's graph-order count, scaled as the keep-all check's schedule scaled its own,
        # is a second estimate: on small attention stacks the model was 3-7% under the compiled
        # schedule, that estimate within 1%.
        scaled = count.peak_bytes * self.keep_all.timeline.peak_bytes // max(1, self._count_of_keep_all())
        log.debug("target %d: model peak %d, graph-order count %d, scaled as keep-all's %d", target,
                  solution.model_peak_bytes, count.peak_bytes, scaled)
        if scaled > target:
            return None, solution.solve_s
        # the plan record's peak until the compile's schedule replaces it: the graph-order count
        return _Attempt(solution, fw, bw, count, checked=False), solution.solve_s

    def fit_with_workspace(self, budget: int, op: object, start: ActivationSolution, *, extra_bytes: int,
                           start_checked_peak: int | None, time_limit_s: float) -> _Attempt | None:
        """The plan of this graph where each call of `op` holds `extra_bytes` more while it runs
        (the loss head in fewer chunks), from `start` (this graph's plan): recomputed further and
        kept back (`recomputed_further`) on the calibrated model, unchecked: the compile's
        schedule checks it. The model's target is _DEFER_MODEL_MARGIN under `budget`, or the
        start's own model peak where its check (`start_checked_peak`) put it within the budget
        above that. Screened as _fit_on_model screens a plan: its graph-order count with the
        extra bytes where `op` runs, scaled as the start's check scaled the start's count
        (keep-all's for an unchecked start), within that target (the budget for a checked start).
        None where `op` is not in the graph or a screen is over."""
        began = time.perf_counter()
        steps = [t for t, n in enumerate(self.analysis.forward_nodes + self.analysis.backward_nodes)
                 if n.op == "call_function" and n.target is op]
        if not steps:
            return None
        problem = self.analysis.problem
        for t in steps:
            problem = with_fixed_bytes_at(problem, t, extra_bytes, by_node=True)
        target = int(budget * (1 - _DEFER_MODEL_MARGIN))
        if start_checked_peak is not None:
            target = max(target, min(start.model_peak_bytes, budget))
        plan = recomputed_further(problem, (start.keep, start.recompute, start.stored), target,
                                  KEEP_BACK_SHARE * time_limit_s)
        if plan is None:
            return None
        peak, added = evaluate(problem, *plan)
        # the grown problem's optimum is no faster than the start problem's: its bound holds
        solution = ActivationSolution(*plan, peak, added, status_text(StatusKind.FALLBACK, RECOMPUTED_FURTHER),
                                      min(start.lower_bound_s, added), time.perf_counter() - began)
        fw, bw = apply_plan(self.joint, self.analysis, solution.keep, solution.recompute, self.num_fwd_outputs,
                            solution.stored)
        if _has_symbolic_sizes(fw) or _has_symbolic_sizes(bw):
            return None
        # the count with the op's working set grown where it runs
        timeline = _graph_order_count(fw, bw, self.num_fwd_outputs, self.options.allocator_rounding,
                                      self.analysis.boundary_bytes)
        runs = {n.name for n in fw.graph.nodes if n.op == "call_function" and n.target is op}
        for index, step in enumerate(timeline.steps):
            if step.phase == "forward" and step.node in runs:
                timeline = with_scratch_at(timeline, index, extra_bytes)
        if start_checked_peak is None:
            scaled = timeline.peak_bytes * self.keep_all.timeline.peak_bytes // max(1, self._count_of_keep_all())
            limit = target
        else:
            scaled, limit = timeline.peak_bytes * start_checked_peak // max(1, self._count_of_plan(start)), budget
        log.debug("with %d bytes more at %s: model peak %d (target %d), added %.2f ms, graph-order count %d, "
                  "scaled %d", extra_bytes, op, peak, target, added * 1e3, timeline.peak_bytes, scaled)
        if scaled > limit:
            return None
        return _Attempt(solution, fw, bw, timeline, checked=False)

    def _count_of_plan(self, solution: ActivationSolution) -> int:
        """The graph-order count of a plan of this graph, made once per plan (each coarser chunk
        count tried from the same start asks again: a rewrite and a count of the whole graph)."""
        key = solution.decisions
        if key not in self._plan_counts:
            fw, bw = apply_plan(self.joint, self.analysis, solution.keep, solution.recompute, self.num_fwd_outputs,
                                solution.stored)
            self._plan_counts[key] = _graph_order_count(fw, bw, self.num_fwd_outputs, self.options.allocator_rounding,
                                                        self.analysis.boundary_bytes).peak_bytes
        return self._plan_counts[key]

    def deferred_check(self) -> "DeferredCheck":
        """The check the compile's schedule makes of a plan of this graph chosen unchecked."""
        return DeferredCheck(self.num_fwd_outputs, self.options.allocator_rounding, self.analysis.boundary_bytes,
                             self.options.step_budget_bytes,
                             adjacent_reuse=inductor_rules_for(self.options).adjacent_reuse, is_default_partition=False)

    def _count_of_keep_all(self) -> int:
        if self._keep_all_count is None:
            self._keep_all_count = _graph_order_count(self.keep_all.forward, self.keep_all.backward,
                                                      self.num_fwd_outputs, self.options.allocator_rounding,
                                                      self.analysis.boundary_bytes).peak_bytes
        return self._keep_all_count

    def _fit_with(self, problem: ActivationProblem, budget: int, time_limit_s: float) -> tuple[_Attempt | None, float]:
        solve_s = 0.0
        target = budget
        best: _Attempt | None = None
        over: _Attempt | None = None  # the overshooting plan with the least checked peak
        raised = 0
        for _ in range(_MAX_TIGHTENINGS + _MAX_RAISES):
            # All solves of one graph share the time limit (each gets at least a second).
            remaining = max(1.0, time_limit_s - solve_s)
            solution = _solve_or_greedy(problem, target, remaining, self.options)
            solve_s += solution.solve_s
            if solution.status == StatusKind.INFEASIBLE:
                break
            attempt = _rewrite_and_check(self.joint, self.analysis, solution, self.num_fwd_outputs,
                                         _checks_schedule(self.options), self.options.allocator_rounding)
            checked = attempt.timeline.peak_bytes
            log.debug("target %d: model peak %d, graph peak %d (%s)", target, solution.model_peak_bytes,
                      checked, solution.status)
            if checked <= budget:
                if best is None or solution.added_time_s < best.solution.added_time_s:
                    best = attempt
                # The model over-estimated: a plan for a higher target may still fit, and run faster
                # (not where this one's added time is within noise of the step: STOCK_SOLVE_ABOVE).
                slack = budget - checked
                if (raised >= _MAX_RAISES or slack <= _RAISE_MIN_SLACK * budget or solution.added_time_s <= 0
                        or (self.stock is not None
                            and solution.added_time_s <= STOCK_SOLVE_ABOVE * self.stock.step_time_s())):
                    break
                raised += 1
                target += slack
            elif best is not None:
                break  # a raise overshot: keep the plan that fitted
            else:
                if over is None or checked < over.timeline.peak_bytes:
                    over = attempt
                # The model under-estimated the real graphs: ask it for that much less than this
                # plan's own model peak (lowering only the target returned the same plan when the
                # model put it well under the target: Llama small at 9.91 MiB, 323 B over, four
                # solves of one plan).
                target = min(target, solution.model_peak_bytes) - (checked - budget)
        if best is None and over is not None:
            best = self._repair_on_check(problem, over, budget)
        return best, solve_s

    def _repair_on_check(self, problem: ActivationProblem, attempt: _Attempt, budget: int) -> _Attempt | None:
        """From a plan whose check peaks over the budget: recompute one more of what it keeps
        across the check's peak step, cheapest per byte first, each change checked, moving on
        from any that lowers the checked peak; the first plan within the budget, or None after
        _REPAIR_TRIES checks. Where the check peaks at a step the model puts well below its own
        peak, no model target moves that step (Llama small at 9.91 MiB: 323 B over, every
        tightened target returned plans checking at the same peak). Where the check's peak holds
        fewer saved activations than it is over the budget, no recomputation brings that step
        within it (GPT style file, 12 layers, 1 x 256, head whole: 1.6 MB saved at a peak 100 MB
        over, in the head's backward, six repairs at one unchanged peak): none is tried."""
        saved = dict(attempt.timeline.peak_breakdown).get(SAVED)
        if saved is not None and attempt.timeline.peak_bytes - saved > budget:
            log.debug("repair: the check's peak holds %s of saved activations, %s over the budget: "
                      "no recomputation lowers it", format_bytes(saved),
                      format_bytes(attempt.timeline.peak_bytes - budget))
            return None
        steps = {step: t for t, step in enumerate(_model_steps(self.analysis))}
        tries = 0
        while tries < _REPAIR_TRIES:
            peak = attempt.timeline.peak_step
            t = steps.get((peak.phase, peak.node))
            held = attempt.solution
            moves = [i for i in held.keep if problem.nbytes[i] and problem.can_recompute[i]
                     and _held_across(problem, i, t)]
            moves.sort(key=lambda i: (sum(problem.recompute_cost_s[j] for j in problem.op_group(i)) / problem.nbytes[i], i))
            lower = None
            for i in moves[:_REPAIR_TRIES - tries]:
                tries += 1
                decisions = close_decisions(problem, set(held.recompute) | {i}, dict(held.stored))
                peak_bytes, added = evaluate(problem, *decisions)
                other = _rewrite_and_check(self.joint, self.analysis,
                                           ActivationSolution(*decisions, peak_bytes, added, StatusKind.FEASIBLE, 0.0, 0.0),
                                           self.num_fwd_outputs, _checks_schedule(self.options),
                                           self.options.allocator_rounding)
                log.debug("repair: recompute %s: graph peak %d", problem.names[i], other.timeline.peak_bytes)
                if other.timeline.peak_bytes <= budget:
                    return other
                if other.timeline.peak_bytes < attempt.timeline.peak_bytes:
                    lower = other
                    break
            if lower is None:
                return None
            attempt = lower
        return None

    def least_peak(self) -> _Attempt:
        return self.least_peak_and_solve_s()[0]

    def attempt_for(self, decisions: ActivationSolution | StockSolution) -> _Attempt | None:
        """The checked graphs of these decisions (a plan chosen for the whole step); None for a
        stock partition that is not a candidate here."""
        if isinstance(decisions, StockSolution):
            return self.stock.at(decisions.fraction) if self.stock is not None else None
        return _rewrite_and_check(self.joint, self.analysis, decisions, self.num_fwd_outputs,
                                  _checks_schedule(self.options), self.options.allocator_rounding)

    def least_peak_and_solve_s(self, within: int | None = None) -> tuple[_Attempt, float]:
        """The least-peak plan (deterministic, so made once: an infeasible first compile and the
        options offered to a step plan both ask for it), and the solve time it took. With
        `within`, the search's first plan whose check is at most `within` where it finds one
        before its end (the same path as the whole search, cut short: a budget at the floor the
        whole search names finds a plan within it), else the least-peak plan."""
        if self._least_peak is None:
            # a search that found nothing within `within` ran the whole search's path: its plan
            # is the least-peak plan
            least, solve_s, complete = _least_peak_attempt(self.joint, self.analysis, self.num_fwd_outputs,
                                                           self.options, self.keep_all, self.uncalibrated,
                                                           within=within)
            if not complete:
                return least, solve_s
            # PyTorch's partition at its smallest fraction is a candidate too: on the GPT style
            # file (12 layers, loss head chunked) it peaked 150 MB below the solver's least-peak
            # plan, whose schedule held a gradient made in the forward together with the backward's
            # temporaries; a floor named above a plan that fits would turn away a budget that works.
            smallest = (self.stock.least_peak_partition(below=least.timeline.peak_bytes) if self.stock is not None
                        else None)
            if smallest is not None and smallest.timeline.peak_bytes < least.timeline.peak_bytes:
                least = smallest
            self._least_peak = (least, solve_s)
        return self._least_peak

    def options_between(self, count: int, time_limit_s: float
                        ) -> list[tuple[int, int, float, ActivationSolution | StockSolution]]:
        """(own peak, held bytes, added time, decisions) of PyTorch's partitions (where they are
        candidates), the keep-all plan, the least-peak plan and the least-time plans at `count`
        budgets evenly between their peaks; duplicates and plans another one beats on all three
        measures dropped; PyTorch's first (ties go to them: measured faster at equal memory),
        least peak last."""
        problem = self.analysis.problem
        least = self.least_peak()
        high, low = self.keep_all.timeline.peak_bytes, least.timeline.peak_bytes
        stock = [self.stock.at(f) for f in STOCK_FRACTIONS] if self.stock is not None else []
        attempts = [a for a in stock if a is not None] + [self.keep_all]
        for i in range(count, 0, -1):
            budget = low + (high - low) * i // (count + 1)
            attempt, _ = self.fit(budget, time_limit_s)
            if attempt is not None:
                attempts.append(attempt)
        attempts.append(least)
        rows: list[tuple[int, int, float, ActivationSolution | StockSolution]] = []
        for a in attempts:
            row = (a.timeline.peak_bytes, held_bytes(problem, a.solution), a.solution.added_time_s, a.solution)
            if any(r[3].decisions == row[3].decisions for r in rows):
                continue
            rows.append(row)
        return [r for r in rows if not any(o is not r and o[0] <= r[0] and o[1] <= r[1] and o[2] <= r[2]
                                           and o[:3] != r[:3] for o in rows)]


# What OR-Tools raises where it cannot take or solve a model: OverflowError for a coefficient past
# int64, ValueError / RuntimeError from its checks and its C++ core, MemoryError.
_SOLVER_FAILURES = (OverflowError, ValueError, RuntimeError, MemoryError)


def _solve_or_greedy(problem, target: int, time_limit_s: float, options: Options) -> ActivationSolution:
    """The solver's plan; if OR-Tools fails on the model (coefficients past int64, its own error,
    out of memory), the greedy plan, with a warning: a crash there would kill the user's run. An
    error of ours in building the model (a bug) propagates."""
    try:
        return solve_cached(solve_activation_plan, problem, target, time_limit_s=time_limit_s,
                            workers=options.workers, seed=options.seed)
    except _SOLVER_FAILURES as error:
        log.warning("memcompile: the solver failed (%s: %s); using the greedy plan", type(error).__name__, error)
        plan = greedy_plan(problem, target)
        peak, added = evaluate(problem, *plan)
        status = StatusKind.FALLBACK if peak <= target else StatusKind.INFEASIBLE
        return ActivationSolution(*plan, peak, added, status, 0.0, 0.0)


def _within(attempt: _Attempt, within: int | None) -> bool:
    """Whether a search cut at `within` (None: not cut) ends at this checked plan."""
    return within is not None and attempt.timeline.peak_bytes <= within


def _least_peak_attempt(joint, analysis, num_fwd_outputs, options, baseline: _Attempt,
                        uncalibrated: ActivationProblem | None = None, within: int | None = None
                        ) -> tuple[_Attempt, float, bool]:
    """(plan, solve time, whether the search ran to its end). The plan with the least peak we can
    find (deterministically), or with `within`, the first plan of the same search whose check is
    at most `within` (then the search stops there: complete False): min-peak under the model, or
    recompute-everything-possible if its rewritten graphs peak lower (the model approximates
    conversion and recompute scratch; the check is exact), or the already-checked keep-all
    `baseline` if it peaks lower still (on ResNet, recomputing convolutions into the backward
    raised the peak: 4.27 MiB reported as the smallest budget where keep-all checked at 3.91).
    The min-peak plan of the `uncalibrated` model is a candidate too where the calibrated model
    does not reproduce the min-peak plan's check: calibration moves only the error no decision
    changes, and on a DDP-split MLP its min-peak plan checked higher."""
    problem = analysis.problem
    least = solve_cached(solve_min_peak, problem, time_limit_s=options.time_limit_s,
                         workers=options.workers, seed=options.seed)
    fuse, rounding = _checks_schedule(options), options.allocator_rounding
    attempt = _rewrite_and_check(joint, analysis, least, num_fwd_outputs, fuse, rounding)
    if _within(attempt, within) and not problem.store_choices:
        return attempt, least.solve_s, False
    # Other starts are checked only where the model, matched to the min-peak plan's check, does
    # not put them at or above that peak (as the descent screens its moves): each check is a
    # lowering of the whole graph. Where the matched model reproduces the check, the uncalibrated
    # model's min-peak plan is not solved for either (at 24 layers of the GPT style file, a
    # 6.5 s solve whose plan the screen then put higher).
    screen = _screen_for(analysis, attempt)
    others = [close_decisions(problem, prefer_recompute=set(range(len(problem.names))))]
    if uncalibrated is not None and uncalibrated != problem and screen is None:
        others.append(solve_cached(solve_min_peak, uncalibrated, time_limit_s=options.time_limit_s,
                                   workers=options.workers, seed=options.seed).decisions)
    lossless: _Attempt | None = None
    if problem.store_choices:
        # Store choices enlarge the model; within the same deterministic time its search can end
        # above the keep/recompute-only optimum, which is also a valid plan: never report worse.
        # The whole keep/recompute-only search runs (its CP-SAT solves are cached and shared):
        # its descent spends all its checks on recomputations, and on Llama it reached 11.05 MB
        # where this one, from another start and trying store choices, stopped at 11.38 MB.
        plain_problem = dataclasses.replace(problem, store_choices=(), created_at=())
        plain_uncalibrated = (dataclasses.replace(uncalibrated, store_choices=(), created_at=())
                              if uncalibrated is not None else None)
        lossless, _, lossless_complete = _least_peak_attempt(
            joint, dataclasses.replace(analysis, problem=plain_problem), num_fwd_outputs, options, baseline,
            plain_uncalibrated, within=within)
        if not lossless_complete:
            return lossless, least.solve_s, False  # within it without quantizing: no error for nothing
        if _within(attempt, within):
            return attempt, least.solve_s, False
        plain = solve_cached(solve_min_peak, plain_problem,
                             time_limit_s=options.time_limit_s, workers=options.workers, seed=options.seed)
        others.append(plain.decisions)
        # ... and storing, from that plan, what is kept at its peak lowers it further.
        others.append(greedy_plan(problem, 0, start_from=plain.decisions, store_only=True))
    for decisions in others:
        if decisions == least.decisions:
            continue
        if screen is not None and evaluate(screen, *decisions)[0] >= attempt.timeline.peak_bytes:
            log.debug("memcompile: a least-peak start the model finds no lower than the min-peak plan: not checked")
            continue
        peak, added = evaluate(problem, *decisions)
        other = _rewrite_and_check(joint, analysis, ActivationSolution(*decisions, peak, added, least.status,
                                                                       0.0, 0.0), num_fwd_outputs, fuse, rounding)
        if other.timeline.peak_bytes < attempt.timeline.peak_bytes:
            attempt = other
            if _within(attempt, within):
                return attempt, least.solve_s, False
    attempt = _descend_on_check(joint, analysis, num_fwd_outputs, fuse, attempt, rounding, within=within)
    if _within(attempt, within):
        return attempt, least.solve_s, False
    if lossless is not None and lossless.timeline.peak_bytes <= attempt.timeline.peak_bytes:
        attempt = lossless  # as low without quantizing: no error for nothing
    if baseline.timeline.peak_bytes < attempt.timeline.peak_bytes:
        attempt = baseline
    return attempt, least.solve_s, True


# From the least-peak plan, the largest kept activations are changed one at a time, to recompute
# or else to one of their store choices (int8, offload, ... where the options allow them), each
# change kept if the check's peak falls: the model misses some of what Inductor fuses and
# reorders (GPT-2 at batch 8: recomputing the last block's GELU values besides the least-peak plan
# checked 1.2 MiB lower while the model then said 2 MiB higher; benchmarks/least_peak_probe.py),
# and at GPT-2 batch 12 with int8 the peak sat at a kept matmul result that only storing it
# lowers. A count, not a time limit: the smallest budget it reports must be found again when
# compiling at exactly that budget.
_DESCENT_TRIES = 8
_DESCENT_TRIES_WITH_STORE = 12


def _descend_on_check(joint, analysis, num_fwd_outputs, fuse: tp.InductorRules | None, attempt: _Attempt,
                      rounding: AllocatorRounding = EXACT, within: int | None = None) -> _Attempt:
    """`attempt` or a plan the descent's checks put lower; with `within`, it stops at the first
    plan whose check is at most `within`."""
    problem = analysis.problem
    limit = _DESCENT_TRIES_WITH_STORE if problem.store_choices else _DESCENT_TRIES
    steps = {step: t for t, step in enumerate(_model_steps(analysis))}
    screen = _screen_for(analysis, attempt)
    tries = 0
    for i in sorted(attempt.solution.keep, key=lambda c: (-problem.nbytes[c], c)):
        if tries >= limit or problem.nbytes[i] == 0 or _within(attempt, within):
            break
        peak = attempt.timeline.peak_step
        if not _held_across(problem, i, steps.get((peak.phase, peak.node))):
            continue  # not held at the checked peak: changing it cannot lower that step
        recompute, stored = set(attempt.solution.recompute), dict(attempt.solution.stored)
        moves = [close_decisions(problem, recompute | {i}, stored)]
        moves += [close_decisions(problem, recompute, {**stored, i: k}) for k in range(len(problem.choices_of(i)))]
        for decisions in moves:
            if tries >= limit:
                break
            if i in decisions[0]:
                continue  # not allowed (cannot be recomputed, a lossy form it must not take), or already so
            if screen is not None and evaluate(screen, *decisions)[0] >= attempt.timeline.peak_bytes:
                continue  # the model, matched to this plan's check, finds no lower peak
            tries += 1
            peak, added = evaluate(problem, *decisions)
            other = _rewrite_and_check(joint, analysis, ActivationSolution(*decisions, peak, added,
                                                                           attempt.solution.status, 0.0, 0.0),
                                       num_fwd_outputs, fuse, rounding)
            if other.timeline.peak_bytes < attempt.timeline.peak_bytes:
                attempt = other
                screen = _screen_for(analysis, attempt)
                break
    return attempt


# The descent's screen is trusted where the model, calibrated to a plan's check, puts that plan's
# peak within this much of the check's: then a move it finds no lower is not checked.
_SCREEN_TOLERANCE = 0.002


def _screen_for(analysis: JointAnalysis, attempt: _Attempt) -> ActivationProblem | None:
    """The model with its fixed bytes matched to `attempt`'s check (passes/calibration.py), to
    estimate the descent's moves from it without lowering them; None where it does not reproduce
    the checked peak (the check's peak at a step the model does not name, or a value it places
    otherwise): then every move is checked."""
    screen = _calibrated_to(analysis, attempt).problem
    modelled = evaluate(screen, attempt.solution.keep, attempt.solution.recompute, attempt.solution.stored)[0]
    checked = attempt.timeline.peak_bytes
    return screen if abs(modelled - checked) <= _SCREEN_TOLERANCE * checked else None


def _infeasible(options: Options, attempt: _Attempt, analysis: JointAnalysis) -> InfeasibleBudgetError:
    need = attempt.timeline.peak_bytes + options.reserve_bytes
    breakdown = attempt.timeline.peak_breakdown
    if isinstance(attempt.solution, StockSolution):
        kept = sorted(((r.held_bytes, r.name) for r in attempt.solution.rows), reverse=True)[:5]
    else:
        kept = sorted(((analysis.problem.nbytes[i], analysis.candidates[i].name) for i in attempt.solution.keep),
                      reverse=True)[:5]
    parts = ", ".join(f"{cat} {format_bytes(b)}" for cat, b in sorted(breakdown, key=lambda x: -x[1]))
    tops = ", ".join(f"{name} {format_bytes(b)}" for b, name in kept if b)
    message = (
        f"memcompile: no plan fits the budget of {format_bytes(options.budget_bytes)} "
        f"({options.budget_bytes} bytes"
        + options.reserve_text()
        + f"). The smallest budget that works is {format_bytes(need)} (min_feasible_bytes={need}). "
        f"At its peak ({attempt.timeline.peak_step.phase} node {attempt.timeline.peak_step.node}): {parts}."
        + (f" Largest activations still kept by that plan: {tops}." if tops else "")
        + _annotation_note(attempt, analysis)
        + " Raise the budget, or reduce batch size / model size."
    )
    return InfeasibleBudgetError(message, budget_bytes=options.budget_bytes, min_feasible_bytes=need,
                                 contributors=tuple(breakdown))


def _annotation_note(attempt: _Attempt, analysis: JointAnalysis) -> str:
    """What the checkpoint annotations (MUST_SAVE / MUST_RECOMPUTE) force on the least-peak plan."""
    if isinstance(attempt.solution, StockSolution):
        return ""  # PyTorch's partition follows the annotations its own way
    problem = analysis.problem
    saved = [i for i in attempt.solution.keep if analysis.cannot_recompute_reason[i].startswith(MUST_SAVE)]
    forced = [i for i in attempt.solution.recompute if analysis.cannot_keep_reason[i] == MUST_RECOMPUTE_REASON]
    if not saved and not forced:
        return ""
    return (f" Checkpoint annotations constrain it: {len(saved)} MUST_SAVE activation(s) "
            f"({format_bytes(sum(problem.nbytes[i] for i in saved))}) are kept and "
            f"{len(forced)} MUST_RECOMPUTE one(s) recomputed whatever the budget; "
            "relaxing them to PREFER_* lets memcompile choose.")




def plan_joint_graph(
    joint: fx.GraphModule,
    joint_inputs,
    *,
    num_fwd_outputs: int,
    static_lifetime_input_indices: list[int] | None,
    options: Options,
    graph_id: str,
    request: "PlanRequest | None" = None,
) -> tuple[fx.GraphModule, fx.GraphModule, Plan]:
    """`_plan_joint_graph`, with a last resort: if planning fails on a graph it cannot read
    (errors.UNREADABLE_GRAPH_ERRORS), PyTorch's own partition runs, with a warning, instead of killing the run.
    An infeasible budget is not a failure: InfeasibleBudgetError (and NoSolverPlanFits) propagate."""
    token = _CHECK_S.set([0.0])
    try:
        return _plan_joint_graph(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs,
                                 static_lifetime_input_indices=static_lifetime_input_indices,
                                 options=options, graph_id=graph_id, request=request)
    except (InfeasibleBudgetError, NoSolverPlanFits):
        raise
    except UNREADABLE_GRAPH_ERRORS as error:
        fw, bw, plan = _stock_fallback(joint, joint_inputs, num_fwd_outputs, static_lifetime_input_indices,
                                       options, graph_id, error)
        fits = 0 < plan.predicted_peak_bytes <= options.step_budget_bytes
        message = (f"memcompile: planning {graph_id} failed ({type(error).__name__}: {error}); PyTorch's default "
                   f"partition is predicted to peak at {format_bytes(plan.predicted_peak_bytes)} "
                   f"({'within' if fits else 'over, or not predicted within,'} the step budget of "
                   f"{format_bytes(options.step_budget_bytes)})")
        if not fits and options.on_unplanned == "raise":
            raise PlanningFailedError(
                message + ". Please report the error; on_unplanned=\"warn\" runs that partition anyway.") from error
        log.warning("%s; running it", message, exc_info=log.isEnabledFor(logging.DEBUG))
        return fw, bw, plan
    finally:
        _CHECK_S.reset(token)


def _stock_fallback(joint, joint_inputs, num_fwd_outputs, static_lifetime_input_indices, options, graph_id, error):
    fw, bw = tp.stock_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs,
                                static_lifetime_input_indices=static_lifetime_input_indices)
    try:
        timeline = predicted_liveness(fw, bw, num_fwd_outputs, _checks_schedule(options), options.allocator_rounding,
                                      options.boundary_bytes)
        peak, steps = timeline.peak_bytes, tuple(s.live_bytes for s in timeline.steps)
        phase, node, breakdown = timeline.peak_step.phase, timeline.peak_step.node, timeline.peak_breakdown
    except UNREADABLE_GRAPH_ERRORS:  # the prediction is informative only here
        peak, steps, phase, node, breakdown = 0, (), "", "", ()
    plan = Plan(
        graph_id=graph_id, budget_bytes=options.budget_bytes, reserve_bytes=options.reserve_bytes,
        library_workspace_bytes=options.library_workspace_bytes, compile_scratch_bytes=options.compile_scratch_bytes,
        predicted_peak_before_bytes=peak,
        predicted_peak_bytes=peak, peak_phase=phase, peak_node=node,
        peak_breakdown=breakdown, decisions=(), added_time_s=0.0,
        solver_status=status_text(StatusKind.STOCK_FALLBACK, type(error).__name__), solve_s=0.0, gap=0.0,
        live_bytes_before=steps, live_bytes_after=steps,
        eager_at_backward_start_bytes=options.boundary_bytes, eager_outside_bytes=options.eager_outside_bytes,
        eager_where=options.eager_where,
    )
    return fw, bw, plan
