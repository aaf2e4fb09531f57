"""User annotations: torch.utils.checkpoint regions and selective-checkpoint policies.

They reach the joint graph as `node.meta["recompute"]` (a CheckpointPolicy; plain
`checkpoint()` tags every op of the region PREFER_RECOMPUTE). memcompile treats MUST_SAVE and
MUST_RECOMPUTE as constraints and leaves PREFER_* to the budget (the solver already picks the
fastest plan that fits).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import memcompile
from budget_helpers import assert_within_budget, budget_range, compile_under, grads, run_step, spy_analyses
from memcompile.passes.graph_facts import checkpoint_policy


def must_policy(ctx, op, *args, **kwargs):
    if op is torch.ops.aten.sin.default:
        return CheckpointPolicy.MUST_SAVE
    if op is torch.ops.aten.gelu.default:
        return CheckpointPolicy.MUST_RECOMPUTE
    return CheckpointPolicy.PREFER_RECOMPUTE


def save_all_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE


class Blocks(nn.Module):
    """MLP blocks, each in a checkpoint region (plain, or with a selective policy). Torch makes
    the outputs of consecutive regions MUST_SAVE (cleanup_recompute_tags), as in eager."""

    def __init__(self, policy=None, d: int = 32, depth: int = 3, p: float = 0.0):
        super().__init__()
        self.policy, self.p = policy, p
        self.blocks = nn.ModuleList(nn.ModuleList([nn.Linear(d, 2 * d), nn.Linear(2 * d, d)]) for _ in range(depth))

    def block(self, x, up, down):
        h = F.gelu(up(x))
        if self.p:
            h = F.dropout(h, self.p, training=True)
        h = h * torch.sigmoid(h)
        return torch.tanh(x + down(h.sin()))

    def forward(self, x):
        for up, down in self.blocks:
            if self.policy is None:
                x = checkpoint(self.block, x, up, down, use_reentrant=False)
            else:
                context = functools.partial(create_selective_checkpoint_contexts, self.policy)
                x = checkpoint(self.block, x, up, down, use_reentrant=False, context_fn=context)
        return x.pow(2).mean()


def _data(batch=128):
    torch.manual_seed(0)
    return torch.randn(batch, 32, requires_grad=True)


def test_must_policies_are_constraints_at_every_budget(monkeypatch):
    model, x = Blocks(must_policy), _data()
    params = list(model.parameters()) + [x]
    eager = grads(params, lambda: model(x))
    analyses = spy_analyses(monkeypatch)
    low, high = budget_range(model, x)
    assert low < high
    for budget in (high, (low + high) // 2, low):
        step = run_step(model, x, params, budget)
        analysis = analyses[-1]
        assert_within_budget(step, budget)
        for a, b in zip(eager, step.grads):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
        tags = {n.name: checkpoint_policy(n) for n in analysis.candidates}
        for i, node in enumerate(analysis.candidates):
            if tags[node.name] == "MUST_SAVE":
                assert not analysis.problem.can_recompute[i]
            if tags[node.name] == "MUST_RECOMPUTE":
                assert not analysis.problem.can_keep[i]
        choices = {d.name: d.choice for d in step.plan.decisions}
        must_save = [n for n, t in tags.items() if t == "MUST_SAVE" and n in choices]
        must_recompute = [n for n, t in tags.items() if t == "MUST_RECOMPUTE" and n in choices]
        assert must_save and must_recompute
        assert all(choices[n] == "keep" for n in must_save)
        assert all(choices[n] == "recompute" for n in must_recompute)
        assert any("MUST_RECOMPUTE" in d.reason for d in step.plan.decisions if d.choice == "recompute")


def test_plain_checkpoint_regions_are_preferences_the_budget_decides():
    """Every op of a plain checkpoint region is PREFER_RECOMPUTE: with room, memcompile keeps
    (faster); under a tight budget it recomputes; gradients are eager's either way."""
    model, x = Blocks(None), _data()
    params = list(model.parameters()) + [x]
    eager = grads(params, lambda: model(x))
    low, high = budget_range(model, x)
    roomy = run_step(model, x, params, high)
    tight = run_step(model, x, params, low)
    assert roomy.plan.choices().get("recompute", 0) == 0
    assert tight.plan.choices().get("recompute", 0) > 0
    for step, budget in ((roomy, high), (tight, low)):
        assert_within_budget(step, budget)
        for a, b in zip(eager, step.grads):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


def test_must_save_that_makes_the_budget_infeasible_says_so():
    x = _data()
    free_low, _ = budget_range(Blocks(None), x)
    pinned = Blocks(save_all_policy)
    pinned_low, _ = budget_range(pinned, x)
    assert pinned_low > free_low
    _, compiled = compile_under(pinned, free_low)
    with pytest.raises(memcompile.InfeasibleBudgetError) as info:
        compiled(x)
    assert info.value.min_feasible_bytes > free_low
    assert "MUST_SAVE" in str(info.value)


def test_random_ops_in_checkpoint_regions_keep_their_draw():
    """Dropout inside checkpoint regions: PyTorch replays the RNG state to recompute it; we keep
    the draw instead (never recompute a random op). Same seed, same gradients, bit for bit,
    as PyTorch's own partition of the same graph."""
    model, x = Blocks(None, p=0.3), _data()
    params = list(model.parameters()) + [x]
    stock = torch.compile(model, backend="aot_eager_decomp_partition")
    expected = grads(params, lambda: stock(x), seed=5)
    torch.compiler.reset()
    low, high = budget_range(model, x)
    for budget in (low, (low + high) // 2):
        step = run_step(model, x, params, budget, seed=5)
        assert_within_budget(step, budget)
        for a, b in zip(expected, step.grads):
            torch.testing.assert_close(b, a, rtol=0, atol=0)
