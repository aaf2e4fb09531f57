"""The roofline time estimate: matmul rates follow the dtype and torch's float32 matmul setting."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from memcompile.cost_models.device import DATASHEET_PROFILES
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
