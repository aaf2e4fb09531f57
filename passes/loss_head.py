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
exactly what PyTorch's mean reduction computes (with label smoothing too). Gradients equal the
unchunked ones up to float reassociation of the sums over chunks.

Where the graph also returns the logits (`forward(idx, targets) -> (logits, loss)`, every Hugging
Face causal LM), the op writes them, chunk by chunk, into an output of the head's dtype: they
exist, once, as the caller expects; no copy is saved for the backward, and their gradient is
never made whole. They leave the op without a gradient path (a differentiable output would get a
zero-filled tangent as large as the logits in every backward, where training loops only
backpropagate the loss); `with_logits_gradients` gives the returned tensor a path of its own,
outside the compiled graph, that runs only if the caller backpropagates through the logits, and
holds only the hidden states for it (the graph returns them too, where they are not an input).

Matched (static shapes; cross_entropy of class indices, no class weights, reduction "mean" or
"sum", any int ignore_index, label smoothing a number):
    cross_entropy(view(-1, V)(step*(linear(h, W, b))), target)
where each step between the linear and the view is one of
- `.contiguous()`                                  (OPT's head);
- `.float()` / `.to(torch.float32)`, at most one   (every HF head: ForCausalLMLoss upcasts);
- `* c` or `/ c` with a Python number c            (Cohere's logit_scale, Granite's logits_scaling);
- `[..., a:b, :]` on the sequence dimension, once  (the shift `logits[..., :-1, :]` with
  `labels[..., 1:]`: the op computes every position and the targets of the positions the loss
  does not read become ignore_index; the labels may be built any way);
and the linear's result (or a step before the upcast and slice, after every scale) may also be
returned by the graph. Under autocast the bf16/float16 logits need no explicit upcast:
cross_entropy autocasts to float32 (its result is float32, which is what is checked). Tied
embeddings (W also read by the embedding) need nothing: the op's gradient of W is summed with
the embedding's. Hugging Face's `sum / num_items_in_batch` is reduction "sum" and a division the
graph keeps. Surveyed on transformers 5.24 (small configs, `(out.logits, out.loss)` compiled):
GPT-2, Llama (also with num_items_in_batch), Mistral, Qwen2, Qwen3, Gemma, GPT-NeoX, OPT, Falcon,
Bloom, Phi, Phi-3, GPT-J, OLMo, Cohere and Granite all match; Gemma 2 does not (softcapping).
Label smoothing is matched where the model's own code passes it (HF's loss_function does not).

Not matched (the head stays whole), and why:
- the logits read by anything else in the graph (a z-loss, `loss + logits.mean()`): their
  gradient inside the graph would need them whole;
- final logit softcapping (Gemma 2/3: `tanh(logits / cap) * cap`), or any other op between the
  linear and the loss than those above: the op computes plain scaled logits;
- low precision logits reaching cross_entropy without an upcast outside autocast: PyTorch computes
  that loss in bf16/float16, the op in float32 (a different result, not a reassociation);
- class weights, reduction="none", probabilities as targets, symbolic (dynamic) shapes, a
  returned upcast or sliced logits tensor, returned logits whose W or b is not a graph input (the
  gradient path outside the graph needs them), and heads too small for two chunks of 16 rows.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import operator
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import fx

from memcompile import loss_ops
from memcompile._torch_private import linear_ops
from memcompile.cost_models.device import DeviceProfile
from memcompile.passes.chunking import ChunkPattern, GraphBoundary, apply_chunking, cast_nodes, chunk_count, find_matches
from memcompile.passes.graph_facts import node_adder, static_shape

_CROSS_ENTROPY_SIGNATURE = inspect.signature(F.cross_entropy)
# Chunk logits no larger than this many times the hidden states (tokens x hidden): small enough
# that the loss head stops being the floor, large enough that the matmuls stay efficient. GPT-2
# small (hidden 128, vocabulary 2048, 512 tokens), compiled, steady state, one thread: 8 chunks
# (factor 2) added 4-5% to the step, 4 chunks (4) 1-2%, 2 chunks (8) 0.4-1%, within a noise of
# ~1% (benchmarks/chunk_count_speed.py). The smallest budget with 4 chunks was no higher than
# with 8 on GPT-2, BERT and Llama small (8.95, 9.56, 10.26 MiB, before the recompute fusion limit
# of passes/fusion_refusals.py), and with 2 higher on GPT-2 and Llama (9.37, 10.54 MiB): the pareto.py probe
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
# The weight, per chunk: the logits' matmul and the hidden gradient's read it, the weight
# gradient's accumulating matmul (64 rows deep at real size) reads and writes it: 4 passes, where
# the whole head makes 3 in all. At real size this is the cost that counts, and it measured as
# 8 passes a chunk at the DRAM copy rate (33 GB/s): 16 chunks added 207-326 ms to a 3.6 s step of
# the 24-layer Llama (64 MiB head) and 400-735 ms to a 5.5 s step of GPT-2 124M (147 MiB head),
# min and median ratios of 5 interleaved steps, where 8 passes say 256 and 600 ms
# (benchmarks/results/chunk_loss_cost_real_*.md). The same share of each model's weight traffic.
_WEIGHT_PASSES_PER_CHUNK = 8
_WEIGHT_PASSES_WHOLE = 3
# Launches measured in whole steps cost ~3x the profile's op overhead: the chunked head added
# 0.71, 0.58 and 1.02 ms (BERT, GPT-2, Llama small; 4 chunks of 128 x 2048, 1 thread) where
# launches, logits and weight passes at the profile's rates say ~0.7
# (benchmarks/results/chunk_loss_cost.md).
_LAUNCH_COST_OVER_MODEL = 3.0


@dataclass(frozen=True)
class LossHead:
    """One matched loss head of a graph (node names) and how it would be chunked."""

    linear: str
    steps: tuple[str, ...]  # the nodes from the linear's result to the (rows, V) view, in order, the view last
    target: str
    cross_entropy: str
    tokens: int  # rows of the linear's result: what the op computes
    vocab: int
    hidden: int
    ignore_index: int
    reduction: str  # "mean" or "sum"
    chunks: int
    label_smoothing: float = 0.0
    logit_scale: float = 1.0
    # Shifted heads: (start, stop) of the sequence dimension (-2) the loss reads; None: all of it.
    seq_window: tuple[int, int] | None = None
    logits_shape: tuple[int, ...] = ()
    # The logits also returned: the nodes holding them and their positions among the graph's outputs.
    returned: tuple[str, ...] = ()
    returned_at: tuple[int, ...] = ()
    # For the returned logits' gradient path: graph input positions of W and b, and of h (None: h
    # is not an input; chunk_loss_heads makes it the graph's output at hidden_output).
    weight_input: int | None = None
    bias_input: int | None = None
    hidden_input: int | None = None
    hidden_output: int | None = None
    tied: bool = False  # W is read elsewhere too (tied input and output embeddings)
    # Under autocast the linear computes in a lower precision than its inputs: they are cast to it
    # (as autocast does) before the op, which does not autocast by itself. None: no cast.
    cast_to: torch.dtype | None = None

    def describe(self) -> str:
        notes = [f"reduction={self.reduction}"]
        notes += ["logits also returned"] if self.returned else []
        notes += ["tied weights"] if self.tied else []
        notes += [f"label smoothing {self.label_smoothing:g}"] if self.label_smoothing else []
        notes += [f"logits scaled by {self.logit_scale:g}"] if self.logit_scale != 1.0 else []
        notes += [f"positions {self.seq_window[0]}:{self.seq_window[1]} of {self.logits_shape[-2]}"] \
            if self.seq_window else []
        return (f"loss head {self.cross_entropy}: linear -> cross_entropy over {self.vocab} classes, "
                f"{self.tokens} tokens, chunked into {self.chunks} ({'; '.join(notes)})")

    def added_time_s(self, profile: DeviceProfile) -> float:
        """Estimated step time the chunked head adds over the whole head (the same matmuls' FLOPs;
        its small ops run unfused, each chunk streams the weight again): what chunk_loss="auto"
        weighs against the recomputation chunking saves. Returned logits: one more pass, their
        copy out. Each pass at the rate of its working set: a chunk of logits, the weight."""
        logits_bytes = self.tokens * self.vocab * 4
        weight_bytes = self.vocab * self.hidden * 4  # float32: the weight gradient's accumulator
        passes = _EXTRA_LOGITS_PASSES + (1 if self.returned else 0)
        weight_passes = _WEIGHT_PASSES_PER_CHUNK * self.chunks - _WEIGHT_PASSES_WHOLE
        return (_LAUNCH_COST_OVER_MODEL * self.chunks * _OPS_PER_CHUNK * profile.op_overhead_s
                + profile.memory_time_s(passes * logits_bytes, logits_bytes / self.chunks)
                + profile.memory_time_s(weight_passes * weight_bytes, weight_bytes))


def _is_call(node: object, targets: set | frozenset) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def _is_upcast(node: fx.Node) -> bool:
    """x.float() or x.to(torch.float32): a cast to float32 and nothing else."""
    if node.op != "call_method":
        return False
    if node.target == "float":
        return len(node.args) == 1 and not node.kwargs
    return node.target == "to" and len(node.args) == 2 and node.args[1] is torch.float32 and not node.kwargs


def _is_contiguous(node: fx.Node) -> bool:
    return node.op == "call_method" and node.target == "contiguous" and len(node.args) == 1 and not node.kwargs


def _scale(node: fx.Node) -> float | None:
    """c for `x * c`, `c * x` or `x / c` with a Python number c (not 0); None otherwise."""
    if node.op != "call_function" or node.target not in (operator.mul, operator.truediv) or node.kwargs \
            or len(node.args) != 2:
        return None
    x, c = node.args if isinstance(node.args[0], fx.Node) else node.args[::-1]
    if node.target is operator.truediv and x is not node.args[0]:
        return None  # c / x
    if not isinstance(x, fx.Node) or isinstance(c, bool) or not isinstance(c, (int, float)) or c == 0:
        return None
    return float(c) if node.target is operator.mul else 1.0 / c


def _seq_window(node: fx.Node) -> tuple[int, int] | None:
    """(start, stop) for `x[..., a:b, :]` (or `x[:, a:b]`, ...): a slice of x's dimension -2 with
    step 1, every other dimension whole; None otherwise."""
    if not _is_call(node, {operator.getitem}) or not isinstance(node.args[0], fx.Node):
        return None
    shape = static_shape(node.args[0])
    index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
    if shape is None or len(shape) < 2 or index.count(Ellipsis) > 1:
        return None
    if Ellipsis in index:
        at = index.index(Ellipsis)
        index = index[:at] + (slice(None),) * (len(shape) - len(index) + 1) + index[at + 1:]
    index = index + (slice(None),) * (len(shape) - len(index))
    if len(index) != len(shape) or not all(isinstance(i, slice) for i in index):
        return None
    window = index[-2]
    bounds_are_ints = all(v is None or type(v) is int for v in (window.start, window.stop))
    if any(i != slice(None) for i in index[:-2] + index[-1:]) or window.step not in (None, 1) or not bounds_are_ints:
        return None
    start, stop, _ = window.indices(shape[-2])
    return (start, stop) if stop > start else None


def _is_row_flatten(node: fx.Node, vocab: int) -> bool:
    """logits.view(-1, V) / reshape: flattens the leading dimensions, keeps the class dimension."""
    if node.op != "call_method" or node.target not in ("view", "reshape") or node.kwargs:
        return False
    dims = node.args[1:]
    if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
        dims = tuple(dims[0])
    return len(dims) == 2 and dims[1] in (vocab, -1) and all(isinstance(d, int) for d in dims)


def _path_from_linear(node: object) -> list[fx.Node] | None:
    """[linear, steps...] ending at `node`: walks back over the steps the rewrite takes (see the
    module docstring) to a linear call; None if another op is in between."""
    path = []
    while isinstance(node, fx.Node):
        path.append(node)
        if _is_call(node, linear_ops()):
            return path[::-1]
        if not (_is_contiguous(node) or _is_upcast(node) or _scale(node) is not None
                or _seq_window(node) is not None):
            return None
        node = next(a for a in node.args if isinstance(a, fx.Node))  # the tensor (`c * x` too)
    return None


def _tensor_args(node: fx.Node) -> list[torch.Tensor]:
    values = [a.meta.get("example_value") for a in node.args if isinstance(a, fx.Node)]
    return [v for v in values if isinstance(v, torch.Tensor)]


def _chunks(tokens: int, vocab: int, hidden: int) -> int:
    wanted = math.ceil(vocab / (_CHUNK_LOGITS_OVER_HIDDEN * hidden))
    return chunk_count(tokens, wanted, _MAX_CHUNKS, _MIN_CHUNK_ROWS)


def _cross_entropy_arguments(node: fx.Node) -> dict[str, Any] | None:
    """cross_entropy's arguments by name (defaults filled in) if the op can compute it; else None."""
    try:
        bound = _CROSS_ENTROPY_SIGNATURE.bind(*node.args, **node.kwargs)
    except TypeError:
        return None
    arguments = {**{k: p.default for k, p in _CROSS_ENTROPY_SIGNATURE.parameters.items()}, **bound.arguments}
    smoothing = arguments["label_smoothing"]
    if (arguments["weight"] is not None or arguments["size_average"] is not None or arguments["reduce"] is not None
            or arguments["reduction"] not in ("mean", "sum") or type(arguments["ignore_index"]) is not int
            or isinstance(smoothing, bool) or not isinstance(smoothing, (int, float)) or not 0 <= smoothing <= 1):
        return None
    return arguments


def _match(ce: fx.Node, boundary: GraphBoundary) -> LossHead | None:
    """The loss head whose cross_entropy is `ce`, if the rewrite can take it."""
    if not _is_call(ce, {F.cross_entropy}):
        return None
    inputs, outputs = boundary.inputs, boundary.outputs
    arguments = _cross_entropy_arguments(ce)
    if arguments is None:
        return None
    view, target = arguments["input"], arguments["target"]
    if not isinstance(view, fx.Node) or not isinstance(target, fx.Node) or len(view.users) != 1:
        return None
    path = _path_from_linear(view.args[0]) if view.args else None
    if path is None:
        return None
    linear, steps = path[0], path[1:] + [view]
    kinds = ["upcast" if _is_upcast(n) else "slice" if _seq_window(n) else "scale" if _scale(n) is not None
             else "contiguous" for n in path[1:]]
    if kinds.count("upcast") > 1 or kinds.count("slice") > 1 or linear.kwargs or len(linear.args) not in (2, 3):
        return None
    hidden_node, weight, bias = (*linear.args, None)[:3]
    logits_shape, view_shape, target_shape = static_shape(linear), static_shape(view), static_shape(target)
    hidden_shape, loss_value = static_shape(hidden_node), ce.meta.get("example_value")
    if None in (logits_shape, view_shape, target_shape, hidden_shape) or len(view_shape) != 2 \
            or not isinstance(loss_value, torch.Tensor):
        return None
    rows_read, vocab = view_shape
    tokens = math.prod(logits_shape[:-1])
    slices = [n for n, k in zip(path[1:], kinds) if k == "slice"]
    window = _seq_window(slices[0]) if slices else None
    read = tokens if window is None else tokens // logits_shape[-2] * (window[1] - window[0])
    value = linear.meta["example_value"]
    # float32 loss: the logits are float32, upcast, or autocast upcasts them for cross_entropy
    if (not _is_row_flatten(view, vocab) or logits_shape[-1] != vocab or rows_read != read
            or target_shape != (rows_read,) or hidden_shape[:-1] != logits_shape[:-1]
            or not value.is_floating_point() or loss_value.dtype != torch.float32):
        return None
    dtypes = {v.dtype for v in _tensor_args(linear)}
    if not all(d.is_floating_point for d in dtypes):
        return None
    # Each node of the path is read by the next, and may be returned by the graph where its value
    # is the op's logits output: after every scale, before the upcast and the slice.
    returned, returned_at = [], []
    for i, node in enumerate(path):
        reader = path[i + 1] if i + 1 < len(path) else view
        others = [u for u in node.users if u is not reader]
        if not others:
            continue
        if outputs is None or any(u.op != "output" for u in others) \
                or any(k in ("upcast", "slice") for k in kinds[:i]) or "scale" in kinds[i:]:
            return None
        positions = [j for j, out in enumerate(outputs) if out is node]
        if not positions:
            return None  # returned inside a structure: no place to give it its gradient path
        returned.append(node.name)
        returned_at += positions
    if returned and (weight not in inputs or (bias is not None and bias not in inputs)):
        return None
    chunks = _chunks(tokens, vocab, hidden_shape[-1])
    if chunks < 2:
        return None
    return LossHead(linear.name, tuple(n.name for n in steps), target.name, ce.name, tokens, vocab, hidden_shape[-1],
                    arguments["ignore_index"], arguments["reduction"], chunks,
                    label_smoothing=float(arguments["label_smoothing"]),
                    logit_scale=math.prod(_scale(n) for n, k in zip(path[1:], kinds) if k == "scale"),
                    seq_window=window, logits_shape=logits_shape,
                    returned=tuple(returned), returned_at=tuple(returned_at),
                    weight_input=inputs.get(weight), bias_input=inputs.get(bias) if bias is not None else None,
                    hidden_input=inputs.get(hidden_node) if returned else None,
                    tied=any(u is not linear for u in weight.users) if isinstance(weight, fx.Node) else False,
                    cast_to=value.dtype if dtypes != {value.dtype} else None)


def _replaced(head: LossHead) -> frozenset[str]:
    """The nodes the rewrite erases (two heads never share one: each node of a head's path is
    read by the next alone)."""
    return frozenset((head.linear, *head.steps, head.cross_entropy))


def _place_hidden_outputs(graph: fx.Graph, heads: tuple[LossHead, ...]) -> tuple[LossHead, ...]:
    """The heads with the positions of the hidden states their rewrites append to the graph's
    outputs (returned logits whose h is not a graph input: their gradient path needs h)."""
    (output,) = graph.find_nodes(op="output")
    at = len(output.args[0]) if isinstance(output.args[0], (tuple, list)) else 0
    placed = []
    for head in heads:
        if head.returned and head.hidden_input is None:
            head, at = dataclasses.replace(head, hidden_output=at), at + 1
        placed.append(head)
    return tuple(placed)


def find_loss_heads(graph: fx.Graph) -> tuple[LossHead, ...]:
    """The loss heads of a Dynamo graph that chunking would split into more than one chunk."""
    return find_matches(graph, LOSS_HEAD)


def chunk_loss_heads(gm: fx.GraphModule) -> tuple[fx.GraphModule, tuple[LossHead, ...]]:
    """A copy of `gm` with every loss head chunked (see the module docstring), and the heads.
    Returns `gm` itself and () when no loss head matches. Where a head's logits are returned,
    its hidden states may be returned too, after the graph's own outputs: run the copy's outputs
    through `with_logits_gradients` (memcompile's backend does; or call `chunked_heads_forward`)."""
    return apply_chunking(gm, LOSS_HEAD)


def with_logits_gradients(heads: Sequence[LossHead], outputs: Any, args: Sequence[Any]) -> Any:
    """The outputs of a graph chunk_loss_heads rewrote, as the original graph returns them (called
    with its inputs `args`): the returned logits with their gradient path (loss_ops), the hidden
    states returned for it dropped."""
    returning = [h for h in heads if h.returned_at]
    if not returning:
        return outputs
    values = list(outputs)
    for head in returning:
        hidden = args[head.hidden_input] if head.hidden_input is not None else values[head.hidden_output]
        bias = args[head.bias_input] if head.bias_input is not None else None
        logits = loss_ops.with_logits_gradient(values[head.returned_at[0]], hidden, args[head.weight_input], bias,
                                               head.logit_scale)
        for i in head.returned_at:
            values[i] = logits
    kept = len(values) - sum(h.hidden_output is not None for h in returning)
    return type(outputs)(values[:kept]) if isinstance(outputs, tuple) else values[:kept]


def chunked_heads_workspace_bytes(graph: fx.Graph, max_chunks: int | None = None) -> int:
    """What the chunked heads of `graph` hold inside their op while it runs (its chunk of logits
    and their gradient: loss_ops.workspace_bytes, as the liveness counts it), each as rewritten or,
    with `max_chunks`, split into at most that many chunks."""
    total = 0
    for node in graph.find_nodes(op="call_function", target=loss_ops.FORWARD):
        args = [a.meta.get("val", a.meta.get("example_value")) if isinstance(a, fx.Node) else a for a in node.args]
        tokens = int(args[0].shape[0])
        if max_chunks is not None:
            chunks = min(math.ceil(tokens / args[5]), max_chunks)
            args[5] = math.ceil(tokens / max(1, chunks))
        total += loss_ops.workspace_bytes(loss_ops.FORWARD, tuple(args))
    return total


def chunked_heads_forward(gm: fx.GraphModule):
    """A Dynamo backend's result for `gm` with its loss heads chunked, run eagerly (tests, probes)."""
    chunked, heads = chunk_loss_heads(gm)
    return lambda *args: with_logits_gradients(heads, chunked.forward(*args), args)


def _rewrite(graph: fx.Graph, head: LossHead, by_name: dict[str, fx.Node]) -> None:
    ce, linear = by_name[head.cross_entropy], by_name[head.linear]
    hidden, weight = linear.args[0], linear.args[1]
    bias = linear.args[2] if len(linear.args) > 2 else None
    target = by_name[head.target]
    rows = math.ceil(head.tokens / head.chunks)
    add = node_adder(graph, ce)

    with graph.inserting_before(ce):
        flat = add("call_method", "reshape", (hidden, -1, head.hidden))
        flat, weight, bias = cast_nodes(add, (flat, weight, bias), head.cast_to)
        if head.seq_window is not None:
            # the op computes every position: those the loss does not read get ignore_index
            start, stop = head.seq_window
            lead, length = head.logits_shape[:-2], head.logits_shape[-2]
            target = add("call_method", "reshape", (target, *lead, stop - start))
            target = add("call_function", F.pad, (target, (start, length - stop), "constant", head.ignore_index))
            target = add("call_method", "reshape", (target, -1))
        out = add("call_function", loss_ops.FORWARD, (flat, weight, bias, target, head.ignore_index, rows,
                                                      head.label_smoothing, head.logit_scale, bool(head.returned)))
        loss = add("call_function", operator.getitem, (out, 0))
        if head.reduction == "mean":
            # PyTorch's mean over the targets it counts (0/0 = nan when none is, as in eager)
            counted = add("call_function", operator.ne, (target, head.ignore_index))
            count = add("call_method", "sum", (counted,))
            loss = add("call_function", operator.truediv, (loss, count))
        if head.returned:
            logits = add("call_function", operator.getitem, (out, 4))
            logits = add("call_method", "view", (logits, *head.logits_shape))
    ce.replace_all_uses_with(loss)
    (output,) = graph.find_nodes(op="output")
    for name in head.returned:
        by_name[name].replace_all_uses_with(logits, delete_user_cb=lambda user: user is output)
    if head.hidden_output is not None:
        output.args = ((*output.args[0], hidden),)
    for node in (ce, *reversed([by_name[n] for n in head.steps]), linear):
        graph.erase_node(node)


LOSS_HEAD = ChunkPattern(_match, _replaced, _rewrite, prepare=_place_hidden_outputs)
