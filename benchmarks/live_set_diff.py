"""Where the check and the allocator disagree at the peak: the check's live storages at its
predicted peak (over Inductor's schedule) against the CPU allocator's live blocks at the measured
peak of one step, as multisets of sizes.

    python benchmarks/live_set_diff.py --model llama [--budget BYTES]

Found with it: Llama small's plans predicted 64 B under the measured peak; the sizes of every
activation, gradient and temporary matched and the 64 B were `rotary_emb.original_inv_freq`, a
buffer of the module the compiled graph never reads (live at start in the measurement).
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import hf_models  # noqa: E402

import memcompile  # noqa: E402
from memcompile import planner  # noqa: E402
from memcompile.passes import liveness  # noqa: E402


def _checks_with_live_sets(run):
    """Run `run()`, recording for every scheduled-liveness check its peak and live storages there."""
    checks = []
    original_check, original_record = liveness.analyze_scheduled_liveness, liveness._record_step

    def check(*args, **kwargs):
        at_peak = {}

        def record(steps, peak, live, phase, name, scratch):
            before = peak["bytes"]
            original_record(steps, peak, live, phase, name, scratch)
            if peak["bytes"] != before:
                at_peak["live"] = [(key, s.nbytes, s.category) for key, s in live.items()]
                at_peak["step"] = (phase, name, scratch)

        liveness._record_step = record
        try:
            timeline = original_check(*args, **kwargs)
        finally:
            liveness._record_step = original_record
        checks.append((timeline.peak_bytes, at_peak))
        return timeline

    planner.analyze_scheduled_liveness = check
    try:
        run()
    finally:
        planner.analyze_scheduled_liveness = original_check
    return checks


def _live_blocks_at_peak(prof) -> tuple[int, dict[int, tuple[int, str]]]:
    """(peak rise, {address: (bytes, allocating op)}) from the profiler's allocator events."""
    allocation = torch._C._profiler._EventType.Allocation
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        kind, extra = event.typed
        if kind == allocation:
            op = event.parent.name if event.parent is not None else "?"
            events.append((event.start_time_ns, int(extra.alloc_size), int(extra.ptr), op))
        stack.extend(event.children)
    live, total, best, best_live = {}, 0, 0, {}
    for _, size, ptr, op in sorted(events):
        if size > 0:
            live[ptr] = (size, op)
        else:
            live.pop(ptr, None)
        total += size
        if total > best:
            best, best_live = total, dict(live)
    return best, best_live


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama", choices=hf_models.MODELS)
    ap.add_argument("--size", default="small")
    ap.add_argument("--budget", type=int, default=10**12)
    args = ap.parse_args()
    torch.set_num_threads(1)
    bench = hf_models.build(args.model, args.size)
    backend = memcompile.budget(args.budget, time_limit_s=5)
    compiled = torch.compile(bench.module, backend=backend)
    checks = _checks_with_live_sets(lambda: compiled(*bench.inputs).backward())
    plan = backend.plans[-1]
    predicted = next(at for peak, at in reversed(checks) if peak == plan.predicted_peak_bytes)
    for p in bench.module.parameters():
        p.grad = None
    at_start = memcompile.measure_peak(lambda: None, live_at_start=[bench.module, *bench.inputs]).live_at_start_bytes
    with torch.profiler.profile(profile_memory=True) as prof:
        compiled(*bench.inputs).backward()
    rise, blocks = _live_blocks_at_peak(prof)
    print(f"{plan.solver_status}: predicted {plan.predicted_peak_bytes:,} B at {predicted['step'][:2]}; "
          f"measured {at_start + rise:,} B ({at_start:,} live at start + {rise:,})")
    static = sum(n for _, n, category in predicted["live"] if category == liveness.STATIC)
    print(f"static storages predicted {static:,} B; live at start measured {at_start:,} B")
    ours = collections.Counter(n for _, n, category in predicted["live"] if category != liveness.STATIC and n)
    theirs = collections.Counter(size for size, _ in blocks.values())
    print("predicted, not measured:", sorted((ours - theirs).items()))
    print("measured, not predicted:", sorted((theirs - ours).items()))
    for size, op in blocks.values():
        if (theirs - ours).get(size):
            print(f"  measured block {size:,} B from {op}")


if __name__ == "__main__":
    main()
