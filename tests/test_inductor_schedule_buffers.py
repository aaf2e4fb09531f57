"""Buffers of Inductor's schedule (memcompile._torch_private.inductor_schedule) that its C++
wrapper allocates although no other kernel reads them: lowering and scheduling only, no code
generation (fast), checked against what the generated wrapper allocated when this was written
(GPT-2 small's backward: `buf0 = empty_strided_cpu((512, 1), ...)` for the fused log-softmax
backward, `buf3`, `buf4` for the fused layer-norm backward, each later reused)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import memcompile
from memcompile import _torch_private as tp
from memcompile import planner

pytestmark = pytest.mark.inductor


class Norm(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.linear = nn.Linear(d, d)

    def forward(self, x):
        return self.linear(self.norm(x)).sum()


def _backward_graph(module, x):
    seen = []
    original = planner._plan_joint_graph

    def spy(*args, **kwargs):
        fw, bw, plan = original(*args, **kwargs)
        seen.append(bw)
        return fw, bw, plan

    planner._plan_joint_graph = spy
    try:
        torch.compile(module, backend=memcompile.budget("1GB", codegen="aot_eager"))(x).backward()
    finally:
        planner._plan_joint_graph = original
        torch.compiler.reset()
    return seen[-1]


def test_row_statistics_a_cpp_kernel_fused_over_an_outer_loop_passes_between_its_nests_are_buffers():
    """The layer-norm backward's per-row sums are reductions in one loop nest of a kernel fused
    over the outer (row) loop and read by the next nest: the C++ backend stores them (a reduction
    is never a kernel-local buffer), so the wrapper allocates them. The check had them in
    registers, 4 bytes per row under the measured peak each."""
    rows, width = 8 * 16, 32
    bw = tp.inductor_post_grad_copy(_backward_graph(Norm(width), torch.randn(8, 16, width, requires_grad=True)))
    schedule = tp.inductor_schedule(bw, is_backward=True)
    read_by_a_kernel = {name for kernel in schedule.kernels for name in kernel.reads}
    kept = [buf for kernel in schedule.kernels if kernel.wrapper_allocates for buf in kernel.allocates
            if buf.name not in read_by_a_kernel and buf.name not in schedule.outputs]
    assert kept and all(buf.nbytes == rows * 4 for buf in kept), kept
