"""The cost model's estimate of Llama small's compute-bound ops: roofline vs timed, against a median.

    OMP_NUM_THREADS=1 taskset -c 0 python benchmarks/op_timing_check.py

For each op (Llama small: batch 4, 128 tokens, hidden 128, 4 heads of 32, MLP 344), traced with
make_fx: the roofline estimate (this CPU's measured profile), the timed estimate
(cost_models/op_timing.py: the fastest of 4-31 runs), and the median of 30 runs timed here.
Writes benchmarks/results/op_timing_check.{json,md}. The figures it reproduces (at 087d8c4, a
quiet core): the causal attention's roofline is 0.46 of its median time alone (162 us against
352; one more call inside a step added 508 us, step_profile.py), the timed estimate 0.97; the
projections' rooflines are within 0.95-1.11 of theirs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from memcompile.cost_models import op_timing
from memcompile.cost_models.device import measure_cpu_profile
from memcompile.cost_models.node_cost import estimate_node_time_s

RESULTS = Path(__file__).resolve().parent / "results"
TOKENS, HIDDEN, HEADS, HEAD_DIM, MLP = 512, 128, 4, 32, 344


def _cases():
    def attention(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    qkv = [torch.randn(4, HEADS, 128, HEAD_DIM) for _ in range(3)]
    yield "attention forward (causal, 4x4x128x32)", attention, qkv, "_scaled_dot_product_flash_attention_for_cpu.default"
    for name, (k, n) in {"q/o projection": (HIDDEN, HIDDEN), "k/v projection": (HIDDEN, HIDDEN // 2),
                         "gate/up projection": (HIDDEN, MLP), "down projection": (MLP, HIDDEN)}.items():
        yield f"{name} ({TOKENS}x{k} @ {k}x{n})", torch.mm, [torch.randn(TOKENS, k), torch.randn(k, n)], "mm.default"


def _median_s(op, args, runs: int = 30) -> float:
    for _ in range(3):
        op(*args)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        op(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    profile = measure_cpu_profile()
    roofline = dataclasses.replace(profile, times_ops=False)
    rows = []
    for name, fn, inputs, target in _cases():
        graph = make_fx(fn, tracing_mode="fake")(*inputs).graph
        (node,) = [n for n in graph.nodes if n.op == "call_function" and str(n.target).endswith(target)]
        args = [op_timing._real(a.meta["val"]) if isinstance(a, torch.fx.Node) else a for a in node.args]
        rows.append(dict(op=name, roofline_us=estimate_node_time_s(node, roofline) * 1e6,
                         timed_us=estimate_node_time_s(node, profile) * 1e6,
                         median_us=_median_s(lambda *a: node.target(*a, **node.kwargs), args) * 1e6))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "op_timing_check.json").write_text(json.dumps(dict(profile=dataclasses.asdict(profile),
                                                                  threads=torch.get_num_threads(), rows=rows), indent=1))
    lines = [f"# Op estimates, Llama small shapes ({torch.get_num_threads()} thread(s); profile "
             f"{profile.matmul_flops_per_s / 1e9:.0f} GFLOP/s)", "",
             "| op | roofline us | timed estimate us | median of 30 us | roofline / median | timed / median |",
             "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['op']} | {r['roofline_us']:.0f} | {r['timed_us']:.0f} | {r['median_us']:.0f} | "
              f"{r['roofline_us'] / r['median_us']:.2f} | {r['timed_us'] / r['median_us']:.2f} |" for r in rows]
    (RESULTS / "op_timing_check.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
