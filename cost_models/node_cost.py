"""Time to (re)compute one FX node: a roofline over FLOPs and bytes moved."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from memcompile.cost_models.device import DeviceProfile
from memcompile.passes.graph_facts import is_aliasing_op, is_getitem, tensor_nbytes

aten = torch.ops.aten


def _meta_value(arg: object) -> object:
    return arg.meta.get("val") if isinstance(arg, fx.Node) else arg


def _cpu_flash_attention_flops(query, key, value, *args, out_val=None, **kwargs) -> int:
    return sdpa_flop_count(query.shape, key.shape, value.shape)


def _cpu_flash_attention_backward_flops(grad_out, query, key, value, *args, out_val=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


# Ops torch.utils.flop_counter has no formula for. Without one, the CPU attention kernel (what
# SDPA lowers to on CPU) counted as memory-bound: recomputing GPT-2's attention was priced at
# ~9 us where it takes ~1 ms, and plans recomputed it freely.
_EXTRA_FLOP_FORMULAS = {
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_attention_flops,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_attention_backward_flops,
}

# Pointwise ops that evaluate a transcendental function per element (compute-bound on a CPU core).
_TRANSCENDENTAL = {
    aten.tanh, aten.exp, aten.exp2, aten.expm1, aten.log, aten.log1p, aten.log2, aten.sigmoid,
    aten.erf, aten.erfc, aten.erfinv, aten.sin, aten.cos, aten.tan, aten.atan, aten.asin, aten.acos,
    aten.sinh, aten.cosh, aten.gelu, aten.gelu_backward, aten.silu, aten.silu_backward, aten.softplus,
    aten.elu, aten.mish, aten._softmax, aten._log_softmax, aten.pow,
}


def node_flops(node: fx.Node) -> int:
    """FLOPs of the op per torch.utils.flop_counter's formulas (0 for ops it has none for)."""
    packet = getattr(node.target, "_overloadpacket", None)
    formula = flop_registry.get(packet) or _EXTRA_FLOP_FORMULAS.get(packet)
    if formula is None:
        return 0
    args = torch.fx.node.map_aggregate(node.args, _meta_value)
    kwargs = torch.fx.node.map_aggregate(node.kwargs, _meta_value)
    try:
        flops = formula(*args, out_val=node.meta.get("val"), **kwargs)
    except Exception:  # a formula that cannot read these shapes: treat the op as memory-bound
        return 0
    if isinstance(flops, torch.SymInt):
        flops = flops.node.hint or 0
    return int(flops)


def transcendental_elements(node: fx.Node) -> int:
    """Transcendental function evaluations of a pointwise op: one per output element (0 for
    other ops, and for pow with an integer exponent, which compilers expand to multiplies)."""
    packet = getattr(node.target, "_overloadpacket", None)
    if packet not in _TRANSCENDENTAL:
        return 0
    if packet is aten.pow and len(node.args) > 1 and isinstance(node.args[1], (int, float)) \
            and float(node.args[1]).is_integer():
        return 0
    val = node.meta.get("val")
    return val.numel() if isinstance(val, torch.Tensor) else 0


def node_bytes_moved(node: fx.Node) -> int:
    """Bytes read plus bytes written (an upper bound: fusion may keep some in registers)."""
    read = sum(tensor_nbytes(inp.meta.get("val")) for inp in node.all_input_nodes)
    return read + tensor_nbytes(node.meta.get("val"))


def estimate_node_time_s(node: fx.Node, profile: DeviceProfile) -> float:
    """Roofline estimate of one execution of `node`; views and getitems are free."""
    if node.op != "call_function":
        return 0.0
    if is_aliasing_op(node) or is_getitem(node):
        return 0.0  # views and tuple access cost no compute
    val = node.meta.get("val")
    compute_s = node_flops(node) / profile.matmul_rate(val.dtype if isinstance(val, torch.Tensor) else None)
    if profile.transcendental_per_s:
        compute_s += transcendental_elements(node) / profile.transcendental_per_s
    memory_s = node_bytes_moved(node) / profile.memory_bytes_per_s
    return max(compute_s, memory_s) + profile.op_overhead_s
