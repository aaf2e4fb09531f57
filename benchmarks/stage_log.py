"""The first call's stages as they happen: each line of memcompile's log with the seconds since start.

    python benchmarks/stage_log.py --model llama --size real --budget 960000000 --threads 2
    python benchmarks/stage_log.py --model gpt_style --batch 4 --seq 512 --budget 1478872070

Builds the model (benchmarks/gpt_style.py or benchmarks/hf_models.py, random weights), compiles it with
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
    ap.add_argument("--model", default="llama", help="gpt_style, or a model of benchmarks/hf_models.py")
    ap.add_argument("--size", default="small", help="hf_models only")
    ap.add_argument("--batch", type=int, default=0, help="0: the config's (gpt_style: 1)")
    ap.add_argument("--seq", type=int, default=0, help="0: the config's (gpt_style: 256)")
    ap.add_argument("--layers", type=int, default=0, help="0: the config's (gpt_style: 12)")
    ap.add_argument("--budget", type=float, required=True, help="memcompile budget in bytes")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--time-limit", type=float, default=30.0, help="the solver's time limit (s)")
    args = ap.parse_args()
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="stage_log_inductor_"))

    import torch

    import first_call
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

    if args.model == "gpt_style":
        args.batch, args.seq = args.batch or 1, args.seq or 256
    module, _, run_step = first_call._build(args)
    backend = memcompile.budget(int(args.budget), time_limit_s=args.time_limit,
                                plan_store=tempfile.mkdtemp(prefix="stage_log_plans_"))
    step = torch.compile(module, backend=backend)
    try:
        run_step(step)
        print(f"ran: {backend.plans[-1].solver_status}")
    except memcompile.InfeasibleBudgetError as error:
        print(f"infeasible: min_feasible_bytes={error.min_feasible_bytes}")
    print(f"first call {time.perf_counter() - began:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
