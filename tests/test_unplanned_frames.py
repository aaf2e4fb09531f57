"""A frame Dynamo gives up on runs eagerly, outside every plan: memcompile says so before it runs
(UnplannedFrameError), or, opted in, warns and lets it run (on_unplanned="warn")."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import memcompile


class BreakInLoop(nn.Module):
    """Issue 31's model: a graph break inside the loop makes Dynamo skip the whole frame."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(6))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = F.dropout(F.gelu(layer(x)), 0.1, self.training)
            if i == 2:
                torch._dynamo.graph_break()
        return x.pow(2).mean()


@pytest.mark.parametrize("codegen", ["inductor", "aot_eager"])
def test_a_skipped_frame_raises_at_every_call_before_it_runs(codegen):
    torch.manual_seed(0)
    model, x = BreakInLoop(), torch.randn(128, 64)
    backend = memcompile.budget(1000, codegen=codegen)
    compiled = torch.compile(model, backend=backend)
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        with pytest.raises(memcompile.UnplannedFrameError, match="graph break in loop") as info:
            compiled(x)
        assert all(p.grad is None for p in model.parameters())  # nothing ran
    message = str(info.value)
    assert "forward" in message and "test_unplanned_frames.py" in message and 'on_unplanned="warn"' in message
    assert info.value.frame.name == "forward" and backend.errors[-1] is info.value
    assert backend.plans == []
    torch.compiler.reset()


def test_on_unplanned_warn_runs_the_frame_eagerly_with_one_warning():
    torch.manual_seed(0)
    model, x = BreakInLoop(), torch.randn(128, 64)
    backend = memcompile.budget(1000, on_unplanned="warn")
    compiled = torch.compile(model, backend=backend)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            compiled(x).backward()
    unplanned = [w for w in caught if issubclass(w.category, memcompile.UnplannedFrameWarning)]
    assert len(unplanned) == 1 and "outside every memcompile plan" in str(unplanned[0].message)
    assert [f.name for f in backend.eager_frames] == ["forward"]
    assert all(p.grad is not None for p in model.parameters())  # it trained, eagerly
    torch.compiler.reset()


def test_the_backend_by_name_raises_too():
    model, x = BreakInLoop(), torch.randn(128, 64)
    compiled = torch.compile(model, backend="memcompile", options={"budget": "1GB"})
    with pytest.raises(memcompile.UnplannedFrameError):
        compiled(x)
    torch.compiler.reset()


def test_frames_without_training_work_are_not_flagged():
    """No gradients (no_grad, or nothing that requires grad): a skipped frame saves nothing for
    a backward, so it runs as Dynamo runs it; frames of other backends are never flagged."""
    model, x = BreakInLoop(), torch.randn(128, 64)
    backend = memcompile.budget(1000, on_unplanned="warn")  # a flagged frame would be listed, not raised
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
    assert backend.eager_frames == []
    torch.compiler.reset()

    def loop(x):
        for i in range(3):
            x = x * 2
            if i == 1:
                torch._dynamo.graph_break()
        return x

    backend = memcompile.budget(1000, on_unplanned="warn")
    y = torch.randn(8)
    torch.testing.assert_close(torch.compile(loop, backend=backend)(y), y * 8)  # no tensor requires grad
    assert backend.eager_frames == []
    torch.compiler.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.compile(model, backend="aot_eager")(x).backward()  # another backend's frame runs as before
    assert not [w for w in caught if issubclass(w.category, memcompile.UnplannedFrameWarning)]
    assert all(p.grad is not None for p in model.parameters())
    torch.compiler.reset()


def test_the_recompile_limit_sends_frames_to_eager_and_that_raises():
    """Past torch._dynamo.config.recompile_limit a frame runs eagerly for new guards."""
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
    backend = memcompile.budget("1GB", codegen="aot_eager")
    compiled = torch.compile(model, backend=backend, dynamic=False)
    with torch._dynamo.config.patch(recompile_limit=2):
        for rows in (8, 9):
            compiled(torch.randn(rows, 16)).sum().backward()
        with pytest.raises(memcompile.UnplannedFrameError, match="recompile limit"):
            compiled(torch.randn(10, 16))
    torch.compiler.reset()


def test_fullgraph_raises_dynamos_own_error_not_ours():
    model, x = BreakInLoop(), torch.randn(128, 64)
    compiled = torch.compile(model, backend=memcompile.budget("1GB"), fullgraph=True)
    with pytest.raises(Exception) as info:
        compiled(x)
    assert not isinstance(info.value, memcompile.UnplannedFrameError)
    torch.compiler.reset()


def test_options_are_validated():
    for name in ("on_unplanned", "on_first_step_overrun"):
        with pytest.raises(ValueError, match=name):
            memcompile.budget("1GB", **{name: "ignore"})
        assert getattr(memcompile.budget("1GB", **{name: "warn"}).options, name) == "warn"
