"""Other forms an activation can wait for the backward in: quantized on the device, or in host memory.

Each format is a pair of graph builders (forward: tensor -> stored values; backward: stored
values -> tensor) made of aten ops Inductor lowers, so conversions fuse with their neighbours,
plus the sizes and costs the solver needs. Which tensors may use which form, and why not, is
decided here too (`store_choices_for`), so the plan can say why a tensor was excluded.

Error of the lossy formats, per element x of a group g (groups: trailing dims of >= 256 elements):
  int8  absmax scaling, round to nearest: |x - x̂| <= max|g| / 254
  fp8   e4m3 scaled to the group's absmax (448): relative error <= 2^-4 (3 mantissa bits)
  bf16  round to nearest: relative error <= 2^-8
"""

from __future__ import annotations

import math
from dataclasses import dataclass
import torch
import torch.fx as fx

from memcompile.cost_models.device import DeviceProfile
from memcompile.node_facts import is_aliasing_op, is_getitem, is_pointwise
from memcompile.plan import Choice
from memcompile.solver.activations import StoreChoice
from memcompile.transfer_ops import COPY_TO_DEVICE, COPY_TO_HOST, WAIT_COPY

aten = torch.ops.aten
prims = torch.ops.prims

LOSSY_FORMATS = ("int8", "fp8", "bf16")
# Storages created by nodes with this name prefix live in host memory: not device bytes.
HOST_PREFIX = "memcompile_host_"
# Below this a tensor is not worth a conversion kernel (launch cost, scale overhead).
MIN_STORE_BYTES = 64 * 1024
_GROUP_ELEMENTS = 256
_FP8_MAX = 448.0  # largest finite float8_e4m3fn
_INT8_MAX = 127.0
_TINY = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class StoreOptions:
    """What the user allowed: lossy formats (opt-in) and offload."""

    formats: tuple[str, ...] = ()
    offload: bool = False
    host_link_bytes_per_s: float = 0.0  # used for offload cost; 0 = the profile's


def _group_dims(shape) -> list[int]:
    """Trailing dims spanning >= _GROUP_ELEMENTS elements (all dims if the tensor is smaller):
    one scale per group keeps scale overhead small for any layout (rows, channels, pixels)."""
    dims, size = [], 1
    for d in reversed(range(len(shape))):
        dims.append(d)
        size *= int(shape[d])
        if size >= _GROUP_ELEMENTS:
            break
    return sorted(dims)


def _num_groups(val: torch.Tensor) -> int:
    dims = set(_group_dims(val.shape))
    groups = 1
    for d, s in enumerate(val.shape):
        if d not in dims:
            groups *= int(s)
    return groups


def stored_nbytes(val: torch.Tensor, fmt: str) -> int:
    """Device bytes the stored form takes (values plus float32 scales); matches the built ops."""
    numel = int(val.numel())
    if fmt == "bf16":
        return numel * 2
    if fmt in ("int8", "fp8"):
        return numel + 4 * _num_groups(val)
    if fmt == "host":
        return 0
    raise ValueError(f"unknown stored format {fmt!r}")


def exclusion_reason(node: fx.Node, fmt: str) -> str:
    """Why `node`'s value may not be stored as `fmt` ('' if it may)."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return "not a tensor"
    if fmt == "host":
        return ""
    if not val.dtype.is_floating_point or val.dtype.itemsize < 2:
        return "integer, boolean or 8-bit tensor"
    if fmt == "bf16" and val.dtype != torch.float32:
        return "bf16 only shrinks float32 tensors"
    if val.dim() == 0:
        return "scalar"
    if _may_hold_non_finite(node):
        # absmax is inf: every value divides to 0 or NaN (GPT-2's causal mask where(m, 0, -inf),
        # stored int8, made every gradient NaN).
        return "may hold inf/NaN (a constant inf or NaN it is computed from): absmax scaling breaks"
    if _is_attention_bias(node):
        # Added to the scores unscaled: absmax rounding beside large masked entries erases the
        # small biases (ALiBi, relative positions).
        return "attention mask or bias: absmax rounding erases its small entries"
    return error_sensitivity(node, fmt)


_NON_FINITE_DEPTH = 8  # ops searched back from a value for a non-finite constant


def _may_hold_non_finite(node: fx.Node) -> bool:
    """A constant inf or NaN among the arguments of `node` or of the ops it is computed from
    (up to _NON_FINITE_DEPTH ops back): `full(-inf)`, `where(mask, 0, -inf)`, `masked_fill`."""
    stack, seen = [(node, 0)], set()
    while stack:
        n, depth = stack.pop()
        if n in seen or depth > _NON_FINITE_DEPTH or n.op != "call_function":
            continue
        seen.add(n)
        for a in list(n.args) + list(n.kwargs.values()):
            for item in a if isinstance(a, (tuple, list)) else (a,):
                if isinstance(item, float) and not math.isfinite(item):
                    return True
                if isinstance(item, fx.Node):
                    stack.append((item, depth + 1))
    return False


def _is_attention_bias(node: fx.Node) -> bool:
    """`node` (or a view of it) is read by an attention op other than as query, key or value."""
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        for user in n.users:
            name = str(user.target)
            if "scaled_dot_product" in name or "attention" in name:
                if n not in user.args[:3]:
                    return True
            elif user.op == "call_function" and is_aliasing_op(user):
                stack.append(user)
    return False


def error_sensitivity(node: fx.Node, fmt: str) -> str:
    """Why rounding `node`'s value to `fmt` would wreck its backward ('' if it would not). Such a
    value is neither stored as `fmt` nor recomputed from a value stored as `fmt`."""
    # Decompositions turn softmax into exp/sum/div; the op it came from is kept in the metadata.
    name = f"{node.target} {node.meta.get('original_aten', '')}"
    if fmt in ("int8", "fp8") and "softmax" in name:
        # Probabilities span orders of magnitude within a row: absmax int8/fp8 scaling zeroes
        # the small ones, which attention's backward multiplies by large gradients.
        return "softmax output: small probabilities lose all precision under absmax scaling"
    if fmt != "host" and any(op in name for op in ("tanh", "sigmoid")):
        # Their backward computes 1 - y^2 or y (1 - y): near saturation (y ~ +-1, 0 or 1) any
        # rounding of y is the whole answer, and gradient errors were > 50% in our tests.
        return "tanh/sigmoid output: its derivative cancels catastrophically near saturation"
    return ""


def conversion_scratch_bytes(val: torch.Tensor, fmt: str) -> tuple[int, int]:
    """Temporaries of `build_store` / `build_load` beyond x, the stored form and the result, when
    every op's output is a buffer (the FX interpreter; Inductor fuses them away): at most two
    float32 copies while quantizing; while dequantizing, the float32 product when x is not
    float32 and the float32 widening of fp8 (which has no type promotion)."""
    wide = 4 * int(val.numel())
    if fmt == "bf16":
        return 0, 0
    load = (wide if fmt == "fp8" else 0) + (wide if val.dtype != torch.float32 else 0)
    return 2 * wide, load


def store_choices_for(
    node: fx.Node, nbytes: int, profile: DeviceProfile, options: StoreOptions,
) -> tuple[tuple[StoreChoice, ...], str]:
    """The store choices `node` may take, and why others were excluded (for the plan)."""
    if nbytes < MIN_STORE_BYTES or not (options.formats or options.offload):
        return (), ("" if not (options.formats or options.offload) else "smaller than 64 KiB")
    val = node.meta["val"]
    choices, reasons = [], []
    for fmt in options.formats:
        why = exclusion_reason(node, fmt)
        if why:
            reasons.append(f"no {fmt}: {why}")
            continue
        held = stored_nbytes(val, fmt)
        # Quantize reads x twice (absmax, convert) and writes the stored form; dequantize reads
        # it and writes x: ~4 kernels, each memory-bound.
        moved = 3 * nbytes + 2 * held + nbytes
        store_scratch, load_scratch = conversion_scratch_bytes(val, fmt)
        convert_s = profile.memory_time_s(moved, nbytes + held) + 4 * profile.op_overhead_s
        choices.append(StoreChoice(Choice.QUANTIZE, fmt, held, convert_s,
                                   store_transient_bytes=store_scratch, load_transient_bytes=load_scratch))
    if options.offload:
        link = options.host_link_bytes_per_s or profile.host_link_bytes_per_s or profile.memory_bytes_per_s
        # Asynchronous copies (passes/partition.py): each direction costs two op launches; the
        # transfer itself is paid only where it outlasts the compute it overlaps (the solver's
        # link term), and the analysis sets how long the copies stay in flight.
        choices.append(StoreChoice(Choice.OFFLOAD, "host", 0, 4 * profile.op_overhead_s, link_s=nbytes / link))
    return tuple(choices), "; ".join(reasons)


# ---- graph builders ---------------------------------------------------------------------------

def call_with_value(graph: fx.Graph, target, args: tuple, kwargs: dict | None = None,
                    name: str | None = None) -> fx.Node:
    """A call_function node with its FakeTensor value computed from its inputs' values."""
    node = graph.create_node("call_function", target, args, kwargs or {}, name=name)
    vals = fx.node.map_arg((args, kwargs or {}), lambda n: n.meta["val"])
    node.meta["val"] = target(*vals[0], **vals[1])
    return node


def build_store(graph: fx.Graph, x: fx.Node, choice: StoreChoice) -> list[fx.Node]:
    """Forward ops turning x into its quantized form; returns the nodes to save for backward."""
    val = x.meta["val"]
    if choice.format == "bf16":
        return [call_with_value(graph, prims.convert_element_type.default, (x, torch.bfloat16), name=f"{x.name}_bf16")]
    dims = _group_dims(val.shape)
    limit = _INT8_MAX if choice.format == "int8" else _FP8_MAX
    x32 = x if val.dtype == torch.float32 else call_with_value(graph, prims.convert_element_type.default, (x, torch.float32))
    absmax = call_with_value(graph, aten.amax.default, (call_with_value(graph, aten.abs.default, (x32,)), dims, True))
    # A floor on the scale: a group of zeros gives 0 / tiny = 0, never 0 / 0.
    scale = call_with_value(graph, aten.clamp_min.default, (call_with_value(graph, aten.div.Scalar, (absmax, limit)), _TINY),
                  name=f"{x.name}_scale")
    scaled = call_with_value(graph, aten.div.Tensor, (x32, scale))
    if choice.format == "int8":
        nearest = call_with_value(graph, aten.round.default, (scaled,))
        above = call_with_value(graph, aten.clamp_min.default, (nearest, -limit))
        rounded = call_with_value(graph, aten.clamp_max.default, (above, limit))
        q = call_with_value(graph, prims.convert_element_type.default, (rounded, torch.int8), name=f"{x.name}_int8")
    else:
        q = call_with_value(graph, prims.convert_element_type.default, (scaled, torch.float8_e4m3fn), name=f"{x.name}_fp8")
    return [q, scale]


def build_load(graph: fx.Graph, stored: list[fx.Node], x: fx.Node, choice: StoreChoice) -> fx.Node:
    """Backward ops turning the quantized form back into a tensor like x."""
    val = x.meta["val"]
    if choice.format == "bf16":
        return call_with_value(graph, prims.convert_element_type.default, (stored[0], val.dtype), name=f"{x.name}_dequant")
    q, scale = stored
    # int8 * float32 promotes to float32 in one op; float8 has no type promotion, so widen first.
    wide = q if choice.format == "int8" else call_with_value(graph, prims.convert_element_type.default, (q, torch.float32))
    # Pointwise ops and conversions keep x's strides, so backward kernels see the layout they were traced with.
    if val.dtype == torch.float32:
        return call_with_value(graph, aten.mul.Tensor, (wide, scale), name=f"{x.name}_dequant")
    restored = call_with_value(graph, aten.mul.Tensor, (wide, scale))
    return call_with_value(graph, prims.convert_element_type.default, (restored, val.dtype), name=f"{x.name}_dequant")


def build_offload(graph: fx.Graph, x: fx.Node, wait_after: fx.Node, pinned: bool) -> tuple[fx.Node, fx.Node]:
    """Forward: the copy to host right after x, and its wait after `wait_after` (x's last forward
    reader or later, while the copy is in flight); `pinned`: the wait depends on `wait_after`
    (a materialised forward node) so no compiler runs it earlier. Returns (copy, wait); the wait
    is saved."""
    with graph.inserting_before(x.next):
        copy = call_with_value(graph, COPY_TO_HOST, (x,), name=f"{HOST_PREFIX}{x.name}_copy")
    if wait_after is x:
        wait_after = copy
    with graph.inserting_after(wait_after):
        wait = call_with_value(graph, WAIT_COPY, (copy, x, wait_after if pinned else None), name=f"{HOST_PREFIX}{x.name}")
    return copy, wait


# How far back an ordering dependency is looked for (nodes).
_PIN_SEARCH = 32


def is_materialised(node: fx.Node) -> bool:
    """A compute node compilers put in a buffer of its own anyway (not pointwise, not a view: a
    matmul, a reduction, a library kernel) yielding a tensor: safe for a transfer op to depend on
    for its order (a pointwise node would be forced out of its fused kernel). Transfers are not
    used: each copy's one reader stays its wait."""
    return (node.op == "call_function" and isinstance(node.meta.get("val"), torch.Tensor)
            and node.target not in (COPY_TO_HOST, COPY_TO_DEVICE, WAIT_COPY)
            and not is_pointwise(node) and not is_aliasing_op(node) and not is_getitem(node))


def ordering_dependency(start: fx.Node, exclude: tuple = ()) -> fx.Node | None:
    """The nearest materialised node at or before `start`: a transfer op reading it as `after`
    runs no earlier."""
    node = start
    for _ in range(_PIN_SEARCH):
        if node.op in ("root", "placeholder"):
            return None
        if node not in exclude and is_materialised(node):
            return node
        node = node.prev
    return None


def pin_reload_order(bw: fx.GraphModule) -> None:
    """Set each reload's and its wait's `after` (their last argument) to the materialised node
    before them in the backward, whose order is final: Inductor keeps them at least that late
    (it hoists ops that read only inputs otherwise)."""
    for node in bw.graph.nodes:
        if node.target is COPY_TO_DEVICE or (node.target is WAIT_COPY and node.args[0].target is COPY_TO_DEVICE):
            node.args = (*node.args[:-1], ordering_dependency(node.prev, exclude=tuple(node.all_input_nodes)))
    bw.graph.lint()
    bw.recompile()


def build_reload(graph: fx.Graph, host: fx.Node, x: fx.Node) -> tuple[fx.Node, fx.Node]:
    """Backward: the copy back to x's device and layout, and its wait. Returns (copy, wait); the
    copy is moved earlier once the backward's order is final (`issue_reloads_early`)."""
    val = x.meta["val"]
    copy = call_with_value(graph, COPY_TO_DEVICE, (host, val.device, list(val.size()), list(val.stride()), None),
                 name=f"{x.name}_reload")
    return copy, call_with_value(graph, WAIT_COPY, (copy, None, None), name=f"{x.name}_reloaded")


def issue_reloads_early(bw: fx.GraphModule, anchors: dict[str, str]) -> None:
    """Move each reload copy (by name) to just before its anchor node, when the anchor runs
    earlier: the copy then overlaps the backward between the two (prefetch)."""
    nodes = {n.name: n for n in bw.graph.nodes}
    order = {n: k for k, n in enumerate(bw.graph.nodes)}
    for copy_name, anchor_name in anchors.items():
        copy, anchor = nodes.get(copy_name), nodes.get(anchor_name)
        if copy is None:
            continue
        if anchor is not None and order[anchor] < order[copy] \
                and not any(order[i] >= order[anchor] for i in copy.all_input_nodes):
            anchor.prepend(copy)
    bw.graph.lint()
    bw.recompile()
