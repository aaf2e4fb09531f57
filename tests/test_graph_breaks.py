"""Graph breaks and per-block compilation: one budget for the whole step (memcompile/ledger.py).

Random models with `torch._dynamo.graph_break()` at random points, compiled with codegen=
"aot_eager" (the FX interpreter frees values exactly as the liveness pass models): gradients
equal eager, and both the ledger's predicted step peak (every region's own peak plus what the
others hold while it runs) and the measured peak of the whole step stay under the budget.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, Phase, example, given, settings, strategies as st

import memcompile
from memcompile.cost_models.device import compile_scratch_bytes
from models import Attention

SETTINGS = settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck),
                    phases=[Phase.explicit, Phase.reuse, Phase.generate])


class BrokenChain(nn.Module):
    """Blocks in a chain with a graph break after the blocks in `breaks`; the loss at the end."""

    def __init__(self, blocks: list[nn.Module], breaks: frozenset[int]):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.breaks = breaks

    def forward(self, x):
        # Unrolled: a graph break inside a `for` loop makes Dynamo skip the whole frame (and
        # compile each block on its own: the per-block case, tested below).
        x = self.blocks[0](x)
        if 0 in self.breaks:
            torch._dynamo.graph_break()
        if len(self.blocks) > 1:
            x = self.blocks[1](x)
        if 1 in self.breaks:
            torch._dynamo.graph_break()
        if len(self.blocks) > 2:
            x = self.blocks[2](x)
        if 2 in self.breaks:
            torch._dynamo.graph_break()
        if len(self.blocks) > 3:
            x = self.blocks[3](x)
        return x.float().pow(2).mean()


class Dense(nn.Module):
    def __init__(self, d: int, act: str):
        super().__init__()
        self.a, self.b = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.act = {"tanh": torch.tanh, "gelu": nn.functional.gelu, "sigmoid": torch.sigmoid}[act]

    def forward(self, x):
        # a chain of cheap pointwise ops: activations worth recomputing
        h = self.act(self.a(x))
        h = self.act(h * 1.5 - 0.25)
        h = self.act(h * 0.5 + 0.25)
        return x + self.b(h)


def _build(arch: str, depth: int, width: int, batch: int, act: str, breaks: frozenset[int], dtype):
    torch.manual_seed(0)
    if arch == "dense":
        blocks, x = [Dense(width, act) for _ in range(depth)], torch.randn(batch, width)
    else:
        blocks, x = [Attention(width, 2) for _ in range(depth)], torch.randn(batch, 8, width)
    model = BrokenChain(blocks, breaks).to(dtype)
    return model, x.to(dtype).requires_grad_(True)


def _grads(model, x, fn):
    model.zero_grad(set_to_none=True)
    x.grad = None
    fn(x).backward()
    return [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]


def _warm_up(backend, compiled, model, x, max_steps: int) -> int:
    """Steps until no region re-plans (the ledger converged); returns how many it took."""
    for step in range(1, max_steps + 1):
        before = len(backend.plans)
        model.zero_grad(set_to_none=True)
        x.grad = None
        compiled(x).backward()
        if step > 1 and len(backend.plans) == before:
            return step
    raise AssertionError(f"the step ledger did not converge in {max_steps} steps: {len(backend.plans)} plans")


def _unconstrained_step_peak(model, x, regions: int, codegen: str = "aot_eager") -> int:
    backend = memcompile.budget(10**12, codegen=codegen, time_limit_s=2)
    compiled = torch.compile(model, backend=backend)
    _warm_up(backend, compiled, model, x, regions + 3)
    torch.compiler.reset()
    return backend.predicted_step_peak()


def _check_step(model, x, budget: int, regions: int, tol, codegen: str = "aot_eager") -> dict:
    """Compile under `budget`, warm up, measure one step; asserts the budget and eager gradients."""
    expected = _grads(model, x, model)
    backend = memcompile.budget(budget, codegen=codegen, time_limit_s=2)
    compiled = torch.compile(model, backend=backend)
    _warm_up(backend, compiled, model, x, regions + 3)
    model.zero_grad(set_to_none=True)
    x.grad = None
    measured = memcompile.measure_peak(lambda: compiled(x).backward(), live_at_start=[model, x])
    got = [p.grad for p in model.parameters()] + [x.grad]
    for a, b in zip(expected, got):
        torch.testing.assert_close(b, a, **tol)
    predicted = backend.predicted_step_peak()
    slots = backend.ledger.footprints()
    assert len(slots) == regions, slots
    assert predicted <= budget
    assert measured.peak_bytes <= budget
    # the ledger's sum is an upper bound of the real step
    assert measured.peak_bytes <= predicted, (measured.peak_bytes, predicted, budget, backend.ledger.eager_bytes(),
                                              backend.measured_steps)
    return {"predicted": predicted, "measured": measured.peak_bytes, "budget": budget, "backend": backend}


@SETTINGS
@given(arch=st.sampled_from(["dense", "attention"]), depth=st.integers(2, 4), width=st.sampled_from([16, 32]),
       batch=st.integers(8, 48), act=st.sampled_from(["tanh", "gelu", "sigmoid"]),
       break_bits=st.integers(0, 7), dtype=st.sampled_from([torch.float32, torch.float64]),
       fraction=st.floats(0.5, 1.05))
@example(arch="dense", depth=4, width=16, batch=10, act="gelu", break_bits=3, dtype=torch.float32, fraction=1.05)
def test_random_graph_breaks_keep_the_whole_step_under_budget(arch, depth, width, batch, act, break_bits,
                                                              dtype, fraction):
    torch.compiler.reset()
    breaks = frozenset(i for i in range(depth - 1) if break_bits >> i & 1)
    regions = len(breaks) + 1
    model, x = _build(arch, depth, width, batch, act, breaks, dtype)
    # The first step compiles each later region beside the earlier ones' activations: what that
    # compile holds (the generator-state copies) is part of what the step needs, not only the
    # steady state (dense x4, 10 x 16, two breaks: 20,224 B on 46,792).
    high = _unconstrained_step_peak(model, x, regions) + (compile_scratch_bytes("cpu") if regions > 1 else 0)
    budget = int(fraction * high)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-9, atol=1e-10)
    try:
        _check_step(model, x, budget, regions, tol)
    except memcompile.InfeasibleBudgetError as error:
        # Typed, raised before the step runs over, naming a budget above this one.
        assert error.min_feasible_bytes > budget
        assert fraction < 1.0
    torch.compiler.reset()


def test_regions_account_for_each_other():
    """Without the ledger each region would be planned for the whole budget; with it, the sum of
    what regions hold at once fits, and a budget between one region's need and the step's needs
    re-plans (recomputes more) instead of running over."""
    model, x = _build("dense", 4, 32, 256, "tanh", frozenset({0, 1, 2}), torch.float32)
    high = _unconstrained_step_peak(model, x, 4)
    # 64 KiB below the unconstrained step: about one hidden activation must be recomputed.
    result = _check_step(model, x, high - 65536, 4, dict(rtol=1e-4, atol=1e-5))
    backend = result["backend"]
    last_plans = backend.plans[-4:]
    assert any(d.choice == "recompute" for p in last_plans for d in p.decisions)
    # Later positions are planned with what earlier ones hold (their reserve grows).
    slots = backend.ledger.footprints()
    assert all(s.own_peak_bytes < result["budget"] for s in slots)
    assert sum(s.saved_bytes for s in slots) > 0


def test_per_block_compilation_shares_one_budget():
    """Each block compiled on its own (the same code object called once per block): positions,
    not compiled graphs, are what the ledger counts."""
    torch.manual_seed(0)
    blocks = nn.ModuleList(Dense(32, "gelu") for _ in range(4))
    x = torch.randn(128, 32, requires_grad=True)

    def run(compiled_blocks, inp):
        for block in compiled_blocks:
            inp = block(inp)
        return inp.pow(2).mean()

    expected = _grads(blocks, x, lambda inp: run(blocks, inp))
    backend = memcompile.budget(10**12, codegen="aot_eager", time_limit_s=2)
    compiled = [torch.compile(b, backend=backend) for b in blocks]
    for _ in range(4):
        _grads(blocks, x, lambda inp: run(compiled, inp))
    # the regions compile beside each other: a step of several counts the compiles' scratch
    high = backend.predicted_step_peak() + backend.options.reserve_bytes + backend.compile_scratch
    assert len(backend.ledger.footprints()) == 4
    torch.compiler.reset()
    budget = high - 32768  # one hidden activation of the last block less
    backend = memcompile.budget(budget, codegen="aot_eager", time_limit_s=2)
    compiled = [torch.compile(b, backend=backend) for b in blocks]
    for _ in range(6):
        got = _grads(blocks, x, lambda inp: run(compiled, inp))
    for a, b in zip(expected, got):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    blocks.zero_grad(set_to_none=True)
    x.grad = None
    # live at start: the blocks, x, and the tensors the final mean/pow (eager) hold are in the step
    measured = memcompile.measure_peak(lambda: run(compiled, x).backward(), live_at_start=[blocks, x])
    assert backend.predicted_step_peak() <= budget
    # the eager loss (pow, mean) outside the compiled blocks is not planned: allow its bytes
    loss_bytes = 2 * 128 * 32 * 4
    assert measured.peak_bytes <= budget + loss_bytes
    assert any(d.choice == "recompute" for p in backend.plans[-4:] for d in p.decisions)


def test_infeasible_total_raises_the_typed_error():
    """Every region fits the budget alone, the step does not: the typed error, before running over."""
    model, x = _build("dense", 4, 32, 256, "tanh", frozenset({0, 1, 2}), torch.float32)
    backend = memcompile.budget(10**12, codegen="aot_eager", time_limit_s=2)
    compiled = torch.compile(model, backend=backend)
    _warm_up(backend, compiled, model, x, 7)
    one_region = max(p.predicted_peak_bytes for p in backend.plans)
    torch.compiler.reset()
    budget = one_region + 1024
    backend = memcompile.budget(budget, codegen="aot_eager", time_limit_s=2)
    compiled = torch.compile(model, backend=backend)
    with pytest.raises(memcompile.InfeasibleBudgetError) as info:
        for _ in range(7):
            compiled(x).backward()
    assert info.value.min_feasible_bytes > budget
    assert backend.errors and backend.errors[-1] is info.value


def test_ledger_counts_what_each_position_overlaps_with():
    from memcompile.ledger import Footprint, StepLedger

    a = Footprint(own_peak_bytes=100, params_bytes=10, inputs_bytes=0, saved_bytes=30, grads_bytes=10)
    b = Footprint(own_peak_bytes=200, params_bytes=20, inputs_bytes=5, saved_bytes=40, grads_bytes=20)
    c = Footprint(own_peak_bytes=150, params_bytes=40, inputs_bytes=7, saved_bytes=50, grads_bytes=40)
    ledger = StepLedger()
    for footprint in (a, b, c):
        position = ledger.begin_call()
        ledger.record(position, footprint, planned_outside=0)
    # b runs while a holds its leaves, saved activations and inputs, and c its leaves and grads
    assert ledger.outside_bytes(1) == (10 + 30 + 0) + (40 + 40)
    assert ledger.outside_bytes(0) == (20 + 20) + (40 + 40)
    assert ledger.outside_bytes(2) == (10 + 30 + 0) + (20 + 40 + 5)
    assert ledger.predicted_step_peak() == max(100 + 120, 200 + 120, 150 + 105)
    assert ledger.earlier_plans_stale(2)  # planned with 0 outside, they now see more
    ledger.backward_ran()
    assert ledger.begin_call() == 0  # a backward ran: the next call starts a step
    ledger.cancel_call(0)
    assert ledger.next_position() == 0


def test_the_step_plan_settles_after_one_choice_and_recompiles_each_region_at_most_once():
    """Convergence: regions compile when first called (step 1), the plan for the whole step is
    chosen once when step 2 starts and each region compiles its part of it at most once; from
    step 3 on nothing is compiled or chosen again and every step holds the same footprints."""
    model, x = _build("dense", 4, 32, 256, "tanh", frozenset({0, 1, 2}), torch.float32)
    high = _unconstrained_step_peak(model, x, 4)
    torch.compiler.reset()
    backend = memcompile.budget(int(0.85 * high), codegen="aot_eager", time_limit_s=2)
    compiled = torch.compile(model, backend=backend)
    compiles, footprints = [], []
    for _ in range(6):
        before = backend.compiles
        model.zero_grad(set_to_none=True)
        x.grad = None
        compiled(x).backward()
        compiles.append(backend.compiles - before)
        footprints.append(backend.ledger.footprints())
    assert compiles[0] == 4 and compiles[1] <= 4 and compiles[2:] == [0, 0, 0, 0]
    assert backend.step_plans == 1
    assert len(backend.plans) == sum(compiles) <= 8
    assert all(f == footprints[2] for f in footprints[2:])
    assert backend.predicted_step_peak() <= backend.options.budget_bytes
    assert any(d.choice == "recompute" for p in backend.plans[-4:] for d in p.decisions)


def test_an_early_region_recomputes_so_that_the_last_one_fits():
    """A budget the greedy order (each region planned in call order with what is left) cannot
    meet: the last region's least peak needs room the first one would keep. The step plan makes
    the first recompute instead, and the measured step stays within the budget."""
    torch.manual_seed(0)
    model, x = _build("dense", 2, 32, 512, "gelu", frozenset({0}), torch.float32)
    backend = memcompile.budget(10**12, codegen="aot_eager", time_limit_s=2)
    compiled = torch.compile(model, backend=backend)
    _warm_up(backend, compiled, model, x, 5)
    regions = [region for region in dict.fromkeys(backend.ledger._regions)]
    first, last = (region.plan_options() for region in regions)
    slots = backend.ledger.footprints()
    torch.compiler.reset()
    # Greedy: region 0 keeps all (its own peak is far below the budget), region 1 then needs its
    # least peak on top of region 0's saved bytes. Pick a budget just below that.
    fixed_last = slots[0].params_bytes + slots[0].inputs_bytes
    greedy_need = first[0][0].saved_bytes + fixed_last + last[-1][0].own_peak_bytes
    budget = greedy_need - 1
    # ... while region 0 keeping all fits next to what region 1 holds then: greedy keeps it all.
    assert first[0][0].own_peak_bytes + slots[1].params_bytes + slots[1].grads_bytes <= budget
    result = _check_step(model, x, budget, 2, dict(rtol=1e-4, atol=1e-5))
    kept_first = result["backend"].ledger.footprints()[0].saved_bytes
    assert kept_first < first[0][0].saved_bytes  # region 0 recomputes part of what greedy kept


def test_leaf_inputs_an_engine_frees_after_their_call_are_not_held_by_the_step():
    """FSDP2 frees a block's gathered parameters (storage resized to 0) when the block is done:
    at the next call the ledger drops them, and their gradients, from that position."""
    from memcompile.ledger import Footprint, StepLedger

    ledger = StepLedger()
    block = Footprint(own_peak_bytes=100, params_bytes=40, inputs_bytes=0, saved_bytes=10, grads_bytes=30)
    freed = {"now": (0, 0)}
    for position in range(2):
        assert ledger.begin_call() == position
        ledger.record(position, block, planned_outside=0)
        ledger.watch_leaves(position, lambda: freed["now"])
        freed["now"] = (0, 0) if position == 0 else (25, 20)
    # position 0's leaves were still there at call 1; position 1's were freed before the next call
    ledger.backward_ran()
    assert ledger.begin_call() == 0
    (_, first), (_, second) = ledger.completed_step()
    assert first == block
    assert (second.params_bytes, second.grads_bytes) == (15, 10)


@pytest.mark.inductor
def test_inductor_regions_replan_inside_calls(monkeypatch):
    """Re-plans for the step plan (here: the second region, which ran its least-peak plan in the
    first step) compile again from inside a call, in the tracing context Dynamo compiled the
    graph in: also with Inductor. (Re-plans for larger dynamic sizes take the same path; tested
    with aot_eager in test_dynamic_shapes.) Checked with every node a buffer: over Inductor's
    schedule this small region's least-peak plan is its keep-all plan, leaving nothing to re-plan."""
    model, x = _build("dense", 2, 32, 64, "tanh", frozenset({0}), torch.float32)
    backend = memcompile.budget(10**9, codegen="inductor", time_limit_s=2,
                                experiments=memcompile.Experiments(fusion_check=False))
    compiled = torch.compile(model, backend=backend)
    for batch in (64, 64, 64):
        torch.manual_seed(batch)
        x = torch.randn(batch, 32, requires_grad=True)
        expected = _grads(model, x, model)
        got = _grads(model, x, compiled)
        for a, b in zip(expected, got):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    assert len(backend.ledger.footprints()) == 2
    # The first step ran both regions at their least peak (region 0 ends at a graph break: more
    # of the step follows it); once the step was known, each re-planned once.
    assert len(backend.plans) == 4
    assert all(p.solver_status.startswith("least_peak") for p in backend.plans[:2])
    # Region 0's first plan already counted region 1's parameters and gradients (the frame's
    # module holds them), before region 1 was compiled: what its re-plan counts too.
    assert backend.plans[0].reserve_bytes == backend.plans[2].reserve_bytes > 0
    assert not any(d.choice == "recompute" for p in backend.plans[2:] for d in p.decisions)  # a roomy budget keeps all


@pytest.mark.inductor
def test_the_step_plan_keeps_pytorchs_partitions_where_they_fit(monkeypatch):
    """Under Inductor PyTorch's partitions are options of every region (planner.StockPartitions):
    the plan for the whole step keeps a region that runs one (no re-plan into keep-all, which
    was slower) and the step, measured, stays under the budget its ledger sums to."""
    model, x = _build("dense", 3, 32, 64, "gelu", frozenset({0, 1}), torch.float32)
    high = _unconstrained_step_peak(model, x, 3, codegen="inductor")
    torch.compiler.reset()
    # beside what a region compiling at a call holds (a step of several regions keeps it)
    budget = int(0.97 * high) + compile_scratch_bytes("cpu")
    result = _check_step(model, x, budget, 3, dict(rtol=1e-4, atol=1e-5), codegen="inductor")
    statuses = [p.solver_status for p in result["backend"].plans]
    # Every region's first plan is its least peak (cautious: the step is not known yet, and the
    # first region ends at a graph break). Once it is, each is re-planned once, into a partition.
    assert all(s.startswith("least_peak") for s in statuses[:3]), statuses
    assert len(statuses) == 6 and all(s.startswith("stock_partition") for s in statuses[3:]), statuses
    torch.compiler.reset()
