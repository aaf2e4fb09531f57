"""Acceptance sweep of issue 7: random budgets over models with dropout, autocast, user
checkpoint policies, convolutions and attention (codegen="aot_eager").

Every (scenario, budget) must either compile and run with measured peak <= budget and
gradients matching the reference, or raise InfeasibleBudgetError with the budget below its
min_feasible_bytes. Anything else is a crash. Writes benchmarks/results/robustness_sweep.{json,md}.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/robustness_sweep.py [--budgets-per-scenario 25] [--quick]

The models are the test suite's (tests/), imported from there.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import random
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Callable

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

import memcompile  # noqa: E402
from budget_helpers import budget_range, grads, run_step  # noqa: E402
from models import WithLoss, build  # noqa: E402
from test_autocast import Autocast  # noqa: E402
from test_rng import DropoutAttention, DropoutMLP, NoisyConv  # noqa: E402
from test_user_checkpoint import Blocks, must_policy  # noqa: E402

OPTIONS = dict(codegen="aot_eager", time_limit_s=2)


@dataclass(frozen=True)
class Scenario:
    name: str
    make: Callable[[], tuple[torch.nn.Module, torch.Tensor]]  # (module returning the loss, input)
    reference: str  # "eager" | "stock_partition" (random ops: same decomposed graph, same seed)
    rtol: float
    atol_scale: float  # atol = atol_scale * the largest reference gradient


def _seeded(make):
    def wrapped():
        torch.manual_seed(0)
        return make()
    return wrapped


SCENARIOS = [
    Scenario("mlp", _seeded(lambda: (lambda m, x: (WithLoss(m), x))(*build("mlp", 64, 4, 256))), "eager", 1e-4, 1e-5),
    Scenario("conv_bn", _seeded(lambda: (lambda m, x: (WithLoss(m), x))(*build("convbn", 16, 3, 8))), "eager", 1e-4, 1e-5),
    Scenario("attention", _seeded(lambda: (lambda m, x: (WithLoss(m), x))(*build("attention", 32, 2, 8))), "eager", 1e-4, 1e-5),
    Scenario("dropout_mlp_p0.3", _seeded(lambda: (DropoutMLP(0.3), torch.randn(256, 32, requires_grad=True))),
             "stock_partition", 0.0, 0.0),
    Scenario("dropout_attention_p0.2", _seeded(lambda: (DropoutAttention(0.2), torch.randn(8, 16, 32, requires_grad=True))),
             "stock_partition", 0.0, 0.0),
    Scenario("noisy_conv_p0.5", _seeded(lambda: (NoisyConv(0.5), torch.randn(8, 8, 12, 12, requires_grad=True))),
             "stock_partition", 0.0, 0.0),
    Scenario("autocast_bf16_attention",
             _seeded(lambda: (lambda m, x: (Autocast(m, torch.bfloat16), x))(*build("attention", 32, 2, 8))),
             "eager", 1.6e-2, 1.6e-2),
    Scenario("autocast_bf16_conv_bn",
             _seeded(lambda: (lambda m, x: (Autocast(m, torch.bfloat16), x))(*build("convbn", 16, 2, 8))),
             "eager", 1.6e-2, 1.6e-2),
    Scenario("user_checkpoint_sac", _seeded(lambda: (Blocks(must_policy), torch.randn(128, 32, requires_grad=True))),
             "eager", 1e-4, 1e-5),
    Scenario("checkpoint_dropout_p0.3", _seeded(lambda: (Blocks(None, p=0.3), torch.randn(128, 32, requires_grad=True))),
             "stock_partition", 0.0, 0.0),
]


@dataclass(frozen=True)
class Run:
    scenario: str
    budget_bytes: int
    outcome: str  # "ran" | "infeasible" | "crash"
    grads_match: bool | None
    max_grad_error: float | None
    predicted_peak_bytes: int | None
    measured_peak_bytes: int | None
    min_feasible_bytes: int | None  # from the InfeasibleBudgetError, when raised
    solver_status: str
    ok: bool  # meets the acceptance rule
    note: str
    seconds: float


SEED = 1234


def _reference(scenario: Scenario, module, x, params):
    if scenario.reference == "eager":
        return grads(params, lambda: module(x), seed=SEED)
    compiled = torch.compile(module, backend="aot_eager_decomp_partition")
    try:
        return grads(params, lambda: compiled(x), seed=SEED)
    finally:
        torch.compiler.reset()


def _one(scenario: Scenario, module, x, params, expected, budget: int, known_low: int) -> Run:
    began = time.perf_counter()
    try:
        step = run_step(module, x, params, budget, seed=SEED, **OPTIONS)
    except memcompile.InfeasibleBudgetError as error:
        torch.compiler.reset()
        ok = budget < error.min_feasible_bytes
        note = "" if budget < known_low else f"infeasible at or above the min_feasible_bytes reported earlier ({known_low})"
        return Run(scenario.name, budget, "infeasible", None, None, None, None, error.min_feasible_bytes,
                   "", ok, note, time.perf_counter() - began)
    except Exception as error:  # noqa: BLE001 - the sweep counts crashes, it must not stop at one
        torch.compiler.reset()
        return Run(scenario.name, budget, "crash", None, None, None, None, None, "", False,
                   f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=4)}", time.perf_counter() - began)
    scale = max(float(g.abs().max()) for g in expected) or 1.0
    errors = [float((a - b).abs().max()) for a, b in zip(expected, step.grads)]
    match = all(torch.allclose(b, a, rtol=scenario.rtol, atol=scenario.atol_scale * scale)
                for a, b in zip(expected, step.grads))
    fits = step.plan.predicted_peak_bytes <= budget and step.measured_peak_bytes <= budget
    note = "" if fits else "over budget"
    return Run(scenario.name, budget, "ran", match, max(errors), step.plan.predicted_peak_bytes,
               step.measured_peak_bytes, None, step.plan.solver_status, fits and match, note,
               time.perf_counter() - began)


def sweep(budgets_per_scenario: int, scenarios: list[Scenario], seed: int = 0) -> tuple[list[Run], dict]:
    rng = random.Random(seed)
    runs: list[Run] = []
    ranges = {}
    for scenario in scenarios:
        module, x = scenario.make()
        params = list(module.parameters()) + [x]
        expected = _reference(scenario, module, x, params)
        low, high = budget_range(module, x, **OPTIONS)
        ranges[scenario.name] = {"min_feasible_bytes": low, "keep_all_predicted_bytes": high}
        # Log-uniform from half the smallest feasible budget to 1.2x the keep-all peak: about a
        # fifth of the draws are infeasible, the rest spread over the planning range.
        lo, hi = math.log(0.5 * low), math.log(1.2 * max(high, low + 1))
        budgets = [low] + [int(math.exp(rng.uniform(lo, hi))) for _ in range(budgets_per_scenario - 1)]
        for budget in budgets:
            run = _one(scenario, module, x, params, expected, budget, low)
            runs.append(run)
            print(f"{run.scenario:26s} budget {budget:>9d} {run.outcome:10s} ok={run.ok} "
                  f"pred={run.predicted_peak_bytes} meas={run.measured_peak_bytes} {run.note[:80]}", flush=True)
    return runs, ranges


def _markdown(runs: list[Run], ranges: dict, seconds: float) -> str:
    lines = [
        "# Robustness sweep (issue 7 acceptance)",
        "",
        f"{len(runs)} random budgets over {len(ranges)} scenarios, codegen=aot_eager, "
        f"time_limit_s={OPTIONS['time_limit_s']}; {seconds / 60:.1f} min on a shared 2-core CPU. "
        "Budgets log-uniform in [0.5 x min_feasible, 1.2 x keep-all peak], plus min_feasible itself. "
        "Gradients: eager (fp32: rtol 1e-4; bf16 autocast: rtol 1.6e-2, atol 1.6e-2 x largest grad) or, "
        "with random ops, PyTorch's own partition of the same graph with the same seed, bit for bit.",
        "",
        "| scenario | runs | ran | infeasible (typed) | crashes | grads match | max predicted / budget | "
        "max measured / budget | median measured / predicted | ok |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name in ranges:
        mine = [r for r in runs if r.scenario == name]
        ran = [r for r in mine if r.outcome == "ran"]
        infeasible = [r for r in mine if r.outcome == "infeasible"]
        crashes = [r for r in mine if r.outcome == "crash"]
        ratios = sorted(r.measured_peak_bytes / r.predicted_peak_bytes for r in ran)
        median = ratios[len(ratios) // 2] if ratios else float("nan")
        pred = max((r.predicted_peak_bytes / r.budget_bytes for r in ran), default=float("nan"))
        meas = max((r.measured_peak_bytes / r.budget_bytes for r in ran), default=float("nan"))
        lines.append(
            f"| {name} | {len(mine)} | {len(ran)} | {len(infeasible)} | {len(crashes)} | "
            f"{sum(bool(r.grads_match) for r in ran)}/{len(ran)} | {pred:.3f} | {meas:.3f} | {median:.3f} | "
            f"{sum(r.ok for r in mine)}/{len(mine)} |")
    bad = [r for r in runs if not r.ok or r.note]
    lines += ["", f"Total: {sum(r.ok for r in runs)}/{len(runs)} meet the rule; "
              f"{sum(r.outcome == 'crash' for r in runs)} crashes."]
    if bad:
        lines += ["", "Runs that miss the rule or carry a note:", ""]
        lines += [f"- {r.scenario} budget {r.budget_bytes}: {r.outcome}, ok={r.ok}, {r.note.splitlines()[0] if r.note else ''}"
                  for r in bad]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets-per-scenario", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="3 budgets over 3 scenarios (smoke run, no files)")
    args = parser.parse_args()
    scenarios = SCENARIOS[:3] if args.quick else SCENARIOS
    began = time.perf_counter()
    runs, ranges = sweep(3 if args.quick else args.budgets_per_scenario, scenarios)
    seconds = time.perf_counter() - began
    table = _markdown(runs, ranges, seconds)
    print(table)
    if args.quick:
        return
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "robustness_sweep.json").write_text(json.dumps({
        "torch": torch.__version__, "options": OPTIONS, "seconds": seconds, "ranges": ranges,
        "runs": [asdict(r) for r in runs]}, indent=1))
    (out / "robustness_sweep.md").write_text(table)


if __name__ == "__main__":
    main()
