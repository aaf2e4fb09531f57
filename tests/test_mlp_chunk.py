"""Chunking transformer MLPs by token rows (passes/mlp_chunk.py): which MLPs match, the same
loss and gradients as the MLPs whole, a lower smallest budget, and the backend applies it only
where no plan fits without it (chunk_mlp="auto")."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from budget_helpers import budget_range, compile_under, grads
from hypothesis import example, given, settings
from hypothesis import strategies as st

import memcompile
from memcompile.cost_models.device import profile_for
from memcompile.passes.mlp_chunk import chunk_mlps, find_mlps

_ACTIVATIONS = {"gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"), "silu": F.silu,
                "relu": F.relu}


class Block(nn.Module):
    """Layer norm, then a plain or gated MLP, with a residual (a transformer block's second half)."""

    def __init__(self, hidden: int, inner: int, activation: str, gated: bool, bias: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, inner, bias=bias)
        self.gate = nn.Linear(hidden, inner, bias=bias) if gated else None
        self.down = nn.Linear(inner, hidden, bias=bias)
        self.act = _ACTIVATIONS[activation]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = self.norm(h)
        inner = self.act(self.gate(x)) * self.up(x) if self.gate is not None else self.act(self.up(x))
        return h + self.down(inner)


class MlpStack(nn.Module):
    def __init__(self, hidden: int = 32, inner: int = 256, depth: int = 2, activation: str = "gelu",
                 gated: bool = False, bias: bool = True) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(hidden, inner, activation, gated, bias) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


def _captured(module: nn.Module, *inputs: torch.Tensor) -> torch.fx.GraphModule:
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(module, backend=capture)(*inputs)
    torch._dynamo.reset()
    return graphs[0]


@settings(max_examples=12, deadline=None)
@given(activation=st.sampled_from(sorted(_ACTIVATIONS)), gated=st.booleans(), bias=st.booleans(),
       batch=st.integers(2, 3), seq=st.integers(40, 90), hidden=st.sampled_from([8, 16, 24]),
       inner=st.integers(20, 100), depth=st.integers(1, 2), seed=st.integers(0, 2**16),
       max_chunks=st.sampled_from([None, 1, 2, 3]))
def test_chunked_mlps_give_the_same_loss_and_gradients(activation, gated, bias, batch, seq, hidden, inner, depth,
                                                       seed, max_chunks) -> None:
    torch.manual_seed(seed)
    model = MlpStack(hidden, inner, depth, activation, gated, bias)
    x = torch.randn(batch, seq, hidden)
    gm = _captured(model, x)
    chunked, blocks = chunk_mlps(gm, max_chunks)
    finest = find_mlps(gm.graph)
    assert len(blocks) == depth and all(b.gated == gated and b.activation == activation for b in blocks)
    assert all(b.tokens == batch * seq for b in blocks)
    assert [b.chunks for b in blocks] == [f.chunks if max_chunks is None else min(f.chunks, max_chunks) for f in finest]
    assert all(f.chunks >= 2 for f in finest)
    assert not find_mlps(chunked.graph)  # every MLP became one op
    targets = [str(n.target) for n in chunked.graph.nodes]
    assert sum("chunked_mlp" in t for t in targets) == depth
    _assert_rewritten_grads_match_eager(model, x, max_chunks)


def test_mlps_the_rewrite_must_not_touch_are_left_alone() -> None:
    x = torch.randn(2, 64, 16)
    up, down, other = nn.Linear(16, 64), nn.Linear(64, 16), nn.Linear(16, 64)

    def intermediate_used_twice(x):
        a = F.gelu(up(x))
        return down(a).sum() + a.sum()

    def no_activation(x):
        return down(up(x)).sum()

    def unknown_activation(x):
        return down(torch.tanh(up(x))).sum()

    def gate_of_another_input(x):
        return down(F.silu(up(x)) * other(x * 2)).sum()

    def too_few_tokens(x):
        return down(F.gelu(up(x[:, :20]))).sum()

    for fn in (intermediate_used_twice, no_activation, unknown_activation, gate_of_another_input, too_few_tokens):
        gm = _captured(fn, x)
        assert find_mlps(gm.graph) == (), fn.__name__
        assert chunk_mlps(gm)[0] is gm

    def plain(x):
        return down(F.gelu(up(x))).sum()

    assert len(find_mlps(_captured(plain, x).graph)) == 1  # the same layers, unmodified, match


def test_auto_chunks_the_mlps_where_no_plan_fits_without_them() -> None:
    torch.manual_seed(0)
    model = MlpStack(hidden=32, inner=512, depth=2, activation="silu", gated=True, bias=False)
    x = torch.randn(4, 64, 32)
    whole_floor, keep_all = budget_range(model, x, chunk_mlp=False)
    chunked_floor, _ = budget_range(model, x, chunk_mlp=True)
    auto_floor, _ = budget_range(model, x)
    # (tokens x intermediate) buffers are no longer held whole in the backward
    assert chunked_floor < whole_floor - 256 * 512 * 4
    assert auto_floor == chunked_floor  # the error names the smallest budget that works

    params = list(model.parameters())
    eager = grads(params, lambda: model(x))
    budget = (chunked_floor + whole_floor) // 2
    backend, compiled = compile_under(model, budget)
    got = grads(params, lambda: compiled(x))
    (plan,) = backend.plans
    assert plan.predicted_peak_bytes <= plan.step_budget_bytes
    assert len(plan.graph_rewrites) == 2 and all("chunked into" in r for r in plan.graph_rewrites)
    assert "no solver plan fits without it" in plan.graph_rewrites[0]
    for g, want in zip(got, eager):
        torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-6)
    for p in params:
        p.grad = None
    measured = memcompile.measure_peak(lambda: compiled(x).backward(), live_at_start=[model, x])
    assert measured.peak_bytes <= budget
    torch.compiler.reset()
    _, refused = compile_under(model, budget, chunk_mlp=False)
    with pytest.raises(memcompile.InfeasibleBudgetError) as info:
        refused(x)
    assert info.value.min_feasible_bytes == whole_floor

    # budgets a plan meets without chunking (even one that recomputes): the graph as written
    for fits in (keep_all, whole_floor + (keep_all - whole_floor) // 3):
        torch.compiler.reset()
        backend, compiled = compile_under(model, fits)
        compiled(x).backward()
        assert all(not p.graph_rewrites for p in backend.plans)
    torch.compiler.reset()


def _chunk_counts(plan) -> list[int]:
    return [int(r.split("chunked into ")[1].split()[0]) for r in plan.graph_rewrites if r.startswith("MLP ")]


def test_auto_chunks_the_mlps_as_coarsely_as_the_budget_allows() -> None:
    # The finest chunking (8 chunks here) lowers the floor most, but each chunk costs its own op
    # launches and smaller matmuls: where 2 chunks fit, auto takes 2; where only the finest fits,
    # the finest.
    torch.manual_seed(2)
    model = MlpStack(hidden=32, inner=512, depth=2, activation="gelu", gated=False, bias=True)
    x = torch.randn(4, 64, 32)
    finest = find_mlps(_captured(model, x).graph)
    assert {b.chunks for b in finest} == {8}
    whole_floor, _ = budget_range(model, x, chunk_mlp=False)
    chunked_floor, _ = budget_range(model, x, chunk_mlp=True)
    params = list(model.parameters())
    eager = grads(params, lambda: model(x))
    for budget, counts in ((whole_floor - 1, [2, 2]), (chunked_floor, [8, 8])):
        torch.compiler.reset()
        backend, compiled = compile_under(model, budget)
        got = grads(params, lambda: compiled(x))
        plan = backend.plans[-1]
        assert _chunk_counts(plan) == counts, plan.graph_rewrites
        # what the plan says it adds counts the chunked MLPs' own cost, more for more chunks
        chunked = [dataclasses.replace(b, chunks=c) for b, c in zip(finest, counts)]
        assert plan.rewrite_time_s == pytest.approx(sum(b.added_time_s(profile_for("cpu")) for b in chunked))
        assert plan.total_added_time_s == plan.added_time_s + plan.rewrite_time_s > plan.added_time_s
        assert "rewrites ~" in memcompile.dump(backend)
        assert ("at most 2 chunks" in plan.graph_rewrites[0]) == (counts == [2, 2])
        assert plan.predicted_peak_bytes <= plan.step_budget_bytes
        for g, want in zip(got, eager):
            torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-6)
        for p in params:
            p.grad = None
        assert memcompile.measure_peak(lambda: compiled(x).backward(), live_at_start=[model, x]).peak_bytes <= budget
    torch.compiler.reset()


@pytest.mark.inductor  # PyTorch's partitions are candidates under Inductor only
@pytest.mark.parametrize("per_chunk_s", [1e-9, 1.0])
def test_a_coarse_chunking_that_can_gain_only_noise_over_the_finest_is_not_searched(monkeypatch,
                                                                                    per_chunk_s) -> None:
    """The finest chunking's plan recomputes no more than a coarser one's (it holds less), so the
    2-chunk graph can beat it by at most what the finer chunks cost beyond it. Where that is within
    noise of the step (chunks priced at 1 ns) and PyTorch's default partition of the 2-chunk graph
    is over the budget, that graph is neither partitioned nor solved: the finest is planned. Where
    finer chunks are priced high (1 s each), the 2-chunk graph is searched as before."""
    from memcompile import planner
    from memcompile.passes.mlp_chunk import MlpBlock

    monkeypatch.setattr(MlpBlock, "added_time_s", lambda self, profile: per_chunk_s * self.chunks)
    torch.manual_seed(2)
    model = MlpStack(hidden=32, inner=512, depth=2, activation="gelu", gated=False, bias=True)
    x = torch.randn(4, 64, 32)
    backend, compiled = compile_under(model, 10**12, codegen="inductor", chunk_mlp=True)
    compiled(x).backward()
    (finest,) = backend.plans
    assert _chunk_counts(finest) == [8, 8]
    budget = finest.predicted_peak_bytes + finest.reserve_bytes  # its default partition: 2 chunks are over
    torch.compiler.reset()
    model.zero_grad(set_to_none=True)
    searched: list[int] = []  # rows per chunk of each graph partitioned or solved (0: not chunked)
    for name in ("_stock_partitions", "_new_replanner"):
        original = getattr(planner, name)

        def recording(joint, *args, _original=original, **kwargs):
            rows = [a for n in joint.graph.nodes if "chunked_mlp" in str(n.target) for a in n.args if isinstance(a, int)]
            searched.append(rows[0] if rows else 0)
            return _original(joint, *args, **kwargs)

        monkeypatch.setattr(planner, name, recording)
    params = list(model.parameters())
    eager = grads(params, lambda: model(x))
    backend, compiled = compile_under(model, budget, codegen="inductor", plan_store=False)
    got = grads(params, lambda: compiled(x))
    plan = backend.plans[-1]
    two_chunks = 256 // 2  # rows per chunk
    assert (two_chunks in searched) == (per_chunk_s > 1e-3), searched
    if per_chunk_s < 1e-3:
        assert _chunk_counts(plan) == [8, 8]
    for g, want in zip(got, eager):
        torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-6)
    for p in params:
        p.grad = None
    assert memcompile.measure_peak(lambda: compiled(x).backward(), live_at_start=[model, x]).peak_bytes <= budget
    torch.compiler.reset()


@pytest.mark.parametrize("finer_is_cheaper", [False, True])
def test_a_coarse_plan_that_costs_more_than_finer_chunking_is_weighed_against_the_finest(monkeypatch,
                                                                                        finer_is_cheaper) -> None:
    """Where the MLPs in 2 chunks fit, their plan is compiled unless it recomputes more than
    chunking them finer would cost beyond it: then the finest graph is planned too and the faster
    of the two plans, with what its chunking costs, is compiled. Here the 2-chunk graph fits with
    nothing recomputed: at the estimated costs (more chunks cost more) it is compiled without
    planning the finest; with finer chunks priced cheaper, it is weighed, and the finest (also
    recomputing nothing) compiled, within the budget and with the same gradients."""
    from memcompile import backend as backend_module
    from memcompile.passes.mlp_chunk import MlpBlock

    if finer_is_cheaper:
        monkeypatch.setattr(MlpBlock, "added_time_s", lambda self, profile: -1e-3 * self.chunks)
    weighed = []
    original = backend_module._Region._plan_coarse

    def plan_coarse(self, *args, **kwargs):
        fitted, coarser = original(self, *args, **kwargs)
        weighed.append(coarser)
        return fitted, coarser

    monkeypatch.setattr(backend_module._Region, "_plan_coarse", plan_coarse)
    torch.manual_seed(2)
    model = MlpStack(hidden=32, inner=512, depth=2, activation="gelu", gated=False, bias=True)
    x = torch.randn(4, 64, 32)
    whole_floor, _ = budget_range(model, x, chunk_mlp=False)
    params = list(model.parameters())
    eager = grads(params, lambda: model(x))
    torch.compiler.reset()
    backend, compiled = compile_under(model, whole_floor - 1)
    got = grads(params, lambda: compiled(x))
    plan = backend.plans[-1]
    (coarser,) = weighed
    if finer_is_cheaper:
        assert coarser is not None and coarser.planned.plan.added_time_s == 0.0
        assert _chunk_counts(plan) == [8, 8] and plan.added_time_s + plan.rewrite_time_s < coarser.total_s
    else:
        assert coarser is None and _chunk_counts(plan) == [2, 2]
    assert plan.predicted_peak_bytes <= plan.step_budget_bytes
    for g, want in zip(got, eager):
        torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-6)
    for p in params:
        p.grad = None
    assert memcompile.measure_peak(lambda: compiled(x).backward(), live_at_start=[model, x]).peak_bytes < whole_floor
    torch.compiler.reset()


@pytest.mark.inductor
def test_inductor_meets_a_budget_only_the_chunked_mlps_fit() -> None:
    torch.manual_seed(1)
    model = MlpStack(hidden=32, inner=256, depth=2, activation="gelu", gated=False, bias=True)
    x = torch.randn(4, 64, 32)
    whole_floor, _ = budget_range(model, x, chunk_mlp=False, codegen="inductor")
    chunked_floor, _ = budget_range(model, x, chunk_mlp=True, codegen="inductor")
    assert chunked_floor < whole_floor
    budget = (chunked_floor + whole_floor) // 2
    params = list(model.parameters())
    eager = grads(params, lambda: model(x))
    backend, compiled = compile_under(model, budget, codegen="inductor")
    got = grads(params, lambda: compiled(x))
    for g, want in zip(got, eager):
        torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-6)
    for p in params:
        p.grad = None
    measured = memcompile.measure_peak(lambda: compiled(x).backward(), live_at_start=[model, x])
    assert backend.plans[-1].graph_rewrites
    assert measured.peak_bytes <= budget
    torch.compiler.reset()


@pytest.mark.parametrize("value", ["yes", 1, None, "always"])
def test_chunk_mlp_option_is_validated(value) -> None:
    with pytest.raises(ValueError, match="chunk_mlp="):
        memcompile.budget("1GB", chunk_mlp=value)


class LayerStack(nn.Module):
    """Linear layers chained at random: each followed by an activation or not, some gated (the
    activation of one linear times another linear of the same input), some with a residual or a
    second reader of their result. Consecutive linear -> activation -> linear layers overlap as
    MLPs (each linear is the down projection of one and the up projection of the next)."""

    _ACTS = {**_ACTIVATIONS, "tanh": torch.tanh, "none": None}

    def __init__(self, width: int, layers: list[tuple[int, str, bool, str]]) -> None:
        super().__init__()
        self.specs = layers
        self.linears, self.gates = nn.ModuleList(), nn.ModuleList()
        d = width
        for out, _, gated, _ in layers:
            self.linears.append(nn.Linear(d, out))
            self.gates.append(nn.Linear(d, out) if gated else nn.Identity())
            d = out
        self.head = nn.Linear(d, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        extra = x.new_zeros(())
        for linear, gate, (_, act, gated, reader) in zip(self.linears, self.gates, self.specs):
            h = linear(x)
            fn = self._ACTS[act]
            h = fn(h) if fn is not None else h
            if gated:
                h = h * gate(x)
            if reader == "residual" and h.shape == x.shape:
                h = h + x
            elif reader == "second":
                extra = extra + h.mean()
            x = h
        return self.head(x).pow(2).mean() + extra


@settings(max_examples=25, deadline=None)
@given(width=st.sampled_from([8, 16]), tokens=st.sampled_from([64, 96, 128]), seed=st.integers(0, 2**16),
       layers=st.lists(st.tuples(st.sampled_from([8, 16, 48, 64]), st.sampled_from(sorted(LayerStack._ACTS)),
                                 st.booleans(), st.sampled_from(["none", "residual", "second"])),
                       min_size=1, max_size=6),
       max_chunks=st.sampled_from([None, 2]))
@example(width=16, tokens=128, seed=0, layers=[(64, "gelu", False, "none")] * 4, max_chunks=None)
@example(width=16, tokens=64, seed=1, layers=[(48, "silu", True, "none"), (16, "relu", False, "residual")] * 2,
         max_chunks=2)
def test_random_layer_stacks_chunk_without_crashing_and_keep_their_gradients(width, tokens, seed, layers,
                                                                             max_chunks) -> None:
    """Whatever the matcher accepts the rewrite takes: no two matches share a node, every match
    becomes one op, and the chunked graph computes the same loss and gradients."""
    torch.manual_seed(seed)
    model = LayerStack(width, layers)
    x = torch.randn(tokens, width)
    gm = _captured(model, x)
    found = find_mlps(gm.graph)
    names = [n for b in found for n in (b.down, b.up, b.gate, b.activation_node, b.product) if n]
    assert len(names) == len(set(names))
    chunked, blocks = chunk_mlps(gm, max_chunks)
    chunked.graph.lint()
    assert len(blocks) == len(found)
    assert sum("chunked_mlp" in str(n.target) for n in chunked.graph.nodes) == len(found)
    _assert_rewritten_grads_match_eager(model, x, max_chunks)


def test_a_stack_of_linear_gelu_layers_under_a_tiny_budget_raises_the_typed_error() -> None:
    """Six linear -> GELU layers, two regions (issue 31): every linear matched twice as an MLP
    once crashed the rewrite with a TypeError; now the budget's answer is the typed error."""

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(256, 256) for _ in range(6))

        def forward(self, x):
            for layer in self.layers:
                x = F.gelu(layer(x))
            torch._dynamo.graph_break()
            return x.pow(2).mean()

    torch.manual_seed(0)
    model, x = Stack(), torch.randn(512, 256)
    _, compiled = compile_under(model, 1000)
    with pytest.raises(memcompile.InfeasibleBudgetError) as info:
        compiled(x)
    assert info.value.min_feasible_bytes > 1000
    torch.compiler.reset()


def _assert_rewritten_grads_match_eager(model, x, max_chunks) -> None:
    """Gradients with every MLP chunked (the rewrite alone, no planning) equal eager's."""
    params = list(model.parameters())
    eager = grads(params, lambda: model(x))
    compiled = torch.compile(model, backend=lambda g, ex: chunk_mlps(g, max_chunks)[0].forward)
    got = grads(params, lambda: compiled(x))
    torch._dynamo.reset()
    for g, want in zip(got, eager):
        torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-5 * max(1.0, want.abs().max().item()))
