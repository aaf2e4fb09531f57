"""Every private torch API memcompile touches, behind names of ours.

Tested against torch 2.13.0 only (pyproject pins <2.14). When torch moves one of these, this is
the one file to change; tests/test_private_api_boundary.py fails if `torch._` is imported anywhere
else in the package.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
import functools
import threading
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._dynamo.backends.common import aot_autograd as _aot_autograd
from torch._functorch import config as _functorch_config
from torch._functorch import partitioners as _partitioners
from torch._functorch._aot_autograd.utils import _is_primal, _is_tangent
from torch._functorch.compile_utils import raise_getitems as _raise_getitems
from torch._inductor import config as _inductor_config
from torch._inductor.compile_fx import compile_fx as _compile_fx
from torch._inductor.compile_fx import compile_fx_inner as _compile_fx_inner
from torch._inductor.custom_graph_pass import CustomPartitionerFn as _CustomPartitionerFn
from torch._inductor.decomposition import select_decomp_table as _select_decomp_table
from torch._subclasses.fake_tensor import FakeTensor as _FakeTensor

TORCH_VERSION = torch.__version__

# Base class Inductor requires for `config.custom_partitioner_fn`.
PartitionerBase = _CustomPartitionerFn


def is_primal(node: fx.Node) -> bool:
    """A joint-graph placeholder holding a forward input (parameter, buffer or user input)."""
    return _is_primal(node)


def is_tangent(node: fx.Node) -> bool:
    """A joint-graph placeholder holding an incoming gradient."""
    return _is_tangent(node)


def is_sym_node(node: fx.Node) -> bool:
    return _partitioners.is_sym_node(node)


def node_nbytes(node: fx.Node) -> int:
    """Bytes of a node's value (sum over tuple members), symbolic sizes resolved by their hint."""
    return int(_partitioners._size_of(node))


def must_recompute_tag(node: fx.Node) -> bool:
    return _partitioners.must_recompute(node)


def prepare_joint_graph(joint: fx.GraphModule) -> fx.GraphModule:
    """The stock partitioner's preprocessing: DCE, user checkpoint tags, forced saves."""
    joint.graph.eliminate_dead_code()
    joint.recompile()
    if _partitioners.has_recomputable_ops(joint):
        joint = _partitioners.cleanup_recompute_tags(joint, is_default_partition=False)
    if not _functorch_config.unsafe_allow_optimization_of_collectives:
        _partitioners.force_save_collectives(joint)
    _partitioners.force_save_effectful_ops(joint)
    _partitioners.force_save_bw_mutation_src(joint)
    return joint


def classify_joint_nodes(
    joint: fx.GraphModule, num_fwd_outputs: int, static_lifetime_input_indices: Sequence[int]
) -> tuple[set[fx.Node], set[fx.Node], set[fx.Node]]:
    """(forward-required, backward-required, unclaimed) node sets, as the stock partitioner sees them."""
    info = _partitioners.classify_nodes(joint, list(static_lifetime_input_indices), num_fwd_outputs)
    return set(info.required_fw_nodes), set(info.required_bw_nodes), set(info.unclaimed_nodes)


def static_lifetime_nodes(joint: fx.GraphModule, indices: Sequence[int]) -> set[fx.Node]:
    primals = [n for n in joint.graph.nodes if is_primal(n)]
    return {p for i, p in enumerate(primals) if i in set(indices)}


def extract_forward_backward(
    joint: fx.GraphModule,
    saved_values: list[fx.Node],
    saved_sym_nodes: list[fx.Node],
    num_fwd_outputs: int,
    static_lifetime_input_nodes: set[fx.Node],
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Split the joint graph given the saved set; anything else backward needs is recomputed.

    The backward is reordered so each recomputed node runs just before its first use (as the
    autograd engine would), not all at the start of backward.
    """
    from torch.utils._ordered_set import OrderedSet

    fw, bw = _partitioners._extract_fwd_bwd_modules(
        joint,
        saved_values,
        saved_sym_nodes=saved_sym_nodes,
        num_fwd_outputs=num_fwd_outputs,
        static_lifetime_input_nodes=OrderedSet(static_lifetime_input_nodes),
    )
    bw = _partitioners.reordering_to_mimic_autograd_engine(bw)
    return _raise_getitems(fw), _raise_getitems(bw)


# Backward nodes that recompute a forward value (marked by the rewrite, passes/partition.py).
# Inductor fuses nodes horizontally when they read the same buffers, and runs the fused kernel at
# its earliest member: a recomputation placed just before its reader in layer 0's backward was
# fused with layer 1's (they read the same saved RoPE cos/sin and masks) and so computed at the
# top of the backward, held across layer 1's. Inductor refuses such fusions only for nodes more
# than 64 apart (Scheduler.are_long_distant_nodes); for marked nodes we refuse them beyond
# RECOMPUTE_FUSION_DISTANCE, and vertical fusions too (_install_fusion_rules). Llama small's
# smallest budget: 10.26 MiB with Inductor's rule alone (the distance set to 10**9), 9.26 MiB
# with the limit (benchmarks/pareto.py probe child).
RECOMPUTED = "memcompile_recomputed"
RECOMPUTE_FUSION_DISTANCE = 4
# Vertical fusions (a reader into its producer) are refused beyond a wider gap: a recomputation
# and its readers within one layer are up to 10 scheduler nodes apart on Llama small (its RMSNorm
# statistics and their backward kernel: 6; the recomputed SiLU and its gradient: 5; layer 1's
# mask and its attention backward: 10), layers about 45 (layer 0's attention read layer 1's
# recomputed mask 57-70 nodes later). At 4, those three were refused too: kernels split for
# nothing. (The widths of horizontal fusion do not carry over: at 8 or 16 instead of 4 Llama
# small's smallest budget rose from 9.26 to 10.75 / 10.38 MiB.)
RECOMPUTE_VERTICAL_GAP = 16


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
# them), marked in GraphModule.meta: the lifetime rule below applies to these only, so a graph
# compiled without memcompile in the same process fuses as stock Inductor does.
PLANNED_GRAPH = "memcompile_planned"

# A horizontal fusion runs both nodes as one kernel at the earlier one's place, so the later
# node's results are allocated there. Where a result of the earlier node dies before the later
# node would run, the fusion makes the two coexist where unfused the later one could take the
# dead one's memory: in the SwiGLU backward Inductor fused the product silu(g) * u (read by the
# down projection's weight-gradient matmul, then dead) with the up projection's gradient
# dh * silu(g) (they share the read of silu(g)), so at the top of Llama small's backward the two
# coexisted where the gradient fits in the product's memory; at 9.91 MiB every plan then also
# recomputed layer 0's attention to make room (3.3-3.5 ms estimated added time, 2.5 without).
# Inductor's own guard (Scheduler.can_fusion_increase_peak_memory) weighs only inputs read once,
# against 32x the bytes the fusion saves reading. Buffers smaller than this are left to Inductor:
# they do not move a peak, and the fusion saves a launch.
LIFETIME_FUSION_MIN_BYTES = 64 * 1024


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

    lifetime_fusion: bool = True  # no horizontal fusion that holds a large dead buffer (above)
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
                f"recompute_fusion_distance={RECOMPUTE_FUSION_DISTANCE} recompute_vertical_gap={RECOMPUTE_VERTICAL_GAP}")


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


@dataclasses.dataclass(frozen=True)
class CompiledSchedule:
    """A graph's schedule as the compile that runs it built it (compile_with_inductor's `schedules`)."""

    is_backward: bool
    graph: fx.GraphModule  # after Inductor's post-grad passes: the graph it lowered
    schedule: Any  # memcompile.passes.inductor_schedule.InductorSchedule
    output_names: tuple[str | None, ...]  # the graph's outputs' names before those passes (they rename some)
    view_names: frozenset[str] = frozenset()  # its `view` nodes before the compile

    def as_checked(self) -> fx.GraphModule:
        """A copy of `graph` as the schedule check sees its copies: Inductor's compile turns every
        `view` into a `reshape` first (for layout changes) that the liveness would count as a
        copy; those it lowered as views are views again."""
        copied = fx.GraphModule(self.graph, copy.deepcopy(self.graph.graph))
        for node in copied.graph.find_nodes(op="call_function", target=torch.ops.aten.reshape.default):
            if node.name in self.view_names:
                node.target = torch.ops.aten.view.default
        return copied


# While set: (id of a graph compile_with_inductor hands Inductor -> (is_backward, its output names,
# its view nodes), where its schedule goes).
_CAPTURE: contextvars.ContextVar[tuple[dict, list] | None] = contextvars.ContextVar(
    "memcompile_schedule_capture", default=None)


def _install_schedule_capture() -> Callable[[], None]:
    """The schedule Inductor builds for code generation is read, as plain data, for the graphs
    compile_with_inductor was asked to capture; returns what restores Inductor's own."""
    from torch._inductor.graph import GraphLowering

    original = GraphLowering.__dict__["_update_scheduler"]

    def _update_scheduler(self) -> None:
        original(self)
        capture = _CAPTURE.get()
        if capture is None:
            return
        expected, sink = capture
        wanted = expected.pop(id(self.module), None)
        if wanted is not None:
            sink.append(CompiledSchedule(wanted[0], self.module, _schedule_of(self), wanted[1], wanted[2]))

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
    """Whether fusing two nodes with no dependency between them keeps a large result of the
    earlier one alive while the later one's large results are allocated, where unfused the
    earlier one's readers (outside the pair) all run before the later node."""
    from torch._inductor.virtualized import V

    early, late = sorted((node1, node2), key=lambda n: n.min_order)
    pair = {n.get_name() for n in early.get_nodes()} | {n.get_name() for n in late.get_nodes()}

    def readers_outside(buf) -> list:
        return [u.node for u in buf.users if not u.is_weak and u.node.get_name() not in pair]

    if not any(_stored_bytes(b) >= LIFETIME_FUSION_MIN_BYTES and readers_outside(b) for b in late.get_outputs()):
        return False  # the later node allocates nothing large that outlives the kernel
    graph_outputs = set(V.graph.get_output_names())
    for buf in early.get_outputs():
        readers = readers_outside(buf)
        if not readers or buf.get_name() in graph_outputs or _stored_bytes(buf) < LIFETIME_FUSION_MIN_BYTES:
            continue
        if any(not hasattr(r, "min_order") for r in readers):
            continue  # read by the graph's output node: never dies
        if max(scheduler.get_fused_node(r).min_order for r in readers) < late.min_order:
            return True
    return False


def _planned_graph_now() -> bool:
    from torch._inductor.virtualized import V

    module = getattr(V.graph, "module", None)
    return bool(getattr(module, "meta", {}).get(PLANNED_GRAPH))


def _install_fusion_rules() -> Callable[[], None]:
    """memcompile's fusion rules on Inductor's choices (inductor_rules scopes them; returns what
    restores Inductor's own): refuse fusions of a recomputed node with one far from it (in
    Inductor's node order), and, in graphs memcompile planned (PLANNED_GRAPH), horizontal fusions that keep a large dead buffer's
    memory from the later node (_fusion_extends_a_lifetime). Other graphs fuse as before.

    Horizontal (two readers of the same buffers): the span of the pair beyond
    RECOMPUTE_FUSION_DISTANCE, as Inductor measures its own 64-node limit. Vertical (producer into
    reader; Inductor has no distance limit there): the gap between the two beyond
    RECOMPUTE_VERTICAL_GAP, so a recomputed chain and its readers in one layer still fuse. A
    recomputed reader fused into a producer far before it runs there: on Llama small at 9.91 MiB,
    layer 0's recomputed attention masks (two 256 KiB buffers) were fused into the kernel that
    recomputed layer 1's boolean mask, at the top of the backward, and held through layer 1's
    backward: every plan the solver made checked 256-512 KiB over its model."""
    from torch._inductor.choices import InductorChoices

    saved = InductorChoices.__dict__["can_fuse_horizontal"], InductorChoices.__dict__["can_fuse_vertical"]
    original, original_vertical = InductorChoices.can_fuse_horizontal, InductorChoices.can_fuse_vertical

    def far_and_recomputed(node1, node2, distance: int, limit: int) -> bool:
        return distance > limit and (_has_recomputed_origin(node1) or _has_recomputed_origin(node2))

    def can_fuse_horizontal(scheduler, node1, node2, shared_data_score):
        span = max(abs(node1.min_order - node2.max_order), abs(node2.min_order - node1.max_order))
        if far_and_recomputed(node1, node2, span, RECOMPUTE_FUSION_DISTANCE):
            return False
        if (_ACTIVE_RULES.get().lifetime_fusion and _planned_graph_now()
                and _fusion_extends_a_lifetime(scheduler, node1, node2)):
            return False
        return original(scheduler, node1, node2, shared_data_score)

    def can_fuse_vertical(scheduler, node1, node2, shared_data_score):
        gap = max(node2.min_order - node1.max_order, node1.min_order - node2.max_order)
        if far_and_recomputed(node1, node2, gap, RECOMPUTE_VERTICAL_GAP):
            return False
        return original_vertical(scheduler, node1, node2, shared_data_score)

    InductorChoices.can_fuse_horizontal = staticmethod(can_fuse_horizontal)
    InductorChoices.can_fuse_vertical = staticmethod(can_fuse_vertical)

    def restore() -> None:
        InductorChoices.can_fuse_horizontal, InductorChoices.can_fuse_vertical = saved

    return restore


def stock_partition(joint: fx.GraphModule, joint_inputs: Any, memory_budget: float | None = None, **kwargs: Any):
    """PyTorch's own min-cut partitioner (used for graphs we do not plan, e.g. no backward, and
    as candidate plans); `memory_budget`: its activation_memory_budget fraction (None: the
    configured one, 1.0 by default)."""
    if memory_budget is None:
        return _partitioners.min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
    # The same exact knapsack as PyTorch's default "dp" solver, in memory linear in the budget's
    # resolution rather than a table of tensors (items x 10,001 floats) allocated mid-step: a
    # region planned at a call must not allocate beyond the budget it plans for.
    with _functorch_config.patch(activation_memory_budget=memory_budget,
                                 activation_memory_budget_solver="dp_knapsack_sliding_hirschberg"):
        return _partitioners.min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)


def is_inductor_random_op(target: object) -> bool:
    """Inductor's own random ops (its replacements of rand/randn/randint, drawn from per-graph seeds)."""
    prims = torch.ops.prims
    return any(target is getattr(getattr(prims, name, None), "default", object())
               for name in ("inductor_random", "inductor_randint", "inductor_seeds", "inductor_seed"))


def gelu_ops() -> frozenset:
    """F.gelu as Dynamo records it (its C binding) and as users write it."""
    return frozenset({torch.nn.functional.gelu, torch._C._nn.gelu})


def silu_ops() -> frozenset:
    """F.silu as Dynamo records it (its C binding) and as users write it."""
    return frozenset({torch.nn.functional.silu, torch._C._nn.silu})


def linear_ops() -> frozenset:
    """F.linear as Dynamo records it (its C binding, torch._C._nn.linear) and as users write it."""
    return frozenset({torch.nn.functional.linear, torch._C._nn.linear})


def is_distributed_tensor(x: object) -> bool:
    """A DTensor (FSDP2's sharded parameters): its global size is not this rank's memory."""
    return isinstance(x, torch.Tensor) and hasattr(x, "_local_tensor") and hasattr(x, "_spec")


def is_fake_tensor(x: object) -> bool:
    return isinstance(x, _FakeTensor)


def example_value_of(op: str, target: Any, args: tuple) -> Any:
    """What a new FX node of a Dynamo graph produces, on its inputs' fake `example_value`s (as
    Dynamo records for every node it traces: AOTAutograd's cache refuses a method called on a
    node without one); None where an input has none."""
    missing = []
    values = fx.node.map_arg(args, lambda n: n.meta["example_value"] if "example_value" in n.meta
                             else missing.append(n))
    fakes = [v for v in pytree.tree_leaves(values) if isinstance(v, _FakeTensor)]
    if missing or not fakes:
        return None
    with fakes[0].fake_mode:
        return getattr(values[0], target)(*values[1:]) if op == "call_method" else target(*values)


def outside_tracing_modes():
    """A context where tensor ops run for real: the partitioner runs under the compile's fake (and
    proxy) dispatch modes, and an op timed there would time nothing."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def inductor_decompositions() -> dict:
    return _select_decomp_table()


@contextlib.contextmanager
def aot_settings(autograd_cache: bool = False):
    """AOTAutograd as memcompile compiles with it. Plans are made inside the partitioner, which an
    AOTAutograd cache hit skips (no Plan, no budget check): that cache is on only where the caller
    keeps the plan beside it (`autograd_cache`, keyed by the partitioner's uuid). Inductor's FX
    graph cache stays on: it caches each partitioned graph's code after the partitioner ran. The
    backward compiles with the forward, before the step runs: compiled lazily at the first
    backward, its compile allocated beside the forward's activations (an attention block's first
    step measured 43,976 B where its plan and every later step peak at 39,304)."""
    with _functorch_config.patch(enable_autograd_cache=autograd_cache, force_non_lazy_backward_lowering=True):
        yield


def compile_with_inductor(
    gm: fx.GraphModule, example_inputs: Sequence[Any], partitioner: _CustomPartitionerFn,
    on_inference: Callable[[fx.GraphModule], None] | None = None,
    schedules: list[CompiledSchedule] | None = None, autograd_cache: bool = False,
    rules: InductorRules = PLANNED_RULES,
) -> Callable:
    """Stock Inductor (pre/post-grad passes, codegen) with our partitioner plugged in;
    `on_inference` sees an inference graph (AOTAutograd's, before codegen), which no
    partitioner does. `schedules` receives the forward's and backward's schedules as this
    compile built them (none for a graph Inductor's FX graph cache had: it lowers nothing).
    With `autograd_cache`, AOTAutograd's cache may serve the compiled graphs: then neither the
    partitioner nor `on_inference` runs (see aot_settings)."""
    expected: dict[int, tuple[bool, tuple[str | None, ...], frozenset[str]]] = {}

    def inner_compile(graph, inputs, **kwargs):
        if kwargs.get("is_inference"):
            if on_inference is not None:
                on_inference(graph)
        elif schedules is not None:
            outputs = graph.graph.find_nodes(op="output")[0].args[0]
            views = graph.graph.find_nodes(op="call_function", target=torch.ops.aten.view.default)
            expected[id(graph)] = (bool(kwargs.get("is_backward")),
                                   tuple(a.name if isinstance(a, fx.Node) else None for a in outputs),
                                   frozenset(n.name for n in views))
        return _compile_fx_inner(graph, inputs, **kwargs)

    # the backward lowers with the forward (aot_settings): both inside the rules' scope
    token = _CAPTURE.set((expected, schedules) if schedules is not None else None)
    try:
        with aot_settings(autograd_cache), inductor_rules(rules):
            return _compile_fx(gm, example_inputs, inner_compile=inner_compile,
                               config_patches={"custom_partitioner_fn": partitioner})
    finally:
        _CAPTURE.reset(token)


def _boxed_interpreter(gm: fx.GraphModule, _example_inputs: Any) -> Callable:
    """Run an FX graph eagerly, freeing every value after its last use (boxed calling
    convention), so memory follows the graph order exactly as the liveness pass models it."""

    def run(args: list) -> Any:
        return fx.Interpreter(gm, garbage_collect_values=True).boxed_run(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def compile_with_aot_eager(
    gm: fx.GraphModule, example_inputs: Sequence[Any], partition_fn: Callable,
    on_inference: Callable[[fx.GraphModule], None] | None = None,
) -> Callable:
    """AOTAutograd + our partitioner, graphs run by the FX interpreter (fast tests, no codegen);
    `on_inference` as for compile_with_inductor."""

    def inference_compiler(graph, inputs):
        if on_inference is not None:
            on_inference(graph)
        return _boxed_interpreter(graph, inputs)

    backend = _aot_autograd(
        fw_compiler=_boxed_interpreter,
        bw_compiler=_boxed_interpreter,
        inference_compiler=inference_compiler,
        partition_fn=partition_fn,
        decompositions=_select_decomp_table(),
    )
    with aot_settings():
        return backend(gm, example_inputs)


def current_tracing_context() -> Any:
    """Dynamo's tracing context of the graph being compiled (fake mode, shape env), or None."""
    return torch._guards.TracingContext.try_get()


@contextlib.contextmanager
def reentered_tracing_context(context: Any):
    """Compile again, after Dynamo returned, in the tracing context a graph was first compiled in:
    AOTAutograd then reuses its fake mode and symbolic sizes instead of specialising."""
    if context is None:
        yield
        return
    if getattr(context, "ddp_optimizer_ctx", None) is not None:
        # DDPOptimizer counts one forward compile per piece and pairs each lazily compiled
        # backward with the next piece's metadata; a re-plan is none of its pieces, so it gets a
        # copy without that count (its lazy backward then reads its own fw_metadata).
        context = copy.copy(context)
        context.ddp_optimizer_ctx = None
    with torch._guards.tracing(context):
        yield


def reset_dynamo() -> None:
    torch._dynamo.reset()


def profiler_allocation_deltas(prof: Any) -> list[tuple[int, int]]:
    """(time_ns, bytes) of every CPU/CUDA allocator event a `torch.profiler.profile(
    profile_memory=True)` recorded; frees are negative. Frees of blocks allocated before the
    profile started are not reported by the allocator, so they never appear here."""
    allocation = torch._C._profiler._EventType.Allocation
    deltas: list[tuple[int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        kind, extra = event.typed
        if kind == allocation:
            deltas.append((event.start_time_ns, int(extra.alloc_size)))
        stack.extend(event.children)
    deltas.sort()
    return deltas


def profiler_running() -> bool:
    """A torch profiler is recording in this process (a second one would break the first)."""
    return bool(torch._C._autograd._profiler_enabled())


def start_memory_profile() -> Any:
    """A started CPU profiler recording allocator events (stop it with stop_memory_profile)."""
    profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
    profile.__enter__()
    return profile


def stop_memory_profile(profile: Any) -> None:
    profile.__exit__(None, None, None)


def release_profile(profile: Any) -> None:
    """Free a stopped profile's recorded results now. A torch.profiler.profile holds a reference
    cycle, so they are otherwise freed whenever the garbage collector reaches it: a collection
    freeing them inside a later compile crashed the process (in the results' destructor)."""
    inner = getattr(profile, "profiler", None)
    if inner is not None:
        inner.kineto_results = None
        inner._function_events = None
        inner._old_function_events = None
        profile.profiler = None


def profiler_mark(name: str) -> None:
    """An instant marker named `name` in the running profile (nothing where none runs)."""
    with torch.profiler.record_function(name):
        pass


def profiler_mark_times(prof: Any, name: str) -> list[int]:
    """The times (ns, the clock of profiler_allocation_deltas) of the markers named `name`, in order."""
    times: list[int] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.name == name:
            times.append(event.start_time_ns)
        stack.extend(event.children)
    return sorted(times)


def after_backward_returns(callback: Callable[[], None]) -> bool:
    """From inside a backward pass on this thread: run `callback` once the engine's call has
    returned to Python (the thread's state autograd saved is then restored), through a profile
    function (sys.setprofile, this thread, removed after). False, and nothing done, where a
    profile function is already set (cProfile, a debugger's): it is left alone."""
    import sys

    from torch.autograd.graph import _engine_run_backward

    if sys.getprofile() is not None:
        return False
    code = _engine_run_backward.__code__
    nested = 0  # backward passes started inside this one (a reentrant checkpoint)

    def watch(frame, event, arg):
        nonlocal nested
        if frame.f_code is not code:
            return
        if event == "call":
            nested += 1
        elif event == "return" and nested:
            nested -= 1
        elif event == "return":
            sys.setprofile(None)
            callback()

    sys.setprofile(watch)
    return True


def watch_dynamo_compiles(started: Callable[[], None], ended: Callable[[], None]) -> Callable[[], None]:
    """Call `started` / `ended` around each Dynamo compile (of any frame) until the returned
    function is called, which removes them."""
    handler = torch._dynamo.callback_handler

    def on_start(_args):
        started()

    def on_end(_args):
        ended()

    handler.register_start_callback(on_start)
    handler.register_end_callback(on_end)

    def remove() -> None:
        # torch._dynamo.reset() may have cleared them already
        if on_start in handler.start_callbacks:
            handler.remove_start_callback(on_start)
        if on_end in handler.end_callbacks:
            handler.remove_end_callback(on_end)

    return remove


def call_when_backward_ends(callback: Callable[[], None]) -> None:
    """From inside a backward pass (a hook): run `callback` once the whole pass has ended."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


@functools.lru_cache(maxsize=1)
def _cpu_isa() -> tuple[bool, bool, bool]:
    """(AMX tiles, AMX-FP16, AVX-512) on this CPU; all True where torch no longer says."""
    try:
        return (bool(torch.cpu._is_amx_tile_supported()), bool(torch.cpu._is_amx_fp16_supported()),
                bool(torch.cpu._is_avx512_supported()))
    except AttributeError:
        return True, True, True


def cpu_flash_attention_isa(dtype: torch.dtype) -> tuple[bool, bool]:
    """(packs, onednn_gemm) for the CPU flash attention kernels in `dtype` on this CPU.
    packs: the forward repacks K and V for AMX brgemm (bf16 with AMX tiles, fp16 with AMX-FP16).
    onednn_gemm: its bf16/fp16 GEMMs go to oneDNN (cpublas -> mkldnn_bf16/fp16_gemm), whose
    scratchpads come from the CPU allocator; that needs AVX-512 and ATen's device check for the
    dtype (mkldnn_bf16/fp16_device_check; fp16 wants AVX512-FP16 or AMX-FP16: on an AVX-512 CPU
    without them the fp16 backward allocated no scratchpad, 12,416 B measured at 1x1x32x16 where
    counting one put 74,880)."""
    if dtype not in (torch.bfloat16, torch.float16):
        return False, False
    amx_tile, amx_fp16, avx512 = _cpu_isa()
    onednn = avx512 and onednn_runs_cpu_matmuls_in(dtype)
    return (amx_tile if dtype == torch.bfloat16 else amx_fp16), onednn


def inductor_lays_out_cpu_convolutions_channels_last() -> bool:
    """Whether Inductor runs CPU convolutions channels-last (torch/_inductor/graph.py
    decide_layout_opt: always when oneDNN is available, unless layout optimization is off)."""
    if not _inductor_config.layout_optimization:
        return False
    return bool(_inductor_config.force_layout_optimization
                or (torch.backends.mkldnn.enabled and torch.backends.mkldnn.is_available()))


def onednn_runs_cpu_matmuls_in(dtype: torch.dtype) -> bool:
    """Whether ATen sends CPU bf16/float16 matmuls (mm, addmm) to oneDNN: oneDNN built in and
    enabled, and the CPU with native support for the dtype (ATen's mkldnn_bf16_device_check /
    mkldnn_fp16_device_check: AVX-512 BF16 or AMX for bf16, AVX-512 FP16 or AMX-FP16 for float16).
    There, oneDNN's brgemm allocates a scratchpad (packed copies of the operands) through the
    CPU allocator; ATen also skips oneDNN for products m*k*n <= 16**3, which callers may ignore
    (an over-count)."""
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return False
    return _onednn_supports(dtype)


@functools.lru_cache(maxsize=None)
def _onednn_supports(dtype: torch.dtype) -> bool:
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return False


@functools.lru_cache(maxsize=1)
def inductor_lowering_facts() -> tuple[frozenset, frozenset, frozenset]:
    """(ops Inductor lowers itself, ops it runs as fallback kernels, ops whose inputs it realizes)
    from torch._inductor.lowering's tables: what passes/fusion.py predicts materialization from."""
    from torch._inductor import lowering

    return (frozenset(k for k in lowering.lowerings if isinstance(k, torch._ops.OpOverload)),
            frozenset(lowering.fallbacks), frozenset(lowering.needs_realized_inputs))


def inductor_config_text() -> str:
    """Inductor's configuration as text: what its lowering and scheduler read (a plan store key part)."""
    from torch._inductor import config

    def plain(value: object) -> object:
        # a custom pass is known by its uuid (as Inductor's own cache knows it), else by its type
        if isinstance(value, (str, int, float, bool, type(None), list, tuple, dict)):
            return value
        uuid = getattr(value, "uuid", None)
        return uuid() if callable(uuid) else type(value).__qualname__

    return repr(sorted((k, plain(v)) for k, v in config.save_config_portable().items()))


def inductor_post_grad_copy(gm: fx.GraphModule, is_inference: bool = False) -> fx.GraphModule:
    """A copy of `gm` after Inductor's post-grad passes: the graph its code generation lowers
    (compile_fx runs the same passes on the graphs we hand it; e.g. `mm + add` becomes one
    `addmm` at the add's position, which keeps the mm's inputs alive until then)."""
    import copy

    from torch._guards import detect_fake_mode
    from torch._inductor.compile_fx import _recursive_post_grad_passes
    from torch._inductor.virtualized import V

    copied = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    fake_mode = detect_fake_mode([n.meta.get("val") for n in copied.graph.nodes if n.op == "placeholder"])
    with torch.no_grad(), V.set_fake_mode(fake_mode):
        _recursive_post_grad_passes(copied, is_inference=is_inference)
    return copied


def _one_access_in_kernel(name: str, donor, members_of_kernel: set[int]) -> bool:
    """Scheduler.decide_inplace_update's single_index_in_fused_node: every read and write of the
    donor by the nodes of this fused kernel is one access (the same dependency). GPT-2's fused
    tanh backward read its donor at two accesses, so Inductor allocated its results anew; counting
    the donation under-predicted a least-peak plan by 1 MiB (14.54 predicted, 15.58 measured)."""
    accesses = set()
    for use in donor.users:
        if id(use.node) not in members_of_kernel:
            continue
        accesses.update(d for d in use.node.read_writes.reads_and_writes() if d.name == name)
        if len(accesses) > 1:
            return False
    return True


def inductor_schedule(gm: fx.GraphModule, is_backward: bool, rules: InductorRules = PLANNED_RULES):
    """Inductor's kernels for `gm` (a graph after its post-grad passes, see inductor_post_grad_copy)
    in the order its wrapper runs them, as plain data (memcompile.passes.inductor_schedule):
    lowering and scheduling (fusion, reordering for peak memory) under `rules`, no code generation."""
    from torch._guards import detect_fake_mode
    from torch._inductor.debug import DebugContext
    from torch._inductor.graph import GraphLowering
    from torch._inductor.virtualized import V

    example = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    fake_mode = detect_fake_mode(example)
    if rules.planned:
        mark_planned(rules, gm)  # and applying to this graph
    graph = GraphLowering(gm, example_inputs=example, is_backward=is_backward)
    if is_backward:
        # AOTAutograd donates saved tensors to the backward (bw_donated_idxs), which may write
        # over them; which ones is decided after partitioning: offer all but the tangents (the
        # liveness never lets a result take a parameter's or an input's storage).
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        graph.bw_donated_idxs = [i for i, n in enumerate(placeholders)
                                 if isinstance(n.meta.get("val"), torch.Tensor) and not _is_tangent(n)]
    with DebugContext(), V.set_graph_handler(graph), V.set_fake_mode(fake_mode), inductor_rules(rules):
        graph.run(*example)
        graph.init_wrapper_code()
        graph._update_scheduler()
        return _schedule_of(graph)


def _schedule_of(graph):
    """The kernels of a lowered and scheduled GraphLowering (the current V.graph), as plain data:
    the facts are read here, what the wrapper allocates, frees and writes in place is decided in
    memcompile.passes.inductor_schedule."""
    from memcompile.passes.inductor_schedule import schedule_from_facts

    return schedule_from_facts(_schedule_facts(graph))


def _schedule_facts(graph):
    """Inductor's scheduler nodes and buffers as plain data (passes/inductor_schedule.py ScheduleFacts)."""
    from memcompile.passes.inductor_schedule import ScheduleFacts

    scheduler = graph.scheduler
    # each scheduled node object by its name (a users list may still hold a node Inductor replaced)
    scheduled = {sub.get_name(): sub for snode in scheduler.nodes for sub in snode.get_nodes()}
    cpp_backend = [_runs_on_cpp_backend(scheduler, snode) for snode in scheduler.nodes]
    buffers = tuple(_buffer_facts(graph, name, buf, scheduled) for name, buf in scheduler.name_to_buf.items())
    donated = tuple(_buffer_facts(graph, name, buf, scheduled, donated=True)
                    for name, buf in scheduler.name_to_donated_buffer.items())
    kernels = tuple(_kernel_facts(scheduler, snode, cpp) for snode, cpp in zip(scheduler.nodes, cpp_backend))
    outputs = tuple(_output_buffer_name(value) for value in graph.graph_outputs)
    peak_estimate, overall_peak_estimate = _inductor_peak_estimate(graph)
    return ScheduleFacts(kernels, buffers, donated, outputs, frozenset(graph.graph_inputs),
                         frozenset(graph.unaligned_buffers), peak_estimate, overall_peak_estimate)


def _transfer_op(node):
    """Our transfer op (memcompile/transfer_ops.py) that made `node`, if any, and its kernel."""
    from torch._inductor import ir

    from memcompile import transfer_ops

    kernel = node.inputs[0] if isinstance(node, ir.MultiOutput) and node.inputs else node
    op = getattr(kernel, "op_overload", None)
    return (op, kernel) if op in (transfer_ops.COPY_TO_HOST, transfer_ops.WAIT_COPY) else (None, None)


def _aliased_buffer(node, op, kernel) -> str | None:
    """The buffer whose storage `node` uses, one step (None: its own): a view into a concat, a
    mutation's target, the copy a transfer wait returns. `op, kernel`: its _transfer_op."""
    from torch._inductor import ir

    from memcompile import transfer_ops

    if op is transfer_ops.WAIT_COPY and kernel.inputs:
        return kernel.inputs[0].get_name()
    layout = node.get_output_spec()
    if isinstance(layout, ir.NonOwningLayout):
        return layout.view.get_name()
    if isinstance(layout, ir.MutationLayoutSHOULDREMOVE):
        return layout.get_buffer().get_name()
    mutated = node.get_mutation_names()
    return mutated[0] if isinstance(node, ir.MutationOutput) and mutated else None


def _layout_kind(spec) -> str:
    """passes/inductor_schedule.py LAYOUT_* of an IR node's output spec."""
    from torch._inductor import ir

    from memcompile.passes import inductor_schedule as schedule

    kinds = ((ir.NoneLayout, schedule.LAYOUT_NONE), (ir.MultiOutputLayout, schedule.LAYOUT_MULTI_OUTPUT),
             (ir.NonOwningLayout, schedule.LAYOUT_NON_OWNING), (ir.MutationLayoutSHOULDREMOVE, schedule.LAYOUT_MUTATION))
    return next((kind for spec_type, kind in kinds if isinstance(spec, spec_type)), schedule.LAYOUT_PLAIN)


def _buffer_facts(graph, name: str, buf, scheduled: dict, donated: bool = False):
    """A scheduler buffer, sized where it is a storage of its own (a MultiOutput member: its
    producer's); or a graph input donated to the backward, as an in-place donor only."""
    from torch._inductor import ir
    from torch._inductor import scheduler as inductor_scheduler

    from memcompile import transfer_ops
    from memcompile.passes import inductor_schedule as schedule

    node = buf.node
    layout = None if node is None else _layout_kind(node.get_output_spec())
    uses = tuple(schedule.BufferUse(
        u.node.get_name() if isinstance(u.node, inductor_scheduler.BaseSchedulerNode) else None,
        isinstance(u.node, inductor_scheduler.BaseSchedulerNode) and scheduled.get(u.node.get_name()) is u.node,
        isinstance(u.node, inductor_scheduler.SchedulerNode), bool(u.can_inplace)) for u in buf.users)
    by_no_op = isinstance(getattr(buf, "defining_op", None), inductor_scheduler.NopKernelSchedulerNode)
    if donated:
        return schedule.BufferFacts(name, layout, defined_by_no_op=by_no_op, users=uses)
    op, kernel = _transfer_op(node)
    aliases = _aliased_buffer(node, op, kernel)
    member_of = node.inputs[0].get_name() if isinstance(node, ir.MultiOutput) and node.inputs else None
    device_bytes, dtype = 0, ""
    if (aliases is None and layout == schedule.LAYOUT_PLAIN) or member_of is not None:
        dtype = str(node.get_dtype())
        if op is not transfer_ops.COPY_TO_HOST:  # host memory (on the CPU test switch, standing in)
            size = graph.sizevars.optimization_hint(graph.get_allocation_storage_size(node))
            device_bytes = int(size) * node.get_dtype().itemsize
    return schedule.BufferFacts(name, layout, aliases, member_of, isinstance(node, ir.MultiOutput), device_bytes,
                                dtype, by_no_op, uses)


def _donor_of(scheduler, name: str):
    """The buffer Scheduler.decide_inplace_update would write over for a read of `name`."""
    return scheduler.name_to_donated_buffer.get(name) or scheduler.name_to_buf.get(name)


def _runs_on_cpp_backend(scheduler, snode) -> bool:
    from torch._inductor.codegen.cpp import CppScheduling

    device = snode.get_device()
    if device is None or device.type == "meta":
        return False
    try:
        backend = scheduler.get_backend(device)
    except Exception:  # noqa: BLE001 - no backend known: a call of its own
        return False
    return isinstance(backend, CppScheduling)


def _kernel_facts(scheduler, snode, cpp_backend: bool):
    from torch._inductor import ir
    from torch._inductor import scheduler as inductor_scheduler

    from memcompile.passes.inductor_schedule import KernelFacts, NodeFacts

    def node_facts(sub) -> NodeFacts:
        reads = tuple(dict.fromkeys(d.name for d in sub.read_writes.reads))
        uses = [u.node for read in reads if (donor := _donor_of(scheduler, read)) is not None for u in donor.users]
        earlier = frozenset(n.get_name() for n in uses if isinstance(n, inductor_scheduler.BaseSchedulerNode)
                            and n.get_name() in sub.ancestors)
        return NodeFacts(sub.get_name(), tuple(b.get_name() for b in sub.get_outputs()), reads, earlier)

    kind = ("library" if isinstance(snode, inductor_scheduler.ExternKernelSchedulerNode)
            else "no_op" if isinstance(snode, inductor_scheduler.NopKernelSchedulerNode) else "generated")
    device = snode.get_device()
    outputs = tuple(b.get_name() for b in snode.get_outputs())
    members = snode.get_nodes()
    members_of_kernel = {id(n) for n in members}
    donors = {name: _donor_of(scheduler, name) for sub in members for name in dict.fromkeys(
        d.name for d in sub.read_writes.reads)}
    one_index = frozenset(name for name, donor in donors.items() if donor is not None
                          and _one_access_in_kernel(name, donor, members_of_kernel))
    origin = _origin_of(scheduler, snode, outputs, kind == "library")
    return KernelFacts(snode.get_name(), kind, snode.is_extern(), snode.is_template(),
                       None if device is None else str(device), cpp_backend, outputs,
                       tuple(d.name for d in list(snode.read_writes.reads) + list(snode.read_writes.writes)),
                       None if origin is None else origin.name, isinstance(snode.node, ir.ExternKernelOut),
                       tuple(node_facts(sub) for sub in members), one_index, _outer_loop_facts(snode))


def _origin_of(scheduler, snode, outputs: tuple[str, ...], library_call: bool):
    """The FX node a kernel computes, where Inductor records one."""
    node = snode.node
    origin = getattr(node, "origin_node", None) if node is not None else None
    if origin is None and outputs:
        origin = getattr(scheduler.name_to_buf[outputs[0]].node, "origin_node", None)
    if library_call and origin is None and node is not None:
        # a library call returning a tuple: the FX node that calls the same op
        op = getattr(node, "op_overload", None)
        origin = next((o for o in node.origins if o.target is op), None) if op is not None else None
    return origin


def _output_buffer_name(value) -> str | None:
    """The buffer (or graph input) an output of the lowered graph is; None: not a tensor."""
    from torch._inductor import ir

    if isinstance(value, (ir.NoneAsConstantBuffer, ir.ShapeAsConstantBuffer)):
        return None
    try:
        return value.get_name()
    except (AttributeError, NotImplementedError):
        return None


def _outer_loop_facts(snode):
    """The loop nests of a C++ kernel fused over an outer loop (OuterLoopFusedSchedulerNode), and
    what Inductor's kernel-local buffer rule reads of its members; None for any other kernel."""
    from torch._inductor.scheduler import FusedSchedulerNode, SchedulerNode

    from memcompile.passes.inductor_schedule import OuterLoopFacts

    outer = getattr(snode, "get_outer_nodes", None)
    if outer is None or not hasattr(snode, "outer_loop_fusion_depth"):
        return None
    nests = list(outer())
    try:
        loop_counts = tuple(len(_call_ranges(n)) for n in nests if isinstance(n, (SchedulerNode, FusedSchedulerNode)))
    except Exception:  # noqa: BLE001 - unreadable: no local buffers (an over-count, never under)
        loop_counts = None
    members = snode.get_nodes()
    return OuterLoopFacts(
        snode.outer_loop_fusion_depth, tuple(tuple(sub.get_name() for sub in nest.get_nodes()) for nest in nests),
        loop_counts, frozenset(sub.get_name() for sub in members if _reduction_or_unreadable(sub)),
        frozenset(buf.get_name() for sub in members for buf in sub.get_outputs()
                  if _written_and_read_contiguously(sub, buf)))


def _call_ranges(node) -> tuple:
    nodes = node.get_nodes()
    _, (group, reduction_group) = max(nodes, key=lambda x: int(x.is_reduction())).group
    return tuple(group) + tuple(reduction_group)


def _reduction_or_unreadable(sub) -> bool:
    try:
        return bool(sub.is_reduction())
    except Exception:  # noqa: BLE001 - unreadable: taken as a reduction, never local (an over-count)
        return True


def _written_and_read_contiguously(sub, buf) -> bool:
    """A result of `sub` with a contiguous layout, which `sub` writes and every user reads at the
    contiguous index of `sub`'s loops (codegen/cpp.py try_outer_loop_fusion_with_local_buf)."""
    from torch._inductor.scheduler import SchedulerNode

    try:
        body = sub._body
        contiguous, stride = 0, 1
        for var, size in reversed(body.var_ranges.items()):
            contiguous += stride * var
            stride *= size
        name = buf.get_name()
        # the layout last: its check (sympy over every stride) costs the most
        return body.get_write_expr(name) == contiguous and all(
            isinstance(u.node, SchedulerNode) and u.node._body.get_read_expr(name) == contiguous
            for u in buf.users) and buf.node.get_layout().is_contiguous()
    except Exception:  # noqa: BLE001 - unreadable: count the buffer (an over-count, never under)
        return False


def _inductor_peak_estimate(graph) -> tuple[tuple[int, ...], int]:
    """Inductor's own memory estimate of its schedule, per scheduler node and overall
    (torch/_inductor/memory.py estimate_peak_memory): its wrapper reuses a freed buffer for a
    later allocation only where this estimate says the reuse does not raise its peak
    (codegen/wrapper.py AllocateLine.should_reuse_buffer). ((), 0) where it cannot be computed."""
    from torch._inductor.memory import estimate_peak_memory, get_freeable_input_buf
    from torch.utils._ordered_set import OrderedSet

    try:
        nodes = graph.scheduler.nodes
        freeable = get_freeable_input_buf(nodes, OrderedSet(graph.graph_inputs.keys()))
        overall, by_node = estimate_peak_memory(nodes, freeable, OrderedSet(graph.get_output_names()))
    except Exception:  # noqa: BLE001 - an estimate we only follow; without it every reuse is assumed
        return (), 0
    return tuple(int(b) for b in by_node), int(overall)


# -- frames Dynamo gives up on ------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class EagerFrame:
    """A frame Dynamo failed to compile and is about to run eagerly, uncompiled."""

    name: str  # the function
    location: str  # file:first line
    reason: str  # Dynamo's one-line reason (its graph-break type, or the error's first line)


# The arguments of the frame Dynamo is converting (while its graphs are compiled), or None.
_FRAME_ARGUMENTS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("memcompile_frame_arguments",
                                                                               default=None)


def compiling_frame_arguments() -> dict:
    """The local variables (arguments) of the frame whose graphs are being compiled: a backend
    called by Dynamo sees the module (`self`) and inputs the frame was called with. Empty
    outside a Dynamo compile watched by watch_eager_frames."""
    return _FRAME_ARGUMENTS.get() or {}


def graph_ends_at_graph_break(gm: fx.GraphModule) -> bool:
    """Dynamo compiled this graph at a graph break: the frame goes on after it (more graphs, or
    eager code) before it returns."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    return bool(getattr(reason, "graph_break", False))


def graph_input_ids(gm: fx.GraphModule) -> frozenset[int]:
    """id() of the real tensors Dynamo lifted as this graph's inputs (parameters, buffers, the
    frame's tensors), as it recorded them at capture."""
    ids = set()
    for node in gm.graph.nodes:
        arg = node.meta.get("grapharg") if node.op == "placeholder" else None
        try:
            example = arg.example if arg is not None else None  # a weak reference Dynamo keeps
        except AssertionError:  # GraphArg.example: its weak reference expired (the tensor is gone)
            example = None
        if isinstance(example, torch.Tensor):
            ids.add(id(example))
    return frozenset(ids)


# watcher(backend, torch.compile options, frame, the frame's arguments) -> None, or raises
_EAGER_FRAME_WATCHERS: list[Callable[[Any, dict, EagerFrame, dict], None]] = []


def watch_eager_frames(watcher: Callable[[Any, dict, EagerFrame, dict], None]) -> None:
    """Call `watcher` for every frame Dynamo is about to run eagerly after failing to compile it
    (a graph break inside a loop skips the whole frame, unsupported code, the recompile limit),
    with the innermost backend the frame was compiled with and torch.compile's options for it.
    An exception the watcher raises reaches the caller of the compiled function unchanged
    instead. Where Dynamo raises anyway (fullgraph=True, error_on_graph_break) it is not called.

    The user's torch.compile runs outside any memcompile code and, for a skipped frame, never
    calls the backend, so this is the one place to notice: Dynamo's frame conversion is wrapped
    once per process, a pass-through for every frame that compiles and for every watcher that
    ignores other backends."""
    if watcher in _EAGER_FRAME_WATCHERS:
        return
    _EAGER_FRAME_WATCHERS.append(watcher)
    _watch_frame_conversions()


# hook() -> None, called before Dynamo converts any frame
_BEFORE_FRAME_CONVERSION: list[Callable[[], None]] = []


def before_each_frame_conversion(hook: Callable[[], None]) -> None:
    """Call `hook()` before Dynamo converts (traces, compiles) any frame in this process. Unlike
    Dynamo's compile callbacks, torch._dynamo.reset() does not remove it."""
    if hook not in _BEFORE_FRAME_CONVERSION:
        _BEFORE_FRAME_CONVERSION.append(hook)
    _watch_frame_conversions()


def _watch_frame_conversions() -> None:
    from torch._dynamo import convert_frame

    convert = convert_frame.ConvertFrameAssert
    if getattr(convert.__call__, "_memcompile_watched", False):
        return
    original = convert.__call__

    @functools.wraps(original)
    def watched(self, frame, *args, **kwargs):
        for hook in list(_BEFORE_FRAME_CONVERSION):
            hook()
        arguments = dict(frame.f_locals)
        token = _FRAME_ARGUMENTS.set(arguments)
        try:
            return original(self, frame, *args, **kwargs)
        except Exception as error:
            if _dynamo_runs_eagerly_after(self, error):
                backend, options = _innermost_backend(self._torchdynamo_orig_backend)
                record = _eager_frame(frame.f_code, error)
                for each in list(_EAGER_FRAME_WATCHERS):
                    each(backend, options, record, arguments)
            raise
        finally:
            _FRAME_ARGUMENTS.reset(token)

    watched._memcompile_watched = True
    convert.__call__ = watched


def _dynamo_runs_eagerly_after(convert: Any, error: Exception) -> bool:
    """What torch/_dynamo/convert_frame.py ConvertFrame.__call__ does with a failed conversion:
    soft failures (unsupported code, user errors), or every error under `suppress_errors`, run
    the frame eagerly; fullgraph / export conversions and error_on_graph_break raise."""
    from torch._dynamo import config as dynamo_config
    from torch._dynamo import exc

    if convert._one_graph or convert._export or convert._box.error_on_graph_break:
        return False
    if isinstance(error, (exc.ResumePrologueTracingError, exc.UncapturedHigherOrderOpError)):
        return False
    return isinstance(error, (exc.Unsupported, exc.UserError)) or bool(dynamo_config.suppress_errors)


def _innermost_backend(fn: Any) -> tuple[Any, dict]:
    """The user's backend under Dynamo's wrappers (its debug wrapper, DDPOptimizer, the
    torch.compile wrapper), and the options torch.compile passes it."""
    for _ in range(8):
        owner = getattr(fn, "__self__", None)
        if owner is not None and hasattr(owner, "backend_compile_fn"):  # DDPOptimizer.compile_fn
            fn = owner.backend_compile_fn
        elif hasattr(fn, "_torchdynamo_orig_backend"):  # WrapBackendDebug
            fn = fn._torchdynamo_orig_backend
        elif hasattr(fn, "compiler_fn") and isinstance(getattr(fn, "kwargs", None), dict):  # _TorchCompileWrapper
            return fn.compiler_fn, dict(fn.kwargs.get("options") or {})
        else:
            break
    return fn, {}


def _eager_frame(code: Any, error: Exception) -> EagerFrame:
    """Dynamo's graph-break type; where one graph break led to another (a break inside a loop),
    the first one's too, and the user's line it happened at."""
    first_line = (str(getattr(error, "msg", error)).strip().splitlines() or [type(error).__name__])[0]
    kind = getattr(error, "gb_type", None) or first_line
    reason = kind if first_line in (kind, "") else f"{kind}: {first_line}"
    stack = getattr(error, "real_stack", None)
    if stack:
        reason += f", at {stack[-1].filename}:{stack[-1].lineno}"
    return EagerFrame(code.co_name, f"{code.co_filename}:{code.co_firstlineno}", reason)
