"""`torch.compile(model, backend="memcompile", options=...)`: the entry point, options, environment."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch

import memcompile
from memcompile import registration
from memcompile.options import make_options
from models import WithLoss, build

FAST = {"codegen": "aot_eager", "time_limit_s": 2}


def _grads(model, x, fn):
    model.zero_grad(set_to_none=True)
    x.grad = None
    fn(x).backward()
    return [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]


def test_the_name_is_registered_through_the_entry_point():
    names = importlib.metadata.entry_points(group="torch_dynamo_backends").names
    assert "memcompile" in names
    assert "memcompile" in torch._dynamo.list_backends()
    assert torch._dynamo.lookup_backend("memcompile") is registration.compile_by_name


def test_options_map_onto_budget_and_gradients_match_eager():
    model, x = build("mlp", 32, 3, 64)
    expected = _grads(model, x, WithLoss(model))
    options = {"budget": "1.5MiB", "reserve": 1000, **FAST}
    compiled = torch.compile(WithLoss(model), backend="memcompile", options=dict(options))
    got = _grads(model, x, compiled)
    for a, b in zip(expected, got):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    backend = memcompile.named_backend(options)
    assert backend is memcompile.last_named_backend()
    assert backend.options == make_options(int(1.5 * 2**20), reserve=1000, **FAST)
    assert [p.budget_bytes for p in backend.plans] == [int(1.5 * 2**20)]
    assert backend.plans[0].predicted_peak_bytes <= int(1.5 * 2**20) - 1000
    assert "graph_0" in memcompile.dump(backend)


def test_equal_options_share_one_backend_across_compile_calls():
    a, xa = build("mlp", 16, 1, 8, seed=1)
    b, xb = build("mlp", 16, 2, 8, seed=2)
    options = {"budget": 10**9, **FAST}
    torch.compile(WithLoss(a), backend="memcompile", options=dict(options))(xa).backward()
    torch.compile(WithLoss(b), backend="memcompile", options=dict(options))(xb).backward()
    assert len(memcompile.named_backend(options).plans) == 2
    assert memcompile.named_backend({**options, "seed": 1}) is not memcompile.named_backend(options)


def test_budget_from_the_environment_when_only_the_name_is_passed(monkeypatch):
    monkeypatch.setenv("MEMCOMPILE_BUDGET", "3GB")
    monkeypatch.setenv("MEMCOMPILE_RESERVE", "1GB")
    model, x = build("mlp", 16, 1, 8)
    expected = _grads(model, x, WithLoss(model))
    # The name alone (as trainers pass it) would compile with Inductor: check what it parses to, then
    # compile with only the fast codegen options, budget and reserve from the environment.
    assert registration.options_from(None) == make_options(3 * 10**9, reserve=10**9)
    got = _grads(model, x, torch.compile(WithLoss(model), backend="memcompile", options=dict(FAST)))
    for a, b in zip(expected, got):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    used = memcompile.last_named_backend().options
    assert (used.budget_bytes, used.reserve_bytes) == (3 * 10**9, 10**9)
    # An explicit option wins over the environment.
    assert registration.options_from({"budget": "2GB"}).budget_bytes == 2 * 10**9
    assert registration.options_from({"budget": "2GB", "reserve": 5}).reserve_bytes == 5


def test_missing_budget_is_a_typed_error_saying_what_to_do(monkeypatch):
    monkeypatch.delenv("MEMCOMPILE_BUDGET", raising=False)
    model, x = build("mlp", 16, 1, 8)
    compiled = torch.compile(WithLoss(model), backend="memcompile")
    with pytest.raises(memcompile.MissingBudgetError) as info:
        compiled(x)
    assert isinstance(info.value, TypeError)
    assert 'options={"budget"' in str(info.value) and "MEMCOMPILE_BUDGET" in str(info.value)


@pytest.mark.parametrize("options, error, names", [
    ({"budget": "lots"}, ValueError, 'options["budget"]'),
    ({"budget": "1GB", "reserve": "2GB"}, ValueError, "reserve"),
    ({"budget": "1GB", "bugdet": 1}, TypeError, "bugdet"),
    ({"budget": "1GB", "codegen": "tvm"}, ValueError, "codegen"),
])
def test_bad_options_name_the_option(options, error, names):
    with pytest.raises(error, match=names.replace("[", r"\[").replace("]", r"\]")):
        registration.options_from(options, environ={})


def test_bad_environment_budget_names_the_variable():
    with pytest.raises(ValueError, match="MEMCOMPILE_BUDGET"):
        registration.options_from(None, environ={"MEMCOMPILE_BUDGET": "twenty gigs"})


def test_bad_options_raise_our_type_from_the_compiled_model():
    model, x = build("mlp", 16, 1, 8)
    compiled = torch.compile(WithLoss(model), backend="memcompile", options={"budget": "1GB", "bugdet": 1})
    with pytest.raises(TypeError, match="bugdet"):
        compiled(x)


def test_inductor_modes_are_refused_with_a_typed_error(monkeypatch):
    monkeypatch.setenv("MEMCOMPILE_BUDGET", "1GB")
    model, x = build("mlp", 16, 1, 8)
    compiled = torch.compile(WithLoss(model), backend="memcompile", mode="max-autotune")
    with pytest.raises(memcompile.UnsupportedModeError, match="max-autotune"):
        compiled(x)


def test_compiler_reset_forgets_the_named_backends():
    model, x = build("mlp", 16, 1, 8)
    options = {"budget": "2GB", **FAST}
    torch.compile(WithLoss(model), backend="memcompile", options=dict(options))(x).backward()
    before = memcompile.named_backend(options)
    assert before.plans and memcompile.last_named_backend() is before
    torch.compiler.reset()
    assert memcompile.last_named_backend() is None
    assert memcompile.named_backend(options) is not before and not memcompile.named_backend(options).plans
