"""What an optimizer holds on the step's device: `memcompile.budget(..., optimizer=opt)`.

    optimizer_reserve(torch.optim.AdamW(model.parameters()))
    # -> OptimizerReserve(nbytes, "AdamW: exp_avg, exp_avg_sq per parameter ... (from the algorithm)")

The state exists from the first `optimizer.step()` on, so during every later step's forward and
backward (where its peak is) it is held outside the compiled graphs: a reserve. Read from
`optimizer.state` where it is populated (any optimizer: what its tensors on the parameters'
device hold, 8-bit states included), else from the algorithm for the optimizers in _RULES:

- Adam, AdamW: exp_avg and exp_avg_sq (+ max_exp_avg_sq with amsgrad), each the size and dtype of
  its parameter, foreach or not; a 0-dim `step` per parameter, on the parameter's device only
  with fused=True or capturable=True (else on the CPU: counted only for a CPU step).
- SGD: momentum_buffer with momentum != 0, nothing without.
- RMSprop, Adamax, NAdam, RAdam, Adadelta, Adagrad, Rprop: their buffers, likewise.

Any other optimizer whose state is not populated yet raises TypeError: call again after its
first step(), or pass what it holds as `reserve=`. Parameters without requires_grad get no state
(unless it is there already: Adagrad makes its state in its constructor). Not counted: what
`optimizer.step()` allocates while it runs (the foreach implementations' temporaries): the step's
forward and backward are over by then, with their activations freed.
Wrappers with an `.optimizer` attribute (accelerate's AcceleratedOptimizer) are read through.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from memcompile.plan import format_bytes


@dataclass(frozen=True)
class OptimizerReserve:
    nbytes: int
    source: str  # how nbytes was counted, for the plan


@dataclass(frozen=True)
class _Rule:
    buffers: Callable[[dict], tuple[str, ...]]  # full-size state tensors per parameter, from its group
    scalars: int  # 0-dim state tensors per parameter
    scalars_on_device: tuple[str, ...] = ("capturable",)  # group flags that put them on the parameter's device


def _flag(group: dict, name: str) -> bool:
    return bool(group.get(name))


_RULES: dict[type, _Rule] = {
    torch.optim.Adam: _Rule(lambda g: ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if _flag(g, "amsgrad") else ()),
                            1, ("capturable", "fused")),
    torch.optim.AdamW: _Rule(lambda g: ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if _flag(g, "amsgrad") else ()),
                             1, ("capturable", "fused")),
    torch.optim.SGD: _Rule(lambda g: ("momentum_buffer",) if g.get("momentum", 0) else (), 0),
    torch.optim.RMSprop: _Rule(lambda g: ("square_avg",) + (("momentum_buffer",) if g.get("momentum", 0) else ())
                               + (("grad_avg",) if _flag(g, "centered") else ()), 1),
    torch.optim.Adamax: _Rule(lambda g: ("exp_avg", "exp_inf"), 1),
    torch.optim.NAdam: _Rule(lambda g: ("exp_avg", "exp_avg_sq"), 2),
    torch.optim.RAdam: _Rule(lambda g: ("exp_avg", "exp_avg_sq"), 1),
    torch.optim.Adadelta: _Rule(lambda g: ("square_avg", "acc_delta"), 1),
    torch.optim.Adagrad: _Rule(lambda g: ("sum",), 1, ("fused",)),
    torch.optim.Rprop: _Rule(lambda g: ("prev", "step_size"), 1),
}


def _unwrapped(optimizer: object) -> torch.optim.Optimizer:
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer) and type(optimizer) not in _RULES:
        optimizer = inner
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer has type {type(optimizer).__name__}: expected a torch.optim.Optimizer "
                        "(its state is counted in the reserve)")
    return optimizer


def _scalar_bytes(group: dict) -> int:
    # torch.optim's _get_scalar_dtype: float32 (fused), else float64 under a float64 default dtype
    return 4 if _flag(group, "fused") or torch.get_default_dtype() != torch.float64 else 8


def _populated_bytes(param: torch.Tensor, state: dict) -> int:
    """What a parameter's state tensors hold on its device (each storage once)."""
    seen, total = set(), 0
    for value in state.values():
        if isinstance(value, torch.Tensor) and value.device == param.device:
            storage = value.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def _estimated_bytes(param: torch.Tensor, group: dict, rule: _Rule) -> int:
    full = len(rule.buffers(group)) * param.numel() * param.element_size()
    on_device = param.device.type == "cpu" or any(_flag(group, f) for f in rule.scalars_on_device)
    return full + (rule.scalars * _scalar_bytes(group) if on_device else 0)


def optimizer_reserve(optimizer: object) -> OptimizerReserve:
    """Bytes `optimizer` holds on its parameters' device during a step's forward and backward."""
    optimizer = _unwrapped(optimizer)
    name = type(optimizer).__name__
    rule = _RULES.get(type(optimizer))
    read = estimated = unknown = 0
    total = 0
    buffers: set[str] = set()
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param)
            if state:  # whatever it is (Adagrad fills its state in __init__, frozen parameters too)
                total += _populated_bytes(param, state)
                read += 1
            elif not param.requires_grad:
                continue  # no gradient, no step: no state
            elif rule is not None:
                total += _estimated_bytes(param, group, rule)
                buffers.update(rule.buffers(group))
                estimated += 1
            else:
                unknown += 1
    if unknown and not read:
        raise TypeError(
            f"memcompile cannot tell what {name} will hold before its first step(): its state is empty and "
            f"memcompile knows the algorithms of {', '.join(sorted(c.__name__ for c in _RULES))} only. Pass "
            "optimizer= after one optimizer.step() (the state is then read), or its bytes as reserve=")
    parts = []
    if read:
        parts.append(f"{read} parameter(s) from optimizer.state")
    if estimated:
        what = ", ".join(sorted(buffers))
        scalars = f"{rule.scalars} 0-dim tensor(s) where on its device" if rule.scalars else ""
        held = " plus ".join(x for x in (f"{what} in its dtype" if what else "", scalars) if x) or "nothing"
        parts.append(f"{estimated} from the algorithm ({held} per parameter)")
    if unknown:
        parts.append(f"{unknown} without state yet not counted (what {name} will give them is unknown)")
    return OptimizerReserve(total, f"{name} state {format_bytes(total)}: " + "; ".join(parts or ["no parameters"]))
