"""memcompile.measure_peak's starting bytes for distributed (DTensor) parameters."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist

import memcompile


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def one_rank_group():
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_dtensor_parameters_count_their_local_shard(one_rank_group):
    """FSDP2 parameters are DTensors, whose storage is the local shard: measure_peak counts that
    shard (and its grad), where reading the DTensor's own storage raised."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    weight = torch.nn.Parameter(distribute_tensor(torch.randn(64, 32), mesh, [Shard(0)]))
    weight.grad = distribute_tensor(torch.randn(64, 32), mesh, [Shard(0)])
    plain = torch.randn(16)
    measured = memcompile.measure_peak(lambda: plain * 2, live_at_start=[weight, plain])
    assert measured.live_at_start_bytes == 2 * 64 * 32 * 4 + 16 * 4
    assert measured.peak_bytes >= measured.live_at_start_bytes + 16 * 4  # plus the product
