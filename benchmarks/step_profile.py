"""Where a plan's added step time goes: torch.profiler self time per op, plain Inductor vs memcompile.

    python benchmarks/step_profile.py --model llama --budget 12467104     # Llama small at 11.89 MiB

One process, both compiled from the same weights; each profiled for --steps steps, twice,
alternating (the second round is kept: caches warm). Prints the plan and, per op (ATen ops and
Inductor's generated kernels, named by enabling its kernel profile), the self time and calls a
step under each, largest difference first. Writes benchmarks/results/step_profile_{model}_{budget}.{json,md}.
The figures it reproduces: recomputed attention (the Llama plans of a7c9e4d / 6cc70d4) shows as
more calls of `aten::_scaled_dot_product_flash_attention_for_cpu` a step.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


def _profiled(fn, module, inputs, steps: int) -> dict[str, tuple[float, int]]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            module.zero_grad(set_to_none=True)
            fn(*inputs).backward()
    return {e.key: (e.self_cpu_time_total / steps, e.count // steps) for e in prof.key_averages()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama")
    ap.add_argument("--size", default="small")
    ap.add_argument("--budget", type=int, required=True, help="memcompile budget in bytes")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--time-limit", type=float, default=5.0)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--debug", action="store_true",
                    help="print the planner's debug log (each solve's model and checked peak, the repair's checks)")
    args = ap.parse_args()
    if args.debug:
        import logging

        logger = logging.getLogger("memcompile")
        logger.setLevel(logging.DEBUG)
        logger.addHandler(logging.StreamHandler())

    import torch
    import torch._inductor.config as inductor_config

    torch.set_num_threads(args.threads)
    inductor_config.cpp.enable_kernel_profile = True  # generated kernels appear by name
    sys.path.insert(0, str(HERE))
    import memcompile
    from hf_models import build
    from pareto import unread_module_bytes

    plain, planned = build(args.model, args.size), build(args.model, args.size)
    reserve = unread_module_bytes(planned.module, planned.inputs)  # as pareto.py: state no graph reads
    backend = memcompile.budget(args.budget, time_limit_s=args.time_limit, **({"reserve": reserve} if reserve else {}))
    # Each through its own code object: Dynamo caches compiled code per code object.
    runs = {"plain Inductor": (torch.compile(lambda *xs: plain.module(*xs)), plain),
            "memcompile": (torch.compile(lambda *xs: planned.module(*xs), backend=backend), planned)}
    for fn, model in runs.values():
        for _ in range(3):
            model.module.zero_grad(set_to_none=True)
            fn(*model.inputs).backward()
    summary = "\n".join(p.summary() for p in backend.plans)
    print(summary)
    per_op: dict[str, dict[str, tuple[float, int]]] = {}
    for _ in range(2):  # the second round is kept
        for name, (fn, model) in runs.items():
            per_op[name] = _profiled(fn, model.module, model.inputs, args.steps)
    base, ours = per_op["plain Inductor"], per_op["memcompile"]
    keys = sorted(set(base) | set(ours), key=lambda k: -abs(ours.get(k, (0, 0))[0] - base.get(k, (0, 0))[0]))
    total = {name: sum(t for t, _ in ops.values()) for name, ops in per_op.items()}
    rows = [{"op": k, "plain_us": base.get(k, (0.0, 0))[0], "plain_calls": base.get(k, (0.0, 0))[1],
             "memcompile_us": ours.get(k, (0.0, 0))[0], "memcompile_calls": ours.get(k, (0.0, 0))[1]} for k in keys]
    lines = [f"# Step profile: {args.model} {args.size}, budget {args.budget} B, {args.threads} thread(s), "
             f"{args.steps} steps\n", "Command: `python benchmarks/step_profile.py " + " ".join(sys.argv[1:]) + "`\n",
             "```\n" + summary + "\n```\n",
             f"Self time a step: plain Inductor {total['plain Inductor']:.0f} us, memcompile {total['memcompile']:.0f} us "
             "(the profiler's own overhead included in both).\n",
             "| op | plain us | calls | memcompile us | calls | difference us |", "| --- " * 6 + "|"]
    for r in rows[:args.top]:
        lines.append(f"| {r['op'][:90]} | {r['plain_us']:.1f} | {r['plain_calls']} | {r['memcompile_us']:.1f} | "
                     f"{r['memcompile_calls']} | {r['memcompile_us'] - r['plain_us']:+.1f} |")
    md = "\n".join(lines) + "\n"
    print(md)
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = RESULTS / f"step_profile_{args.model}_{args.budget}"
    stem.with_suffix(".json").write_text(json.dumps({"args": vars(args), "plan": summary, "total_us": total,
                                                     "ops": rows}, indent=1) + "\n")
    stem.with_suffix(".md").write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
