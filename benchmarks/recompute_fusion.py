"""What modelling Inductor's inlining of values not saved buys (passes/recompute_fusion.py).

For each Hugging Face model (benchmarks/hf_models.py) and budgets between its smallest budget
and keep-all's peak, one process compiles the same step under memcompile twice: with the fates
of values not saved in the solver's model ("fates on", the default) and without them (each such
value counted as a buffer, `memcompile.planner.RECOMPUTE_FUSION = False`: the model before), with memcompile's default
chunk_loss="auto" unless --chunk-loss says otherwise. The
two compiled steps are timed interleaved (median of --steps) beside plain Inductor, so load hits
all alike. Peaks are memcompile.measure_peak (CPU allocator events).

    OMP_NUM_THREADS=1 python benchmarks/recompute_fusion.py --models gpt2,llama,bert --steps 11

Writes benchmarks/results/recompute_fusion.json and .md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import hf_models  # noqa: E402
from pareto import interleaved_medians  # noqa: E402

import memcompile  # noqa: E402
from memcompile import planner  # noqa: E402

MIB = 2**20


def _compiled(module, inputs, budget: int, fates: bool, chunk_loss):
    """(step function, backend, compile seconds) of `module` under `budget`, fates on or off."""
    planner.RECOMPUTE_FUSION = fates
    torch.compiler.reset()
    backend = memcompile.budget(budget, time_limit_s=5, chunk_loss=chunk_loss)
    fn = torch.compile(module, backend=backend)
    began = time.perf_counter()
    fn(*inputs).backward()
    module.zero_grad(set_to_none=True)
    return fn, backend, time.perf_counter() - began


def _smallest_budget(module, inputs, fates: bool, chunk_loss) -> int:
    planner.RECOMPUTE_FUSION = fates
    torch.compiler.reset()
    try:
        torch.compile(module, backend=memcompile.budget(1, time_limit_s=5, chunk_loss=chunk_loss))(*inputs).backward()
    except memcompile.InfeasibleBudgetError as error:
        return error.min_feasible_bytes
    raise RuntimeError("a 1-byte budget fitted")


def measure(model: str, size: str, steps: int, fractions: list[float], chunk_loss) -> list[dict]:
    torch.manual_seed(0)
    bench = hf_models.build(model, size)
    module, inputs = bench.module, bench.inputs
    plain = torch.compile(module)
    plain(*inputs).backward()
    module.zero_grad(set_to_none=True)
    plain_peak = memcompile.measure_peak(lambda: plain(*inputs).backward(), live_at_start=[module, *inputs]).peak_bytes
    module.zero_grad(set_to_none=True)
    floors = {fates: _smallest_budget(module, inputs, fates, chunk_loss) for fates in (True, False)}
    low = max(floors.values())  # both must fit
    rows = []
    for f in fractions:
        budget = int(low + f * (plain_peak - low))
        row = {"model": model, "size": size, "budget_bytes": budget, "fraction": f, "plain_peak_bytes": plain_peak,
               "smallest_budget_fates_on": floors[True], "smallest_budget_fates_off": floors[False]}
        runs = [(plain, module)]
        for fates in (False, True):
            fn, backend, compile_s = _compiled(module, inputs, budget, fates, chunk_loss)
            key = "on" if fates else "off"
            peak = memcompile.measure_peak(lambda: fn(*inputs).backward(), live_at_start=[module, *inputs])
            module.zero_grad(set_to_none=True)
            row[f"{key}_peak_bytes"] = peak.peak_bytes
            row[f"{key}_predicted_bytes"] = max(p.predicted_peak_bytes for p in backend.plans)
            row[f"{key}_estimated_added_ms"] = sum(p.added_time_s for p in backend.plans) * 1e3
            row[f"{key}_status"] = [p.solver_status for p in backend.plans]
            row[f"{key}_compile_s"] = compile_s
            row[f"{key}_rewrites"] = sorted({r for p in backend.plans for r in p.graph_rewrites})
            runs.append((fn, module))
        planner.RECOMPUTE_FUSION = True
        times = interleaved_medians(runs, inputs, steps)
        base, off, on = (statistics.median(t) for t in times)
        row.update(plain_step_s=base, off_step_s=off, on_step_s=on, off_ratio=off / base, on_ratio=on / base,
                   on_vs_off=on / off, min_on_vs_off=min(times[2]) / min(times[1]), steps=steps,
                   threads=torch.get_num_threads(), chunk_loss=chunk_loss)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def markdown(rows: list[dict], command: str) -> str:
    lines = [
        "# Modelling what Inductor inlines when a value is not saved: fates on vs off",
        "",
        f"torch {torch.__version__}, {rows[0]['threads']} thread(s), {rows[0]['steps']} interleaved steps "
        f"(median; min-over-min as a cross-check), chunk_loss={rows[0]['chunk_loss']!r}. Budgets between the larger of the two "
        f"smallest budgets and plain Inductor's peak. Step ratios are against plain Inductor in the same "
        f"run. Command: `{command}`.",
        "",
        "| model | smallest budget on / off (MiB) | budget (MiB) | peak off / on (MiB) | predicted off / on (MiB) "
        "| est. added ms off / on | step vs plain off / on | on / off (median) | on / off (min) | status off / on "
        "| rewrites off / on | compile s off / on |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} ({r['size']}) | {r['smallest_budget_fates_on'] / MIB:.2f} / "
            f"{r['smallest_budget_fates_off'] / MIB:.2f} | {r['budget_bytes'] / MIB:.2f} "
            f"| {r['off_peak_bytes'] / MIB:.2f} / {r['on_peak_bytes'] / MIB:.2f} "
            f"| {r['off_predicted_bytes'] / MIB:.2f} / {r['on_predicted_bytes'] / MIB:.2f} "
            f"| {r['off_estimated_added_ms']:.2f} / {r['on_estimated_added_ms']:.2f} "
            f"| {r['off_ratio']:.3f} / {r['on_ratio']:.3f} | {r['on_vs_off']:.3f} | {r['min_on_vs_off']:.3f} "
            f"| {','.join(r['off_status'])} / {','.join(r['on_status'])} "
            f"| {','.join(r['off_rewrites']) or '-'} / {','.join(r['on_rewrites']) or '-'} "
            f"| {r['off_compile_s']:.0f} / {r['on_compile_s']:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="gpt2,llama,bert")
    ap.add_argument("--size", default="small", choices=hf_models.SIZES)
    ap.add_argument("--steps", type=int, default=11)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--fractions", default="0.05,0.25,0.5", help="of the way from the smallest budget to plain's peak")
    ap.add_argument("--chunk-loss", default="auto", choices=("auto", "true", "false"),
                    help="memcompile's chunk_loss option for both arms (auto: chunk only where nothing else fits)")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for model in args.models.split(","):
        chunk_loss = {"auto": "auto", "true": True, "false": False}[args.chunk_loss]
        rows += measure(model, args.size, args.steps, [float(f) for f in args.fractions.split(",")], chunk_loss)
    out = HERE / "results" / f"recompute_fusion{args.tag}"
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    command = "python benchmarks/recompute_fusion.py " + " ".join(sys.argv[1:])
    out.with_suffix(".md").write_text(markdown(rows, command))
    print(markdown(rows, command))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
