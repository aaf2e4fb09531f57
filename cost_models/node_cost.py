"""Time to (re)compute one FX node: a roofline over FLOPs and bytes moved."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry

from memcompile.cost_models.device import DeviceProfile
from memcompile.passes.graph_facts import is_aliasing_op, is_getitem, tensor_nbytes


def _meta_value(arg: object) -> object:
    return arg.meta.get("val") if isinstance(arg, fx.Node) else arg


def node_flops(node: fx.Node) -> int:
    """FLOPs of the op per torch.utils.flop_counter's formulas (0 for ops it has none for)."""
    packet = getattr(node.target, "_overloadpacket", None)
    formula = flop_registry.get(packet)
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
    memory_s = node_bytes_moved(node) / profile.memory_bytes_per_s
    return max(compute_s, memory_s) + profile.op_overhead_s
