"""Chunk a language model's loss head: linear -> cross_entropy over the vocabulary, by token rows.

Why: the logits of a loss head (tokens x vocabulary) are often the largest tensors of a step, and
the backward of an unchunked cross-entropy holds two of them at once (the saved logits and their
gradient) right where the backward starts. No keep/recompute choice removes that: it was the
floor of the step's peak for GPT-2, Llama and BERT (benchmarks/results/pareto_small.md). Split
by token rows, one chunk's logits and their gradient exist at a time, and no logits are saved.

The rewrite works on Dynamo's graph (torch-level calls) before AOTAutograd: the head becomes one
call of `memcompile.loss_ops.chunked_linear_cross_entropy` (a custom op: Inductor cannot fuse
its chunks back together; it computes the gradients as it goes, the backward scales them), and for
reduction="mean" a division by the count of targets not equal to `ignore_index`, which is
exactly what PyTorch's mean reduction computes. Gradients equal the unchunked ones up to float
reassociation of the sums over chunks.

Matched pattern (every intermediate used once, static shapes, no class weights, no label
smoothing): cross_entropy(view(-1, V)([float](linear(h, W, b))), target).
"""

from __future__ import annotations

import inspect
import math
import operator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import fx

from memcompile import loss_ops
from memcompile._torch_private import linear_ops
from memcompile.cost_models.device import DeviceProfile
from memcompile.passes.graph_facts import node_adder, rewritten_copy

_CROSS_ENTROPY_SIGNATURE = inspect.signature(F.cross_entropy)
# Chunk logits no larger than this many times the hidden states (tokens x hidden): small enough
# that the loss head stops being the floor, large enough that the matmuls stay efficient. GPT-2
# small (hidden 128, vocabulary 2048, 512 tokens), compiled, steady state, one thread: 8 chunks
# (factor 2) added 4-5% to the step, 4 chunks (4) 1-2%, 2 chunks (8) 0.4-1%, within a noise of
# ~1% (benchmarks/chunk_count_speed.py). The smallest budget with 4 chunks was no higher than
# with 8 on GPT-2, BERT and Llama small (8.95, 9.56, 10.26 MiB, before the recompute fusion limit
# of _torch_private), and with 2 higher on GPT-2 and Llama (9.37, 10.54 MiB): the pareto.py probe
# child (budget 1) with this constant set before the compile.
_CHUNK_LOGITS_OVER_HIDDEN = 4
_MAX_CHUNKS = 16
_MIN_CHUNK_ROWS = 16
# What the chunked op (memcompile/loss_ops.py) costs beyond the whole head, which the compiler
# fuses: per chunk ~14 separately launched ops (the matmuls, the softmax's max / sub / exp / sum,
# the loss terms, the gradient's scale and one-hot, the bias sum), and ~4 more passes over the
# float32 logits than the fused head makes (the op: ~12 over each chunk; Inductor's whole head:
# the matmul's write, the loss's reductions, the gradient's read and write, the matmuls' reads).
_OPS_PER_CHUNK = 14
_EXTRA_LOGITS_PASSES = 4
# Measured in whole steps, the chunked head adds ~3x what the two terms above say: 0.71, 0.58 and
# 1.02 ms (BERT, GPT-2, Llama small; 4 chunks of 128 x 2048, 1 thread) where they say 0.33
# (benchmarks/results/chunk_loss_cost.md), and BERT at PyTorch's 0.8 partition's peak chunked
# its head for 0.30 ms estimated against 0.33 ms of recomputation: 1.033x the step where that
# partition ran 0.999x (benchmarks/decisive_points.py at 53e5292; docs/decisions.md). Scaled to
# the worst of the three: where the estimates are close the head stays whole, and a stock
# partition that fits is kept.
_STEP_COST_OVER_MODEL = 3.0


@dataclass(frozen=True)
class LossHead:
    """One matched loss head of a graph (node names) and how it would be chunked."""

    linear: str
    target: str
    logits_view: str
    upcast: str  # the float() node between linear and view, or "" if none
    cross_entropy: str
    tokens: int
    vocab: int
    hidden: int
    ignore_index: int
    reduction: str  # "mean" or "sum"
    chunks: int
    # Under autocast the linear computes in a lower precision than its inputs: they are cast to it
    # (as autocast does) before the op, which does not autocast by itself. None: no cast.
    cast_to: torch.dtype | None = None

    def describe(self) -> str:
        return (f"loss head {self.cross_entropy}: linear -> cross_entropy over {self.vocab} classes, "
                f"{self.tokens} tokens, chunked into {self.chunks} (reduction={self.reduction})")

    def added_time_s(self, profile: DeviceProfile) -> float:
        """Estimated step time the chunked head adds over the whole head (the same matmuls; its
        small ops run unfused): what chunk_loss="auto" weighs against the recomputation chunking
        saves: see _STEP_COST_OVER_MODEL."""
        logits_bytes = self.tokens * self.vocab * 4
        return _STEP_COST_OVER_MODEL * (self.chunks * _OPS_PER_CHUNK * profile.op_overhead_s
                                        + _EXTRA_LOGITS_PASSES * logits_bytes / profile.memory_bytes_per_s)


def _static_shape(node: fx.Node) -> tuple[int, ...] | None:
    value = node.meta.get("example_value")
    if not isinstance(value, torch.Tensor):
        return None
    shape = tuple(value.shape)
    return shape if all(isinstance(s, int) for s in shape) else None


def _is_call(node: object, targets: set | frozenset) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def _is_upcast(node: fx.Node) -> bool:
    """x.float() or x.to(torch.float32): a cast to float32 and nothing else."""
    if node.op != "call_method":
        return False
    if node.target == "float":
        return len(node.args) == 1 and not node.kwargs
    return node.target == "to" and len(node.args) == 2 and node.args[1] is torch.float32 and not node.kwargs


def _is_row_flatten(node: fx.Node, vocab: int) -> bool:
    """logits.view(-1, V) / reshape: flattens the leading dimensions, keeps the class dimension."""
    if node.op != "call_method" or node.target not in ("view", "reshape") or node.kwargs:
        return False
    dims = node.args[1:]
    if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
        dims = tuple(dims[0])
    return len(dims) == 2 and dims[1] in (vocab, -1) and all(isinstance(d, int) for d in dims)


def _tensor_args(node: fx.Node) -> list[torch.Tensor]:
    values = [a.meta.get("example_value") for a in node.args if isinstance(a, fx.Node)]
    return [v for v in values if isinstance(v, torch.Tensor)]


def _chunks(tokens: int, vocab: int, hidden: int) -> int:
    wanted = math.ceil(vocab / (_CHUNK_LOGITS_OVER_HIDDEN * hidden))
    return max(1, min(_MAX_CHUNKS, wanted, tokens // _MIN_CHUNK_ROWS))


def find_loss_heads(graph: fx.Graph) -> tuple[LossHead, ...]:
    """The loss heads of a Dynamo graph that chunking would split into more than one chunk."""
    heads = []
    for node in graph.nodes:
        if not _is_call(node, {F.cross_entropy}):
            continue
        try:
            bound = _CROSS_ENTROPY_SIGNATURE.bind(*node.args, **node.kwargs)
        except TypeError:
            continue
        arguments = {**{k: p.default for k, p in _CROSS_ENTROPY_SIGNATURE.parameters.items()}, **bound.arguments}
        if (arguments["weight"] is not None or arguments["size_average"] is not None
                or arguments["reduce"] is not None or arguments["label_smoothing"] != 0.0
                or arguments["reduction"] not in ("mean", "sum") or not isinstance(arguments["ignore_index"], int)):
            continue
        view, target = arguments["input"], arguments["target"]
        if not isinstance(view, fx.Node) or not isinstance(target, fx.Node) or len(view.users) != 1:
            continue
        upcast = view.args[0] if isinstance(view.args[0], fx.Node) and _is_upcast(view.args[0]) else None
        linear = upcast.args[0] if upcast is not None else view.args[0]
        if upcast is not None and len(upcast.users) != 1:
            continue
        if not _is_call(linear, linear_ops()) or len(linear.users) != 1 or linear.kwargs:
            continue
        logits_shape, view_shape, target_shape = _static_shape(linear), _static_shape(view), _static_shape(target)
        hidden_node = linear.args[0]
        hidden_shape = _static_shape(hidden_node) if isinstance(hidden_node, fx.Node) else None
        if None in (logits_shape, view_shape, target_shape, hidden_shape) or len(view_shape) != 2:
            continue
        tokens, vocab = view_shape
        value = linear.meta["example_value"]
        if (not _is_row_flatten(view, vocab) or logits_shape[-1] != vocab or target_shape != (tokens,)
                or not value.is_floating_point() or (upcast is None and value.dtype != torch.float32)):
            continue
        dtypes = {v.dtype for v in _tensor_args(linear)}
        if not all(d.is_floating_point for d in dtypes):
            continue
        chunks = _chunks(tokens, vocab, hidden_shape[-1])
        if chunks < 2:
            continue
        heads.append(LossHead(linear.name, target.name, view.name, upcast.name if upcast is not None else "", node.name,
                              tokens, vocab, hidden_shape[-1], arguments["ignore_index"], arguments["reduction"],
                              chunks, cast_to=value.dtype if dtypes != {value.dtype} else None))
    return tuple(heads)


def chunk_loss_heads(gm: fx.GraphModule) -> tuple[fx.GraphModule, tuple[LossHead, ...]]:
    """A copy of `gm` with every loss head chunked (see the module docstring), and the heads.
    Returns `gm` itself and () when no loss head matches."""
    heads = find_loss_heads(gm.graph)
    if not heads:
        return gm, ()
    return rewritten_copy(gm, heads, _rewrite), heads


def _rewrite(graph: fx.Graph, head: LossHead, by_name: dict[str, fx.Node]) -> None:
    ce, view, linear = by_name[head.cross_entropy], by_name[head.logits_view], by_name[head.linear]
    upcast = by_name[head.upcast] if head.upcast else None
    hidden, weight = linear.args[0], linear.args[1]
    bias = linear.args[2] if len(linear.args) > 2 else None
    target = by_name[head.target]
    rows = math.ceil(head.tokens / head.chunks)
    add = node_adder(graph, ce)

    with graph.inserting_before(ce):
        if head.cast_to is not None:
            hidden, weight = (add("call_method", "to", (x, head.cast_to)) for x in (hidden, weight))
            bias = add("call_method", "to", (bias, head.cast_to)) if isinstance(bias, fx.Node) else bias
        flat = add("call_method", "reshape", (hidden, -1, head.hidden))
        out = add("call_function", loss_ops.FORWARD, (flat, weight, bias, target, head.ignore_index, rows))
        loss = add("call_function", operator.getitem, (out, 0))
        if head.reduction == "mean":
            # PyTorch's mean over the targets it counts (0/0 = nan when none is, as in eager)
            counted = add("call_function", operator.ne, (target, head.ignore_index))
            count = add("call_method", "sum", (counted,))
            loss = add("call_function", operator.truediv, (loss, count))
    ce.replace_all_uses_with(loss)
    for node in (ce, view, upcast, linear):
        if node is not None:
            graph.erase_node(node)
