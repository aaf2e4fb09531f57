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
Built in two steps: `memcompile._torch_private.inductor_schedule` (_torch_private/lowering.py)
lowers and schedules the graph (no code generation) and _torch_private/scheduler_facts.py reads
the scheduler's nodes and buffers into plain facts (ScheduleFacts);
`schedule_from_facts` here decides from them what Inductor's wrapper will allocate, free and write
in place (the rules of its scheduler and C++ backend, named at each).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace


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


# -- what the seam reads off Inductor's scheduler (_torch_private/scheduler_facts.py) -------------
# Layout kinds of a buffer's IR node (its get_output_spec()), the ones the rules below tell apart.
LAYOUT_PLAIN = "plain"  # a storage of its own (FixedLayout, FlexibleLayout...)
LAYOUT_NONE = "none"  # no tensor (a mutation's result, a call returning nothing)
LAYOUT_MULTI_OUTPUT = "multi_output"  # a library call's tuple: its members are buffers of their own
LAYOUT_NON_OWNING = "non_owning"  # a view into another buffer (a concat's input)
LAYOUT_MUTATION = "mutation"  # written into another buffer (MutationLayoutSHOULDREMOVE)


@dataclass(frozen=True)
class BufferUse:
    """One entry of a buffer's users list (a scheduler node that reads or writes it, or the graph's output)."""

    node: str | None  # the scheduler node's name; None: not a scheduler node (the graph's output)
    # That node object is the one scheduled under its name (Inductor can replace a node, finalizing a
    # template choice, while an older users list still holds the old one).
    scheduled: bool
    loop_nest: bool  # a SchedulerNode: one generated loop nest (not a library call, no-op or group)
    can_inplace: bool  # Inductor's own flag: this use reads it at the index it writes


@dataclass(frozen=True)
class BufferFacts:
    """A buffer of the scheduler (name_to_buf), or a graph input donated to the backward."""

    name: str
    layout: str | None  # LAYOUT_*; None: no IR node
    # The buffer whose storage it uses, one step: a view's, a mutation's target, the copy a transfer
    # wait returns. None: its own.
    aliases: str | None = None
    member_of: str | None = None  # a MultiOutput's producer: the library call returning the tuple
    multi_output: bool = False  # a MultiOutput node (allocated by its producer)
    # Device memory its storage takes (allocation size by Inductor's size hint times the item
    # size): 0 in host memory (our copy_to_host's result), and for buffers without a storage of their
    # own, which are not sized.
    device_bytes: int = 0
    dtype: str = ""  # str(torch dtype), where sized
    defined_by_no_op: bool = False  # made by a no-op kernel (NopKernelSchedulerNode)
    users: tuple[BufferUse, ...] = ()


@dataclass(frozen=True)
class NodeFacts:
    """One scheduler node inside a kernel (a fused kernel has several; any other kernel one, itself)."""

    name: str
    outputs: tuple[str, ...]
    reads: tuple[str, ...]  # buffers it reads, first read first, each once
    # The users of the buffers it reads that it depends on (its ancestors among them): done before it.
    earlier_users: frozenset[str]


@dataclass(frozen=True)
class OuterLoopFacts:
    """A C++ kernel fused over an outer loop (codegen/cpp.py OuterLoopFusedSchedulerNode)."""

    depth: int  # outer_loop_fusion_depth
    nests: tuple[tuple[str, ...], ...]  # the inner loop nests, each its scheduler nodes' names
    # Per loop nest that is a scheduled loop (SchedulerNode or fused group), how many loops it has
    # (its call ranges); None where Inductor's objects could not be read.
    nest_loop_counts: tuple[int, ...] | None
    reductions: frozenset[str]  # members that are reductions (or whose kind could not be read)
    # Results with a contiguous layout, written and read by every user at the contiguous index of
    # the writer's loops (codegen/cpp.py try_outer_loop_fusion_with_local_buf's index check).
    contiguous_results: frozenset[str]


@dataclass(frozen=True)
class KernelFacts:
    """One scheduler node of the run order (a kernel, or a no-op)."""

    name: str  # the scheduler node's name
    kind: str  # "library" (ExternKernelSchedulerNode), "no_op" (NopKernelSchedulerNode) or "generated"
    extern: bool  # Inductor's is_extern(): flushes as a library call
    template: bool
    device: str | None  # str(torch.device)
    cpp_backend: bool  # Inductor's backend for its device is the C++ one (CppScheduling)
    outputs: tuple[str, ...]
    accessed: tuple[str, ...]  # its reads' then its writes' buffer names
    origin: str | None  # the FX node it computes (a readable name), where Inductor records one
    out_variant: bool  # a library call writing into a buffer the wrapper allocates (ExternKernelOut)
    nodes: tuple[NodeFacts, ...]
    # Buffers (with a buffer record) its nodes access at one index only, reads and writes together
    # (Scheduler.decide_inplace_update's single_index_in_fused_node).
    read_at_one_index: frozenset[str]
    outer_loop: OuterLoopFacts | None = None


@dataclass(frozen=True)
class ScheduleFacts:
    """A lowered and scheduled graph as plain data: what `schedule_from_facts` decides from."""

    kernels: tuple[KernelFacts, ...]  # in the order the wrapper runs them
    buffers: tuple[BufferFacts, ...]  # in the scheduler's order (name_to_buf)
    donated_buffers: tuple[BufferFacts, ...]  # the backward's donated inputs
    graph_outputs: tuple[str | None, ...]  # per FX output argument: its buffer (None: not a tensor)
    graph_inputs: frozenset[str]
    unaligned_buffers: frozenset[str]  # buffers and inputs Inductor assumes unaligned
    peak_estimate: tuple[int, ...] = ()  # Inductor's estimate per kernel (memory.py estimate_peak_memory)
    overall_peak_estimate: int = 0


# -- what the wrapper allocates, frees and writes in place, decided from those facts --------------
def schedule_from_facts(facts: ScheduleFacts) -> InductorSchedule:
    """The kernels of a lowered and scheduled graph, with what each allocates and reads."""
    buffers = {b.name: b for b in facts.buffers}
    donated = {b.name: b for b in facts.donated_buffers}
    members = _multi_output_members(facts.buffers)

    def storage_of(name: str) -> str:
        return _storage_of(name, buffers)

    def donor_of(name: str) -> BufferFacts | None:
        return donated.get(name) or buffers.get(name)

    def storages_read(names: Iterable[str]) -> list[str]:
        out: list[str] = []
        for name in names:
            base = storage_of(name)
            out.extend(members.get(base, [base]))
        return list(dict.fromkeys(out))

    kernel_of = {node.name: index for index, k in enumerate(facts.kernels) for node in k.nodes}
    call_groups = cpp_call_groups(facts.kernels)
    kernels = []
    generated_kernels: set[int] = set()
    for index, kernel in enumerate(facts.kernels):
        allocates = []
        for name in kernel.outputs:
            buf = buffers[name]
            if storage_of(name) != name or buf.layout in (LAYOUT_NONE, LAYOUT_MULTI_OUTPUT):
                continue  # an alias, or a tuple whose members are counted below
            if buf.multi_output:
                continue  # allocated by its producer
            allocates.append(ScheduledBuffer(name, buf.device_bytes, buf.dtype))
        for name in kernel.outputs:
            for member in members.get(name, ()):
                allocates.append(ScheduledBuffer(member, buffers[member].device_bytes, buffers[member].dtype))
        reads = [n for n in storages_read(kernel.accessed) if n not in {b.name for b in allocates}]
        if any(buffers[o].multi_output for o in kernel.outputs):
            reads = storages_read(kernel.outputs) + reads  # the tuple holds every member until here
        extern = kernel.kind == "library"
        generated = kernel.kind == "generated"
        if generated:
            generated_kernels.add(index)
        candidates = (_in_place_candidates(kernel, index, {b.name for b in allocates}, kernel_of, donor_of,
                                           storage_of) if generated else [])
        kernels.append(ScheduledKernel(
            index=index, name=kernel.origin if kernel.origin is not None else kernel.name,
            allocates=tuple(allocates), reads=tuple(reads), in_place_candidates=tuple(candidates),
            wrapper_allocates=generated or kernel.kind == "no_op" or kernel.out_variant,
            extern_origin=kernel.origin if extern and kernel.origin is not None else "",
            call_group=call_groups[index], library_call=extern))

    outputs = tuple(None if name is None else storage_of(name) for name in facts.graph_outputs)
    # A generated kernel's result that no other kernel reads and the graph does not return is
    # kept in registers: its code generation removes the buffer (remove_kernel_local_buffers).
    read_elsewhere = {n for k in kernels for n in k.reads} | {o for o in outputs if o is not None}
    read_elsewhere |= outer_loop_fused_kept_buffers(facts.kernels, buffers)
    kernels = [replace(k, allocates=tuple(b for b in k.allocates if b.name in read_elsewhere))
               if k.index in generated_kernels else k
               for k in kernels]
    # What the wrapper reuses a freed buffer by includes its alignment (buffer_reuse_key).
    unaligned = facts.unaligned_buffers
    kernels = [replace(k, allocates=tuple(replace(b, aligned=False) if b.name in unaligned else b
                                          for b in k.allocates))
               for k in kernels]
    return InductorSchedule(tuple(kernels), outputs, facts.peak_estimate, facts.overall_peak_estimate,
                            unaligned_inputs=frozenset(n for n in unaligned if n in facts.graph_inputs))


def _storage_of(name: str, buffers: dict[str, BufferFacts]) -> str:
    """The buffer whose storage `name` uses (views into a concat, mutation results, the alias a
    transfer wait returns); a graph input is its own."""
    for _ in range(33):  # a chain longer than this is taken to end where it is
        buf = buffers.get(name)
        if buf is None or buf.aliases is None:
            return name
        name = buf.aliases
    return name


def _multi_output_members(buffers: Iterable[BufferFacts]) -> dict[str, list[str]]:
    """Members of a multi-output library call (sdpa's outputs...), by the call: it allocates them."""
    members: dict[str, list[str]] = {}
    for buf in buffers:
        if buf.member_of is not None:
            members.setdefault(buf.member_of, []).append(buf.name)
    return members


def _in_place_candidates(kernel: KernelFacts, index: int, allocated: set[str], kernel_of: dict[str, int],
                         donor_of: Callable[[str], BufferFacts | None],
                         storage_of: Callable[[str], str]) -> list[tuple[str, str]]:
    """Scheduler.decide_inplace_update: a result may be written over an input whose only use left
    is this very node (each node of a fused kernel is a use of its own), read there at the index
    written, by a kernel the wrapper allocates for. `donor_of`: the donated input of that name,
    else the buffer."""
    candidates: list[tuple[str, str]] = []
    for node in kernel.nodes:
        for out in node.outputs:
            if out not in allocated:
                continue
            for read in node.reads:
                donor = donor_of(read)
                if donor is None or donor.layout in (None, LAYOUT_NONE, LAYOUT_MULTI_OUTPUT, LAYOUT_MUTATION):
                    continue
                if donor.defined_by_no_op:
                    continue
                # uses by kernels run before, or by nodes this one depends on, are done
                remaining = [u for u in donor.users if u.node is None
                             or (kernel_of.get(u.node, -1) >= index and u.node not in node.earlier_users)]
                if (len(remaining) == 1 and remaining[0].node == node.name and remaining[0].scheduled
                        and remaining[0].can_inplace and read in kernel.read_at_one_index):
                    # the first eligible read wins, even a buffer of this kernel the check counts
                    # as kernel-local (then no other input is donated): GPT-2's fused tanh
                    # backward took its own 1 MiB buffer, not its input
                    candidates.append((out, storage_of(read)))
                    break
    return candidates


def cpp_call_groups(kernels: Sequence[KernelFacts]) -> list[int]:
    """Per kernel, the wrapper call it runs in (-1: one of its own), as Scheduler._codegen emits
    them: it flushes the backend (emits the pending call, then frees what it read last) before a
    library call, a template or a device change, and frees right after a library call; Inductor's
    C++ backend (CppScheduling) otherwise keeps adding generated kernels to one call (its
    ready_to_flush only past 500 arguments: ignored, a larger group holds more, never less).
    Other backends (Triton) free after each kernel."""
    groups: list[int] = []
    current, device = -1, None
    for index, kernel in enumerate(kernels):
        if kernel.device is None and not kernel.extern:
            groups.append(current)  # a no-op kernel: no flush, no call, inside the pending one
            continue
        if kernel.extern or not kernel.cpp_backend:
            groups.append(-1)
            current = -1
            continue
        if current < 0 or kernel.template or (kernel.device is not None and kernel.device != device):
            current = index
        if kernel.device is not None:
            device = kernel.device
        groups.append(current)
    return groups


def outer_loop_fused_kept_buffers(kernels: Sequence[KernelFacts], buffers: dict[str, BufferFacts]) -> set[str]:
    """Buffers a C++ kernel fused over an outer loop (OuterLoopFusedSchedulerNode) passes from one
    of its inner loop nests to another: each nest is its own kernel body
    (codegen/cpp.py codegen_outer_loop_node), so the buffer is stored and the wrapper allocates
    it, although no other kernel reads it. The exception is Inductor's kernel-local buffer
    (try_outer_loop_fusion_with_local_buf): a contiguous, contiguously written and read
    pointwise result, when every inner nest spans the fused depth plus one loop. On GPT-2 the
    backward's fused log-softmax and layer-norm kernels kept three such 2 KiB row statistics
    (a reduction, never local), and the check had them in registers."""
    kept: set[str] = set()
    for kernel in kernels:
        outer = kernel.outer_loop
        if outer is None:
            continue
        nest_of = {name: i for i, nest in enumerate(outer.nests) for name in nest}
        members = {node.name for node in kernel.nodes}
        local_ok = outer.nest_loop_counts is not None and all(
            count == outer.depth + 1 for count in outer.nest_loop_counts)
        for node in kernel.nodes:
            for name in node.outputs:
                readers = [u.node for u in buffers[name].users if u.loop_nest and u.node is not None]
                if not any(nest_of.get(r, -1) not in (-1, nest_of[node.name]) for r in readers):
                    continue  # read in its own nest only (or outside: counted as read elsewhere)
                if local_ok and _becomes_local_buffer(node, buffers[name], members, outer):
                    continue
                kept.add(name)
    return kept


def _becomes_local_buffer(node: NodeFacts, buf: BufferFacts, members: set[str], outer: OuterLoopFacts) -> bool:
    """The conditions of codegen/cpp.py try_outer_loop_fusion_with_local_buf for one result."""
    if node.name in outer.reductions or len(node.outputs) != 1:
        return False
    if not all(u.node in members and u.scheduled for u in buf.users):
        return False
    return buf.name in outer.contiguous_results
