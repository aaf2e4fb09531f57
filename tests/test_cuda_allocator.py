"""The CUDA caching allocator's block sizes in the prediction (cost_models/cuda_allocator.py).

`max_memory_allocated` counts the blocks allocations get, not the bytes they asked for: exact
values at each boundary of c10/cuda/CUDACachingAllocator.cpp's rules, the allocator settings read
from the environment, and the liveness and the backend counting blocks on CUDA only. All on the
CPU: the device is a string here."""

from __future__ import annotations

import pytest
import torch

import memcompile
from memcompile.cost_models.cuda_allocator import (
    CUDA_DEFAULT,
    EXACT,
    AllocatorRounding,
    allocator_rounding_for,
    new_segment_bytes,
)
from memcompile.passes.liveness import analyze_liveness

KIB, MIB = 2**10, 2**20


@pytest.mark.parametrize(("requested", "allocated"), [
    (0, 0),  # an empty tensor allocates nothing
    (1, 512), (511, 512), (512, 512), (513, 1024),  # kMinBlockSize
    (MIB - 1, MIB), (MIB, MIB),  # the largest small-pool request: split from a 2 MiB segment
    (MIB + 1, MIB + 512),  # large pool, new 20 MiB segment: 19 MiB remain, split
    (10 * MIB - 512, 10 * MIB - 512),  # still a 20 MiB segment (under kMinLargeAlloc)
    (10 * MIB, 10 * MIB),  # its own 10 MiB segment, nothing remains
    (10 * MIB + 1, 10 * MIB + 512),  # 12 MiB segment, 2 MiB - 512 B remain (> 1 MiB): split
    (11 * MIB - 512, 11 * MIB - 512),  # 1 MiB + 512 B remain: split
    (11 * MIB, 12 * MIB),  # exactly 1 MiB remains: not split, the whole segment is allocated
    (11 * MIB + 1, 12 * MIB),  # 1 MiB - 512 B remain: the whole segment
    (12 * MIB, 12 * MIB),
    (823_410_688, 786 * MIB),  # GPT-2's bf16 logits at 8 x 1024 tokens: 0.74 MiB over
    (1_646_821_376, 1_646_821_376),  # the same in float32: 1.47 MiB remain, split
])
def test_cuda_blocks_at_the_allocators_boundaries(requested: int, allocated: int) -> None:
    assert CUDA_DEFAULT.allocated_bytes(requested) == allocated
    assert EXACT.allocated_bytes(requested) == requested  # the CPU: what was asked for


def test_new_segments_by_request_size() -> None:
    assert new_segment_bytes(512) == new_segment_bytes(MIB) == 2 * MIB  # kSmallBuffer
    assert new_segment_bytes(MIB + 512) == new_segment_bytes(10 * MIB - 512) == 20 * MIB  # kLargeBuffer
    assert new_segment_bytes(10 * MIB) == 10 * MIB
    assert new_segment_bytes(10 * MIB + 512) == 12 * MIB  # kRoundLarge


def test_allocator_settings_change_the_blocks() -> None:
    expandable = AllocatorRounding(exact=False, expandable_segments=True)
    assert expandable.allocated_bytes(11 * MIB) == 11 * MIB  # split whenever 512 B remain
    assert expandable.allocated_bytes(1) == 512
    capped = AllocatorRounding(exact=False, max_split_bytes=62 * MIB)
    assert CUDA_DEFAULT.allocated_bytes(62 * MIB + 1) == 62 * MIB + 512  # 2 MiB - 512 B remain: split
    assert capped.allocated_bytes(62 * MIB + 1) == 64 * MIB  # never split at or above 62 MiB
    assert capped.allocated_bytes(60 * MIB + 1) == 60 * MIB + 512  # 2 MiB - 512 B remain: split
    power2 = AllocatorRounding(exact=False, power2_divisions=4)
    assert power2.allocated_bytes(1200) == 1536  # at most 4 x 512 B: plain 512 B blocks
    assert power2.allocated_bytes(5000) == 5120  # 4096..8192 in steps of 1024
    assert power2.allocated_bytes(4096) == 4096  # a power of two stays
    assert power2.allocated_bytes(MIB + 1) == MIB + 256 * KIB


def test_allocator_settings_from_the_environment() -> None:
    assert allocator_rounding_for("cpu", {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}) == EXACT
    assert allocator_rounding_for("cuda", {}) == CUDA_DEFAULT
    assert allocator_rounding_for("cuda:1", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,max_split_size_mb:128"}) \
        == AllocatorRounding(exact=False, expandable_segments=True, max_split_bytes=128 * MIB)
    # the newer variable wins; commas inside a [...] value do not split settings
    both = {"PYTORCH_ALLOC_CONF": "roundup_power2_divisions:[256:1,>:4],expandable_segments:True",
            "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}
    assert allocator_rounding_for("cuda", both) == AllocatorRounding(exact=False, expandable_segments=True)
    assert allocator_rounding_for("cuda", {"PYTORCH_ALLOC_CONF": "roundup_power2_divisions:8"}).power2_divisions == 8
    assert allocator_rounding_for("cuda", {"PYTORCH_ALLOC_CONF": "backend:cudaMallocAsync"}) == EXACT


def _graphs(fn, *inputs):
    """(forward, backward) as memcompile partitions them (keep-all budget, FX interpreter)."""
    from memcompile import planner

    captured = {}
    original = planner.apply_plan

    def spy(*args, **kwargs):
        captured["graphs"] = original(*args, **kwargs)
        return captured["graphs"]

    planner.apply_plan = spy
    try:
        torch.compile(fn, backend=memcompile.budget("10GB", codegen="aot_eager"))(*inputs).backward()
    finally:
        planner.apply_plan = original
    return captured["graphs"]


def test_liveness_counts_cuda_blocks() -> None:
    w = torch.randn(300, requires_grad=True)  # 1,200 B: a 1,536 B block

    def f(w):
        return (w.tanh() * 3).sum()

    fw, bw = _graphs(f, w)
    exact = analyze_liveness(fw, bw, 1)
    blocks = analyze_liveness(fw, bw, 1, rounding=CUDA_DEFAULT)
    assert exact.static_bytes == 1200 and blocks.static_bytes == 1536
    assert [s.node for s in blocks.steps] == [s.node for s in exact.steps]
    for a, b in zip(exact.steps, blocks.steps):
        # every live storage (1,200 B tensors, 4 B scalars) rounds up by less than 512 B
        assert a.live_bytes < b.live_bytes < a.live_bytes + 8 * 512
        assert b.live_bytes % 512 == 0  # the 4 KiB scratch allowance is whole blocks too


def test_backend_rounds_only_on_cuda(monkeypatch) -> None:
    """The device is decided once, from the first graph's inputs: the CPU keeps exact bytes; a
    step on CUDA (here: the backend told it is one) plans with blocks, so its smallest budget grows."""
    import memcompile.backend as backend_module

    model = torch.nn.Sequential(torch.nn.Linear(30, 50), torch.nn.Tanh(), torch.nn.Linear(50, 3))
    x = torch.randn(7, 30)
    real = backend_module.allocator_rounding_for

    def smallest(device: str) -> tuple[int, memcompile.Backend]:
        monkeypatch.setattr(backend_module, "allocator_rounding_for", lambda _device, env: real(device, env))
        torch.compiler.reset()
        backend = memcompile.budget(1, codegen="aot_eager")
        with pytest.raises(memcompile.InfeasibleBudgetError) as error:
            torch.compile(model, backend=backend)(x).sum().backward()
        return error.value.min_feasible_bytes, backend

    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    on_cpu, backend = smallest("cpu")
    assert backend.options.allocator_rounding == EXACT
    on_cuda, backend = smallest("cuda")
    assert backend.options.allocator_rounding == CUDA_DEFAULT
    # the parameters alone (6,000, 200, 600 and 12 B) hold 2,952 B more as blocks
    assert on_cuda > on_cpu
    assert (on_cuda - backend.options.reserve_bytes) % 512 == 0  # the reserve: the CPU's compile copies
