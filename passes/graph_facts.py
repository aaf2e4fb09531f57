"""Small facts about FX nodes that several passes and cost models read."""

from __future__ import annotations

import copy
import operator
import os

import torch
import torch.fx as fx

from memcompile import _torch_private as tp
from memcompile import loss_ops, mlp_ops
from memcompile.cost_models.cpu_workspace import ONEDNN_SCRATCH_CAP_BYTES
from memcompile.sizes import size_value


def tensor_nbytes(value: object) -> int:
    """Bytes of a tensor (or of the tensors in a tuple/list); symbolic sizes: see memcompile.sizes."""
    if isinstance(value, torch.Tensor):
        # symbolic sizes: the sizes being planned for (memcompile.sizes), else the traced ones
        return size_value(value.numel()) * value.dtype.itemsize
    if isinstance(value, (tuple, list)):
        return sum(tensor_nbytes(v) for v in value)
    return 0


def is_aliasing_op(node: fx.Node) -> bool:
    """True when the op's first output shares storage with its first input (views, in-place writes)."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None or not schema.returns:
        return False
    return schema.returns[0].alias_info is not None


def is_getitem(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem


def _argument(node: fx.Node, name: str, default: object = None) -> object:
    """An op argument by schema name, whether passed by position or keyword."""
    if name in node.kwargs:
        return node.kwargs[name]
    schema = getattr(node.target, "_schema", None)
    for position, argument in enumerate(schema.arguments if schema else ()):
        if argument.name == name:
            return node.args[position] if position < len(node.args) else argument.default_value
    return default


def is_random_op(node: fx.Node) -> bool:
    """Ops whose result depends on the RNG state: recomputing them would change the values.

    Attention kernels are tagged random because of their dropout; with dropout_p == 0 they are
    deterministic and may be recomputed.
    """
    tags = getattr(node.target, "tags", ())
    if torch.Tag.nondeterministic_seeded not in tags:
        return False
    if "scaled_dot_product" in str(node.target):
        return _argument(node, "dropout_p", 0.0) not in (0, 0.0)
    return True


def is_mutating_op(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is not None and schema.is_mutable


def is_pointwise(node: fx.Node) -> bool:
    return node.op == "call_function" and torch.Tag.pointwise in getattr(node.target, "tags", ())


def effective_reads(node: fx.Node, inlined: frozenset | set, either: frozenset | set = frozenset()) -> list[fx.Node]:
    """The buffers `node` reads once inlined producers are fused into it: an inlined producer is
    replaced by what it reads; an `either` producer (maybe inlined) counts as both."""
    out, stack, seen = [], list(node.all_input_nodes), set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in inlined or n in either:
            stack.extend(n.all_input_nodes)
        if n not in inlined:
            out.append(n)
    return out


def step_device(inputs: object) -> str:
    """The accelerator a step runs on: the type of the first non-CPU tensor among `inputs`
    (nested as AOTAutograd passes them, (primals, tangents)), else "cpu". A CPU scalar input (a
    seed, a step count) beside device tensors does not make the step a CPU one."""
    pending = [inputs]
    while pending:
        x = pending.pop(0)
        if isinstance(x, torch.Tensor):
            if x.device.type != "cpu":
                return x.device.type
        elif isinstance(x, (list, tuple)):
            pending[:0] = x
        elif isinstance(x, dict):
            pending[:0] = x.values()
    return "cpu"


def graph_device_type(gm: fx.GraphModule) -> str:
    """The device type of the graph's tensors (see step_device; "cpu" when it has none)."""
    return step_device([node.meta.get("val") for node in gm.graph.nodes])


def _needs_dense_input(node: fx.Node) -> bool:
    """Ops that run as library kernels (matmul, convolution, ...) rather than generated loops."""
    return (node.op == "call_function" and not is_pointwise(node) and not is_aliasing_op(node)
            and not is_getitem(node) and node.target is not operator.getitem)


def _is_strided_view(value: object) -> bool:
    """A view a library kernel cannot read in place: neither contiguous nor a transpose of it."""
    if not isinstance(value, torch.Tensor) or value.dim() < 2:
        return False
    if value.is_contiguous() or value.transpose(-1, -2).is_contiguous():
        return False
    return True


def layout_copy_bytes(node: fx.Node) -> int:
    """Bytes of the dense copies a library kernel makes of strided-view inputs while it runs."""
    if not _needs_dense_input(node):
        return 0
    total = 0
    for inp in node.all_input_nodes:
        if is_aliasing_op(inp) or is_getitem(inp):
            value = inp.meta.get("val")
            if _is_strided_view(value):
                total += tensor_nbytes(value)
    return total


# Scratch that library kernels allocate while they run. Convolutions on CPU (float32: oneDNN):
# see _conv_workspace_cpu. On other devices (cuDNN; not measured) the old fit to CPU allocator
# events stands: forward ~2x its output, backward ~4x its input plus a fixed ~29 KiB. Flash
# attention: counted from its kernels where they are read (_attention_workspace), else ~0.5x what
# it reads and writes (backward), ~1/16 plus 16 KiB (forward).
_KIB = 1024
# oneDNN's blocked layouts (nChw16c, OIhw16i16o) pad channels to 16 on AVX-512 CPUs; AVX2 uses
# blocks of 8, counted as 16 here (up to 2x over for layers under 16 channels). The old fit
# (backward 4x the input) is what 8-channel blocks give a 4-channel layer: on AVX-512 the same
# layer's blocked copies are 4x each, and the backward holds two of them at once.
_CONV_CHANNEL_BLOCK = 16
_BF16_CONV_SCRATCH_PER_THREAD = 48 * _KIB


def onednn_channel_block() -> int:
    """The channel block of oneDNN's convolution kernels on this CPU: 16 with AVX-512, 8 below
    (AVX2). Read from ATen's CPU capability, capped by oneDNN's own ISA switch where it is set
    (ONEDNN_MAX_CPU_ISA / DNNL_MAX_CPU_ISA, e.g. "AVX2": what tests use to model AVX2 CPUs)."""
    capped = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")
    if capped and capped.upper() != "ALL" and "512" not in capped:
        return 8
    return 16 if "AVX512" in torch.backends.cpu.get_cpu_capability() else 8


def _conv_workspace_guess(node: fx.Node) -> int:
    values = [a.meta.get("val") if isinstance(a, fx.Node) else None for a in node.args[:2]]
    if "backward" in str(node.target):
        inp = values[1]
        return 4 * tensor_nbytes(inp) + 32 * _KIB
    return 2 * tensor_nbytes(node.meta.get("val")) + 16 * _KIB


def _conv_workspace_cpu(node: fx.Node, channels_last: bool = False) -> int:
    """What oneDNN's convolution allocates on CPU besides the op's results (torch 2.13, float32,
    allocator events over batch 2-16, channels 3-64, sizes 8-32, kernels 1 and 3, strides 1
    and 2, 1 and 2 threads, AVX-512 and AVX2 (ONEDNN_MAX_CPU_ISA=AVX2 on an AVX-512 CPU gives
    the AVX2 machines' numbers exactly): never under, tests/test_conv_workspace.py). Channels padded to the
    block (`ci`, `co`); `src`, `dst`, `wei`: blocked copies of input, output and weights.
    Channels-last tensors (`channels_last`: Inductor's layout on CPU, or the input's strides) are
    read and written as they are: only the weights are blocked, forward one copy, backward one
    per thread plus the blocked weight gradient. Contiguous (NCHW) ones are copied to blocks:
    - forward: src (not for a thin input read by a direct kernel: fewer channels than the
      block of this CPU, kernel > 1), wei, bias and dst at once; then dst and the plain result.
      Channels-last on AVX2: also 8 output columns' input rows per thread (c_in x kernel x 8).
    - backward, input gradient: blocked grad_output, wei and the blocked input gradient at once;
      then that and the plain input gradient; with strides > 1 two more input-sized copies.
    - backward, weight gradient: the input gradient (already made), src, blocked grad_output and
      one wei + bias per thread (reduced at the end); or blocked and plain weight gradients.
    Strided 1x1 kernels copy the strided input per thread first (`rtus`); small fixed scratchpads
    on top (per thread in the backward: ~37 KiB seen with strides > 1, up to ~20 KiB with
    2 threads without). Grouped, dilated and transposed convolutions were not measured (the
    same count is assumed)."""
    backward = "backward" in str(node.target)
    args = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in node.args]
    if backward:
        out, inp, weight = args[:3]
        stride = args[4]
        mask = args[10] if len(args) > 10 else (True, True, True)
    else:
        inp, weight = args[:2]
        out = node.meta.get("val")
        stride = args[3] if len(args) > 3 else (1,)
    itemsize = inp.dtype.itemsize
    batch, c_in, c_out = (size_value(d) for d in (inp.shape[0], inp.shape[1], out.shape[1]))
    space_in = size_value(inp.numel()) // max(1, batch * c_in)
    space_out = size_value(out.numel()) // max(1, batch * c_out)
    kernel = 1
    for k in weight.shape[2:]:
        kernel *= size_value(k)
    ci, co = (_round_up(c, _CONV_CHANNEL_BLOCK) for c in (c_in, c_out))
    src, dst = batch * ci * space_in * itemsize, batch * co * space_out * itemsize
    wei = _round_up(size_value(weight.shape[0]), _CONV_CHANNEL_BLOCK) * _round_up(
        size_value(weight.shape[1]), _CONV_CHANNEL_BLOCK) * kernel * itemsize
    bias = co * itemsize
    threads = torch.get_num_threads()
    strided = any(size_value(s) > 1 for s in stride)
    block = onednn_channel_block()
    if channels_last or _is_channels_last(inp):
        if not backward:
            # AVX2's kernels gather each thread's input rows for 8 output columns at once.
            rows = 8 * c_in * kernel * itemsize if block < _CONV_CHANNEL_BLOCK else 0
            return wei + bias + threads * (16 * _KIB + rows)
        return (1 + threads) * (wei + bias) + threads * (96 if strided else 32) * _KIB
    rtus = min(batch, threads) * max(ci, co) * min(space_in, space_out) * itemsize if strided else 0
    if not backward:
        result = tensor_nbytes(out)
        thin = c_in < block and kernel > 1
        return max(rtus + (0 if thin else src) + wei + bias + dst - result, dst) + 16 * _KIB
    results = tensor_nbytes(node.meta.get("val"))  # the gradients asked for (None where masked)
    grad_input = tensor_nbytes(inp) if mask[0] else 0
    blocked_grad = max(src, grad_input)
    data = max(dst + wei, grad_input) + blocked_grad + (2 * grad_input if strided else 0) if mask[0] else 0
    grads = results - grad_input
    weights = grad_input + max(rtus + src + dst + threads * (wei + bias), wei + bias + grads) if (
        mask[1] or mask[2]) else 0
    scratchpads = threads * (56 if strided else 16) * _KIB
    return max(0, max(data, weights) - results) + scratchpads


def _is_channels_last(value: torch.Tensor) -> bool:
    """A 4-d/5-d tensor with channels innermost, and not as well contiguous (one channel, one
    position: then oneDNN may block it). From planning sizes: no guards on symbolic strides."""
    if value.dim() not in (4, 5):
        return False
    sizes = [size_value(d) for d in value.shape]
    strides = [size_value(d) for d in value.stride()]
    positions = 1
    for d in sizes[2:]:
        positions *= d
    return sizes[1] > 1 and positions > 1 and strides[1] == 1 and strides[-1] == sizes[1]


def _im2col_bytes(node: fx.Node) -> int:
    """The column buffer of a convolution lowered to matmul (CPU without oneDNN, e.g. float64):
    batch x input channels x kernel elements x output positions."""
    args = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in node.args[:3]]
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if "backward" in str(node.target):
        grad_out, inp, weight = tensors[:3]
        out_shape = grad_out.shape
    else:
        inp, weight = tensors[:2]
        out = node.meta.get("val")
        out_shape = out.shape if isinstance(out, torch.Tensor) else inp.shape
    kernel = 1
    for k in weight.shape[2:]:
        kernel *= int(k)
    positions = 1
    for p in out_shape[2:]:
        positions *= int(p)
    return int(inp.shape[0]) * int(inp.shape[1]) * kernel * positions * inp.dtype.itemsize


_GEMMS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
                        torch.ops.aten.baddbmm.default}
# Per thread, oneDNN's float16/bfloat16 GEMMs on CPU allocate scratch (converted or packed blocks)
# from the CPU allocator, sized by one GEMM (not the batch) and bounded by its blocking. Allocator
# events, torch 2.13, Xeon with AVX512-FP16 and AMX-BF16, 1 and 2 threads (exactly per thread),
# m, k, n from 16 to 4096: float16 up to 6.7 B per element of A, B and C (16x768x16) and 1.7 MB
# (1024^3); bfloat16 up to 2.7 B (40x16x48) and 1.05 MB (3.5 MB at 1024 x 4096 x 32000). Counted
# with margin: c x elements, capped as cost_models/cpu_workspace.py caps it (grows with k), plus 8 KiB. float32: none.
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


def _low_precision_gemm_scratch(node: fx.Node) -> int:
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
    return torch.get_num_threads() * (per_thread + 8 * _KIB)


def counted_exactly(node: fx.Node) -> bool:
    """A library call whose transient memory kernel_workspace_bytes counts exactly (or from
    above), so the check over Inductor's schedule needs no per-op margin there (at a partition's
    measured peak, 4 KiB too many is a rejected plan):
    - a float32 matrix multiply whose operands are contiguous or transposed-contiguous: BLAS
      reads them as they are, and MKL's buffers are its own (GPT-2 small's stock partitions
      peaked at a backward mm: predicted to the byte). Not float16/bfloat16: their oneDNN
      scratch is a bound fitted to measurements;
    - CPU flash attention in float32, forward or backward (_attention_workspace, exact on 250
      random shapes; GPT-2's activation_memory_budget=0.8 partition peaks at one)."""
    out = node.meta.get("val")
    name = str(getattr(node.target, "__name__", node.target))
    if "_scaled_dot_product_flash_attention_for_cpu" in name:
        query = node.args[1 if "backward" in name else 0]
        query = query.meta.get("val") if isinstance(query, fx.Node) else None
        return isinstance(query, torch.Tensor) and query.dtype == torch.float32
    if node.target not in _GEMMS or not isinstance(out, torch.Tensor) or out.dtype in _GEMM_SCRATCH_PER_ELEMENT:
        return False
    operands = [a.meta.get("val") if isinstance(a, fx.Node) else None for a in node.args[-2:]]
    try:
        return len(operands) == 2 and all(
            isinstance(t, torch.Tensor) and t.dim() >= 2 and (t.is_contiguous() or t.transpose(-1, -2).is_contiguous())
            for t in operands)
    except Exception:  # noqa: BLE001 - symbolic strides that cannot be decided: assume a copy
        return False


def kernel_workspace_bytes(node: fx.Node, inductor: bool = False) -> int:
    """Bytes a library kernel allocates and frees inside itself while `node` runs. `inductor`:
    the graph runs as Inductor's code, which lays CPU convolutions out channels-last."""
    if node.op != "call_function":
        return 0
    if node.target in (loss_ops.FORWARD, mlp_ops.FORWARD, mlp_ops.BACKWARD):
        args = tuple(a.meta.get("val") if isinstance(a, fx.Node) else a for a in node.args)
        ops = loss_ops if node.target is loss_ops.FORWARD else mlp_ops
        return ops.workspace_bytes(node.target, args)
    name = str(getattr(node.target, "__name__", node.target))
    if "scaled_dot_product" in name:
        known = _attention_workspace(node, name)
        if known is not None:
            return known
        moved = sum(tensor_nbytes(i.meta.get("val")) for i in node.all_input_nodes)
        moved += tensor_nbytes(node.meta.get("val"))
        return moved // 2 if "backward" in name else moved // 16 + 16 * _KIB
    if node.target in _GEMMS:
        return _low_precision_gemm_scratch(node)
    if "_unsafe_masked_index_put_accumulate" in name and not inductor:
        # The embedding backward's decomposition, run eagerly (Inductor lowers it to a scatter):
        # ATen clamps a copy of the indices, inverts the mask and masks a copy of the values
        # before accumulating (torch 2.13, CPU allocator events: 16,896 B beside the 8 KiB result
        # for GPT-2 tiny's position embedding, which measured 12.5 KiB over its floor uncounted).
        return sum(tensor_nbytes(i.meta.get("val")) for i in node.all_input_nodes[1:])
    if "convolution" not in name:
        return 0
    value = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], fx.Node) else None
    if not isinstance(value, torch.Tensor):
        return 4 * sum(tensor_nbytes(i.meta.get("val")) for i in node.all_input_nodes)
    try:
        if value.device.type != "cpu":
            return _conv_workspace_guess(node)
        # bf16/fp16 convolutions on CPU took the im2col path on our machine (no native bf16
        # ISA): columns of 9x the output for a 3x3 kernel; with oneDNN's bf16 kernels it would be
        # less. float64 takes it always (no oneDNN kernel).
        channels_last = inductor and tp.inductor_lays_out_cpu_convolutions_channels_last()
        if value.dtype in (torch.bfloat16, torch.float16):
            counted = max(_conv_workspace_cpu(node, channels_last), _im2col_bytes(node) + 32 * _KIB)
            # bf16 on a CPU with AMX-BF16 runs oneDNN's native kernels, whose per-thread scratchpads
            # dominate small convolutions: 4x4x8x8 measured 75 KB forward / 95 KB backward at 2
            # threads where the count said 51 / 58 KB (test_autocast's convbn, 18 KB over budget).
            return counted + (torch.get_num_threads() * _BF16_CONV_SCRATCH_PER_THREAD
                              if value.dtype == torch.bfloat16 else 0)
        if value.dtype == torch.float32:
            return _conv_workspace_cpu(node, channels_last)
        return _im2col_bytes(node) + 32 * _KIB
    except (ValueError, IndexError, TypeError, AttributeError):  # unexpected signature: assume a lot
        return 4 * sum(tensor_nbytes(i.meta.get("val")) for i in node.all_input_nodes)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


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
        blocked = max(2 * min(_round_up(kv_rows, 32), 256) * depth + 128 * depth,
                      2 * kv_rows * _round_up(head_dim, 32))
        return max(blocked, 3 * sum(operands)) + 16 * _KIB
    blocked = 4 * _round_up(kv_rows, 64) * (q_rows + 128) + 128 * q_rows
    return max(blocked, 12 * max(operands)) + 16 * _KIB


def attention_backward_onednn_scratch(dtype: torch.dtype, seq: int, kv_seq: int, head_dim: int) -> int:
    """One thread's oneDNN GEMM scratchpad in the CPU flash attention backward; 0 where cpublas
    keeps the block's GEMMs (float32/float64, no oneDNN, or 16^3 multiply-adds or fewer)."""
    if dtype not in (torch.bfloat16, torch.float16) or not tp.cpu_flash_attention_isa(dtype)[1]:
        return 0
    q_split, kv_split = _cpu_attention_blocks(seq, kv_seq)
    if q_split * kv_split * head_dim <= 16 ** 3:
        return 0
    return _onednn_gemm_scratch(dtype, q_split, kv_split, head_dim)


def _attention_workspace(node: fx.Node, name: str) -> int | None:
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
        rows = batch * heads * _round_up(seq, 128)
        width = _round_up(head_dim, 32) if head_dim <= 192 else 256
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
        kv_cols, width = (_round_up(kv_split, 64), _round_up(head_dim, 64)) if padded else (kv_split, head_dim)
        per_thread = (q_split * kv_cols + 2 * q_split + q_split * width) * accum
        if reduced:  # the block's scores again in bf16/fp16 (key columns rounded up to even when packed)
            per_thread += q_split * (_round_up(kv_cols, 2) if pack else kv_cols) * itemsize
        total = threads * per_thread
        if pack:  # K as it is, V with each key block rounded up to even rows (VNNI pairs), and a
            # per-thread staging copy of one key block
            even_d = _round_up(head_dim, 2)
            v_rows = (kv_seq - 1) // kv_split * _round_up(kv_split, 2) + _round_up((kv_seq - 1) % kv_split + 1, 2)
            total += batch * heads * (kv_seq * even_d + v_rows * _round_up(width, 2)) * itemsize
            total += threads * _round_up(kv_split, 2) * even_d * itemsize
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
    return 0 if dtype == torch.float32 else _KIB


def promotion_copy_bytes(node: fx.Node) -> int:
    """Bytes of the converted copies a pointwise op makes of inputs whose dtype is not the one it
    computes in (CPU TensorIterator materialises them: `bool_mask * x` allocates a float copy
    of the mask, measured with torch 2.13), plus the product `prims.fma` (a*b + c) materialises
    when it runs eagerly."""
    if not is_pointwise(node):
        return 0
    out = node.meta.get("val")
    if not isinstance(out, torch.Tensor):
        return 0
    if "fma" in str(node.target):
        return tensor_nbytes(out)
    inputs = [i.meta.get("val") for i in node.all_input_nodes]
    if "where" in str(node.target):
        inputs = inputs[1:]  # the condition is read as it is
    tensors = [t for t in inputs if isinstance(t, torch.Tensor) and t.dim() > 0]
    if len(tensors) < 2:
        return 0
    common = tensors[0].dtype
    for t in tensors[1:]:
        common = torch.promote_types(common, t.dtype)
    return sum(t.numel() * common.itemsize for t in tensors if t.dtype != common and isinstance(t.numel(), int))


def transient_bytes(node: fx.Node, inductor: bool = False) -> int:
    """Memory `node` needs only while it runs: kernel workspaces, dense copies of views and
    converted copies of mixed-dtype inputs (`inductor`: see kernel_workspace_bytes)."""
    return kernel_workspace_bytes(node, inductor) + layout_copy_bytes(node) + promotion_copy_bytes(node)


# -- what the user and torch say about a node --------------------------------------------------

_BUILTIN_NAMESPACES = ("aten", "prims")


def is_builtin_op(node: fx.Node) -> bool:
    """An aten/prims operator overload (what AOTAutograd decomposes to). Custom ops
    (torch.library), higher-order ops and plain Python callables are not: their purity, their
    use of the random generator and their cost are unknown to us."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    namespace = getattr(node.target, "namespace", None)
    return hasattr(node.target, "_schema") and namespace in _BUILTIN_NAMESPACES


def checkpoint_policy(node: fx.Node) -> str:
    """The user's activation-checkpoint policy for `node` ("" when none): "MUST_SAVE",
    "PREFER_SAVE", "MUST_RECOMPUTE", "PREFER_RECOMPUTE", "MUST_CPU_OFFLOAD", "PREFER_CPU_OFFLOAD".

    torch.utils.checkpoint regions and selective-checkpoint policies reach the joint graph as
    `node.meta["recompute"]` (a CheckpointPolicy; plain `checkpoint()` tags PREFER_RECOMPUTE).
    Torch also forces some nodes to MUST_SAVE (boundaries between consecutive checkpoint regions,
    effectful ops, sources of backward mutations): those are hard too.
    """
    tag = node.meta.get("recompute")
    if tag is None:
        return ""
    name = getattr(tag, "name", None) or str(tag).rsplit(".", 1)[-1]
    return name


# -- what Inductor does with a node (facts for passes/fusion.py) ------------------------------

# Lowered to Pointwise bodies though not tagged pointwise (torch/_inductor/lowering.py: dtype
# conversions, copies, constant fills, indexing loads).
_POINTWISE_LOWERINGS = frozenset({
    "convert_element_type", "clone", "_to_copy", "full", "full_like", "scalar_tensor", "iota",
    "embedding", "index", "gather", "constant_pad_nd", "where", "masked_fill", "_unsafe_index",
    "zeros_like", "ones_like", "fill", "slice_scatter",
})
# Lowered with make_reduction (realized unless unrolled: reductions over <= 8 elements).
_REDUCTIONS = frozenset({
    "sum", "mean", "amax", "amin", "argmax", "argmin", "prod", "var_mean", "var", "std", "any",
    "all", "max", "min", "logsumexp", "std_mean",
})
# Computed into a fresh buffer like a reduction: `scatter(x, ...)` lowers to `scatter_(clone(x), ...)`
# (the clone is realized, x's body inlined into it; src and index are loaded inline), index_put the
# same; not the fallback cases of utils.use_scatter_fallback (reduce other than add/sum, GPU
# atomics), which these are not.
_SCATTERS = frozenset({"scatter", "scatter_add", "index_put", "_unsafe_index_put"})
# Lowered as a copy of their first input that the op then writes into (torch/_inductor/lowering.py:
# `index_put(x, ...)` is `index_put_impl_(clone(x), ...)`, `_unsafe_masked_index_put_accumulate` an
# `_unsafe_index_put`, the scatters likewise): the copy's kernel may take over x's buffer where x
# dies there (scheduler.decide_inplace_update), as the accumulate of an embedding's gradient does.
_WRITE_OVER_A_COPY = _SCATTERS | {"scatter_reduce", "_unsafe_masked_index_put_accumulate", "as_strided_scatter"}
_UNROLL_REDUCTIONS_THRESHOLD = 8  # torch/_inductor/config.py unroll_reductions_threshold
# Library kernels with a lowering that still need realized inputs (tuned_addmm's mm_args).
_EXTERN_WITH_LOWERING = frozenset({"addmm", "baddbmm", "_int_mm", "mm", "bmm", "convolution",
                                   "convolution_backward"})


def _packet_name(node: fx.Node) -> str:
    packet = getattr(node.target, "overloadpacket", None)
    return getattr(packet, "__name__", "") or str(getattr(node.target, "__name__", node.target)).split(".")[0]


def writes_over_a_copy_of_its_first_input(node: fx.Node) -> bool:
    """Whether Inductor lowers `node` as a copy of its first argument written into in place
    (_WRITE_OVER_A_COPY), so that the copy may reuse that argument's buffer where it dies."""
    return node.op == "call_function" and _packet_name(node) in _WRITE_OVER_A_COPY


def _is_small_reduction(node: fx.Node) -> bool:
    inp = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], fx.Node) else None
    out = node.meta.get("val")
    if isinstance(out, (tuple, list)):
        out = out[0] if out else None
    if not isinstance(inp, torch.Tensor) or not isinstance(out, torch.Tensor):
        return False
    outn = max(1, size_value(out.numel()))
    return size_value(inp.numel()) <= _UNROLL_REDUCTIONS_THRESHOLD * outn


def fusion_kind(node: fx.Node, lowered: frozenset, fallbacks: frozenset, realizes_inputs: frozenset) -> tuple[str, bool]:
    """(kind for passes/fusion.py, whether Inductor realizes the node's inputs)."""
    from memcompile.passes import fusion

    if node.op == "placeholder":
        return fusion.INPUT, False
    if is_getitem(node):
        return fusion.MEMBER, False
    if node.op != "call_function":
        return fusion.EXTERN, True
    name = _packet_name(node)
    needs_realized = node.target in realizes_inputs
    if is_mutating_op(node):
        return fusion.EXTERN, True
    if is_aliasing_op(node):
        return fusion.VIEW, needs_realized
    if (node.target in fallbacks or needs_realized or name in _EXTERN_WITH_LOWERING
            or getattr(node.target, "overloadpacket", None) is None or node.target not in lowered):
        return fusion.EXTERN, True
    if isinstance(node.meta.get("val"), (tuple, list)) and name not in _REDUCTIONS:
        return fusion.EXTERN, True  # multi-output lowerings we do not model (sort, topk, ...)
    if is_pointwise(node) or name in _POINTWISE_LOWERINGS:
        return fusion.POINTWISE, False
    if name in _REDUCTIONS:
        return (fusion.SMALL_REDUCTION if _is_small_reduction(node) else fusion.REDUCTION), False
    if name in _SCATTERS and _argument(node, "reduce", None) is None:
        return fusion.REDUCTION, False
    return fusion.OTHER, False


# Library kernels Inductor calls with an `out=` buffer its wrapper allocates (extern_kernels.mm
# etc.); other fallbacks allocate their results themselves.
_OUT_VARIANT_EXTERNS = frozenset({"mm", "addmm", "bmm", "baddbmm"})


def wrapper_allocates(kind: str, node: fx.Node) -> bool:
    """Whether Inductor's wrapper allocates `node`'s result (then it may reuse a freed buffer)."""
    from memcompile.passes import fusion

    if kind in (fusion.POINTWISE, fusion.REDUCTION, fusion.SMALL_REDUCTION, fusion.OTHER):
        return True
    return kind == fusion.EXTERN and _packet_name(node) in _OUT_VARIANT_EXTERNS


def fusion_facts(gm: fx.GraphModule, forced_outputs: set | frozenset = frozenset()) -> tuple:
    """The plain facts passes/fusion.py predicts Inductor's buffers from, in graph order.
    `forced_outputs`: nodes to treat as graph outputs too (a joint graph's saved activations)."""
    from memcompile import _torch_private as tp
    from memcompile.passes.fusion import HEAVY_OPS, OpFacts

    lowered, fallbacks, realizes_inputs = tp.inductor_lowering_facts()
    out = gm.graph.find_nodes(op="output")[0]
    outputs = set(out.all_input_nodes) | set(forced_outputs)
    facts = []
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        kind, realizes = fusion_kind(node, lowered, fallbacks, realizes_inputs)
        tensor_inputs = tuple(a.name for a in _flat_args(node) if isinstance(a, fx.Node))
        constants = sum(1 for a in _flat_args(node) if isinstance(a, (int, float, bool)) and not isinstance(a, fx.Node))
        facts.append(OpFacts(node.name, kind, tensor_inputs, constants if kind != "view" else 0,
                             node in outputs, _packet_name(node) in HEAVY_OPS, realizes))
    return tuple(facts)


def _flat_args(node: fx.Node) -> list:
    flat: list = []
    for a in list(node.args) + list(node.kwargs.values()):
        if isinstance(a, (tuple, list)):
            flat.extend(a)
        else:
            flat.append(a)
    return flat


def rewritten_copy(gm: fx.GraphModule, matches: tuple, rewrite) -> fx.GraphModule:
    """A copy of `gm` with `rewrite(graph, match, nodes by name)` applied to each match (found by
    node name in `gm`): the shared step of the Dynamo-graph rewrites (passes/loss_head.py,
    passes/mlp_chunk.py)."""
    out = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    by_name = {n.name: n for n in out.graph.nodes}
    for match in matches:
        rewrite(out.graph, match, by_name)
    out.graph.lint()
    out.recompile()
    return out


def node_adder(graph: fx.Graph, like: fx.Node):
    """add(op, target, args): a node in `graph` carrying `like`'s metadata but its values (the
    rewrite's new nodes are traced again by AOTAutograd), and its own fake `example_value` where
    its inputs have theirs (as Dynamo's nodes do: AOTAutograd's cache reads them)."""
    meta = {k: v for k, v in like.meta.items() if k not in ("example_value", "val", "tensor_meta")}

    def add(op: str, target, args: tuple) -> fx.Node:
        node = graph.create_node(op, target, args, {})
        node.meta.update(meta)
        value = tp.example_value_of(op, target, args)
        if value is not None:
            node.meta["example_value"] = value
        return node

    return add


def static_shape(node: object) -> tuple[int, ...] | None:
    """A Dynamo graph node's shape where every size is an int (its fake example value's); else None."""
    value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    if not isinstance(value, torch.Tensor):
        return None
    shape = tuple(value.shape)
    return shape if all(isinstance(s, int) for s in shape) else None
