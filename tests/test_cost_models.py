"""The roofline time estimate: matmul rates follow the dtype and torch's float32 matmul setting."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

import memcompile
from memcompile.cost_models.device import (
    DATASHEET_PROFILES,
    DeviceProfile,
    blas_workspace_bytes,
    blas_workspace_bytes_for,
    measure_cpu_profile,
)
from memcompile.cost_models.node_cost import estimate_node_time_s, node_bytes_moved, node_flops, transcendental_elements


def _mm_node(dtype: torch.dtype, n: int):
    graph = make_fx(torch.mm, tracing_mode="fake")(torch.empty(n, n, dtype=dtype), torch.empty(n, n, dtype=dtype))
    (node,) = [x for x in graph.graph.nodes if x.op == "call_function"]
    return node


@pytest.mark.parametrize("device", ["a100", "h100", "h200"])
def test_float32_matmuls_are_timed_at_float32_or_tf32_rates(device):
    profile = DATASHEET_PROFILES[device]
    n = 4096  # compute-bound on every profile, at every dtype
    bf16 = estimate_node_time_s(_mm_node(torch.bfloat16, n), profile) - profile.op_overhead_s
    saved = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        fp32 = estimate_node_time_s(_mm_node(torch.float32, n), profile) - profile.op_overhead_s
        torch.set_float32_matmul_precision("high")
        tf32 = estimate_node_time_s(_mm_node(torch.float32, n), profile) - profile.op_overhead_s
    finally:
        torch.set_float32_matmul_precision(saved)
    assert bf16 == pytest.approx(2 * n**3 / profile.matmul_flops_per_s)
    assert fp32 == pytest.approx(2 * n**3 / profile.float32_matmul_flops_per_s)
    assert tf32 == pytest.approx(2 * n**3 / profile.tf32_matmul_flops_per_s)
    assert bf16 < tf32 < fp32


def test_the_step_device_is_found_in_the_inputs_as_aot_autograd_nests_them(monkeypatch):
    """The cost profile follows the step's device. AOTAutograd hands the partitioner its inputs
    nested ((primals, tangents)); reading only the top level found no tensor, so every CUDA step
    was costed with the host CPU's profile (recompute ~1000x too slow, offload never "auto")."""
    import memcompile.planner as planner

    seen = []
    original = planner.step_device
    monkeypatch.setattr(planner, "step_device", lambda inputs: seen.append(inputs) or original(inputs))
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    torch.compile(model, backend=memcompile.budget(10**9, codegen="aot_eager"))(torch.randn(4, 8)).sum().backward()
    assert seen, "the planner did not look for the device"

    def on_meta(x):  # the same nesting, the tensors on another device
        if isinstance(x, torch.Tensor):
            return torch.empty(x.shape, dtype=x.dtype, device="meta")
        if isinstance(x, (list, tuple)):
            return type(x)(on_meta(y) for y in x)
        return x

    assert original(seen[0]) == "cpu"
    assert original(on_meta(seen[0])) == "meta"
    # A CPU scalar (a seed, a step count) beside device tensors does not make the step a CPU one.
    assert original(([torch.tensor(3)], [torch.empty(2, device="meta")])) == "meta"


@pytest.mark.parametrize("major, environ, expected", [
    (9, {}, 32 * 2**20),  # Hopper default
    (10, {}, 32 * 2**20),  # Blackwell
    (8, {}, 4096 * 1024 * 2 + 16 * 1024 * 8),  # ":4096:2:16:8" before Hopper
    (9, {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}, 16 * 1024 * 8),  # the deterministic-algorithms setting
    (8, {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}, 4096 * 1024 * 8),
    (9, {"CUBLAS_WORKSPACE_CONFIG": "nonsense"}, 32 * 2**20),  # unparsable: PyTorch warns, keeps the default
    (9, {"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "0"}, 32 * 2**20 + 2**20),  # cuBLASLt's own 1 MiB beside it
    (9, {"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "0", "CUBLASLT_WORKSPACE_SIZE": "4096"}, 32 * 2**20 + 4 * 2**20),
])
def test_cublas_workspace_is_sized_as_pytorch_sizes_it(major, environ, expected):
    assert blas_workspace_bytes_for(major, environ) == expected


def test_library_workspaces_enter_the_reserve_and_the_smallest_budget(monkeypatch):
    """On CUDA the cuBLAS workspaces (one per thread: forward and autograd's backward) are device
    memory `max_memory_allocated` counts; an H200 run measured 2 x 32 MiB beyond every plan's
    prediction. Here (CPU) the device has none; the backend's hook is fed a size."""
    import memcompile.backend as backend_module

    assert blas_workspace_bytes("cpu") == 0
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    x = torch.randn(64, 32)

    def smallest_budget(workspace: int) -> int:
        monkeypatch.setattr(backend_module, "blas_workspace_bytes", lambda device: workspace)
        torch.compiler.reset()
        backend = memcompile.budget(1, reserve=0, codegen="aot_eager")
        with pytest.raises(memcompile.InfeasibleBudgetError) as error:
            torch.compile(model, backend=backend)(x).sum().backward()
        assert backend.options.library_workspace_bytes == workspace
        assert backend.options.reserve_bytes == workspace
        assert (f"cuBLAS workspaces {workspace}" in str(error.value)) == (workspace > 0)
        return error.value.min_feasible_bytes

    without = smallest_budget(0)
    assert smallest_budget(3 * 2**20) == without + 3 * 2**20

    monkeypatch.setattr(backend_module, "blas_workspace_bytes", lambda device: 2**20)
    torch.compiler.reset()
    backend = memcompile.budget(without + 2**20, codegen="aot_eager")
    torch.compile(model, backend=backend)(x).sum().backward()
    (plan,) = backend.plans
    assert plan.library_workspace_bytes == 2**20 and plan.reserve_bytes == 2**20
    assert plan.predicted_peak_bytes <= plan.step_budget_bytes == without
    assert "cuBLAS workspaces 1.00 MiB" in memcompile.dump(backend)


_CPU_LIKE = DeviceProfile("cpu-test", 1e11, 2e10, 0.0, 0.0, transcendental_per_s=2.5e9)


def _nodes(fn, *args):
    graph = make_fx(fn, tracing_mode="fake")(*args)
    return [x for x in graph.graph.nodes if x.op == "call_function"]


@settings(max_examples=10, deadline=None)
@given(b=st.integers(1, 4), h=st.integers(1, 8), s=st.sampled_from([16, 64, 256]), d=st.sampled_from([16, 64]),
       causal=st.booleans())
def test_cpu_attention_is_priced_by_its_matmul_flops(b, h, s, d, causal):
    # SDPA lowers to the CPU flash kernel, which torch's flop counter has no formula for: priced
    # by its bytes alone, recomputing attention looked ~100x cheaper than it is.
    q, k, v = (torch.empty(b, h, s, d) for _ in range(3))
    (node,) = [n for n in _nodes(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal), q, k, v)
               if "flash_attention_for_cpu" in str(n.target)]
    flops = 4 * b * h * s * s * d  # QK^T and PV
    assert node_flops(node) == flops
    assert estimate_node_time_s(node, _CPU_LIKE) == pytest.approx(
        max(flops / _CPU_LIKE.matmul_flops_per_s, node_bytes_moved(node) / _CPU_LIKE.memory_bytes_per_s))


@settings(max_examples=10, deadline=None)
@given(shape=st.lists(st.integers(1, 64), min_size=1, max_size=3))
def test_transcendental_pointwise_ops_pay_per_element_on_a_cpu_profile(shape):
    x = torch.empty(shape)
    tanh, = _nodes(torch.tanh, x)
    cube, = _nodes(lambda t: torch.pow(t, 3.0), x)
    root, = _nodes(lambda t: torch.pow(t, 0.5), x)
    mul, = _nodes(lambda t: t * 2.0, x)
    per_element = 1 / _CPU_LIKE.transcendental_per_s
    for node in (tanh, root):
        assert transcendental_elements(node) == x.numel()
        assert estimate_node_time_s(node, _CPU_LIKE) == pytest.approx(
            max(x.numel() * per_element, node_bytes_moved(node) / _CPU_LIKE.memory_bytes_per_s))
    for node in (cube, mul):  # an integer power is multiplies
        assert transcendental_elements(node) == 0
        assert estimate_node_time_s(node, _CPU_LIKE) == pytest.approx(node_bytes_moved(node) / _CPU_LIKE.memory_bytes_per_s)
    # Datasheet (GPU) profiles do not charge them: memory-bound there.
    assert estimate_node_time_s(tanh, DATASHEET_PROFILES["h100"]) == pytest.approx(
        node_bytes_moved(tanh) / DATASHEET_PROFILES["h100"].memory_bytes_per_s + DATASHEET_PROFILES["h100"].op_overhead_s)


def test_the_measured_cpu_profile_has_every_rate():
    profile = measure_cpu_profile()
    assert profile.matmul_flops_per_s > 0 and profile.memory_bytes_per_s > 0 and profile.transcendental_per_s > 0
