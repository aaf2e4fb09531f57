"""Repeat the few variants that decide a pareto verdict, all in each of several processes.

    python benchmarks/decisive_points.py --model llama --children 5 \\
        --variants amb:0.8,amb:0.6,mc:10082053,mc:10389253     # decisive_llama_small.*

pareto.py runs one variant per child, so a variant's step ratio carries that child's luck (where
the allocator puts its buffers, what else the machine runs): the same Llama small partition
measured 0.97-1.05 in different children of one pareto run (benchmarks/results/pareto_small.md),
a spread as large as the 10% threshold's margins that decide "lowest peak at <= 10% added step
time". Here every child compiles the plain-Inductor baseline and every listed variant (each
through its own code object, so Dynamo caches none of them for another; PyTorch's
activation_memory_budget set only while its variant's first call partitions the graph; no compile
cache), measures each one's peak, and times
them in rounds: baseline, the variants in a rotated order, baseline again, each timed step after
an untimed one of the same function (pareto.STEPS_PER_SWITCH). A variant's ratio in a child is the
median of its steps over the median of both baselines' steps. Over the children: the mean ratio,
its 95% confidence interval (Student's t), and the plain-vs-plain ratio of the two baselines as
the noise floor.

Variants: `amb:F` (Inductor, activation_memory_budget=F), `ckpt` (Inductor, per-block
torch.utils.checkpoint), `mc:BYTES` (memcompile.budget(BYTES), lossless), `mc8:BYTES` (int8),
`mc@VARIANT` (memcompile, lossless, at the peak that VARIANT, listed before it, measured in the same
child: `amb:0.2,mc@amb:0.2`).
Writes benchmarks/results/decisive{tag}.jsonl (one record per child), decisive{tag}.md and
decisive{tag}_summary.json; the tag is _<model>_<size> unless --tag says otherwise.

At --size real a child compiles plain Inductor and every variant of a 100M-parameter model and
times them for minutes: run the children in pieces, each appended to the .jsonl as it finishes (exit 3 while children are left):

    python benchmarks/decisive_points.py --model llama --size real --threads 2 --steps 3 \
        --time-limit 30 --variants amb:0.8,mc:1113464070 --resume --max-new 1
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
MARK = "DECISIVE_JSON:"
OVERHEAD = 0.10
# two-sided 95% Student's t quantiles by degrees of freedom (children - 1)
_T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23}


def _fresh_function(module):
    """A function calling `module` through a code object of its own: Dynamo caches compiled code
    per code object and, with parameters as graph inputs, would hand one variant another's graph."""
    code = compile("lambda *xs: module(*xs)", f"<decisive variant {id(module)}>", "eval")
    return eval(code, {"module": module})


def child(spec: dict) -> dict:
    import torch
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    sys.path.insert(0, str(HERE))
    import memcompile
    from hf_models import build
    from pareto import STEPS_PER_SWITCH, code_and_machine, one_step, unread_module_bytes

    torch.set_num_threads(spec["threads"])
    inductor_config.fx_graph_cache = False
    functorch_config.enable_autograd_cache = False
    torch._dynamo.config.cache_size_limit = 64

    def fresh():
        return build(spec["model"], spec["size"])

    runs = []  # (name, fn, module, inputs)
    made = code_and_machine()
    rec: dict = {**spec, "torch": torch.__version__, "commit": made["commit"],
                 "machine": f"{made['cpu']} ({made['cpus']} CPUs)", "variants": {}}
    # module state no graph reads (Llama's rotary_emb.original_inv_freq): held outside the step,
    # reserved as pareto.py does (a Dynamo capture: before anything else is compiled)
    probe = fresh()
    reserve = unread_module_bytes(probe.module, probe.inputs)
    del probe
    base = fresh()
    base_fn = torch.compile(_fresh_function(base.module))
    one_step(base_fn, base.module, base.inputs)
    for name in spec["variants"]:
        kind, _, arg = name.partition(":")
        is_memcompile = kind in ("mc", "mc8") or name.startswith("mc@")
        var = fresh()
        info: dict = {}
        default_fraction = functorch_config.activation_memory_budget
        if kind == "amb":
            functorch_config.activation_memory_budget = float(arg)
            fn = torch.compile(_fresh_function(var.module))
        elif kind == "ckpt":
            var.enable_block_checkpointing()
            fn = torch.compile(_fresh_function(var.module))
        elif is_memcompile:
            if name.startswith("mc@"):
                # the budget is the peak an earlier variant of this child measured
                arg = str(rec["variants"][name[len("mc@"):]]["peak_bytes"])
                info["budget_bytes"] = int(arg)
            backend = memcompile.budget(int(arg), time_limit_s=spec["time_limit"], reserve=reserve,
                                        **({"quantize": "int8"} if kind == "mc8" else {}))
            fn = torch.compile(_fresh_function(var.module), backend=backend)
        else:
            raise ValueError(f"unknown variant {name!r}: expected amb:F, ckpt, mc:BYTES, mc8:BYTES or mc@VARIANT")
        t0 = time.perf_counter()
        try:
            one_step(fn, var.module, var.inputs)  # compiles (and partitions) under the fraction
        finally:
            functorch_config.activation_memory_budget = default_fraction
        info["first_call_s"] = time.perf_counter() - t0
        one_step(fn, var.module, var.inputs)
        var.module.zero_grad(set_to_none=True)
        m = memcompile.measure_peak(lambda: fn(*var.inputs).backward(), live_at_start=[var.module, *var.inputs])
        var.module.zero_grad(set_to_none=True)
        info["peak_bytes"] = m.peak_bytes
        if is_memcompile:
            info["budget_ok"] = m.peak_bytes <= int(arg)
            info["plan_summary"] = backend.plans[0].summary() if backend.plans else ""
        rec["variants"][name] = info
        runs.append((name, fn, var.module, var.inputs))

    def timed(fn, module, inputs) -> float:
        # after STEPS_PER_SWITCH - 1 untimed steps of the same function, as pareto.py times
        for _ in range(STEPS_PER_SWITCH - 1):
            one_step(fn, module, inputs)
        return one_step(fn, module, inputs)

    base_times: list[float] = []
    base2_times: list[float] = []
    times: dict[str, list[float]] = {name: [] for name, *_ in runs}
    for i in range(spec["steps"]):
        order = runs[i % len(runs):] + runs[:i % len(runs)]  # no variant always right after the baseline
        base_times.append(timed(base_fn, base.module, base.inputs))
        for name, fn, module, inputs in order:
            times[name].append(timed(fn, module, inputs))
        base2_times.append(timed(base_fn, base.module, base.inputs))
    # the reference: both baselines' steps (the first of a round follows the previous round's
    # last variant, the second follows this round's variants)
    base_median = statistics.median(base_times + base2_times)
    rec["baseline_step_s"] = base_median
    rec["noise_ratio"] = statistics.median(base2_times) / statistics.median(base_times)
    for name, ts in times.items():
        rec["variants"][name].update(step_s=statistics.median(ts), step_ratio=statistics.median(ts) / base_median)
    rec["status"] = "ok"
    return rec


def interval(values: list[float]) -> tuple[float, float, float]:
    """(mean, low, high): the mean and its two-sided 95% Student's t interval."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan, math.nan
    half = _T95.get(len(values) - 1, 1.96) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half


def same_spec(rec: dict, spec: dict) -> bool:
    """Whether a child's record was measured under `spec` (its variants are a dict of results)."""
    return (all(rec.get(k) == v for k, v in spec.items() if k != "variants")
            and list(rec.get("variants", {})) == spec["variants"])


def default_tag(args: argparse.Namespace) -> str:
    """The result files' suffix unless --tag says otherwise: decisive_llama_small.*"""
    return f"_{args.model}_{args.size}"


def report(recs: list[dict], args: argparse.Namespace) -> str:
    ok = [r for r in recs if r.get("status") == "ok"]
    lines = [f"# Decisive points: {args.model} {args.size}, {len(ok)} children x {args.steps} rounds",
             "",
             f"Command: `python benchmarks/decisive_points.py --model {args.model} --size {args.size} "
             f"--children {args.children} --steps {args.steps} --threads {args.threads} "
             f"--time-limit {args.time_limit:g} --variants {args.variants}"
             f"{' --tag ' + args.tag if args.tag != default_tag(args) else ''}`. Every child compiles the baseline and every variant; "
             "ratio = the variant's median step / the median of both baselines' steps, in the same child.",
             "",
             f"Children measured at commit(s) {', '.join(sorted({r.get('commit', 'not recorded') for r in ok})) or '-'}; "
             f"machine: {', '.join(sorted({r.get('machine', 'not recorded') for r in ok})) or '-'}."
             + (f" {args.note}" if args.note else ""),
             ""]
    noise = [r["noise_ratio"] for r in ok]
    if noise:
        m, lo, hi = interval(noise)
        lines.append(f"Plain vs plain (second baseline / first): {', '.join(f'{x:.3f}' for x in noise)}; "
                     f"mean {m:.3f} (95% CI {lo:.3f}-{hi:.3f}); baseline step medians "
                     f"{', '.join(str(round(r['baseline_step_s'] * 1e3)) for r in ok)} ms.")
        lines.append("")
    lines += ["| variant | peak MiB | budget ok | ratios per child | mean | 95% CI | <= 1.10 (mean) | CI below 1.10 |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    verdict = {}
    for name in args.variants.split(","):
        vals = [r["variants"][name]["step_ratio"] for r in ok if name in r["variants"]]
        peaks = sorted({r["variants"][name]["peak_bytes"] for r in ok if name in r["variants"]})
        okays = {r["variants"][name].get("budget_ok") for r in ok if name in r["variants"]} - {None}
        if not vals:
            continue
        m, lo, hi = interval(vals)
        verdict[name] = {"mean": m, "low": lo, "high": hi, "peaks": peaks, "ratios": vals}
        peak_text = "/".join(f"{p / 2**20:.2f}" for p in peaks)
        budget_text = "-" if not okays else ("yes" if okays == {True} else "**no**")
        lines.append(f"| {name} | {peak_text} | {budget_text} | {', '.join(f'{v:.3f}' for v in vals)} | {m:.3f} | "
                     f"{lo:.3f}-{hi:.3f} | {'yes' if m <= 1 + OVERHEAD else 'no'} | "
                     f"{'yes' if hi <= 1 + OVERHEAD else 'no'} |")
    (RESULTS / f"decisive{args.tag}_summary.json").write_text(json.dumps(verdict, indent=2) + "\n")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama")
    ap.add_argument("--size", default="small", choices=("tiny", "small", "medium", "real"))
    ap.add_argument("--variants", default="amb:0.8,amb:0.6,mc:10082053,mc:10389253")
    ap.add_argument("--children", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20, help="timing rounds per child")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--time-limit", type=float, default=5.0, help="memcompile solver time_limit_s")
    ap.add_argument("--tag", default=None, help="suffix of the result files (default: _<model>_<size>)")
    ap.add_argument("--report-only", action="store_true", help="rebuild the .md from the .jsonl")
    ap.add_argument("--resume", action="store_true",
                    help="keep the .jsonl's children of the same spec and run only the missing ones")
    ap.add_argument("--max-new", type=int, default=None,
                    help="run at most this many children now; exit 3 while children are left")
    ap.add_argument("--child-timeout", type=float, default=None, help="seconds before a child is stopped")
    ap.add_argument("--note", default="", help="a sentence for the report (where the records do not say it)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.tag is None:
        args.tag = default_tag(args)
    if args.child is not None:
        print(MARK + json.dumps(child(json.loads(args.child))), flush=True)
        return 0
    RESULTS.mkdir(parents=True, exist_ok=True)
    jsonl = RESULTS / f"decisive{args.tag}.jsonl"
    spec = {"model": args.model, "size": args.size, "threads": args.threads, "steps": args.steps,
            "time_limit": args.time_limit, "variants": args.variants.split(",")}
    kept = [json.loads(line) for line in jsonl.read_text().splitlines()] if jsonl.exists() else []
    if args.report_only:
        recs = kept
    else:
        recs = [r for r in kept if args.resume and r.get("status") == "ok" and same_spec(r, spec)]
        todo = [i for i in range(args.children) if i not in {r["child"] for r in recs}]
        left = len(todo) - (args.max_new if args.max_new is not None else len(todo))
        with jsonl.open("w") as sink:
            for rec in recs:
                sink.write(json.dumps(rec) + "\n")
            sink.flush()
            for i in todo[:args.max_new]:
                t0 = time.perf_counter()
                try:
                    out = subprocess.run([sys.executable, __file__, "--child", json.dumps({**spec, "child": i})],
                                         capture_output=True, text=True, timeout=args.child_timeout)
                    line = next((ln for ln in out.stdout.splitlines() if ln.startswith(MARK)), None)
                    rec = (json.loads(line[len(MARK):]) if line else
                           {**spec, "child": i, "status": "crashed", "error": out.stderr[-3000:]})
                except subprocess.TimeoutExpired:
                    rec = {**spec, "child": i, "status": "timeout", "error": f"over {args.child_timeout} s"}
                rec["wall_s"] = round(time.perf_counter() - t0, 1)
                if rec.get("status") != "ok":
                    rec["variants"] = {}  # the spec's names only: no results
                sink.write(json.dumps(rec) + "\n")
                sink.flush()
                recs.append(rec)
                ratios = {k: round(v.get("step_ratio", float("nan")), 3) for k, v in rec.get("variants", {}).items()}
                print(f"child {i}: {rec['status']} in {rec['wall_s']:.0f}s, ratios {ratios}, "
                      f"noise {rec.get('noise_ratio', float('nan')):.3f}", flush=True)
        if left > 0:
            md = report(recs, args)
            (RESULTS / f"decisive{args.tag}.md").write_text(md)
            print(f"{left} child(ren) left: run again with --resume", flush=True)
            return 3
    md = report(recs, args)
    (RESULTS / f"decisive{args.tag}.md").write_text(md)
    print(md)
    bad = any(r.get("status") != "ok" or any(v.get("budget_ok") is False for v in r.get("variants", {}).values())
              for r in recs)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
