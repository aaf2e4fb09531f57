"""Bad input and faults: typed errors naming the argument, an infeasible budget's typed error,
solver and planner failures degrading to a valid plan, ops the passes do not know."""

from __future__ import annotations

import logging
import math
import re

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings, strategies as st

import memcompile
from budget_helpers import assert_within_budget, budget_range, compile_under, grads, run_step
from memcompile.options import parse_bytes
from memcompile.plan import StatusKind
from models import WithLoss, build


# -- the public API's arguments ----------------------------------------------------------------

def _budget(**kwargs):
    return memcompile.budget("1GB", **kwargs)


@pytest.mark.parametrize("call, error, names", [
    (lambda: memcompile.budget(None), ValueError, "limit"),
    (lambda: memcompile.budget([1]), ValueError, "limit"),
    (lambda: memcompile.budget("12 parsecs"), ValueError, "limit"),
    (lambda: memcompile.budget(-3), ValueError, "limit"),
    (lambda: _budget(reserve="2GB"), ValueError, "reserve"),
    (lambda: _budget(reserve="x"), ValueError, "reserve"),
    (lambda: _budget(time_limit_s=0), ValueError, "time_limit_s"),
    (lambda: _budget(time_limit_s=math.inf), ValueError, "time_limit_s"),
    (lambda: _budget(time_limit_s="5"), ValueError, "time_limit_s"),
    (lambda: _budget(codegen="tvm"), ValueError, "codegen"),
    (lambda: _budget(codegen=None), ValueError, "codegen"),
    (lambda: _budget(device="tpu"), ValueError, "device"),
    (lambda: _budget(device=0), ValueError, "device"),
    (lambda: _budget(workers=0), ValueError, "workers"),
    (lambda: _budget(workers=1.5), ValueError, "workers"),
    (lambda: _budget(seed=-1), ValueError, "seed"),
    (lambda: _budget(seed=True), ValueError, "seed"),
    (lambda: _budget(solver_time=3), TypeError, "solver_time"),
    (lambda: memcompile.dump(3), TypeError, "Backend"),
    (lambda: memcompile.dump([1, 2]), TypeError, "Backend"),
    (lambda: memcompile.dump(_budget(), format="pdf"), ValueError, "format"),
    (lambda: memcompile.dump(_budget(), format=["text"]), ValueError, "format"),
    (lambda: memcompile.dump(_budget(), path=3), TypeError, "path"),
    (lambda: memcompile.measure_peak(3), TypeError, "fn"),
    (lambda: memcompile.measure_peak(lambda: 0, device="tpu"), ValueError, "device"),
    (lambda: memcompile.measure_peak(lambda: 0, device=1), ValueError, "device"),
    (lambda: memcompile.measure_peak(lambda: 0, live_at_start=3), TypeError, "live_at_start"),
    (lambda: memcompile.measure_peak(lambda: 0, live_at_start=torch.ones(2)), TypeError, "live_at_start"),
    (lambda: memcompile.measure_peak(lambda: 0, live_at_start=["model"]), TypeError, "live_at_start"),
])
def test_wrong_arguments_name_the_argument_and_what_is_accepted(call, error, names):
    with pytest.raises(error) as info:
        call()
    message = str(info.value)
    assert names in message
    assert re.search(r"expected|accepted|takes|must be|use |pass ", message), message


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message for a machine without CUDA")
def test_measuring_cuda_without_cuda_says_so():
    with pytest.raises(ValueError, match="device='cuda'.*not available"):
        memcompile.measure_peak(lambda: 0, device="cuda")


def test_accepted_arguments_still_work():
    backend = memcompile.budget("2 GiB", reserve=2**20, time_limit_s=0.5, codegen="aot_eager", device="h100",
                                workers=1, seed=3)
    assert backend.options.step_budget_bytes == 2 * 2**30 - 2**20
    assert memcompile.dump(backend, format="json").startswith("{")
    x = torch.ones(4)
    measured = memcompile.measure_peak(lambda: x * 2, live_at_start=(x,), device="cpu")
    assert measured.peak_bytes >= 16


# -- the budget string parser, fuzzed --------------------------------------------------------

UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
         "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def _mixed_case(draw, text):
    return "".join(c.upper() if draw(st.booleans()) else c for c in text)


@st.composite
def size_strings(draw):
    """Valid sizes in every accepted spelling: integers, decimals, exponents, spaces, any case."""
    unit = draw(st.sampled_from(sorted(UNITS)))
    mantissa = draw(st.one_of(
        st.integers(1, 10**9).map(str),
        st.decimals(min_value="0.001", max_value="100000", places=3, allow_nan=False,
                    allow_infinity=False).map(str),
        st.tuples(st.integers(1, 99), st.integers(-2, 6)).map(lambda p: f"{p[0]}e{p[1]}"),
    ))
    space = draw(st.sampled_from(["", " ", "  ", "\t"]))
    lead, trail = draw(st.sampled_from(['', ' '])), draw(st.sampled_from(['', ' ']))
    return f"{lead}{mantissa}{space}{_mixed_case(draw, unit)}{trail}", mantissa, unit


@settings(max_examples=300, deadline=None)
@given(size_strings())
def test_parser_reads_every_accepted_spelling(case):
    text, mantissa, unit = case
    expected = int(float(mantissa) * UNITS[unit])
    if expected <= 0:
        with pytest.raises(ValueError, match="limit"):
            parse_bytes(text)
    else:
        assert parse_bytes(text) == expected


@settings(max_examples=300, deadline=None)
@given(st.one_of(
    st.text(max_size=16),
    st.text(alphabet="0123456789.eE+- kKmMgGtTiIbB", max_size=12),
    st.binary(max_size=8), st.floats(allow_nan=True, allow_infinity=True), st.integers(),
    st.none(), st.booleans(), st.lists(st.integers(), max_size=2), st.complex_numbers(),
))
def test_parser_accepts_or_raises_a_value_error_naming_the_argument(value):
    try:
        result = parse_bytes(value, name="reserve", allow_zero=True)
    except ValueError as error:
        assert "reserve" in str(error) and "expected" in str(error)
    else:
        assert isinstance(result, int) and not isinstance(result, bool) and result >= 0


# -- infeasible budgets, solver and planner faults ---------------------------------------------

def test_infeasible_budget_raises_the_typed_error_with_the_smallest_budget():
    model, x = build("mlp", 32, 3, 64)
    _, compiled = compile_under(WithLoss(model), 1000)
    with pytest.raises(memcompile.InfeasibleBudgetError) as info:
        compiled(x)
    assert info.value.min_feasible_bytes > 1000 and info.value.budget_bytes == 1000
    assert "min_feasible_bytes" in str(info.value)


@pytest.fixture
def attention_case():
    model, x = build("attention", 16, 2, 8)
    step = WithLoss(model)
    params = list(model.parameters()) + [x]
    low, high = budget_range(step, x)
    assert low < high
    return step, x, params, grads(params, lambda: step(x)), (low + high) // 2


def _check(step_result, expected, budget):
    assert_within_budget(step_result, budget)
    for a, b in zip(expected, step_result.grads):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("fault", [OverflowError("coefficient past int64"), MemoryError("solver out of memory"),
                                   RuntimeError("OR-Tools crashed")])
def test_solver_exceptions_fall_back_to_the_greedy_plan(attention_case, monkeypatch, caplog, fault):
    from memcompile import planner

    def broken(*_args, **_kwargs):
        raise fault

    step, x, params, expected, budget = attention_case
    monkeypatch.setattr(planner, "solve_activation_plan", broken)
    with caplog.at_level(logging.WARNING, logger="memcompile"):
        result = run_step(step, x, params, budget)
    _check(result, expected, budget)
    # the greedy plan; where it is over the target, repaired by the checks (feasible), or the
    # least-peak search's (which falls back to greedy plans too); never a plan of the solver's
    assert result.plan.status_kind in (StatusKind.FALLBACK, StatusKind.FEASIBLE, StatusKind.LEAST_PEAK), \
        result.plan.solver_status
    assert "solver failed" in caplog.text


def test_a_bug_in_planning_is_not_hidden_by_a_fallback(attention_case, monkeypatch):
    """A broken invariant (an AssertionError: a bug) reaches the user, not a fallback plan that
    would hide it; only what OR-Tools raises on a model it cannot take falls back."""
    from memcompile import planner

    def broken(*_args, **_kwargs):
        raise AssertionError("sentinel: a bug in building the model")

    step, x, params, _expected, budget = attention_case
    monkeypatch.setattr(planner, "solve_activation_plan", broken)
    with pytest.raises(Exception) as info:
        run_step(step, x, params, budget)
    chain, error = [], info.value
    while error is not None:
        chain.append(error)
        error = error.__cause__ or error.__context__
    assert any(isinstance(e, AssertionError) and "sentinel" in str(e) for e in chain), chain


def test_solver_that_runs_out_of_time_still_gives_a_plan(attention_case, monkeypatch):
    """A solver that finds nothing in time: CP-SAT's time limit at its smallest."""
    from memcompile import planner
    from memcompile.solver import activations

    original = activations.solve_activation_plan

    def hurried(problem, budget, **kwargs):
        kwargs["time_limit_s"] = 1e-3
        return original(problem, budget, **kwargs)

    step, x, params, expected, budget = attention_case
    monkeypatch.setattr(planner, "solve_activation_plan", hurried)
    result = run_step(step, x, params, budget)
    _check(result, expected, budget)


def test_a_broken_invariant_in_planning_is_not_hidden_by_the_fallback(attention_case, monkeypatch):
    """An AssertionError is a bug, not a graph planning cannot read: it reaches the caller instead
    of running PyTorch's partition with a warning (which would hide it in a user's run, and a
    test's sentinel with it)."""
    from memcompile import planner

    def broken(*_args, **_kwargs):
        raise AssertionError("a broken invariant")

    step, x, params, _expected, budget = attention_case
    monkeypatch.setattr(planner, "analyze_joint_graph", broken)
    with pytest.raises(Exception, match="a broken invariant") as info:
        run_step(step, x, params, "1GB")
    # Dynamo wraps what a backend raises (BackendCompilerFailed) around the error itself
    assert isinstance(getattr(info.value, "inner_exception", info.value), AssertionError), repr(info.value)
    torch.compiler.reset()


@pytest.mark.parametrize("broken_name", ["greedy_plan", "analyze_joint_graph", "solve_min_peak"])
def test_planner_failures_fall_back_to_the_stock_partition_only_where_it_fits(attention_case, monkeypatch, caplog,
                                                                              broken_name):
    """If even the fallback fails (or the analysis does), PyTorch's own partition runs where it is
    predicted within the budget (a warning says planning failed), with correct gradients; where it
    is not, the call raises PlanningFailedError, unless on_unplanned="warn" runs it anyway."""
    from memcompile import planner

    def broken(*_args, **_kwargs):
        raise RuntimeError(f"{broken_name} exploded")

    step, x, params, expected, budget = attention_case
    monkeypatch.setattr(planner, "solve_activation_plan", broken)
    monkeypatch.setattr(planner, broken_name, broken)
    tight = 1 if broken_name == "solve_min_peak" else budget
    # At a roomy budget only the analysis runs (nothing to solve): its failure falls back there.
    runs = ([("1GB", {})] if broken_name == "analyze_joint_graph" else []) + [(tight, {"on_unplanned": "warn"})]
    for limit, options in runs:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="memcompile"):
            result = run_step(step, x, params, limit, **options)
        for a, b in zip(expected, result.grads):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
        assert result.plan.solver_status.startswith("stock_fallback")
        assert "default partition" in caplog.text and f"{broken_name} exploded" in caplog.text
    with pytest.raises(memcompile.PlanningFailedError, match="exploded") as info:
        run_step(step, x, params, 1)
    assert isinstance(info.value.__cause__, RuntimeError)
    torch.compiler.reset()


# -- ops the passes do not know ----------------------------------------------------------------

@torch.library.custom_op("memcompile_test::scaled_tanh", mutates_args=())
def scaled_tanh(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.tanh(x) * scale


@scaled_tanh.register_fake
def _(x, scale):
    return torch.empty_like(x)


def _scaled_tanh_backward(ctx, grad):
    (out,) = ctx.saved_tensors
    return grad * (ctx.scale - out * out / ctx.scale), None


def _scaled_tanh_setup(ctx, inputs, output):
    ctx.scale = inputs[1]
    ctx.save_for_backward(output)


scaled_tanh.register_autograd(_scaled_tanh_backward, setup_context=_scaled_tanh_setup)


class CustomOpModel(nn.Module):
    def __init__(self, d: int = 32, depth: int = 3):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = scaled_tanh(layer(x), 1.5)
        return x.pow(2).mean()


def test_custom_op_without_flop_formula_is_kept_not_recomputed():
    torch.manual_seed(0)
    model, x = CustomOpModel(), torch.randn(256, 32, requires_grad=True)
    params = list(model.parameters()) + [x]
    expected = grads(params, lambda: model(x))
    low, high = budget_range(model, x)
    for budget in (low, (low + high) // 2):
        result = run_step(model, x, params, budget)
        _check(result, expected, budget)
        custom = [d for d in result.plan.decisions if "scaled_tanh" in d.op]
        assert custom and all(d.choice == "keep" and "outside aten" in d.reason for d in custom)


def test_an_op_the_cost_model_cannot_read_is_kept_not_fatal(monkeypatch):
    from memcompile.passes import activation_analysis

    original = activation_analysis.estimate_node_time_s

    def picky(node, profile):
        if "tanh" in str(node.target):
            raise NotImplementedError("no cost for tanh")
        return original(node, profile)

    monkeypatch.setattr(activation_analysis, "estimate_node_time_s", picky)
    model, x = build("mlp", 32, 3, 128)
    step = WithLoss(model)
    params = list(model.parameters()) + [x]
    expected = grads(params, lambda: step(x))
    low, high = budget_range(step, x)
    result = run_step(step, x, params, low)
    _check(result, expected, low)
    tanh = [d for d in result.plan.decisions if "tanh" in d.op]
    assert tanh and all(d.choice == "keep" and "could not be estimated" in d.reason for d in tanh)
