"""The step users write, at real size: the loss computed eagerly outside the compiled model.

A Llama-style model file (benchmarks/llama_style.py: 12 layers, GQA, SwiGLU, RMSNorm, RoPE,
vocab 32000) trained as torchtitan's trainer does (`pred = model(tokens); loss =
cross_entropy(pred.flatten(0, 1).float(), labels.flatten()); del pred; loss.backward()`), the
model compiled, the loss not. Rows, each in a fresh process, appended to the result file as they
finish (a run resumes where the file stops):

- plain Inductor: its measured peak;
- eager: its measured peak (the budget a user would expect to be met);
- memcompile at fractions of plain Inductor's peak, and at eager's peak: each step's outcome
  (within, StepOverrunError after a measured overrun, InfeasibleBudgetError before running) and
  measured peak; where a step names a floor after the step was measured, a row at that floor.

    OMP_NUM_THREADS=2 python benchmarks/outside_memory.py            # all rows, resumable
    python benchmarks/outside_memory.py --report                     # the table

Writes benchmarks/results/outside_memory.{jsonl,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
STEPS = 4


def _setup(args):
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import llama_style

    torch.set_num_threads(args.threads)
    config = llama_style.LlamaConfig(dim=args.dim, n_layers=args.layers, n_heads=args.heads, n_kv_heads=args.kv_heads,
                                     vocab_size=args.vocab, ffn_hidden=args.ffn)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=g)
    labels = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=g)
    return llama_style, config, tokens, labels


def child(args: argparse.Namespace, variant: str) -> dict:
    import torch

    import memcompile

    llama_style, config, tokens, labels = _setup(args)
    model = llama_style.build(config)
    params = sum(p.numel() for p in model.parameters())
    if variant == "eager":
        backend, step_model = None, model
    elif variant == "plain":
        backend, step_model = "inductor", torch.compile(model, backend="inductor")
    else:
        backend = memcompile.budget(int(variant), time_limit_s=5.0)
        step_model = torch.compile(model, backend=backend)
    steps = []
    for i in range(STEPS if variant not in ("eager", "plain") else 2):
        for p in model.parameters():
            p.grad = None
        began = time.perf_counter()
        row = {"step": i + 1}
        try:
            measured = memcompile.measure_peak(lambda: llama_style.training_step(step_model, tokens, labels),
                                               live_at_start=[model, tokens, labels])
            row.update(outcome="within" if variant in ("eager", "plain") or measured.peak_bytes <= int(variant)
                       else "OVER (silent)", peak_bytes=measured.peak_bytes)
        except memcompile.StepOverrunError as error:
            row.update(outcome="StepOverrunError", peak_bytes=error.needed_bytes)
        except memcompile.InfeasibleBudgetError as error:
            row.update(outcome="InfeasibleBudgetError", floor_bytes=error.min_feasible_bytes)
        row["wall_s"] = round(time.perf_counter() - began, 2)
        steps.append(row)
    result = {"variant": variant, "params": params, "steps": steps}
    if variant not in ("eager", "plain"):
        result["measured"] = [{"peak_bytes": m.peak_bytes, "boundary_bytes": m.boundary_bytes,
                               "outside_bytes": m.outside_bytes, "where": m.boundary_where}
                              for m in backend.measured_steps]
        result["predicted_step_peak"] = backend.predicted_step_peak()
    return result


def _rows(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _run(args: argparse.Namespace, variant: str, path: pathlib.Path) -> dict:
    command = [sys.executable, __file__, "--child", variant] + _shape_args(args)
    began = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.row_timeout)
    if done.returncode != 0:
        raise SystemExit(f"row {variant} failed:\n{done.stderr[-3000:]}")
    row = json.loads(done.stdout.strip().splitlines()[-1])
    row.update(shape=_shape(args), wall_s=round(time.perf_counter() - began, 1), commit=_commit(),
               machine=f"{platform.machine()} {os.cpu_count()} cores, {args.threads} threads")
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)
    return row


def _shape(args) -> str:
    return (f"llama {args.layers}x{args.dim} h{args.heads}/kv{args.kv_heads} ffn{args.ffn} vocab{args.vocab}, "
            f"{args.batch}x{args.seq}")


def _shape_args(args) -> list[str]:
    return [f"--{k}={getattr(args, k)}" for k in ("layers", "dim", "heads", "kv_heads", "ffn", "vocab", "batch", "seq",
                                                  "threads")]


def _commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv_heads", type=int, default=2)
    parser.add_argument("--ffn", type=int, default=688)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--fractions", default="0.9,0.75")
    parser.add_argument("--row-timeout", type=int, default=840)
    parser.add_argument("--out", default=str(RESULTS / "outside_memory.jsonl"))
    parser.add_argument("--child")
    parser.add_argument("--report", action="store_true")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args, args.child)))
        return
    path = pathlib.Path(args.out)
    if args.report:
        report(path)
        return
    rows = [r for r in _rows(path) if r.get("shape") == _shape(args)]
    done = {r["variant"] for r in rows}
    for variant in ("plain", "eager"):
        if variant not in done:
            rows.append(_run(args, variant, path))
    plain = next(r for r in rows if r["variant"] == "plain")["steps"][-1]["peak_bytes"]
    eager = next(r for r in rows if r["variant"] == "eager")["steps"][-1]["peak_bytes"]
    budgets = [int(plain * float(f)) for f in args.fractions.split(",")] + [eager]
    for budget in budgets:
        row = next((r for r in rows if r["variant"] == str(budget)), None) or _run(args, str(budget), path)
        rows.append(row)
        floors = [s["floor_bytes"] for s in row["steps"][1:] if "floor_bytes" in s]
        if floors and str(floors[-1]) not in {r["variant"] for r in rows}:
            rows.append(_run(args, str(floors[-1]), path))
    report(path)


def report(path: pathlib.Path) -> None:
    rows = _rows(path)
    lines = ["| shape | commit | variant | params | step 1 | step 2 | step 3 | step 4 | measured outside (boundary / other) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        cells = []
        for s in r["steps"]:
            figure = s.get("peak_bytes", s.get("floor_bytes"))
            cells.append(f"{s['outcome']} {figure:,}" if figure is not None else s["outcome"])
        cells += [""] * (4 - len(cells))
        measured = r.get("measured") or []
        outside = "; ".join(f"{m['boundary_bytes']:,} / {m['outside_bytes']:,}" for m in measured) or "-"
        variant = r["variant"] if r["variant"] in ("plain", "eager") else f"memcompile at {int(r['variant']):,} B"
        lines.append(f"| {r['shape']} | {r['commit']} | {variant} | {r['params']:,} | " + " | ".join(cells[:4])
                     + f" | {outside} |")
    machine = rows[-1]["machine"] if rows else ""
    text = ("# The loss outside the compiled model, at real size\n\n"
            f"`python benchmarks/outside_memory.py`, CPU ({machine}). Each row a fresh process; steps measured with "
            "`memcompile.measure_peak`. StepOverrunError: the step ran and was measured over the budget (named); "
            "InfeasibleBudgetError: raised before the step ran, naming the floor.\n\n" + "\n".join(lines) + "\n")
    path.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
