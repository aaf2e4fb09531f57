"""One short device check: peak and step time of keep-all / recompute only / + offload / + int8.

On CUDA: peak = torch.cuda.max_memory_allocated over one step, step time = median of 5 after
warm-up, at budgets of 0.8, 0.6 and 0.45 of the keep-all peak; one table, a few minutes.
Without CUDA it runs the same table on the CPU in a degraded mode: offload off (no separate host
memory), a smaller model, peak from the CPU allocator events.

    python benchmarks/gpu_check.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import memcompile  # noqa: E402
from models import WithMSELoss, make_gpt, make_input, make_target  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    blocks, d, batch, seq = (12, 1024, 8, 1024) if cuda else (4, 128, 8, 128)
    model = make_gpt(n_blocks=blocks, d_model=d, n_heads=16 if cuda else 4).to(device)
    x, y = make_input(batch, seq, d).to(device), make_target(batch, seq, d).to(device)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def run(limit, **options):
        torch.compiler.reset()
        backend = memcompile.budget(limit, time_limit_s=10, **options)
        step = torch.compile(WithMSELoss(model), backend=backend)
        try:
            step(x, y).backward()
        except memcompile.InfeasibleBudgetError as error:
            return {"feasible": False, "min_feasible": error.min_feasible_bytes}
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            step(x, y).backward()
            sync()
            peak = torch.cuda.max_memory_allocated()
        else:
            peak = memcompile.measure_peak(lambda: step(x, y).backward(), live_at_start=[x, y, *model.parameters()]).peak_bytes
        times = []
        for _ in range(6):
            model.zero_grad(set_to_none=True)
            sync()
            began = time.perf_counter()
            step(x, y).backward()
            sync()
            times.append(time.perf_counter() - began)
        plan = backend.plans[0] if backend.plans else None
        return {"feasible": True, "peak": peak, "step_s": statistics.median(times[1:]),
                "predicted": plan.predicted_peak_bytes if plan else None, "choices": plan.choices() if plan else {}}

    keep_all = run(10**14)
    rows = [("keep-all", None, keep_all)]
    variants = [("recompute only", {"offload": False}), ("+ int8", {"offload": False, "quantize": "int8"})]
    if cuda:
        variants.insert(1, ("+ offload", {"offload": True}))
    for fraction in (0.8, 0.6, 0.45):
        limit = int(fraction * keep_all["peak"])
        for label, options in variants:
            rows.append((label, limit, run(limit, **options)))
    mib = 2**20
    print(f"device {device} ({torch.cuda.get_device_name() if cuda else 'CPU, degraded: no offload'}), "
          f"GPT {blocks}x{d} batch {batch} seq {seq}")
    print(f"{'variant':<16} {'budget MiB':>10} {'peak MiB':>9} {'<=':>3} {'step ms':>8} {'ratio':>6}  choices")
    for label, limit, r in rows:
        if not r["feasible"]:
            print(f"{label:<16} {limit / mib:>10.1f}  infeasible (min {r['min_feasible'] / mib:.1f} MiB)")
            continue
        ok = "" if limit is None else ("yes" if r["peak"] <= limit else "NO")
        print(f"{label:<16} {(limit or 0) / mib:>10.1f} {r['peak'] / mib:>9.1f} {ok:>3} {r['step_s'] * 1e3:>8.1f} "
              f"{r['step_s'] / keep_all['step_s']:>6.2f}  {r['choices']}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps([{"variant": v, "budget": b, **r} for v, b, r in rows], indent=1))


if __name__ == "__main__":
    main()
