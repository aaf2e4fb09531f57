"""The first call's time, on a first launch and on a later one: plain Inductor against memcompile.

Each variant runs in fresh processes, twice in a row: the first launch with empty caches (its own
Inductor cache folder and, for memcompile, its own plan store), the second with what the first
left there, as a user's second run of the same script. Reported per launch: the first call's wall
time (forward and backward: tracing, planning, compiling, running), the step's measured peak, the
plan's status, and Inductor's FX graph cache hits.

    OMP_NUM_THREADS=1 python benchmarks/first_call.py --model gpt2 --size gpu --batch 1 --seq 256 --budgets 1.0e9

Writes benchmarks/results/first_call.{jsonl,md} (--out to change). One thread per process;
absolute times depend on the machine and what else runs there: compare rows of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def child(args: argparse.Namespace) -> dict:
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import hf_models
    from torch._dynamo.utils import counters

    import memcompile

    torch.set_num_threads(1)
    overrides = {k: v for k, v in (("batch", args.batch), ("seq", args.seq), ("layers", args.layers)) if v}
    bench = hf_models.build(args.model, args.size, **overrides)
    backend = "inductor" if args.child == "plain" else memcompile.budget(int(float(args.child)), time_limit_s=5.0)
    step = torch.compile(bench.module, backend=backend)
    began = time.perf_counter()
    status, peak = "ran", 0
    try:
        step(*bench.inputs).backward()
    except memcompile.InfeasibleBudgetError as error:
        status = f"infeasible, floor {error.min_feasible_bytes}"
    first_call_s = time.perf_counter() - began
    if status == "ran":
        for p in bench.module.parameters():
            p.grad = None
        peak = memcompile.measure_peak(lambda: step(*bench.inputs).backward(),
                                       live_at_start=[bench.module, *bench.inputs]).peak_bytes
        if args.child != "plain":
            plan = backend.plans[-1]
            status = plan.solver_status + (" (from the plan store)" if plan.from_plan_store else "")
    hits = {k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")}
    return {"first_call_s": round(first_call_s, 2), "status": status, "peak_bytes": peak, "fx_graph_cache": hits}


def run(args: argparse.Namespace) -> list[dict]:
    rows = []
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    for variant in ["plain"] + args.budgets:
        folder = tempfile.mkdtemp(prefix="first_call_")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": os.path.join(folder, "inductor"),
               "MEMCOMPILE_PLAN_STORE": os.path.join(folder, "plans")}
        for launch in ("first", "later"):
            command = [sys.executable, __file__, "--child", variant, "--model", args.model, "--size", args.size,
                       "--batch", str(args.batch), "--seq", str(args.seq), "--layers", str(args.layers)]
            out = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
            lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
            if not lines:
                raise RuntimeError(f"{variant} {launch} launch failed:\n{out.stderr[-4000:]}")
            row = {"model": args.model, "size": args.size, "batch": args.batch, "seq": args.seq,
                   "variant": "plain Inductor" if variant == "plain" else f"memcompile {variant}",
                   "launch": launch, "commit": commit, **json.loads(lines[-1])}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    plain = {r["launch"]: r["first_call_s"] for r in rows if r["variant"] == "plain Inductor"}
    head = rows[0]
    lines = [f"# First call: first and later launch, {head['model']} ({head['size']} config) batch {head['batch']} x "
             f"{head['seq']}", "",
             f"Commit {head['commit']}, torch 2.13.0+cpu, one thread per process, a shared 2-core x86-64 VM. "
             "Command: `OMP_NUM_THREADS=1 python benchmarks/first_call.py` with the arguments in the rows.", "",
             "| variant | launch | first call | / plain Inductor's, same launch | measured peak | plan | FX graph cache |",
             "| --- | --- | ---: | ---: | ---: | --- | --- |"]
    for r in rows:
        ratio = r["first_call_s"] / plain[r["launch"]] if plain.get(r["launch"]) else float("nan")
        lines.append(f"| {r['variant']} | {r['launch']} | {r['first_call_s']:.1f} s | {ratio:.2f}x | "
                     f"{r['peak_bytes']:,} B | {r['status']} | {r['fx_graph_cache']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--size", default="gpu", help="a size of benchmarks/hf_models.py (gpu: the real config)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--layers", type=int, default=0, help="0: the config's")
    parser.add_argument("--budgets", nargs="+", default=["1.0e9"], help="memcompile budgets in bytes")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "first_call.jsonl")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    rows = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args.out.with_suffix(".md").write_text(table(rows))
    print(table(rows))


if __name__ == "__main__":
    main()
