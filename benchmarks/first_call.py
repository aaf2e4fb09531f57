"""The first call's time, on a first launch and on a later one: plain Inductor against memcompile.

Each variant runs in fresh processes, twice in a row: the first launch with empty caches (its own
Inductor cache folder and, for memcompile, its own plan store), the second with what the first
left there, as a user's second run of the same script. Reported per launch: the first call's wall
time (forward and backward: tracing, planning, compiling, running), the step's measured peak, the
plan's status, and Inductor's FX graph cache hits.

Variants (--variants, in order): `plain` (Inductor), `amb:F` (Inductor with PyTorch's
activation_memory_budget=F), a budget in bytes for memcompile (`1.2e9`), `peak:V` for
memcompile at the peak variant V measured on this configuration (`peak:amb:0.5`), or `of:X:V` at
X times that peak (`of:0.5:plain`: below memcompile's floor, the infeasible answer).

    OMP_NUM_THREADS=1 python benchmarks/first_call.py --model gpt_style --layers 12 --batch 1 --seq 256 \
        --variants plain amb:0.5 peak:amb:0.5 of:0.9:plain of:0.5:plain

Models: `gpt_style` (benchmarks/gpt_style.py at GPT-2 small's width, vocabulary 50304, --layers
blocks; the loop holds the logits through the backward), or a model of benchmarks/hf_models.py
(--size gpu: the real config). Rows are appended to --out (JSON lines) as each variant ends; a run
skips the variants the file already has for this commit and configuration, so an interrupted run goes
on where it stopped. The table (--out with .md) holds every row of the file. One thread per
process; absolute times depend on the machine and what else runs there: compare rows of one run.
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


def _build(args: argparse.Namespace):
    """(module, inputs, run one step) of the configuration."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    if args.model == "gpt_style":
        from gpt_style import GPT, GPTConfig

        torch.manual_seed(0)
        config = GPTConfig(n_layer=args.layers or 12, block_size=max(args.seq, 1024))
        model = GPT(config)
        idx = torch.randint(0, config.vocab_size, (args.batch, args.seq))
        targets = torch.randint(0, config.vocab_size, (args.batch, args.seq))

        def gpt_step(step):
            logits, loss = step(idx, targets)  # the caller holds the logits through the backward
            loss.backward()
            del logits

        return model, [idx, targets], gpt_step
    import hf_models

    overrides = {k: v for k, v in (("batch", args.batch), ("seq", args.seq), ("layers", args.layers)) if v}
    bench = hf_models.build(args.model, args.size, **overrides)
    return bench.module, list(bench.inputs), lambda step: step(*bench.inputs).backward()


def child(args: argparse.Namespace) -> dict:
    import torch
    from torch._dynamo.utils import counters
    from torch._functorch import config as functorch_config

    import memcompile

    torch.set_num_threads(1)
    module, inputs, run_step = _build(args)
    variant = args.child
    backend = memcompile.budget(int(float(variant)), time_limit_s=5.0) if variant[0].isdigit() else "inductor"
    fraction = float(variant.split(":")[1]) if variant.startswith("amb:") else 1.0
    with functorch_config.patch(activation_memory_budget=fraction):
        step = torch.compile(module, backend=backend)
        began = time.perf_counter()
        status, peak = "ran", 0
        try:
            run_step(step)
        except memcompile.InfeasibleBudgetError as error:
            status = f"infeasible, floor {error.min_feasible_bytes}"
        first_call_s = time.perf_counter() - began
        if status == "ran":
            for p in module.parameters():
                p.grad = None
            peak = memcompile.measure_peak(lambda: run_step(step), live_at_start=[module, *inputs]).peak_bytes
            if backend != "inductor":
                plan = backend.plans[-1]
                status = plan.solver_status + (" (from the plan store)" if plan.from_plan_store else "")
    hits = {k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")}
    # plans chosen on a bound that their compiled schedule did not confirm (compiled twice)
    extra = {"deferred_checks_failed": getattr(backend, "deferred_checks_failed", 0)} if backend != "inductor" else {}
    return {"first_call_s": round(first_call_s, 2), "status": status, "peak_bytes": peak, "fx_graph_cache": hits,
            **extra}


def _config(args: argparse.Namespace) -> dict:
    return {"model": args.model, "size": args.size, "layers": args.layers, "batch": args.batch, "seq": args.seq}


def _rows(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _name(variant: str) -> str:
    if variant == "plain":
        return "plain Inductor"
    if variant.startswith("amb:"):
        return f"Inductor activation_memory_budget={variant[4:]}"
    return f"memcompile {variant}"


def run(args: argparse.Namespace, commit: str) -> None:
    config = _config(args)
    for spec in args.variants:
        mine = [r for r in _rows(args.out) if r.get("commit") == commit and all(r.get(k) == v for k, v in config.items())]
        variant = spec
        if spec.startswith(("peak:", "of:")):
            factor, of = (1.0, spec[5:]) if spec.startswith("peak:") else (float(spec.split(":")[1]),
                                                                          spec.split(":", 2)[2])
            measured = [r for r in mine if r["spec"] == of and r["launch"] == "first" and r["peak_bytes"]]
            if not measured:
                raise SystemExit(f"{spec}: no measured peak of {of} for this configuration yet: list it first")
            variant = str(int(factor * measured[0]["peak_bytes"]))
        folder = tempfile.mkdtemp(prefix="first_call_")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": os.path.join(folder, "inductor"),
               "MEMCOMPILE_PLAN_STORE": os.path.join(folder, "plans")}
        if any(r["spec"] == spec for r in mine):
            continue  # measured by an earlier run
        made = []
        for launch in ("first", "later"):
            command = [sys.executable, __file__, "--child", variant, "--model", args.model, "--size", args.size,
                       "--batch", str(args.batch), "--seq", str(args.seq), "--layers", str(args.layers)]
            out = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
            lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
            if not lines:
                raise RuntimeError(f"{variant} {launch} launch failed:\n{out.stderr[-4000:]}")
            row = {**config, "spec": spec, "variant": _name(variant), "launch": launch, "commit": commit,
                   **json.loads(lines[-1])}
            print(json.dumps(row), flush=True)
            made.append(row)
        with args.out.open("a") as file:  # both launches or neither: the later one needs the first's caches
            file.write("".join(json.dumps(row) + "\n" for row in made))


def table(rows: list[dict], note: str = "") -> str:
    lines = ["# First call: first and later launch, plain Inductor against memcompile", "",
             f"{note}torch 2.13.0+cpu, one thread per process, a 2-core x86-64 VM, memcompile at the row's commit. "
             "Command: `OMP_NUM_THREADS=1 python benchmarks/first_call.py` with the configuration and variants "
             "in the rows (`--help`). Each launch in its own process; first launches with empty caches.", "",
             "| commit | model | layers | batch x seq | variant | launch | first call "
             "| / plain Inductor's, same launch and commit | measured peak | plan |",
             "| --- | --- | ---: | --- | --- | --- | ---: | ---: | ---: | --- |"]
    for r in rows:
        plain = next((p["first_call_s"] for p in rows if p["spec"] == "plain" and p["launch"] == r["launch"]
                      and all(p[k] == r[k] for k in ("commit", "model", "size", "layers", "batch", "seq"))), None)
        ratio = f"{r['first_call_s'] / plain:.2f}x" if plain else "-"
        peak = f"{r['peak_bytes']:,} B" if r["peak_bytes"] else "-"
        lines.append(f"| {r['commit']} | {r['model']} | {r['layers'] or '-'} | {r['batch']} x {r['seq']} | {r['variant']} | "
                     f"{r['launch']} | {r['first_call_s']:.1f} s | {ratio} | {peak} | {r['status']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt_style", help="gpt_style, or a model of benchmarks/hf_models.py")
    parser.add_argument("--size", default="gpu", help="hf_models only: a size (gpu: the real config)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--layers", type=int, default=0, help="0: the config's (gpt_style: 12)")
    parser.add_argument("--variants", nargs="+", default=["plain", "amb:0.5", "peak:amb:0.5"],
                        help="plain, amb:F, a memcompile budget in bytes, peak:V or of:X:V (see above)")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "first_call_gpt_style.jsonl")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    run(args, commit)
    rows = [r for r in _rows(args.out) if "spec" in r]
    args.out.with_suffix(".md").write_text(table(rows))
    print(table(rows))


if __name__ == "__main__":
    main()
