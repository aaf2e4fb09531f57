"""The torch.compile backend: Dynamo graph -> AOTAutograd joint graph -> our partitioner -> codegen."""

from __future__ import annotations

import contextvars
import copy
import dataclasses
import itertools
import logging
import os
import threading
import weakref
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from memcompile import _torch_private as tp
from memcompile.cost_models.cuda_allocator import EXACT, allocator_rounding_for
from memcompile.cost_models.device import blas_workspace_bytes, profile_for
from memcompile.passes.graph_facts import step_device
from memcompile.passes.loss_head import LossHead, chunk_loss_heads, find_loss_heads
from memcompile.passes.mlp_chunk import MlpBlock, chunk_mlps, find_mlps
from memcompile.plan_dump import write_dump_dir
from memcompile.errors import InfeasibleBudgetError
from memcompile.joint_plan import PlanOption, Position, choose_joint, least_step_peak
from memcompile.joint_plan import step_peaks as joint_step_peaks
from memcompile.ledger import Footprint, InputBytes, StepLedger, footprint_of, input_bytes, saved_bytes_of
from memcompile.options import Options
from memcompile.plan import Plan, format_bytes
from memcompile.plan_cache import source_hash
from memcompile.planner import NoSolverPlanFits, PlanRequest, Replanner, plan_joint_graph
from memcompile.sizes import planning_sizes, planning_sizes_now

log = logging.getLogger("memcompile")

# Partitioners must survive Inductor's deepcopy/pickle of its config, so they refer to their
# backend by id; plans are reported back through this registry.
_BACKENDS: "weakref.WeakValueDictionary[int, Backend]" = weakref.WeakValueDictionary()
_ids = itertools.count()
_lock = threading.Lock()


@dataclasses.dataclass
class _CompileRecord:
    """What the partitioner reports back to the region that is compiling (None: inference)."""

    plan: Plan | None = None
    inputs: InputBytes | None = None
    request: PlanRequest | None = None  # what the region asks of the planner (and gets back)
    graph_rewrites: tuple[str, ...] = ()  # what the region changed in its graph before compiling
    rewrite_time_s: float = 0.0  # what those changes are estimated to add to the step by themselves


_RECORD: contextvars.ContextVar[_CompileRecord | None] = contextvars.ContextVar("memcompile_record", default=None)


class Partitioner(tp.PartitionerBase):
    """Inductor's `custom_partitioner_fn`: plans the joint graph under the backend's budget."""

    def __init__(self, options: Options, backend_id: int) -> None:
        self.options = options
        self.backend_id = backend_id

    def __call__(self, gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any):
        backend = _BACKENDS.get(self.backend_id)
        graph_id = backend.next_graph_id() if backend is not None else "graph"
        static = list(kwargs.get("static_lifetime_input_indices") or [])
        record = _RECORD.get()
        inputs = input_bytes(gm, kwargs["num_fwd_outputs"], static)
        fw, bw, plan = plan_joint_graph(
            gm,
            joint_inputs,
            num_fwd_outputs=kwargs["num_fwd_outputs"],
            static_lifetime_input_indices=static,
            options=self.options,
            graph_id=graph_id,
            request=record.request if record is not None else None,
        )
        sizes = planning_sizes_now()
        if sizes:
            plan = dataclasses.replace(plan, size_bounds=tuple(sorted((str(k), v) for k, v in sizes.items())))
        if record is not None and record.graph_rewrites:
            plan = dataclasses.replace(plan, graph_rewrites=record.graph_rewrites,
                                       rewrite_time_s=record.rewrite_time_s)
        if record is not None:
            record.plan = plan
            record.inputs = inputs
        if backend is not None:
            backend.plans.append(plan)
            write_dump_dir(plan, os.environ.get("MEMCOMPILE_DUMP_DIR"))
        if not plan.stock_inductor_rules:
            tp.mark_planned(fw, bw)
        return fw, bw

    def uuid(self) -> str:
        # Budget, options, code and torch version: a cached graph is never reused under another plan.
        return f"memcompile-{source_hash()}-{tp.TORCH_VERSION}-{self.options.describe()}"

    def __reduce__(self):
        return (Partitioner, (self.options, self.backend_id))

    def __deepcopy__(self, memo: dict) -> "Partitioner":
        return self


@dataclasses.dataclass(frozen=True)
class _Variant:
    """One compilation of a region: for what others hold (outside_bytes) and for sizes <= sizes."""

    fn: Callable
    plan: Plan | None
    inputs: InputBytes | None
    decisions: tuple | None = None  # (keep, recompute, stored) of its plan, when planned by memcompile

    def footprint(self, held_by_caller: tuple[bool, ...]) -> Footprint | None:
        if self.plan is None or self.inputs is None:
            return None  # an inference graph: saves nothing
        return footprint_of(self.plan, self.inputs, held_by_caller)


def _symbol_sites(fake_inputs: Sequence[object]) -> tuple[tuple[int, int | None, object], ...]:
    """(input index, dim or None for a SymInt input, symbol) for every size that is a plain symbol."""
    sites = []
    for i, value in enumerate(fake_inputs):
        if isinstance(value, torch.SymInt) and value.node.expr.is_Symbol:
            sites.append((i, None, value.node.expr))
        elif isinstance(value, torch.Tensor):
            for d, size in enumerate(value.shape):
                if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
                    sites.append((i, d, size.node.expr))
    return tuple(sites)


def _trace_sizes(fake_inputs: Sequence[object]) -> dict[object, int]:
    sizes: dict[object, int] = {}
    for i, d, symbol in _symbol_sites(fake_inputs):
        value = fake_inputs[i] if d is None else fake_inputs[i].shape[d]
        if value.node.hint is not None:
            sizes[symbol] = int(value.node.hint)
    return sizes


class _Region:
    """What Backend.__call__ returns for a graph: its compiled variants, chosen at every call.

    A step may call several regions (graph breaks, per-block compilation, DDPOptimizer pieces),
    and one region at several positions (identical blocks share a graph). Every call asks the
    step ledger for its position and records what it holds there. The first step runs what was
    compiled when each region was first called: planned with what earlier positions hold, and,
    for any region that is not the step's first, its least-peak plan, so that regions not yet
    seen find room. Once a step has ended (its backward ran), the backend chooses one plan per
    region for the whole step (Backend.settle, memcompile/joint_plan.py) and each region
    compiles that plan at its next call: at most once per step shape. Sizes beyond the largest
    planned for (dynamic shapes) are re-planned before they run: a plan made for sizes S covers
    every size <= S, bytes only grow with sizes (see docs/design.md).
    """

    _MAX_VARIANTS = 16

    def __init__(self, backend: "Backend", gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
        self.backend = backend
        self.loss_heads: tuple[LossHead, ...] = ()
        self.mlps: tuple[MlpBlock, ...] = ()
        self.reasons: dict[str, str] = {}  # why "auto" applied a rewrite, by its attribute (for the plan)
        for rewrite in _REWRITES:
            if getattr(backend.options, rewrite.option) is True:
                gm, found = rewrite.apply(gm)
                setattr(self, rewrite.attr, found)
        self.gm = gm
        self.pristine_graph = copy.deepcopy(gm.graph)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        fakes = [n.meta.get("example_value") for n in placeholders]
        # Fake inputs (never the user's real tensors: holding those would cost memory).
        self.fake_inputs = fakes if len(fakes) == len(example_inputs) and all(f is not None for f in fakes) else None
        self.tracing_context = tp.current_tracing_context()
        self.sites = _symbol_sites(self.fake_inputs or ())
        self.sizes = _trace_sizes(self.fake_inputs or ())
        self.variants: dict[tuple, _Variant] = {}
        self.replanner: Replanner | None = None  # of the latest compile: plans it at other budgets
        self._options: tuple[Replanner, tuple[tuple[PlanOption, Any], ...]] | None = None
        self.assigned: tuple[Any, int] | None = None  # the step plan's (decisions, outside) for this region
        self._current: tuple[_Variant, int] | None = None  # what it ran last, and the outside planned for
        self._example_inputs = list(example_inputs)  # only until the first compile
        self._first: _Variant | None = None

    def _sizes_key(self) -> tuple:
        return tuple(sorted((str(k), v) for k, v in self.sizes.items()))

    def compile_first(self) -> None:
        backend = self.backend
        position = backend.ledger.next_position()
        outside = backend.ledger.outside_bytes(position)
        example_inputs, self._example_inputs = self._example_inputs, []
        # Before any step has ended, a region after the first (or compiled ahead of its call
        # behind another one, as DDPOptimizer compiles all its pieces at once) cannot know what
        # later regions need: it holds as little as it can for the first step.
        cautious = backend.in_first_step() and (position > 0 or backend.compiled_ahead > 0)
        kind = "least" if cautious else "outside"

        def compile_for(o: int, search_least_peak: bool = True) -> _Variant:
            return self._compile((kind, o, self._sizes_key()), o, self.gm, example_inputs,
                                 PlanRequest(least_peak=cautious, search_least_peak=search_least_peak))

        # Where a rewrite could lower the floor (a chunked loss head, chunked MLPs), a graph no
        # solver plan fits is not searched for its least peak before the rewritten graph is planned.
        defer = not cautious and outside <= 0 and bool(self._pending_rewrites())
        try:
            self._first = self._plan_for_position(position, outside, lambda o: compile_for(o, not defer))
        except NoSolverPlanFits:
            self._first = self._plan_rewritten(position, outside, compile_for, whole_error=None, coarse=not cautious)
        except InfeasibleBudgetError as error:
            if not self._pending_rewrites():
                raise
            self._first = self._plan_rewritten(position, outside, compile_for, whole_error=error, coarse=not cautious)
        else:
            if not cautious:
                device = backend.options.device or step_device(example_inputs)
                for rewrite in [r for r in self._pending_rewrites() if r.when_faster]:
                    self._rewrite_if_faster(rewrite, position, outside, compile_for, device)
        # Counted once compiled: a compile Dynamo abandons (it restarts its analysis from inside
        # the backend, e.g. TensorifyScalarRestartAnalysis under dynamic=True) is never called,
        # and counting it made the retried compile of a one-region step cautious (its least peak).
        backend.compiled_ahead += 1
        self._current = (self._first, outside)

    def _pending_rewrites(self) -> list["_Rewrite"]:
        """The "auto" rewrites not applied yet that would change this region's graph."""
        return [r for r in _REWRITES if getattr(self.backend.options, r.option) == "auto" and not getattr(self, r.attr)
                and r.find(self.gm.graph)]

    def _plan_rewritten(self, position: int, outside: int, compile_for: Callable[..., _Variant],
                        whole_error: InfeasibleBudgetError | None, coarse: bool = True) -> _Variant:
        """No plan fits the graph as it is (`whole_error`, its smallest budget), or no solver plan
        (None: its least peak not searched yet): apply the pending rewrites one at a time (the
        loss head, then the MLPs) and plan each graph. Without `whole_error`, only the last graph
        is searched for its least peak at first; where even that fails, the graphs before it are
        searched (from the most rewritten: a least-peak plan of one may fit), and the error names
        the smallest of their smallest budgets. Deferring the searches saved 25 of a 63 s first
        call on Llama small at 9.91 MiB (benchmarks/compile_profile.py). With `coarse`, a
        rewrite with coarser variants (_Rewrite.coarse_first) tries those first (_plan_coarse)."""
        deferred = whole_error is None
        errors = [] if deferred else [whole_error]
        unsearched = [self._head_state()] if deferred else []
        pending = self._pending_rewrites()
        for i, rewrite in enumerate(pending):
            reason = f"no {'solver ' if deferred else ''}plan fits without it"
            if coarse:
                fitted = self._plan_coarse(rewrite, reason, position, outside, compile_for)
                if fitted is not None:
                    return fitted
            self._apply(rewrite)
            self.reasons[rewrite.attr] = reason
            log.info("memcompile: %s; chunking %s: %s", self.reasons[rewrite.attr], rewrite.what,
                     "; ".join(x.describe() for x in getattr(self, rewrite.attr)))
            search = not deferred or i == len(pending) - 1
            try:
                return self._plan_for_position(position, outside, lambda o: compile_for(o, search))
            except NoSolverPlanFits:
                unsearched.append(self._head_state())
            except InfeasibleBudgetError as error:
                errors.append(error)
        for state in reversed(unsearched):
            self._restore_head_state(state)
            try:
                return self._plan_for_position(position, outside, compile_for)
            except InfeasibleBudgetError as error:
                errors.append(error)
        raise min(errors, key=lambda e: e.min_feasible_bytes)

    def _plan_coarse(self, rewrite: "_Rewrite", reason: str, position: int, outside: int,
                     compile_for: Callable[..., _Variant]) -> _Variant | None:
        """The rewrite with fewer, larger chunks (each of rewrite.coarse_first, no least-peak
        search): the first that a solver plan fits, or None with the region as it was. Fewer
        chunks cost less: ViT small at 7.76 MiB ran 1.18x the step with its MLPs in 2 chunks
        against 1.30x in 8 (the finest, what the MLPs' shapes ask for), both within the budget."""
        for limit in rewrite.coarse_first:
            saved = self._head_state()
            if not self._apply(rewrite, limit):
                return None
            self.reasons[rewrite.attr] = f"{reason}; at most {limit} chunks (the fewest tried that fit)"
            try:
                return self._plan_for_position(position, outside, lambda o: compile_for(o, False))
            except (NoSolverPlanFits, InfeasibleBudgetError):
                log.info("memcompile: no solver plan fits with %s in at most %d chunks", rewrite.what, limit)
                self._restore_head_state(saved)
        return None

    def _rewrite_if_faster(self, rewrite: "_Rewrite", position: int, outside: int,
                           compile_for: Callable[..., _Variant], device: str) -> None:
        """An "auto" rewrite where the plan without it fits by recomputing: plan the rewritten graph
        too, and keep it if its recomputation plus what the rewrite itself costs is estimated less.
        A chunked loss head never holds the logits whole, chunked MLPs never their intermediate
        activations, so the rest of the step has more room (GPT-2 small at 13.20 MiB: PyTorch's 0.4
        partition with the head whole ran 1.11x the step, the chunked head with the 0.8 partition
        1.05x; benchmarks/results/pareto_small_s12.md). Costs one more compile, only where the
        plan recomputes more than the rewrite costs."""
        current = self._first
        plan = current.plan if current is not None else None
        if plan is None or plan.added_time_s <= 0:
            return
        found = rewrite.find(self.gm.graph)
        rewrite_s = sum(x.added_time_s(profile_for(device)) for x in found)
        if not found or plan.added_time_s <= rewrite_s:
            return
        saved = self._head_state()
        self._apply(rewrite)
        self.reasons[rewrite.attr] = (
            f"estimated faster: recompute {plan.added_time_s * 1e3:.2f} ms without it, "
            f"chunking ~{rewrite_s * 1e3:.2f} ms plus this plan's recomputation")
        try:
            rewritten = self._plan_for_position(position, outside, compile_for)
        except InfeasibleBudgetError:
            rewritten = None
        if rewritten is not None and rewritten.plan is not None \
                and rewritten.plan.added_time_s + rewrite_s < plan.added_time_s:
            log.info("memcompile: chunking %s (%s): %s", rewrite.what, self.reasons[rewrite.attr],
                     "; ".join(x.describe() for x in getattr(self, rewrite.attr)))
            self._first = rewritten
            self._forget_plan(plan)
            return
        self._restore_head_state(saved)
        if rewritten is not None and rewritten.plan is not None:
            self._forget_plan(rewritten.plan)

    def _head_state(self) -> tuple:
        """What rewriting the graph changes, to go back to it as it was."""
        return (self.gm, self.loss_heads, self.mlps, self.pristine_graph, self.replanner, dict(self.variants),
                dict(self.reasons))

    def _restore_head_state(self, state: tuple) -> None:
        (self.gm, self.loss_heads, self.mlps, self.pristine_graph, self.replanner, self.variants,
         self.reasons) = state

    def _forget_plan(self, plan: Plan) -> None:
        """Drop the plan of a compile this region does not use from the backend's list."""
        self.backend.plans[:] = [p for p in self.backend.plans if p is not plan]

    def _apply(self, rewrite: "_Rewrite", max_chunks: int | None = None) -> bool:
        """Apply a rewrite (passes/loss_head.py, passes/mlp_chunk.py) for every later compile,
        into at most `max_chunks` chunks where given; False if it finds nothing to rewrite."""
        graph = fx.GraphModule(self.gm, copy.deepcopy(self.pristine_graph))
        gm, found = rewrite.apply(graph) if max_chunks is None else rewrite.apply(graph, max_chunks)
        if not found:
            return False
        self.gm = gm
        setattr(self, rewrite.attr, found)
        self.pristine_graph = copy.deepcopy(gm.graph)
        return True

    def _graph_rewrites(self) -> tuple[str, ...]:
        """What this region changed in its graph, and why, for the plan."""
        described = []
        for rewrite in _REWRITES:
            reason = self.reasons.get(rewrite.attr, "")
            described += [x.describe() + (f" ({reason})" if reason else "") for x in getattr(self, rewrite.attr)]
        return tuple(described)

    def _rewrite_time_s(self, device: str) -> float:
        """What the changes to this region's graph are estimated to add to the step by themselves."""
        profile = profile_for(device)
        return sum(x.added_time_s(profile) for rewrite in _REWRITES for x in getattr(self, rewrite.attr))

    def _compile(self, key: tuple, outside: int, gm: fx.GraphModule, example_inputs: Sequence[Any],
                 request: PlanRequest) -> _Variant:
        options = self.backend.options
        if outside:
            # What other regions hold while this one runs is, for this graph, held outside it.
            options = dataclasses.replace(options, reserve_bytes=options.reserve_bytes + outside)
        record = _CompileRecord(request=request, graph_rewrites=self._graph_rewrites(),
                                rewrite_time_s=self._rewrite_time_s(options.device or step_device(example_inputs)))
        token = _RECORD.set(record)
        try:
            with planning_sizes(self.sizes):
                fn = self.backend.compile_graph(gm, example_inputs, options)
        finally:
            _RECORD.reset(token)
        variant = _Variant(fn, record.plan, record.inputs,
                           request.solution.decisions if request.solution is not None else None)
        if request.replanner is not None:
            self.replanner = request.replanner
        if len(self.variants) >= self._MAX_VARIANTS:
            self.variants.pop(next(iter(self.variants)))
        self.variants[key] = variant
        self.backend.compiles += 1
        return variant

    def _recompile(self, key: tuple, outside: int, request: PlanRequest) -> _Variant:
        if self.fake_inputs is None:
            raise RuntimeError("memcompile: cannot re-plan a graph without fake example inputs")
        gm = fx.GraphModule(self.gm, copy.deepcopy(self.pristine_graph))
        with tp.reentered_tracing_context(self.tracing_context):
            return self._compile(key, outside, gm, self.fake_inputs, request)

    def _plan_for_position(self, position: int, outside: int, compile_for: Callable[[int], _Variant]) -> _Variant:
        try:
            return compile_for(outside)
        except InfeasibleBudgetError as error:
            backend = self.backend
            if outside <= 0 or not (backend.in_first_step() or backend.ledger.earlier_plans_stale(position)):
                raise
            # Earlier regions of this step run plans made before the later regions were known;
            # the plan for the whole step replaces them once it has ended (and raises if none
            # fits). Rather than stop a budget that may well fit then, run this step with the
            # least this region can hold.
            shortfall = error.min_feasible_bytes - self.backend.options.budget_bytes
            log.warning("memcompile: this step may run %s over the budget while its regions are first "
                        "compiled (earlier regions were planned before later ones existed); the step is "
                        "planned as a whole once it has ended", format_bytes(shortfall))
            return compile_for(max(0, outside - shortfall))

    def _replan(self, position: int, outside: int) -> _Variant:
        try:
            return self._plan_for_position(position, outside, lambda o: self._recompile(
                ("outside", o, self._sizes_key()), o, PlanRequest()))
        except InfeasibleBudgetError as error:
            self.backend.errors.append(error)
            raise

    def plan_options(self) -> tuple[tuple[PlanOption, Any], ...]:
        """(option, decisions) this region offers the step plan: from its latest compile's
        Replanner (a few solves, once per compile); just what it runs if it has none."""
        if self.replanner is None:
            variant = self._current[0] if self._current else None
            plan = variant.plan if variant is not None else None
            if plan is None:
                return ((PlanOption(0, 0, 0.0), None),)
            return ((PlanOption(plan.predicted_peak_bytes, saved_bytes_of(plan), plan.added_time_s), None),)
        if self._options is None or self._options[0] is not self.replanner:
            rows = self.replanner.options_between(_OPTIONS_BETWEEN, self.backend.options.time_limit_s)
            self._options = (self.replanner, tuple(
                (PlanOption(peak, held, added), decisions) for peak, held, added, decisions in rows))
        return self._options[1]

    def _grown_sizes(self, args: Sequence[Any]) -> dict[object, int]:
        """The sizes to plan for: the largest seen, including this call's."""
        sizes = dict(self.sizes)
        for i, d, symbol in self.sites:
            value = int(args[i] if d is None else args[i].shape[d])
            if value > sizes.get(symbol, 0):
                log.info("memcompile: size %s=%d exceeds the %d planned for; re-planning", symbol, value,
                         sizes.get(symbol, 0))
                sizes[symbol] = value
        return sizes

    def _variant_for(self, position: int, sizes_grew: bool) -> tuple[_Variant, int]:
        first, self._first = self._first, None
        if not sizes_grew:
            if first is not None:
                return first, self._current[1]  # the call right after the first compile runs it
            if self.assigned is not None:
                decisions, outside = self.assigned
                if self._current is not None and self._current[0].decisions == decisions.decisions:
                    return self._current[0], outside  # it already runs the step plan's choice
                key = ("option", decisions.decisions, self._sizes_key())
                variant = self.variants.get(key)
                if variant is None:
                    fingerprint = self.replanner.fingerprint if self.replanner is not None else None
                    variant = self._recompile(key, outside, PlanRequest(decisions=decisions, fingerprint=fingerprint))
                return variant, outside
            if self._current is not None:
                return self._current  # no step plan yet (or a one-region step): keep what runs
        outside = self.backend.ledger.outside_bytes(position)
        key = ("outside", outside, self._sizes_key())
        variant = self.variants.get(key) or self._replan(position, outside)
        self.assigned = None  # made for other sizes; the next step's plan re-plans with these
        return variant, outside

    def __call__(self, *args: Any) -> Any:
        latest = self._current[0] if self._current else next(reversed(self.variants.values()))
        if not torch.is_grad_enabled() or latest.plan is None:
            return latest.fn(*args)  # inference graphs are not planned: nothing to re-plan
        if any(tp.is_fake_tensor(a) for a in args):
            # DDPOptimizer runs each compiled piece on fake tensors while it compiles the next
            # one (for its inputs' strides): not a call of the step.
            return latest.fn(*args)
        backend, ledger = self.backend, self.backend.ledger
        backend.compiled_ahead = 0
        planned_sizes, self.sizes = self.sizes, self._grown_sizes(args)
        position = ledger.begin_call()
        try:
            if position == 0:
                backend.settle()
            variant, outside = self._variant_for(position, planned_sizes != self.sizes)
        except InfeasibleBudgetError:
            self.sizes = planned_sizes  # smaller sizes keep running under their plan
            ledger.cancel_call(position)
            raise
        self._current = (variant, outside)
        # Leaf inputs (parameters, the user's tensors) are held by the caller all step; the
        # others are activations of an earlier region. The same graph can be called with both
        # (one compiled block per position), so this is read at every call.
        held_by_caller = tuple(not isinstance(a, torch.Tensor) or a.grad_fn is None for a in args)
        footprint = variant.footprint(held_by_caller)
        if footprint is not None and ledger.record(position, footprint, outside, self):
            backend.warn_if_step_over_budget()
        if footprint is not None and variant.inputs is not None and len(args) == len(variant.inputs.nbytes):
            ledger.watch_leaves(position, _freed_leaves(args, held_by_caller, variant.inputs))
        out = variant.fn(*args)
        _on_backward(out, ledger.backward_ran)
        return out


@dataclasses.dataclass(frozen=True)
class _Rewrite:
    """A graph rewrite a region may apply before compiling, under an option True / False / "auto"."""

    what: str  # for messages
    option: str  # the Options field
    attr: str  # the _Region attribute holding what it rewrote (each with describe() and added_time_s())
    find: Callable[[fx.Graph], tuple]
    apply: Callable[[fx.GraphModule], tuple[fx.GraphModule, tuple]]
    # Also tried where a plan fits without it, if estimated faster. Not for MLPs: their chunked
    # backward recomputes the up / gate projections, measured 1.25 ms a layer on Llama small
    # (benchmarks/mlp_chunk_cost.py) where estimated 0.6: applied only where no plan fits without it.
    when_faster: bool = True
    # Chunk limits tried first, coarsest first, where no plan fits without the rewrite (`apply`
    # then takes max_chunks): the fewest chunks that fit cost the least.
    coarse_first: tuple[int, ...] = ()


# In the order "auto" tries them where no plan fits: the loss head first (cheap to chunk).
_REWRITES = (_Rewrite("the loss head", "chunk_loss", "loss_heads", find_loss_heads, chunk_loss_heads),
             _Rewrite("the MLPs", "chunk_mlp", "mlps", find_mlps, chunk_mlps, when_faster=False, coarse_first=(2,)))

# Options between a region's keep-all and least-peak plans offered to the step plan.
_OPTIONS_BETWEEN = 3


def _freed_leaves(args: Sequence[Any], held_by_caller: Sequence[bool], inputs: InputBytes) -> Callable[[], tuple[int, int]]:
    """A check, for later, of which of this call's leaf inputs have had their storage freed
    (resized to 0, as FSDP2 frees gathered parameters): (their bytes, of those with gradients)."""
    leaves = [(a.untyped_storage(), nbytes, has_grad)
              for a, held, nbytes, has_grad in zip(args, held_by_caller, inputs.nbytes, inputs.has_grad)
              if held and isinstance(a, torch.Tensor) and nbytes]

    def freed() -> tuple[int, int]:
        gone = [(nbytes, has_grad) for storage, nbytes, has_grad in leaves if storage.nbytes() == 0]
        return sum(b for b, _ in gone), sum(b for b, g in gone if g)

    return freed


def _on_backward(outputs: Any, callback: Callable[[], None]) -> None:
    """Call `callback` once the backward of these outputs' graph has run (starts a new step)."""
    for out in outputs if isinstance(outputs, (list, tuple)) else (outputs,):
        grad_fn = getattr(out, "grad_fn", None)
        if grad_fn is not None:
            grad_fn.register_hook(lambda *_: callback())
            return


class Backend:
    """What `memcompile.budget(...)` returns: pass it as `torch.compile(..., backend=...)`.

    `plans` holds the plan of every graph compiled with it, in compile order (a graph re-planned
    for what other regions hold, or for larger sizes, adds a plan). `ledger` tracks the regions of
    one step (graph breaks): see memcompile/ledger.py.
    """

    def __init__(self, options: Options) -> None:
        self.options = options
        self.plans: list[Plan] = []
        self.errors: list[Exception] = []
        self.ledger = StepLedger()
        self.compiles = 0  # graphs compiled (first compiles and re-plans)
        self.step_plans = 0  # times a plan for the whole step was chosen (settle)
        self.compiled_ahead = 0  # regions compiled since the last call (DDPOptimizer compiles all at once)
        self._settled: tuple | None = None  # the step shape the current step plan was chosen for
        self._steps_ended = False
        self._graph_count = itertools.count()
        self._warned_over = 0
        with _lock:
            self.id = next(_ids)
            _BACKENDS[self.id] = self

    def next_graph_id(self) -> str:
        return f"graph_{next(self._graph_count)}"

    def predicted_step_peak(self) -> int:
        """Predicted peak of a whole step: each region's own peak plus what the others hold then."""
        return self.ledger.predicted_step_peak()

    def in_first_step(self) -> bool:
        """No step has ended yet: regions called later in the step are still unknown."""
        return not self._steps_ended and self.ledger.completed_step() is None

    def settle(self) -> None:
        """At the start of a step: if the previous step's shape (which region ran at each position,
        and what each call held regardless of plan) differs from the one the current step plan
        was chosen for, choose one plan per region for the whole step (memcompile/joint_plan.py)
        and assign it; regions compile it at their next call. The shape does not depend on the
        plans, so this settles after one choice: at most one re-plan per region per step shape.
        Raises InfeasibleBudgetError if no combination fits."""
        completed = self.ledger.completed_step()
        if completed is None:
            return
        self._steps_ended = True
        shape = tuple((region, f.params_bytes, f.inputs_bytes, f.grads_bytes) for region, f in completed)
        if shape == self._settled:
            return
        regions = list(dict.fromkeys(region for region, _ in completed))
        if len(completed) < 2:
            for region in regions:
                region.assigned = None  # one call per step: its own plan is the step's
            self._settled = shape
            return
        menus = [region.plan_options() for region in regions]
        options = [[option for option, _ in menu] for menu in menus]
        positions = [Position(regions.index(region), f.params_bytes, f.inputs_bytes, f.grads_bytes)
                     for region, f in completed]
        budget = self.options.step_budget_bytes
        choice = choose_joint(positions, options, budget)
        if choice is None:
            least = least_step_peak(positions, options)
            need = least.step_peak_bytes + self.options.reserve_bytes
            error = InfeasibleBudgetError(
                f"memcompile: no plan of this step's {len(positions)} region calls ({len(regions)} compiled "
                f"region(s)) fits the budget of {format_bytes(self.options.budget_bytes)} "
                f"({self.options.budget_bytes} bytes"
                + self.options.reserve_text()
                + f"). The smallest budget that works is {format_bytes(need)} (min_feasible_bytes={need}), "
                "with every region at its least peak where that helps. Raise the budget, or reduce batch "
                "size / model size.", budget_bytes=self.options.budget_bytes, min_feasible_bytes=need)
            self.errors.append(error)
            log.error("%s", error)
            raise error
        peaks = joint_step_peaks(positions, options, choice.option_of)
        for r, region in enumerate(regions):
            own = options[r][choice.option_of[r]].own_peak_bytes
            outside = max(peak - own for peak, q in zip(peaks, positions) if q.region == r)
            decisions = menus[r][choice.option_of[r]][1]
            region.assigned = None if decisions is None else (decisions, outside)
        self._settled = shape
        self.step_plans += 1
        log.info("memcompile: one plan per region for the step: predicted step peak %s of %s, added time "
                 "~%.2f ms (%s)", format_bytes(choice.step_peak_bytes), format_bytes(budget),
                 choice.added_time_s * 1e3, choice.status)

    def warn_if_step_over_budget(self) -> None:
        """Regions compiled during a step can make an earlier region's running plan too large for
        the rest of this step; the next step re-plans it. Say so rather than be silent."""
        peak = self.ledger.predicted_step_peak()
        if peak > self.options.step_budget_bytes and peak > self._warned_over:
            self._warned_over = peak
            log.warning("memcompile: while new regions are compiled, this step may peak at %s, over the budget of "
                        "%s; the step is planned as a whole once it has ended", format_bytes(peak),
                        format_bytes(self.options.step_budget_bytes))

    def compile_graph(self, gm: fx.GraphModule, example_inputs: Sequence[Any], options: Options) -> Callable:
        partitioner = Partitioner(options, self.id)
        if options.codegen == "inductor":
            return tp.compile_with_inductor(gm, example_inputs, partitioner)

        def partition_fn(joint, joint_inputs, **kwargs):
            return partitioner(joint, joint_inputs, **kwargs)

        return tp.compile_with_aot_eager(gm, example_inputs, partition_fn)

    def reserve_library_workspace(self, example_inputs: Sequence[Any]) -> None:
        """Count the matmul library's workspaces (cuBLAS on CUDA: 2 x 32 MiB on an H200, measured
        in an allocator snapshot as blocks no op of the step allocated) in the reserve, once."""
        if self.options.library_workspace_bytes:
            return
        workspace = blas_workspace_bytes(step_device(example_inputs))
        if workspace:
            self.options = dataclasses.replace(self.options, reserve_bytes=self.options.reserve_bytes + workspace,
                                               library_workspace_bytes=workspace)

    def round_to_allocator(self, example_inputs: Sequence[Any]) -> None:
        """Size each allocation as the step's device allocator holds it (on CUDA: the caching
        allocator's 512 B blocks, under the allocator settings of this process), once."""
        if self.options.allocator_rounding != EXACT:
            return
        rounding = allocator_rounding_for(step_device(example_inputs), os.environ)
        if rounding != EXACT:
            self.options = dataclasses.replace(self.options, allocator_rounding=rounding)

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        self.reserve_library_workspace(example_inputs)
        self.round_to_allocator(example_inputs)
        region = _Region(self, gm, example_inputs)
        try:
            region.compile_first()
        except InfeasibleBudgetError as error:
            # Raised from the compiled callable so the user catches our type, not Dynamo's
            # wrapper; every call raises, so the step never runs over budget.
            self.errors.append(error)
            log.error("%s", error)
            saved_error = error  # `error` is unbound once the except block ends

            def over_budget(*_args: Any, **_kwargs: Any):
                raise saved_error

            return over_budget
        return region

    def __repr__(self) -> str:
        return f"memcompile.budget({self.options.describe()})"
