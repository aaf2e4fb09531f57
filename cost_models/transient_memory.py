"""Memory a node needs only while it runs: library kernels' workspaces, dense copies of strided
views and converted copies of mixed-dtype inputs."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from memcompile import loss_ops, mlp_ops
from memcompile.cost_models.attention_workspace import attention_workspace_bytes
from memcompile.cost_models.conv_workspace import convolution_workspace_bytes
from memcompile.cost_models.cpu_workspace import GEMM_OPS, LOW_PRECISION_GEMM_DTYPES, low_precision_gemm_scratch_bytes
from memcompile.node_facts import is_aliasing_op, is_getitem, is_pointwise, tensor_nbytes


def _needs_dense_input(node: fx.Node) -> bool:
    """Ops that run as library kernels (matmul, convolution, ...) rather than generated loops."""
    return (node.op == "call_function" and not is_pointwise(node) and not is_aliasing_op(node)
            and not is_getitem(node) and node.target is not operator.getitem)


def _is_strided_view(value: object) -> bool:
    """A view a library kernel cannot read in place: neither contiguous nor a transpose of it."""
    if not isinstance(value, torch.Tensor) or value.dim() < 2:
        return False
    if value.is_contiguous() or value.transpose(-1, -2).is_contiguous():
        return False
    return True


def layout_copy_bytes(node: fx.Node) -> int:
    """Bytes of the dense copies a library kernel makes of strided-view inputs while it runs."""
    if not _needs_dense_input(node):
        return 0
    total = 0
    for inp in node.all_input_nodes:
        if is_aliasing_op(inp) or is_getitem(inp):
            value = inp.meta.get("val")
            if _is_strided_view(value):
                total += tensor_nbytes(value)
    return total


def counted_exactly(node: fx.Node) -> bool:
    """A library call whose transient memory kernel_workspace_bytes counts exactly (or from
    above), so the check over Inductor's schedule needs no per-op margin there (at a partition's
    measured peak, 4 KiB too many is a rejected plan):
    - a float32 matrix multiply whose operands are contiguous or transposed-contiguous: BLAS
      reads them as they are, and MKL's buffers are its own (GPT-2 small's stock partitions
      peaked at a backward mm: predicted to the byte). Not float16/bfloat16: their oneDNN
      scratch is a bound fitted to measurements;
    - CPU flash attention in float32, forward or backward (attention_workspace.py, exact on 250
      random shapes; GPT-2's activation_memory_budget=0.8 partition peaks at one)."""
    out = node.meta.get("val")
    name = str(getattr(node.target, "__name__", node.target))
    if "_scaled_dot_product_flash_attention_for_cpu" in name:
        query = node.args[1 if "backward" in name else 0]
        query = query.meta.get("val") if isinstance(query, fx.Node) else None
        return isinstance(query, torch.Tensor) and query.dtype == torch.float32
    if node.target not in GEMM_OPS or not isinstance(out, torch.Tensor) or out.dtype in LOW_PRECISION_GEMM_DTYPES:
        return False
    operands = [a.meta.get("val") if isinstance(a, fx.Node) else None for a in node.args[-2:]]
    try:
        return len(operands) == 2 and all(
            isinstance(t, torch.Tensor) and t.dim() >= 2 and (t.is_contiguous() or t.transpose(-1, -2).is_contiguous())
            for t in operands)
    except Exception:  # noqa: BLE001 - symbolic strides that cannot be decided: assume a copy
        return False


def kernel_workspace_bytes(node: fx.Node, inductor: bool = False) -> int:
    """Bytes a library kernel allocates and frees inside itself while `node` runs. `inductor`:
    the graph runs as Inductor's code, which lays CPU convolutions out channels-last."""
    if node.op != "call_function":
        return 0
    if node.target in (loss_ops.FORWARD, mlp_ops.FORWARD, mlp_ops.BACKWARD):
        args = tuple(a.meta.get("val") if isinstance(a, fx.Node) else a for a in node.args)
        ops = loss_ops if node.target is loss_ops.FORWARD else mlp_ops
        return ops.workspace_bytes(node.target, args)
    name = str(getattr(node.target, "__name__", node.target))
    if "scaled_dot_product" in name:
        return attention_workspace_bytes(node)
    if node.target in GEMM_OPS:
        return low_precision_gemm_scratch_bytes(node)
    if "_unsafe_masked_index_put_accumulate" in name and not inductor:
        # The embedding backward's decomposition, run eagerly (Inductor lowers it to a scatter):
        # ATen clamps a copy of the indices, inverts the mask and masks a copy of the values
        # before accumulating (torch 2.13, CPU allocator events: 16,896 B beside the 8 KiB result
        # for GPT-2 tiny's position embedding, which measured 12.5 KiB over its floor uncounted).
        return sum(tensor_nbytes(i.meta.get("val")) for i in node.all_input_nodes[1:])
    if "convolution" not in name:
        return 0
    return convolution_workspace_bytes(node, inductor)


def promotion_copy_bytes(node: fx.Node) -> int:
    """Bytes of the converted copies a pointwise op makes of inputs whose dtype is not the one it
    computes in (CPU TensorIterator materialises them: `bool_mask * x` allocates a float copy
    of the mask, measured with torch 2.13), plus the product `prims.fma` (a*b + c) materialises
    when it runs eagerly."""
    if not is_pointwise(node):
        return 0
    out = node.meta.get("val")
    if not isinstance(out, torch.Tensor):
        return 0
    if "fma" in str(node.target):
        return tensor_nbytes(out)
    inputs = [i.meta.get("val") for i in node.all_input_nodes]
    if "where" in str(node.target):
        inputs = inputs[1:]  # the condition is read as it is
    tensors = [t for t in inputs if isinstance(t, torch.Tensor) and t.dim() > 0]
    if len(tensors) < 2:
        return 0
    common = tensors[0].dtype
    for t in tensors[1:]:
        common = torch.promote_types(common, t.dtype)
    return sum(t.numel() * common.itemsize for t in tensors if t.dtype != common and isinstance(t.numel(), int))


def transient_bytes(node: fx.Node, inductor: bool = False) -> int:
    """Memory `node` needs only while it runs: kernel workspaces, dense copies of views and
    converted copies of mixed-dtype inputs (`inductor`: see kernel_workspace_bytes)."""
    return kernel_workspace_bytes(node, inductor) + layout_copy_bytes(node) + promotion_copy_bytes(node)
