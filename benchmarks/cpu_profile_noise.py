"""How the CPU profile reads when another process shares the core: the old single timing (20 calls
of a 256x256 matmul) against `measure_cpu_profile` (the fastest of 5 rounds of 4), each in a fresh
process, quiet and beside a busy loop pinned to the same core.

    python benchmarks/cpu_profile_noise.py [--core 1] [--repeats 3]

The figures of 40df673 (one-off runs of the same code): old 129-166 GFLOP/s quiet, 77-88 busy; new
160-180 quiet, 180 busy. This script, 2026-12-01: old 147-160 quiet, 55-83 busy; new 200 quiet, 170-200 busy.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

_OLD = """
import time, torch
torch.set_num_threads(1)
n, reps = 256, 20
a, b = torch.randn(n, n), torch.randn(n, n)
torch.mm(a, b)
start = time.perf_counter()
for _ in range(reps):
    torch.mm(a, b)
print(2 * n**3 * reps / (time.perf_counter() - start) / 1e9)
"""
_NEW = """
import torch
torch.set_num_threads(1)
from memcompile.cost_models.device import measure_cpu_profile
print(measure_cpu_profile().matmul_flops_per_s / 1e9)
"""


def _read(code: str, core: int) -> float:
    out = subprocess.run(["taskset", "-c", str(core), sys.executable, "-c", code],
                         capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--core", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    for load in ("quiet", "busy"):
        spinner = None
        if load == "busy":
            spinner = subprocess.Popen(["taskset", "-c", str(args.core), sys.executable, "-c", "while True: pass"])
            time.sleep(0.5)
        try:
            for name, code in (("old single timing", _OLD), ("measure_cpu_profile", _NEW)):
                rates = [_read(code, args.core) for _ in range(args.repeats)]
                print(f"{load:5s}  {name:20s}  " + "  ".join(f"{r:4.0f}" for r in rates) + "  GFLOP/s")
        finally:
            if spinner is not None:
                spinner.kill()


if __name__ == "__main__":
    main()
