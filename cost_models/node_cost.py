"""Time to (re)compute one FX node: a roofline over FLOPs and bytes moved."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry

from memcompile.cost_models.device import DeviceProfile
from memcompile.cost_models.op_timing import measured_op_time_s
from memcompile.errors import UNREADABLE_GRAPH_ERRORS
from memcompile.node_facts import is_aliasing_op, is_getitem, tensor_nbytes


def _meta_value(arg: object) -> object:
    return arg.meta.get("val") if isinstance(arg, fx.Node) else arg


def _attention_flops(query, key, value, *, backward: bool) -> int:
    """Scaled-dot-product attention: per query-key pair, the scores (head dim d) and the weighted
    values (head dim dv) forward; the backward recomputes the scores and runs four more matmuls
    (two over d, two over dv). Causal masks are not discounted, as torch's own counts for the
    CUDA kernels do not: recomputing attention may be over-priced, never under-priced."""
    *heads, sq, d = query.shape
    sk, dv = key.shape[-2], value.shape[-1]
    pairs = sq * sk
    for h in heads:
        pairs *= h
    return 2 * pairs * ((3 * d + 2 * dv) if backward else (d + dv))


# FLOP formulas torch.utils.flop_counter has none for. Without them CPU attention was priced as a
# memory-bound op: recomputing it in Llama small's backward was costed 8 us where a call ran
# 0.46 ms (`python benchmarks/step_profile.py --model llama --budget 12467104` at 15a093a:
# 1,820 us for 4 calls a step; the profile is in commit eb5cdd4's benchmarks/results/).
_FLOPS_TORCH_LACKS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
        lambda q, k, v, *rest, **kw: _attention_flops(q, k, v, backward=False),
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward:
        lambda grad_out, q, k, v, *rest, **kw: _attention_flops(q, k, v, backward=True),
}


def _meta_arguments(node: fx.Node) -> tuple[tuple, dict]:
    """The node's arguments with its input nodes replaced by their fake values."""
    return torch.fx.node.map_aggregate(node.args, _meta_value), torch.fx.node.map_aggregate(node.kwargs, _meta_value)


def node_flops(node: fx.Node) -> int:
    """FLOPs of the op per torch.utils.flop_counter's formulas, or ours for ops it has none for
    (_FLOPS_TORCH_LACKS); 0 for ops neither has (pointwise, data movement: timed by bytes)."""
    packet = getattr(node.target, "_overloadpacket", None)
    formula = flop_registry.get(packet)
    if formula is None and packet in _FLOPS_TORCH_LACKS:
        ours = _FLOPS_TORCH_LACKS[packet]
        formula = lambda *args, out_val=None, **kwargs: ours(*args, **kwargs)  # noqa: E731
    if formula is None:
        return 0
    args, kwargs = _meta_arguments(node)
    try:
        flops = formula(*args, out_val=node.meta.get("val"), **kwargs)
    # torch's formulas assert what they cannot read (flop_counter: mm, bmm, attention shapes)
    except (*UNREADABLE_GRAPH_ERRORS, AssertionError):  # a formula that cannot read these shapes: memory-bound
        return 0
    if isinstance(flops, torch.SymInt):
        flops = flops.node.hint or 0
    return int(flops)


def node_bytes_moved(node: fx.Node) -> int:
    """Bytes read plus bytes written (an upper bound: fusion may keep some in registers)."""
    read = sum(tensor_nbytes(inp.meta.get("val")) for inp in node.all_input_nodes)
    return read + tensor_nbytes(node.meta.get("val"))


def estimate_node_time_s(node: fx.Node, profile: DeviceProfile) -> float:
    """Roofline estimate of one execution of `node`, or its measured time where the profile times
    compute-bound ops (op_timing.py); views and getitems are free."""
    if node.op != "call_function":
        return 0.0
    if is_aliasing_op(node) or is_getitem(node):
        return 0.0  # views and tuple access cost no compute
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):  # a multi-result op (attention): the rate of its first result's dtype
        val = next((v for v in val if isinstance(v, torch.Tensor)), None)
    flops = node_flops(node)
    if flops and profile.times_ops:
        measured = measured_op_time_s(node.target, *_meta_arguments(node), node.meta.get("val"))
        if measured is not None:
            return measured
    compute_s = flops / profile.matmul_rate(val.dtype if isinstance(val, torch.Tensor) else None)
    memory_s = profile.memory_time_s(node_bytes_moved(node))
    return max(compute_s, memory_s) + profile.op_overhead_s
