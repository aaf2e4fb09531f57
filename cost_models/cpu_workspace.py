"""Scratch that CPU math libraries allocate and free inside one call (fitted bounds)."""

from __future__ import annotations

import os

import torch
import torch.fx as fx

from memcompile import _torch_private as tp
from memcompile.sizes import size_value

KIB = 1024

# Per-thread ceiling on oneDNN's CPU GEMM scratch: blocked packing grows with k (~850 B per k
# measured at 1024 x 4096 x 32000 bf16, ~1.7 KB at 1024^3 fp16), whole-operand packing only for
# small operands. 8 MiB + 2 KiB x k per thread, above everything measured (torch 2.13).
ONEDNN_SCRATCH_CAP_BYTES = 8 * 1024 * 1024


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def onednn_max_cpu_isa_settings() -> tuple[str, str]:
    """The caps on oneDNN's instruction set in this process's environment, "" where unset:
    (ONEDNN_MAX_CPU_ISA, DNNL_MAX_CPU_ISA), e.g. "AVX2" (what tests use to model AVX2 CPUs).
    The convolution fits read them, and so does the plan store's machine key."""
    return os.environ.get("ONEDNN_MAX_CPU_ISA", ""), os.environ.get("DNNL_MAX_CPU_ISA", "")


def onednn_matmul_scratch_bytes(m: int, k: int, n: int, dtype: torch.dtype, device: torch.device) -> int:
    """An upper bound on the scratchpad oneDNN allocates (and frees) inside one CPU bf16/float16
    (m x k) @ (k x n) matmul; 0 where ATen does not use oneDNN for it (other devices, float32,
    CPUs without native support, oneDNN disabled).

    Measured on an Intel Xeon with AMX (torch 2.13, oneDNN 3.12; m 9..600, k 8..1024, n 50..5000,
    1 and 2 threads): bf16 packs B (k padded to 32, n to 64, 2 bytes each) in VNNI layout, in full
    per thread for some shapes (e.g. 33 x 8 x 5000: 320 KiB per thread), plus a few KiB for A and the
    float32 accumulators; float16 (AVX-512 FP16, no AMX-FP16) copies A blocks (up to ~6 bytes per
    element of A) and B blocks. The bound: per thread, B in full (2 bytes an element for bf16, 4 for
    float16), 8 bytes an element of A, padded to 64, and 16 KiB; measured at most 1/2.1 of it in bf16,
    1/1.3 in float16. oneDNN's blocking heuristic is not modelled: for large heads it packs B block
    by block and this over-counts."""
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float16):
        return 0
    if not tp.onednn_runs_cpu_matmuls_in(dtype):
        return 0
    k_pad, n_pad, m_pad = round_up(k, 64), round_up(n, 64), round_up(m, 64)
    b_bytes = 2 if dtype == torch.bfloat16 else 4
    per_thread = b_bytes * k_pad * n_pad + 8 * m_pad * k_pad + 16384
    # Large heads are packed block by block (bf16 1024 x 4096 x 32000: 3.5 MB where B in full is
    # 262 MB): the bound, without the cap, charged gigabytes for a 128k vocabulary.
    return torch.get_num_threads() * min(per_thread, ONEDNN_SCRATCH_CAP_BYTES + 2048 * k_pad)


GEMM_OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
            torch.ops.aten.baddbmm.default}
# Per thread, oneDNN's float16/bfloat16 GEMMs on CPU allocate scratch (converted or packed blocks)
# from the CPU allocator, sized by one GEMM (not the batch) and bounded by its blocking. Allocator
# events, torch 2.13, Xeon with AVX512-FP16 and AMX-BF16, 1 and 2 threads (exactly per thread),
# m, k, n from 16 to 4096: float16 up to 6.7 B per element of A, B and C (16x768x16) and 1.7 MB
# (1024^3); bfloat16 up to 2.7 B (40x16x48) and 1.05 MB (3.5 MB at 1024 x 4096 x 32000). Counted
# with margin: c x elements, capped as onednn_matmul_scratch_bytes caps it (grows with k), plus 8 KiB. float32: none.
# float16: 12 B and a 20 KiB floor (was 7 B): one- and two-row GEMMs drawn by the test measured
# above 7 B x elements: addmm 1x161 @ 161x26 at 8.8 B, 1x142 @ 142x29 at 7.06 B, 2x81 @ 81x26
# at ~18.2 KB per thread besides the 8 KiB (7 B said 15.8 KB); bfloat16: 6 B (was 5): 1x193 @ 193x22
# at 5.47 B. The cause is not read from oneDNN.
_GEMM_SCRATCH_PER_ELEMENT = {torch.float16: 12, torch.bfloat16: 6}
_GEMM_SCRATCH_FLOOR = {torch.float16: 20 * 1024, torch.bfloat16: 0}
# Skinny GEMMs (a few rows or columns; oneDNN's GEMV-like kernels) allocate scratch per thread that
# grows with the depth k alone, not with m x k + k x n: bfloat16 128 B per k (1x8192 @ 8192x1:
# 1,050,624 B = 128 x 8192 + 2 KiB); float16 up to 330 B per k (16x100 @ 100x1: 37,056 B), never
# above 297 KB (8x2048 @ 2048x2; its k is blocked). Allocator events, torch 2.13, this Xeon, 1,500
# shapes with m 1-32, k 1-8192, n 1-300, mm/addmm/bmm: none above (rate x k, capped) + 8 KiB.
_SKINNY_GEMM_SCRATCH_PER_K = {torch.float16: 340, torch.bfloat16: 128}
_SKINNY_GEMM_SCRATCH_CAP = {torch.float16: 320 * 1024, torch.bfloat16: None}
# The dtypes whose GEMM scratch is counted by the fitted bound above (not exactly).
LOW_PRECISION_GEMM_DTYPES = frozenset(_GEMM_SCRATCH_PER_ELEMENT)


def low_precision_gemm_scratch_bytes(node: fx.Node) -> int:
    """oneDNN's per-thread scratch inside one CPU float16/bfloat16 GEMM node (mm, addmm, bmm,
    baddbmm), from the fits above; 0 for other dtypes and devices."""
    out = node.meta.get("val")
    if not isinstance(out, torch.Tensor) or out.device.type != "cpu" or out.dtype not in _GEMM_SCRATCH_PER_ELEMENT:
        return 0
    a, b = (x.meta.get("val") if isinstance(x, fx.Node) else None for x in node.args[-2:]) if len(
        node.args) >= 2 else (None, None)
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return 0
    m, k, n = size_value(a.shape[-2]), size_value(a.shape[-1]), size_value(b.shape[-1])
    blocked = min(max(_GEMM_SCRATCH_PER_ELEMENT[out.dtype] * (m * k + k * n + m * n),
                      _GEMM_SCRATCH_FLOOR[out.dtype]),
                  ONEDNN_SCRATCH_CAP_BYTES + 2048 * k)
    skinny = _SKINNY_GEMM_SCRATCH_PER_K[out.dtype] * k
    cap = _SKINNY_GEMM_SCRATCH_CAP[out.dtype]
    per_thread = max(blocked, skinny if cap is None else min(skinny, cap))
    return torch.get_num_threads() * (per_thread + 8 * KIB)
