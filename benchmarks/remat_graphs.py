"""Rematerialization solver on the published benchmark graphs (Checkmate, Moccasin).

    python benchmarks/remat_graphs.py --graph FILE --budget-fraction 0.8 [--time-limit 30] [--json]
    python benchmarks/remat_graphs.py            # every shared graph at 0.9 / 0.8 / 0.7

Budget = ceil(fraction * baseline peak), where the baseline runs the graph in its topological order
and frees every tensor right after its last use. The graphs are read from the shared data folder
and never copied into the repository; the sweep is skipped when the folder is absent.

The sweep writes `benchmarks/results/remat_graphs.{json,md}`. Wall-clock times are noisy on a shared
machine, so every row also records the CPU seconds of the solve (all solver threads and the
solver's forked bound process; close to wall x 2 when the machine is idle, and much less sensitive
to other load) and the 1-minute load average when the solve started.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

from memcompile.solver.remat import (
    RematResult,
    baseline_schedule,
    load_networkx,
    problem_from_networkx,
    simulate,
    solve_remat,
)

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "remat_graphs"
RESULTS = Path(__file__).resolve().parent / "results"
FRACTIONS = (0.9, 0.8, 0.7)


def run_one(path: Path, fraction: float, time_limit_s: float) -> dict:
    graph = load_networkx(path)
    problem = problem_from_networkx(graph)
    original_id = {str(v): v for v in graph.nodes}  # node ids exactly as in the JSON file
    baseline_peak, baseline_cost = simulate(problem, baseline_schedule(problem))
    budget = math.ceil(fraction * baseline_peak)
    load_1m = os.getloadavg()[0]
    cpu_started = _cpu_s()
    result = solve_remat(problem, budget, time_limit_s=time_limit_s)
    cpu_s = _cpu_s() - cpu_started
    return {
        "graph": path.name,
        "n": problem.n,
        "budget_fraction": fraction,
        "budget": budget,
        "baseline_peak": baseline_peak,
        "baseline_cost": baseline_cost,
        "peak": result.peak if result.has_schedule else None,
        "cost": result.cost if result.has_schedule else None,
        "lower_bound": result.lower_bound,
        "gap": result.gap if result.has_schedule else None,
        "proven_lower_bound": result.proven_lower_bound if result.has_schedule else None,
        "proven_gap": result.proven_gap if result.has_schedule else None,
        "peak_lower_bound": result.peak_lower_bound,
        "solve_s": round(result.solve_s, 3),
        "cpu_s": round(cpu_s, 3),
        "load_1m": round(load_1m, 2),
        "status": result.status,
        "schedule": _schedule_with_ids(result, problem.names, original_id),
    }


def _cpu_s() -> float:
    """CPU seconds of this process and its finished children (the solver's bound process)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _schedule_with_ids(result: RematResult, names: tuple[str, ...], original_id: dict) -> list:
    return [[kind, original_id[names[v]]] for kind, v in result.schedule]


def markdown_table(rows: list[dict]) -> str:
    """Overheads are cost / baseline cost - 1; gaps are (cost - bound) / cost.

    "formulation" bounds hold for the schedules the stage grid can express (what "optimal" means);
    "proven" bounds hold for every valid schedule.
    """
    lines = [
        "| graph | n | f | budget | peak | cost overhead | bound overhead (formulation) | gap (formulation) "
        "| bound overhead (proven) | gap (proven) | solve_s | cpu_s | load | status |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        c0 = r["baseline_cost"]
        if r["cost"] is not None:
            cells = [
                str(r["peak"]),
                f"{r['cost'] / c0 - 1:.2%}",
                f"{r['lower_bound'] / c0 - 1:.2%}",
                f"{r['gap']:.2%}",
                f"{r['proven_lower_bound'] / c0 - 1:.2%}",
                f"{r['proven_gap']:.2%}",
            ]
        else:
            cells = ["-"] * 6
        lines.append(
            f"| {r['graph']} | {r['n']} | {r['budget_fraction']} | {r['budget']} | {' | '.join(cells)} | "
            f"{r['solve_s']:.2f} | {r['cpu_s']:.1f} | {r['load_1m']:.1f} | {_status_text(r)} |"
        )
    return "\n".join(lines)


def _status_text(r: dict) -> str:
    if r["status"] == "infeasible":
        return f"infeasible (proved: peak >= {r['peak_lower_bound']})"
    if r["cost"] is None:
        return (
            f"{r['status']}: no schedule found, not proved infeasible "
            f"(proved only peak >= {r['peak_lower_bound']}, below the budget)"
        )
    return r["status"]


def sweep(time_limit_s: float) -> int:
    graphs = sorted(DATA.glob("*.json")) if DATA.is_dir() else []
    if not graphs:
        print(f"skipped: no benchmark graphs under {DATA}")
        return 0
    rows = []
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    for path in graphs:
        for fraction in FRACTIONS:
            row = run_one(path, fraction, time_limit_s)
            print(f"{row['graph']} f={fraction}: {row['status']} in {row['solve_s']:.2f}s", file=sys.stderr)
            rows.append(row)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "remat_graphs.json").write_text(json.dumps(rows, indent=1) + "\n")
    table = markdown_table(rows)
    machine = f"{os.cpu_count()} CPUs, {platform.python_implementation()} {platform.python_version()}, ortools {_ortools_version()}"
    (RESULTS / "remat_graphs.md").write_text(
        f"Rematerialization benchmark (time limit {time_limit_s:g}s per solve), started {started} on {machine}.\n"
        "cpu_s: CPU seconds of the solve (all threads and the forked bound process); load: 1-minute load average at its start.\n\n"
        f"{table}\n"
    )
    print(table)
    return 0


def _ortools_version() -> str:
    from importlib.metadata import version

    return version("ortools")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graph", type=Path, help="node-link JSON graph; omit to sweep all shared graphs")
    parser.add_argument("--budget-fraction", type=float, default=0.8)
    parser.add_argument("--time-limit", type=float, default=30.0, help="seconds per solve")
    parser.add_argument("--json", action="store_true", help="print JSON (the default for --graph)")
    args = parser.parse_args(argv)
    if args.graph is None:
        return sweep(args.time_limit)
    print(json.dumps(run_one(args.graph, args.budget_fraction, args.time_limit)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
