"""The planner's least-time plan at a ladder of budgets for one model: estimated added time and
checked peak, so the solver's model can be compared on and off (MEMCOMPILE_RECOMPUTE_FUSION=0).

    OMP_NUM_THREADS=1 python benchmarks/fit_ladder.py --model gpt2 --batch 8 --budgets 20,19,18,17,16,15.5,15,14.5
    MEMCOMPILE_RECOMPUTE_FUSION=0 OMP_NUM_THREADS=1 python benchmarks/fit_ladder.py ...   # the model before
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import hf_models  # noqa: E402
from fit_targets import replanner_of  # noqa: E402

import memcompile  # noqa: E402

MIB = 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2", choices=hf_models.MODELS)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--budgets", default="20,19,18,17,16,15.5,15,14.5", help="MiB, the first below keep-all's peak")
    ap.add_argument("--time-limit", type=float, default=5.0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    budgets = [float(b) for b in args.budgets.split(",")]
    bench = hf_models.build(args.model, "small", batch=args.batch)
    replanner = replanner_of(bench, memcompile.budget(int(budgets[0] * MIB), time_limit_s=args.time_limit,
                                                      chunk_loss=True))
    print(f"keep-all checked {replanner.keep_all.timeline.peak_bytes / MIB:.2f} MiB")
    for b in budgets:
        began = time.perf_counter()
        attempt, _ = replanner.fit(int(b * MIB), args.time_limit)
        took = time.perf_counter() - began
        if attempt is None:
            print(f"{b:6.2f} MiB: no plan ({took:.1f} s)")
            continue
        s = attempt.solution
        print(f"{b:6.2f} MiB: estimated added {s.added_time_s * 1e3:7.3f} ms, status {s.status}, "
              f"{len(s.recompute)} recomputed, checked {attempt.timeline.peak_bytes / MIB:.2f} MiB ({took:.1f} s)")


if __name__ == "__main__":
    main()
