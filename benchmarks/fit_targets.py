"""How the solver's memory model tracks the exact check, target by target (the calibration's effect).

Compiles a Hugging Face model (benchmarks/hf_models.py, small config) once under memcompile, then
for each model target asks the solver for its least-time plan and checks the rewritten graphs:
prints the model's peak, the checked peak and the estimated added step time, and the same for the
model's least-peak plan. With --uncalibrated, the solver gets the model before calibration
(passes/calibration.py), so both can be compared in one run.

    OMP_NUM_THREADS=1 python benchmarks/fit_targets.py --model bert --targets 14,15,15.5,16
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import hf_models  # noqa: E402

import memcompile  # noqa: E402
from memcompile import planner  # noqa: E402
from memcompile.solver.activations import close_decisions, evaluate, solve_min_peak  # noqa: E402

MIB = 2**20


def replanner_of(bench, backend) -> planner.Replanner:
    """The planner's Replanner for one step of `bench` compiled under `backend` (the budget must
    be below keep-all's peak, so that the planner builds one); the step may be infeasible."""
    seen: list[planner.Replanner] = []
    original_fit = planner.Replanner.fit

    def spy(self, budget, time_limit_s):
        seen.append(self)
        return original_fit(self, budget, time_limit_s)

    planner.Replanner.fit = spy
    try:
        torch.compile(bench.module, backend=backend)(*bench.inputs).backward()
    except memcompile.InfeasibleBudgetError:
        pass
    finally:
        planner.Replanner.fit = original_fit
    return seen[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bert", choices=hf_models.MODELS)
    ap.add_argument("--targets", default="14,15,15.5,16", help="comma-separated model targets in MiB")
    ap.add_argument("--time-limit", type=float, default=5.0)
    ap.add_argument("--uncalibrated", action="store_true", help="solve on the model before calibration")
    args = ap.parse_args()
    torch.set_num_threads(1)

    bench = hf_models.build(args.model, "small")
    backend = memcompile.budget(1 << 60, time_limit_s=args.time_limit)
    # A budget below keep-all's peak makes the planner build its Replanner; any plan will do here.
    keep_all_peak = None
    try:
        torch.compile(bench.module, backend=backend)(*bench.inputs).backward()
        keep_all_peak = backend.plans[0].predicted_peak_bytes
    finally:
        torch.compiler.reset()
    replanner = replanner_of(bench, memcompile.budget(int(keep_all_peak * 0.9), time_limit_s=args.time_limit))
    problem = replanner.uncalibrated if args.uncalibrated else replanner.analysis.problem
    fuse = planner._checks_schedule(replanner.options)

    def check(solution):
        return planner._rewrite_and_check(replanner.joint, replanner.analysis, solution,
                                          replanner.num_fwd_outputs, fuse).timeline.peak_bytes

    model_keep_all, _ = evaluate(problem, *close_decisions(problem, prefer_recompute=set()))
    print(f"{args.model} ({'uncalibrated' if args.uncalibrated else 'calibrated'} model): keep-all "
          f"model {model_keep_all / MIB:.2f} MiB, checked {replanner.keep_all.timeline.peak_bytes / MIB:.2f} MiB")
    least = solve_min_peak(problem, time_limit_s=args.time_limit, workers=replanner.options.workers,
                           seed=replanner.options.seed)
    print(f"least peak: model {least.model_peak_bytes / MIB:.2f}, checked {check(least) / MIB:.2f} MiB")
    print("| target MiB | model MiB | checked MiB | added ms | status |")
    print("| --- | --- | --- | --- | --- |")
    for target in (float(t) for t in args.targets.split(",")):
        solution = planner._solve_or_greedy(problem, int(target * MIB), args.time_limit, replanner.options)
        if solution.status == "infeasible":
            print(f"| {target:.2f} | - | - | - | infeasible under the model |")
            continue
        print(f"| {target:.2f} | {solution.model_peak_bytes / MIB:.2f} | {check(solution) / MIB:.2f} | "
              f"{solution.added_time_s * 1e3:.2f} | {solution.status} |")


if __name__ == "__main__":
    main()
