"""What chunking the loss head costs in step time, and what it saves in peak, at a loose budget.

For each Hugging Face model (benchmarks/hf_models.py), one process compiles the same step twice
under memcompile with a budget nothing needs to be recomputed for: chunk_loss=False (the head as
written) and chunk_loss=True (passes/loss_head.py). The two are timed interleaved, step by step
(median of --steps), so machine load hits both alike; the ratio is chunked / whole. Peaks are
memcompile.measure_peak (CPU allocator events).

    OMP_NUM_THREADS=1 python benchmarks/chunk_loss_cost.py --models gpt2,llama,bert --steps 21

Writes benchmarks/results/chunk_loss_cost.json and .md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import hf_models  # noqa: E402
from pareto import interleaved_medians  # noqa: E402

import memcompile  # noqa: E402

MIB = 2**20


def measure(model: str, size: str, steps: int, budget: str) -> dict:
    torch.manual_seed(0)
    bench = hf_models.build(model, size)
    module, inputs = bench.module, bench.inputs
    runs, row = [], {"model": model, "size": size, "budget": budget}
    for chunk in (False, True):
        backend = memcompile.budget(budget, chunk_loss=chunk, time_limit_s=5)
        fn = torch.compile(module, backend=backend)
        fn(*inputs).backward()  # compile
        module.zero_grad(set_to_none=True)
        peak = memcompile.measure_peak(lambda: fn(*inputs).backward(), live_at_start=[module, *inputs])
        module.zero_grad(set_to_none=True)
        key = "chunked" if chunk else "whole"
        row[f"{key}_peak_bytes"] = peak.peak_bytes
        row[f"{key}_rewrites"] = [r for p in backend.plans for r in p.graph_rewrites]
        row[f"{key}_estimated_rewrite_s"] = sum(p.rewrite_time_s for p in backend.plans)
        runs.append((fn, module))
    times = interleaved_medians(runs, inputs, steps)
    whole, chunked = (statistics.median(t) for t in times)
    row.update(whole_step_s=whole, chunked_step_s=chunked, step_ratio=chunked / whole, added_s=chunked - whole,
               min_step_ratio=min(times[1]) / min(times[0]), steps=steps, threads=torch.get_num_threads())
    return row


def markdown(rows: list[dict], command: str) -> str:
    lines = [
        "# chunk_loss: step time and peak, chunked head vs whole head (budget with nothing to recompute)",
        "",
        f"torch {torch.__version__}, {rows[0]['threads']} thread(s), {rows[0]['steps']} interleaved steps "
        f"(median; min-over-min as a less noisy cross-check). Command: `{command}`.",
        "",
        "| model | whole peak MiB | chunked peak MiB | peak ratio | whole step ms | chunked step ms "
        "| step ratio (median) | step ratio (min) | added ms (median) | estimated ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} ({r['size']}) | {r['whole_peak_bytes'] / MIB:.2f} | {r['chunked_peak_bytes'] / MIB:.2f} "
            f"| {r['chunked_peak_bytes'] / r['whole_peak_bytes']:.3f} | {r['whole_step_s'] * 1e3:.1f} "
            f"| {r['chunked_step_s'] * 1e3:.1f} | {r['step_ratio']:.3f} | {r['min_step_ratio']:.3f} "
            f"| {(r['chunked_step_s'] - r['whole_step_s']) * 1e3:.2f} | {r['chunked_estimated_rewrite_s'] * 1e3:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="gpt2,llama,bert")
    ap.add_argument("--size", default="small", choices=hf_models.SIZES)
    ap.add_argument("--steps", type=int, default=21)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--budget", default="1GB", help="loose: nothing needs recomputing")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for model in args.models.split(","):
        rows.append(measure(model, args.size, args.steps, args.budget))
        print(json.dumps(rows[-1]), flush=True)
    out = HERE / "results" / f"chunk_loss_cost{args.tag}"
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    command = "python benchmarks/chunk_loss_cost.py " + " ".join(sys.argv[1:])
    out.with_suffix(".md").write_text(markdown(rows, command))
    print(markdown(rows, command))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
