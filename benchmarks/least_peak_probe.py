"""Model vs check for the least-peak plan, and for that plan with named kept activations recomputed.

The solver's least-peak plan minimises the *model's* peak; the exact check (rewrite + liveness over
Inductor's schedule) can disagree where the model charges recomputed values as stored tensors that
Inductor fuses into their reader. This prints both peaks for the least-peak plan and for the same
plan with --recompute NAMES recomputed too.

    OMP_NUM_THREADS=1 python benchmarks/least_peak_probe.py --model gpt2 --batch 8 \\
        --recompute tanh_1,mul_15,add_18,add_10
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import hf_models  # noqa: E402
from fit_targets import replanner_of  # noqa: E402

import memcompile  # noqa: E402
from memcompile import planner  # noqa: E402
from memcompile.solver.activations import close_decisions, evaluate, solve_min_peak  # noqa: E402

MIB = 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2", choices=hf_models.MODELS)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--budget-mib", type=float, default=18.5, help="any budget below keep-all's peak")
    ap.add_argument("--recompute", default="tanh_1,mul_15,add_18,add_10")
    ap.add_argument("--time-limit", type=float, default=5.0)
    args = ap.parse_args()
    torch.set_num_threads(1)

    bench = hf_models.build(args.model, "small", batch=args.batch)
    backend = memcompile.budget(int(args.budget_mib * MIB), time_limit_s=args.time_limit, chunk_loss=True)
    replanner = replanner_of(bench, backend)
    problem = replanner.analysis.problem
    fuse = planner._checks_schedule(replanner.options)

    def check(solution):
        timeline = planner._rewrite_and_check(replanner.joint, replanner.analysis, solution,
                                              replanner.num_fwd_outputs, fuse).timeline
        return f"{timeline.peak_bytes / MIB:.2f} MiB at {timeline.peak_step.phase} {timeline.peak_step.node}"

    least = solve_min_peak(problem, time_limit_s=args.time_limit, workers=1, seed=0)
    print(f"least-peak plan: model {least.model_peak_bytes / MIB:.2f} MiB, checked {check(least)}")
    names = list(problem.names)
    extra = {names.index(n) for n in args.recompute.split(",") if n in names}
    keep, recompute, stored = close_decisions(problem, prefer_recompute=set(least.recompute) | extra)
    peak, added = evaluate(problem, keep, recompute, stored)
    other = dataclasses.replace(least, keep=keep, recompute=recompute, stored=stored, model_peak_bytes=peak,
                                added_time_s=added)
    print(f"+ recompute {args.recompute}: model {peak / MIB:.2f} MiB, checked {check(other)}")
    # What the planner itself reports as the smallest budget (its least-peak path, with the
    # descent on the check in memcompile/planner.py).
    torch.compiler.reset()
    try:
        torch.compile(bench.module, backend=memcompile.budget(1, time_limit_s=args.time_limit,
                                                             chunk_loss=True))(*bench.inputs).backward()
    except memcompile.InfeasibleBudgetError as error:
        print(f"planner's smallest budget: {error.min_feasible_bytes / MIB:.2f} MiB ({error.min_feasible_bytes} B)")


if __name__ == "__main__":
    main()
