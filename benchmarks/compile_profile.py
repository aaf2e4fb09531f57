"""Where memcompile's compile time goes: cProfile of one model's first step at a budget.

    OMP_NUM_THREADS=1 python benchmarks/compile_profile.py --model llama --budget 10389253

Builds the model (benchmarks/hf_models.py, random weights), compiles it with
memcompile.budget(--budget) and profiles the first forward and backward (the compile), then
prints the cumulative time of memcompile's and Inductor's main stages. The figures it
reproduces (at 604ca63, under the profiler and beside a test run: inflated): Llama small at
9.91 MiB, first call 63 s, of it planning 51 s, 26 checks of candidate plans (Inductor
schedules) 32 s, and the least-peak search of the graph with the loss head whole, which is
computed only to be discarded for the chunked head's plan, 24.7 s.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import hf_models  # noqa: E402

import memcompile  # noqa: E402

STAGES = ("planner.py:.*\\(_plan_joint_graph\\)", "planner.py:.*\\(fit\\)", "planner.py:.*\\(least_peak_and_solve_s\\)",
          "planner.py:.*\\(_rewrite_and_check\\)", "_torch_private/lowering.py:.*\\(inductor_schedule\\)",
          "planner.py:.*\\(_descend_on_check\\)", "planner.py:.*\\(_make\\)", "op_timing.py:.*\\(_time\\)",
          "compile_fx.py:.*\\(compile_fx_inner\\)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama")
    ap.add_argument("--size", default="small")
    ap.add_argument("--budget", type=int, required=True, help="memcompile budget in bytes")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=0, help="0: the size's")
    ap.add_argument("--seq", type=int, default=0, help="0: the size's")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    bench = hf_models.build(args.model, args.size, **{k: v for k, v in (("batch", args.batch), ("seq", args.seq)) if v})
    backend = memcompile.budget(args.budget, time_limit_s=5.0, plan_store=False)  # a first launch
    step = torch.compile(bench.module, backend=backend)
    profiler = cProfile.Profile()
    profiler.enable()
    step(*bench.inputs).backward()
    profiler.disable()
    print(memcompile.dump(backend))
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out).sort_stats("cumulative")
    print(f"first call: {stats.total_tt:.1f} s under the profiler")
    for stage in STAGES:
        stats.print_stats(stage, 1)
    rows = [line for line in out.getvalue().splitlines() if "(" in line and ":" in line and line.strip()[:1].isdigit()]
    print("   ncalls  tottime  percall  cumtime  percall filename:lineno(function)")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
