"""Issue 3 acceptance: what int8 storage buys over recompute alone, on a GPT stack (Inductor, CPU).

Reports: the smallest feasible budget with recompute only and with int8; at a ladder of budgets,
the planner's predicted added time, measured peak and step time of both; the gradient error of
int8 against eager; and 50-step loss curves of both.

    .venv/bin/python benchmarks/quantize_acceptance.py [--steps 50] [--blocks 4]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import memcompile  # noqa: E402
from models import WithMSELoss, make_gpt, make_input, make_target  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results"


def compile_step(model, limit, **options):
    torch.compiler.reset()
    backend = memcompile.budget(limit, time_limit_s=8, **options)
    return backend, torch.compile(WithMSELoss(model), backend=backend)


def smallest_budget(model, x, y, **options) -> int:
    backend, step = compile_step(model, 1, **options)
    try:
        step(x, y)
    except memcompile.InfeasibleBudgetError as error:
        return error.min_feasible_bytes
    raise AssertionError("a 1-byte budget was accepted")


def grads(model, fn, x, y):
    model.zero_grad(set_to_none=True)
    fn(x, y).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def _timed_step_s(model, step, x, y) -> float:
    model.zero_grad(set_to_none=True)
    began = time.perf_counter()
    step(x, y).backward()
    return time.perf_counter() - began


def step_time_ratio(model, variant, x, y, reps: int = 7) -> tuple[float, float, float]:
    """(variant median s, plain median s, ratio): plain Inductor is compiled next to the variant
    and the two are timed alternately, so load drifts hit both alike."""
    plain = torch.compile(WithMSELoss(model), backend=memcompile.budget(10**12, time_limit_s=8))
    for step in (plain, variant):
        _timed_step_s(model, step, x, y)  # warm-up (and plain's compile)
    plain_s, variant_s = [], []
    for _ in range(reps):
        plain_s.append(_timed_step_s(model, plain, x, y))
        variant_s.append(_timed_step_s(model, variant, x, y))
    a, b = statistics.median(variant_s), statistics.median(plain_s)
    return a, b, a / b


def measure(model, step, x, y) -> int:
    model.zero_grad(set_to_none=True)
    return memcompile.measure_peak(lambda: step(x, y).backward(), live_at_start=[x, y, *model.parameters()]).peak_bytes


def loss_curve(limit, steps, blocks, x, y, **options) -> list[float]:
    model = make_gpt(n_blocks=blocks, d_model=x.shape[-1], seed=3)
    _, step = compile_step(model, limit, **options)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = step(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--tag", default="", help="suffix of the result files (e.g. _graph_order for a run with MEMCOMPILE_FUSION_CHECK=0)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    load_at_start = os.getloadavg()[0]
    batch, seq, d = 8, 128, 128
    model = make_gpt(n_blocks=args.blocks, d_model=d)
    x, y = make_input(batch, seq, d), make_target(batch, seq, d)
    eager = grads(model, WithMSELoss(model), x, y)

    backend, plain = compile_step(model, 10**12)
    plain(x, y).backward()
    free = backend.plans[0].predicted_peak_before_bytes
    base_peak = measure(model, plain, x, y)
    low_lossless = smallest_budget(model, x, y)
    low_int8 = smallest_budget(model, x, y, quantize="int8")

    rows = []
    ladder = [int(f * free) for f in (0.9, 0.75, 0.6)] + sorted({low_lossless, low_int8}, reverse=True)
    for limit in ladder:
        fraction = limit / free
        for label, options in (("recompute only", {}), ("+ int8", {"quantize": "int8"})):
            if limit < (low_lossless if not options else low_int8):
                rows.append({"budget": limit, "fraction": fraction, "variant": label, "feasible": False})
                continue
            backend, step = compile_step(model, limit, **options)
            got = grads(model, step, x, y)
            err = max(((a - b).norm() / b.norm()).item() for a, b in zip(got, eager))
            plan = backend.plans[0]
            variant_s, plain_s, ratio = step_time_ratio(model, step, x, y)
            rows.append({
                "budget": limit, "fraction": fraction, "variant": label, "feasible": True,
                "predicted_peak": plan.predicted_peak_bytes, "measured_peak": measure(model, step, x, y),
                "predicted_added_ms": plan.added_time_s * 1e3, "step_s": variant_s, "plain_step_s": plain_s,
                "step_ratio": ratio,
                "grad_rel_err": err, "choices": plan.choices(),
            })
    curve_budget = int(0.6 * free)
    curves = {
        "recompute only": loss_curve(curve_budget, args.steps, args.blocks, x, y),
        "+ int8": loss_curve(curve_budget, args.steps, args.blocks, x, y, quantize="int8"),
    }
    result = {
        "model": f"GPT {args.blocks}x{d}, batch {batch}, seq {seq}, float32, Inductor CPU, 2 threads",
        "keep_all_predicted_peak": free, "keep_all_measured_peak": base_peak,
        "smallest_budget_recompute_only": low_lossless, "smallest_budget_int8": low_int8,
        "rows": rows, "loss_curve_budget": curve_budget, "loss_curves": curves,
        "load_average": [load_at_start, os.getloadavg()[0]],
        "fusion_check": os.environ.get("MEMCOMPILE_FUSION_CHECK", "") == "1",
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"quantize_acceptance{args.tag}.json").write_text(json.dumps(result, indent=1) + "\n")
    mib = 2**20
    lines = [
        f"# int8 vs recompute only ({result['model']})", "",
        "prediction: fusion-aware (MEMCOMPILE_FUSION_CHECK=1)" if result["fusion_check"] else
        "prediction: every op's result a buffer (default)",
        f"keep-all: predicted {free / mib:.2f} MiB, measured {base_peak / mib:.2f} MiB",
        "step ratio: median variant step / median plain-Inductor step, the two timed alternately (7 each); "
        f"1-min load average {result['load_average'][0]:.1f} at the start, {result['load_average'][1]:.1f} at the end",
        f"smallest feasible budget: recompute only {low_lossless / mib:.2f} MiB, with int8 {low_int8 / mib:.2f} MiB", "",
        "| budget | variant | measured peak | <= budget | predicted added ms | step ratio | grad rel err | choices |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if not r["feasible"]:
            lines.append(f"| {r['budget'] / mib:.2f} MiB | {r['variant']} | infeasible | | | | | |")
            continue
        lines.append(
            f"| {r['budget'] / mib:.2f} MiB ({r['fraction']:.2f} P) | {r['variant']} | {r['measured_peak'] / mib:.2f} MiB | "
            f"{'yes' if r['measured_peak'] <= r['budget'] else 'NO'} | {r['predicted_added_ms']:.2f} | {r['step_ratio']:.2f} | "
            f"{r['grad_rel_err']:.1e} | {r['choices']} |")
    lossless, lossy = curves["recompute only"], curves["+ int8"]
    lines += ["", f"loss over {args.steps} steps at {curve_budget / mib:.2f} MiB (Adam 1e-3): "
              f"recompute only {lossless[0]:.4f} -> {lossless[-1]:.4f}; int8 {lossy[0]:.4f} -> {lossy[-1]:.4f}; "
              f"max |difference| {max(abs(a - b) for a, b in zip(lossless, lossy)):.2e}"]
    (RESULTS / f"quantize_acceptance{args.tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
