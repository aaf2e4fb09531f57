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
from memcompile.plan_dump import write_dump_dir
from memcompile.errors import InfeasibleBudgetError
from memcompile.ledger import Footprint, InputBytes, StepLedger, footprint_of, input_bytes
from memcompile.options import Options
from memcompile.plan import Plan, format_bytes
from memcompile.plan_cache import source_hash
from memcompile.planner import plan_joint_graph
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
        )
        sizes = planning_sizes_now()
        if sizes:
            plan = dataclasses.replace(plan, size_bounds=tuple(sorted((str(k), v) for k, v in sizes.items())))
        if record is not None:
            record.plan = plan
            record.inputs = inputs
        if backend is not None:
            backend.plans.append(plan)
            write_dump_dir(plan, os.environ.get("MEMCOMPILE_DUMP_DIR"))
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

    At each call (grad enabled) it asks the step ledger what other regions hold at this call's
    position, reads the actual symbolic sizes from the arguments, and runs the variant planned
    for exactly that outside-held amount and for sizes >= the actual ones (the largest seen so
    far); when there is none it compiles one (same graph, re-planned). A plan made for sizes S
    covers every size <= S: bytes only grow with sizes (see docs/design.md).
    """

    _MAX_VARIANTS = 16

    def __init__(self, backend: "Backend", gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
        self.backend = backend
        self.gm = gm
        self.pristine_graph = copy.deepcopy(gm.graph)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        fakes = [n.meta.get("example_value") for n in placeholders]
        # Fake inputs (never the user's real tensors: holding those would cost memory).
        self.fake_inputs = fakes if len(fakes) == len(example_inputs) and all(f is not None for f in fakes) else None
        self.tracing_context = tp.current_tracing_context()
        self.sites = _symbol_sites(self.fake_inputs or ())
        self.sizes = _trace_sizes(self.fake_inputs or ())
        self.variants: dict[tuple[int, tuple], _Variant] = {}
        self._example_inputs = list(example_inputs)  # only until the first compile
        self._first: tuple[int, _Variant] | None = None

    def _key(self, outside: int) -> tuple[int, tuple]:
        return outside, tuple(sorted((str(k), v) for k, v in self.sizes.items()))

    def compile_first(self) -> None:
        position = self.backend.ledger.next_position()
        outside = self.backend.ledger.outside_bytes(position)
        example_inputs, self._example_inputs = self._example_inputs, []
        # The call that follows at once runs what was compiled here (also a transient plan).
        self._first = (position, self._plan_for_position(
            position, outside, lambda o: self._compile(o, self.gm, example_inputs)))

    def _compile(self, outside: int, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> _Variant:
        options = self.backend.options
        if outside:
            # What other regions hold while this one runs is, for this graph, held outside it.
            options = dataclasses.replace(options, reserve_bytes=options.reserve_bytes + outside)
        record = _CompileRecord()
        token = _RECORD.set(record)
        try:
            with planning_sizes(self.sizes):
                fn = self.backend.compile_graph(gm, example_inputs, options)
        finally:
            _RECORD.reset(token)
        variant = _Variant(fn, record.plan, record.inputs)
        if len(self.variants) >= self._MAX_VARIANTS:
            self.variants.pop(next(iter(self.variants)))
        self.variants[self._key(outside)] = variant
        return variant

    def _recompile(self, outside: int) -> _Variant:
        if self.fake_inputs is None:
            raise RuntimeError("memcompile: cannot re-plan a graph without fake example inputs")
        gm = fx.GraphModule(self.gm, copy.deepcopy(self.pristine_graph))
        with tp.reentered_tracing_context(self.tracing_context):
            return self._compile(outside, gm, self.fake_inputs)

    def _plan_for_position(self, position: int, outside: int, compile_for: Callable[[int], _Variant]) -> _Variant:
        try:
            return compile_for(outside)
        except InfeasibleBudgetError as error:
            if not self.backend.ledger.earlier_plans_stale(position):
                raise
            # Earlier regions of this step still run plans made before the later regions were
            # known; they are re-planned on their next call. Rather than stop a budget that may
            # well fit once they are, run this step with the least this region can hold.
            shortfall = error.min_feasible_bytes - self.backend.options.budget_bytes
            log.warning("memcompile: this step may run %s over the budget while its regions are first "
                        "compiled (earlier regions were planned before later ones existed); they are "
                        "re-planned on their next call", format_bytes(shortfall))
            return compile_for(max(0, outside - shortfall))

    def _replan(self, position: int, outside: int) -> _Variant:
        try:
            return self._plan_for_position(position, outside, self._recompile)
        except InfeasibleBudgetError as error:
            self.backend.errors.append(error)
            raise

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

    def __call__(self, *args: Any) -> Any:
        latest = next(reversed(self.variants.values()))
        if not torch.is_grad_enabled() or latest.plan is None:
            return latest.fn(*args)  # inference graphs are not planned: nothing to re-plan
        ledger = self.backend.ledger
        planned_sizes, self.sizes = self.sizes, self._grown_sizes(args)
        position = ledger.begin_call()
        outside = ledger.outside_bytes(position)
        first, self._first = self._first, None
        if first is not None and first[0] == position and planned_sizes == self.sizes:
            variant = first[1]
        else:
            try:
                variant = self.variants.get(self._key(outside)) or self._replan(position, outside)
            except InfeasibleBudgetError:
                self.sizes = planned_sizes  # smaller sizes keep running under their plan
                ledger.cancel_call(position)
                raise
        # Leaf inputs (parameters, the user's tensors) are held by the caller all step; the
        # others are activations of an earlier region. The same graph can be called with both
        # (one compiled block per position), so this is read at every call.
        held_by_caller = tuple(not isinstance(a, torch.Tensor) or a.grad_fn is None for a in args)
        footprint = variant.footprint(held_by_caller)
        if footprint is not None and ledger.record(position, footprint, outside):
            self.backend.warn_if_step_over_budget()
        out = variant.fn(*args)
        _on_backward(out, ledger.backward_ran)
        return out


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

    def warn_if_step_over_budget(self) -> None:
        """Regions compiled during a step can make an earlier region's running plan too large for
        the rest of this step; the next step re-plans it. Say so rather than be silent."""
        peak = self.ledger.predicted_step_peak()
        if peak > self.options.step_budget_bytes and peak > self._warned_over:
            self._warned_over = peak
            log.warning("memcompile: while new regions are compiled, this step may peak at %s, over the budget of "
                        "%s; the regions are re-planned on their next call", format_bytes(peak),
                        format_bytes(self.options.step_budget_bytes))

    def compile_graph(self, gm: fx.GraphModule, example_inputs: Sequence[Any], options: Options) -> Callable:
        partitioner = Partitioner(options, self.id)
        if options.codegen == "inductor":
            return tp.compile_with_inductor(gm, example_inputs, partitioner)

        def partition_fn(joint, joint_inputs, **kwargs):
            return partitioner(joint, joint_inputs, **kwargs)

        return tp.compile_with_aot_eager(gm, example_inputs, partition_fn)

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
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
