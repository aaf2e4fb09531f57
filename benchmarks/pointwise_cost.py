"""The cost model's time for single pointwise ops against their measured eager time on this CPU.

    python benchmarks/pointwise_cost.py [--size 512] [--threads 1]

Each op on a (size, size) float32 tensor: cost_models.node_cost.estimate_node_time_s (a roofline:
FLOPs from torch.utils.flop_counter, which has no formula for pointwise ops, so bytes moved over
the measured copy bandwidth) against the median eager time. Writes
benchmarks/results/pointwise_cost.{json,md}. At d107a80 (1 thread, 512 x 512, two runs): the
model said 48.6 us for every op; mul measured 53-59 us, tanh 100-112 us, erf 167 us, the tanh
GELU (one aten op here) 478-484 us: transcendental pointwise work is compute-bound on this CPU,
so recomputing a GELU chain is priced several times too low (issue 6 notes). Inside a plan the
solver charges recomputed ops that Inductor inlines less still (14-20 us each on GPT-2 small:
the `recomputed` column of the pareto.py records committed in c8686b0).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from memcompile.cost_models.device import profile_for
from memcompile.cost_models.node_cost import estimate_node_time_s

RESULTS = Path(__file__).resolve().parent / "results"
OPS = {
    "mul": lambda x: x * x,
    "add": lambda x: x + 1.0,
    "pow 3": lambda x: x.pow(3),
    "tanh": torch.tanh,
    "exp": torch.exp,
    "erf": torch.erf,
    "gelu (tanh)": lambda x: F.gelu(x, approximate="tanh"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    profile = profile_for("cpu")
    x = torch.randn(args.size, args.size)
    rows = []
    for name, fn in OPS.items():
        nodes = [n for n in make_fx(fn)(x).graph.nodes if n.op == "call_function"]
        modelled = sum(estimate_node_time_s(n, profile) for n in nodes)
        fn(x)
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            fn(x)
            times.append(time.perf_counter() - start)
        measured = statistics.median(times)
        rows.append({"op": name, "aten_ops": len(nodes), "modelled_us": 1e6 * modelled, "measured_us": 1e6 * measured,
                     "measured_over_modelled": measured / modelled})
    meta = {"size": args.size, "threads": args.threads, "torch": torch.__version__,
            "memory_bytes_per_s": profile.memory_bytes_per_s}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "pointwise_cost.json").write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    table = [f"# Pointwise ops: cost model vs eager ({meta})\n",
             "| op | aten ops | modelled us | measured us | measured / modelled |", "| --- | --- | --- | --- | --- |"]
    table += [f"| {r['op']} | {r['aten_ops']} | {r['modelled_us']:.1f} | {r['measured_us']:.1f} | "
              f"{r['measured_over_modelled']:.2f} |" for r in rows]
    (RESULTS / "pointwise_cost.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()
