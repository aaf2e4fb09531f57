"""Random ops (dropout, noise, random permutations) under tight budgets: never recomputed (that
would draw new numbers), everything downstream of them still recomputable, gradients equal
those of the same seed.

Two references, because the compiled graph's dropout is not eager's: Inductor's decomposition
table (which codegen="aot_eager" uses too) draws a dropout mask as `rand(...) < p` while eager
draws it with `bernoulli_`. So (1) against PyTorch's own partition of the same decomposed graph
(`aot_eager_decomp_partition`) gradients must be bit-identical; (2) with Inductor's
`fallback_random=True` (eager's random ops kept), against eager PyTorch within float32 rounding
(rtol 1e-5, atol 1e-6; a different mask changes them by orders of magnitude more).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

import memcompile
from budget_helpers import assert_within_budget, budget_range, grads, run_step, spy_analyses
from memcompile.passes.graph_facts import is_random_op
import step_sweep


class DropoutMLP(nn.Module):
    def __init__(self, p: float, d: int = 32, depth: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(d, 2 * d), nn.Dropout(p), nn.GELU(), nn.Linear(2 * d, d), nn.Dropout(p))
            for _ in range(depth))

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(x + block(x))
        return x.pow(2).mean()


class DropoutAttention(nn.Module):
    def __init__(self, p: float, d: int = 32, heads: int = 2):
        super().__init__()
        self.p, self.heads = p, heads
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Dropout(p), nn.Linear(2 * d, d))

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p)
        x = x + F.dropout(self.proj(att.transpose(1, 2).reshape(b, s, d)), self.p)
        return (x + self.mlp(x)).pow(2).mean()


class NoisyConv(nn.Module):
    """Channel dropout (bernoulli on an N x C x 1 x 1 mask) and additive Gaussian noise."""

    def __init__(self, p: float, c: int = 8):
        super().__init__()
        self.p = p
        self.a, self.b = nn.Conv2d(c, c, 3, padding=1), nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        h = F.dropout2d(torch.relu(self.a(x)), self.p, training=True)
        h = torch.sigmoid(self.b(h + 0.1 * torch.randn_like(h)))
        return h.pow(2).mean()


class RandomMix(nn.Module):
    """randperm, rrelu (uniform), alpha dropout and bernoulli sampling in one graph."""

    def __init__(self, p: float, d: int = 32):
        super().__init__()
        self.p = p
        self.a, self.b = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        h = F.rrelu(self.a(x), training=True)
        h = h[torch.randperm(h.shape[0])]
        h = F.alpha_dropout(h, self.p, training=True)
        gate = torch.bernoulli(torch.sigmoid(h).detach())
        return (self.b(torch.tanh(h) * gate)).pow(2).mean()


def build(kind: str, p: float, batch: int):
    """Sizes where activations outweigh parameters, so budgets below the keep-all peak exist."""
    torch.manual_seed(0)
    if kind == "mlp":
        return DropoutMLP(p), torch.randn(64 * batch, 32, requires_grad=True)
    if kind == "attention":
        return DropoutAttention(p), torch.randn(batch, 16, 32, requires_grad=True)
    if kind == "conv":
        return NoisyConv(p), torch.randn(batch, 8, 12, 12, requires_grad=True)
    return RandomMix(p), torch.randn(16 * batch, 32, requires_grad=True)


def stock_grads(model, x, seed):
    """PyTorch's own partition of the same decomposed graph (the same random ops, in order)."""
    compiled = torch.compile(model, backend="aot_eager_decomp_partition")
    try:
        return grads(list(model.parameters()) + [x], lambda: compiled(x), seed)
    finally:
        torch.compiler.reset()


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck),
          phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(kind=st.sampled_from(["mlp", "attention", "conv", "mix"]), p=st.sampled_from([0.1, 0.5, 0.9]),
       batch=st.integers(2, 8), fraction=st.floats(0.0, 1.0), seed=st.integers(0, 2**31 - 1))
def test_random_ops_give_bit_identical_grads_under_any_budget(kind, p, batch, fraction, seed):
    torch.compiler.reset()
    model, x = build(kind, p, batch)
    params = list(model.parameters()) + [x]
    expected = stock_grads(model, x, seed)
    low, high = budget_range(model, x)
    budget = int(low + fraction * max(0, high - low))
    step = run_step(model, x, params, budget, seed=seed)
    assert_within_budget(step, budget)
    for plan_decision in step.plan.decisions:
        if plan_decision.choice == "recompute":
            assert "rand" not in plan_decision.op and "bernoulli" not in plan_decision.op
    for a, b in zip(expected, step.grads):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["mlp", "attention"])
def test_values_downstream_of_random_ops_are_recomputed_from_the_kept_draw(kind, monkeypatch):
    model, x = build(kind, 0.5, 8)
    params = list(model.parameters()) + [x]
    expected = stock_grads(model, x, seed=3)
    low, _high = budget_range(model, x)
    analyses = spy_analyses(monkeypatch)
    step = run_step(model, x, params, low, seed=3)
    analysis = analyses[-1]
    random_nodes = {n for n in analysis.forward_nodes if is_random_op(n)}
    assert random_nodes, "the model has random ops"
    downstream, frontier = set(), list(random_nodes)
    while frontier:
        for user in frontier.pop().users:
            if user not in downstream:
                downstream.add(user)
                frontier.append(user)
    recomputed = {d.name for d in step.plan.decisions if d.choice == "recompute"}
    by_name = {n.name: n for n in analysis.candidates}
    assert not recomputed & {n.name for n in random_nodes}
    assert any(by_name[name] in downstream for name in recomputed), (
        f"nothing downstream of {sorted(n.name for n in random_nodes)} recomputed: {sorted(recomputed)}")
    for i, node in enumerate(analysis.candidates):
        if node in random_nodes:
            assert not analysis.problem.can_recompute[i]
            assert "random op" in analysis.cannot_recompute_reason[i]
    for a, b in zip(expected, step.grads):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


@pytest.mark.parametrize("kind, p", [("mlp", 0.3), ("conv", 0.5), ("attention", 0.2)])
def test_grads_equal_eager_with_the_same_seed(kind, p):
    """With eager's random ops (fallback_random), the compiled step under its smallest budget
    draws the same numbers as eager PyTorch from the same seed."""
    import torch._inductor.config as inductor_config  # tests may use private torch APIs

    model, x = build(kind, p, 4)
    params = list(model.parameters()) + [x]
    eager = grads(params, lambda: model(x), seed=11)
    other_seed = grads(params, lambda: model(x), seed=12)
    with inductor_config.patch(fallback_random=True):
        low, high = budget_range(model, x)
        for budget in (low, (low + high) // 2):
            step = run_step(model, x, params, budget, seed=11)
            assert_within_budget(step, budget)
            for a, b in zip(eager, step.grads):
                torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    # the comparison can fail: another mask moves the gradients far outside that tolerance
    assert any(not torch.allclose(a, c, rtol=1e-3, atol=1e-4) for a, c in zip(eager, other_seed))


# Every aten operator that draws from the generator (torch 2.13 docs: random sampling, dropout,
# randomized activations). AOTAutograd's CPU graphs contain these after decomposition.
RANDOM_PACKETS = [
    "rand", "rand_like", "randn", "randn_like", "randint", "randint_like", "randperm", "bernoulli",
    "native_dropout", "dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout", "normal",
    "uniform", "exponential", "geometric", "cauchy", "log_normal", "multinomial", "poisson", "rrelu",
    "rrelu_with_noise", "rrelu_with_noise_functional", "random", "_fused_dropout", "_standard_gamma",
    "_sample_dirichlet", "binomial",
]


def _call_node(op) -> torch.fx.Node:
    graph = torch.fx.Graph()
    return graph.call_function(op, ())


def test_every_random_aten_overload_is_recognised():
    missing = []
    for name in RANDOM_PACKETS:
        packet = getattr(torch.ops.aten, name)
        for overload in packet.overloads():
            if not is_random_op(_call_node(getattr(packet, overload))):
                missing.append(f"aten.{name}.{overload}")
    assert not missing, missing
    # and the deterministic neighbours are not
    for op in (torch.ops.aten.mul.Tensor, torch.ops.aten.gt.Scalar, torch.ops.aten.addmm.default,
               torch.ops.aten.empty_like.default, torch.ops.aten.index.Tensor):
        assert not is_random_op(_call_node(op))


def test_random_ops_emitted_for_cpu_training_graphs_are_all_recognised(monkeypatch):
    """What AOTAutograd emits on CPU for each model's random ops is what `is_random_op` bans:
    the joint graphs' random nodes are exactly the nodes of the known random operators."""
    known = {getattr(getattr(torch.ops.aten, name), o) for name in RANDOM_PACKETS
             for o in getattr(torch.ops.aten, name).overloads()}
    analyses = spy_analyses(monkeypatch)
    emitted = set()
    for kind in ("mlp", "conv", "mix"):
        model, x = build(kind, 0.5, 4)
        torch.compile(model, backend=memcompile.budget("1GB", codegen="aot_eager"))(x).backward()
        torch.compiler.reset()
        for node in analyses[-1].forward_nodes:
            if node.op == "call_function" and node.target in known:
                emitted.add(str(node.target))
                assert is_random_op(node)
            elif is_random_op(node):
                raise AssertionError(f"{node.target} banned as random but not a known random op")
    # decomposed dropout draws rand; noise randn; the mix randperm, uniform (rrelu) and bernoulli
    assert {"aten.rand.default", "aten.randn.default", "aten.randperm.default", "aten.bernoulli.p"} <= emitted


def test_attention_without_dropout_may_be_recomputed():
    attention = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default

    def f(q, k, v):
        return attention(q, k, v, 0.0, True), attention(q, k, v, 0.1, True), torch.ops.aten.rand_like.default(q)

    graph = torch.fx.symbolic_trace(f).graph
    calls = [n for n in graph.nodes if n.op == "call_function" and n.target is not getattr]
    by_target = [(str(n.target), n.args[3] if len(n.args) > 3 else None, is_random_op(n)) for n in calls]
    assert (str(attention), 0.0, False) in by_target
    assert (str(attention), 0.1, True) in by_target
    assert any("rand_like" in t and random for t, _, random in by_target)



@pytest.mark.parametrize("codegen", ["aot_eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_planning_mid_step_does_not_move_the_random_stream(codegen):
    # The same seed before every step: every step draws the same masks, including the second,
    # in which memcompile plans the whole step (timing ops and checking plans) and compiles its
    # two regions again, mid-step.
    case = step_sweep.Case(kind="mlp", depth=2, width=16, batch=64, dropout=0.1, autocast=False, checkpoint="none",
                           breaks=(0,), break_in_loop=False, budget_fraction=1.0, seed=37703)
    model, x = step_sweep.build(case)
    params = list(model.parameters()) + [x]
    backend = memcompile.budget(10**12, codegen=codegen)  # any budget: the first step runs least peaks
    compiled = torch.compile(model, backend=backend)
    first = grads(params, lambda: compiled(x), seed=1)
    compiles = backend.compiles
    for _ in range(2):
        again = grads(params, lambda: compiled(x), seed=1)
        for a, b in zip(again, first):
            assert torch.equal(a, b)
    assert backend.compiles > compiles, "the second step compiles the step plan's variants (what this tests)"
