"""passes/tied_gradients.py: a tied weight's embedding gradient scattered into its head gradient
(the same sum, one vocabulary-sized buffer fewer)."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from hypothesis import given, settings
from hypothesis import strategies as st

import memcompile
from budget_helpers import grads
from memcompile.passes.tied_gradients import accumulate_tied_embedding_gradients

aten = torch.ops.aten


def _tied_sum_graph(head_grad: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor,
                    mask: torch.Tensor) -> fx.GraphModule:
    """head_grad + (rows scattered into zeros at ids, masked), as Inductor's decomposition writes
    it, each node with its value (what a traced joint graph carries)."""
    graph = fx.Graph()
    placeholders = [graph.placeholder(n) for n in ("head_grad", "ids", "rows", "mask")]
    for node, value in zip(placeholders, (head_grad, ids, rows, mask)):
        node.meta["val"] = value
    _, ids_node, rows_node, mask_node = placeholders
    zeros = graph.call_function(aten.full.default, (list(head_grad.shape), 0), {"dtype": head_grad.dtype})
    scattered = graph.call_function(aten._unsafe_masked_index_put_accumulate.default,
                                    (zeros, mask_node, [ids_node], rows_node))
    graph.output(graph.call_function(aten.add.Tensor, (placeholders[0], scattered)))
    for node in graph.nodes:
        if node.op == "call_function":
            args = fx.node.map_arg(node.args, lambda n: n.meta["val"])
            node.meta["val"] = node.target(*args, **node.kwargs)
    return fx.GraphModule(torch.nn.Module(), graph)


def _example(vocab: int, width: int, tokens: int, padding: int, dtype: torch.dtype, seed: int):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (tokens,), generator=generator)
    return (torch.randn(vocab, width, generator=generator).to(dtype), ids,
            torch.randn(tokens, width, generator=generator).to(dtype), (ids != padding).unsqueeze(-1))


@settings(max_examples=25, deadline=None)
@given(vocab=st.integers(2, 64), width=st.integers(1, 16), tokens=st.integers(1, 40),
       padding=st.integers(-1, 3), dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
       seed=st.integers(0, 2**16))
def test_the_scatter_into_the_head_gradient_is_the_same_sum(vocab, width, tokens, padding, dtype, seed) -> None:
    example = _example(vocab, width, tokens, padding, dtype, seed)
    gm = _tied_sum_graph(*example)
    want = gm(*example)
    rewritten = accumulate_tied_embedding_gradients(gm)
    targets = [n.target for n in rewritten.graph.nodes if n.op == "call_function"]
    assert targets == [aten._unsafe_masked_index_put_accumulate.default]  # no zeros, no add
    got = rewritten(*example)
    if dtype != torch.bfloat16:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        return
    # In bf16 each accumulation rounds, in another order in each graph, and terms of one row may
    # cancel (2 rows, 34 tokens: 0.043 apart where the sum was 0.035): both within the rounding of
    # the sum of the terms' magnitudes of the exact (float64) sum.
    exact_inputs = tuple(t.double() if t.is_floating_point() else t for t in example)
    exact = _tied_sum_graph(*exact_inputs)(*exact_inputs)
    magnitudes = (exact_inputs[0].abs(), exact_inputs[1], exact_inputs[2].abs(), exact_inputs[3])
    bound = (tokens + 2) * 2.0**-8 * _tied_sum_graph(*magnitudes)(*magnitudes)
    assert ((got.double() - exact).abs() <= bound).all() and ((want.double() - exact).abs() <= bound).all()


def test_a_sum_the_scatter_does_not_feed_alone_is_left_alone() -> None:
    gm = _tied_sum_graph(*_example(8, 4, 5, -1, torch.float32, 0))
    zeros = next(n for n in gm.graph.nodes if n.target is aten.full.default)
    with gm.graph.inserting_before(next(n for n in gm.graph.nodes if n.op == "output")):
        extra = gm.graph.call_function(aten.sum.default, (zeros,))  # the zeros read elsewhere too
    output = next(n for n in gm.graph.nodes if n.op == "output")
    output.args = ((output.args[0], extra),)
    gm.recompile()
    before = [n.target for n in gm.graph.nodes]
    assert [n.target for n in accumulate_tied_embedding_gradients(gm).graph.nodes] == before


@pytest.mark.inductor
def test_a_tied_gpt_style_models_floor_holds_one_vocabulary_sized_gradient() -> None:
    """GPT style, tied embeddings, under Inductor: at the floor the step holds its parameters,
    their gradients and the returned logits, and little else; the floor is measured, the
    gradients are eager's."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from gpt_style import GPT, GPTConfig

    torch.manual_seed(0)
    config = GPTConfig(n_layer=1, n_head=2, n_embd=32, vocab_size=4096, block_size=64)
    model = GPT(config)
    idx = torch.randint(0, config.vocab_size, (2, 64))
    targets = torch.randint(0, config.vocab_size, (2, 64))
    params = list(model.parameters())
    eager = grads(params, lambda: model(idx, targets)[1])
    backend = memcompile.budget(1, time_limit_s=5, plan_store=False)
    compiled = torch.compile(model, backend=backend)
    try:
        compiled(idx, targets)
        raise AssertionError("a 1-byte budget fitted")
    except memcompile.InfeasibleBudgetError as error:
        floor = error.min_feasible_bytes
    torch.compiler.reset()
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    logits_bytes = 2 * 64 * config.vocab_size * 4
    vocab_grad = config.vocab_size * config.n_embd * 4
    # parameters and their gradients, the logits the caller holds; the rest is under one
    # vocabulary-sized gradient (before: the head's and the embedding's, both whole)
    assert floor < 2 * param_bytes + logits_bytes + vocab_grad
    backend = memcompile.budget(floor, time_limit_s=5, plan_store=False)
    compiled = torch.compile(model, backend=backend)
    got = grads(params, lambda: compiled(idx, targets)[1])
    for g, want in zip(got, eager):
        torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-5)

    def step():
        logits, loss = compiled(idx, targets)
        loss.backward()
        return logits

    measured = memcompile.measure_peak(step, live_at_start=[model, idx, targets])
    assert measured.peak_bytes <= floor
    torch.compiler.reset()
