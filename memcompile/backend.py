"""The torch.compile backend: Dynamo graph -> AOTAutograd joint graph -> our partitioner -> codegen."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import itertools
import logging
import math
import os
import threading
import time
import warnings
import weakref
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx as fx

from memcompile import _torch_private as tp
from memcompile import check_memo, logs
from memcompile.cost_models.cuda_allocator import EXACT, allocator_rounding_for
from memcompile.cost_models.device import DeviceProfile, blas_workspace_bytes, compile_scratch_bytes
from memcompile.cost_models.op_timing import timing_allocation_limit
from memcompile.passes.graph_facts import step_device
from memcompile.passes.chunking import coarsened, find_matches
from memcompile.passes.loss_head import LossHead, with_logits_gradients
from memcompile import plan_store
from memcompile.plan_dump import write_dump_dir
from memcompile.errors import (InfeasibleBudgetError, PlannedOnly, PlanningFailedError, StepOverrunError,
                               StepOverrunWarning, UnplannedFrameError, UnplannedFrameWarning)
from memcompile.joint_plan import PlanOption
from memcompile.ledger import Footprint, InputBytes, StepLedger, footprint_of, input_bytes, saved_bytes_of
from memcompile.options import Options, with_resolved_budget
from memcompile.plan import Plan, TextEnum, format_bytes, with_input_names
from memcompile.plan_cache import source_hash
from memcompile.solver.activations import ActivationSolution
from memcompile.region_rewrites import (Rewrite, RewriteState, apply_rewrite, initial_rewrites, pending_rewrites,
                                        rewrite_named)
from memcompile.planner import (DeferredReplanner, NoSolverPlanFits, PlannedGraph, PlanRequest, Replanner,
                                confirm_on_compile, cost_profile, held_bytes, inductor_rules_for, plan_joint_graph,
                                planned_with, planning_environment, predicted_inference_peak)
from memcompile.sizes import planning_sizes, planning_sizes_now
from memcompile.step_plan import NoStepPlan, StepBudget, choose_step_plan, no_step_plan_error, step_positions
from memcompile.step_meter import BACKWARD_STARTS, Bound, StepMemory, StepMeter, unique_storage_bytes

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
    inference_peak_bytes: int | None = None  # an inference graph's predicted peak (no partitioner runs)
    input_names: tuple[str, ...] = ()  # the graph's placeholders: the plan names its inputs after them
    # raise _Planned with the plan as soon as it is made where it is estimated to add more than
    # this (-inf: always): the region compares it with a rewritten graph's before lowering either
    stop_above_s: float | None = None
    # raise _Planned where this says so of the plan just made; else the compile goes on to lower
    # it (the region weighs the plan before the graph it was made on is traced again)
    stop_if: Callable[[_Planned], bool] | None = None


class _Planned(Exception):
    """A graph's plan, made and not compiled (_CompileRecord.stop_above_s); `made`, where the
    planning can say, is what compiles the same graph to it without searching again."""

    def __init__(self, plan: Plan, made: PlannedGraph | None, replanner: Replanner | None = None) -> None:
        super().__init__(f"memcompile: planned {plan.graph_id} only, to compare")
        self.plan = plan
        self.made = made
        self.replanner = replanner  # plans the same graph again (None: none was made)


@dataclasses.dataclass(frozen=True)
class _Coarse:
    """A coarser chunking's plan, made and not compiled (_Region._plan_coarse), and its region state."""

    planned: _Planned
    state: "_Saved"
    total_s: float  # its plan's added time and what its rewrites cost


@dataclasses.dataclass(frozen=True)
class _Coarsening:
    """A chunk limit of a rewrite weighed by _Region._coarsened: the plan with it and the totals."""

    total_s: float  # the plan's added time and the rewrite's cost at this limit
    limit: int | None  # None: the finest (the rewrite as applied)
    planned: _Planned
    cost_s: float  # the rewrite's own estimated cost at this limit
    grown_bytes: int  # the rewrite's working set beyond the finest's


_RECORD: contextvars.ContextVar[_CompileRecord | None] = contextvars.ContextVar("memcompile_record", default=None)


class Partitioner(tp.PartitionerBase):
    """Inductor's `custom_partitioner_fn`: plans the joint graph under the backend's budget."""

    def __init__(self, options: Options, backend_id: int, cache_key: str | None = None) -> None:
        self.options = options
        self.backend_id = backend_id
        # everything the plan depends on besides the graph (Region._compiled_key): AOTAutograd's
        # cache, which knows the partitioner by its uuid, then serves only graphs of the same plan
        self.cache_key = cache_key

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
        primals = sum(map(tp.is_primal, gm.graph.find_nodes(op="placeholder")))
        if record is not None and len(record.input_names) == primals:  # primals_N: the N-th graph input
            plan = dataclasses.replace(plan, peak_tensors=with_input_names(plan.peak_tensors, record.input_names))
        if record is not None and (record.stop_above_s is not None or record.stop_if is not None):
            request = record.request
            replanner = request.replanner if request is not None else None
            planned = _Planned(plan, request.made if request is not None else None,
                               replanner.made if isinstance(replanner, DeferredReplanner) else replanner)
            if ((record.stop_above_s is not None and plan.added_time_s > record.stop_above_s)
                    or (record.stop_if is not None and record.stop_if(planned))):
                raise planned
        if record is not None:
            record.plan = plan
            record.inputs = inputs
        if backend is not None:
            backend.plans.append(plan)
            write_dump_dir(plan, backend.dump_dir)
            if backend.plan_only:
                raise PlannedOnly(plan)  # memcompile.max_batch: the plan, no code, no step
        if not plan.stock_inductor_rules:
            tp.mark_planned(inductor_rules_for(self.options), fw, bw)
        return fw, bw

    def uuid(self) -> str:
        # Budget, options, code and torch version: a cached graph is never reused under another plan.
        if self.cache_key is not None:
            return f"memcompile-{self.cache_key}"
        return f"memcompile-{source_hash()}-{tp.TORCH_VERSION}-{self.options.describe()}"

    def __reduce__(self):
        return (Partitioner, (self.options, self.backend_id, self.cache_key))

    def __deepcopy__(self, memo: dict) -> "Partitioner":
        return self


@dataclasses.dataclass(frozen=True)
class _Variant:
    """One compilation of a region: for what others hold (outside_bytes) and for sizes <= sizes."""

    fn: Callable
    plan: Plan | None
    inputs: InputBytes | None
    decisions: tuple | None = None  # (keep, recompute, stored) of its plan, when planned by memcompile
    cautious: bool = False  # its least-peak plan, run while the rest of the step is not known
    loss_heads: tuple[LossHead, ...] = ()  # the chunked heads of the graph it compiled
    from_autograd_cache: bool = False  # served by AOTAutograd's cache: no Replanner came with it

    def user_outputs(self, outputs: Any, args: Sequence[Any]) -> Any:
        """What the user's code returns: a chunked head's returned logits get their gradient path,
        the hidden states the graph returned for it are dropped (passes/loss_head.py)."""
        return with_logits_gradients(self.loss_heads, outputs, args)

    def footprint(self, held_by_caller: tuple[bool, ...]) -> Footprint | None:
        if self.plan is None or self.inputs is None:
            return None  # an inference graph: saves nothing
        return footprint_of(self.plan, self.inputs, held_by_caller)


@dataclasses.dataclass(frozen=True)
class _Saved:
    """What trying a rewrite changes in a region, to go back to it: the rewritten graph, and the
    latest compile's replanner and the variants compiled since."""

    rewrites: RewriteState
    replanner: Replanner | None
    variants: dict[tuple, _Variant]


class _PlannedFor(TextEnum):
    """What a variant was planned for: the head of its key in _Region.variants."""

    LEAST = "least"  # the least peak (a first step, while the rest of the step is not known)
    OUTSIDE = "outside"  # the budget beside what the rest of the step holds (the key's next element)
    OPTION = "option"  # the decisions the step plan chose among the region's options


def _rewrite_first_reason(no_fit: NoSolverPlanFits, rewrite_first_s: float | None) -> str | None:
    """Why the first rewrite is applied where a plan without it could fit (PlanRequest.rewrite_first_s)."""
    if not no_fit.rewrite_first or rewrite_first_s is None:
        return None
    return (f"PyTorch's partition is over the budget, and chunking is estimated at "
            f"{rewrite_first_s * 1e3:.2f} ms in the fewest chunks it may take, less than a plan without it could save")


def _chunked_cost_s(matches: Sequence[Any], limit: int | None, profile: DeviceProfile) -> float:
    """What a rewrite's matches are estimated to add to the step in at most `limit` chunks (None:
    as matched, the finest)."""
    return sum(x.added_time_s(profile) for x in (coarsened(tuple(matches), limit) if limit else matches))


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
    region for the whole step (Backend.settle, memcompile/step_plan.py) and each region
    compiles that plan at its next call: at most once per step shape. Sizes beyond the largest
    planned for (dynamic shapes) are re-planned before they run: a plan made for sizes S covers
    every size <= S, bytes only grow with sizes (see docs/design.md).
    """

    _MAX_VARIANTS = 16

    def __init__(self, backend: "Backend", gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
        self.backend = backend
        # What Dynamo says of the step around this graph: more follows it in its frame (a graph
        # break), its frame was called with activations (a block called inside a step), and the
        # frame's modules' parameters (later regions of the first step take some of them).
        arguments = tp.compiling_frame_arguments()
        self.ends_at_graph_break = tp.graph_ends_at_graph_break(gm)
        self.called_mid_step = _holds_activations(arguments)
        self.own_leaf_ids = tp.graph_input_ids(gm)
        backend.ledger.note_frame_leaves(_module_parameters(arguments))
        self.rewrites = initial_rewrites(gm, backend.options)  # the graph as rewritten so far
        placeholders = [n for n in self.rewrites.gm.graph.nodes if n.op == "placeholder"]
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
        self.followed_in_first_step = False
        # What eager code was measured to hold as this region's backward starts (a loss computed
        # on its output; memcompile/step_meter.py), planned for (Options.boundary_bytes).
        self.boundary_bytes = 0
        self.boundary_where = ""

    def hold_at_backward_start(self, nbytes: int, where: str, outside: int) -> None:
        """Plan for `nbytes` held by eager code as the backward starts. Unless what runs fits
        with them added at its peak (beside `outside`, what the step holds then), every variant
        made without them is dropped, so the next call plans again."""
        self.boundary_bytes, self.boundary_where = nbytes, where
        plan = self._current[0].plan if self._current is not None else None
        if plan is not None and plan.predicted_peak_bytes + nbytes + outside <= self.backend.options.step_budget_bytes:
            return
        self.variants.clear()
        self._current = self.assigned = self._first = None
        self._options = None
        self.replanner = None

    def _sizes_key(self) -> tuple:
        return tuple(sorted((str(k), v) for k, v in self.sizes.items()))

    def compile_first(self) -> None:
        backend = self.backend
        position = backend.ledger.next_position()
        outside = backend.ledger.outside_bytes(position, also_seen=self.own_leaf_ids)
        example_inputs, self._example_inputs = self._example_inputs, []
        cautious = self._cautious_first(position)
        self.followed_in_first_step = cautious  # more of the first step may follow it
        if not cautious and not backend.measured_steps:
            self._hold_returned_gradients()
        compile_for = functools.partial(self._compile_first_for, example_inputs, cautious)
        profile = cost_profile(backend.options, backend.options.device or step_device(example_inputs))

        # Where a rewrite could lower the floor (a chunked loss head, chunked MLPs), a graph no
        # solver plan fits is not searched for its least peak before the rewritten graph is planned:
        # where it is the step's one region. Buffers of the frame no region takes (HF Llama's
        # rotary table kept for a reset, `original_inv_freq`) are held beside it all the same,
        # but say nothing of regions to follow, as parameters no region has taken yet may.
        frozen_unseen = backend.ledger.unseen_leaf_bytes(self.own_leaf_ids, frozen_only=True)
        defer = not cautious and outside - frozen_unseen <= 0 and bool(self._pending_rewrites())
        # An earlier launch's ladder for this graph goes straight to the rewrites it ended with.
        ladder_key = self._ladder_key(outside) if defer else None
        # ... or raises what it ended with, where no graph of it fitted: else a later launch traces
        # and searches every rung again (benchmarks/first_call.py, its `of:0.5:plain` rows).
        refused_key = self._ladder_key(outside, f"refused position={position}") if defer else None
        if refused_key:
            self._raise_if_refused_before(refused_key)
        replayed = self._replay_ladder(ladder_key, position, outside, compile_for) if ladder_key else None
        if replayed is not None:
            self._first = replayed
            self._finish_first(None, outside)  # nothing new to store
            return
        if defer and _inputs_and_gradients_bytes(example_inputs) > backend.options.step_budget_bytes:
            # No plan of any graph of the ladder fits: the least peak of the most rewritten one is
            # all that is searched, for the floor the error names (or a plan, if an input's
            # gradient was counted that the step does not make).
            self._first = self._refused_or(refused_key, lambda: self._plan_rewritten(
                position, outside, compile_for, whole_error=None, coarse=False, only_last=True, profile=profile))
            self._finish_first(ladder_key, outside)
            return
        rewrite_first_s = self._cheap_rewrite_s(example_inputs) if defer else None

        def first_for(o: int) -> _Variant:
            # Where its plan recomputes more than a rewrite also tried when a plan fits without it
            # costs (the loss head), the graph as traced is not lowered before the rewritten
            # graph's plan is compared with its own (_rewritten_if_estimated_faster).
            cheapest = self._cheapest_rewrite_s(example_inputs) if not cautious else None
            first_s = self._cheap_rewrite_s(example_inputs) if defer else None  # (again: a retry may follow a rewrite)
            try:
                return compile_for(o, not defer, rewrite_first_s=first_s, stop_above_s=cheapest)
            except _Planned as planned:
                traced = planned
            self.rewrites = dataclasses.replace(self.rewrites, gm=self.rewrites.fresh_graph())
            chosen = self._rewritten_if_estimated_faster(traced, example_inputs, o, compile_for)
            if isinstance(chosen, _Variant):
                return chosen
            if chosen is not traced:
                return compile_for(o, planned=chosen.made)
            logs.rung("the graph as traced, compiled to the plan it was estimated with")
            return compile_for(o, not defer, rewrite_first_s=first_s, planned=traced.made)

        try:
            self._first = self._plan_for_position(position, outside, first_for)
        except StepOverrunError:
            # Not this region's own limit (earlier calls hold too much): it plans at its call,
            # which raises the error where the user sees it, and plans again if the step is run again.
            backend.compiled_ahead += 1
            return
        except NoSolverPlanFits as no_fit:
            floor_at_least = no_fit.floor_at_least
            first_reason = _rewrite_first_reason(no_fit, rewrite_first_s)
            self._first = self._refused_or(refused_key, lambda: self._plan_rewritten(
                position, outside, compile_for, whole_error=None, coarse=not cautious,
                whole_floor_at_least=floor_at_least, first_reason=first_reason, profile=profile))
        except InfeasibleBudgetError as error:
            if not self._pending_rewrites():
                raise
            whole_error = error
            self._first = self._refused_or(refused_key, lambda: self._plan_rewritten(
                position, outside, compile_for, whole_error=whole_error, coarse=not cautious, profile=profile))
        self._finish_first(ladder_key, outside)

    def _cautious_first(self, position: int) -> bool:
        """Whether the first compile plans its least peak rather than to the budget. Before any
        step has ended, a region that more of the step follows (one after the first; one that
        ends at a graph break, or was called with activations, as blocks compiled one by one
        after an embedding are; one compiled ahead of its call behind another, as DDPOptimizer
        compiles all its pieces) cannot know what later regions need: it holds as little as it
        can for the first step, and is re-planned once the step is known. A first region called
        with the step's inputs plans to the budget at once: most steps are that one region (its
        loss computed in it, or eagerly after it), and planning it twice would double its
        compile. Where more regions do follow it, a later call that cannot fit raises
        StepOverrunError before it runs (and the step run again fits)."""
        backend = self.backend
        cautious = backend.in_first_step() and (
            position > 0 or backend.compiled_ahead > 0 or self.ends_at_graph_break or self.called_mid_step)
        return cautious or backend.cautious_now()

    def _hold_returned_gradients(self) -> None:
        """Until a step is measured, a step's one region holds room as its backward starts for
        the gradient of what it returns: a loss computed on returned logits makes at least that
        (the log-softmax it saves), beside the gradient its backward counts."""
        returned = _returned_gradient_bytes(self.rewrites.gm)
        if returned:
            self.boundary_bytes = returned
            self.boundary_where = "not measured yet: the size of the outputs it returns that need a gradient"
            self.backend.defaulted_boundaries.append(self)

    def _compile_first_for(self, example_inputs: Sequence[Any], cautious: bool, outside: int,
                           search_least_peak: bool = True, partitions_only: bool = False,
                           rewrite_first_s: float | None = None, stop_above_s: float | None = None,
                           planned: PlannedGraph | None = None,
                           stop_if: Callable[[_Planned], bool] | None = None) -> _Variant:
        """One compile of the first call's graph as rewritten so far, beside `outside` (with
        `stop_above_s`, `stop_if`: see _compile; `planned`: PlanRequest.planned)."""
        backend = self.backend
        kind = _PlannedFor.LEAST if cautious else _PlannedFor.OUTSIDE
        variant = self._compile((kind, outside, self._sizes_key()), outside, self.rewrites.gm, example_inputs,
                                PlanRequest(least_peak=cautious, search_least_peak=search_least_peak,
                                            partitions_only=partitions_only, rewrite_first_s=rewrite_first_s,
                                            defer_check=backend.options.codegen == "inductor"
                                            and not backend.plan_only, planned=planned),
                                autograd_cache=not cautious, stop_above_s=stop_above_s, stop_if=stop_if)
        # the request the kept compile made (a ladder replays it)
        self.rewrites = dataclasses.replace(self.rewrites, searched_least_peak=search_least_peak)
        return variant

    def _rewritten_if_estimated_faster(self, estimate: _Planned, example_inputs: Sequence[Any], outside: int,
                                       compile_for: Callable[..., _Variant]) -> _Planned | _Variant:
        """Where the plan of the graph as it is (`estimate`) recomputes: each "auto" rewrite also
        tried where a plan fits without it (Rewrite.when_faster: the loss head), applied if the
        rewritten graph's plan plus what the rewrite itself costs is estimated faster. Both graphs
        are compared on their plans before either is lowered: the one not taken is never
        compiled. The rewritten graph's compile (`compile_for`) goes on to lower its plan where
        that is taken as it is (no coarser chunk count): its variant is returned. Else returns the
        estimate of the graph the region has now (`estimate` itself where no rewrite was
        applied), for the caller to compile to that plan.
        A chunked loss head never holds the logits whole, chunked MLPs never their intermediate
        activations, so the rest of the step has more room (GPT-2 small at 13.20 MiB: PyTorch's 0.4
        partition with the head whole ran 1.11x the step, the chunked head with the 0.8 partition
        1.05x in a run of `python benchmarks/pareto.py --models gpt2 --size small --threads 1`)."""
        profile = cost_profile(self.backend.options, self.backend.options.device or step_device(example_inputs))
        for rewrite in [r for r in self._pending_rewrites() if r.when_faster]:
            rewrite_s = self._pending_cost_s(rewrite, example_inputs)
            added_s = estimate.plan.added_time_s
            if added_s <= rewrite_s:  # (pending: it matches)
                continue
            saved = self._saved()
            self._apply(rewrite)
            logs.rung(f"{rewrite.what} chunked (is it faster than recomputing?)")
            # the reason it is kept where its compile goes on (restored with the rest where not)
            self.rewrites = self.rewrites.with_reason(
                rewrite.kind, f"estimated faster: recompute {added_s * 1e3:.2f} ms without it, "
                              f"chunking ~{rewrite_s * 1e3:.2f} ms plus this plan's recomputation")
            stop_if, weighed = self._weighing_chunk_counts(rewrite, saved, rewrite_s, profile, to_beat_s=added_s)
            rewritten: _Planned | None = None
            try:
                return compile_for(outside, False, stop_if=stop_if)
            except _Planned:
                rewritten, rewrite_s = weighed[-1]
            except (NoSolverPlanFits, InfeasibleBudgetError):
                pass
            if rewritten is not None and rewritten.plan.added_time_s + rewrite_s < added_s:
                limit = self.rewrites.chunk_limits.get(rewrite.kind)
                reason = (f"estimated faster: recompute {added_s * 1e3:.2f} ms without it, "
                          f"chunking ~{rewrite_s * 1e3:.2f} ms plus this plan's recomputation"
                          + (f"; at most {limit} chunk{'s' if limit > 1 else ''}: the count estimated fastest "
                             "with its plan, which holds the larger working set"
                             if limit is not None else ""))
                self.rewrites = self.rewrites.with_reason(rewrite.kind, reason)
                log.debug("memcompile: chunking %s (%s): %s", rewrite.what, reason,
                          "; ".join(x.describe() for x in self.rewrites.matches(rewrite.kind)))
                estimate = rewritten
                continue
            logs.rung(f"not chunking {rewrite.what}: not estimated faster")
            self._restore(saved)
        return estimate

    def _weighing_chunk_counts(self, rewrite: Rewrite, before: _Saved, rewrite_s: float, profile: DeviceProfile,
                               to_beat_s: float = math.inf
                               ) -> tuple[Callable[[_Planned], bool], list[tuple[_Planned, float]]]:
        """A `stop_if` for the compile of the graph `rewrite` was just applied to (from `before`,
        costing `rewrite_s`): its plan weighed in fewer chunks (_coarsened), the compile going on
        where the plan is taken as it is and, with the rewrite's cost, under `to_beat_s`; and the
        list it appends each weighing to (the plan chosen, the rewrite's cost at its count)."""
        weighed: list[tuple[_Planned, float]] = []

        def stop_if(planned: _Planned) -> bool:
            chosen, cost_s = self._coarsened(rewrite, before, planned, rewrite_s, profile)
            weighed.append((chosen, cost_s))
            return chosen is not planned or chosen.plan.added_time_s + cost_s >= to_beat_s

        return stop_if, weighed

    def _coarsened(self, rewrite: Rewrite, before: _Saved, rewritten: _Planned, rewrite_s: float,
                   profile: DeviceProfile) -> tuple[_Planned, float]:
        """The rewrite in fewer chunks (Rewrite.room_limits) where that is estimated faster: each
        chunk of a loss head streams its weight again, a coarser one holds a larger working set.
        Where the plan of the graph as rewritten has room under its budget for that growth, the
        plan is kept (the same candidates, decided alike) and its peak taken as that much higher;
        where it has not, the plan recomputed further to make the room (Replanner.
        fit_with_workspace, a few greedy moves from it), taken where its added time and the
        coarser rewrite's together are less. The compile checks the plan where the estimate
        deferred its check. Returns the estimate so changed and the rewrite's cost at its limit;
        `rewritten` and `rewrite_s` where no limit is faster (or the rewrite has none)."""
        plan, made = rewritten.plan, rewritten.made
        if rewrite.workspace_bytes is None or made is None:
            return rewritten, rewrite_s
        room = plan.step_budget_bytes - plan.predicted_peak_bytes
        graph = self.rewrites.gm.graph
        held = rewrite.workspace_bytes(graph, None)
        matches = self.rewrites.matches(rewrite.kind)
        finest = max(m.chunks for m in matches)
        replanner = rewritten.replanner
        # recomputing more needs the solver's plan, and a compile that checks it on its schedule
        checks_schedule = self.backend.options.codegen == "inductor" and not self.backend.plan_only
        start = made.solution if (isinstance(made.solution, ActivationSolution) and checks_schedule
                                  and replanner is not None and rewrite.workspace_op is not None) else None
        start_checked_peak = plan.predicted_peak_bytes if made.deferred is None else None
        best = _Coarsening(plan.added_time_s + rewrite_s, None, rewritten, rewrite_s, 0)
        for limit in sorted((x for x in rewrite.room_limits if x < finest), reverse=True):  # more chunks first
            grown = rewrite.workspace_bytes(graph, limit) - held
            cost = _chunked_cost_s(matches, limit, profile)
            if grown <= room:
                raised = dataclasses.replace(plan, predicted_peak_bytes=plan.predicted_peak_bytes + grown)
                candidate = _Planned(raised, dataclasses.replace(made, plan=raised), replanner)
            elif start is None:
                break
            elif plan.added_time_s + cost >= best.total_s:
                continue  # not even without more recomputation; a coarser limit costs less
            else:
                attempt = replanner.fit_with_workspace(plan.step_budget_bytes, rewrite.workspace_op, start,
                                                       extra_bytes=grown, start_checked_peak=start_checked_peak,
                                                       time_limit_s=self.backend.options.time_limit_s)
                if attempt is None:
                    break  # a coarser limit grows the working set more
                again = planned_with(made, replanner, attempt)
                candidate = _Planned(again.plan, again, replanner)
            total = candidate.plan.added_time_s + cost
            log.debug("memcompile: %s in at most %d chunks: %s more working set, plan %.2f ms + rewrite %.2f ms",
                      rewrite.what, limit, format_bytes(grown), candidate.plan.added_time_s * 1e3, cost * 1e3)
            if total >= best.total_s and grown > room:
                # the plan's time grows with the working set, the head's cost falls less and less:
                # taken as past the least total (each further limit is another plan, ~10 s at 24 layers)
                break
            if total < best.total_s:
                best = _Coarsening(total, limit, candidate, cost, grown)
        limit, chosen, cost, grown = best.limit, best.planned, best.cost_s, best.grown_bytes
        if limit is None:
            return rewritten, rewrite_s
        self._restore(before)
        if not self._apply(rewrite, limit):  # (it matched at the finest count)
            raise PlanningFailedError(f"memcompile: {rewrite.what} no longer matches in at most {limit} chunks")
        recomputed = chosen.plan.added_time_s - plan.added_time_s
        logs.rung(f"{rewrite.what} in at most {limit} chunk{'s' if limit > 1 else ''} ("
                  + (f"its plan recomputes {recomputed * 1e3:.2f} ms more" if chosen.made is not None
                     and chosen.made.solution is not made.solution else "its plan has room")
                  + f" for {format_bytes(grown)} more working set)")
        return chosen, cost

    def _raise_if_refused_before(self, refused_key: str) -> None:
        """Raise what an earlier launch's ladder for this graph ended with, where no graph of it fitted."""
        options = self.backend.options
        refused = plan_store.load(options.plan_store_dir, refused_key)
        if refused is not None and refused.kind == plan_store.Outcome.INFEASIBLE:
            logs.stage("no graph of this region's rewrite ladder fitted this budget in an earlier launch (plan store)")
            raise InfeasibleBudgetError(refused.error_message, budget_bytes=options.budget_bytes,
                                        min_feasible_bytes=refused.min_feasible_bytes,
                                        contributors=refused.contributors, whole_step=refused.whole_step)

    def _pending_cost_s(self, rewrite: Rewrite, example_inputs: Sequence[Any]) -> float:
        """What `rewrite`, not applied yet, is estimated to add to the step by itself."""
        profile = cost_profile(self.backend.options, self.backend.options.device or step_device(example_inputs))
        return _chunked_cost_s(find_matches(self.rewrites.gm.graph, rewrite.pattern), None, profile)

    def _cheap_rewrite_s(self, example_inputs: Sequence[Any]) -> float | None:
        """The least estimated added time of the first pending rewrite, at any chunk count it may
        take (Rewrite.room_limits, or the finest), where it is one also tried when a plan fits
        without it (the loss head: Rewrite.when_faster); None otherwise. Its graph's plan takes the
        fewest chunks it has room for (_plan_rewritten): each chunk of a loss head streams its
        weight again (GPT style file, 12 layers, 4 x 512: 16 chunks ~962 ms, 2 chunks ~146 ms,
        against a 26.5 s step)."""
        pending = self._pending_rewrites()
        if not pending or not pending[0].when_faster:
            return None
        rewrite = pending[0]
        profile = cost_profile(self.backend.options, self.backend.options.device or step_device(example_inputs))
        matches = find_matches(self.rewrites.gm.graph, rewrite.pattern)
        return min(_chunked_cost_s(matches, limit, profile) for limit in (None, *rewrite.room_limits))

    def _cheapest_rewrite_s(self, example_inputs: Sequence[Any]) -> float | None:
        """The least estimated added time of the pending rewrites also tried where a plan fits
        without them (Rewrite.when_faster), or None where there is none (or no joint graph)."""
        if not _needs_gradient(example_inputs):
            return None
        return min((self._pending_cost_s(r, example_inputs) for r in self._pending_rewrites() if r.when_faster),
                   default=None)

    def _finish_first(self, ladder_key: str | None, outside: int) -> None:
        if ladder_key is not None:
            self._store_ladder(ladder_key)
        # Counted once compiled: a compile Dynamo abandons (it restarts its analysis from inside
        # the backend, e.g. TensorifyScalarRestartAnalysis under dynamic=True) is never called,
        # and counting it made the retried compile of a one-region step cautious (its least peak).
        self.backend.compiled_ahead += 1
        self._current = (self._first, outside)

    def _refused_or(self, refused_key: str | None, plan: Callable[[], _Variant]) -> _Variant:
        """plan(); where it raises InfeasibleBudgetError, that is stored under `refused_key` first."""
        try:
            return plan()
        except InfeasibleBudgetError as error:
            if refused_key is not None:
                plan_store.save(self.backend.options.plan_store_dir, refused_key, plan_store.StoredOutcome(
                    plan_store.Outcome.INFEASIBLE, error_message=str(error),
                    min_feasible_bytes=error.min_feasible_bytes, contributors=tuple(error.contributors),
                    whole_step=error.whole_step))
            raise

    def _pending_rewrites(self) -> list[Rewrite]:
        """The "auto" rewrites not applied yet that would change this region's graph."""
        return pending_rewrites(self.rewrites, self.backend.options)

    def _plan_rewritten(self, position: int, outside: int, compile_for: Callable[..., _Variant],
                        whole_error: InfeasibleBudgetError | None, coarse: bool = True,
                        whole_floor_at_least: int = 0, only_last: bool = False,
                        first_reason: str | None = None, profile: DeviceProfile | None = None) -> _Variant:
        """No plan fits the graph as it is (`whole_error`, its smallest budget), or no solver plan
        (None: its least peak not searched yet): apply the pending rewrites one at a time (the
        loss head, then the MLPs) and plan each graph. Without `whole_error`, only the last graph
        is searched for its least peak at first; where even that fails, the graphs before it are
        searched (from the most rewritten: a least-peak plan of one may fit), and the error names
        the smallest of their smallest budgets. Deferring the searches saved 25 of a 63 s first
        call on Llama small at 9.91 MiB (benchmarks/compile_profile.py). With `coarse`, a
        rewrite with coarser variants (Rewrite.coarse_first) tries those first (_plan_coarse).
        Once one graph's least peak is known, the graphs before it are tried only for the least
        peak of PyTorch's partitions (PlanRequest.partitions_only: a rewrite seldom raises the
        solver's least peak, but a partition's kernel order can be lower: GPT style, 12 layers,
        the chunked head's 0.4 partition peaked 150 MB below the chunked MLPs' least-peak plan),
        and not where their NoSolverPlanFits says no plan of them fits below the floor found
        (`floor_at_least`; `whole_floor_at_least` for the graph as it is). With `only_last`,
        where the inputs and their gradients alone are over the budget, only the last graph is
        planned, and its least peak is the floor the error names: a run at it fits, and the
        graphs before are not lowered again for a floor perhaps a partition's kernel order
        lower (GPT style, 12 layers, tied gradients accumulated: the chunked head's 0.4 partition
        checked 1004.05 MiB, the chunked MLPs' floor 1003.30 MiB). `first_reason`: why the first rewrite is applied
        where not because no plan fits without it (PlanRequest.rewrite_first_s); with `profile`,
        that rewrite takes the fewest chunks its graph's plan has room for (_coarsened, as where it
        is tried because estimated faster): its compile stops once the plan is made only where a
        coarser count is taken (_CompileRecord.stop_if), else it goes on to lower that plan.
        Where a coarser variant's plan recomputes more than the finest chunking would cost beyond
        it (`profile`'s estimates), the finest graph is planned too and the faster of the two
        compiled (_Coarse)."""
        deferred = whole_error is None
        errors = [] if deferred else [whole_error]
        unsearched = [(self._saved(), whole_floor_at_least)] if deferred and not only_last else []
        pending = self._pending_rewrites()
        for i, rewrite in enumerate(pending):
            reason = ("the inputs and their gradients alone exceed the budget" if only_last
                      else first_reason if i == 0 and first_reason
                      else f"no {'solver ' if deferred else ''}plan fits without it")
            coarser: _Coarse | None = None
            if coarse:
                fitted, coarser = self._plan_coarse(rewrite, reason, position, outside, compile_for, profile)
                if fitted is not None:
                    return fitted
            before = self._saved()
            self._apply(rewrite)
            self.rewrites = self.rewrites.with_reason(rewrite.kind, reason)
            logs.rung(f"{rewrite.what} chunked ({reason})")
            log.debug("memcompile: %s; chunking %s: %s", reason, rewrite.what,
                      "; ".join(x.describe() for x in self.rewrites.matches(rewrite.kind)))
            search = not deferred or i == len(pending) - 1
            if only_last and not search:
                continue
            if i == 0 and first_reason and profile is not None and rewrite.room_limits:
                # compiled as its plan is made, unless fewer chunks are estimated faster
                stop_if, weighed = self._weighing_chunk_counts(
                    rewrite, before, _chunked_cost_s(self.rewrites.matches(rewrite.kind), None, profile), profile)
                try:
                    return self._plan_for_position(position, outside,
                                                   lambda o, stop_if=stop_if: compile_for(o, False, stop_if=stop_if))
                except _Planned:
                    chosen = weighed[-1][0]
                except NoSolverPlanFits as no_fit:
                    unsearched.append((self._saved(), no_fit.floor_at_least))
                    continue
                except InfeasibleBudgetError as error:
                    errors.append(error)
                    continue
                limit = self.rewrites.chunk_limits.get(rewrite.kind)
                self.rewrites = self.rewrites.with_reason(
                    rewrite.kind, reason + (f"; at most {limit} chunk{'s' if limit > 1 else ''}: the fewest its "
                                            "plan has room for" if limit is not None else ""))
                return self._plan_for_position(position, outside, lambda o, made=chosen.made: compile_for(o, planned=made))
            stop = (coarser.total_s - self.rewrites.added_time_s(profile)
                    if coarser is not None and profile is not None else None)
            try:
                return self._plan_for_position(position, outside,
                                               lambda o, search=search, stop=stop: compile_for(o, search, stop_above_s=stop))
            except _Planned:  # (asked for only with a coarser plan to beat: the finest is no faster)
                if coarser is None:
                    raise
                return self._compile_coarse(coarser, position, outside, compile_for)
            except NoSolverPlanFits as no_fit:
                if coarser is not None:
                    return self._compile_coarse(coarser, position, outside, compile_for)
                unsearched.append((self._saved(), no_fit.floor_at_least))
            except InfeasibleBudgetError as error:
                if coarser is not None:
                    return self._compile_coarse(coarser, position, outside, compile_for)
                errors.append(error)
        for state, floor_at_least in reversed(unsearched):
            if errors and floor_at_least >= min(e.min_feasible_bytes for e in errors):
                log.debug("memcompile: a graph of the ladder needs at least %d bytes, no less than the floor "
                          "found: not searched", floor_at_least)
                continue
            self._restore(state)
            logs.rung("the least peak of PyTorch's partitions of the graphs before" if errors
                      else "the least-peak search of the graphs tried")
            try:
                return self._plan_for_position(position, outside, lambda o: compile_for(o, True, bool(errors)))
            except InfeasibleBudgetError as error:
                errors.append(error)
        raise min(errors, key=lambda e: e.min_feasible_bytes)

    def _plan_coarse(self, rewrite: Rewrite, reason: str, position: int, outside: int,
                     compile_for: Callable[..., _Variant], profile: DeviceProfile | None
                     ) -> tuple[_Variant | None, _Coarse | None]:
        """The rewrite with fewer, larger chunks (each of rewrite.coarse_first, no least-peak
        search): the first that a solver plan fits, compiled; or (None, None) with the region as it
        was. Fewer chunks cost less: ViT small at 7.76 MiB ran 1.18x the step with its MLPs in 2
        chunks against 1.30x in 8 (the finest, what the MLPs' shapes ask for), both within the
        budget. But a plan that recomputes more than chunking finer would cost beyond it (GPT style
        file, 12 layers, 4 x 512, near its floor: 3.5 s added with the MLPs in 2 chunks, 0.5 s with
        them in 8) is not compiled: it is returned (None, its _Coarse) with the region as it was,
        for the caller to weigh against the finest graph's plan."""
        finest_s = (_chunked_cost_s(find_matches(self.rewrites.gm.graph, rewrite.pattern), None, profile)
                    if profile is not None else None)
        for limit in rewrite.coarse_first:
            saved = self._saved()
            if not self._apply(rewrite, limit):
                return None, None
            self.rewrites = self.rewrites.with_reason(
                rewrite.kind, f"{reason}; at most {limit} chunks (the fewest tried that fit)")
            logs.rung(f"{rewrite.what} in at most {limit} chunks ({reason})")
            rewrite_s = self.rewrites.added_time_s(profile) if profile is not None else 0.0
            # what chunking finer costs beyond this: a plan recomputing more is weighed against it
            stop = (finest_s - _chunked_cost_s(self.rewrites.matches(rewrite.kind), None, profile)
                    if profile is not None and finest_s is not None else None)
            try:
                # The finest chunking's plan recomputes no more than this one's (it holds less), so
                # this graph beats it by at most `stop`: where PyTorch's default partition of it is
                # over the budget and `stop` is within noise of the step, it is not searched (as a
                # cheap rewrite is applied first: PlanRequest.rewrite_first_s).
                planned_fit = self._plan_for_position(
                    position, outside, lambda o, stop=stop: compile_for(o, False, stop_above_s=stop, rewrite_first_s=stop))
                return planned_fit, None
            except _Planned as planned:
                log.debug("memcompile: with %s in at most %d chunks the plan adds %.2f ms, more than chunking finer "
                          "costs beyond it (%.2f ms): the finest graph is planned to compare", rewrite.what, limit,
                          planned.plan.added_time_s * 1e3, (stop or 0.0) * 1e3)
                coarser = _Coarse(planned, self._saved(), planned.plan.added_time_s + rewrite_s)
                self._restore(saved)
                return None, coarser
            except (NoSolverPlanFits, InfeasibleBudgetError):
                log.debug("memcompile: no solver plan fits with %s in at most %d chunks", rewrite.what, limit)
                self._restore(saved)
        return None, None

    def _compile_coarse(self, coarser: _Coarse, position: int, outside: int,
                        compile_for: Callable[..., _Variant]) -> _Variant:
        """The coarser graph compiled to the plan made for it (_plan_coarse)."""
        self._restore(coarser.state)
        self.rewrites = dataclasses.replace(self.rewrites, gm=self.rewrites.fresh_graph())
        logs.rung("the coarser chunking, compiled to its plan: the finest graph's plan is no faster, or none fits")
        return self._plan_for_position(position, outside, lambda o: compile_for(o, False, planned=coarser.planned.made))

    def _saved(self) -> _Saved:
        """What trying a rewrite changes, to go back to it as it was."""
        return _Saved(self.rewrites, self.replanner, dict(self.variants))

    def _restore(self, saved: _Saved) -> None:
        self.rewrites, self.replanner, self.variants = saved.rewrites, saved.replanner, saved.variants

    def _forget_plan(self, plan: Plan) -> None:
        """Drop the plan of a compile this region does not use from the backend's list."""
        self.backend.plans[:] = [p for p in self.backend.plans if p is not plan]

    def _apply(self, rewrite: Rewrite, max_chunks: int | None = None) -> bool:
        """Apply a rewrite for every later compile, into at most `max_chunks` chunks where given;
        False if it finds nothing to rewrite."""
        rewritten = apply_rewrite(self.rewrites, rewrite, max_chunks)
        if rewritten is None:
            return False
        self.rewrites = rewritten
        return True

    def _ladder_key(self, outside: int, what: str = "") -> str | None:
        """The plan store's key of this region's rewrite ladder: its Dynamo graph, the options,
        what others hold, the machine; None where not stored (symbolic sizes, no store)."""
        options = self.backend.options
        if not options.plan_store_dir or self.fake_inputs is None:
            return None
        device = options.device or step_device(self.fake_inputs)
        return plan_store.outcome_key(self.rewrites.gm, num_fwd_outputs=-1, static_lifetime_input_indices=None,
                                      options_text=options.describe(),
                                      request_text=f"ladder outside={outside}" + (f" {what}" if what else ""),
                                      environment_text=planning_environment(device))

    def _replay_ladder(self, key: str, position: int, outside: int,
                       compile_for: Callable[..., _Variant]) -> _Variant | None:
        """The rewrites an earlier launch's ladder ended with, applied at once and planned (its
        plan is then in the store too); None, with the region as it was, if that does not fit."""
        stored = plan_store.load_ladder(self.backend.options.plan_store_dir, key)
        if not stored:
            return None
        moves, search = stored
        saved = self._saved()
        for name, limit, reason in moves:
            rewrite = rewrite_named(name)
            if rewrite is None or self.rewrites.matches(rewrite.kind) or not self._apply(rewrite, limit):
                self._restore(saved)
                return None
            self.rewrites = self.rewrites.with_reason(rewrite.kind, reason)
            logs.rung(f"{rewrite.what} chunked, as an earlier launch chose ({reason})")
        try:
            return self._plan_for_position(position, outside, lambda o: compile_for(o, search))
        except (NoSolverPlanFits, InfeasibleBudgetError, StepOverrunError):
            self._restore(saved)
            return None

    def _store_ladder(self, key: str) -> None:
        moves = self.rewrites.ladder_moves(self.backend.options)
        if moves:
            plan_store.save_ladder(self.backend.options.plan_store_dir, key, moves, self.rewrites.searched_least_peak)

    def _compiled_key(self, options: Options, request: PlanRequest, gm: fx.GraphModule,
                      example_inputs: Sequence[Any]) -> str | None:
        """The key of this compile's plan beside AOTAutograd's cache entry (the partitioner's
        uuid): the graph, the options, the request, the sizes planned for and the machine; None
        where that cache is not used: not Inductor, no plan store, planning only, a forced plan,
        no gradient (an inference graph is checked where it compiles), sizes not readable."""
        backend = self.backend
        if (options.codegen != "inductor" or not options.plan_store_dir or backend.plan_only
                or request.decisions is not None or not _needs_gradient(example_inputs)):
            return None
        device = options.device or step_device(example_inputs)
        asked = (f"compiled least_peak={request.least_peak} search={request.search_least_peak} "
                 f"partitions_only={request.partitions_only} defer_check={request.defer_check} "
                 f"rewrite_first={request.rewrite_first_s is not None} "
                 f"sizes={self._sizes_key()}")
        return plan_store.outcome_key(gm, num_fwd_outputs=-1, static_lifetime_input_indices=None,
                                      options_text=options.describe(), request_text=asked,
                                      environment_text=planning_environment(device))

    def _compile_setup(self, outside: int, gm: fx.GraphModule, example_inputs: Sequence[Any],
                       request: PlanRequest) -> tuple[Options, _CompileRecord]:
        """The options a compile beside `outside` plans with, and the record its partitioner fills."""
        eager = self.backend.ledger.eager_bytes() if outside else 0
        options = dataclasses.replace(self.backend.options, boundary_bytes=self.boundary_bytes, eager_outside_bytes=eager,
                                      eager_where=self.boundary_where if self.boundary_bytes >= eager
                                      else self.backend.ledger.eager_where())
        if outside:
            # What other regions hold while this one runs is, for this graph, held outside it; and
            # this compile (at a call, beside it) holds its scratch then. A step's only region, or
            # its first, compiles while little more than the parameters and inputs are live.
            scratch = self.backend.compile_scratch
            options = dataclasses.replace(options, reserve_bytes=options.reserve_bytes + outside + scratch,
                                          compile_scratch_bytes=scratch)
        profile = cost_profile(self.backend.options, options.device or step_device(example_inputs))
        record = _CompileRecord(request=request, graph_rewrites=self.rewrites.described(),
                                rewrite_time_s=self.rewrites.added_time_s(profile),
                                input_names=tuple(n.name for n in gm.graph.find_nodes(op="placeholder")))
        return options, record

    @contextlib.contextmanager
    def _compiling(self, options: Options, record: _CompileRecord, example_inputs: Sequence[Any]) -> Iterator[None]:
        """The scope one compile (or estimate) of this region runs in: its record for the
        partitioner, the sizes planned for, the memory op timing may take, the checks remembered."""
        token = _RECORD.set(record)
        try:
            # op timing runs while the compile's own copies are live (counted in the reserve or not)
            headroom = _headroom_bytes(options, example_inputs) - (self.backend.compile_scratch - options.compile_scratch_bytes)
            with planning_sizes(self.sizes), timing_allocation_limit(headroom), \
                    check_memo.remembering(self.backend.checks):
                yield
        finally:
            _RECORD.reset(token)

    def _compile(self, key: tuple, outside: int, gm: fx.GraphModule, example_inputs: Sequence[Any],
                 request: PlanRequest, autograd_cache: bool = False, stop_above_s: float | None = None,
                 stop_if: Callable[[_Planned], bool] | None = None) -> _Variant:
        """One compile; with `stop_above_s`, _Planned instead where the plan is estimated to add
        more than that, with `stop_if`, where it says so of the plan (nothing lowered:
        _CompileRecord.stop_above_s, stop_if)."""
        options, record = self._compile_setup(outside, gm, example_inputs, request)
        record.stop_above_s = stop_above_s
        record.stop_if = stop_if
        schedules: list[tp.CompiledSchedule] = []  # the compile's own, for a plan chosen on a bound
        cache_key = self._compiled_key(options, request, gm, example_inputs) if autograd_cache else None
        with self._compiling(options, record, example_inputs):
            fn = self.backend.compile_graph(gm, example_inputs, options, schedules, cache_key)
        from_cache = cache_key is not None and record.plan is None and record.inference_peak_bytes is None
        if from_cache:
            # AOTAutograd's cache served the graphs (no partitioner ran): their plan is the one kept
            # under the same key when they were compiled; without it, compiled again uncached
            stored = plan_store.load(options.plan_store_dir, cache_key)
            if stored is None or stored.kind != plan_store.Outcome.COMPILED:
                log.debug("memcompile: AOTAutograd's cache had this graph but the plan store not its plan; "
                          "compiling it again")
                again = self.rewrites.fresh_graph()
                # (nothing is kept under the key: the cached graphs may be a plan its compile's
                # schedule did not confirm, which AOTAutograd stored before the check)
                return self._compile(key, outside, again, example_inputs, request, autograd_cache=False)
            record.plan = plan_store.as_loaded(stored.plan, self.backend.next_graph_id())
            record.inputs = stored.inputs
            request.solution = stored.solution
            self.backend.plans.append(record.plan)
            logs.stage(f"{record.plan.graph_id}: compiled graphs and their plan from the caches of an earlier launch")
        if request.deferred is not None:
            self.backend.deferred_checks += 1
            confirmed = confirm_on_compile(request.deferred, schedules, record.plan)
            request.deferred = None
            if confirmed is None:
                # over the budget on the compiled schedule (or none built: a cached compile):
                # planned again, every candidate checked before it is compiled
                self.backend.deferred_checks_failed += 1
                log.info("memcompile: %s: the plan, chosen on an estimate, was not confirmed by its compiled "
                         "schedule; planning again with checks", record.plan.graph_id)
                self._forget_plan(record.plan)
                again = self.rewrites.fresh_graph()
                checked = dataclasses.replace(request, defer_check=False, planned=None)
                return self._compile(key, outside, again, example_inputs, checked, autograd_cache)
            self.backend.plans[:] = [confirmed if p is record.plan else p for p in self.backend.plans]
            record.plan = confirmed
        if cache_key is not None and not from_cache and record.plan is not None:
            plan_store.save(options.plan_store_dir, cache_key, plan_store.StoredOutcome(
                plan_store.Outcome.COMPILED, plan=record.plan, solution=request.solution, inputs=record.inputs))
        if record.inference_peak_bytes is not None:
            _check_inference_peak(record.inference_peak_bytes, options)
        variant = _Variant(fn, record.plan, record.inputs,
                           request.solution.decisions if request.solution is not None else None,
                           cautious=request.least_peak, loss_heads=self.rewrites.loss_heads,
                           from_autograd_cache=from_cache)
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
        gm = self.rewrites.fresh_graph()
        # Compiled at a call, mid-step, outside Dynamo (which keeps the random state around its
        # own compiles): planning times ops and checks plans on random inputs, and the step's
        # random stream (its dropout masks) must not move, or a seeded step would not repeat.
        with tp.reentered_tracing_context(self.tracing_context), _random_state_kept(self.fake_inputs):
            return self._compile(key, outside, gm, self.fake_inputs, request)

    def _plan_for_position(self, position: int, outside: int, compile_for: Callable[[int], _Variant]) -> _Variant:
        try:
            return compile_for(outside)
        except InfeasibleBudgetError as error:
            backend = self.backend
            if backend.in_first_step() and (position > 0 or self.followed_in_first_step) and error.whole_step:
                error = _for_the_step_so_far(error, position)  # later regions are not known yet
            if outside <= 0 or not (backend.in_first_step() or backend.ledger.earlier_plans_stale(position)):
                raise error
            shortfall = error.min_feasible_bytes - backend.options.budget_bytes
            reducible = backend.reducible_saved_bytes(position)
            if shortfall > reducible:
                # Even with every earlier call at its least peak this one would not fit: no plan
                # of the step does. The floor assumes them at their least.
                raise InfeasibleBudgetError(
                    str(error).replace(str(error.min_feasible_bytes), str(error.min_feasible_bytes - reducible)),
                    budget_bytes=error.budget_bytes, min_feasible_bytes=error.min_feasible_bytes - reducible,
                    contributors=error.contributors, whole_step=error.whole_step) from error
            # Earlier calls of this step run plans made before this region was known (the first
            # step's single regions, a region compiled after the step plan was chosen): the plan
            # for the whole step replaces them once it has ended, but this step would run over.
            backend.first_step_overrun(error, position)  # raises, unless on_first_step_overrun="warn"
            return compile_for(max(0, outside - shortfall))

    def _fit_to_position(self, position: int, variant: _Variant, outside: int,
                         held_grads: int = 0) -> tuple[_Variant, int]:
        """Before a call runs: the variant's peak plus what the rest of the step holds now (the
        ledger) and the gradients its inputs already have (accumulated over micro-steps, which
        its plan did not count) within the budget; else this region's plan for that (a region
        called again at a later position of the first step, as identical blocks are, plans its
        least peak). Where no plan fits, InfeasibleBudgetError before the call runs."""
        backend = self.backend
        held = backend.ledger.outside_bytes(position) + held_grads
        plan = variant.plan
        if plan is None:
            return variant, outside
        kept = backend.kept_at(position, self)
        if kept is not None and kept[0] is variant and not held_grads and not backend.cautious_now():
            return variant, outside  # it ran here in a step measured within the budget
        cautious_now = backend.cautious_now() and not variant.cautious
        if plan.predicted_peak_bytes + held <= backend.options.step_budget_bytes and not cautious_now:
            return variant, outside
        least = backend.in_first_step() or variant.cautious or backend.cautious_now()
        planned_for = _PlannedFor.LEAST if least else _PlannedFor.OUTSIDE
        key = (planned_for, held, self._sizes_key())
        fitted = self.variants.get(key)
        if fitted is None:
            log.info("memcompile: %s at step position %d would peak at %s with what the step holds then; "
                     "planning it for that", plan.graph_id, position, format_bytes(plan.predicted_peak_bytes + held))
            try:
                fitted = self._plan_for_position(position, held, lambda o: self._recompile(
                    (planned_for, o, self._sizes_key()), o, PlanRequest(least_peak=least)))
            except InfeasibleBudgetError as error:
                if held_grads:
                    error = InfeasibleBudgetError(
                        f"{error} (It counts the {format_bytes(held_grads)} of gradients this call's inputs already "
                        "hold: gradients accumulated over micro-steps live from the step's start.)",
                        budget_bytes=error.budget_bytes, min_feasible_bytes=error.min_feasible_bytes,
                        contributors=error.contributors)
                self.backend.errors.append(error)
                raise error
        return fitted, held

    def _replan(self, position: int, outside: int) -> _Variant:
        least = self.backend.cautious_now()
        kind = _PlannedFor.LEAST if least else _PlannedFor.OUTSIDE
        try:
            return self._plan_for_position(position, outside, lambda o: self._recompile(
                (kind, o, self._sizes_key()), o, PlanRequest(least_peak=least)))
        except InfeasibleBudgetError as error:
            self.backend.errors.append(error)
            raise

    def least_saved_bytes(self) -> int:
        """What this region's least-peak plan holds from its forward to its backward (0 when it
        has no plan to offer: what it runs is all there is)."""
        current = self._current[0] if self._current else None
        if current is not None and current.cautious:
            return saved_bytes_of(current.plan) if current.plan is not None else 0
        if self.replanner is None:
            return saved_bytes_of(current.plan) if current is not None and current.plan is not None else 0
        least = self.replanner.least_peak()
        return held_bytes(self.replanner.analysis.problem, least.solution)

    def plan_options(self) -> tuple[tuple[PlanOption, Any], ...]:
        """(option, decisions) this region offers the step plan: from its latest compile's
        Replanner (a few solves, once per compile); just what it runs if it has none."""
        current = self._current[0] if self._current else None
        if self.replanner is None and current is not None and current.from_autograd_cache \
                and self.fake_inputs is not None:
            # served by AOTAutograd's cache, with no Replanner: traced again to offer the options
            self._recompile((_PlannedFor.OUTSIDE, self._current[1], self._sizes_key()), self._current[1], PlanRequest())
        if self.replanner is None:
            variant = self._current[0] if self._current else None
            plan = variant.plan if variant is not None else None
            if plan is None:
                return ((PlanOption(0, 0, 0.0), None),)
            return ((PlanOption(plan.predicted_peak_bytes, saved_bytes_of(plan), plan.added_time_s), None),)
        if self._options is None or self._options[0] is not self.replanner:
            # Planned at a call, after Dynamo returned: PyTorch's partitioner needs the graph's fake
            # mode for random ops (their seed's placeholder), and op timing must not move the
            # step's random stream (as in _recompile).
            with tp.reentered_tracing_context(self.tracing_context), _random_state_kept(self.fake_inputs or ()):
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
                log.debug("memcompile: size %s=%d exceeds the %d planned for; re-planning", symbol, value,
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
                key = (_PlannedFor.OPTION, decisions.decisions, self._sizes_key())
                variant = self.variants.get(key)
                if variant is None:
                    fingerprint = self.replanner.fingerprint if self.replanner is not None else None
                    variant = self._recompile(key, outside, PlanRequest(decisions=decisions, fingerprint=fingerprint))
                return variant, outside
            kept = self.backend.kept_at(position, self)
            if kept is not None:
                return kept
            cautious_after_first = self._current is not None and self._current[0].cautious \
                and not self.backend.in_first_step()
            if self._current is not None and not cautious_after_first:
                return self._current  # no step plan yet (or a one-region step): keep what runs
            # a least-peak plan of the first step, in a step now known to be this region alone
        outside = self.backend.ledger.outside_bytes(position)
        key = (_PlannedFor.OUTSIDE, outside, self._sizes_key())
        variant = self.variants.get(key) or self._replan(position, outside)
        self.assigned = None  # made for other sizes; the next step's plan re-plans with these
        return variant, outside

    def __call__(self, *args: Any) -> Any:
        latest = self._current[0] if self._current else next(reversed(self.variants.values()), None)
        if latest is not None and (not torch.is_grad_enabled() or latest.plan is None):
            # inference graphs are not planned: nothing to re-plan
            return latest.user_outputs(latest.fn(*args), args)
        if any(tp.is_fake_tensor(a) for a in args):
            # DDPOptimizer runs each compiled piece on fake tensors while it compiles the next
            # one (for its inputs' strides): not a call of the step.
            return latest.user_outputs(latest.fn(*args), args)
        backend, ledger = self.backend, self.backend.ledger
        backend.pause_measuring()  # re-plans below allocate: not the step's memory
        backend.compiled_ahead = 0
        planned_sizes, self.sizes = self.sizes, self._grown_sizes(args)
        # Leaf inputs (parameters, the user's tensors) are held by the caller all step; the
        # others are activations of an earlier region. The same graph can be called with both
        # (one compiled block per position), so this is read at every call.
        held_by_caller = tuple(not isinstance(a, torch.Tensor) or a.grad_fn is None for a in args)
        held_grads = _accumulated_grad_bytes(args, held_by_caller)
        position = ledger.begin_call(id(a) for a, held in zip(args, held_by_caller)
                                     if held and isinstance(a, torch.Tensor))
        try:
            if position == 0:
                backend.stop_measuring()  # a measured step read late (its figures apply from here)
                backend.settle()
            variant, outside = self._variant_for(position, planned_sizes != self.sizes)
            variant, outside = self._fit_to_position(position, variant, outside, held_grads)
        except (InfeasibleBudgetError, StepOverrunError):
            self.sizes = planned_sizes  # smaller sizes keep running under their plan
            ledger.abort_step()  # the step stops here; the next call starts it again
            backend.stop_measuring()
            raise
        self._current = (variant, outside)
        backend.ran_at(position, self, variant, outside)
        footprint = variant.footprint(held_by_caller)
        if footprint is not None and held_grads:
            footprint = dataclasses.replace(footprint, held_grads_bytes=held_grads)
        if footprint is not None and ledger.record(position, footprint, outside, self):
            backend.warn_if_step_over_budget()
        if footprint is not None and variant.inputs is not None and len(args) == len(variant.inputs.nbytes):
            ledger.watch_leaves(position, _freed_leaves(args, held_by_caller, variant.inputs))
        meter = backend.meter_for(position, args)
        graph_id = variant.plan.graph_id if variant.plan is not None else "a region"
        backend.resume_measuring()
        if meter is not None and footprint is not None:
            # what the plans count as held when this call starts (the measured outside aside)
            declared = backend.declared_reserve_bytes()
            planned = (ledger.outside_bytes(position) - ledger.eager_bytes() + footprint.params_bytes
                       + footprint.inputs_bytes + held_grads + declared)
            meter.bound(Bound("call", f"{graph_id}'s forward (step position {position})", planned_bytes=planned,
                              covered_bytes=declared))
        out = variant.fn(*args)
        _on_backward(out, backend.backward_ran)  # before user_outputs: returned logits' own path may never run
        if meter is not None:
            meter.bound(Bound("open", f"the eager code after {graph_id}'s forward (step position {position})",
                              position=position))
            # by the end of its backward the region holds its parameters, their gradients and its
            # inputs' gradients: the rest of its peak is free for eager code then
            ended = footprint.params_bytes + footprint.grads_bytes + footprint.inputs_bytes if footprint else 0
            slack = max(0, footprint.own_peak_bytes - ended) if footprint is not None else 0
            _meter_backward(out, meter, f"the eager code after {graph_id}'s backward (step position {position})", slack)
        return variant.user_outputs(out, args)


def _headroom_bytes(options: Options, example_inputs: Sequence[Any]) -> int:
    """What is left of the step budget beside this graph's inputs (all live while it compiles at
    its first call) and what the rest of the step holds (in the reserve): 0 where sizes are symbolic."""
    tensors = [a for a in example_inputs if isinstance(a, torch.Tensor)]
    counts = [a.numel() for a in tensors]
    if any(isinstance(n, torch.SymInt) for n in counts):
        return 0  # symbolic sizes (reading them as ints would guard on them)
    return options.step_budget_bytes - sum(n * a.element_size() for n, a in zip(counts, tensors))


def _random_state_kept(example_inputs: Sequence[Any]):
    """The CPU generator's state, and that of each accelerator the inputs are on, restored after."""
    devices = {a.device for a in example_inputs if isinstance(a, torch.Tensor)}
    accelerators = sorted({d.index or 0 for d in devices if d.type not in ("cpu", "meta")})
    kinds = {d.type for d in devices if d.type not in ("cpu", "meta")}
    if len(kinds) != 1:
        return torch.random.fork_rng(devices=[])
    return torch.random.fork_rng(devices=accelerators, device_type=kinds.pop())


# Steps measured at most (memcompile/step_meter.py): the first, and those planned for a larger
# figure of memory outside the regions than the step before.
_MEASURED_STEPS_MAX = 3
# A measured step's plans run on where no step plan fits on predictions only if its peak, this
# much larger, fits beside the reserve: the same plans peaked 2% higher in the next step of a
# two-region conv step (the Inductor budget sweep, seed 4, case 25).
_MEASURED_ROOM = 0.05
# Steps in a row that ended unread (forward calls alone under grad mode, a compile mid-step)
# after which measuring stops: on the CPU each try runs the step under a profiler.
_UNREAD_STEPS_MAX = 8

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


def _needs_gradient(example_inputs: Sequence[Any]) -> bool:
    """Whether a compile of these inputs makes a joint graph (the partitioner plans it)."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs)


def _inputs_and_gradients_bytes(example_inputs: Sequence[Any]) -> int:
    """What every plan of a graph with these inputs holds as its backward ends: each input's
    storage once (the caller holds the inputs, parameters live through the step) and a gradient
    of each input that requires one. 0 where storages cannot be told apart (fake tensors, and
    subclasses such as DTensor, whose gradient may not be their size)."""
    tensors = [t for t in example_inputs if isinstance(t, torch.Tensor)]
    if any(type(t) not in (torch.Tensor, torch.nn.Parameter) for t in tensors):
        return 0
    return unique_storage_bytes(tensors) + sum(t.numel() * t.element_size() for t in tensors if t.requires_grad)


def _raising(error: Exception) -> Callable:
    """A compiled callable that raises `error` (ours, not Dynamo's wrapper, reaches the caller)."""

    def raise_it(*_args: Any, **_kwargs: Any):
        raise error

    return raise_it


def _on_backward(outputs: Any, callback: Callable[[], None]) -> None:
    """Call `callback` once the backward of these outputs' graph has run (starts a new step)."""
    for out in outputs if isinstance(outputs, (list, tuple)) else (outputs,):
        grad_fn = getattr(out, "grad_fn", None)
        if grad_fn is not None:
            grad_fn.register_hook(lambda *_: callback())
            return


def _meter_backward(outputs: Any, meter: StepMeter, after: str, slack_bytes: int) -> None:
    """Bounds of the eager windows around this call's compiled backward: one closes as it starts
    (the gradients handed to it are its plan's), one opens when it ends; the first backward of
    the step also closes the step's measure when the whole backward pass has ended."""
    for out in outputs if isinstance(outputs, (list, tuple)) else (outputs,):
        grad_fn = getattr(out, "grad_fn", None)
        if grad_fn is None:
            continue

        def starts(grad_outputs):
            handed = sum(g.untyped_storage().nbytes() for g in grad_outputs if isinstance(g, torch.Tensor))
            if not meter.backward_seen:
                meter.backward_seen = True
                tp.call_when_backward_ends(meter.backward_ended)
            meter.bound(Bound("close", BACKWARD_STARTS, handed_bytes=handed))

        grad_fn.register_prehook(starts)
        grad_fn.register_hook(lambda *_: meter.bound(Bound("open", after, slack_bytes=slack_bytes)))
        meter.note_graph(grad_fn)
        return


class Backend:
    """What `memcompile.budget(...)` returns: pass it as `torch.compile(..., backend=...)`.

    `plans` holds the plan of every graph compiled with it, in compile order (a graph re-planned
    for what other regions hold, or for larger sizes, adds a plan). `ledger` tracks the regions of
    one step (graph breaks): see memcompile/ledger.py.
    """

    MEMCOMPILE_BACKEND = True  # how plan_dump knows one without importing this module

    def __init__(self, options: Options) -> None:
        watch_skipped_frames()
        self.options = options
        # MEMCOMPILE_DUMP_DIR: each plan's JSON and HTML are written there (plan_dump.write_dump_dir)
        self.dump_dir = os.environ.get("MEMCOMPILE_DUMP_DIR")
        self.plans: list[Plan] = []
        self.errors: list[Exception] = []
        self.eager_frames: list[tp.EagerFrame] = []  # frames Dynamo ran eagerly, outside every plan ("warn")
        self.ledger = StepLedger()
        self.compiles = 0  # graphs compiled (first compiles and re-plans)
        self.checks = check_memo.CheckMemo()  # checks of planned graphs made for this backend
        self.deferred_checks = 0  # plans chosen on an estimate, left to their compiled schedule to check
        self.deferred_checks_failed = 0  # ... that their compiled schedule did not confirm
        # What compiling a graph at a call holds on the step's device (set with the workspaces):
        # counted where a region compiles beside what other regions hold.
        self.compile_scratch = 0
        self.step_plans = 0  # times a plan for the whole step was chosen (settle)
        self.compiled_ahead = 0  # regions compiled since the last call (DDPOptimizer compiles all at once)
        self._settled: tuple | None = None  # the step shape the current step plan was chosen for
        # per position of the step running: (region, variant, outside) it ran (ran_at)
        self._step_calls: dict[int, tuple[Any, Any, int]] = {}
        # the last measured step's calls, where it fitted the budget with the reserve beside it
        self._measured_within: dict[int, tuple[Any, Any, int]] | None = None
        # those calls, kept for the settled step shape where no step plan fits on predictions
        self._kept: dict[int, tuple[Any, Any, int]] | None = None
        self._steps_ended = False
        self._graph_count = itertools.count()
        self._warned_over = 0
        # After a StepOverrunError: the number of steps completed then. Until one more completes,
        # every call runs its least-peak plan, so that the step, run again, fits if any plan does.
        self._cautious_while: int | None = None
        self.plan_only = False  # raise PlannedOnly with each graph's plan instead of compiling it (max_batch)
        self.regions = 0  # regions compiled (one per captured graph)
        self.compile_s = 0.0  # wall time of their first compiles
        self._first_step_ended = False
        # The step's memory outside its compiled regions is measured (memcompile/step_meter.py)
        # in its first step, and again in a step planned for a larger figure than the last.
        self.meter: StepMeter | None = None
        self.measured_steps: list[StepMemory] = []
        self.defaulted_boundaries: list[_Region] = []  # regions holding the default until a step is measured
        self._measure_next = True
        self._unmeasured_warned = False
        self._unread_steps = 0
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

    def ran_at(self, position: int, region: Any, variant: Any, outside: int) -> None:
        """The call at `position` of the step running runs `variant` (a new step starts at 0)."""
        if position == 0:
            self._step_calls = {}
        self._step_calls[position] = (region, variant, outside)

    def kept_at(self, position: int, region: Any) -> tuple[Any, int] | None:
        """(variant, outside) this region ran at `position` in the last measured step, where its
        plans are kept (settle: no step plan fits on predictions, the measured step did); else None."""
        kept = self._kept.get(position) if self._kept is not None else None
        if kept is None or kept[0] is not region:
            return None
        return kept[1], kept[2]

    def settle(self) -> None:
        """At the start of a step: if the previous step's shape (which region ran at each position,
        and what each call held regardless of plan) differs from the one the current step plan
        was chosen for, choose one plan per region for the whole step (memcompile/step_plan.py)
        and assign it; regions compile it at their next call. The shape does not depend on the
        plans, so this settles after one choice: at most one re-plan per region per step shape.
        Raises InfeasibleBudgetError if no combination fits."""
        completed = self.ledger.completed_step()
        if completed is None:
            return
        self._steps_ended = True
        shape = tuple((region, f.params_bytes, f.inputs_bytes, f.grads_bytes, f.held_grads_bytes) for region, f in completed)
        if shape == self._settled:
            return
        if len(completed) < 2:
            for region, _ in completed:
                region.assigned = None  # one call per step: its own plan is the step's
            self._settled = shape
            return
        regions, positions = step_positions(completed)
        # the options' checks draw random inputs (see _recompile)
        with _random_state_kept(()), check_memo.remembering(self.checks):
            menus = [region.plan_options() for region in regions]
        budget = StepBudget(self.options.step_budget_bytes, self.options.reserve_bytes, self.compile_scratch,
                            self.ledger.eager_bytes())
        plan = choose_step_plan(positions, [[option for option, _ in menu] for menu in menus], budget)
        measured = self._measured_within
        self._kept = None
        if isinstance(plan, NoStepPlan) and measured is not None and len(measured) == len(completed) \
                and all(measured[p][0] is region for p, (region, _) in enumerate(completed)):
            # The plans' predictions, composed with what the step was measured to hold outside
            # them, leave no room; the step these plans ran was measured within the budget with
            # the reserve beside it, and runs again as it was (a conv stack of four regions:
            # predicted 200.09 KiB at the least, measured 118.59 KiB, of a 199.99 KiB budget).
            log.info("memcompile: no step plan fits the budget on the plans' predictions (%s at the least); the "
                     "plans of the last step, measured within it, are kept",
                     format_bytes(plan.min_feasible_bytes))
            for region in regions:
                region.assigned = None
            self._kept = measured
            self._settled = shape
            self._measure_next = len(self.measured_steps) < _MEASURED_STEPS_MAX  # and measured again
            return
        if isinstance(plan, NoStepPlan):
            error = no_step_plan_error(plan, positions, self.options)
            self.errors.append(error)
            log.error("%s", error)
            raise error
        for region, menu, option, outside in zip(regions, menus, plan.option_of, plan.outside_bytes):
            decisions = menu[option][1]
            region.assigned = None if decisions is None else (decisions, outside)
        self._settled = shape
        self.step_plans += 1
        log.debug("memcompile: one plan per region for the step: predicted step peak %s of %s, added time "
                  "~%.2f ms (%s)", format_bytes(plan.step_peak_bytes), format_bytes(plan.regions_bytes),
                  plan.added_time_s * 1e3, plan.status)

    def meter_for(self, position: int, args: Sequence[Any]) -> StepMeter | None:
        """The meter of this step, started at its first call when the step is to be measured."""
        if position == 0 or (self.meter is not None and self.meter.graphs_gone()):
            # a step that ended without a backward (its graphs freed: forward calls alone) is not read
            self.stop_measuring()
            if self._measure_next:
                self._measure_next = False
                meter = StepMeter(torch.device(step_device(args)), self.step_measured)
                if meter.start([a for a in args if isinstance(a, torch.Tensor) and not tp.is_fake_tensor(a)
                                and not tp.is_distributed_tensor(a)]):
                    self.meter = meter
                elif not self._unmeasured_warned:
                    self._unmeasured_warned = True
                    log.warning("memcompile: another profiler is running, so the memory this step holds outside its "
                                "compiled regions (an eager loss, eager modules between compiled blocks) cannot be "
                                "measured and is not in the plan; run a step without the profiler first")
        return self.meter if self.meter is not None and not self.meter.finished else None

    def declared_reserve_bytes(self) -> int:
        """The reserve the user passed for memory outside the graphs (an engine's buckets and
        shards): eager memory the step measures within it is covered (step_meter.Bound)."""
        options = self.options
        return max(0, options.reserve_bytes - options.optimizer_reserve_bytes - options.library_workspace_bytes
                   - options.compile_scratch_bytes)

    def pause_measuring(self) -> None:
        """memcompile compiles or re-plans from here: not the step's memory (resume_measuring)."""
        if self.meter is not None and not self.meter.finished:
            self.meter.bound(Bound("pause", ""))

    def resume_measuring(self) -> None:
        if self.meter is not None and not self.meter.finished:
            self.meter.bound(Bound("resume", ""))

    def stop_measuring(self) -> None:
        meter, self.meter = self.meter, None
        if meter is None:
            return
        if not meter.finished:
            meter.abandon()
        if meter.read:
            return
        self._unread_steps += 1
        if self._unread_steps < _UNREAD_STEPS_MAX:
            self._measure_next = True  # measure the next step instead
        elif not self.measured_steps:
            log.warning("memcompile: %d steps in a row ended before their backward was measured (forward calls "
                        "alone under grad mode?); the memory the step holds outside its compiled regions is no "
                        "longer measured and is not in the plan: reserve for it (memcompile.budget(reserve=...))",
                        self._unread_steps)

    def step_measured(self, measured: StepMemory) -> None:
        """A measured step's memory: what it held outside the plans is held beside every region
        from the next call on (a larger figure than planned: that step is measured too). A step
        that ran over the budget raises StepOverrunError (on_first_step_overrun="warn": warns)."""
        self.measured_steps.append(measured)
        self._unread_steps = 0
        # (the reserve beside it: what the step holds later that this one may not have, an
        # optimizer's states made at its first step)
        fits = measured.peak_bytes * (1 + _MEASURED_ROOM) + self.options.reserve_bytes <= self.options.budget_bytes
        self._measured_within = dict(self._step_calls) if fits and self._step_calls else None
        step = self.ledger.steps_completed() + 1
        grew = measured.outside_bytes > self.ledger.eager_bytes()
        if grew:
            self.ledger.measured_outside(measured.outside_bytes, measured.where)
        calls = self.ledger.calls_before(measured.boundary_position + 1)
        region = calls[measured.boundary_position][0] if 0 <= measured.boundary_position < len(calls) else None
        defaulted, self.defaulted_boundaries = self.defaulted_boundaries, []
        for other in defaulted:  # the measure replaces the default, up or down
            if other is not region:
                other.hold_at_backward_start(0, "", 0)
        if isinstance(region, _Region) and (measured.boundary_bytes > region.boundary_bytes or region in defaulted):
            grew = grew or measured.boundary_bytes > region.boundary_bytes
            region.hold_at_backward_start(measured.boundary_bytes, measured.boundary_where,
                                          self.ledger.outside_bytes(measured.boundary_position))
        self._measure_next = grew and len(self.measured_steps) < _MEASURED_STEPS_MAX
        log.debug("memcompile: step %d measured a peak of %s (budget %s); eager code outside the compiled regions held "
                 "up to %s as the backward started (%s) and %s beyond the plans at other times (%s)%s", step,
                 format_bytes(measured.peak_bytes), format_bytes(self.options.budget_bytes),
                 format_bytes(measured.boundary_bytes), measured.boundary_where or "-",
                 format_bytes(measured.outside_bytes), measured.where or "-",
                 "; the next step is planned with them" if grew else "")
        over = measured.peak_bytes - self.options.budget_bytes
        if over <= 0:
            return
        if not (measured.outside_bytes or measured.boundary_bytes):
            # Nothing outside the plans: a plan run over the budget knowingly (on_unplanned="warn",
            # a fallback) or a prediction that missed; said, not raised.
            log.warning("memcompile: step %d measured a peak of %s, %s over the budget of %s, with nothing outside "
                        "the compiled regions: the plans it ran predicted %s", step, format_bytes(measured.peak_bytes),
                        format_bytes(over), format_bytes(self.options.budget_bytes),
                        format_bytes(self.predicted_step_peak() + self.options.reserve_bytes))
            return
        message = (
            f"memcompile: step {step} measured a peak of {format_bytes(measured.peak_bytes)} "
            f"({measured.peak_bytes} bytes), {format_bytes(over)} over the budget of "
            f"{format_bytes(self.options.budget_bytes)} ({self.options.budget_bytes} bytes). Outside its compiled "
            f"regions the step held memory no plan had counted: {format_bytes(measured.boundary_bytes)} "
            f"({measured.boundary_bytes} bytes) as the backward started ({measured.boundary_where or '-'}), "
            f"{format_bytes(measured.outside_bytes)} ({measured.outside_bytes} bytes) at other times "
            f"({measured.where or '-'}): eager code such as a loss computed on a returned output, or modules run "
            "eagerly between compiled blocks. From the next step on the plans hold it beside them, so the step "
            "fits or raises InfeasibleBudgetError naming the whole step's floor before it runs. To keep the first "
            f"step within the budget too, pass reserve={measured.boundary_bytes + measured.outside_bytes} to "
            "memcompile.budget(), or compute the loss inside the compiled function.")
        if self.options.on_first_step_overrun == "raise":
            error = StepOverrunError(message, budget_bytes=self.options.budget_bytes, needed_bytes=measured.peak_bytes)
            self.errors.append(error)
            raise error
        log.warning("%s", message)
        warnings.warn(message, StepOverrunWarning, stacklevel=2)

    def reducible_saved_bytes(self, position: int) -> int:
        """What the calls of this step before `position` hold beyond their regions' least-peak
        plans: how much room running them at their least would have left."""
        total = 0
        for region, footprint in self.ledger.calls_before(position):
            if footprint is not None and isinstance(region, _Region):
                total += max(0, footprint.saved_bytes - region.least_saved_bytes())
        return total

    def cautious_now(self) -> bool:
        """A StepOverrunError stopped this step shape's run: run every call at its least peak
        until a step has completed."""
        return self._cautious_while is not None and self._cautious_while == self.ledger.steps_completed()

    def first_step_overrun(self, error: InfeasibleBudgetError, position: int) -> None:
        """The call at `position` cannot fit beside what earlier calls of this step hold, which
        run plans made before this region was known: raise StepOverrunError, or warn."""
        shortfall = error.min_feasible_bytes - self.options.budget_bytes
        message = (
            f"memcompile: the call at position {position} of this step would run {format_bytes(shortfall)} over "
            f"the budget of {format_bytes(self.options.budget_bytes)}: the regions called before it in this step "
            "run plans made before it was known (a step's first run of new regions; a region compiled after the "
            "plan for the whole step was chosen). The plan for the whole step, chosen once the step has ended, "
            "would fit it if any does. Pass on_first_step_overrun=\"warn\" to memcompile.budget() to run this "
            "step over the budget with a warning; or compile the model as one region (no graph break), or its "
            "blocks one by one from the first call on, so that memcompile knows the step before it runs.")
        if self.options.on_first_step_overrun == "raise":
            overrun = StepOverrunError(
                message + " Run the step again and memcompile, now knowing it has several regions, runs each at "
                "its least peak until the step has ended once.", budget_bytes=self.options.budget_bytes,
                needed_bytes=error.min_feasible_bytes)
            self.errors.append(overrun)
            self._cautious_while = self.ledger.steps_completed()
            raise overrun
        log.warning("%s", message)
        warnings.warn(message, StepOverrunWarning, stacklevel=2)

    def warn_if_step_over_budget(self) -> None:
        """Regions compiled during a step can make an earlier region's running plan too large for
        the rest of this step; the next step re-plans it. Say so rather than be silent."""
        peak = self.ledger.predicted_step_peak()
        if peak > self.options.step_budget_bytes and peak > self._warned_over:
            self._warned_over = peak
            log.warning("memcompile: while new regions are compiled, this step may peak at %s, over the budget of "
                        "%s; the step is planned as a whole once it has ended", format_bytes(peak),
                        format_bytes(self.options.step_budget_bytes))

    def frame_runs_eagerly(self, frame: tp.EagerFrame) -> None:
        """Dynamo gave up on a frame compiled with this backend, which would run uncompiled:
        its memory is in no plan. Raise UnplannedFrameError (the default), or warn once per frame."""
        message = (
            f"memcompile: Dynamo could not compile {frame.name} ({frame.location}) and would run it eagerly, "
            f"outside every memcompile plan, so the step's memory would not be bounded by the budget of "
            f"{format_bytes(self.options.budget_bytes)}. Dynamo's reason: {frame.reason}. To fix it: move a "
            "graph break out of the loop it is in, or remove it (torch.compile(..., fullgraph=True) names every "
            "break); or compile the loop's body, block by block, with this backend; or pass "
            "on_unplanned=\"warn\" to memcompile.budget() to run such frames eagerly, unplanned, with a warning.")
        if self.options.on_unplanned == "raise":
            error = UnplannedFrameError(message, frame=frame)
            self.errors.append(error)
            raise error
        if frame not in self.eager_frames:
            self.eager_frames.append(frame)
            log.warning("%s", message)
            warnings.warn(message, UnplannedFrameWarning, stacklevel=2)

    def compile_graph(self, gm: fx.GraphModule, example_inputs: Sequence[Any], options: Options,
                      schedules: list[tp.CompiledSchedule] | None = None, cache_key: str | None = None) -> Callable:
        """The compiled region; under Inductor, `schedules` receives the schedules it built, and
        with `cache_key` AOTAutograd's cache may serve it (no partitioner runs then)."""
        partitioner = Partitioner(options, self.id, cache_key)

        def on_inference(graph: fx.GraphModule) -> None:
            record = _RECORD.get()
            if record is not None:
                record.inference_peak_bytes = predicted_inference_peak(graph, options.allocator_rounding)

        if options.codegen == "inductor":
            return tp.compile_with_inductor(gm, example_inputs, partitioner, on_inference, schedules,
                                            autograd_cache=cache_key is not None, rules=inductor_rules_for(options))

        def partition_fn(joint, joint_inputs, **kwargs):
            return partitioner(joint, joint_inputs, **kwargs)

        return tp.compile_with_aot_eager(gm, example_inputs, partition_fn, on_inference)

    def reserve_library_workspace(self, example_inputs: Sequence[Any]) -> None:
        """Count the matmul library's workspaces (cuBLAS on CUDA: 2 x 32 MiB on an H200, measured
        in an allocator snapshot as blocks no op of the step allocated) in the reserve, once; and
        learn what a compile during the step allocates beside it (compile_scratch_bytes)."""
        if self.options.library_workspace_bytes or self.compile_scratch:
            return
        device = step_device(example_inputs)
        workspace, self.compile_scratch = blas_workspace_bytes(device), compile_scratch_bytes(device)
        if workspace:
            self.options = dataclasses.replace(self.options, reserve_bytes=self.options.reserve_bytes + workspace,
                                               library_workspace_bytes=workspace)

    def backward_ran(self) -> None:
        """A backward of this step has started: the step's calls are known. The first time, say
        what the step is predicted to peak at."""
        self.ledger.backward_ran()
        if not self._first_step_ended:
            self._first_step_ended = True
            calls = sum(f is not None for f in self.ledger.footprints())
            log.info("%s", logs.step_summary(self.predicted_step_peak(), self.options, self.regions, calls,
                                             self.compile_s))

    def round_to_allocator(self, example_inputs: Sequence[Any]) -> None:
        """Size each allocation as the step's device allocator holds it (on CUDA: the caching
        allocator's 512 B blocks, under the allocator settings of this process), once."""
        if self.options.allocator_rounding != EXACT:
            return
        rounding = allocator_rounding_for(step_device(example_inputs), os.environ)
        if rounding != EXACT:
            self.options = dataclasses.replace(self.options, allocator_rounding=rounding)

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        try:
            self.options = with_resolved_budget(self.options, example_inputs)  # budget("90%"), "free"
        except ValueError as error:
            self.errors.append(error)
            return _raising(error)
        self.reserve_library_workspace(example_inputs)
        self.pause_measuring()  # a region compiled mid-step (resumed at its call)
        what, began = f"region {self.regions}", time.perf_counter()
        self.regions += 1
        self.round_to_allocator(example_inputs)
        region = _Region(self, gm, example_inputs)
        try:
            with logs.progress(what):
                region.compile_first()
        except PlannedOnly as planned:
            return _raising(planned)
        except (InfeasibleBudgetError, PlanningFailedError) as error:
            # Raised from the compiled callable so the user catches our type, not Dynamo's
            # wrapper; every call raises, so the step never runs over budget.
            if isinstance(error, InfeasibleBudgetError) and not self.measured_steps:
                error = _before_any_step(error)
            self.errors.append(error)
            if not self.plan_only:  # max_batch's probes above the answer are expected not to fit
                log.error("%s", error)
            saved_error = error  # `error` is unbound once the except block ends

            def over_budget(*_args: Any, **_kwargs: Any):
                raise saved_error

            return over_budget
        finally:
            self.compile_s += time.perf_counter() - began
        plan = region._current[0].plan if region._current is not None else None
        if plan is not None:
            log.info("%s", logs.region_line(what, plan, time.perf_counter() - began))
        return region

    def __repr__(self) -> str:
        return f"memcompile.budget({self.options.describe()})"


def _holds_trainable_tensors(arguments: dict) -> bool:
    """A frame whose arguments include a tensor or a module's parameter that requires grad: run
    eagerly, its ops save activations for the backward (a frame of plain values holds nothing
    past its return)."""
    return any(v.requires_grad if isinstance(v, torch.Tensor) else any(p.requires_grad for p in v.parameters())
               for v in _tensors_in(arguments))


def _on_eager_frame(backend_fn: Any, compile_options: dict, frame: tp.EagerFrame, arguments: dict) -> None:
    """tp.watch_eager_frames' watcher: frames of memcompile backends only (by object, or by name
    through registration's resolver), training only (grad enabled, trainable tensors)."""
    backend = backend_fn if isinstance(backend_fn, Backend) else None
    resolve = getattr(backend_fn, "memcompile_backend", None)
    if backend is None and callable(resolve):
        try:
            backend = resolve(compile_options)
        except (TypeError, ValueError):
            return  # bad options: the compiled graphs raise those at their first call
    if backend is None or not torch.is_grad_enabled() or not _holds_trainable_tensors(arguments):
        return
    backend.frame_runs_eagerly(frame)


def watch_skipped_frames() -> None:
    """From the first backend on (memcompile.budget, or the backend looked up by name): a skipped
    frame never reaches the backend, and this is how its run outside the budget is noticed (see
    tp.watch_eager_frames). A process that only imports memcompile runs Dynamo unwatched."""
    tp.watch_eager_frames(_on_eager_frame)


def _for_the_step_so_far(error: InfeasibleBudgetError, position: int) -> InfeasibleBudgetError:
    """A region's InfeasibleBudgetError, planned beside what the step's earlier calls hold at
    their least: the smallest budget for the step as far as it is known."""
    return InfeasibleBudgetError(
        f"{error} (This is the smallest budget for the step's first {position + 1} region call(s), each at its "
        "least peak, with what the earlier ones hold; regions called later in the step may need more.)",
        budget_bytes=error.budget_bytes, min_feasible_bytes=error.min_feasible_bytes,
        contributors=error.contributors, whole_step=False)


def _returned_gradient_bytes(gm: fx.GraphModule) -> int:
    """Bytes of the graph's floating outputs of more than one element that require a gradient,
    where it returns no scalar that does (a loss computed inside: the outputs are only held);
    0 where a size is symbolic."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    total = 0
    for node in _output_nodes(output):
        value = node.meta.get("example_value")
        if not isinstance(value, torch.Tensor) or not value.requires_grad or not value.is_floating_point():
            continue
        numel = value.numel()
        if isinstance(numel, torch.SymInt):
            return 0
        if numel <= 1:
            return 0  # the loss is computed inside
        total += numel * value.element_size()
    return total


def _output_nodes(output: fx.Node) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg(output.args, found.append)
    return found


def _before_any_step(error: InfeasibleBudgetError) -> InfeasibleBudgetError:
    """An InfeasibleBudgetError raised before any step ran: its floor counts the compiled
    graphs only, not yet what eager code holds outside them (measured once a step runs)."""
    return InfeasibleBudgetError(
        f"{error} (Memory that eager code holds outside the compiled regions, such as a loss computed on a "
        "returned output, is not measured yet: no step has run. A step run at this floor measures it, and the "
        "floor named then is the whole step's.)",
        budget_bytes=error.budget_bytes, min_feasible_bytes=error.min_feasible_bytes,
        contributors=error.contributors, whole_step=error.whole_step)


def _tensors_in(arguments: dict, limit: int = 256):
    """Tensors and modules among a frame's arguments, one level into lists, tuples and dicts."""
    values = list(arguments.values())
    for value in values[:limit]:
        if isinstance(value, (torch.Tensor, torch.nn.Module)):
            yield value
        elif isinstance(value, (list, tuple)):
            values.extend(value[:32])
        elif isinstance(value, dict):
            values.extend(list(value.values())[:32])


def _holds_activations(arguments: dict) -> bool:
    """The frame was called with an activation (a tensor with an autograd history): it runs
    inside a step, after other work that holds memory."""
    return any(isinstance(v, torch.Tensor) and v.grad_fn is not None for v in _tensors_in(arguments))


def _module_parameters(arguments: dict) -> dict[int, tuple[int, bool]]:
    """id -> (bytes, has a gradient) of the parameters and buffers of the frame's modules."""
    leaves: dict[int, tuple[int, bool]] = {}
    for value in _tensors_in(arguments):
        if isinstance(value, torch.nn.Module):
            for tensor in itertools.chain(value.parameters(), value.buffers()):
                # Sharded parameters (FSDP2's DTensors) are the user's reserve, not the step's.
                if not (tp.is_fake_tensor(tensor) or tp.is_distributed_tensor(tensor)):
                    leaves[id(tensor)] = (tensor.numel() * tensor.element_size(), tensor.requires_grad)
    return leaves


def _check_inference_peak(peak: int, options: Options) -> None:
    """An inference graph (no_grad, inference_mode, frozen parameters) runs no plan: it fits the
    budget as it is (its predicted peak, every value a buffer freed after its last reader), or
    the call raises before running. A chunked loss head or MLP of a training plan does not
    apply to it: its logits are whole."""
    need = peak + options.reserve_bytes
    if need <= options.budget_bytes:
        return
    raise InfeasibleBudgetError(
        f"memcompile: this inference graph (no gradients: torch.no_grad, inference_mode or frozen parameters) is "
        f"predicted to peak at {format_bytes(need)}, over the budget of {format_bytes(options.budget_bytes)} "
        f"({options.budget_bytes} bytes{options.reserve_text()}); memcompile plans training steps only, so the "
        f"smallest budget for it is {format_bytes(need)} (min_feasible_bytes={need}). Raise the budget, or run "
        "inference with a smaller batch.", budget_bytes=options.budget_bytes, min_feasible_bytes=need)



def _accumulated_grad_bytes(args: Sequence[Any], held_by_caller: Sequence[bool]) -> int:
    """Bytes of the gradients this call's leaf inputs already have (gradient accumulation: the
    step starts with them; a plan counts gradients from the backward on only)."""
    seen, total = set(), 0
    for a, held in zip(args, held_by_caller):
        grad = a.grad if held and isinstance(a, torch.Tensor) and a.requires_grad else None
        if grad is not None and id(grad) not in seen:
            seen.add(id(grad))
            total += grad.numel() * grad.element_size()
    return total
