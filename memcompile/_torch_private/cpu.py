"""Facts of this CPU and of Inductor's configuration that cost models and plan keys read."""

from __future__ import annotations

import functools

import torch
from torch._inductor import config as _inductor_config

@functools.lru_cache(maxsize=1)
def _cpu_isa() -> tuple[bool, bool, bool]:
    """(AMX tiles, AMX-FP16, AVX-512) on this CPU; all True where torch no longer says."""
    try:
        return (bool(torch.cpu._is_amx_tile_supported()), bool(torch.cpu._is_amx_fp16_supported()),
                bool(torch.cpu._is_avx512_supported()))
    except AttributeError:
        return True, True, True


def cpu_flash_attention_isa(dtype: torch.dtype) -> tuple[bool, bool]:
    """(packs, onednn_gemm) for the CPU flash attention kernels in `dtype` on this CPU.
    packs: the forward repacks K and V for AMX brgemm (bf16 with AMX tiles, fp16 with AMX-FP16).
    onednn_gemm: its bf16/fp16 GEMMs go to oneDNN (cpublas -> mkldnn_bf16/fp16_gemm), whose
    scratchpads come from the CPU allocator; that needs AVX-512 and ATen's device check for the
    dtype (mkldnn_bf16/fp16_device_check; fp16 wants AVX512-FP16 or AMX-FP16: on an AVX-512 CPU
    without them the fp16 backward allocated no scratchpad, 12,416 B measured at 1x1x32x16 where
    counting one put 74,880)."""
    if dtype not in (torch.bfloat16, torch.float16):
        return False, False
    amx_tile, amx_fp16, avx512 = _cpu_isa()
    onednn = avx512 and onednn_runs_cpu_matmuls_in(dtype)
    return (amx_tile if dtype == torch.bfloat16 else amx_fp16), onednn


def inductor_lays_out_cpu_convolutions_channels_last() -> bool:
    """Whether Inductor runs CPU convolutions channels-last (torch/_inductor/graph.py
    decide_layout_opt: always when oneDNN is available, unless layout optimization is off)."""
    if not _inductor_config.layout_optimization:
        return False
    return bool(_inductor_config.force_layout_optimization
                or (torch.backends.mkldnn.enabled and torch.backends.mkldnn.is_available()))


def onednn_runs_cpu_matmuls_in(dtype: torch.dtype) -> bool:
    """Whether ATen sends CPU bf16/float16 matmuls (mm, addmm) to oneDNN: oneDNN built in and
    enabled, and the CPU with native support for the dtype (ATen's mkldnn_bf16_device_check /
    mkldnn_fp16_device_check: AVX-512 BF16 or AMX for bf16, AVX-512 FP16 or AMX-FP16 for float16).
    There, oneDNN's brgemm allocates a scratchpad (packed copies of the operands) through the
    CPU allocator; ATen also skips oneDNN for products m*k*n <= 16**3, which callers may ignore
    (an over-count)."""
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return False
    return _onednn_supports(dtype)


@functools.lru_cache(maxsize=None)
def _onednn_supports(dtype: torch.dtype) -> bool:
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return False


def inductor_config_text() -> str:
    """Inductor's configuration as text: what its lowering and scheduler read (a plan store key part)."""
    from torch._inductor import config

    def plain(value: object) -> object:
        # a custom pass is known by its uuid (as Inductor's own cache knows it), else by its type
        if isinstance(value, (str, int, float, bool, type(None), list, tuple, dict)):
            return value
        uuid = getattr(value, "uuid", None)
        return uuid() if callable(uuid) else type(value).__qualname__

    return repr(sorted((k, plain(v)) for k, v in config.save_config_portable().items()))
