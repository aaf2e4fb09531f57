"""AOTAutograd and the functorch partitioner: the joint graph, its stock preprocessing and
partition, the split into forward and backward, and the settings memcompile compiles under."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import torch.fx as fx
from torch._dynamo.backends.common import aot_autograd as _aot_autograd
from torch._functorch import config as _functorch_config
from torch._functorch import partitioners as _partitioners
from torch._functorch._aot_autograd.utils import _is_primal, _is_tangent
from torch._functorch.compile_utils import raise_getitems as _raise_getitems
from torch._inductor.custom_graph_pass import CustomPartitionerFn as _CustomPartitionerFn
from torch._inductor.decomposition import select_decomp_table as _select_decomp_table

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
