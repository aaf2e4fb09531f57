"""Device profiles: the few numbers a roofline time estimate needs."""

from __future__ import annotations

import functools
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

    def matmul_rate(self, dtype: torch.dtype | None) -> float:
        """Dense matmul FLOP/s for results of `dtype`."""
        if dtype not in (torch.float32, torch.float64):
            return self.matmul_flops_per_s
        if self.tf32_matmul_flops_per_s and dtype == torch.float32 \
                and torch.get_float32_matmul_precision() != "highest":
            return self.tf32_matmul_flops_per_s
        rate = self.float32_matmul_flops_per_s or self.matmul_flops_per_s
        return rate if dtype == torch.float32 else rate / 2


# Datasheet numbers (dense bf16 tensor-core FLOP/s, HBM bandwidth, PCIe/NVLink-C2C host link,
# launch overhead, plain float32 and TF32 FLOP/s). The H200's host link is what pinned copies
# measured on one (benchmarks/gpu_check.py: 55.3 GB/s device to host, 55.4 back), not PCIe 5's 64.
DATASHEET_PROFILES = {
    "a100": DeviceProfile("a100", 312e12, 2.0e12, 32e9, 5e-6, 19.5e12, 156e12),
    "h100": DeviceProfile("h100", 989e12, 3.35e12, 64e9, 5e-6, 67e12, 494e12),
    "h200": DeviceProfile("h200", 989e12, 4.8e12, 55e9, 5e-6, 67e12, 494e12),
}


def _round2(x: float) -> float:
    """Two significant digits: measured numbers jitter; plans (and their cache keys) should not."""
    return float(f"{x:.2g}")


@functools.lru_cache(maxsize=1)
def measure_cpu_profile() -> DeviceProfile:
    """A quick (~0.2 s) measurement of this CPU's matmul and copy throughput."""
    n = 256
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    reps = 20
    start = time.perf_counter()
    for _ in range(reps):
        torch.mm(a, b)
    flops = 2 * n**3 * reps / max(time.perf_counter() - start, 1e-9)
    src = torch.empty(4 * 2**20)  # 16 MiB: beyond most caches
    dst = torch.empty_like(src)
    dst.copy_(src)
    start = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    bandwidth = 2 * src.nbytes * reps / max(time.perf_counter() - start, 1e-9)
    return DeviceProfile("cpu", _round2(flops), _round2(bandwidth), 0.0, 2e-6)


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
