"""Markdown tables from benchmarks/gpu_check.py's rows: one table per model and dtype, then the
acceptance checks of issue 28 (each "not measured" until its rows are there).

    python benchmarks/gpu_table.py OUT/rows.jsonl [MORE.jsonl ...] > table.md

The last row of each id wins (a rerun's row replaces an earlier one).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

MIB = 2**20
OVERHEAD = 0.10  # "lowest peak at <= 10% added step time"
SAME_SPEED = 1.05  # "at PyTorch's 0.8 and 0.5 peaks memcompile's step within 1.05x of PyTorch's"
LOWER_PEAK = 1.5
MAX_BATCH = 2.0
MEMCOMPILE_KINDS = ("mc", "int8", "offload")
PYTORCH_KINDS = ("inductor", "amb", "hf_ckpt")


def load(paths: list[pathlib.Path]) -> dict[str, dict]:
    rows: dict[str, dict] = {}
    for path in paths:
        for line in path.read_text().splitlines():
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a killed run
            if "id" in row:
                rows[row["id"]] = row
    return rows


def mib(n) -> str:
    return f"{n / MIB:,.1f}" if isinstance(n, (int, float)) else ""


def signed_mib(n) -> str:
    return f"{n / MIB:+,.2f}" if isinstance(n, (int, float)) else ""


def ratio(x, digits: int = 3) -> str:
    return f"{x:.{digits}f}" if isinstance(x, (int, float)) else ""


def plan_of(r: dict) -> str:
    if r.get("kind") == "max_batch":
        probes = ", ".join(f"{p['batch']}: {'fits' if p.get('fits') else 'no'}" for p in r.get("probes", []))
        return f"{r.get('method', '')}; predicted batch {r.get('batch_predicted', '')}; probes {probes}"
    if r.get("status") not in ("ok",):
        return f"**{r.get('status')}**: {str(r.get('error', ''))[:160]}"
    choices = r.get("choices")
    text = r.get("solver_status", "")
    if choices:
        text += " " + ", ".join(f"{k} {v}" for k, v in sorted(choices.items()))
    if r.get("graph_rewrites"):
        text += f"; rewrites: {len(r['graph_rewrites'])}"
    if r.get("snapshot"):
        text += f"; snapshot {r['snapshot']}"
    return text.strip()


def group_table(group: str, rows: list[dict]) -> str:
    first = rows[0]
    lines = [f"### {group} ({first.get('device', '')}, torch {first.get('torch', '')}, codegen "
             f"{first.get('codegen', '')}, batch {first.get('main_batch', '')})", "",
             "| row | batch | budget MiB | predicted MiB | measured MiB | <= budget | measured - predicted MiB "
             "| requested / reserved peak MiB | step ms | step ratio (noise) | compile s (ratio) "
             "| grad err vs eager (plain's) | plan |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        fits = "" if r.get("fits") is None else ("yes" if r["fits"] else "**NO**")
        step = f"{r['step_s'] * 1e3:.2f}" if r.get("step_s") else ""
        if r.get("step_ratio"):
            timing = f"{r['step_ratio']:.3f} ({r.get('noise_ratio', 0):.3f})"
        elif r.get("samples_per_s"):
            timing = f"{r['samples_per_s']:.1f} samples/s"
        else:
            timing = ""
        compile_s = f"{r['compile_s']:.0f} ({r.get('compile_ratio', 0):.2f})" if r.get("compile_s") else ""
        grad = (f"{r['grad_rel_err']:.1e} ({r.get('plain_grad_rel_err', 0):.1e})"
                if isinstance(r.get("grad_rel_err"), (int, float)) else "")
        allocator = (f"{mib(r.get('peak_requested'))} / {mib(r.get('peak_reserved'))}"
                     if r.get("peak_requested") is not None else "")
        batch = r.get("max_batch", r.get("batch", ""))
        measured = r.get("peak")
        if r.get("kind") == "max_batch":
            fitting = [p for p in r.get("probes", []) if p.get("fits")]
            measured = fitting[-1].get("peak") if fitting else None
        lines.append(f"| {r['name']} | {batch} | {mib(r.get('budget'))} | {mib(r.get('predicted'))} | {mib(measured)} "
                     f"| {fits} | {signed_mib(r.get('over_predicted'))} | {allocator} | {step} | {timing} "
                     f"| {compile_s} | {grad} | {plan_of(r)} |")
    return "\n".join(lines)


def acceptance(rows: dict[str, dict]) -> str:
    ok = {i: r for i, r in rows.items() if r.get("status") == "ok"}
    lines = ["## Acceptance (issue 28)", ""]

    # budget honoured on every row; measured <= predicted on every memcompile row
    budgeted = [r for r in ok.values() if r.get("fits") is not None]
    over = [r for r in budgeted if not r["fits"]]
    lines.append(f"- Budget honoured: {len(budgeted) - len(over)} of {len(budgeted)} rows with a budget"
                 + ("" if not over else "; **over**: " + ", ".join(
                     f"{r['id']} by {signed_mib(r['peak'] - r['budget'])} MiB" for r in over)))
    predicted = [r for r in ok.values() if isinstance(r.get("over_predicted"), (int, float))]
    if predicted:
        worst = max(predicted, key=lambda r: r["over_predicted"])
        under = [r for r in predicted if r["over_predicted"] > 0]
        lines.append(f"- Measured <= predicted: {len(predicted) - len(under)} of {len(predicted)} memcompile rows; "
                     f"measured - predicted from {signed_mib(min(r['over_predicted'] for r in predicted))} to "
                     f"{signed_mib(worst['over_predicted'])} MiB ({worst['id']})")
    else:
        lines.append("- Measured <= predicted: not measured")

    groups = sorted({r["group"] for r in rows.values() if "group" in r})
    for group in groups:
        get = lambda name: ok.get(f"{group}/{name}")  # noqa: E731
        lines.append(f"- {group}:")
        for fraction in ("0.8", "0.5"):
            pytorch, ours = get(f"amb{fraction}"), get(f"mc@amb{fraction}")
            if pytorch and ours and pytorch.get("step_ratio") and ours.get("step_ratio"):
                vs = ours["step_ratio"] / pytorch["step_ratio"]
                verdict = "met" if vs <= SAME_SPEED else "**missed**"
                lines.append(f"  - at PyTorch's {fraction} peak ({mib(pytorch['peak'])} MiB): memcompile "
                             f"{ours['step_ratio']:.3f}x plain, PyTorch {pytorch['step_ratio']:.3f}x: "
                             f"{vs:.3f}x PyTorch's step ({verdict}, target <= {SAME_SPEED})")
            else:
                lines.append(f"  - at PyTorch's {fraction} peak: not measured")
        fast = lambda kinds: [r for r in ok.values() if r.get("group") == group and r.get("kind") in kinds  # noqa: E731
                              and r.get("step_ratio") and r["step_ratio"] <= 1 + OVERHEAD and r.get("peak")]
        ours, theirs = fast(MEMCOMPILE_KINDS), fast(PYTORCH_KINDS)
        if ours and theirs:
            best_ours = min(ours, key=lambda r: r["peak"])
            best_theirs = min(theirs, key=lambda r: r["peak"])
            factor = best_theirs["peak"] / best_ours["peak"]
            verdict = "met" if factor >= LOWER_PEAK else "**missed**"
            lines.append(f"  - lowest peak at <= {OVERHEAD:.0%} added time: memcompile {mib(best_ours['peak'])} MiB "
                         f"({best_ours['name']}, {best_ours['step_ratio']:.3f}x), PyTorch {mib(best_theirs['peak'])} MiB "
                         f"({best_theirs['name']}, {best_theirs['step_ratio']:.3f}x): {factor:.2f}x lower "
                         f"({verdict}, target >= {LOWER_PEAK})")
        else:
            lines.append(f"  - lowest peak at <= {OVERHEAD:.0%} added time: not measured")
        doubled = rows.get(f"{group}/mc@inductor_b4")
        search = get("maxbatch:mc")
        if search:
            factor = search["batch_ratio"]
            lines.append(f"  - max batch at plain Inductor's batch-{search.get('small_batch', '?')} "
                         f"peak ({mib(search['budget'])} MiB): memcompile lossless {search['max_batch']} "
                         f"({factor:.2f}x; {'met' if factor >= MAX_BATCH else '**missed**'}, target >= {MAX_BATCH}x)")
        elif doubled and doubled.get("status") in ("ok", "infeasible"):
            fits = doubled.get("status") == "ok" and doubled.get("fits")
            lines.append(f"  - max batch: memcompile {'fits' if fits else 'does **not** fit'} batch "
                         f"{doubled.get('batch', doubled.get('main_batch'))} (2x) in plain Inductor's half-batch peak "
                         f"({mib(doubled.get('budget'))} MiB)" + ("" if fits else
                                                                   f"; its smallest budget {mib(doubled.get('min_feasible'))} MiB"))
        else:
            lines.append("  - max batch: not measured")
        for method in ("int8", "pytorch"):
            r = get(f"maxbatch:{method}")
            if r:
                lines.append(f"  - max batch, {'memcompile int8' if method == 'int8' else 'PyTorch ' + r['method']}: "
                             f"{r['max_batch']} ({r['batch_ratio']:.2f}x)")
    failed = [r for r in rows.values() if r.get("status") not in ("ok", "infeasible")]
    if failed:
        lines += ["", "Rows that did not finish: " + "; ".join(f"{r['id']} ({r.get('status')}: "
                                                               f"{str(r.get('error', ''))[:120]})" for r in failed)]
    return "\n".join(lines)


def markdown(rows: dict[str, dict]) -> str:
    by_group: dict[str, list[dict]] = {}
    for r in rows.values():
        if "group" in r:
            by_group.setdefault(r["group"], []).append(r)
    parts = [acceptance(rows), "", "## Rows", "",
             "Peaks: `torch.cuda.max_memory_allocated` over one step after `reset_peak_memory_stats` (on the CPU: "
             "memcompile.measure_peak); budget: the measured peak of the row named after `@`, or memcompile's own "
             "floor; predicted: memcompile's plan (step peak + reserve, cuBLAS workspaces included); step ratio: "
             "median step over plain Inductor's, timed interleaved in the same process (noise: plain's second "
             "timing over its first); compile ratio: first call over plain Inductor's, no graph caches."]
    for group, group_rows in by_group.items():
        parts += ["", group_table(group, group_rows)]
    return "\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rows", nargs="+", type=pathlib.Path)
    parser.add_argument("--out", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    text = markdown(load(args.rows))
    if args.out:
        args.out.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
