"""A loss head computed chunk by chunk: linear -> cross-entropy without ever holding the whole logits.

`chunked_linear_cross_entropy(h, W, b, t, ignore_index, rows, label_smoothing, logit_scale,
keep_logits)` returns the summed (label-smoothed) cross-entropy of `logit_scale * (h @ W.T + b)`
(in float32) against `t` over the tokens whose target is not `ignore_index`, and that sum's
gradients with respect to `h`, `W` and `b`, computed while each chunk's logits exist (the loss is
a scalar: the backward only scales them by the incoming gradient); with `keep_logits` also the
logits themselves, in the head's dtype, written chunk by chunk (a model that returns them). The
same matmuls as the unchunked head, no logits saved and none recomputed. (Until 2026-11-30 the
backward recomputed each chunk's logits: one more head matmul, 12-18% of a GPT-2 small step.)

Why custom ops (torch.library) and not the same ops in the graph: Inductor fuses the chunks'
pointwise kernels horizontally (they read the same targets and the same incoming gradient), which
brings every chunk's logits back to life at once. An op is opaque to fusion: its chunks run one at
a time, and the memory it needs while it runs is `workspace_bytes`: never less than the
allocator's events, at most 8 KiB more in float32 (tests/test_loss_head.py). Its cost is
registered with torch.utils.flop_counter (three head matmuls), so the cost model charges a
recomputation of it what it costs. On CPUs with native
bf16 / float16 (AVX-512 BF16, AMX, AVX-512 FP16), the low precision head matmul runs in oneDNN,
whose scratchpad (packed operand copies, per thread) is counted by `cost_models.cpu_workspace.onednn_matmul_scratch_bytes`.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.utils.flop_counter import register_flop_formula

from memcompile.chunked_ops import without_autocast
from memcompile.cost_models.cpu_workspace import onednn_matmul_scratch_bytes


def _chunk_logits(h: torch.Tensor, weight_t: torch.Tensor, bias: Optional[torch.Tensor], scale: float,
                  out: Optional[torch.Tensor]) -> torch.Tensor:
    """One chunk's logits in float32, to be overwritten: computed in the head's dtype (into `out`,
    the op's logits output, when it returns them), scaled there as the model scales them, then
    upcast as `.float()` does (a copy of `out`; a no-op for a float32 result of its own)."""
    if out is None:
        logits = h @ weight_t if bias is None else torch.addmm(bias, h, weight_t)
    else:
        logits = torch.mm(h, weight_t, out=out) if bias is None else torch.addmm(bias, h, weight_t, out=out)
    if scale != 1.0:
        logits.mul_(scale)
    if logits.dtype != torch.float32:
        return logits.float()
    return logits.clone() if out is not None else logits


@torch.library.custom_op("memcompile::chunked_linear_cross_entropy", mutates_args=())
def chunked_linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                                 target: torch.Tensor, ignore_index: int, rows: int, label_smoothing: float,
                                 logit_scale: float, keep_logits: bool
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    with without_autocast(h.device):
        return _forward(h, weight, bias, target, ignore_index, rows, label_smoothing, logit_scale, keep_logits)


def _forward(h, weight, bias, target, ignore_index, rows, label_smoothing, logit_scale, keep_logits):
    """(total, d total/d h, d total/d weight, d total/d bias, logits): the summed loss over the
    tokens whose target is not `ignore_index`, of the logits `logit_scale * (h @ W.T + b)`, and
    its gradients, computed chunk by chunk while each chunk's logits exist (the loss is a scalar,
    so its gradients need only be scaled by the incoming one in the backward). Without a bias the
    gradient of the bias is an empty tensor (a custom op cannot return None); without
    `keep_logits` so are the logits, otherwise all of them in the head's dtype (the model returns
    them as well as the loss).

    With label smoothing e, a token's loss is PyTorch's: (1 - e) (lse - z_t) + e (lse - mean(z)),
    and its gradient softmax(z) - (1 - e) one_hot(t) - e / V.

    Each op call here costs microseconds of Python and dispatch, many times a chunk: per-token
    values are made once for all chunks, per-row results are written into them (out=), and the
    loss is summed once at the end: 14 calls a chunk (33 before 2026-11-30)."""
    tokens, vocab = h.shape[0], weight.shape[0]
    grad_h = torch.empty_like(h)
    # float32 accumulators for lower precision weights (as one unchunked matmul accumulates)
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    grad_bias = torch.zeros(vocab if bias is not None else 0, dtype=torch.float32, device=weight.device)
    logits_out = h.new_empty((tokens, vocab) if keep_logits else (0,))
    weight_float = weight.float()  # the same tensor for float32 weights
    weight_t = weight.t()
    # per token (a column), once: whether it counts, its target (0 where it does not count), its
    # weight (the logits' scale, or 0.0) and what the one-hot and the smoothing subtract from the
    # gradient; the chunks' row maxima, sums of exponentials, target logits (and for smoothing
    # sums of logits) are written into columns made once too
    counts = (target != ignore_index).unsqueeze(1)
    index = torch.where(counts, target.unsqueeze(1), 0)
    token_weight = counts.to(torch.float32).mul_(logit_scale)
    minus_target = token_weight * -(1.0 - label_smoothing)
    smoothing = token_weight * (label_smoothing / vocab) if label_smoothing else None
    columns = torch.empty((4 if label_smoothing else 3, tokens, 1), dtype=torch.float32, device=h.device).unbind(0)
    top, sums, picked = columns[:3]
    logit_sums = columns[3] if label_smoothing else None
    float32 = h.dtype == torch.float32
    for i, (h_chunk, grad_h_chunk) in enumerate(zip(h.split(rows), grad_h.split(rows))):
        at = slice(i * rows, i * rows + h_chunk.shape[0])
        out = logits_out[at] if keep_logits else None
        logits = _chunk_logits(h_chunk, weight_t, bias, logit_scale, out)
        torch.gather(logits, 1, index[at], out=picked[at])
        if logit_sums is not None:
            torch.sum(logits, 1, keepdim=True, out=logit_sums[at])
        # softmax in place: the chunk's logits are the only chunk-sized buffer
        torch.amax(logits, 1, keepdim=True, out=top[at])
        torch.sum(logits.sub_(top[at]).exp_(), 1, keepdim=True, out=sums[at])
        # d total / d (unscaled) logits = scale (softmax - (1 - e) one_hot(target) - e / V) on
        # counted tokens, 0 on the others
        grad_logits = logits.mul_(token_weight[at] / sums[at])
        if smoothing is not None:
            grad_logits.sub_(smoothing[at])
        grad_logits.scatter_add_(1, index[at], minus_target[at])
        if float32:
            torch.mm(grad_logits, weight_float, out=grad_h_chunk)
            grad_weight.addmm_(grad_logits.t(), h_chunk)
        else:
            grad_h_chunk.copy_(grad_logits @ weight_float)
            grad_weight.addmm_(grad_logits.t(), h_chunk.float())
        if bias is not None:
            grad_bias += grad_logits.sum(0)
        del logits, grad_logits  # before the next chunk's logits are allocated
    losses = sums.log_().add_(top).sub_(picked.mul_(1.0 - label_smoothing) if label_smoothing else picked)
    if logit_sums is not None:
        losses.sub_(logit_sums.mul_(label_smoothing / vocab))
    total = torch.where(counts, losses, 0.0).sum()
    return total, grad_h, grad_weight.to(weight.dtype), grad_bias.to(weight.dtype), logits_out


@chunked_linear_cross_entropy.register_fake
def _(h, weight, bias, target, ignore_index, rows, label_smoothing, logit_scale, keep_logits):
    vocab = weight.shape[0]
    return (h.new_empty((), dtype=torch.float32), torch.empty_like(h), torch.empty_like(weight),
            weight.new_empty(vocab if bias is not None else 0),
            h.new_empty((h.shape[0], vocab) if keep_logits else (0,)))


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*output[1:4])
    ctx.has_bias = inputs[2] is not None
    # Only the loss has a gradient path. The logits it also returns have none: the model's
    # caller usually never backpropagates through them, and a differentiable output would get a
    # tangent, a zero-filled tensor as large as the logits, in every backward. Where the caller
    # does, memcompile gives them a path of their own (`with_logits_gradient`).
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_total, *_unused):
    # The loss is a scalar: its gradients, computed in the forward, scaled by the incoming one.
    grad_h, grad_weight, grad_bias = ctx.saved_tensors
    return (grad_h * grad_total, grad_weight * grad_total, grad_bias * grad_total if ctx.has_bias else None,
            None, None, None, None, None, None)


chunked_linear_cross_entropy.register_autograd(_backward, setup_context=_setup_context)

FORWARD = torch.ops.memcompile.chunked_linear_cross_entropy.default


@register_flop_formula(torch.ops.memcompile.chunked_linear_cross_entropy)
def _flops(h_shape, weight_shape, *_args, **_kwargs) -> int:
    # the head matmul and its two gradient matmuls: what the cost model charges a recomputation
    tokens, hidden = h_shape
    return 6 * tokens * hidden * weight_shape[0]


class _LogitsGradient(torch.autograd.Function):
    """The gradient path of logits the chunked op returned without one: d logits / d (h, W, b),
    run only if the caller backpropagates through the logits (nothing is held for it but h)."""

    @staticmethod
    def forward(ctx, logits, hidden, weight, bias, scale):
        ctx.save_for_backward(hidden, weight, bias)
        ctx.scale = scale
        return logits.view_as(logits)

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, bias = ctx.saved_tensors
        # as the model's head computes: in the logits' dtype (autocast's, if it cast), then
        # cast back to each input's dtype
        g = grad.reshape(-1, grad.shape[-1]) * ctx.scale
        need = ctx.needs_input_grad
        grad_h = (g @ weight.to(g.dtype)).view(hidden.shape).to(hidden.dtype) if need[1] else None
        grad_w = (g.t() @ hidden.reshape(-1, hidden.shape[-1]).to(g.dtype)).to(weight.dtype) if need[2] else None
        grad_b = g.sum(0).to(bias.dtype) if bias is not None and need[3] else None
        return None, grad_h, grad_w, grad_b, None


def with_logits_gradient(logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                         bias: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    """`logits` (= scale * (hidden @ weight.T + bias), returned by the chunked op without a
    gradient path) with one: a backward through them reaches hidden, weight and bias."""
    return _LogitsGradient.apply(logits, hidden, weight, bias, scale)


def workspace_bytes(op: object, args: tuple) -> int:
    """Bytes the op allocates and frees inside itself, from its arguments' shapes and dtypes
    (fake tensors at planning time); 0 for other ops."""
    if op is not FORWARD:
        return 0
    h, weight, bias, rows, label_smoothing, keep_logits = args[0], args[1], args[2], args[5], args[6], args[8]
    tokens, hidden = h.shape
    vocab = weight.shape[0]
    chunk = min(rows, tokens)
    upcast = weight.dtype != torch.float32
    # the float32 logits, and for a low precision head first its matmul result (in the op's
    # logits output where it returns them) with, while the matmul runs (freed before the
    # .float() copy), oneDNN's scratchpad
    onednn = onednn_matmul_scratch_bytes(chunk, hidden, vocab, weight.dtype, h.device)
    native = chunk * vocab * weight.element_size() if upcast and not keep_logits else 0
    logits = native + max(chunk * vocab * 4, onednn) if upcast else chunk * vocab * 4
    # float copies of W and h's chunk, and the float32 accumulators, when W is not float32
    extra = (vocab * hidden * 4 + chunk * hidden * 4) if upcast else 0
    accumulators = (vocab * hidden * 4 + (vocab * 4 if bias is not None else 0)) if upcast else 0
    # the chunk's gradient rows for h (float32 h: written in place), then (freed by then) its
    # column sum for the bias
    rows_or_sum = max(chunk * hidden * 4 if h.dtype != torch.float32 else 0, vocab * 4 if bias is not None else 0)
    # per token: whether it counts, its index, weight and one-hot entry, its row's maximum, sum
    # of exponentials and target logit (1 + 8 + 4 x 5 B), with smoothing its subtrahend and sum
    # of logits (4 x 2 B); per chunk row: the gradient's scale
    per_token = 29 + (8 if label_smoothing else 0)
    return logits + rows_or_sum + extra + accumulators + tokens * per_token + chunk * 48 + 512
