"""Chunking linear -> cross_entropy loss heads (passes/loss_head.py): same loss and gradients as
the whole head, a lower least peak, and the backend applies it where it is needed or estimated
faster ("auto")."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from budget_helpers import budget_range, compile_under, grads
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import memcompile
from memcompile import loss_ops
from memcompile.cost_models.device import profile_for
from memcompile.passes.loss_head import chunk_loss_heads, find_loss_heads


class TinyLM(nn.Module):
    """Embedding, a few tanh layers, then a vocabulary head and cross-entropy (the loss head)."""

    def __init__(self, vocab: int, hidden: int, depth: int, bias: bool, upcast: bool, reduction: str,
                 ignore_index: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden, dtype=dtype)
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden, dtype=dtype) for _ in range(depth))
        self.head = nn.Linear(hidden, vocab, bias=bias, dtype=dtype)
        self.vocab, self.upcast, self.reduction, self.ignore_index = vocab, upcast, reduction, ignore_index

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        logits = self.head(h)
        if self.upcast:
            logits = logits.float()
        # next-token targets; every fifth position ignored (as padding would be)
        targets = torch.where(ids % 5 == 0, self.ignore_index, torch.roll(ids, -1, dims=1))
        return F.cross_entropy(logits.view(-1, self.vocab), targets.view(-1), ignore_index=self.ignore_index,
                               reduction=self.reduction)


def _captured_graph(module: nn.Module, ids: torch.Tensor) -> torch.fx.GraphModule:
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(module, backend=capture)(ids)
    (gm,) = graphs
    return gm


def _lm_cases():
    return st.fixed_dictionaries({
        "vocab": st.integers(64, 700),
        "hidden": st.sampled_from([8, 16, 24]),
        "depth": st.integers(0, 2),
        "bias": st.booleans(),
        "reduction": st.sampled_from(["mean", "sum"]),
        "ignore_index": st.sampled_from([-100, 0, 3]),
        "dtype": st.sampled_from([torch.float32, torch.float32, torch.bfloat16]),
        "batch": st.integers(1, 4),
        "seq": st.integers(16, 80),
    })


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=_lm_cases(), seed=st.integers(0, 2**16))
def test_chunked_head_gives_the_same_loss_and_gradients(case: dict, seed: int) -> None:
    torch._dynamo.reset()  # per example: every example is a new model
    torch.manual_seed(seed)
    dtype = case.pop("dtype")
    batch, seq = case.pop("batch"), case.pop("seq")
    # bf16 logits reach cross_entropy only upcast (the Hugging Face heads do logits.float())
    model = TinyLM(**case, upcast=dtype != torch.float32 or seed % 2 == 0, dtype=dtype)
    ids = torch.randint(0, case["vocab"], (batch, seq))
    gm = _captured_graph(model, ids)
    chunked, heads = chunk_loss_heads(gm)
    tokens = batch * seq
    # chunks of >= 16 token rows whose logits are about 4x the hidden states, at most 16
    chunks = min(16, math.ceil(case["vocab"] / (4 * case["hidden"])), tokens // 16)
    if chunks < 2:
        assert heads == () and chunked is gm  # too few tokens to split
        return
    (head,) = heads
    assert (head.tokens, head.vocab, head.hidden, head.reduction, head.chunks) == (
        tokens, case["vocab"], case["hidden"], case["reduction"], chunks)
    names = {n.name for n in chunked.graph.nodes}
    assert head.linear not in names and head.cross_entropy not in names
    # one call of the chunked op, and no whole-vocabulary logits left
    (call,) = [n for n in chunked.graph.nodes if n.target is loss_ops.FORWARD]
    assert call.args[4:] == (case["ignore_index"], math.ceil(tokens / chunks))
    assert not find_loss_heads(chunked.graph)
    assert not [n for n in chunked.graph.nodes if n.target is F.cross_entropy]

    params = list(model.parameters())
    eager_grads = grads(params, lambda: model(ids))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=lambda g, ex: chunk_loss_heads(g)[0].forward)
    chunked_grads = grads(params, lambda: compiled(ids))
    eager_loss, chunked_loss = model(ids), compiled(ids)
    # float32: sums reassociated over chunks, a few ulps. bf16: eager rounds the logits' gradient
    # to bf16 before the head's backward matmuls, the op keeps it in float32: a few bf16 ulps of
    # each gradient's scale
    for got, want in zip([chunked_loss, *chunked_grads], [eager_loss, *eager_grads]):
        if dtype == torch.float32:
            # atol: a few ulps of the gradient's scale (AVX-512 float32 matmuls reassociate too)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * max(1.0, want.abs().max().item()))
        else:
            scale = want.abs().max().float().item()
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * scale)


def test_heads_the_rewrite_must_not_touch_are_left_alone() -> None:
    torch.manual_seed(0)
    ids = torch.randint(0, 300, (2, 64))
    head = nn.Linear(16, 300)
    embed = nn.Embedding(300, 16)
    targets = torch.roll(ids, -1, dims=1).view(-1)

    def smoothed(x):
        return F.cross_entropy(head(embed(x)).view(-1, 300), targets, label_smoothing=0.1)

    def weighted(x):
        return F.cross_entropy(head(embed(x)).view(-1, 300), targets, weight=torch.ones(300))

    def logits_also_returned(x):
        logits = head(embed(x))
        return F.cross_entropy(logits.view(-1, 300), targets) + logits.mean()

    def per_token(x):
        return F.cross_entropy(head(embed(x)).view(-1, 300), targets, reduction="none").sum()

    def not_a_linear(x):
        return F.cross_entropy(torch.tanh(head(embed(x))).view(-1, 300), targets)

    for fn in (smoothed, weighted, logits_also_returned, per_token, not_a_linear):
        torch._dynamo.reset()
        gm = _captured_graph(fn, ids)
        assert find_loss_heads(gm.graph) == (), fn.__name__
        assert chunk_loss_heads(gm)[0] is gm

    def plain(x):
        return F.cross_entropy(head(embed(x)).view(-1, 300), targets)

    torch._dynamo.reset()
    assert len(find_loss_heads(_captured_graph(plain, ids).graph)) == 1  # the same head, unmodified, matches


def _head_bound_lm() -> tuple[TinyLM, torch.Tensor]:
    # logits (512 x 1024 float32 = 2 MiB) dwarf the hidden states (512 x 32): the loss head is the floor
    torch.manual_seed(0)
    model = TinyLM(vocab=1024, hidden=32, depth=2, bias=True, upcast=False, reduction="mean", ignore_index=-100)
    return model, torch.randint(0, 1024, (4, 128))


def test_auto_chunks_the_head_where_no_plan_fits_without_it() -> None:
    model, ids = _head_bound_lm()
    whole_floor, keep_all = budget_range(model, ids, chunk_loss=False)
    chunked_floor, _ = budget_range(model, ids, chunk_loss=True)
    auto_floor, _ = budget_range(model, ids)
    # the head's logits and their gradient are no longer held whole at the backward's start
    assert chunked_floor < whole_floor - 2 * 2**20
    assert auto_floor == chunked_floor  # the error names the smallest budget that works

    params = list(model.parameters())
    eager = grads(params, lambda: model(ids))
    # a budget only the chunked head meets: "auto" chunks it, False refuses it with a clear error
    budget = (chunked_floor + whole_floor) // 2
    backend, compiled = compile_under(model, budget)
    chunked = grads(params, lambda: compiled(ids))
    (plan,) = backend.plans
    assert plan.predicted_peak_bytes <= plan.step_budget_bytes
    assert len(plan.graph_rewrites) == 1 and "chunked into" in plan.graph_rewrites[0]
    assert "rewrite" in memcompile.dump(backend)
    for got, want in zip(chunked, eager):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    measured = memcompile.measure_peak(lambda: compiled(ids).backward(), live_at_start=[model, ids])
    assert measured.peak_bytes <= budget
    torch.compiler.reset()
    _, refused = compile_under(model, budget, chunk_loss=False)
    with pytest.raises(memcompile.InfeasibleBudgetError) as info:
        refused(ids)
    assert info.value.min_feasible_bytes == whole_floor

    # a budget the whole head meets: "auto" leaves the graph as the user wrote it
    torch.compiler.reset()
    backend, compiled = compile_under(model, keep_all)
    compiled(ids).backward()
    assert all(not p.graph_rewrites for p in backend.plans)


def test_the_whole_heads_least_peak_is_not_searched_when_the_chunked_head_fits(monkeypatch) -> None:
    """Where no solver plan fits with the head whole, the chunked head is planned before the whole
    head's least-peak search (Llama small at 9.91 MiB: 25 s of a 63 s first call, for a plan the
    chunked head's replaced); the plan and its gradients are as before. Below both floors the
    whole head is planned again, and the error still names the smaller floor."""
    from memcompile import planner

    model, ids = _head_bound_lm()
    whole_floor, _ = budget_range(model, ids, chunk_loss=False)
    chunked_floor, _ = budget_range(model, ids, chunk_loss=True)
    searched = []
    original = planner._least_peak_attempt

    def least_peak(joint, *args, **kwargs):
        searched.append(any("chunked_linear_cross_entropy" in str(n.target) for n in joint.graph.nodes))
        return original(joint, *args, **kwargs)

    monkeypatch.setattr(planner, "_least_peak_attempt", least_peak)
    budget = (chunked_floor + whole_floor) // 2
    backend, compiled = compile_under(model, budget)
    got = grads(list(model.parameters()), lambda: compiled(ids))
    (plan,) = backend.plans
    assert "chunked into" in plan.graph_rewrites[0] and plan.predicted_peak_bytes <= plan.step_budget_bytes
    assert all(searched)  # no search of the whole head's graph
    for g, want in zip(got, grads(list(model.parameters()), lambda: model(ids))):
        torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-6)
    torch.compiler.reset()
    searched.clear()
    _, compiled = compile_under(model, chunked_floor - 1)
    with pytest.raises(memcompile.InfeasibleBudgetError) as info:
        compiled(ids)
    assert info.value.min_feasible_bytes == min(chunked_floor, whole_floor)
    assert sorted(searched) == [False, True]  # both graphs searched once the chunked head failed


def test_auto_chunks_the_head_where_that_is_estimated_faster_than_recomputing() -> None:
    # wide layers (512 x 256 activations) before a 2048-class head: with the head whole, budgets
    # below keep-all are met by recomputing those layers, which chunking the head may avoid
    torch.manual_seed(0)
    model = TinyLM(vocab=2048, hidden=256, depth=4, bias=True, upcast=False, reduction="mean", ignore_index=-100)
    ids = torch.randint(0, 2048, (4, 128))
    whole_floor, keep_all = budget_range(model, ids, chunk_loss=False)
    (head,) = find_loss_heads(_captured_graph(model, ids).graph)
    chunking_s = head.added_time_s(profile_for("cpu"))
    assert chunking_s > 0
    params = list(model.parameters())
    eager = grads(params, lambda: model(ids))
    chose = set()
    for budget in (keep_all - (keep_all - whole_floor) // 20, whole_floor + (keep_all - whole_floor) // 4):
        added = {}
        for form in (False, True):
            torch.compiler.reset()
            backend, compiled = compile_under(model, budget, chunk_loss=form)
            compiled(ids).backward()
            added[form] = backend.plans[0].added_time_s
        chunk = added[False] > chunking_s and added[True] + chunking_s < added[False]
        torch.compiler.reset()
        backend, compiled = compile_under(model, budget)
        got = grads(params, lambda: compiled(ids))
        (plan,) = backend.plans  # the plan not chosen is not listed
        assert bool(plan.graph_rewrites) == chunk
        assert plan.added_time_s == added[chunk]
        if chunk:
            assert "estimated faster" in plan.graph_rewrites[0]
        for g, want in zip(got, eager):
            torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-6)
        model.zero_grad(set_to_none=True)  # as planned: the step starts without gradients
        measured = memcompile.measure_peak(lambda: compiled(ids).backward(), live_at_start=[model, ids])
        assert measured.peak_bytes <= budget
        chose.add(chunk)
    torch.compiler.reset()
    assert chose == {False, True}  # the budgets above exercise both outcomes


@pytest.mark.parametrize("value", ["yes", 1, None, "always"])
def test_chunk_loss_option_is_validated(value) -> None:
    with pytest.raises(ValueError, match="chunk_loss="):
        memcompile.budget("1GB", chunk_loss=value)


@pytest.mark.inductor
def test_inductor_meets_a_budget_only_the_chunked_head_fits() -> None:
    model, ids = _head_bound_lm()
    whole_floor, _ = budget_range(model, ids, chunk_loss=False, codegen="inductor")
    chunked_floor, _ = budget_range(model, ids, chunk_loss=True, codegen="inductor")
    assert chunked_floor < whole_floor
    budget = (chunked_floor + whole_floor) // 2
    params = list(model.parameters())
    eager = grads(params, lambda: model(ids))
    backend, compiled = compile_under(model, budget, codegen="inductor")
    got = grads(params, lambda: compiled(ids))
    for g, want in zip(got, eager):
        torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-6)
    measured = memcompile.measure_peak(lambda: compiled(ids).backward(), live_at_start=[model, ids])
    assert backend.plans[-1].graph_rewrites
    assert measured.peak_bytes <= budget


@settings(max_examples=15, deadline=None)
@given(tokens=st.integers(16, 600), hidden=st.sampled_from([8, 24, 64]), vocab=st.integers(50, 1500),
       rows=st.integers(8, 128), bias=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 2**16))
def test_op_scratch_is_what_the_allocator_sees(tokens, hidden, vocab, rows, bias, dtype, seed) -> None:
    # What the check charges while the ops run (loss_ops.workspace_bytes), against the allocator's
    # events: never less; in float32 at most 8 KiB more (small index and mask tensors that do not
    # all coexist), in bf16 an over-count.
    torch.manual_seed(seed)
    h, weight = torch.randn(tokens, hidden, dtype=dtype), torch.randn(vocab, hidden, dtype=dtype)
    b = torch.randn(vocab, dtype=dtype) if bias else None
    target = torch.randint(0, vocab, (tokens,))
    target[::3] = -100
    live = [h, weight, target] + ([b] if bias else [])
    measured = memcompile.measure_peak(
        lambda: loss_ops.chunked_linear_cross_entropy(h, weight, b, target, -100, rows), live_at_start=live)
    outputs = sum(t.numel() * t.element_size() for t in measured.result)
    charged = loss_ops.workspace_bytes(loss_ops.FORWARD, (h, weight, b, target, -100, rows))
    scratch = measured.rise_bytes - outputs
    assert charged >= scratch
    if dtype == torch.float32:
        assert charged - scratch <= 8192


def test_a_head_under_autocast_computes_as_autocast_does() -> None:
    # float32 weights, bf16 matmul: the rewrite casts the op's inputs as autocast casts F.linear's
    torch.manual_seed(0)
    model = TinyLM(vocab=512, hidden=16, depth=1, bias=True, upcast=True, reduction="mean", ignore_index=-100)
    ids = torch.randint(0, 512, (2, 64))

    def step(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(x)

    (head,) = find_loss_heads(_captured_graph(step, ids).graph)
    assert head.cast_to == torch.bfloat16
    params = list(model.parameters())
    eager = grads(params, lambda: step(ids))
    torch._dynamo.reset()
    compiled = torch.compile(step, backend=lambda g, ex: chunk_loss_heads(g)[0].forward)
    chunked = grads(params, lambda: compiled(ids))
    assert all(g.dtype == torch.float32 for g in chunked)
    torch.testing.assert_close(compiled(ids), step(ids), rtol=1e-2, atol=1e-2)
    for got, want in zip(chunked, eager):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_the_backward_only_scales_the_gradients_the_forward_computed() -> None:
    """The op computes the summed loss's gradients chunk by chunk in the forward, where each
    chunk's logits exist; the backward multiplies by the incoming gradient (no head matmul: the
    old backward recomputed every chunk's logits, 12-18% of a GPT-2 small step). The flop
    formula charges the forward its three head matmuls, what a recomputation of it costs."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    tokens, hidden, vocab = 96, 16, 300
    h = torch.randn(tokens, hidden, requires_grad=True)
    weight, bias = torch.randn(vocab, hidden, requires_grad=True), torch.randn(vocab, requires_grad=True)
    target = torch.randint(0, vocab, (tokens,))
    target[::4] = -100
    with FlopCounterMode(display=False) as forward:
        total = loss_ops.chunked_linear_cross_entropy(h, weight, bias, target, -100, 32)[0]
    assert forward.get_total_flops() == 6 * tokens * hidden * vocab
    with FlopCounterMode(display=False) as backward:
        (0.5 * total).backward()
    assert backward.get_total_flops() == 0
    got = [p.grad for p in (h, weight, bias)]
    for p in (h, weight, bias):
        p.grad = None
    (0.5 * F.cross_entropy(F.linear(h, weight, bias), target, reduction="sum")).backward()
    for g, p in zip(got, (h, weight, bias)):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-6)
