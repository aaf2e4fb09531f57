"""The roofline time estimate: matmul rates follow the dtype and torch's float32 matmul setting."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import memcompile
from memcompile.cost_models.device import DATASHEET_PROFILES, blas_workspace_bytes, blas_workspace_bytes_for
from memcompile.cost_models.node_cost import estimate_node_time_s


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
