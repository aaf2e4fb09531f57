"""What a user reaches for (issue 30): budgets relative to the device, the optimizer's state
counted, quiet logs with progress, max_batch over plans, and what holds memory at the peak."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import memcompile
from memcompile import logs
from memcompile.device_budget import DeviceMemory, device_memory, parse_relative, resolve_relative
from memcompile.optimizer_state import optimizer_reserve
from memcompile.plan_dump import load_plans, to_html

from models import MLP

REPO = Path(__file__).resolve().parents[1]
SVG = "{http://www.w3.org/2000/svg}"
FAST = {"codegen": "aot_eager", "time_limit_s": 2.0}


def step(model: nn.Module, x: torch.Tensor, backend) -> None:
    """One plain step (gradients reset first: accumulated ones would count in the budget)."""
    model.zero_grad(set_to_none=True)
    torch.compile(model, backend=backend)(x).sum().backward()


# -- 1. budgets relative to the device ------------------------------------------------------------

@pytest.mark.parametrize("text, spelled", [("90%", "90%"), (" 90.5 % ", "90.5%"), ("100%", "100%"), ("free", "free"),
                                           ("FREE", "free"), ("20GB", None), (123, None)])
def test_relative_budgets_are_recognised(text, spelled):
    assert parse_relative(text) == spelled


@pytest.mark.parametrize("bad", ["150%", "0%", "-5%", "abc%", "%", "100.1%", "90%%"])
def test_bad_percentages_raise_a_clear_value_error(bad):
    with pytest.raises(ValueError, match="percentage"):
        memcompile.budget(bad)


def test_free_subtracts_the_stated_margin_and_a_percent_is_of_the_total():
    memory = DeviceMemory("cuda:0", 1_000_000, 400_000, "total memory (test)", "free (test)")
    free = resolve_relative("free", memory)
    assert free.budget_bytes == 380_000 and "5% margin" in free.source and "cuda:0" in free.source
    assert resolve_relative("90%", memory).budget_bytes == 900_000
    with pytest.raises(ValueError, match="resolves to 0 bytes"):
        resolve_relative("free", DeviceMemory("cpu", 10, 0, "", ""))


def test_cuda_free_counts_what_this_process_allocator_holds(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (3 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda index: 2**30)
    memory = device_memory(torch.device("cuda", 1))
    assert (memory.device, memory.total_bytes, memory.free_bytes) == ("cuda:1", 80 * 2**30, 4 * 2**30)
    assert "torch.cuda.mem_get_info" in memory.total_source
    assert resolve_relative("90%", memory).source == "90% of cuda:1's 80.00 GiB total memory (torch.cuda.mem_get_info)"


def test_a_percent_budget_resolves_at_the_first_graph_on_the_cpu_and_the_plan_says_from_what():
    backend = memcompile.budget("50%", **FAST)
    assert backend.options.budget_bytes == 0 and backend.options.budget_spec == "50%"
    step(MLP(16, 2), torch.randn(8, 16), backend)
    total = device_memory(torch.device("cpu")).total_bytes
    assert backend.options.budget_bytes == total // 2
    plan = backend.plans[0]
    assert plan.budget_bytes == total // 2
    assert plan.budget_source.startswith("50% of the CPU's ") and "memory" in plan.budget_source
    assert f"budget from      {plan.budget_source}" in memcompile.dump(backend)
    assert plan.budget_source in memcompile.dump(backend, format="html").replace("&#x27;", "'")


def test_a_relative_budget_by_name_and_a_reserve_it_cannot_hold_raises_at_the_call():
    model, x = MLP(16, 2), torch.randn(8, 16)
    options = {"budget": "free", **FAST}
    torch.compile(model, backend="memcompile", options=options)(x).sum().backward()
    assert memcompile.named_backend(options).plans[0].budget_source.startswith("free at the first call on the CPU")
    torch._dynamo.reset()
    backend = memcompile.budget("1%", reserve="100TB", **FAST)  # accepted now: the budget is not known yet
    with pytest.raises(ValueError, match=r"budget\('1%'\) = \d+ bytes .*leaves nothing"):
        step(model, x, backend)


# -- 2. the optimizer's state ---------------------------------------------------------------------

class TwoDtypes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Parameter(torch.randn(5, dtype=torch.bfloat16))
        self.frozen = nn.Parameter(torch.randn(64), requires_grad=False)

    def forward(self, x):
        return (self.a(x).sum() + self.b.float().sum()) * 1.0


def state_bytes(optimizer) -> int:
    return sum(t.untyped_storage().nbytes() for s in optimizer.state.values() for t in s.values()
               if isinstance(t, torch.Tensor))


OPTIMIZERS = [
    (torch.optim.Adam, {}), (torch.optim.Adam, {"amsgrad": True}), (torch.optim.AdamW, {"foreach": True}),
    (torch.optim.AdamW, {"fused": True}), (torch.optim.SGD, {"lr": 0.1}), (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    (torch.optim.RMSprop, {"momentum": 0.9, "centered": True}), (torch.optim.Adamax, {}), (torch.optim.NAdam, {}),
    (torch.optim.RAdam, {}), (torch.optim.Adadelta, {}), (torch.optim.Adagrad, {}), (torch.optim.Rprop, {}),
]


@pytest.mark.parametrize("cls, kwargs", OPTIMIZERS, ids=lambda v: getattr(v, "__name__", None) or str(v))
def test_the_estimate_before_the_first_step_is_what_the_optimizer_then_holds(cls, kwargs):
    model = TwoDtypes()
    optimizer = cls(model.parameters(), **kwargs)
    before = optimizer_reserve(optimizer)
    model(torch.randn(2, 8)).backward()
    optimizer.step()
    assert before.nbytes == state_bytes(optimizer) == optimizer_reserve(optimizer).nbytes
    if cls is torch.optim.SGD and not kwargs.get("momentum"):
        assert before.nbytes == 0 and "nothing per parameter" in before.source
    else:
        assert "from optimizer.state" in optimizer_reserve(optimizer).source


def test_adamw_counts_two_moments_in_the_parameters_dtype():
    model = TwoDtypes()
    reserve = optimizer_reserve(torch.optim.AdamW(model.parameters()))
    # exp_avg and exp_avg_sq in float32 for the Linear, bfloat16 for b; a CPU step scalar each; not `frozen`
    assert reserve.nbytes == 2 * (8 * 8 + 8) * 4 + 2 * 5 * 2 + 3 * 4
    assert "exp_avg, exp_avg_sq" in reserve.source and "from the algorithm" in reserve.source


def test_an_unknown_optimizer_is_a_clear_error_until_its_state_exists():
    class Mine(torch.optim.SGD):
        pass

    model = TwoDtypes()
    optimizer = Mine(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(TypeError, match="cannot tell what Mine will hold"):
        memcompile.budget("1GB", optimizer=optimizer)
    model(torch.randn(2, 8)).backward()
    optimizer.step()
    assert memcompile.budget("1GB", optimizer=optimizer).options.optimizer_reserve_bytes == state_bytes(optimizer)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        memcompile.budget("1GB", optimizer=model)


def test_the_optimizer_reserve_is_in_the_plan_the_dump_and_the_check():
    model, x = MLP(32, 4), torch.randn(256, 32)
    optimizer = torch.optim.AdamW(model.parameters())
    state = optimizer_reserve(optimizer).nbytes
    with pytest.raises(ValueError, match="of which the optimizer's state"):
        memcompile.budget(state, optimizer=optimizer)
    backend = memcompile.budget(10**9, reserve=1000, optimizer=optimizer, **FAST)
    assert backend.options.reserve_bytes == 1000 + state
    step(model, x, backend)
    plan = backend.plans[0]
    # beside what a compile during the step holds (a constant, on the CPU)
    assert (plan.reserve_bytes - plan.compile_scratch_bytes, plan.optimizer_reserve_bytes) == (1000 + state, state)
    assert plan.step_budget_bytes == 10**9 - 1000 - state - plan.compile_scratch_bytes
    text = memcompile.dump(backend)
    assert f"(optimizer state {memcompile.plan.format_bytes(state)}" in text and "AdamW state" in text
    assert "optimizer state" in memcompile.dump(backend, format="html")
    optimizer.step()  # the state now exists: what was reserved
    assert state_bytes(optimizer) == state


# -- 3. logs: quiet by default, one line per region, a progress line, one summary ------------------

def test_a_training_loop_logs_one_line_per_region_and_one_summary(caplog):
    caplog.set_level(logging.DEBUG, logger="memcompile")
    model, x = MLP(32, 6), torch.randn(512, 32)
    backend = memcompile.budget(700_000, **FAST)
    compiled = torch.compile(model, backend=backend)
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        compiled(x).sum().backward()
    shown = [r.getMessage() for r in caplog.records if r.name == "memcompile" and r.levelno >= logging.INFO]
    assert len(shown) == 2, shown
    region, summary = shown
    plan = backend.plans[0]
    assert region.startswith("memcompile: region 0 (graph_0) planned in ")
    for part in (f"predicted peak {memcompile.plan.format_bytes(plan.predicted_peak_bytes)}",
                 f"of the step budget {memcompile.plan.format_bytes(700_000 - plan.reserve_bytes)}", "solve ", "check "):
        assert part in region, part
    assert summary.startswith("memcompile: first step: predicted peak ") and "within it" in summary
    assert any(r.levelno == logging.DEBUG for r in caplog.records)  # the rest is there, at DEBUG


def test_progress_names_the_region_the_rung_and_the_planner_step(monkeypatch, caplog):
    monkeypatch.setattr(logs, "PROGRESS_AFTER_S", 0.05)
    monkeypatch.setattr(logs, "PROGRESS_EVERY_S", 60.0)
    caplog.set_level(logging.INFO, logger="memcompile")
    with logs.progress("region 3"):
        logs.rung("the loss head chunked (no plan fits without it)")
        logs.stage("graph_7: searching the least-peak plan")
        time.sleep(0.5)
    lines = [r.getMessage() for r in caplog.records if "still planning" in r.getMessage()]
    assert lines == ["memcompile: still planning region 3 after 0 s: rung the loss head chunked (no plan fits "
                     "without it); graph_7: searching the least-peak plan"]
    logs.stage("outside any compile: ignored")


def test_a_long_first_compile_reports_progress(monkeypatch, caplog):
    monkeypatch.setattr(logs, "PROGRESS_AFTER_S", 0.0)
    caplog.set_level(logging.INFO, logger="memcompile")
    step(MLP(16, 2), torch.randn(8, 16), memcompile.budget(10**9, **FAST))
    assert any(r.getMessage().startswith("memcompile: still planning region 0 after 0 s: rung the graph as traced")
               for r in caplog.records)


def test_by_default_stderr_gets_the_region_line_and_the_summary_only():
    code = ("import torch, memcompile, sys; sys.path.insert(0, 'tests'); from models import MLP\n"
            "m, x = MLP(16, 2), torch.randn(8, 16)\n"
            "f = torch.compile(m, backend=memcompile.budget(10**9, codegen='aot_eager'))\n"
            "for _ in range(3): f(x).sum().backward()\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("MEMCOMPILE_LOGS", None)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert run.returncode == 0, run.stderr
    ours = [line for line in run.stderr.splitlines() if line.startswith("memcompile")]
    assert len(ours) == 2 and "region 0 (graph_0) planned" in ours[0] and "first step" in ours[1], run.stderr
    quiet = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300,
                           env={**env, "MEMCOMPILE_LOGS": "warning"})
    assert quiet.returncode == 0 and "memcompile" not in quiet.stderr, quiet.stderr


# -- 4. max_batch: bisection over plans -----------------------------------------------------------

def mlp_steps(model: nn.Module):
    def make_step(batch, backend):
        compiled = torch.compile(model, backend=backend, dynamic=False)
        x = torch.randn(batch, 32)
        return lambda: compiled(x).sum().backward()

    return make_step


def test_max_batch_finds_the_largest_batch_whose_plan_fits_without_running_a_step():
    torch.manual_seed(0)
    model = MLP(32, 6)
    budget = 400_000
    found = memcompile.max_batch(mlp_steps(model), budget, lo=8, hi=1024, **FAST)
    assert all(p.grad is None for p in model.parameters())  # plans only: no step ran
    probed = {p.batch: p for p in found.probes}
    assert probed[found.batch].fits and not probed[found.batch + 1].fits
    assert found.plan.predicted_peak_bytes <= found.plan.step_budget_bytes == budget - found.plan.reserve_bytes
    assert probed[found.batch + 1].need_bytes > budget
    assert found.limit.startswith(f"batch {found.batch}'s plan peaks at ")
    assert f"batch {found.batch + 1} needs a budget of at least" in found.limit
    # The batch found runs within the budget, measured.
    backend = memcompile.budget(budget, **FAST)
    x = torch.randn(found.batch, 32)
    compiled = torch.compile(model, backend=backend)
    compiled(x).sum().backward()
    model.zero_grad(set_to_none=True)
    measured = memcompile.measure_peak(lambda: compiled(x).sum().backward(), live_at_start=[model, x])
    assert measured.peak_bytes <= budget


def test_max_batch_validates_and_raises_when_even_lo_does_not_fit():
    make_step = mlp_steps(MLP(32, 2))
    for bad in ({"lo": 0}, {"lo": 4, "hi": 2}, {"lo": 1.5}):
        with pytest.raises(ValueError, match="max_batch"):
            memcompile.max_batch(make_step, "1GB", **bad)
    with pytest.raises(TypeError, match="expected the step to run"):
        memcompile.max_batch(lambda batch, backend: None, "1GB", **FAST)
    with pytest.raises(RuntimeError, match="without compiling a graph with the backend"):
        memcompile.max_batch(lambda batch, backend: (lambda: None), "1GB", **FAST)
    with pytest.raises(memcompile.InfeasibleBudgetError) as error:
        memcompile.max_batch(make_step, 20_000, lo=64, hi=128, **FAST)
    assert error.value.min_feasible_bytes > 20_000
    found = memcompile.max_batch(make_step, memcompile.budget("1GB", **FAST), lo=1, hi=4)
    assert found.batch == 4 and "hi=4 reached" in found.limit and len(found.probes) == 2


# -- 6. the picture: what holds memory at the peak ------------------------------------------------

@pytest.fixture(scope="module")
def tight_plan():
    """A plan that recomputes: the MLP at 0.85 of its keep-all peak."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = MLP(32, 6), torch.randn(512, 32)
    keep_all = memcompile.budget(10**9, **FAST)
    step(model, x, keep_all)
    torch._dynamo.reset()
    backend = memcompile.budget(int(0.85 * keep_all.plans[0].predicted_peak_bytes), **FAST)
    step(model, x, backend)
    torch._dynamo.reset()
    plan = backend.plans[0]
    assert any(d.choice == "recompute" for d in plan.decisions)
    return plan


def test_live_bytes_by_category_add_up_at_every_step(tight_plan):
    plan = tight_plan
    series = dict(plan.live_categories_after)
    assert list(series) == ["parameters_and_inputs", "gradients", "saved_activations", "outputs", "temporaries",
                            "op_scratch_and_workspace"]
    for i, total in enumerate(plan.live_bytes_after):
        assert sum(values[i] for values in series.values()) == total
    peak = plan.live_bytes_after.index(plan.predicted_peak_bytes)
    assert {c: v[peak] for c, v in series.items() if v[peak]} == {c: b for c, b in plan.peak_breakdown if b}
    assert 0 < plan.backward_from_step < len(plan.live_bytes_after)
    names = [name for name, _, _ in plan.peak_tensors]
    sizes = [b for _, _, b in plan.peak_tensors]
    assert sizes == sorted(sizes, reverse=True) and sum(sizes) <= plan.predicted_peak_bytes
    assert "primals_1" in names or any(n.endswith("(backward)") for n in names)


def test_the_picture_stacks_categories_and_lists_the_peak(tight_plan):
    plan = tight_plan
    html = to_html([plan])
    ET.fromstring(html)
    svg = ET.fromstring(re.search(r"<svg\b.*?</svg>", html, flags=re.S).group(0))
    drawn = [p.get("data-category") for p in svg.findall(f".//{SVG}polygon[@class='category']")]
    assert drawn == [c for c, v in plan.live_categories_after if any(v)]
    peak_step = int(svg.find(f".//{SVG}circle[@class='peak']").get("data-step"))
    at_peak = {p.get("data-category"): int(p.get("data-peak-bytes"))
               for p in svg.findall(f".//{SVG}polygon[@class='category']")}
    assert sum(at_peak.values()) == plan.live_bytes_after[peak_step] == plan.predicted_peak_bytes
    assert svg.find(f".//{SVG}line[@class='phase-boundary']") is not None
    page = ET.fromstring(html)
    ns = "{http://www.w3.org/1999/xhtml}"
    categories = [tr.get("data-category") for tr in page.iter(f"{ns}tr") if tr.get("data-category")
                  and tr.get("data-bytes") is None]
    assert set(categories) == {c for c, b in plan.peak_breakdown if b}
    tensors = [(tr.get("data-category"), int(tr.get("data-bytes"))) for tr in page.iter(f"{ns}tr")
               if tr.get("data-bytes") is not None]
    assert tensors == [(c, b) for _, c, b in plan.peak_tensors]
    assert "Largest tensors live at the peak" in html and "Fits." in html


def test_the_status_reads_in_plain_words():
    from test_dump import hand_plan

    least = hand_plan(solver_status="least_peak_optimal", gap=1.0)
    html = to_html([least])
    verdict = html[html.index('<p class="status">'):]
    verdict = verdict[:verdict.index("</p>")]
    assert "the least memory memcompile can plan" in verdict and "100" not in verdict
    assert "gap" not in memcompile.dump(least).split("solver", 1)[1].splitlines()[0]
    stock = to_html([hand_plan(solver_status="stock_partition (activation_memory_budget=0.8)")])
    assert "PyTorch&#x27;s own partition (activation_memory_budget=0.8) fits" in stock
    assert "NOT enforced" in to_html([hand_plan(solver_status="stock_fallback (KeyError)")])


def test_new_plan_fields_survive_the_json_round_trip(tight_plan, tmp_path):
    memcompile.dump(tight_plan, format="json", path=tmp_path / "p.json")
    assert load_plans(tmp_path / "p.json") == [tight_plan]


@pytest.mark.inductor
def test_under_inductor_the_scheduled_check_splits_categories_and_names_tensors():
    """Planned with Inductor's check (its lowering and schedule), no code generated (plan-only)."""
    torch.manual_seed(0)
    backend = memcompile.Backend(memcompile.make_options(700_000, time_limit_s=2.0))
    backend.plan_only = True
    with pytest.raises(memcompile.errors.PlannedOnly) as planned:
        step(MLP(32, 6), torch.randn(512, 32), backend)
    plan = planned.value.plan
    series = dict(plan.live_categories_after)
    for i, total in enumerate(plan.live_bytes_after):
        assert sum(values[i] for values in series.values()) == total
    assert plan.peak_tensors and not any(re.fullmatch(r"(bw:)?buf\d+", name) for name, _, _ in plan.peak_tensors)
    assert plan.check_s > 0
