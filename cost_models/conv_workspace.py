"""Scratch that convolution kernels allocate and free inside one call (fitted bounds).

On CPU (float32: oneDNN) see _conv_workspace_cpu; bfloat16/float16 take the larger of that and
im2col's columns; float64 im2col. On other devices (cuDNN; not measured) the old fit to CPU
allocator events stands: forward ~2x its output, backward ~4x its input plus a fixed ~29 KiB."""

from __future__ import annotations

import torch
import torch.fx as fx

from memcompile import _torch_private as tp
from memcompile.cost_models.cpu_workspace import KIB, onednn_max_cpu_isa_settings, round_up
from memcompile.node_facts import tensor_nbytes
from memcompile.sizes import size_value

# oneDNN's blocked layouts (nChw16c, OIhw16i16o) pad channels to 16 on AVX-512 CPUs; AVX2 uses
# blocks of 8, counted as 16 here (up to 2x over for layers under 16 channels). The old fit
# (backward 4x the input) is what 8-channel blocks give a 4-channel layer: on AVX-512 the same
# layer's blocked copies are 4x each, and the backward holds two of them at once.
_CONV_CHANNEL_BLOCK = 16
_BF16_CONV_SCRATCH_PER_THREAD = 48 * KIB


def onednn_channel_block() -> int:
    """The channel block of oneDNN's convolution kernels on this CPU: 16 with AVX-512, 8 below
    (AVX2). Read from ATen's CPU capability, capped by oneDNN's own ISA switch where it is set
    (onednn_max_cpu_isa_settings)."""
    onednn_cap, dnnl_cap = onednn_max_cpu_isa_settings()
    capped = onednn_cap or dnnl_cap
    if capped and capped.upper() != "ALL" and "512" not in capped:
        return 8
    return 16 if "AVX512" in torch.backends.cpu.get_cpu_capability() else 8


def _conv_workspace_guess(node: fx.Node) -> int:
    values = [a.meta.get("val") if isinstance(a, fx.Node) else None for a in node.args[:2]]
    if "backward" in str(node.target):
        inp = values[1]
        return 4 * tensor_nbytes(inp) + 32 * KIB
    return 2 * tensor_nbytes(node.meta.get("val")) + 16 * KIB


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
    ci, co = (round_up(c, _CONV_CHANNEL_BLOCK) for c in (c_in, c_out))
    src, dst = batch * ci * space_in * itemsize, batch * co * space_out * itemsize
    wei = round_up(size_value(weight.shape[0]), _CONV_CHANNEL_BLOCK) * round_up(
        size_value(weight.shape[1]), _CONV_CHANNEL_BLOCK) * kernel * itemsize
    bias = co * itemsize
    threads = torch.get_num_threads()
    strided = any(size_value(s) > 1 for s in stride)
    block = onednn_channel_block()
    if channels_last or _is_channels_last(inp):
        if not backward:
            # AVX2's kernels gather each thread's input rows for 8 output columns at once.
            rows = 8 * c_in * kernel * itemsize if block < _CONV_CHANNEL_BLOCK else 0
            return wei + bias + threads * (16 * KIB + rows)
        return (1 + threads) * (wei + bias) + threads * (96 if strided else 32) * KIB
    rtus = min(batch, threads) * max(ci, co) * min(space_in, space_out) * itemsize if strided else 0
    if not backward:
        result = tensor_nbytes(out)
        thin = c_in < block and kernel > 1
        return max(rtus + (0 if thin else src) + wei + bias + dst - result, dst) + 16 * KIB
    results = tensor_nbytes(node.meta.get("val"))  # the gradients asked for (None where masked)
    grad_input = tensor_nbytes(inp) if mask[0] else 0
    blocked_grad = max(src, grad_input)
    data = max(dst + wei, grad_input) + blocked_grad + (2 * grad_input if strided else 0) if mask[0] else 0
    grads = results - grad_input
    weights = grad_input + max(rtus + src + dst + threads * (wei + bias), wei + bias + grads) if (
        mask[1] or mask[2]) else 0
    scratchpads = threads * (56 if strided else 16) * KIB
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


def convolution_workspace_bytes(node: fx.Node, inductor: bool = False) -> int:
    """Bytes a convolution kernel (forward or backward) allocates and frees inside itself.
    `inductor`: the graph runs as Inductor's code, which lays CPU convolutions out channels-last."""
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
            counted = max(_conv_workspace_cpu(node, channels_last), _im2col_bytes(node) + 32 * KIB)
            # bf16 on a CPU with AMX-BF16 runs oneDNN's native kernels, whose per-thread scratchpads
            # dominate small convolutions: 4x4x8x8 measured 75 KB forward / 95 KB backward at 2
            # threads where the count said 51 / 58 KB (test_autocast's convbn, 18 KB over budget).
            return counted + (torch.get_num_threads() * _BF16_CONV_SCRATCH_PER_THREAD
                              if value.dtype == torch.bfloat16 else 0)
        if value.dtype == torch.float32:
            return _conv_workspace_cpu(node, channels_last)
        return _im2col_bytes(node) + 32 * KIB
    except (ValueError, IndexError, TypeError, AttributeError):  # unexpected signature: assume a lot
        return 4 * sum(tensor_nbytes(i.meta.get("val")) for i in node.all_input_nodes)
