"""Fake tensors, distributed tensors and the identities of ops as Dynamo records them."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor as _FakeTensor

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
