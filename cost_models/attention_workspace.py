"""Scratch that fused attention kernels allocate and free inside one call: counted from their
kernels where they are read (_kernel_workspace_bytes), else ~0.5x what the op reads and writes
(backward), ~1/16 of it plus 16 KiB (forward)."""

from __future__ import annotations

import torch
import torch.fx as fx

from memcompile import _torch_private as tp
from memcompile.cost_models.cpu_workspace import KIB, round_up
from memcompile.node_facts import tensor_nbytes
from memcompile.sizes import size_value


def _cpu_attention_blocks(seq: int, kv_seq: int) -> tuple[int, int]:
    """The (query rows, key rows) block the CPU flash kernels work on per thread
    (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp: q blocks of 32/64/256 rows from
    sequences of 192/768, key blocks of 512; a shorter sequence is one block)."""
    q_split = 256 if seq >= 768 else 64 if seq >= 192 else 32
    return min(seq, q_split), min(kv_seq, 512)


def _onednn_gemm_scratch(dtype: torch.dtype, q_rows: int, kv_rows: int, head_dim: int) -> int:
    """Scratchpad oneDNN allocates (through the CPU allocator) per thread for the largest of the
    bf16/fp16 flash attention backward's dV/dK (kv_rows x head_dim over q_rows) and dQ (q_rows x
    head_dim over kv_rows) GEMMs; one GEMM's at a time. Not read from oneDNN's source: bounded
    from allocator events (torch 2.13, 1 and 2 threads, ~490 shapes on a Xeon with AMX-BF16
    and AVX512-FP16). bf16: a bf16 copy of the dV/dK GEMM's left operand (its rows blocked by up
    to 256, depth padded to 32) plus 128 B per depth row, or of the dQ GEMM's right operand
    (columns padded to 32); fp16 converts to float32: the dQ GEMM's operands at 64-column
    blocks. The max with 3 B (bf16) per operand element or 12 B per element of the largest
    operand (fp16: three float32 copies) covers the shapes those miss; +16 KiB. Never under on
    those shapes; over by 1.2x to 5.4x on the scratchpad alone (mean 2.2x bf16, 2.6x fp16), 1.1x
    to 2.8x on the op's whole scratch."""
    operands = (q_rows * kv_rows, kv_rows * head_dim, q_rows * head_dim)
    if dtype == torch.bfloat16:
        depth = max(q_rows, 32)
        # fewer query rows than 32 are padded as the depth is (8 rows x 512 keys x 64 measured
        # 1,668 B above the unpadded count)
        operands = (depth * kv_rows, kv_rows * head_dim, depth * head_dim)
        blocked = max(2 * min(round_up(kv_rows, 32), 256) * depth + 128 * depth,
                      2 * kv_rows * round_up(head_dim, 32))
        return max(blocked, 3 * sum(operands)) + 16 * KIB
    blocked = 4 * round_up(kv_rows, 64) * (q_rows + 128) + 128 * q_rows
    return max(blocked, 12 * max(operands)) + 16 * KIB


def attention_backward_onednn_scratch(dtype: torch.dtype, seq: int, kv_seq: int, head_dim: int) -> int:
    """One thread's oneDNN GEMM scratchpad in the CPU flash attention backward; 0 where cpublas
    keeps the block's GEMMs (float32/float64, no oneDNN, or 16^3 multiply-adds or fewer)."""
    if dtype not in (torch.bfloat16, torch.float16) or not tp.cpu_flash_attention_isa(dtype)[1]:
        return 0
    q_split, kv_split = _cpu_attention_blocks(seq, kv_seq)
    if q_split * kv_split * head_dim <= 16 ** 3:
        return 0
    return _onednn_gemm_scratch(dtype, q_split, kv_split, head_dim)


def _kernel_workspace_bytes(node: fx.Node, name: str) -> int | None:
    """What the fused attention kernels allocate besides their results (query: B, H, S, D).

    CPU flash attention (FlashAttentionKernel.cpp), per thread, in the accumulation type
    (float32 for float32/bf16/fp16):
    - forward: the scores of one (q, kv) block, the row maxima and sums, and one q block of the
      output; bf16/fp16 keep the block's scores again in their own type; with AMX (bf16: AMX
      tiles, fp16: AMX-FP16) and 64+ query and key rows, packed copies of the whole K and V
      and a per-thread key block for brgemm (fp16: also the older kernel's 64-column padding,
      not measured);
    - backward: the scores and their gradient for one block (again in bf16/fp16 for those), a
      row of sums per q block; plus a contiguous copy of grad_out when its (B, S, H, D) view is
      not contiguous (the kernel reads it in that layout); bf16/fp16 on AVX-512 CPUs: oneDNN's
      GEMM scratchpads (attention_backward_onednn_scratch).
    Measured on GPT-2 small: 31 KiB in the backward, where half the bytes moved said 1.2 MiB.
    CUDA flash backward (FlashAttention-2's mha_bwd): a float32 accumulator of dQ, rows padded
    to 128 and the head dimension to 32, and the softmax row sums; an H200 allocator snapshot
    showed 32.5 MiB for B=8, H=16, S=1024, D=64, where half the bytes moved said 64 MiB. Head
    dimensions not a multiple of 8 (padded copies of every input), the CUDA forward, and the
    cuDNN and memory-efficient kernels are not read: None, and the caller keeps its rough
    estimate (an over-count, never under)."""
    backward = "backward" in name
    tensors = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in node.args[:4]]
    grad_out, tensors = (tensors[0], tensors[1:]) if backward else (None, tensors)
    if len(tensors) < 2 or not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in tensors[:2]):
        return None
    query, key = tensors[:2]
    if backward and not (isinstance(grad_out, torch.Tensor) and grad_out.dim() == 4):
        return None
    try:
        batch, heads, seq, head_dim = (int(size_value(d)) for d in query.shape)
        kv_seq = int(size_value(key.shape[2]))
    except (TypeError, ValueError):
        return None
    if "for_cpu" not in name:
        if (name.split(".")[0] != "_scaled_dot_product_flash_attention_backward" or head_dim % 8
                or torch.are_deterministic_algorithms_enabled()):  # deterministic: one dQ per split
            return None
        rows = batch * heads * round_up(seq, 128)
        width = round_up(head_dim, 32) if head_dim <= 192 else 256
        return 4 * rows * width + 4 * rows
    q_split, kv_split = _cpu_attention_blocks(seq, kv_seq)
    accum = 8 if query.dtype == torch.float64 else 4
    reduced = query.dtype in (torch.bfloat16, torch.float16)
    itemsize = query.itemsize
    threads = torch.get_num_threads()
    packs = tp.cpu_flash_attention_isa(query.dtype)[0]
    if not backward:
        # AMX repacks K and V (allocator events: bf16 from 64 query and 64 key rows on, at any
        # head count and head dimension; below either, never)
        pack = packs and seq >= 64 and kv_seq >= 64
        # fp16 packs only with AMX-FP16 (not measured): the older kernel's 64-column padding kept
        padded = pack and query.dtype == torch.float16
        kv_cols, width = (round_up(kv_split, 64), round_up(head_dim, 64)) if padded else (kv_split, head_dim)
        per_thread = (q_split * kv_cols + 2 * q_split + q_split * width) * accum
        if reduced:  # the block's scores again in bf16/fp16 (key columns rounded up to even when packed)
            per_thread += q_split * (round_up(kv_cols, 2) if pack else kv_cols) * itemsize
        total = threads * per_thread
        if pack:  # K as it is, V with each key block rounded up to even rows (VNNI pairs), and a
            # per-thread staging copy of one key block
            even_d = round_up(head_dim, 2)
            v_rows = (kv_seq - 1) // kv_split * round_up(kv_split, 2) + round_up((kv_seq - 1) % kv_split + 1, 2)
            total += batch * heads * (kv_seq * even_d + v_rows * round_up(width, 2)) * itemsize
            total += threads * round_up(kv_split, 2) * even_d * itemsize
        return total + _attention_margin(query.dtype)
    per_thread = 2 * q_split * kv_split * (accum + (itemsize if reduced else 0)) + q_split * accum
    # every thread is counted a scratchpad although at::parallel_for may run a few (batch, head)
    # items on one thread only: an over-count of up to (threads - 1) scratchpads, never under
    per_thread += attention_backward_onednn_scratch(query.dtype, seq, kv_seq, head_dim)
    try:
        contiguous = bool(grad_out.transpose(1, 2).is_contiguous())
    except Exception:  # noqa: BLE001 - symbolic strides: assume the copy
        contiguous = False
    copy = 0 if contiguous else tensor_nbytes(grad_out)
    return threads * per_thread + copy + _attention_margin(query.dtype)


def _attention_margin(dtype: torch.dtype) -> int:
    """float32: none, the count above is what the allocator sees (250 random shapes, 1 and 2
    threads: exact at 1, up to 1 KiB over at 2); other dtypes keep 1 KiB (bf16/fp16's oneDNN
    scratch is a fitted bound; float64 not measured)."""
    return 0 if dtype == torch.float32 else KIB


def attention_workspace_bytes(node: fx.Node) -> int:
    """Bytes a scaled-dot-product attention kernel allocates and frees inside itself: counted
    where its kernel is read, else a rough over-count from the bytes it moves."""
    name = str(getattr(node.target, "__name__", node.target))
    known = _kernel_workspace_bytes(node, name)
    if known is not None:
        return known
    moved = sum(tensor_nbytes(i.meta.get("val")) for i in node.all_input_nodes)
    moved += tensor_nbytes(node.meta.get("val"))
    return moved // 2 if "backward" in name else moved // 16 + 16 * KIB
