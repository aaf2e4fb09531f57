"""Inductor's schedule of one graph, as plain data: the kernels in the order its wrapper runs them,
the buffers each allocates and the buffers (or graph inputs) each reads.

Why not the FX graph's order: Inductor's scheduler fuses nodes far apart in the graph into one
kernel and runs it at its earliest member (torch/_inductor/scheduler.py `fuse_nodes_once`: fused
nodes sorted by `min_order`, their dependencies hoisted by the topological sort), then reorders
kernels for its own peak estimate (`memory.reorder_for_peak_memory`). On a Llama plan that
recomputes in the backward, layer 0's recomputed RoPE keys, attention masks and q/k projections
were fused with layer 1's (they read the same saved cos/sin and mask) and computed at the top of
the backward, held across all of layer 1's backward; and the three 688 KiB outputs of one fused
MLP-backward kernel coexisted where the graph order let each reuse the previous one's memory.
The liveness over this schedule (passes/liveness.py `analyze_scheduled_liveness`) sees both.
Built by `memcompile._torch_private.inductor_schedule` (lowering and scheduling, no codegen).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ScheduledBuffer:
    name: str  # Inductor's buffer name (buf12)
    nbytes: int  # the storage the wrapper allocates (0 for aliases)
    dtype: str  # with nbytes, the key the wrapper reuses freed buffers by
    # Also part of that key (codegen/wrapper.py buffer_reuse_key): outputs of library calls that
    # return tuples (attention's gradients) are "assumed to be not aligned", and the wrapper never
    # hands them to an allocation of its own, which is aligned.
    aligned: bool = True


@dataclass(frozen=True)
class ScheduledKernel:
    index: int  # position in the run order (also makes equal kernels distinct)
    name: str  # a readable name: the first FX node it computes
    allocates: tuple[ScheduledBuffer, ...]  # buffers allocated when it runs
    reads: tuple[str, ...]  # buffers and graph inputs it reads (aliases resolved to their storage)
    in_place_candidates: tuple[tuple[str, str], ...]  # (result, input it may be written over)
    wrapper_allocates: bool  # generated kernel or out= library call: may take a freed buffer
    extern_origin: str = ""  # the FX node of a library kernel (for its workspace), else ""
    # The wrapper call this kernel runs in, when several kernels share one (-1: a call of its
    # own). Inductor's C++ backend (codegen/cpp.py CppScheduling) gathers the generated kernels
    # between two library calls into one C++ function: the wrapper allocates every member's
    # buffers before that single call and frees what the members read last only after it
    # (Scheduler._codegen flushes, and frees, at library calls and templates only). GPT-2
    # tiny's last kernel group allocated the 128 KiB embedding gradient while the attention's
    # 48 KiB qkv gradient, read by an earlier member, was still held: 32 KB over the budget.
    call_group: int = -1
    # A library call (aten: matmul, attention, convolution...) may allocate scratch no model
    # explains (liveness.OP_SCRATCH_BYTES); a kernel Inductor generated allocates nothing itself
    # (the wrapper allocates its buffers, counted in `allocates`), so it gets no such margin.
    library_call: bool = True


@dataclass(frozen=True)
class InductorSchedule:
    kernels: tuple[ScheduledKernel, ...]
    outputs: tuple[str | None, ...]  # per FX output argument: the storage it is (None: not a tensor)
    # Inductor's own memory estimate per kernel and its maximum: what its wrapper decides buffer
    # reuse by (empty: unknown, every reuse is assumed).
    peak_estimate: tuple[int, ...] = ()
    overall_peak_estimate: int = 0
    # Graph inputs Inductor assumes unaligned (every CPU input: utils.should_assume_input_aligned).
    # A result written in place over one inherits it (make_inplace), and with it a reuse key no
    # aligned allocation matches: the wrapper frees it rather than holding it for one.
    unaligned_inputs: frozenset[str] = frozenset()
