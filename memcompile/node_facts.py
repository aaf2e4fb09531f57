"""Small facts about FX nodes that passes and cost models both read (imports neither package)."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from memcompile.sizes import size_value


def tensor_nbytes(value: object) -> int:
    """Bytes of a tensor (or of the tensors in a tuple/list); symbolic sizes: see memcompile.sizes."""
    if isinstance(value, torch.Tensor):
        # symbolic sizes: the sizes being planned for (memcompile.sizes), else the traced ones
        return size_value(value.numel()) * value.dtype.itemsize
    if isinstance(value, (tuple, list)):
        return sum(tensor_nbytes(v) for v in value)
    return 0


def is_aliasing_op(node: fx.Node) -> bool:
    """True when the op's first output shares storage with its first input (views, in-place writes)."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None or not schema.returns:
        return False
    return schema.returns[0].alias_info is not None


def is_getitem(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem


def is_pointwise(node: fx.Node) -> bool:
    return node.op == "call_function" and torch.Tag.pointwise in getattr(node.target, "tags", ())
