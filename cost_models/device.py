"""Device profiles: the few numbers a roofline time estimate needs."""

from __future__ import annotations

import functools
import math
import os
import re
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    matmul_flops_per_s: float  # dense matmul throughput at the activation dtype
    memory_bytes_per_s: float  # device memory bandwidth
    host_link_bytes_per_s: float  # device <-> host copies (offload); 0 where memory is shared
    op_overhead_s: float  # fixed cost per launched op (kernel launch / dispatch)
    # float32 matmuls run far slower than bf16 on tensor-core devices: plain float32, and TF32
    # (used when torch.get_float32_matmul_precision() is not "highest"). 0: matmul_flops_per_s.
    float32_matmul_flops_per_s: float = 0.0
    tf32_matmul_flops_per_s: float = 0.0
    # The share of a phase's compute time that host copies run behind (1: all of it).
    copy_overlap: float = 1.0
    # Compute-bound ops (those with a FLOP count) are timed on this device instead of priced by
    # the roofline (cost_models/op_timing.py): CPU only, where the plan's process runs them.
    times_ops: bool = False
    # Working sets beyond the caches stream at this rate (a CPU's DRAM: 27-35 GB/s on the 2-core
    # EPYC VM where a 16 MiB copy ran at 80-99 GB/s); those of at most `cache_bytes` at
    # memory_bytes_per_s. 0: memory_bytes_per_s for every size (accelerators' datasheet rate).
    large_memory_bytes_per_s: float = 0.0
    cache_bytes: int = 0

    def memory_time_s(self, nbytes: float, working_set_bytes: float | None = None) -> float:
        """Seconds to move `nbytes` through memory in passes over `working_set_bytes` (default:
        `nbytes`): at the cache's rate where the working set fits it, else at the large rate."""
        working_set = nbytes if working_set_bytes is None else working_set_bytes
        if self.large_memory_bytes_per_s and working_set > self.cache_bytes:
            return nbytes / self.large_memory_bytes_per_s
        return nbytes / self.memory_bytes_per_s

    def matmul_rate(self, dtype: torch.dtype | None) -> float:
        """Dense matmul FLOP/s for results of `dtype`."""
        if dtype not in (torch.float32, torch.float64):
            return self.matmul_flops_per_s
        if self.tf32_matmul_flops_per_s and dtype == torch.float32 \
                and torch.get_float32_matmul_precision() != "highest":
            return self.tf32_matmul_flops_per_s
        rate = self.float32_matmul_flops_per_s or self.matmul_flops_per_s
        return rate if dtype == torch.float32 else rate / 2


# Datasheet numbers (dense bf16 tensor-core FLOP/s, HBM bandwidth, launch overhead, plain float32
# and TF32 FLOP/s) and, for offload, what benchmarks/gpu_check.py measured on an H200:
# - the host link as activation copies use it: 2 x offloaded bytes / summed copy time was 36.5 GB/s
#   in both offload rows of the run (one 256 MiB pinned copy: 55 GB/s); A100 and H100 take the
#   same 0.66 of their PCIe 4 / 5 rates;
# - 13-24% of the copy time ran behind compute, about 0.15 of a step's compute time.
_LINK_EFFICIENCY = 36.5 / 55
_COPY_OVERLAP = 0.15
DATASHEET_PROFILES = {
    "a100": DeviceProfile("a100", 312e12, 2.0e12, _LINK_EFFICIENCY * 32e9, 5e-6, 19.5e12, 156e12, _COPY_OVERLAP),
    "h100": DeviceProfile("h100", 989e12, 3.35e12, _LINK_EFFICIENCY * 64e9, 5e-6, 67e12, 494e12, _COPY_OVERLAP),
    "h200": DeviceProfile("h200", 989e12, 4.8e12, 36.5e9, 5e-6, 67e12, 494e12, _COPY_OVERLAP),
}


def _round2(x: float) -> float:
    """Two significant digits: measured numbers jitter; plans (and their cache keys) should not."""
    return float(f"{x:.2g}")


def _best_rate(work: float, run, rounds: int = 5, reps: int = 4) -> float:
    """work / the fastest of `rounds` timings of `reps` calls of `run`. The fastest, not the mean:
    whatever else the machine runs (Inductor's compile workers on the same core, another job) only
    ever slows a round down, and the profile was taken at such moments: the same plan was
    estimated at 1.01 ms of added time in one process and 1.85 ms in another (Llama small)."""
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(reps):
            run()
        best = min(best, time.perf_counter() - start)
    return work * reps / max(best, 1e-9)


def _host_floats(*shape: int) -> torch.Tensor:
    """A float32 tensor over Python-owned memory: no allocation of torch's allocator, which a
    step's budget counts (the profile is measured inside the first call, beside the step)."""
    return torch.frombuffer(bytearray(4 * math.prod(shape)), dtype=torch.float32).view(*shape)


@functools.lru_cache(maxsize=1)
def measure_cpu_profile() -> DeviceProfile:
    """A quick (~0.1 s) measurement of this CPU's matmul and copy throughput, on host memory
    outside torch's allocator (see _host_floats): copies of 16 MiB (a 32 MiB working set, within
    the last-level cache of many server CPUs) and of 64 MiB (128 MiB: DRAM), since a model at
    real size streams tensors of tens of MiB: on the 2-core EPYC VM 80-99 against 27-35 GB/s
    (the chunked loss head, priced at the first rate, cost 10-17x its estimate: docs/decisions.md)."""
    n = 256
    a, b, product = _host_floats(n, n).uniform_(), _host_floats(n, n).uniform_(), _host_floats(n, n)
    torch.mm(a, b, out=product)
    flops = _best_rate(2 * n**3, lambda: torch.mm(a, b, out=product))
    cached = _copy_rate(_CACHED_COPY_MIB, rounds=5, reps=4)
    large = min(_copy_rate(_DRAM_COPY_MIB, rounds=3, reps=1), cached)
    return DeviceProfile("cpu", _round2(flops), _round2(cached), 0.0, 2e-6, times_ops=True,
                         large_memory_bytes_per_s=_round2(large), cache_bytes=2 * _CACHED_COPY_MIB * 2**20)


_CACHED_COPY_MIB = 16
_DRAM_COPY_MIB = 64


def _copy_rate(mib: int, rounds: int, reps: int) -> float:
    """Bytes per second a copy of `mib` MiB moves (read and written), between host buffers."""
    src = _host_floats(mib * 2**18)
    dst = _host_floats(mib * 2**18)
    dst.copy_(src)
    return _best_rate(2 * src.nbytes, lambda: dst.copy_(src), rounds, reps)


def profile_for(device: str | torch.device | None) -> DeviceProfile:
    """The profile for a device name ("cpu", "cuda", "h100", ...)."""
    name = str(device or "cpu").lower()
    if name in DATASHEET_PROFILES:
        return DATASHEET_PROFILES[name]
    if name.startswith("cuda"):
        if torch.cuda.is_available():
            product = torch.cuda.get_device_name().lower()
            for key, profile in DATASHEET_PROFILES.items():
                if key in product:
                    return profile
        return DATASHEET_PROFILES["h100"]
    return measure_cpu_profile()


# cuBLAS handles are per thread: the forward runs on the caller's thread, the backward on
# autograd's device thread, and PyTorch keeps one workspace per (handle, stream).
BLAS_HANDLES_PER_STEP = 2


# While a graph compiles during the step (every region's first call, a re-plan at a call), Dynamo's
# frame compile, AOTAutograd, Inductor and memcompile each keep a copy of the CPU generator's state,
# nested so that all four are live at once (a profile of a first call shows them, 5,056 B each).
COMPILE_GENERATOR_COPIES = 4
_CPU_GENERATOR_STATE_BYTES = torch.random.default_generator.get_state().numel()  # at import, before any step


def compile_scratch_bytes(device: str) -> int:
    """Bytes on `device` that compiling a graph during the step allocates beside the step's own:
    on the CPU the generator-state copies; 0 on accelerators (their states are copied to the host)."""
    return COMPILE_GENERATOR_COPIES * _CPU_GENERATOR_STATE_BYTES if device == "cpu" else 0


def blas_workspace_bytes_for(capability_major: int, environ: dict[str, str]) -> int:
    """Bytes of one cuBLAS workspace as PyTorch sizes it (aten/src/ATen/cuda/CublasHandlePool.cpp):
    CUBLAS_WORKSPACE_CONFIG ":SIZE_KiB:COUNT..." if set, else 32 MiB on Hopper and Blackwell
    (major 9, 10, 12) and ":4096:2:16:8" before; plus cuBLASLt's own workspace (CUBLASLT_WORKSPACE_SIZE
    KiB, default 1 MiB) only where TORCH_CUBLASLT_UNIFIED_WORKSPACE turns the shared one off."""
    default = 32 * 2**20 if capability_major in (9, 10, 12) else 4096 * 1024 * 2 + 16 * 1024 * 8
    config = environ.get("CUBLAS_WORKSPACE_CONFIG")
    pairs = re.findall(r":([0-9]+):([0-9]+)", config or "")
    blas = sum(int(size) * 1024 * int(count) for size, count in pairs) if pairs else default
    unified = environ.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "1").strip().lower() not in ("0", "false", "off", "no")
    if unified:
        return blas
    lt_kib = environ.get("CUBLASLT_WORKSPACE_SIZE", "1024")
    return blas + (int(lt_kib) * 1024 if lt_kib.isdigit() else 2**20)


def blas_workspace_bytes(device: str) -> int:
    """Device bytes the matmul library holds for a step on `device` (allocated through the caching
    allocator on first use and kept, so `max_memory_allocated` counts them): 0 off CUDA."""
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return 0
    major, _ = torch.cuda.get_device_capability()
    return BLAS_HANDLES_PER_STEP * blas_workspace_bytes_for(major, dict(os.environ))
