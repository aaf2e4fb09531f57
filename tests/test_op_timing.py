"""Compute-bound ops timed on the CPU (cost_models/op_timing.py) instead of priced by the roofline."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

from memcompile import _torch_private as tp
from memcompile.cost_models import op_timing
from memcompile.cost_models.device import DeviceProfile
from memcompile.cost_models.node_cost import estimate_node_time_s

ROOFLINE = DeviceProfile("test", matmul_flops_per_s=1e11, memory_bytes_per_s=1e10, host_link_bytes_per_s=0.0,
                         op_overhead_s=2e-6)
TIMED = dataclasses.replace(ROOFLINE, times_ops=True)
TICK_S = 0.001


def _fake_clock(patch: pytest.MonkeyPatch) -> tuple[list, list]:
    """A fresh cache and a fake clock (each read advances TICK_S / 2, so every run of an op reads
    TICK_S / 2); returns the ops timed (op, args, kwargs) and the tensors made to run them."""
    calls, made, now = [], [], itertools.count()
    patch.setattr(op_timing, "_measured", {})
    patch.setattr(op_timing, "_spent_s", [0.0])
    patch.setattr(op_timing.time, "perf_counter", lambda: next(now) * TICK_S / 2)
    time_op, real = op_timing._time, op_timing._real
    patch.setattr(op_timing, "_time", lambda op, args, kwargs: calls.append((op, args, kwargs)) or time_op(op, args, kwargs))
    patch.setattr(op_timing, "_real", lambda value: made.append(real(value)) or made[-1])
    return calls, made


@pytest.fixture
def clock(monkeypatch):
    return _fake_clock(monkeypatch)[0]


def _nodes(fn, *inputs, mode="fake"):
    graph = make_fx(fn, tracing_mode=mode)(*inputs).graph
    return [n for n in graph.nodes if n.op == "call_function"]


@settings(max_examples=15, deadline=None)
@given(m=st.integers(1, 96), k=st.integers(1, 96), n=st.integers(1, 96), transposed=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]))
def test_a_matmul_is_timed_once_per_distinct_call_on_real_inputs_of_its_layout(m, k, n, transposed, dtype):
    """The estimate is the timed call (a fake clock here), run on real CPU tensors of the node's
    shapes, strides and dtype, even under the compile's fake mode; a second node of the same
    call is not timed again; the roofline profile times none."""
    with pytest.MonkeyPatch.context() as patch:
        calls, made = _fake_clock(patch)
        a = torch.randn(m, k, dtype=dtype)
        b = torch.randn(n, k, dtype=dtype).t() if transposed else torch.randn(k, n, dtype=dtype)
        first, _add, second = _nodes(lambda a, b: (a @ b, (a + 0) @ b), a, b)
        assert first.target == second.target == torch.ops.aten.mm.default
        with torch._subclasses.fake_tensor.FakeTensorMode():  # as inside the partitioner
            assert estimate_node_time_s(first, TIMED) == pytest.approx(TICK_S / 2)
        assert estimate_node_time_s(second, TIMED) == pytest.approx(TICK_S / 2)
        assert len(calls) == 1
        real_a, real_b = made[-1]  # the args tuple, made in one call
        assert not any(tp.is_fake_tensor(t) for t in (real_a, real_b))
        assert real_b.stride() == b.stride() and real_a.shape == a.shape and real_a.dtype == dtype
        assert estimate_node_time_s(first, ROOFLINE) == pytest.approx(
            max(2 * m * k * n / ROOFLINE.matmul_rate(dtype), (a.nbytes + b.nbytes + m * n * a.itemsize) / 1e10) + 2e-6)


def test_pointwise_ops_symbolic_sizes_and_large_tensors_stay_on_the_roofline(clock, monkeypatch):
    x = torch.randn(64, 64)
    (add,) = _nodes(lambda x: x + 1, x)
    assert estimate_node_time_s(add, TIMED) == estimate_node_time_s(add, ROOFLINE)
    (mm,) = _nodes(lambda a: a @ a, torch.randn(5, 5), mode="symbolic")
    assert estimate_node_time_s(mm, TIMED) == estimate_node_time_s(mm, ROOFLINE)
    # an outer product: 32 KiB of inputs, a result over MAX_BYTES (a run would allocate it)
    (outer,) = _nodes(torch.mm, torch.randn(4097, 1), torch.randn(1, 4097))
    assert estimate_node_time_s(outer, TIMED) == estimate_node_time_s(outer, ROOFLINE)
    monkeypatch.setattr(op_timing, "MAX_BYTES", 3 * x.nbytes - 1)  # inputs and result: 3 x.nbytes
    (mm,) = _nodes(lambda a: a @ a, x)
    assert estimate_node_time_s(mm, TIMED) == estimate_node_time_s(mm, ROOFLINE)
    assert clock == []  # none was run
    monkeypatch.setattr(op_timing, "MAX_BYTES", 3 * x.nbytes)
    assert estimate_node_time_s(mm, TIMED) == pytest.approx(TICK_S / 2) and len(clock) == 1


def test_an_op_that_fails_on_random_inputs_or_a_spent_budget_keeps_the_roofline(clock, monkeypatch):
    (mm,) = _nodes(lambda a: a @ a, torch.randn(8, 8))

    def fails(value):
        raise RuntimeError("index out of range")  # what an indexing op on random inputs may do

    monkeypatch.setattr(op_timing, "_real", fails)
    assert estimate_node_time_s(mm, TIMED) == estimate_node_time_s(mm, ROOFLINE)
    assert len(clock) == 1 and op_timing._spent_s[0] > 0
    op_timing._spent_s[0] = op_timing.TIME_BUDGET_S
    (bmm,) = [n for n in _nodes(torch.bmm, torch.randn(2, 8, 8), torch.randn(2, 8, 8))]
    assert estimate_node_time_s(bmm, TIMED) == estimate_node_time_s(bmm, ROOFLINE)
    assert len(clock) == 1


def test_a_slow_first_call_is_not_repeated(clock, monkeypatch):
    monkeypatch.setattr(op_timing, "MAX_CALL_S", TICK_S / 4)  # the first call (TICK_S / 2) is slower
    (mm,) = _nodes(lambda a: a @ a, torch.randn(8, 8))
    reads = []
    fake = op_timing.time.perf_counter
    monkeypatch.setattr(op_timing.time, "perf_counter", lambda: reads.append(1) or fake())
    assert estimate_node_time_s(mm, TIMED) == pytest.approx(TICK_S / 2)
    assert len(reads) == 4  # the budget's two reads and the one call's two


def test_cpu_attention_is_timed_by_running_it():
    """The call the roofline priced at a third of its time (Llama small's attention): timed on
    real inputs, its estimate is a positive time of the order of one real call, whatever the
    machine (no timing asserted beyond that)."""
    q, k, v = (torch.randn(2, 4, 128, 32) for _ in range(3))
    nodes = _nodes(lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), q, k, v)
    (attention,) = [n for n in nodes if "flash_attention" in str(n.target)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(op_timing, "_measured", {})
        patch.setattr(op_timing, "_spent_s", [0.0])
        timed = estimate_node_time_s(attention, TIMED)
        assert timed > 0 and timed != estimate_node_time_s(attention, ROOFLINE)
        assert len(op_timing._measured) == 1 and list(op_timing._measured.values()) == [timed]


def test_a_broadcast_operand_is_made_in_its_own_layout(clock):
    """An expanded (stride 0) operand cannot be filled in place; its storage is filled first."""
    row, b = torch.randn(1, 16), torch.randn(16, 16)
    (mm,) = [n for n in _nodes(lambda row, b: torch.mm(row.expand(16, 16), b), row, b)
             if n.target == torch.ops.aten.mm.default]
    assert estimate_node_time_s(mm, TIMED) == pytest.approx(TICK_S / 2)
    (real_a, _) = [op_timing._real(x) for x in clock[0][1]]
    assert real_a.stride() == (0, 1) and real_a.shape == (16, 16) and torch.isfinite(real_a).all()


def test_ops_are_not_timed_beyond_the_headroom_the_backend_allows(clock):
    # a timing run allocates its inputs and result beside the step's tensors at the first call
    x = torch.randn(32, 32)
    (mm,) = _nodes(lambda a: a @ a, x)
    with op_timing.timing_allocation_limit(3 * x.nbytes - 1):
        assert estimate_node_time_s(mm, TIMED) == estimate_node_time_s(mm, ROOFLINE)
    with op_timing.timing_allocation_limit(3 * x.nbytes):
        assert estimate_node_time_s(mm, TIMED) != estimate_node_time_s(mm, ROOFLINE)


def test_timing_draws_nothing_from_the_global_random_stream(clock):
    (mm,) = _nodes(lambda a: a @ a, torch.randn(24, 24))
    state = torch.get_rng_state()
    estimate_node_time_s(mm, TIMED)
    assert torch.equal(state, torch.get_rng_state())
