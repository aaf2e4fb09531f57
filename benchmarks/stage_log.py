"""The first call's stages as they happen: each line of memcompile's log with the seconds since start.

    python benchmarks/stage_log.py --model llama --size real --budget 960000000 --threads 2

Builds the model (benchmarks/hf_models.py, random weights), compiles it with
memcompile.budget(--budget, time_limit_s=--time-limit) and an empty plan store and Inductor cache
(a first launch), runs one forward and backward, and prints memcompile's log at DEBUG, each line
stamped with the wall time since the start (the stage names come from the progress lines
printed every 30 s of a long planning: `still planning region 0 after ...: rung ...; graph_N: ...`),
then the plan's status and the first call's total. One process, nothing else timed: run it alone.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama", help="a model of benchmarks/hf_models.py")
    ap.add_argument("--size", default="small")
    ap.add_argument("--budget", type=float, required=True, help="memcompile budget in bytes")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--time-limit", type=float, default=30.0, help="the solver's time limit (s)")
    args = ap.parse_args()
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="stage_log_inductor_"))

    import torch

    import hf_models
    import memcompile

    torch.set_num_threads(args.threads)
    began = time.perf_counter()

    class Stamped(logging.Formatter):
        def format(self, record: logging.LogRecord) -> str:
            return f"{time.perf_counter() - began:7.1f} {record.getMessage()}"

    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(Stamped())
    logger = logging.getLogger("memcompile")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False

    bench = hf_models.build(args.model, args.size)
    backend = memcompile.budget(int(args.budget), time_limit_s=args.time_limit,
                                plan_store=tempfile.mkdtemp(prefix="stage_log_plans_"))
    step = torch.compile(bench.module, backend=backend)
    try:
        loss = step(*bench.inputs)
        loss.backward()
        print(f"ran: {backend.plans[-1].solver_status}")
    except memcompile.InfeasibleBudgetError as error:
        print(f"infeasible: min_feasible_bytes={error.min_feasible_bytes}")
    print(f"first call {time.perf_counter() - began:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
