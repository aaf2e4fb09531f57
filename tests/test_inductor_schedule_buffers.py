"""Buffers of Inductor's schedule (memcompile._torch_private: inductor_schedule) that its C++
wrapper allocates although no other kernel reads them: lowering and scheduling only, no code
generation (fast), checked against what the generated wrapper allocated when this was written
(GPT-2 small's backward: `buf0 = empty_strided_cpu((512, 1), ...)` for the fused log-softmax
backward, `buf3`, `buf4` for the fused layer-norm backward, each later reused); and the
inputs it lets a kernel write its result over, against what Inductor's own code generation
decided (`Scheduler.decide_inplace_update`, recorded as the wrapper writes each reuse)."""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch
import torch.nn as nn

import memcompile
from memcompile import _torch_private as tp
from memcompile._torch_private import inductor_hooks, scheduler_facts
from memcompile import planner
from memcompile.passes import fusion_refusals, liveness

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


@contextlib.contextmanager
def _recording_inductor():
    """Inside: every graph Inductor generates code for, as (a copy of the graph after its
    post-grad passes: what inductor_schedule is given, is_backward), and every in-place reuse its
    wrapper writes, as (graph index, result, input written over). Graphs lowered only to be
    scheduled (the planner's check) are not recorded. Caches off, so code generation runs."""
    from torch._inductor.codegen.wrapper import PythonWrapperCodegen
    from torch._inductor.graph import GraphLowering
    from torch._inductor.virtualized import V

    graphs, reuses, index_of = [], [], {}
    lower, codegen, reuse = (GraphLowering.__init__, GraphLowering.codegen,
                             PythonWrapperCodegen.codegen_inplace_reuse)

    def recording_lower(self, gm, *args, **kwargs):
        self.memcompile_test_copy = copy.deepcopy(gm)
        lower(self, gm, *args, **kwargs)

    def recording_codegen(self, *args, **kwargs):
        index_of[id(self)] = len(graphs)
        graphs.append((self.memcompile_test_copy, self.is_backward))
        return codegen(self, *args, **kwargs)

    def recording_reuse(self, input_buffer, output_buffer):
        reuses.append((index_of[id(V.graph)], output_buffer.get_name(), input_buffer.get_name()))
        return reuse(self, input_buffer, output_buffer)

    GraphLowering.__init__, GraphLowering.codegen = recording_lower, recording_codegen
    PythonWrapperCodegen.codegen_inplace_reuse = recording_reuse
    try:
        with torch.compiler.config.patch(force_disable_caches=True):
            yield graphs, reuses
    finally:
        GraphLowering.__init__, GraphLowering.codegen = lower, codegen
        PythonWrapperCodegen.codegen_inplace_reuse = reuse


def _in_place_pairs(schedule) -> set[tuple[str, str]]:
    return {(result, donor) for kernel in schedule.kernels for result, donor in kernel.in_place_candidates}


def _own_buffer_read_first(x, w):
    # tanh is realized (a heavy op read twice on CPU) in the kernel that computes the result:
    # the result's first read is that buffer, its second the mm's result
    a, m = torch.tanh(x), x @ w
    return a * m + a * 2


def _library_result_read_first(x, w):
    a, m = torch.tanh(x), x @ w
    return m * a + a * 2


def _read_at_one_index_by_a_fused_reduction(x, w):
    m = x @ w
    return m / m.sum(-1, keepdim=True)


def _read_transposed_by_a_fused_reduction(x, w):
    m = x @ w
    return m / (m + m.t()).sum(-1, keepdim=True)


def _read_in_part_by_a_fused_reduction(x, w):
    m = x @ w
    return m / m[:, : m.shape[1] // 2].sum(-1, keepdim=True)


# (graph, whose storage its result takes: the kernel's "own" buffer, the mm's "library" result, or None)
IN_PLACE_CASES = {
    # two eligible reads: Inductor writes over the first one, here the kernel's own tanh buffer,
    # and the mm's result stays allocated (GPT-2's fused tanh-GELU backward, 1 MiB there)
    "own_buffer_read_first": (_own_buffer_read_first, "own"),
    "library_result_read_first": (_library_result_read_first, "library"),
    # the mm's result is read by two nodes of one fused kernel: at one index it is taken...
    "read_at_one_index_by_a_fused_reduction": (_read_at_one_index_by_a_fused_reduction, "library"),
    # ...at two (transposed, or a part of it by the row sum) it is not
    "read_transposed_by_a_fused_reduction": (_read_transposed_by_a_fused_reduction, None),
    "read_in_part_by_a_fused_reduction": (_read_in_part_by_a_fused_reduction, None),
}


@pytest.mark.parametrize("case", sorted(IN_PLACE_CASES))
def test_in_place_donors_are_the_inputs_inductor_writes_over_and_the_check_meets_the_measured_peak(
        case, monkeypatch):
    """The (result, donor) pairs of the schedule are the reuses Inductor's wrapper wrote for the
    same graph, and the check over it (without its per-step margin) is the measured peak of the
    compiled call. Before the donor rule followed Scheduler.decide_inplace_update (the first
    eligible read only; none accessed at two indices in the fused kernel), the check took the
    mm's 16 KiB result as donor in the own-buffer case and in both two-index cases: 16 KiB
    under the measured peak."""
    fn, expected_donor = IN_PLACE_CASES[case]
    generator = torch.Generator().manual_seed(0)
    x, w = (torch.randn(64, 64, generator=generator) for _ in range(2))
    compiled = torch.compile(fn)
    with _recording_inductor() as (graphs, reuses), torch.no_grad():
        torch.testing.assert_close(compiled(x, w), fn(x, w), rtol=1e-4, atol=1e-4)
        measured = memcompile.measure_peak(lambda: compiled(x, w), live_at_start=[x, w])
    assert [is_backward for _, is_backward in graphs] == [False], "one inference graph"
    graph = graphs[0][0]

    schedule = tp.inductor_schedule(graph, is_backward=False)
    assert _in_place_pairs(schedule) == {(result, donor) for _, result, donor in reuses}

    # what the case is about: whose storage Inductor's result took
    # (a buffer the schedule allocates for no kernel is one its own kernel keeps to itself)
    library_call = {b.name: bool(k.extern_origin) for k in schedule.kernels for b in k.allocates}
    kinds = {"own" if donor not in library_call else "library" if library_call[donor] else "other"
             for _, _, donor in reuses}
    assert kinds == ({expected_donor} if expected_donor else set()), (case, reuses)
    if expected_donor is None:
        # the kernel does read the mm's result, which dies there: only the two indices refuse it
        monkeypatch.setattr(scheduler_facts, "_one_access_in_kernel", lambda *args: True)
        assert _in_place_pairs(tp.inductor_schedule(graph, is_backward=False))
        monkeypatch.undo()

    monkeypatch.setattr(liveness, "OP_SCRATCH_BYTES", 0)
    timeline = liveness.analyze_scheduled_liveness(graph, None, 1, schedule, None)
    assert measured.peak_bytes <= timeline.peak_bytes <= measured.peak_bytes + 1024, (
        timeline.peak_bytes, measured.peak_bytes)


class _TanhGELUBlock(nn.Module):
    """GPT-2's MLP (Hugging Face's NewGELUActivation, tanh written out) with its residual."""

    def __init__(self, d: int):
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        h = self.up(x)
        gelu = 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * torch.pow(h, 3.0))))
        return x + self.down(gelu)


def test_a_training_steps_in_place_donors_are_the_inputs_inductor_writes_over():
    """Through the backend, forward and backward: the backward's fused tanh-GELU gradient reads
    the mm's result first, then four saved tensors donated to the backward, each eligible;
    Inductor writes over the first only. (Listing all five, the check still took the mm's
    result, the first live one: the same peak here, but a wrong list of donors.)"""
    torch.manual_seed(0)
    model, x = _TanhGELUBlock(32), torch.randn(64, 32, requires_grad=True)
    compiled = torch.compile(model, backend=memcompile.budget("1GB"))
    with _recording_inductor() as (graphs, reuses):
        compiled(x).sum().backward()
    assert [is_backward for _, is_backward in graphs] == [False, True]
    for index, (graph, is_backward) in enumerate(graphs):
        schedule = tp.inductor_schedule(graph, is_backward=is_backward)
        assert _in_place_pairs(schedule) == {(r, d) for i, r, d in reuses if i == index}, (
            "backward" if is_backward else "forward")
    assert any(i == 1 for i, _, _ in reuses), "the backward writes a result over an input"


def _reduction_read_early_and_by_a_late_recomputation(x, w, wide, wide_w, wider, wider_w):
    s = x.sum(-1, keepdim=True)  # a reduction: a buffer, read by a matmul at once
    y = (w @ s).expand(x.shape).contiguous() @ w
    for _ in range(8):  # more than RECOMPUTE_VERTICAL_GAP scheduler nodes
        y = torch.relu(y @ wide) @ wide_w  # temporaries live in between
    late = wider * s  # the node marked as recomputed: its only reader is the last matmul
    return (y @ w + late @ wider_w,)  # a tuple, as partitioned graphs return

@pytest.fixture
def inductor_rules():
    """memcompile's Inductor rules installed for the test (as inside memcompile's own compiles)."""
    with tp.inductor_rules(tp.PLANNED_RULES):
        yield


@pytest.mark.inductor
def test_no_class_of_inductor_stays_patched_after_a_memcompile_compile():
    """memcompile's fusion and reuse rules are on Inductor's classes only while it lowers or
    compiles; after its compile returns (and between steps) they are Inductor's own, so a user's
    other torch.compile calls, and other threads, run under Inductor's rules."""
    from torch._inductor.choices import InductorChoices
    from torch._inductor.codegen.wrapper import AllocateLine

    before = (InductorChoices.__dict__["can_fuse_horizontal"], InductorChoices.__dict__["can_fuse_vertical"],
              AllocateLine.__dict__["should_reuse_buffer"])
    installed = []
    real_install = inductor_hooks._install_fusion_rules

    def install():
        restore = real_install()
        installed.append(InductorChoices.__dict__["can_fuse_horizontal"] is not before[0])
        return restore

    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    x = torch.randn(16, 32, requires_grad=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(inductor_hooks, "_install_fusion_rules", install)
        torch.compile(model, backend=memcompile.budget(10**9))(x).sum().backward()
    assert installed and all(installed), "the rules were not in force during memcompile's compile"
    after = (InductorChoices.__dict__["can_fuse_horizontal"], InductorChoices.__dict__["can_fuse_vertical"],
             AllocateLine.__dict__["should_reuse_buffer"])
    assert after == before
    torch.compiler.reset()



@pytest.mark.parametrize("rows,width", [(64, 512), (32, 256)])
def test_a_recomputed_reader_is_not_fused_into_a_producer_far_before_it(inductor_rules, rows, width, monkeypatch):
    """Inductor fuses a reader into its producer (vertical fusion) however far apart they are, and
    the fused kernel runs at the producer: a recomputation placed just before its reader was
    computed at the top of the backward and held across it (Llama small's attention masks:
    256-512 KiB over every plan at 9.91 MiB). Marked readers far from their producer now run
    where the rewrite put them; with the distance unlimited they are fused again (the test can
    fail), and the check's peak is higher by the held buffer."""
    from torch.fx.experimental.proxy_tensor import make_fx

    late_bytes = rows * 2 * width * 4
    args = (torch.randn(rows, rows), torch.randn(rows, rows), torch.randn(rows, width), torch.randn(width, rows),
            torch.randn(rows, 2 * width), torch.randn(2 * width, rows))
    graph = make_fx(_reduction_read_early_and_by_a_late_recomputation, tracing_mode="fake")(*args)
    late = next(n for n in graph.graph.nodes if n.target == torch.ops.aten.mul.Tensor)
    late.meta[tp.RECOMPUTED] = True

    def schedule_and_peak():
        schedule = tp.inductor_schedule(graph, is_backward=False)
        made_in, name = next((k.index, b.name) for k in schedule.kernels for b in k.allocates if b.nbytes == late_bytes)
        read_in = next(k.index for k in schedule.kernels if name in k.reads)
        return made_in, read_in, liveness.analyze_scheduled_liveness(graph, None, 1, schedule, None).peak_bytes

    made_in, read_in, peak = schedule_and_peak()
    assert made_in == read_in - 1, (made_in, read_in)
    monkeypatch.setattr(fusion_refusals, "RECOMPUTE_VERTICAL_GAP", 10**9)
    fused_in, _, fused_peak = schedule_and_peak()
    assert fused_in == 0
    assert fused_peak > peak, (fused_peak, peak)  # the late buffer held across the temporaries


def _product_and_its_gradient(s, u, dh, dout, x):
    """The tail of a SwiGLU backward with silu(gate) saved (s): the product h = s * u is read only
    by the down projection's weight gradient; the up projection's gradient dh * s reads s too, so
    Inductor fuses the two pointwise nodes (a horizontal fusion) and runs both at the first."""
    h = s * u
    down_weight_grad = dout.permute(1, 0) @ h  # h's last reader
    up_grad = dh * s
    return (down_weight_grad, up_grad.permute(1, 0) @ x)


@pytest.mark.parametrize("rows,width", [(512, 344), (256, 128)])
def test_a_fusion_that_would_keep_a_dead_buffer_live_is_refused_in_planned_graphs(rows, width, monkeypatch):
    """Fused, the up gradient is allocated while the product is live (Llama small's SwiGLU
    backward: five 688 KiB buffers at the weight-gradient matmul where four suffice); refused,
    it runs after the matmul and takes the product's freed memory: the check's peak is one
    buffer lower. With the rule off the two share a kernel again (the test can fail)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    wide = rows * width * 4
    args = (torch.randn(rows, width), torch.randn(rows, width), torch.randn(rows, width),
            torch.randn(rows, 64), torch.randn(rows, 64))
    graph = make_fx(_product_and_its_gradient, tracing_mode="fake")(*args)

    def kernels_of_wide_buffers_and_peak(rules):
        schedule = tp.inductor_schedule(graph, is_backward=False, rules=rules)
        made_in = sorted(k.index for k in schedule.kernels for b in k.allocates if b.nbytes == wide)
        return made_in, liveness.analyze_scheduled_liveness(graph, None, 1, schedule, None).peak_bytes

    made_in, peak = kernels_of_wide_buffers_and_peak(tp.PLANNED_RULES)
    fused_in, fused_peak = kernels_of_wide_buffers_and_peak(tp.InductorRules(lifetime_fusion=False))
    assert len(fused_in) == 2 and fused_in[0] == fused_in[1], fused_in  # one kernel allocates both
    assert len(made_in) == 2 and made_in[0] < made_in[1], made_in  # two kernels apart
    # refused, the peak is at the second matmul (its result beside the first's), not at the first
    assert fused_peak - peak == wide - width * 64 * 4, (fused_peak, peak)


def test_graphs_memcompile_did_not_plan_fuse_as_stock_inductor(inductor_rules, monkeypatch):
    """The rule is installed process-wide (Inductor's choices hook) but reads the planned-graph
    mark: a plain torch.compile of the same function generates the same kernels with it as
    without it."""
    import torch._inductor.config as inductor_config
    from torch._inductor import metrics

    args = (torch.randn(256, 128), torch.randn(256, 128), torch.randn(256, 128),
            torch.randn(256, 64), torch.randn(256, 64))

    def kernels_generated() -> int:
        torch.compiler.reset()
        metrics.reset()
        # a cached kernel skips the scheduler (config.patch: monkeypatch's undo deletes the entry)
        with inductor_config.patch(fx_graph_cache=False):
            torch.compile(_product_and_its_gradient, fullgraph=True)(*args)
        return metrics.generated_kernel_count

    with_rule = kernels_generated()
    with tp.inductor_rules(tp.InductorRules(lifetime_fusion=False)):
        assert kernels_generated() == with_rule
    monkeypatch.setattr(inductor_hooks, "_planned_graph_now", lambda: True)  # as if memcompile had planned it
    assert kernels_generated() == with_rule + 1  # the product and the up gradient apart
    torch.compiler.reset()


def _early_dead_buffer_and_a_late_one_of_its_size(x, w_big, w_wide, w_row):
    c = (x @ w_big).sum(1, keepdim=True)  # the graph's peak (as Inductor estimates it), first
    a = (x + c).sin()
    p = a @ w_wide  # a's last reader: dead from here, its size free for a later result
    s = p.sum(1, keepdim=True)
    return s @ w_row  # the size of a, two kernels after a died: holding a stays under that peak


def test_in_planned_graphs_the_wrapper_reuses_a_dead_buffer_only_for_the_next_kernel(inductor_rules, monkeypatch):
    """Inductor's wrapper holds a dead buffer for a later allocation of its size wherever its own
    estimate of the graph's peak allows (AllocateLine.should_reuse_buffer); on Llama small two
    dead 256 KiB gradients were held through the step's peak. In graphs memcompile planned the
    dead buffer is freed instead (the check's model: test_scheduled_liveness); elsewhere, and
    with MEMCOMPILE_ADJACENT_REUSE=0, as stock Inductor."""
    import torch._inductor.config as inductor_config
    from torch._inductor.utils import run_and_get_code

    args = (torch.randn(128, 128), torch.randn(128, 1024), torch.randn(128, 512), torch.randn(1, 128))

    def reuses() -> list[str]:
        torch.compiler.reset()
        with inductor_config.patch(fx_graph_cache=False):
            _, (code, *_) = run_and_get_code(torch.compile(_early_dead_buffer_and_a_late_one_of_its_size,
                                                           fullgraph=True), *args)
        return [line.strip() for line in code.splitlines() if line.strip().endswith("# reuse")]

    stock = reuses()
    assert stock  # among them the last result, held for in the dead sin(x)'s memory
    monkeypatch.setattr(inductor_hooks, "_planned_graph_now", lambda: True)  # as if memcompile had planned it
    planned = reuses()
    assert set(planned) < set(stock), (planned, stock)  # only reuses by the next kernel remain
    with tp.inductor_rules(tp.InductorRules(adjacent_reuse=False)):
        assert reuses() == stock
    torch.compiler.reset()
