"""Facts about FX nodes that the passes read: purity, the user's checkpoint tags, what Inductor
fuses, and the Dynamo-graph rewrites' shared steps. Facts the cost models read too live in
memcompile/node_facts.py; what a node costs, in cost_models/."""

from __future__ import annotations

import copy
import operator

import torch
import torch.fx as fx

from memcompile import _torch_private as tp
from memcompile.node_facts import is_aliasing_op, is_getitem, is_pointwise
from memcompile.sizes import size_value


def _argument(node: fx.Node, name: str, default: object = None) -> object:
    """An op argument by schema name, whether passed by position or keyword."""
    if name in node.kwargs:
        return node.kwargs[name]
    schema = getattr(node.target, "_schema", None)
    for position, argument in enumerate(schema.arguments if schema else ()):
        if argument.name == name:
            return node.args[position] if position < len(node.args) else argument.default_value
    return default


def is_random_op(node: fx.Node) -> bool:
    """Ops whose result depends on the RNG state: recomputing them would change the values.

    Attention kernels are tagged random because of their dropout; with dropout_p == 0 they are
    deterministic and may be recomputed.
    """
    tags = getattr(node.target, "tags", ())
    if torch.Tag.nondeterministic_seeded not in tags:
        return False
    if "scaled_dot_product" in str(node.target):
        return _argument(node, "dropout_p", 0.0) not in (0, 0.0)
    return True


def is_mutating_op(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is not None and schema.is_mutable


def effective_reads(node: fx.Node, inlined: frozenset | set, either: frozenset | set = frozenset()) -> list[fx.Node]:
    """The buffers `node` reads once inlined producers are fused into it: an inlined producer is
    replaced by what it reads; an `either` producer (maybe inlined) counts as both."""
    out, stack, seen = [], list(node.all_input_nodes), set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in inlined or n in either:
            stack.extend(n.all_input_nodes)
        if n not in inlined:
            out.append(n)
    return out


def step_device(inputs: object) -> str:
    """The accelerator a step runs on: the type of the first non-CPU tensor among `inputs`
    (nested as AOTAutograd passes them, (primals, tangents)), else "cpu". A CPU scalar input (a
    seed, a step count) beside device tensors does not make the step a CPU one."""
    pending = [inputs]
    while pending:
        x = pending.pop(0)
        if isinstance(x, torch.Tensor):
            if x.device.type != "cpu":
                return x.device.type
        elif isinstance(x, (list, tuple)):
            pending[:0] = x
        elif isinstance(x, dict):
            pending[:0] = x.values()
    return "cpu"


def graph_device_type(gm: fx.GraphModule) -> str:
    """The device type of the graph's tensors (see step_device; "cpu" when it has none)."""
    return step_device([node.meta.get("val") for node in gm.graph.nodes])


# -- what the user and torch say about a node --------------------------------------------------

_BUILTIN_NAMESPACES = ("aten", "prims")


def is_builtin_op(node: fx.Node) -> bool:
    """An aten/prims operator overload (what AOTAutograd decomposes to). Custom ops
    (torch.library), higher-order ops and plain Python callables are not: their purity, their
    use of the random generator and their cost are unknown to us."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    namespace = getattr(node.target, "namespace", None)
    return hasattr(node.target, "_schema") and namespace in _BUILTIN_NAMESPACES


def checkpoint_policy(node: fx.Node) -> str:
    """The user's activation-checkpoint policy for `node` ("" when none): "MUST_SAVE",
    "PREFER_SAVE", "MUST_RECOMPUTE", "PREFER_RECOMPUTE", "MUST_CPU_OFFLOAD", "PREFER_CPU_OFFLOAD".

    torch.utils.checkpoint regions and selective-checkpoint policies reach the joint graph as
    `node.meta["recompute"]` (a CheckpointPolicy; plain `checkpoint()` tags PREFER_RECOMPUTE).
    Torch also forces some nodes to MUST_SAVE (boundaries between consecutive checkpoint regions,
    effectful ops, sources of backward mutations): those are hard too.
    """
    tag = node.meta.get("recompute")
    if tag is None:
        return ""
    name = getattr(tag, "name", None) or str(tag).rsplit(".", 1)[-1]
    return name


# -- what Inductor does with a node (facts for passes/fusion.py) ------------------------------

# Lowered to Pointwise bodies though not tagged pointwise (torch/_inductor/lowering.py: dtype
# conversions, copies, constant fills, indexing loads).
_POINTWISE_LOWERINGS = frozenset({
    "convert_element_type", "clone", "_to_copy", "full", "full_like", "scalar_tensor", "iota",
    "embedding", "index", "gather", "constant_pad_nd", "where", "masked_fill", "_unsafe_index",
    "zeros_like", "ones_like", "fill", "slice_scatter",
})
# Lowered with make_reduction (realized unless unrolled: reductions over <= 8 elements).
_REDUCTIONS = frozenset({
    "sum", "mean", "amax", "amin", "argmax", "argmin", "prod", "var_mean", "var", "std", "any",
    "all", "max", "min", "logsumexp", "std_mean",
})
# Computed into a fresh buffer like a reduction: `scatter(x, ...)` lowers to `scatter_(clone(x), ...)`
# (the clone is realized, x's body inlined into it; src and index are loaded inline), index_put the
# same; not the fallback cases of utils.use_scatter_fallback (reduce other than add/sum, GPU
# atomics), which these are not.
_SCATTERS = frozenset({"scatter", "scatter_add", "index_put", "_unsafe_index_put"})
# Lowered as a copy of their first input that the op then writes into (torch/_inductor/lowering.py:
# `index_put(x, ...)` is `index_put_impl_(clone(x), ...)`, `_unsafe_masked_index_put_accumulate` an
# `_unsafe_index_put`, the scatters likewise): the copy's kernel may take over x's buffer where x
# dies there (scheduler.decide_inplace_update), as the accumulate of an embedding's gradient does.
_WRITE_OVER_A_COPY = _SCATTERS | {"scatter_reduce", "_unsafe_masked_index_put_accumulate", "as_strided_scatter"}
_UNROLL_REDUCTIONS_THRESHOLD = 8  # torch/_inductor/config.py unroll_reductions_threshold
# Library kernels with a lowering that still need realized inputs (tuned_addmm's mm_args).
_EXTERN_WITH_LOWERING = frozenset({"addmm", "baddbmm", "_int_mm", "mm", "bmm", "convolution",
                                   "convolution_backward"})


def _packet_name(node: fx.Node) -> str:
    packet = getattr(node.target, "overloadpacket", None)
    return getattr(packet, "__name__", "") or str(getattr(node.target, "__name__", node.target)).split(".")[0]


def writes_over_a_copy_of_its_first_input(node: fx.Node) -> bool:
    """Whether Inductor lowers `node` as a copy of its first argument written into in place
    (_WRITE_OVER_A_COPY), so that the copy may reuse that argument's buffer where it dies."""
    return node.op == "call_function" and _packet_name(node) in _WRITE_OVER_A_COPY


def _is_small_reduction(node: fx.Node) -> bool:
    inp = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], fx.Node) else None
    out = node.meta.get("val")
    if isinstance(out, (tuple, list)):
        out = out[0] if out else None
    if not isinstance(inp, torch.Tensor) or not isinstance(out, torch.Tensor):
        return False
    outn = max(1, size_value(out.numel()))
    return size_value(inp.numel()) <= _UNROLL_REDUCTIONS_THRESHOLD * outn


def fusion_kind(node: fx.Node, lowered: frozenset, fallbacks: frozenset, realizes_inputs: frozenset) -> tuple[str, bool]:
    """(kind for passes/fusion.py, whether Inductor realizes the node's inputs)."""
    from memcompile.passes import fusion

    if node.op == "placeholder":
        return fusion.INPUT, False
    if is_getitem(node):
        return fusion.MEMBER, False
    if node.op != "call_function":
        return fusion.EXTERN, True
    name = _packet_name(node)
    needs_realized = node.target in realizes_inputs
    if is_mutating_op(node):
        return fusion.EXTERN, True
    if is_aliasing_op(node):
        return fusion.VIEW, needs_realized
    if (node.target in fallbacks or needs_realized or name in _EXTERN_WITH_LOWERING
            or getattr(node.target, "overloadpacket", None) is None or node.target not in lowered):
        return fusion.EXTERN, True
    if isinstance(node.meta.get("val"), (tuple, list)) and name not in _REDUCTIONS:
        return fusion.EXTERN, True  # multi-output lowerings we do not model (sort, topk, ...)
    if is_pointwise(node) or name in _POINTWISE_LOWERINGS:
        return fusion.POINTWISE, False
    if name in _REDUCTIONS:
        return (fusion.SMALL_REDUCTION if _is_small_reduction(node) else fusion.REDUCTION), False
    if name in _SCATTERS and _argument(node, "reduce", None) is None:
        return fusion.REDUCTION, False
    return fusion.OTHER, False


# Library kernels Inductor calls with an `out=` buffer its wrapper allocates (extern_kernels.mm
# etc.); other fallbacks allocate their results themselves.
_OUT_VARIANT_EXTERNS = frozenset({"mm", "addmm", "bmm", "baddbmm"})


def wrapper_allocates(kind: str, node: fx.Node) -> bool:
    """Whether Inductor's wrapper allocates `node`'s result (then it may reuse a freed buffer)."""
    from memcompile.passes import fusion

    if kind in (fusion.POINTWISE, fusion.REDUCTION, fusion.SMALL_REDUCTION, fusion.OTHER):
        return True
    return kind == fusion.EXTERN and _packet_name(node) in _OUT_VARIANT_EXTERNS


def fusion_facts(gm: fx.GraphModule, forced_outputs: set | frozenset = frozenset()) -> tuple:
    """The plain facts passes/fusion.py predicts Inductor's buffers from, in graph order.
    `forced_outputs`: nodes to treat as graph outputs too (a joint graph's saved activations)."""
    from memcompile import _torch_private as tp
    from memcompile.passes.fusion import HEAVY_OPS, OpFacts

    lowered, fallbacks, realizes_inputs = tp.inductor_lowering_facts()
    out = gm.graph.find_nodes(op="output")[0]
    outputs = set(out.all_input_nodes) | set(forced_outputs)
    facts = []
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        kind, realizes = fusion_kind(node, lowered, fallbacks, realizes_inputs)
        tensor_inputs = tuple(a.name for a in _flat_args(node) if isinstance(a, fx.Node))
        constants = sum(1 for a in _flat_args(node) if isinstance(a, (int, float, bool)) and not isinstance(a, fx.Node))
        facts.append(OpFacts(node.name, kind, tensor_inputs, constants if kind != "view" else 0,
                             node in outputs, _packet_name(node) in HEAVY_OPS, realizes))
    return tuple(facts)


def _flat_args(node: fx.Node) -> list:
    flat: list = []
    for a in list(node.args) + list(node.kwargs.values()):
        if isinstance(a, (tuple, list)):
            flat.extend(a)
        else:
            flat.append(a)
    return flat


def rewritten_copy(gm: fx.GraphModule, matches: tuple, rewrite) -> fx.GraphModule:
    """A copy of `gm` with `rewrite(graph, match, nodes by name)` applied to each match (found by
    node name in `gm`): the shared step of the Dynamo-graph rewrites (passes/loss_head.py,
    passes/mlp_chunk.py)."""
    out = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    by_name = {n.name: n for n in out.graph.nodes}
    for match in matches:
        rewrite(out.graph, match, by_name)
    out.graph.lint()
    out.recompile()
    return out


def node_adder(graph: fx.Graph, like: fx.Node):
    """add(op, target, args): a node in `graph` carrying `like`'s metadata but its values (the
    rewrite's new nodes are traced again by AOTAutograd), and its own fake `example_value` where
    its inputs have theirs (as Dynamo's nodes do: AOTAutograd's cache reads them)."""
    meta = {k: v for k, v in like.meta.items() if k not in ("example_value", "val", "tensor_meta")}

    def add(op: str, target, args: tuple) -> fx.Node:
        node = graph.create_node(op, target, args, {})
        node.meta.update(meta)
        value = tp.example_value_of(op, target, args)
        if value is not None:
            node.meta["example_value"] = value
        return node

    return add


def static_shape(node: object) -> tuple[int, ...] | None:
    """A Dynamo graph node's shape where every size is an int (its fake example value's); else None."""
    value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    if not isinstance(value, torch.Tensor):
        return None
    shape = tuple(value.shape)
    return shape if all(isinstance(s, int) for s in shape) else None
