"""A transformer MLP computed by token rows: the (tokens x intermediate) activations exist one
chunk at a time, in the forward and in the backward.

    up = x @ w_up.T + b_up
    inner = act(up)                                   (plain: GPT-2, BERT, ViT)
    inner = act(x @ w_gate.T + b_gate) * up           (gated: Llama's SwiGLU)
    y = inner @ w_down.T + b_down

Why: at tight budgets the step's peak sits inside an MLP's backward (Llama small: five 688 KiB
SwiGLU buffers at once; ViT small: the last block's 1 MiB pre- and post-activation and their
gradient). No keep/recompute choice lowers that working set: it is what the unchunked backward
needs at once. Chunked, the forward saves only `x` and the backward recomputes each chunk's
`up` / `gate` (the matmuls the tight plans recompute anyway) next to that chunk's gradients.
Gradients equal the unchunked ones up to float reassociation of the weight gradients' sums over
chunks.

Why custom ops (torch.library), as for the loss head (memcompile/loss_ops.py): Inductor would fuse
the chunks' pointwise kernels back together; an op runs its chunks one at a time, and what it
allocates inside is `workspace_bytes`. The backward is a second op (the autograd formula of the
first), so the joint graph holds two opaque nodes whose costs are registered with
torch.utils.flop_counter.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.utils.flop_counter import register_flop_formula

from memcompile.chunked_ops import without_autocast
from memcompile.cost_models.cpu_workspace import onednn_matmul_scratch_bytes

ACTIVATIONS = ("gelu", "gelu_tanh", "silu", "relu")


def _act_(t: torch.Tensor, activation: str) -> torch.Tensor:
    """The activation in place (no second chunk-sized buffer)."""
    if activation == "gelu":
        return torch.ops.aten.gelu_(t)
    if activation == "gelu_tanh":
        return torch.ops.aten.gelu_(t, approximate="tanh")
    if activation == "silu":
        return torch.ops.aten.silu_(t)
    if activation == "relu":
        return t.relu_()
    raise ValueError(f"memcompile.chunked_mlp: unknown activation {activation!r}; expected one of {ACTIVATIONS}")


def _act(t: torch.Tensor, activation: str) -> torch.Tensor:
    return _act_(t.clone(), activation) if activation == "relu" else {
        "gelu": lambda: torch.ops.aten.gelu(t),
        "gelu_tanh": lambda: torch.ops.aten.gelu(t, approximate="tanh"),
        "silu": lambda: torch.ops.aten.silu(t),
    }[activation]()


def _act_backward(grad: torch.Tensor, pre: torch.Tensor, activation: str) -> torch.Tensor:
    """d act(pre) / d pre * grad, as autograd computes it (the same ATen kernels)."""
    if activation == "gelu":
        return torch.ops.aten.gelu_backward(grad, pre)
    if activation == "gelu_tanh":
        return torch.ops.aten.gelu_backward(grad, pre, approximate="tanh")
    if activation == "silu":
        return torch.ops.aten.silu_backward(grad, pre)
    return torch.ops.aten.threshold_backward(grad, pre, 0)


def _project(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return x @ weight.t() if bias is None else torch.addmm(bias, x, weight.t())


@torch.library.custom_op("memcompile::chunked_mlp", mutates_args=())
def chunked_mlp(x: torch.Tensor, w_up: torch.Tensor, b_up: Optional[torch.Tensor], w_gate: Optional[torch.Tensor],
                b_gate: Optional[torch.Tensor], w_down: torch.Tensor, b_down: Optional[torch.Tensor],
                activation: str, rows: int) -> torch.Tensor:
    """y for x of (tokens, hidden), `rows` tokens at a time."""
    with without_autocast(x.device):
        y = x.new_empty((x.shape[0], w_down.shape[0]))
        for x_chunk, y_chunk in zip(x.split(rows), y.split(rows)):
            inner = _act_(_project(x_chunk, w_gate if w_gate is not None else w_up,
                                   b_gate if w_gate is not None else b_up), activation)
            if w_gate is not None:
                inner.mul_(_project(x_chunk, w_up, b_up))
            if b_down is None:
                torch.mm(inner, w_down.t(), out=y_chunk)
            else:
                torch.addmm(b_down, inner, w_down.t(), out=y_chunk)
            del inner  # before the next chunk's
        return y


@chunked_mlp.register_fake
def _(x, w_up, b_up, w_gate, b_gate, w_down, b_down, activation, rows):
    return x.new_empty((x.shape[0], w_down.shape[0]))


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half-precision gradients (as one unchunked matmul accumulates), else their own
    (float64 stays float64)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _empty_like_or_none(t: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    # a custom op cannot return None: an empty tensor stands for an absent parameter's gradient
    return (torch.zeros(t.shape, dtype=_accumulation_dtype(like.dtype), device=t.device) if t is not None
            else like.new_empty(0))


@torch.library.custom_op("memcompile::chunked_mlp_backward", mutates_args=())
def chunked_mlp_backward(grad_y: torch.Tensor, x: torch.Tensor, w_up: torch.Tensor, b_up: Optional[torch.Tensor],
                         w_gate: Optional[torch.Tensor], b_gate: Optional[torch.Tensor], w_down: torch.Tensor,
                         b_down: Optional[torch.Tensor], activation: str, rows: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                    torch.Tensor, torch.Tensor]:
    """(grad x, grad w_up, grad b_up, grad w_gate, grad b_gate, grad w_down, grad b_down); absent
    parameters get empty gradients. Each chunk recomputes its `up` (and `gate`) from x."""
    with without_autocast(x.device):
        return _backward_chunks(grad_y, x, w_up, b_up, w_gate, b_gate, w_down, b_down, activation, rows)


def _backward_chunks(grad_y, x, w_up, b_up, w_gate, b_gate, w_down, b_down, activation, rows):
    grad_x = torch.empty_like(x)
    # float32 accumulators of the weight gradients (the same tensors for float32 weights, which
    # are returned as they are), as one unchunked matmul accumulates
    grad_w_up, grad_b_up = _empty_like_or_none(w_up, x), _empty_like_or_none(b_up, x)
    grad_w_gate, grad_b_gate = _empty_like_or_none(w_gate, x), _empty_like_or_none(b_gate, x)
    grad_w_down, grad_b_down = _empty_like_or_none(w_down, x), _empty_like_or_none(b_down, x)
    float32 = _accumulation_dtype(x.dtype) == x.dtype  # float32 or float64: accumulated in place
    gated = w_gate is not None
    for x_chunk, grad_y_chunk, grad_x_chunk in zip(x.split(rows), grad_y.split(rows), grad_x.split(rows)):
        up = _project(x_chunk, w_up, b_up)
        pre = _project(x_chunk, w_gate, b_gate) if gated else up
        act = _act(pre, activation)
        inner = act * up if gated else act
        _accumulate(grad_w_down, grad_y_chunk.t(), inner, float32)
        if b_down is not None:
            grad_b_down += grad_y_chunk.sum(0, dtype=grad_b_down.dtype)
        del inner
        grad_inner = grad_y_chunk @ w_down
        if gated:
            grad_up = act.mul_(grad_inner)  # d/d up = act(gate) * grad_inner, in act's buffer
            grad_act = up.mul_(grad_inner)  # d/d act(gate), in up's buffer
            del grad_inner  # before act's backward allocates d/d gate
            grad_pre = _act_backward(grad_act, pre, activation)
            del grad_act
        else:
            del act
            grad_up = grad_pre = _act_backward(grad_inner, pre, activation)
            del grad_inner
        _accumulate(grad_w_up, grad_up.t(), x_chunk, float32)
        if b_up is not None:
            grad_b_up += grad_up.sum(0, dtype=grad_b_up.dtype)
        if gated:
            _accumulate(grad_w_gate, grad_pre.t(), x_chunk, float32)
            if b_gate is not None:
                grad_b_gate += grad_pre.sum(0, dtype=grad_b_gate.dtype)
        if float32:
            torch.mm(grad_up, w_up, out=grad_x_chunk)
            if gated:
                grad_x_chunk.addmm_(grad_pre, w_gate)
        else:
            grad_x_chunk.copy_(grad_up @ w_up + grad_pre @ w_gate if gated else grad_up @ w_up)
        del up, pre, grad_up, grad_pre
    dtype = x.dtype
    return (grad_x, grad_w_up.to(dtype), grad_b_up.to(dtype), grad_w_gate.to(dtype), grad_b_gate.to(dtype),
            grad_w_down.to(dtype), grad_b_down.to(dtype))


def _accumulate(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor, float32: bool) -> None:
    """total += a @ b, in float32 (low precision products are computed in their dtype, then added)."""
    if float32:
        total.addmm_(a, b)
    else:
        total += (a @ b).float()


@chunked_mlp_backward.register_fake
def _(grad_y, x, w_up, b_up, w_gate, b_gate, w_down, b_down, activation, rows):
    def like(t):
        # as the op returns them: contiguous, in x's dtype (float32 accumulators cast), whatever
        # the parameter's strides (a transposed weight's gradient is not transposed)
        return x.new_empty(t.shape) if t is not None else x.new_empty(0)
    return (torch.empty_like(x), like(w_up), like(b_up), like(w_gate), like(b_gate), like(w_down), like(b_down))


def _setup_context(ctx, inputs, output) -> None:
    x, w_up, b_up, w_gate, b_gate, w_down, b_down, activation, rows = inputs
    ctx.save_for_backward(x, w_up, b_up, w_gate, b_gate, w_down, b_down)
    ctx.activation, ctx.rows = activation, rows


def _backward(ctx, grad_y):
    x, w_up, b_up, w_gate, b_gate, w_down, b_down = ctx.saved_tensors
    grads = torch.ops.memcompile.chunked_mlp_backward(grad_y.contiguous(), x, w_up, b_up, w_gate, b_gate, w_down,
                                                      b_down, ctx.activation, ctx.rows)
    present = (x, w_up, b_up, w_gate, b_gate, w_down, b_down)
    return (*(g if t is not None else None for g, t in zip(grads, present)), None, None)


chunked_mlp.register_autograd(_backward, setup_context=_setup_context)

FORWARD = torch.ops.memcompile.chunked_mlp.default
BACKWARD = torch.ops.memcompile.chunked_mlp_backward.default


def _matmul_flops(tokens: int, hidden: int, inner: int, out: int, gated: bool) -> int:
    return 2 * tokens * hidden * inner * (2 if gated else 1) + 2 * tokens * inner * out


@register_flop_formula(torch.ops.memcompile.chunked_mlp)
def _forward_flops(x_shape, w_up_shape, b_up_shape, w_gate_shape, b_gate_shape, w_down_shape, *_args, **_kwargs) -> int:
    tokens, hidden = x_shape
    return _matmul_flops(tokens, hidden, w_up_shape[0], w_down_shape[0], w_gate_shape is not None)


@register_flop_formula(torch.ops.memcompile.chunked_mlp_backward)
def _backward_flops(grad_y_shape, x_shape, w_up_shape, b_up_shape, w_gate_shape, b_gate_shape, w_down_shape,
                    *_args, out_shape=None, **_kwargs) -> int:
    # the recomputed up (and gate) projections, and the two gradient matmuls of each of the three
    tokens, hidden = x_shape
    gated = w_gate_shape is not None
    inner, out = w_up_shape[0], w_down_shape[0]
    return 2 * tokens * hidden * inner * (2 if gated else 1) + 2 * _matmul_flops(tokens, hidden, inner, out, gated)


def recompute_flops(tokens: int, hidden: int, inner: int, gated: bool) -> int:
    """What the backward op computes beyond the unchunked MLP's backward: the up (and gate)
    projections again."""
    return 2 * tokens * hidden * inner * (2 if gated else 1)


def workspace_bytes(op: object, args: tuple) -> int:
    """Bytes the forward or backward op allocates and frees inside itself, from its arguments'
    shapes and dtypes (fake tensors at planning time); 0 for other ops. Chunk-sized buffers:
    forward, the activation (in place) and the gated product's other factor; backward, `up`,
    `gate`, `act` and then the product / its gradient (four at once, three without a gate).
    Low precision adds float32 accumulators of the weight gradients and oneDNN's scratch."""
    if op is FORWARD:
        x, w_up, w_gate, w_down, rows = args[0], args[1], args[3], args[5], args[-1]
    elif op is BACKWARD:
        x, w_up, w_gate, w_down, rows = args[1], args[2], args[4], args[6], args[-1]
    else:
        return 0
    tokens, hidden = x.shape
    inner, out = w_up.shape[0], w_down.shape[0]
    chunk = min(rows, tokens)
    size = x.element_size()
    gated = w_gate is not None
    onednn = max(onednn_matmul_scratch_bytes(chunk, hidden, inner, x.dtype, x.device),
                 onednn_matmul_scratch_bytes(chunk, inner, out, x.dtype, x.device))
    if op is FORWARD:
        return (2 if gated else 1) * chunk * inner * size + onednn + 512
    buffers = (4 if gated else 3) * chunk * inner * size
    low_precision = x.dtype in (torch.float16, torch.bfloat16)
    # float32 accumulators (the weight gradients' sizes) and, for a low precision product, its
    # float copy; the bias gradients' float32 sums per chunk
    accumulators = 4 * (inner * hidden * (2 if gated else 1) + out * inner) if low_precision else 0
    product = 4 * max(inner * hidden, out * inner) * (2 if low_precision else 0)
    grad_x_rows = 2 * chunk * hidden * size if low_precision else 0
    return buffers + accumulators + product + grad_x_rows + 4 * (2 * inner + out) + onednn + 1024
