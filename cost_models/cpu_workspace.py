"""Scratch that CPU math libraries allocate and free inside one call (fitted bounds)."""

from __future__ import annotations

import torch

from memcompile import _torch_private as tp

# Per-thread ceiling on oneDNN's CPU GEMM scratch: blocked packing grows with k (~850 B per k
# measured at 1024 x 4096 x 32000 bf16, ~1.7 KB at 1024^3 fp16), whole-operand packing only for
# small operands. 8 MiB + 2 KiB x k per thread, above everything measured (torch 2.13).
ONEDNN_SCRATCH_CAP_BYTES = 8 * 1024 * 1024


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


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
    k_pad, n_pad, m_pad = _round_up(k, 64), _round_up(n, 64), _round_up(m, 64)
    b_bytes = 2 if dtype == torch.bfloat16 else 4
    per_thread = b_bytes * k_pad * n_pad + 8 * m_pad * k_pad + 16384
    # Large heads are packed block by block (bf16 1024 x 4096 x 32000: 3.5 MB where B in full is
    # 262 MB): the bound, without the cap, charged gigabytes for a 128k vocabulary.
    return torch.get_num_threads() * min(per_thread, ONEDNN_SCRATCH_CAP_BYTES + 2048 * k_pad)
