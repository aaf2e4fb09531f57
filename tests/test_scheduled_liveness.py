"""Liveness over Inductor's schedule (passes/liveness.py analyze_scheduled_liveness), on small
hand-made schedules: no Inductor run (tests/test_fusion_inductor.py checks real ones)."""

from __future__ import annotations

import torch
import torch.fx as fx

from memcompile import _torch_private as tp
from memcompile.passes.inductor_schedule import InductorSchedule, ScheduledBuffer, ScheduledKernel
from memcompile.passes.liveness import CATEGORIES, OP_SCRATCH_BYTES, SCRATCH, analyze_liveness, analyze_scheduled_liveness

KIB = 1024
F32 = str(torch.float32)


def _graph(placeholders: dict[str, int], outputs: list[tuple[str, int]]) -> fx.GraphModule:
    """Placeholders of the given float counts, and outputs: (name, floats) of new nodes
    (mul of the first placeholder) or existing placeholders."""
    graph = fx.Graph()
    nodes = {}
    for name, floats in placeholders.items():
        nodes[name] = graph.placeholder(name)
        nodes[name].meta["val"] = torch.empty(floats)
    first = next(iter(nodes.values()))
    outs = []
    for name, floats in outputs:
        if name not in nodes:
            nodes[name] = graph.create_node("call_function", torch.ops.aten.mul.Tensor, (first, first), name=name)
            nodes[name].meta["val"] = torch.empty(floats)
        outs.append(nodes[name])
    graph.output(outs)
    return fx.GraphModule(torch.nn.Module(), graph)


def _kernel(index, allocates, reads, in_place=(), generated=True):
    return ScheduledKernel(index, f"k{index}", tuple(ScheduledBuffer(n, b, F32) for n, b in allocates), tuple(reads),
                           tuple(in_place), generated)


def _forward_steps(timeline):
    return [s.live_bytes - OP_SCRATCH_BYTES for s in timeline.steps if s.phase == "forward"]


def test_results_of_one_kernel_coexist_and_one_may_take_a_dying_input():
    x = 4 * KIB
    fw = _graph({"primals_1": 1024}, [("out", 1024)])
    kernels = (
        _kernel(0, [("buf0", 4 * KIB)], ["primals_1"]),
        # one fused kernel, two results; buf1 is written over buf0, which dies here
        _kernel(1, [("buf1", 4 * KIB), ("buf2", 4 * KIB)], ["buf0"], in_place=[("buf1", "buf0")]),
        _kernel(2, [("buf3", 4 * KIB)], ["buf1", "buf2"]),
    )
    timeline = analyze_scheduled_liveness(fw, None, 1, InductorSchedule(kernels, ("buf3",)), None)
    assert _forward_steps(timeline) == [x + 4 * KIB, x + 8 * KIB, x + 12 * KIB]

    # buf0 read again later: it does not die at k1, so both results take new memory
    later = (kernels[0], kernels[1], _kernel(2, [("buf3", 4 * KIB)], ["buf1", "buf2", "buf0"]))
    timeline = analyze_scheduled_liveness(fw, None, 1, InductorSchedule(later, ("buf3",)), None)
    assert _forward_steps(timeline) == [x + 4 * KIB, x + 12 * KIB, x + 16 * KIB]


def _under_stock_reuse(*args, **kwargs):
    """The liveness under Inductor's own reuse rule (InductorRules(adjacent_reuse=False)), which
    the tests using it model; the graphs memcompile plans reuse only between adjacent kernels
    (the test after this one)."""
    return analyze_scheduled_liveness(*args, adjacent_reuse=False, **kwargs)


def test_in_planned_graphs_a_freed_buffer_is_reused_only_by_the_next_kernel():
    """memcompile's rule (_torch_private.inductor_rules): the kernels of the next test, where
    Inductor holds buf0 and buf1 dead for later allocations of their sizes; here each is freed
    when it dies and the later result allocated anew."""
    assert tp.PLANNED_RULES.adjacent_reuse_applies  # the default
    x = 4 * KIB
    fw = _graph({"primals_1": 1024}, [("out", 1024)])
    kernels = (
        _kernel(0, [("buf0", 8 * KIB)], ["primals_1"]),
        _kernel(1, [("buf1", 4 * KIB)], ["buf0"], generated=False),
        _kernel(2, [("buf2", 2 * KIB)], ["buf1"]),
        _kernel(3, [("buf3", 8 * KIB)], ["buf2"]),
        _kernel(4, [("buf4", 4 * KIB)], ["buf3"]),
        _kernel(5, [("buf5", 4 * KIB)], ["buf4"]),
    )
    steps = _forward_steps(analyze_scheduled_liveness(fw, None, 1, InductorSchedule(kernels, ("buf5",)), None))
    assert steps[:5] == [x + 8 * KIB, x + 12 * KIB, x + 4 * KIB + 2 * KIB, x + 2 * KIB + 8 * KIB,
                         x + 8 * KIB + 4 * KIB]
    assert steps[5] == x + 4 * KIB + 4 * KIB  # buf4 read while buf5 is written: no taker before it dies


def test_a_freed_buffer_is_held_for_the_next_allocation_of_its_size():
    x = 4 * KIB
    fw = _graph({"primals_1": 1024}, [("out", 1024)])
    kernels = (
        _kernel(0, [("buf0", 8 * KIB)], ["primals_1"]),
        _kernel(1, [("buf1", 4 * KIB)], ["buf0"], generated=False),  # a library call: allocates its own
        _kernel(2, [("buf2", 2 * KIB)], ["buf1"]),
        _kernel(3, [("buf3", 8 * KIB)], ["buf2"]),  # takes buf0's memory, held since k1
        _kernel(4, [("buf4", 4 * KIB)], ["buf3"]),  # takes buf1's memory, held since k2
    )
    steps = _forward_steps(_under_stock_reuse(fw, None, 1, InductorSchedule(kernels, ("buf4",)), None))
    assert steps[2] == x + 8 * KIB + 4 * KIB + 2 * KIB  # buf0 dead, but still allocated
    assert steps[3] == x + 4 * KIB + 2 * KIB + 8 * KIB  # buf3 in buf0's memory; buf1 held
    assert steps[4] == x + 8 * KIB + 4 * KIB  # buf4 in buf1's memory; buf2 (no taker) freed


def test_saved_tensors_renamed_by_post_grad_passes_are_held_for_the_backward():
    """Inductor's post-grad passes turn `add_1 = mm + x` into `addmm_default`; the backward's
    placeholder keeps the name add_1. Unmatched, the saved tensor looked unread and was dropped."""
    fw = _graph({"primals_1": 16}, [("sum_1", 1), ("addmm_default", 4096)])
    bw = _graph({"add_1": 4096, "tangents_1": 1}, [("grad", 16)])
    saved = 4096 * 4
    fw_schedule = InductorSchedule((_kernel(0, [("buf0", 4)], ["primals_1"]),
                                    _kernel(1, [("buf1", saved)], ["primals_1"])), ("buf0", "buf1"))
    bw_schedule = InductorSchedule((_kernel(0, [("buf0", 64)], ["add_1", "tangents_1"]),), ("buf0",))
    names = ("sum_1", "add_1")

    def backward_peak(timeline):
        return max(s.live_bytes for s in timeline.steps if s.phase == "backward")

    with_names = _under_stock_reuse(fw, bw, 1, fw_schedule, bw_schedule, saved_names=names)
    assert backward_peak(with_names) >= saved + 64
    without = _under_stock_reuse(fw, bw, 1, fw_schedule, bw_schedule)
    assert backward_peak(without) < saved  # the mismatch the names fix
    # the graph-order liveness takes the same names
    assert backward_peak(analyze_liveness(fw, bw, 1, saved_names=names)) >= saved + 64
    assert backward_peak(analyze_liveness(fw, bw, 1)) < saved


def test_a_freed_buffer_is_reused_only_where_inductors_own_estimate_allows():
    """Inductor's wrapper reuses a freed buffer for a later allocation of its size only when
    they are adjacent or holding it keeps Inductor's estimate of the schedule within its peak
    (AllocateLine.should_reuse_buffer). Assuming every reuse held a dead 1 MiB saved tensor of
    GPT-2 across the peak the wrapper had freed (prediction 16.05 MiB for 13.85 measured)."""
    x = 4 * KIB
    fw = _graph({"primals_1": 1024}, [("out", 1024)])
    kernels = (  # as in the test above: buf3 may take buf0 (freed after k1), buf4 buf1 (after k2)
        _kernel(0, [("buf0", 8 * KIB)], ["primals_1"]),
        _kernel(1, [("buf1", 4 * KIB)], ["buf0"], generated=False),
        _kernel(2, [("buf2", 2 * KIB)], ["buf1"]),
        _kernel(3, [("buf3", 8 * KIB)], ["buf2"]),
        _kernel(4, [("buf4", 4 * KIB)], ["buf3"]),
    )

    def steps(estimate, overall):
        schedule = InductorSchedule(kernels, ("buf4",), estimate, overall)
        return _forward_steps(_under_stock_reuse(fw, None, 1, schedule, None))

    every_reuse = steps((), 0)  # no estimate: every reuse assumed, buf0 held through k2
    assert every_reuse[2] == x + 8 * KIB + 4 * KIB + 2 * KIB
    estimate = (10 * KIB, 20 * KIB, 30 * KIB, 20 * KIB, 10 * KIB, 0)  # per kernel, plus one past the last
    assert steps(estimate, 100 * KIB) == every_reuse  # room under Inductor's peak: the same reuses
    # buf0 held through k2 would lift Inductor's estimate there (30 KiB) above its peak: freed
    # after k1, buf3 allocated anew; buf1 (held through k3, 20 + 4 <= 30 KiB) is still reused.
    declined = steps(estimate, 30 * KIB)
    assert declined[2] == x + 4 * KIB + 2 * KIB
    assert declined[3] == x + 4 * KIB + 2 * KIB + 8 * KIB
    assert declined[4] == x + 8 * KIB + 4 * KIB


def test_inductors_reuse_rule_counts_what_earlier_reuses_hold():
    from memcompile.passes.liveness import _inductor_would_reuse

    held = [0, 10, 10, 0]
    assert _inductor_would_reuse(held, 20, freed_at=0, step=3, nbytes=8)  # 8 + 10 <= 20
    assert held == [0, 18, 18, 0]  # held across kernels 1 and 2 now
    assert not _inductor_would_reuse(held, 20, freed_at=0, step=3, nbytes=4)  # 4 + 18 > 20
    assert held == [0, 18, 18, 0]
    assert _inductor_would_reuse(held, 20, freed_at=2, step=3, nbytes=100)  # adjacent: always


def test_a_saved_tensor_the_backward_frees_is_not_held_for_a_later_allocation():
    """Inductor's wrapper frees a graph input outright (codegen_free: FreeLine for an
    InputBuffer, donated or not): a saved tensor is never kept for reuse. Counting it as pooled
    handed its memory to a reuse the wrapper gives a temporary of its own, which it holds: on
    the attention stack of test_inductor_e2e that hid a 16 KiB buffer held across the attention
    backward (measured 535,848 B for 523,592 predicted once its workspace was counted exactly)."""
    fw = _graph({"primals_1": 1024}, [("out", 1), ("saved", 1024)])
    fw_schedule = InductorSchedule((_kernel(0, [("buf0", 4)], ["primals_1"]),
                                    _kernel(1, [("buf1", 4 * KIB)], ["primals_1"])), ("buf0", "buf1"))
    bw = _graph({"saved": 1024, "tangents_1": 1024}, [("grad", 1024)])
    bw_schedule = InductorSchedule((
        _kernel(0, [("buf0", 4 * KIB)], ["tangents_1"]),
        _kernel(1, [("buf1", KIB)], ["buf0"]),  # buf0 dies: kept for the next 4 KiB allocation
        _kernel(2, [("buf2", KIB)], ["saved", "buf1"]),  # the saved tensor dies: freed
        _kernel(3, [("buf3", 4 * KIB)], ["buf2"]),  # takes buf0's memory, held since k1
    ), ("buf3",))
    timeline = _under_stock_reuse(fw, bw, 1, fw_schedule, bw_schedule, saved_names=("out", "saved"))
    steps = [s.live_bytes for s in timeline.steps if s.phase == "backward"]
    assert steps[2] == steps[1] + KIB  # buf2 added, buf0 still allocated (dead, held for buf3)
    assert steps[3] == steps[2] - 4 * KIB - KIB  # the saved tensor and buf1 freed; buf3 in buf0


def test_an_unaligned_library_result_is_not_held_for_an_aligned_allocation():
    """The wrapper's reuse key includes alignment (buffer_reuse_key): the outputs of a library
    call returning a tuple (attention's gradients) are assumed not aligned, so the next aligned
    allocation of their size takes an older aligned buffer, held meanwhile, not them."""
    x = 4 * KIB
    fw = _graph({"primals_1": 1024}, [("out", 1024)])
    unaligned = ScheduledKernel(1, "k1", (ScheduledBuffer("buf1", 4 * KIB, F32, aligned=False),), ("buf0",), (),
                                False)
    kernels = (
        _kernel(0, [("buf0", 4 * KIB)], ["primals_1"]),
        unaligned,  # buf0 dies here: kept for the next aligned 4 KiB allocation
        _kernel(2, [("buf2", KIB)], ["buf1"]),  # buf1 dies: its key has no taker, freed
        _kernel(3, [("buf3", 4 * KIB)], ["buf2"]),  # takes buf0's memory
    )
    steps = _forward_steps(_under_stock_reuse(fw, None, 1, InductorSchedule(kernels, ("buf3",)), None))
    assert steps[2] == x + 4 * KIB + 4 * KIB + KIB  # buf0 held, buf1 read, buf2 new
    assert steps[3] == x + KIB + 4 * KIB  # buf1 freed, buf3 in buf0's memory


def test_a_result_written_over_an_unaligned_saved_tensor_is_not_held_for_an_aligned_allocation():
    """Inductor assumes every CPU graph input unaligned (utils.should_assume_input_aligned), and a
    result written in place over one inherits that (make_inplace): its reuse key matches no
    aligned allocation, so the wrapper frees it. BERT small's activation_memory_budget=0.8
    partition: such a buffer counted as held across the attention backward put the check
    262,144 B over the measured peak (16,366,216 for 16,104,072), and the partition was
    rejected at its own peak."""
    fw = _graph({"primals_1": 1024}, [("out", 1), ("saved", 1024)])
    fw_schedule = InductorSchedule((_kernel(0, [("buf0", 4)], ["primals_1"]),
                                    _kernel(1, [("buf1", 4 * KIB)], ["primals_1"])), ("buf0", "buf1"))
    bw = _graph({"saved": 1024, "tangents_1": 1024}, [("grad", 1024)])
    kernels = (
        _kernel(0, [("buf0", 4 * KIB)], ["tangents_1"]),
        _kernel(1, [("buf1", 4 * KIB)], ["saved", "buf0"], in_place=[("buf1", "saved")]),  # buf0 dies: pooled
        _kernel(2, [("buf2", KIB)], ["buf1"]),  # buf1 dies: unaligned, no aligned taker
        _kernel(3, [("buf3", 4 * KIB)], ["buf2"]),  # takes buf0's memory
        _kernel(4, [("buf4", 4 * KIB)], ["buf3"]),  # nothing aligned left: allocated anew
    )

    def backward_steps(unaligned):
        bw_schedule = InductorSchedule(kernels, ("buf4",), unaligned_inputs=frozenset(unaligned))
        timeline = _under_stock_reuse(fw, bw, 1, fw_schedule, bw_schedule, saved_names=("out", "saved"))
        return [s.live_bytes for s in timeline.steps if s.phase == "backward"]

    steps = backward_steps({"saved"})
    assert steps[3] == steps[2] - 4 * KIB  # buf1 freed after k2; buf3 in buf0's held memory
    # aligned (a GPU input at offset 0): the LIFO pool hands buf1 to buf3 and holds buf0 for buf4
    assert backward_steps(set())[3] == steps[3] + 4 * KIB


def test_a_tangent_stays_allocated_until_the_backward_returns():
    """AOTAutograd's backward receives the tangents as arguments, so they stay allocated through
    the whole backward although the graph reads them once (the wrapper's `del tangents_1` drops
    one reference of several). GPT-2's loss gradient, counted freed after its first kernel, put
    the check 4 bytes under the measured peak; a large tangent would put it further under."""
    fw = _graph({"primals_1": 1024}, [("out", 1024)])
    fw_schedule = InductorSchedule((_kernel(0, [("buf0", 4 * KIB)], ["primals_1"]),), ("buf0",))
    graph = fx.Graph()  # tangents_1 -> a -> grad: the tangent's only reader is the first node
    tangent = graph.placeholder("tangents_1")
    a = graph.create_node("call_function", torch.ops.aten.mul.Tensor, (tangent, tangent), name="a")
    grad = graph.create_node("call_function", torch.ops.aten.mul.Tensor, (a, a), name="grad")
    for node in (tangent, a, grad):
        node.meta["val"] = torch.empty(1024)
    graph.output([grad])
    bw = fx.GraphModule(torch.nn.Module(), graph)
    bw_schedule = InductorSchedule((
        _kernel(0, [("buf0", 4 * KIB)], ["tangents_1"]),
        _kernel(1, [("buf1", 4 * KIB)], ["buf0"]),
    ), ("buf1",))
    for timeline in (analyze_scheduled_liveness(fw, bw, 1, fw_schedule, bw_schedule), analyze_liveness(fw, bw, 1)):
        # less the step's own scratch margin (liveness.op_scratch_bytes: none at a pointwise op)
        last = [s.live_bytes - dict(zip(CATEGORIES, s.by_category)).get(SCRATCH, 0)
                for s in timeline.steps if s.phase == "backward"][-1]
        # primals_1, the forward's output (the caller holds it), the tangent, the last
        # kernel's input and its result: 4 KiB each
        assert last == 5 * 4 * KIB
