"""The fastest-plan solver's ways on a real joint graph's problem, side by side.

    python benchmarks/solver_compare.py --model llama --size real --budget 960000000 --solve 2

Builds the model (benchmarks/hf_models.py, random weights), compiles it with memcompile at
--budget (empty plan store), and stops at its --solve-th call of the fastest-plan solver: that
call's problem (the joint graph's candidates, calibrated, with its repeated-block classes) and
target are what the rows below solve, in the same process. Rows: the greedy plan (single moves;
class moves), each kept back (`kept_back`), CP-SAT over single values and with one decision per
class (--cp-limit seconds each, hinted with the greedy plan), and the least-peak heuristics.
Each row: seconds, the model's peak and added time. Appends one JSON line to --out. One process,
nothing else timed: run it alone. (`--solve 1` on the 24-layer Llama at 960,000,000 B is the
graph as traced, `--solve 2` the graph with the loss head chunked.)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


class _Captured(BaseException):  # not an Exception: no handler of the compile takes it
    def __init__(self, problem, target):
        super().__init__("captured")
        self.problem, self.target = problem, target


def _capture(model: str, size: str, budget: int, which: int, threads: int):
    import torch

    import hf_models
    import memcompile
    from memcompile import planner

    torch.set_num_threads(threads)
    original, calls = planner.solve_activation_plan, [0]

    def spy(problem, target, **kwargs):
        calls[0] += 1
        if calls[0] == which:
            raise _Captured(problem, target)
        return original(problem, target, **kwargs)

    planner.solve_activation_plan = spy
    try:
        bench = hf_models.build(model, size)
        backend = memcompile.budget(budget, time_limit_s=30, plan_store=tempfile.mkdtemp(prefix="solver_compare_"))
        torch.compile(bench.module, backend=backend)(*bench.inputs).backward()
    except _Captured as captured:
        return captured.problem, captured.target
    finally:
        planner.solve_activation_plan = original
    raise SystemExit(f"the planner called the solver {calls[0]} time(s), fewer than --solve {which}")


def _cp_sat(problem, target, hint, limit_s: float, one_per_class: bool):
    from memcompile.solver import activations as A
    from memcompile.solver.cpsat import run_model

    built = A._build_model(dataclasses.replace(problem, same_decision_as=()), target)
    if one_per_class:
        for i, g in enumerate(problem.same_decision_as):
            if 0 <= g != i:
                built.model.add(built.keep[i] == built.keep[g])
                built.model.add(built.recompute[i] == built.recompute[g])
    A._add_hint(problem, built, hint)
    outcome = run_model(built.model, time_limit_s=limit_s, workers=2, seed=0)
    return (A._decisions_from(outcome, built) if outcome.has_solution else None), outcome.status


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama")
    ap.add_argument("--size", default="real")
    ap.add_argument("--budget", type=int, required=True)
    ap.add_argument("--solve", type=int, default=1, help="which call of the solver to capture (1 = the first)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cp-limit", type=float, default=30.0)
    ap.add_argument("--out", default=str(HERE / "results" / "solver_compare.jsonl"))
    args = ap.parse_args()
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="solver_compare_inductor_"))

    problem, target = _capture(args.model, args.size, args.budget, args.solve, args.threads)
    from memcompile.solver import activations as A

    classes = {g for g in problem.same_decision_as if g >= 0}
    print(f"{len(problem.names)} candidates, {len(classes)} classes over "
          f"{sum(g >= 0 for g in problem.same_decision_as)}, target {target} B")
    rows = []

    def row(name, began, plan, note=""):
        seconds = time.perf_counter() - began
        peak, added = A.evaluate(problem, *plan) if plan is not None else (None, None)
        rows.append({"way": name, "s": round(seconds, 2), "peak_bytes": peak,
                     "added_ms": None if added is None else round(added * 1e3, 2),
                     "fits": peak is not None and peak <= target, "note": note})
        print(f"{name:34s} {seconds:6.1f} s  peak {peak}  added {rows[-1]['added_ms']} ms {note}", flush=True)
        return plan

    began = time.perf_counter()
    greedy = row("greedy, single moves", began, A.greedy_plan(problem, target))
    began = time.perf_counter()
    row("  kept back", began, A.kept_back(problem, greedy, target, 60.0))
    if classes:
        began = time.perf_counter()
        tied = row("greedy, class moves", began, A.greedy_plan(problem, target, tied=True))
        began = time.perf_counter()
        row("  kept back", began, A.kept_back(problem, tied, target, 60.0))
    for one_per_class in ([False, True] if classes else [False]):
        began = time.perf_counter()
        hint = A.greedy_plan(problem, target, tied=one_per_class)
        plan, status = _cp_sat(problem, target, hint, args.cp_limit, one_per_class)
        found = row("CP-SAT, one decision per class" if one_per_class else "CP-SAT, single values", began, plan, status)
        if found is not None and A.evaluate(problem, *found)[0] <= target:
            began = time.perf_counter()
            row("  kept back", began, A.kept_back(problem, found, target, 60.0))
    for tied in ([False, True] if classes else [False]):
        for per_second in (True, False):
            began = time.perf_counter()
            row(f"least peak: greedy, {'class' if tied else 'single'} moves, per {'second' if per_second else 'byte'}",
                began, A.greedy_plan(problem, 0, per_second=per_second, tied=tied))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=HERE,
                                capture_output=True, text=True).stdout.strip())
    record = {"model": args.model, "size": args.size, "budget": args.budget, "solve": args.solve, "target": target,
              "candidates": len(problem.names), "classes": len(classes), "threads": args.threads,
              "cp_limit_s": args.cp_limit, "commit": commit + ("+dirty" if dirty else ""), "rows": rows}
    with open(args.out, "a") as f:
        f.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
