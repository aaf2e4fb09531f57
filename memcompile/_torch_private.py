"""Every private torch API memcompile touches, behind names of ours.

Tested against torch 2.13.0 only (pyproject pins <2.14). When torch moves one of these, this is
the one file to change; tests/test_private_api_boundary.py fails if `torch._` is imported anywhere
else in the package.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch._dynamo.backends.common import aot_autograd as _aot_autograd
from torch._functorch import config as _functorch_config
from torch._functorch import partitioners as _partitioners
from torch._functorch._aot_autograd.utils import _is_primal, _is_tangent
from torch._functorch.compile_utils import raise_getitems as _raise_getitems
from torch._inductor import config as _inductor_config
from torch._inductor.compile_fx import compile_fx as _compile_fx
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


def stock_partition(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any):
    """PyTorch's own min-cut partitioner (used for graphs we do not plan, e.g. no backward)."""
    return _partitioners.min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)


def is_fake_tensor(x: object) -> bool:
    return isinstance(x, _FakeTensor)


def inductor_decompositions() -> dict:
    return _select_decomp_table()


@contextlib.contextmanager
def caches_disabled():
    """Plans are made inside the partitioner, which a cache hit skips; until plans are persisted
    next to Inductor's cache entries we compile without the FX/AOT caches."""
    with _functorch_config.patch(enable_autograd_cache=False), _inductor_config.patch(
        fx_graph_cache=False
    ):
        yield


def compile_with_inductor(
    gm: fx.GraphModule, example_inputs: Sequence[Any], partitioner: _CustomPartitionerFn
) -> Callable:
    """Stock Inductor (pre/post-grad passes, codegen) with our partitioner plugged in."""
    with caches_disabled():
        return _compile_fx(gm, example_inputs, config_patches={"custom_partitioner_fn": partitioner})


def _boxed_interpreter(gm: fx.GraphModule, _example_inputs: Any) -> Callable:
    """Run an FX graph eagerly, freeing every value after its last use (boxed calling
    convention), so memory follows the graph order exactly as the liveness pass models it."""

    def run(args: list) -> Any:
        return fx.Interpreter(gm, garbage_collect_values=True).boxed_run(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def compile_with_aot_eager(
    gm: fx.GraphModule, example_inputs: Sequence[Any], partition_fn: Callable
) -> Callable:
    """AOTAutograd + our partitioner, graphs run by the FX interpreter (fast tests, no codegen)."""
    backend = _aot_autograd(
        fw_compiler=_boxed_interpreter,
        bw_compiler=_boxed_interpreter,
        inference_compiler=_boxed_interpreter,
        partition_fn=partition_fn,
        decompositions=_select_decomp_table(),
    )
    with caches_disabled():
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


@functools.lru_cache(maxsize=1)
def inductor_lowering_facts() -> tuple[frozenset, frozenset, frozenset]:
    """(ops Inductor lowers itself, ops it runs as fallback kernels, ops whose inputs it realizes)
    from torch._inductor.lowering's tables: what passes/fusion.py predicts materialization from."""
    from torch._inductor import lowering

    return (frozenset(k for k in lowering.lowerings if isinstance(k, torch._ops.OpOverload)),
            frozenset(lowering.fallbacks), frozenset(lowering.needs_realized_inputs))


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
