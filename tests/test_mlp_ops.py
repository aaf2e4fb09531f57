"""The chunked MLP ops (memcompile/mlp_ops.py): the forward and its gradients equal the unchunked
MLP's, the ops pass torch.library.opcheck, `workspace_bytes` bounds what the allocator sees inside
them, the flop formulas count the unchunked MLP plus the recomputed projections, and under
torch.compile the ops are two opaque nodes of the joint graph."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

import memcompile
from memcompile import mlp_ops

NAMES = ("x", "w_up", "b_up", "w_gate", "b_gate", "w_down", "b_down")


def _reference_act(t: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "gelu":
        return F.gelu(t)
    if activation == "gelu_tanh":
        return F.gelu(t, approximate="tanh")
    if activation == "silu":
        return F.silu(t)
    assert activation == "relu"
    return F.relu(t)


def reference_mlp(x, w_up, b_up, w_gate, b_gate, w_down, b_down, activation: str) -> torch.Tensor:
    """The MLP unchunked, as a model writes it."""
    up = F.linear(x, w_up, b_up)
    inner = _reference_act(F.linear(x, w_gate, b_gate), activation) * up if w_gate is not None else \
        _reference_act(up, activation)
    return F.linear(inner, w_down, b_down)


def make_tensors(tokens: int, hidden: int, inner: int, out: int, gated: bool, bias: bool, dtype: torch.dtype,
                 seed: int, requires_grad: bool = False) -> list[Optional[torch.Tensor]]:
    """(x, w_up, b_up, w_gate, b_gate, w_down, b_down), weights scaled as nn.Linear's (values of
    order one throughout); absent ones None."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        t = (torch.randn(*shape, generator=g) * scale).to(dtype)
        return t.requires_grad_(requires_grad)

    return [rand(tokens, hidden), rand(inner, hidden, scale=hidden ** -0.5), rand(inner) if bias else None,
            rand(inner, hidden, scale=hidden ** -0.5) if gated else None, rand(inner) if gated and bias else None,
            rand(out, inner, scale=inner ** -0.5), rand(out) if bias else None]


def assert_close(got: torch.Tensor, want: torch.Tensor, name: str, exact: Optional[torch.Tensor] = None) -> None:
    """`got` (the chunked op's) against `want` (the unchunked MLP's, in the same dtype). float32:
    rtol 1e-5, and an atol of a few ulps of the tensor's scale plus 4x the unchunked float32
    result's own error against `exact` (float64), where given: a weight gradient sums `tokens`
    products, and summed chunk by chunk (rows=1: one a token) it rounds differently, by as much
    as the float32 sum's own rounding (several ulps of the terms where they cancel)."""
    assert got.shape == want.shape and got.dtype == want.dtype, name
    scale = max(1.0, want.abs().max().float().item()) if want.numel() else 1.0
    if want.dtype == torch.float32:
        atol = 1e-6 * scale
        if exact is not None and want.numel():
            atol += 4 * (want.double() - exact).abs().max().item()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=atol, msg=lambda m: f"{name}: {m}")
    else:
        # bf16: the chunks' weight-gradient products are rounded to bf16 before their float32 sum
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * scale,
                                   msg=lambda m: f"{name}: {m}")


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@settings(max_examples=100, deadline=None)
@given(tokens=st.integers(1, 70), rows=st.integers(1, 80), hidden=st.sampled_from([4, 8, 16, 24]),
       inner=st.integers(1, 48), out=st.sampled_from([1, 5, 8, 16]), gated=st.booleans(), bias=st.booleans(),
       activation=st.sampled_from(mlp_ops.ACTIVATIONS),
       dtype=st.sampled_from([torch.float32, torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))
@example(tokens=37, rows=8, hidden=16, inner=40, out=8, gated=True, bias=True, activation="silu",
         dtype=torch.float32, seed=0)  # 5 chunks, the last of 5 rows
@example(tokens=5, rows=16, hidden=8, inner=24, out=5, gated=False, bias=False, activation="gelu",
         dtype=torch.float32, seed=1)  # rows > tokens: one chunk
@example(tokens=23, rows=1, hidden=8, inner=12, out=8, gated=False, bias=True, activation="relu",
         dtype=torch.float32, seed=2)  # a chunk a row
@example(tokens=50, rows=16, hidden=24, inner=48, out=16, gated=True, bias=False, activation="gelu_tanh",
         dtype=torch.bfloat16, seed=3)
@example(tokens=33, rows=10, hidden=16, inner=32, out=8, gated=False, bias=True, activation="silu",
         dtype=torch.bfloat16, seed=4)
def test_chunked_mlp_gives_the_unchunked_output_and_gradients(tokens, rows, hidden, inner, out, gated, bias,
                                                               activation, dtype, seed) -> None:
    tensors = make_tensors(tokens, hidden, inner, out, gated, bias, dtype, seed, requires_grad=True)
    present = [t for t in tensors if t is not None]
    grad_y = torch.randn(tokens, out, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)

    want = reference_mlp(*tensors, activation)
    want_grads = torch.autograd.grad(want, present, grad_y)
    got = mlp_ops.chunked_mlp(*tensors, activation, rows)
    got_grads = torch.autograd.grad(got, present, grad_y)

    exact, exact_grads = None, [None] * len(want_grads)  # bf16: against the bf16 MLP only
    if dtype == torch.float32:
        wide = [t.detach().double().requires_grad_() if t is not None else None for t in tensors]
        exact = reference_mlp(*wide, activation)
        exact_grads = torch.autograd.grad(exact, [t for t in wide if t is not None], grad_y.double())
    assert_close(got, want, "y", exact)
    names = [n for n, t in zip(NAMES, tensors) if t is not None]
    for name, g, w, e in zip(names, got_grads, want_grads, exact_grads):
        assert_close(g, w, f"grad {name}", e)

    # the backward op itself: empty tensors for absent parameters, which the autograd formula
    # turns into None gradients
    detached = [t.detach() if t is not None else None for t in tensors]
    raw = mlp_ops.BACKWARD(grad_y, *detached, activation, rows)
    assert len(raw) == 7
    for name, t, g in zip(NAMES, tensors, raw):
        if t is None:
            assert g.numel() == 0, name
        else:
            assert g.shape == t.shape and g.dtype == dtype, name
    ctx = SimpleNamespace(saved_tensors=tuple(detached), activation=activation, rows=rows)
    formula = mlp_ops._backward(ctx, grad_y)
    assert len(formula) == 9 and formula[7:] == (None, None)  # activation, rows
    for name, t, g in zip(NAMES, tensors, formula):
        assert (g is None) == (t is None), name


@pytest.mark.parametrize("gated", [False, True])
def test_absent_parameters_get_no_gradient_and_present_ones_do(gated) -> None:
    # w_gate / biases absent: autograd through the op leaves .grad of a frozen tensor alone and
    # fills every parameter the op was given
    tensors = make_tensors(12, 8, 16, 4, gated, False, torch.float32, 0, requires_grad=True)
    frozen_bias = torch.randn(4)  # a bias that does not require grad
    tensors[6] = frozen_bias
    mlp_ops.chunked_mlp(*tensors, "gelu", 5).sum().backward()
    assert frozen_bias.grad is None
    for name, t in zip(NAMES, tensors):
        if t is not None and t is not frozen_bias:
            assert t.grad is not None and t.grad.shape == t.shape and t.grad.abs().sum() > 0, name


def test_an_unknown_activation_is_refused() -> None:
    tensors = make_tensors(4, 8, 8, 4, False, False, torch.float32, 0)
    with pytest.raises(ValueError, match="unknown activation 'tanh'"):
        mlp_ops.chunked_mlp(*tensors, "tanh", 2)


@pytest.mark.parametrize("case", [
    dict(tokens=10, hidden=8, inner=12, out=6, gated=True, bias=True, dtype=torch.float32, activation="silu", rows=4),
    dict(tokens=7, hidden=8, inner=12, out=6, gated=False, bias=False, dtype=torch.float32, activation="gelu_tanh",
         rows=32),
    dict(tokens=9, hidden=16, inner=24, out=8, gated=True, bias=False, dtype=torch.bfloat16, activation="relu",
         rows=2),
    dict(tokens=11, hidden=8, inner=12, out=6, gated=False, bias=True, dtype=torch.float32, activation="gelu",
         rows=3),
], ids=["gated-bias-f32", "plain-f32", "gated-bf16", "plain-bias-f32"])
def test_opcheck_passes_on_both_ops(case) -> None:
    case = dict(case)
    activation, rows, dtype = case.pop("activation"), case.pop("rows"), case["dtype"]
    tensors = make_tensors(**case, seed=0, requires_grad=True)
    torch.library.opcheck(mlp_ops.chunked_mlp, (*tensors, activation, rows))
    grad_y = torch.randn(case["tokens"], case["out"]).to(dtype)
    detached = [t.detach() if t is not None else None for t in tensors]
    torch.library.opcheck(mlp_ops.chunked_mlp_backward, (grad_y, *detached, activation, rows))


def test_opcheck_passes_with_transposed_weights_and_input() -> None:
    # weights stored (in, out) and used as w.t() (as a model may write F.linear(x, w.t())), and a
    # column-major input: the fake impls must give the real outputs' strides (the gradients come
    # back contiguous)
    torch.manual_seed(0)
    tokens, hidden, inner, out = 10, 8, 12, 6
    tensors = [torch.randn(hidden, tokens).t(), torch.randn(hidden, inner).t(), torch.randn(inner),
               torch.randn(hidden, inner).t(), torch.randn(inner), torch.randn(inner, out).t(), torch.randn(out)]
    tensors = [t.requires_grad_() for t in tensors]
    torch.library.opcheck(mlp_ops.chunked_mlp, (*tensors, "silu", 3))
    grad_y = torch.randn(out, tokens).t()
    torch.library.opcheck(mlp_ops.chunked_mlp_backward, (grad_y, *[t.detach() for t in tensors], "silu", 3))
    got = torch.autograd.grad(mlp_ops.chunked_mlp(*tensors, "silu", 3), tensors, grad_y)
    want = torch.autograd.grad(reference_mlp(*tensors, "silu"), tensors, grad_y)
    for name, g, w in zip(NAMES, got, want):
        assert_close(g, w, name)


@settings(max_examples=40, deadline=None)
@given(tokens=st.integers(1, 200), rows=st.integers(1, 128), hidden=st.sampled_from([8, 16, 24, 64]),
       inner=st.integers(4, 96), out=st.sampled_from([8, 16, 64]), gated=st.booleans(), bias=st.booleans(),
       activation=st.sampled_from(mlp_ops.ACTIVATIONS), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 2**16))
@example(tokens=150, rows=40, hidden=16, inner=96, out=16, gated=True, bias=True, activation="silu",
         dtype=torch.float32, seed=0)
@example(tokens=150, rows=40, hidden=16, inner=96, out=16, gated=False, bias=False, activation="gelu",
         dtype=torch.float32, seed=0)
def test_op_scratch_is_what_the_allocator_sees(tokens, rows, hidden, inner, out, gated, bias, activation, dtype,
                                               seed) -> None:
    # What the planner charges while each op runs (mlp_ops.workspace_bytes) against the allocator's
    # events: never less. In float32 the chunk buffers are exact (forward: the activation, and the
    # gated product's other factor; backward: up, gate, act and the product or its gradient); the
    # slack is the formula's fixed allowances: 512 B in the forward; 1 KiB and the float32 bias
    # sums (4 * (2 * inner + out), charged with or without biases) in the backward (measured 1096
    # to 2872 B over 400 cases with inner <= 200). bf16 over-counts (oneDNN's scratchpad bound:
    # measured 2-50x the allocator's rise).
    tensors = make_tensors(tokens, hidden, inner, out, gated, bias, dtype, seed)
    args = (*tensors, activation, rows)
    live = [t for t in tensors if t is not None]

    forward = memcompile.measure_peak(lambda: mlp_ops.FORWARD(*args), live_at_start=live)
    assert forward.result.shape == (tokens, out)
    scratch = forward.rise_bytes - _nbytes([forward.result])
    charged = mlp_ops.workspace_bytes(mlp_ops.FORWARD, args)
    buffers = (2 if gated else 1) * min(rows, tokens) * inner * forward.result.element_size()
    assert charged >= scratch >= 0
    if dtype == torch.float32:
        assert scratch == buffers  # one chunk's buffers, never the whole (tokens x inner)
        assert charged - scratch <= 512

    grad_y = torch.randn(tokens, out).to(dtype)
    backward_args = (grad_y, *args)
    backward = memcompile.measure_peak(lambda: mlp_ops.BACKWARD(*backward_args), live_at_start=live + [grad_y])
    scratch = backward.rise_bytes - _nbytes(backward.result)
    charged = mlp_ops.workspace_bytes(mlp_ops.BACKWARD, backward_args)
    assert charged >= scratch >= 0
    if dtype == torch.float32:
        assert charged - scratch <= 1024 + 4 * (2 * inner + out)
        # at least the chunk buffers: the formula's allowance is not what absorbs them
        assert scratch >= (4 if gated else 3) * min(rows, tokens) * inner * 4


def test_workspace_bytes_is_zero_for_other_ops() -> None:
    tensors = make_tensors(8, 8, 8, 8, False, False, torch.float32, 0)
    assert mlp_ops.workspace_bytes(torch.ops.aten.mm.default, (tensors[0], tensors[1])) == 0


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_flop_formulas_count_the_unchunked_mlp_and_the_recomputed_projections(gated, bias) -> None:
    tokens, hidden, inner, out, rows = 37, 16, 40, 12, 8
    tensors = make_tensors(tokens, hidden, inner, out, gated, bias, torch.float32, 0, requires_grad=True)
    grad_y = torch.randn(tokens, out)

    def counted(fn) -> tuple[int, int]:
        with FlopCounterMode(display=False) as forward:
            y = fn()
        with FlopCounterMode(display=False) as backward:
            y.backward(grad_y)
        return forward.get_total_flops(), backward.get_total_flops()

    chunked_fw, chunked_bw = counted(lambda: mlp_ops.chunked_mlp(*tensors, "gelu", rows))
    reference_fw, reference_bw = counted(lambda: reference_mlp(*tensors, "gelu"))
    matmuls = 2 * tokens * hidden * inner * (2 if gated else 1) + 2 * tokens * inner * out
    assert reference_fw == matmuls and reference_bw == 2 * matmuls  # the reference counts only matmuls
    recompute = mlp_ops.recompute_flops(tokens, hidden, inner, gated)
    assert recompute == 2 * tokens * hidden * inner * (2 if gated else 1)
    assert chunked_fw == reference_fw
    assert chunked_bw == reference_bw + recompute
    assert chunked_fw + chunked_bw == reference_fw + reference_bw + recompute


class ChunkedMlp(nn.Module):
    """A (batch, seq, hidden) MLP calling the chunked op, then a nonlinear loss."""

    def __init__(self, hidden: int, inner: int, out: int, gated: bool, bias: bool, activation: str,
                 rows: int) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, inner, bias=bias)
        self.gate = nn.Linear(hidden, inner, bias=bias) if gated else None
        self.down = nn.Linear(inner, out, bias=bias)
        self.activation, self.rows = activation, rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate
        y = mlp_ops.chunked_mlp(x.reshape(-1, x.shape[-1]), self.up.weight, self.up.bias,
                                gate.weight if gate is not None else None, gate.bias if gate is not None else None,
                                self.down.weight, self.down.bias, self.activation, self.rows)
        return torch.tanh(y).square().sum()


def _recording_backend(graphs: dict[str, list[torch.fx.GraphModule]]):
    from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func

    def compiler(kind):
        def compile_graph(gm, example_inputs):
            graphs[kind].append(gm)
            return make_boxed_func(gm.forward)
        return compile_graph

    def backend(gm, example_inputs):
        return aot_module_simplified(gm, example_inputs, fw_compiler=compiler("fw"), bw_compiler=compiler("bw"))

    return backend


def _calls(gm: torch.fx.GraphModule, target) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is target)


@pytest.mark.parametrize("gated,bias,activation", [(True, False, "silu"), (False, True, "gelu_tanh")])
def test_compiled_grads_equal_eager_and_the_ops_are_two_opaque_nodes(gated, bias, activation) -> None:
    torch.manual_seed(0)
    model = ChunkedMlp(16, 40, 8, gated, bias, activation, rows=7)
    x = torch.randn(3, 11, 16, requires_grad=True)  # 33 tokens: 5 chunks, the last of 5 rows
    params = [x, *model.parameters()]

    def grads(step):
        for p in params:
            p.grad = None
        loss = step(x)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in params]

    eager_loss, eager = grads(model)
    compiled_loss, compiled = grads(torch.compile(model, backend="aot_eager"))
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-6, atol=0)
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)

    # and against the unchunked MLP
    def unchunked(inp):
        gate = model.gate
        y = reference_mlp(inp.reshape(-1, 16), model.up.weight, model.up.bias, gate.weight if gate else None,
                          gate.bias if gate else None, model.down.weight, model.down.bias, activation)
        return torch.tanh(y).square().sum()

    reference_loss, reference = grads(unchunked)
    torch.testing.assert_close(eager_loss, reference_loss, rtol=1e-5, atol=0)
    for got, want in zip(compiled, reference):
        assert_close(got, want, "grad")

    torch._dynamo.reset()
    graphs = {"fw": [], "bw": []}
    recorded_loss, recorded = grads(torch.compile(model, backend=_recording_backend(graphs)))
    (fw,), (bw,) = graphs["fw"], graphs["bw"]
    assert _calls(fw, mlp_ops.FORWARD) == 1 and _calls(fw, mlp_ops.BACKWARD) == 0
    assert _calls(bw, mlp_ops.BACKWARD) == 1 and _calls(bw, mlp_ops.FORWARD) == 0
    # opaque: no matmul or activation of the MLP traced into either graph
    for gm in (fw, bw):
        targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
        assert not targets & {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.gelu.default,
                              torch.ops.aten.silu.default, torch.ops.aten.gelu_backward.default,
                              torch.ops.aten.silu_backward.default}, targets
    torch.testing.assert_close(recorded_loss, eager_loss, rtol=1e-6, atol=0)
    for got, want in zip(recorded, eager):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("gated", [False, True])
def test_float64_gradients_are_accumulated_in_float64(gated: bool) -> None:
    # Found by test_backend_properties in CI: float32 accumulators made float64 gradients float32-exact only.
    torch.manual_seed(0)

    def make(*shape):
        return torch.randn(*shape, dtype=torch.float64, requires_grad=True)

    x, w_up, b_up, w_down, b_down = make(50, 8), make(20, 8), make(20), make(8, 20), make(8)
    w_gate = make(20, 8) if gated else None
    inputs = [t for t in (x, w_up, b_up, w_gate, w_down, b_down) if t is not None]
    up = F.linear(x, w_up, b_up)
    want_y = F.linear(F.gelu(F.linear(x, w_gate)) * up if gated else F.gelu(up), w_down, b_down)
    grad = torch.randn_like(want_y)
    want = torch.autograd.grad(want_y, inputs, grad)
    got = torch.autograd.grad(mlp_ops.chunked_mlp(x, w_up, b_up, w_gate, None, w_down, b_down, "gelu", 16), inputs, grad)
    for g, w in zip(got, want):
        assert g.dtype == torch.float64
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-10)
