"""The rules of passes/inductor_schedule.py over hand-made facts (no Inductor): what the wrapper
allocates, which wrapper call each kernel runs in, and which input a result is written over."""

from __future__ import annotations

from memcompile.passes.inductor_schedule import (
    LAYOUT_MULTI_OUTPUT,
    LAYOUT_NON_OWNING,
    LAYOUT_PLAIN,
    BufferFacts,
    BufferUse,
    KernelFacts,
    NodeFacts,
    OuterLoopFacts,
    ScheduleFacts,
    cpp_call_groups,
    schedule_from_facts,
)

F32 = "torch.float32"


def _use(node: str | None, can_inplace: bool = False, loop_nest: bool = True) -> BufferUse:
    return BufferUse(node, node is not None, loop_nest and node is not None, can_inplace)


def _buffer(name: str, users=(), nbytes: int = 64, **facts) -> BufferFacts:
    return BufferFacts(name, facts.pop("layout", LAYOUT_PLAIN), device_bytes=nbytes, dtype=F32,
                       users=tuple(users), **facts)


def _kernel(name: str, kind: str = "generated", outputs=(), reads=(), nodes=None, **facts) -> KernelFacts:
    nodes = nodes if nodes is not None else (NodeFacts(name, tuple(outputs), tuple(reads), frozenset()),)
    defaults = dict(extern=kind == "library", template=False, device="cpu", cpp_backend=True, origin=None,
                    out_variant=False, read_at_one_index=frozenset(reads))
    defaults.update(facts)
    return KernelFacts(name, kind, outputs=tuple(outputs), accessed=tuple(reads), nodes=nodes, **defaults)


def _facts(kernels, buffers, outputs, donated=()) -> ScheduleFacts:
    return ScheduleFacts(tuple(kernels), tuple(buffers), tuple(donated), tuple(outputs),
                         frozenset({"primals_1"}), frozenset())


def test_generated_kernels_between_library_calls_share_one_cpp_call():
    kernels = [_kernel("op0", "library"), _kernel("op1"), _kernel("op2"), _kernel("op3", device=None),
               _kernel("op4", "library"), _kernel("op5", template=True), _kernel("op6", cpp_backend=False)]
    assert cpp_call_groups(kernels) == [-1, 1, 1, 1, -1, 5, -1]


def test_a_result_no_other_kernel_reads_stays_in_registers_unless_an_outer_loop_nest_passes_it_on():
    buffers = [_buffer("buf0", [_use("op1")]), _buffer("buf1", [_use("op2")]), _buffer("buf2", [_use(None)])]
    fused = (NodeFacts("op1", ("buf1",), ("buf0",), frozenset()), NodeFacts("op2", ("buf2",), ("buf1",), frozenset()))
    kernels = [_kernel("op0", "library", ["buf0"], ["primals_1"]),
               _kernel("op1_op2", outputs=["buf1", "buf2"], reads=["buf0", "buf1"], nodes=fused)]
    schedule = schedule_from_facts(_facts(kernels, buffers, ["buf2"]))
    assert [b.name for b in schedule.kernels[1].allocates] == ["buf2"]  # buf1 kernel-local

    outer = OuterLoopFacts(1, (("op1",), ("op2",)), (2, 2), frozenset({"op1"}), frozenset({"buf1"}))
    kernels[1] = _kernel("op1_op2", outputs=["buf1", "buf2"], reads=["buf0", "buf1"], nodes=fused, outer_loop=outer)
    schedule = schedule_from_facts(_facts(kernels, buffers, ["buf2"]))
    assert [b.name for b in schedule.kernels[1].allocates] == ["buf1", "buf2"]  # a reduction: stored


def test_the_first_eligible_input_is_written_over_and_aliases_resolve_to_their_storage():
    buffers = [_buffer("buf0", [_use("op2", can_inplace=True)]),
               _buffer("buf1", [_use("op2", can_inplace=True)], layout=LAYOUT_NON_OWNING, aliases="buf0"),
               _buffer("buf2", [_use(None)]),
               _buffer("buf3", [_use("op4")], layout=LAYOUT_MULTI_OUTPUT),
               _buffer("buf4", [_use(None)], member_of="buf3", multi_output=True)]
    kernels = [_kernel("op0", "library", ["buf0"], ["primals_1"]), _kernel("op1", "no_op", ["buf1"], ["buf0"]),
               _kernel("op2", outputs=["buf2"], reads=["buf1", "buf0"]),
               _kernel("op3", "library", ["buf3"], ["buf2"]), _kernel("op4", "no_op", ["buf4"], ["buf3"])]
    schedule = schedule_from_facts(_facts(kernels, buffers, ["buf2", "buf4"]))
    assert schedule.kernels[2].in_place_candidates == (("buf2", "buf0"),)  # buf1 read first: its storage
    assert schedule.kernels[2].reads == ("buf0",)
    assert [b.name for b in schedule.kernels[3].allocates] == ["buf4"]  # the call allocates its tuple's members
    assert schedule.outputs == ("buf2", "buf4")
    # read at two indices in its kernel: not written over
    kernels[2] = _kernel("op2", outputs=["buf2"], reads=["buf1", "buf0"], read_at_one_index=frozenset())
    assert schedule_from_facts(_facts(kernels, buffers, ["buf2", "buf4"])).kernels[2].in_place_candidates == ()
