"""Chunk transformer MLPs by token rows: linear -> activation [* linear] -> linear.

Why: at tight budgets the step's peak sits inside an MLP's backward, whose (tokens x
intermediate) working set no keep/recompute choice lowers (memcompile/mlp_ops.py). Split by token
rows, one chunk of it exists at a time, and the forward saves only the MLP's input. The price:
the backward recomputes the up (and gate) projections, which `MlpBlock.added_time_s` estimates
and the backend weighs (chunk_mlp="auto", memcompile/backend.py).

The rewrite works on Dynamo's graph (torch-level calls) before AOTAutograd, as the loss head's
does (passes/loss_head.py): the MLP becomes one call of `memcompile::chunked_mlp`, whose backward
is `memcompile::chunked_mlp_backward`. Gradients equal the unchunked ones up to float
reassociation of the weight gradients' sums over chunks.

Matched patterns (every intermediate used once, static shapes, floating point):
    linear(act(linear(x, W1, b1)), W2, b2)                            GPT-style, BERT, ViT
    linear(act(linear(x, Wg, bg)) * linear(x, Wu, bu), Wd, bd)        gated (Llama's SwiGLU)
with act one of F.gelu (exact or tanh), F.silu, F.relu / torch.relu.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import fx

from memcompile import mlp_ops
from memcompile._torch_private import gelu_ops, linear_ops, silu_ops
from memcompile.cost_models.device import DeviceProfile
from memcompile.passes.chunking import ChunkPattern, GraphBoundary, apply_chunking, cast_nodes, chunk_count, find_matches
from memcompile.passes.graph_facts import node_adder, static_shape

# A chunk's (rows x intermediate) buffers no larger than half the MLP's input (tokens x hidden):
# the backward's four chunk buffers then hold about what two hidden states hold.
_CHUNK_INNER_OVER_HIDDEN = 0.5
_MAX_CHUNKS = 16
_MIN_CHUNK_ROWS = 32
# Per chunk, the ops the forward and backward launch separately (matmuls, activation and its
# backward, products, bias sums), and the passes over the intermediate the chunked backward makes
# beyond Inductor's fused one (the activation recomputed, unfused products).
_OPS_PER_CHUNK = 16
_EXTRA_INNER_PASSES = 4
# Fitted to measured steps (pareto children, 1 thread, this 2-core CPU; 2026-12-02): ViT small's
# two MLPs cost ~3.8 ms each in 8 chunks and ~2.2 ms in 2 (1.30x and 1.18-1.21x a ~26 ms step,
# less the plans' own estimates), i.e. ~0.27 ms a chunk (17 us an eager op, against the 2 us
# launch of the profile) over ~1.7 ms, twice the recomputed projections at the profile's matmul
# rate (chunk-sized matmuls in the step ran 55-63 GFLOP/s against a profile of 96). Llama small,
# fitted on neither: 3.3 ms an MLP in 6 chunks estimated, ~3.35 ms measured (its least-peak plan,
# 1.25x, less the plan's and the loss head's estimates). The roofline alone said 1.1-1.2 ms.
_EAGER_OP_S = 17e-6
_CHUNKED_MATMUL_EFFICIENCY = 0.6

_MULS = frozenset({operator.mul, torch.mul})


def _activation_of(node: object) -> str | None:
    """The mlp_ops activation name of an activation call, or None."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or len(node.args) != 1:
        return None
    if node.target in gelu_ops():
        approximate = node.kwargs.get("approximate", "none")
        if set(node.kwargs) - {"approximate"}:
            return None
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(approximate)
    if node.kwargs.get("inplace", False) or set(node.kwargs) - {"inplace"}:
        return None
    if node.target in silu_ops():
        return "silu"
    if node.target in (F.relu, torch.relu):
        return "relu"
    return None


@dataclass(frozen=True)
class MlpBlock:
    """One matched MLP of a graph (node names) and how it would be chunked."""

    down: str
    up: str
    gate: str  # "" for a plain MLP
    activation_node: str
    product: str  # the gated product's node, "" for a plain MLP
    activation: str
    tokens: int
    hidden: int
    inner: int
    out: int
    chunks: int
    dtype: torch.dtype
    cast_to: torch.dtype | None = None  # under autocast: the linears' compute dtype

    @property
    def gated(self) -> bool:
        return bool(self.gate)

    def describe(self) -> str:
        kind = f"gated {self.activation}" if self.gated else self.activation
        return (f"MLP {self.down}: {kind} over {self.inner} features, {self.tokens} tokens, chunked into "
                f"{self.chunks}")

    def added_time_s(self, profile: DeviceProfile) -> float:
        """Estimated step time the chunked MLP adds over the unchunked one: the backward's
        recomputed projections and activation, and the chunks' separately launched ops."""
        dtype = self.cast_to or self.dtype
        size = torch.tensor([], dtype=dtype).element_size()
        flops = mlp_ops.recompute_flops(self.tokens, self.hidden, self.inner, self.gated)
        return (flops / (_CHUNKED_MATMUL_EFFICIENCY * profile.matmul_rate(dtype))
                + profile.memory_time_s(_EXTRA_INNER_PASSES * self.tokens * self.inner * size,
                                        self.tokens * self.inner * size / self.chunks)
                + self.chunks * _OPS_PER_CHUNK * max(profile.op_overhead_s, _EAGER_OP_S))


def _linear(node: object) -> tuple[fx.Node, fx.Node, object] | None:
    """(input, weight, bias or None) of a linear call with node weights, else None."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target in linear_ops()
            and not node.kwargs and len(node.args) in (2, 3)):
        return None
    x, weight = node.args[0], node.args[1]
    bias = node.args[2] if len(node.args) == 3 else None
    if not isinstance(x, fx.Node) or not isinstance(weight, fx.Node) or not (bias is None or isinstance(bias, fx.Node)):
        return None
    return x, weight, bias


def _value(node: object) -> torch.Tensor | None:
    value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _chunks(tokens: int, hidden: int, inner: int) -> int:
    wanted = math.ceil(inner / (_CHUNK_INNER_OVER_HIDDEN * hidden))
    return chunk_count(tokens, wanted, _MAX_CHUNKS, _MIN_CHUNK_ROWS)


def _match(down: fx.Node, _boundary: GraphBoundary) -> MlpBlock | None:
    """The MLP whose down projection is `down`, if the rewrite can take it."""
    down_args = _linear(down)
    if down_args is None:
        return None
    inner_node = down_args[0]
    if len(inner_node.users) != 1:
        return None
    product, gate = None, None
    if inner_node.op == "call_function" and inner_node.target in _MULS and not inner_node.kwargs \
            and len(inner_node.args) == 2 and all(isinstance(a, fx.Node) for a in inner_node.args):
        product = inner_node
        first, second = inner_node.args
        act_node, up = (first, second) if _activation_of(first) else (second, first)
        if first is second or _activation_of(act_node) is None:
            return None
        gate = act_node.args[0]
    else:
        act_node = inner_node
        up = act_node.args[0] if _activation_of(act_node) else None
    activation = _activation_of(act_node)
    up_args = _linear(up)
    if activation is None or up_args is None or len(act_node.users) != 1 or len(up.users) != 1:
        return None
    if gate is not None:
        gate_args = _linear(gate)
        if gate_args is None or len(gate.users) != 1 or gate_args[0] is not up_args[0]:
            return None
    x = up_args[0]
    x_shape, up_shape, down_shape = static_shape(x), static_shape(up), static_shape(down)
    if None in (x_shape, up_shape, down_shape) or len(x_shape) < 2:
        return None
    hidden, inner, out = x_shape[-1], up_shape[-1], down_shape[-1]
    tokens = math.prod(x_shape[:-1])
    if up_shape[:-1] != x_shape[:-1] or down_shape[:-1] != x_shape[:-1] or tokens == 0:
        return None
    linears = [down, up] + ([gate] if gate is not None else [])
    outputs = [_value(n) for n in linears + [act_node] + ([product] if product is not None else [])]
    if any(v is None for v in outputs) or len({v.dtype for v in outputs}) != 1 or not outputs[0].is_floating_point():
        return None
    compute = outputs[0].dtype
    operands = [_value(a) for n in linears for a in n.args if isinstance(a, fx.Node)]
    if any(v is None or not v.is_floating_point() for v in operands):
        return None
    # a weight shared with another use (tied) would need its gradients summed: still correct, as
    # the op's gradient flows into the same node; only shapes must be those of a linear
    chunks = _chunks(tokens, hidden, inner)
    if chunks < 2:
        return None
    return MlpBlock(down.name, up.name, gate.name if gate is not None else "", act_node.name,
                    product.name if product is not None else "", activation, tokens, hidden, inner, out, chunks,
                    compute, cast_to=compute if {v.dtype for v in operands} != {compute} else None)


def _nodes_of(block: MlpBlock) -> frozenset[str]:
    """The nodes the rewrite replaces (and erases) for this MLP."""
    return frozenset(n for n in (block.down, block.up, block.gate, block.activation_node, block.product) if n)


def find_mlps(graph: fx.Graph) -> tuple[MlpBlock, ...]:
    """The MLPs of a Dynamo graph that chunking would split into more than one chunk, no two
    sharing a node (passes/chunking.find_matches: the first in graph order wins)."""
    return find_matches(graph, MLP)


def chunk_mlps(gm: fx.GraphModule, max_chunks: int | None = None) -> tuple[fx.GraphModule, tuple[MlpBlock, ...]]:
    """A copy of `gm` with every MLP chunked (see the module docstring), and the MLPs; with
    `max_chunks`, into at most that many chunks each. Returns `gm` itself and () when none matches."""
    return apply_chunking(gm, MLP, max_chunks)


def _rewrite(graph: fx.Graph, block: MlpBlock, by_name: dict[str, fx.Node]) -> None:
    down, up = by_name[block.down], by_name[block.up]
    gate = by_name[block.gate] if block.gate else None
    x, w_up, b_up = _linear(up)
    _, w_gate, b_gate = _linear(gate) if gate is not None else (None, None, None)
    _, w_down, b_down = _linear(down)
    lead = static_shape(down)[:-1]
    rows = math.ceil(block.tokens / block.chunks)
    add = node_adder(graph, down)

    with graph.inserting_before(down):
        x, w_up, b_up, w_gate, b_gate, w_down, b_down = cast_nodes(
            add, (x, w_up, b_up, w_gate, b_gate, w_down, b_down), block.cast_to)
        flat = add("call_method", "reshape", (x, -1, block.hidden))
        y = add("call_function", mlp_ops.FORWARD,
                (flat, w_up, b_up, w_gate, b_gate, w_down, b_down, block.activation, rows))
        shaped = add("call_method", "reshape", (y, *lead, block.out))
    down.replace_all_uses_with(shaped)
    for name in (block.down, block.product, block.activation_node, block.up, block.gate):
        if name:
            graph.erase_node(by_name[name])


MLP = ChunkPattern(_match, _nodes_of, _rewrite)
