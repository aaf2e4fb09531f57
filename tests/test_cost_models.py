"""The roofline time estimate: matmul rates follow the dtype and torch's float32 matmul setting."""

from __future__ import annotations

import operator
import time

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.fx.experimental.proxy_tensor import make_fx

import memcompile
from memcompile import _torch_private as tp
from memcompile.cost_models import device as device_module
from memcompile.cost_models.device import (DATASHEET_PROFILES, DeviceProfile, blas_workspace_bytes,
                                           blas_workspace_bytes_for, compile_scratch_bytes)
from memcompile.cost_models.node_cost import estimate_node_time_s, node_bytes_moved
from memcompile.options import Experiments


def _mm_node(dtype: torch.dtype, n: int):
    graph = make_fx(torch.mm, tracing_mode="fake")(torch.empty(n, n, dtype=dtype), torch.empty(n, n, dtype=dtype))
    (node,) = [x for x in graph.graph.nodes if x.op == "call_function"]
    return node


@pytest.mark.parametrize("device", ["a100", "h100", "h200"])
def test_float32_matmuls_are_timed_at_float32_or_tf32_rates(device):
    profile = DATASHEET_PROFILES[device]
    n = 4096  # compute-bound on every profile, at every dtype
    bf16 = estimate_node_time_s(_mm_node(torch.bfloat16, n), profile) - profile.op_overhead_s
    saved = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        fp32 = estimate_node_time_s(_mm_node(torch.float32, n), profile) - profile.op_overhead_s
        torch.set_float32_matmul_precision("high")
        tf32 = estimate_node_time_s(_mm_node(torch.float32, n), profile) - profile.op_overhead_s
    finally:
        torch.set_float32_matmul_precision(saved)
    assert bf16 == pytest.approx(2 * n**3 / profile.matmul_flops_per_s)
    assert fp32 == pytest.approx(2 * n**3 / profile.float32_matmul_flops_per_s)
    assert tf32 == pytest.approx(2 * n**3 / profile.tf32_matmul_flops_per_s)
    assert bf16 < tf32 < fp32


def test_the_step_device_is_found_in_the_inputs_as_aot_autograd_nests_them(monkeypatch):
    """The cost profile follows the step's device. AOTAutograd hands the partitioner its inputs
    nested ((primals, tangents)); reading only the top level found no tensor, so every CUDA step
    was costed with the host CPU's profile (recompute ~1000x too slow, offload never "auto")."""
    import memcompile.planner as planner

    seen = []
    original = planner.step_device
    monkeypatch.setattr(planner, "step_device", lambda inputs: seen.append(inputs) or original(inputs))
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    torch.compile(model, backend=memcompile.budget(10**9, codegen="aot_eager"))(torch.randn(4, 8)).sum().backward()
    assert seen, "the planner did not look for the device"

    def on_meta(x):  # the same nesting, the tensors on another device
        if isinstance(x, torch.Tensor):
            return torch.empty(x.shape, dtype=x.dtype, device="meta")
        if isinstance(x, (list, tuple)):
            return type(x)(on_meta(y) for y in x)
        return x

    assert original(seen[0]) == "cpu"
    assert original(on_meta(seen[0])) == "meta"
    # A CPU scalar (a seed, a step count) beside device tensors does not make the step a CPU one.
    assert original(([torch.tensor(3)], [torch.empty(2, device="meta")])) == "meta"


@pytest.mark.parametrize("major, environ, expected", [
    (9, {}, 32 * 2**20),  # Hopper default
    (10, {}, 32 * 2**20),  # Blackwell
    (8, {}, 4096 * 1024 * 2 + 16 * 1024 * 8),  # ":4096:2:16:8" before Hopper
    (9, {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}, 16 * 1024 * 8),  # the deterministic-algorithms setting
    (8, {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}, 4096 * 1024 * 8),
    (9, {"CUBLAS_WORKSPACE_CONFIG": "nonsense"}, 32 * 2**20),  # unparsable: PyTorch warns, keeps the default
    (9, {"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "0"}, 32 * 2**20 + 2**20),  # cuBLASLt's own 1 MiB beside it
    (9, {"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "0", "CUBLASLT_WORKSPACE_SIZE": "4096"}, 32 * 2**20 + 4 * 2**20),
])
def test_cublas_workspace_is_sized_as_pytorch_sizes_it(major, environ, expected):
    assert blas_workspace_bytes_for(major, environ) == expected


def test_library_workspaces_enter_the_reserve_and_the_smallest_budget(monkeypatch):
    """On CUDA the cuBLAS workspaces (one per thread: forward and autograd's backward) are device
    memory `max_memory_allocated` counts; an H200 run measured 2 x 32 MiB beyond every plan's
    prediction. Here (CPU) the device has none; the backend's hook is fed a size."""
    import memcompile.backend as backend_module

    assert blas_workspace_bytes("cpu") == 0
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    x = torch.randn(64, 32)

    def smallest_budget(workspace: int) -> int:
        monkeypatch.setattr(backend_module, "blas_workspace_bytes", lambda device: workspace)
        torch.compiler.reset()
        backend = memcompile.budget(1, reserve=0, codegen="aot_eager")
        with pytest.raises(memcompile.InfeasibleBudgetError) as error:
            torch.compile(model, backend=backend)(x).sum().backward()
        assert backend.options.library_workspace_bytes == workspace
        assert backend.options.reserve_bytes == workspace
        assert (f"cuBLAS workspaces {workspace}" in str(error.value)) == (workspace > 0)
        return error.value.min_feasible_bytes

    without = smallest_budget(0)
    assert smallest_budget(3 * 2**20) == without + 3 * 2**20

    monkeypatch.setattr(backend_module, "blas_workspace_bytes", lambda device: 2**20)
    torch.compiler.reset()
    backend = memcompile.budget(without + 2**20, codegen="aot_eager")
    torch.compile(model, backend=backend)(x).sum().backward()
    (plan,) = backend.plans
    assert plan.library_workspace_bytes == 2**20 and plan.reserve_bytes == 2**20
    assert plan.predicted_peak_bytes <= plan.step_budget_bytes == without
    assert "cuBLAS workspaces 1.00 MiB" in memcompile.dump(backend)


ATTENTION_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
ATTENTION_CPU_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
PLAIN_PROFILE = DeviceProfile("test", matmul_flops_per_s=1e11, memory_bytes_per_s=1e10, host_link_bytes_per_s=0.0,
                              op_overhead_s=2e-6)


@settings(max_examples=25, deadline=None)
@given(batch=st.integers(1, 4), heads=st.integers(1, 8), seq=st.sampled_from([1, 16, 100, 128, 512]),
       kv_seq=st.sampled_from([None, 7, 64, 300]), head_dim=st.sampled_from([16, 32, 64, 80]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), causal=st.booleans())
def test_cpu_attention_is_timed_by_its_matmuls_forward_and_backward(batch, heads, seq, kv_seq, head_dim, dtype,
                                                                   causal):
    """torch's flop counter has no formula for the CPU attention kernels, so recomputing attention
    was priced as a memory-bound op (Llama small: 8 us estimated, 0.43-0.46 ms measured a call).
    Forward: scores and weighted values, 2 * pairs * (d + dv) FLOPs; backward: 2 * pairs *
    (3 d + 2 dv); timed at the matmul rate of the result dtype. Causal is not discounted."""
    kv_seq = seq if causal or kv_seq is None else kv_seq
    q = torch.empty(batch, heads, seq, head_dim, dtype=dtype)
    k, v = (torch.empty(batch, heads, kv_seq, head_dim, dtype=dtype) for _ in range(2))
    pairs = batch * heads * seq * kv_seq

    def forward(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    traced = make_fx(forward, tracing_mode="fake")(q, k, v)
    (node,) = [n for n in traced.graph.nodes if n.target == ATTENTION_CPU]
    rate = PLAIN_PROFILE.matmul_rate(dtype)
    expected = 2 * pairs * 2 * head_dim / rate
    assert estimate_node_time_s(node, PLAIN_PROFILE) - PLAIN_PROFILE.op_overhead_s == pytest.approx(
        max(expected, node_bytes_moved(node) / PLAIN_PROFILE.memory_bytes_per_s))

    out = torch.empty(batch, heads, seq, head_dim, dtype=dtype)
    lse = torch.empty(batch, heads, seq, dtype=torch.float32)
    traced = make_fx(lambda g, q, k, v, o, lse_: ATTENTION_CPU_BACKWARD(g, q, k, v, o, lse_, 0.0, causal),
                     tracing_mode="fake")(out, q, k, v, out, lse)
    (node,) = [n for n in traced.graph.nodes if n.target == ATTENTION_CPU_BACKWARD]
    expected = 2 * pairs * 5 * head_dim / rate
    assert estimate_node_time_s(node, PLAIN_PROFILE) - PLAIN_PROFILE.op_overhead_s == pytest.approx(
        max(expected, node_bytes_moved(node) / PLAIN_PROFILE.memory_bytes_per_s))


def test_recomputing_attention_costs_its_kernel_in_the_plan(monkeypatch):
    """End to end: in an attention block's analysis the attention output (a getitem of the
    kernel's tuple) costs, to recompute, at least the forward kernel's matmuls at the profile's
    rate; before the formula it cost one op overhead, and the solver recomputed attention first."""
    from budget_helpers import spy_analyses

    seen = spy_analyses(monkeypatch)
    monkeypatch.setattr(memcompile.planner, "profile_for", lambda device: PLAIN_PROFILE)
    batch, seq, dim, heads = 2, 64, 32, 4

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.out = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)

        def forward(self, x):
            q, k, v = (t.view(batch, seq, heads, dim // heads).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.out(y.transpose(1, 2).reshape(batch, seq, dim)).square().sum()

    x = torch.randn(batch, seq, dim)
    torch.compile(Attention(), backend=memcompile.budget(10**9, codegen="aot_eager"))(x).backward()
    (analysis,) = seen
    attention = [i for i, c in enumerate(analysis.candidates)
                 if c.target is operator.getitem and c.args[0].target == ATTENTION_CPU and c.args[1] == 0]
    assert attention, "no attention output among the candidates"
    kernel_s = 2 * batch * heads * seq * seq * 2 * (dim // heads) / PLAIN_PROFILE.matmul_rate(torch.float32)
    for i in attention:
        assert analysis.problem.recompute_cost_s[i] >= kernel_s


def test_attention_log_sum_exp_is_kept_where_memory_allows(monkeypatch):
    """The log-sum-exp of attention is a forward value only the backward reads. It was classed
    as computed in the backward (unkeepable), so every solver plan, keep-all included, re-ran
    attention in the backward to get it; with room to keep everything nothing is recomputed."""
    from budget_helpers import spy_analyses

    seen = spy_analyses(monkeypatch)
    batch, seq, dim, heads = 2, 32, 32, 4
    qkv = torch.nn.Linear(dim, 3 * dim)

    def block(x):
        q, k, v = (t.view(batch, seq, heads, dim // heads).transpose(1, 2) for t in qkv(x).chunk(3, -1))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).square().sum()

    backend = memcompile.budget(10**9, codegen="aot_eager")
    torch.compile(block, backend=backend)(torch.randn(batch, seq, dim)).backward()
    (analysis,) = seen
    (lse,) = [i for i, c in enumerate(analysis.candidates)
              if c.target is operator.getitem and c.args[0].target == ATTENTION_CPU and c.args[1] == 1]
    assert analysis.problem.can_keep[lse], analysis.cannot_keep_reason[lse]
    choices = {d.name: d.choice for d in backend.plans[0].decisions}
    assert choices[analysis.candidates[lse].name] == "keep"
    assert "recompute" not in choices.values(), choices


def test_the_cpu_profile_takes_the_fastest_round_not_the_mean():
    """Other work on the core only slows a round down (the old single timing read 77-88 GFLOP/s
    with a busy loop on the same core, 129-166 without), so the rate is the fastest round's."""
    from memcompile.cost_models.device import _best_rate

    durations = iter([0.03, 0.001, 0.03, 0.03, 0.03])
    rate = _best_rate(1.0, lambda: time.sleep(next(durations)), rounds=5, reps=1)
    assert rate > 1 / 0.01  # the mean round (0.024 s) would give ~42


def test_eager_embedding_backward_scratch_is_counted():
    """The embedding backward's decomposition run eagerly (codegen="aot_eager") copies its values,
    indices and mask before accumulating: uncounted, GPT-2 tiny measured 12.5 KiB over its floor
    there. Inductor lowers it to a scatter that allocates nothing beside its result."""
    from memcompile.cost_models.transient_memory import kernel_workspace_bytes

    op = torch.ops.aten._unsafe_masked_index_put_accumulate.default
    grad, values = torch.zeros(32, 64), torch.randn(2, 32, 64)
    index = torch.randint(0, 32, (2, 32))
    mask = (index >= 0).unsqueeze(-1)
    gm = make_fx(lambda g, m, i, v: op(g, m, [i], v), tracing_mode="fake")(grad, mask, index, values)
    (node,) = [n for n in gm.graph.nodes if n.target is op]
    measured = memcompile.measure_peak(lambda: op(grad, mask, [index], values),
                                       live_at_start=[grad, mask, index, values])
    scratch = measured.rise_bytes - grad.nbytes  # beside its result
    assert 0 < scratch <= kernel_workspace_bytes(node) <= scratch + 1024
    assert kernel_workspace_bytes(node, inductor=True) == 0


def test_measuring_the_cpu_profile_allocates_nothing_a_budget_counts():
    # it is measured inside the first call, beside the step's tensors (once 33 MiB at a 100 KiB budget)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        profile = device_module.measure_cpu_profile.__wrapped__()
    assert profile.matmul_flops_per_s > 0 and profile.memory_bytes_per_s > 0
    assert 0 < profile.large_memory_bytes_per_s <= profile.memory_bytes_per_s and profile.cache_bytes > 0
    assert [d for _, d in tp.profiler_allocation_deltas(prof) if d > 0] == []


@settings(max_examples=50, deadline=None)
@given(nbytes=st.integers(0, 2**34), working_set=st.one_of(st.none(), st.integers(0, 2**34)),
       cache_mib=st.integers(1, 256), slower=st.floats(1.0, 8.0))
def test_memory_time_is_at_the_large_rate_beyond_the_cache_only(nbytes, working_set, cache_mib, slower):
    cached = DeviceProfile("test", 1e11, 8e10, 0.0, 2e-6)
    tiered = DeviceProfile("test", 1e11, 8e10, 0.0, 2e-6, large_memory_bytes_per_s=8e10 / slower,
                           cache_bytes=cache_mib * 2**20)
    beyond = (nbytes if working_set is None else working_set) > cache_mib * 2**20
    assert cached.memory_time_s(nbytes, working_set) == nbytes / 8e10  # no large rate: one rate for all
    assert tiered.memory_time_s(nbytes, working_set) == pytest.approx(nbytes / 8e10 * (slower if beyond else 1.0))


_COMPILE_FRAMES = ("dynamo_timed", "entire_frame_compile", "backend_compile", "compile_fx")


def _most_held_by_compiles(prof) -> int:
    """The most bytes that allocations made inside compile frames held at once."""
    allocation = torch._C._profiler._EventType.Allocation
    events, stack = [], [(e, False) for e in prof.profiler.kineto_results.experimental_event_tree()]
    while stack:
        event, inside = stack.pop()
        inside = inside or any(frame in event.name for frame in _COMPILE_FRAMES)
        kind, extra = event.typed
        if kind == allocation and inside:
            events.append((event.start_time_ns, int(extra.alloc_size)))
        stack.extend((child, inside) for child in event.children)
    held = most = 0
    for _, delta in sorted(events):
        held += delta
        most = max(most, held)
    return most


@pytest.mark.parametrize("codegen", ["aot_eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_what_a_compile_during_the_step_holds_fits_its_reserve(codegen, monkeypatch):
    """Each region compiles at its first call, beside what the step holds then: the copies of the
    generator state that Dynamo, AOTAutograd, Inductor and memcompile keep meanwhile are counted
    (compile_scratch_bytes) where other regions hold memory. Op timing is off here: it is bounded
    by the headroom apart."""
    torch.compiler.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    x = torch.randn(8, 16)
    backend = memcompile.budget("1GB", codegen=codegen, experiments=Experiments(time_ops=False))
    compiled = torch.compile(model, backend=backend)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        compiled(x).sum().backward()
    held = _most_held_by_compiles(prof)
    torch.compiler.reset()
    assert backend.compile_scratch == compile_scratch_bytes("cpu") > 0
    assert 0 < held <= compile_scratch_bytes("cpu"), held
