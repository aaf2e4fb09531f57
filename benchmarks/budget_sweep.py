"""Never over budget in silence, under Inductor: random training steps under random budgets.

Each case (tests/step_sweep.py) is a small model (MLP, convolution or attention blocks; dropout,
bf16 autocast, checkpoint annotations at random) with 0-3 graph breaks between blocks, or inside
the loop over them, and a budget drawn from 0.2x to 1.2x its keep-all step peak. The rule: it runs
with every step's measured peak (the first included) within the budget and the reference's
gradients, or raises a typed error before running over (InfeasibleBudgetError, whose named floor
a run then meets; StepOverrunError, after which the step run again fits; UnplannedFrameError for a
break inside a loop). Anything else, or a crash, breaks the rule.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/budget_sweep.py --cases 300 [--codegen inductor] [--seed 0]

Results are appended to benchmarks/results/budget_sweep.jsonl as they finish (a rerun with the
same seed skips the cases already there); --report writes benchmarks/results/budget_sweep.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import random
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

import step_sweep  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _done(path: pathlib.Path, seed: int, codegen: str, budget_range: tuple[float, float]) -> set[int]:
    if not path.exists():
        return set()
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["index"] for r in rows if r.get("seed") == seed and r.get("codegen") == codegen
            and tuple(r["case"].get("budget_range", (0.2, 1.2))) == tuple(budget_range)}


def run(cases: int, codegen: str, seed: int, path: pathlib.Path, deadline_s: float | None,
        budget_range: tuple[float, float] = (0.2, 1.2)) -> None:
    rng = random.Random(seed)
    drawn = [dataclasses.replace(step_sweep.draw_case(rng), budget_range=budget_range) for _ in range(cases)]
    done = _done(path, seed, codegen, budget_range)
    began = time.perf_counter()
    commit = _commit()
    for index, case in enumerate(drawn):
        if index in done:
            continue
        if deadline_s is not None and time.perf_counter() - began > deadline_s:
            print(f"deadline reached after {index} cases", flush=True)
            return
        outcome = step_sweep.run_case(case, codegen=codegen)
        row = {"index": index, "seed": seed, "codegen": codegen, "commit": commit, "torch": torch.__version__,
               **step_sweep.as_row(outcome)}
        with path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"{index:4d} {'ok ' if outcome.ok else 'BAD'} {outcome.outcome:10s} {case.describe():58s} "
              f"budget={outcome.budget_bytes} peaks={list(outcome.peaks)} floor={outcome.floor_bytes} "
              f"{outcome.seconds:.0f}s {outcome.note[:160]}", flush=True)


def report(path: pathlib.Path) -> str:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    kinds = sorted({r["case"]["kind"] for r in rows})
    lines = [
        "# Budget sweep: never over budget in silence",
        "",
        f"{len(rows)} random (model, graph breaks, budget) cases, codegen {', '.join(sorted({r['codegen'] for r in rows}))}, "
        f"torch {rows[0]['torch'] if rows else '?'}, a shared 2-core x86-64 CPU VM; by seed: "
        + "; ".join(f"seed {seed}: {sum(r['seed'] == seed for r in rows)} cases at commit "
                    f"{', '.join(sorted({r['commit'] for r in rows if r['seed'] == seed}))}"
                    for seed in sorted({r['seed'] for r in rows}))
        + ". Command: `OMP_NUM_THREADS=1 .venv/bin/python benchmarks/budget_sweep.py --cases 150 --seed S` per seed, "
        "then `--report`.",
        "Budgets log-uniform in "
        + ", ".join(f"[{low}, {high}]" for low, high in sorted({tuple(r['case'].get('budget_range', (0.2, 1.2)))
                                                               for r in rows}))
        + " x the keep-all step peak (by seed: the case's `budget_range`); every step measured (the first included).",
        "",
        "| model | cases | ran within budget | infeasible (typed, floor met) | overrun (typed, rerun fits) | "
        "unplanned (typed) | rule met | crashes |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for kind in kinds + ["all"]:
        mine = [r for r in rows if kind == "all" or r["case"]["kind"] == kind]
        count = lambda outcome: sum(r["outcome"] == outcome and r["ok"] for r in mine)  # noqa: E731
        lines.append(f"| {kind} | {len(mine)} | {count('ran')} | {count('infeasible')} | {count('overrun')} | "
                     f"{count('unplanned')} | {sum(r['ok'] for r in mine)} | {sum(r['outcome'] == 'crash' for r in mine)} |")
    over = [r for r in rows if r["outcome"] == "ran" and any(p > r["budget_bytes"] for p in r["peaks"])]
    reruns = sum(r["floor_runs"] > 1 for r in rows)
    breaks = sum(bool(r["case"]["breaks"]) for r in rows)
    lines += ["", f"Silent overruns (a step over its budget without an error): {len(over)}. "
              f"Cases with graph breaks: {breaks}. Floors named in a first step of several regions that a run "
              f"at them raised again (a later region needed more): {reruns}. Gradient mismatches: "
              f"{sum('gradients differ' in r['note'] for r in rows)}."]
    counted = [r for r in rows if "deferred_checks" in r]
    if counted:
        deferred = sum(r["deferred_checks"] for r in counted)
        failed = sum(r["deferred_checks_failed"] for r in counted)
        lines += ["", f"Plans compiled on an estimate, their compile's schedule checking them (rows that count "
                  f"them: {len(counted)}): {deferred}; not confirmed, so planned again with checks: {failed}"
                  + (f" ({failed / deferred:.1%})." if deferred else ".")]
    bad = [r for r in rows if not r["ok"]]
    if bad:
        lines += ["", "Cases that break the rule:", ""]
        lines += [f"- {r['describe']} budget {r['budget_bytes']}: {r['outcome']}: {r['note'].splitlines()[0][:300]}"
                  for r in bad]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=300)
    parser.add_argument("--codegen", choices=["inductor", "aot_eager"], default="inductor")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--deadline-s", type=float, default=None, help="stop starting cases after this long")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "budget_sweep.jsonl")
    parser.add_argument("--report", action="store_true", help="only write the markdown table from --out")
    parser.add_argument("--budget-range", type=float, nargs=2, default=(0.2, 1.2), metavar=("LOW", "HIGH"),
                        help="budgets log-uniform in [LOW, HIGH] x the keep-all step peak (0.2 1.2; a seed's "
                             "rows are resumed only under the range they were drawn in)")
    args = parser.parse_args()
    if not args.report:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        run(args.cases, args.codegen, args.seed, args.out, args.deadline_s, tuple(args.budget_range))
    table = report(args.out)
    print(table)
    if args.report:
        args.out.with_suffix(".md").write_text(table)


if __name__ == "__main__":
    main()
