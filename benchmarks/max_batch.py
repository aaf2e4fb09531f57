"""The largest batch that fits a fixed absolute memory budget, per method.

    python benchmarks/max_batch.py                       # GPT-2 "small", budget = plain Inductor's peak at batch 4
    python benchmarks/max_batch.py --model llama --base-batch 2
    python benchmarks/max_batch.py --plans --budget 17487880     # memcompile.max_batch: bisection over plans

Methods: plain Inductor; Inductor with torch._functorch.config.activation_memory_budget at the
fraction that fits the most (--fractions, default 0.0, the least memory it can aim at); memcompile
lossless; memcompile with quantize="int8" ("unavailable" when memcompile.budget() does not accept
it). The budget is plain Inductor's measured peak at --base-batch (or --budget bytes).

A batch "fits" when the step compiles and runs (no InfeasibleBudgetError) and its measured peak
(memcompile.measure_peak, as in pareto.py) is <= the budget. Search: doubling from --base-batch
(halving if that does not fit) until one does not fit, then bisection. Each probe is a child
process (fresh Dynamo, config and caches). Writes benchmarks/results/max_batch{tag}.jsonl and .md.

--plans: memcompile's row from `memcompile.max_batch` instead, in one child: bisection over plans
(each probe traces and plans the step, plan-only: no code generated, no step run), then one
compile and measured step at the batch it returns (measured peak <= budget?) and the plan of the
next batch (it must not fit). `--override layers=12 hidden=768 ...` changes the model's config
(e.g. GPT-2 small's real one). Writes benchmarks/results/max_batch{tag}_plans.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
MARK = "MAX_BATCH_JSON:"
METHODS = ("inductor", "memcompile", "inductor_amb", "memcompile_int8")


def plans_child(spec: dict) -> dict:
    """memcompile.max_batch over plans, then the found batch compiled, run and measured."""
    import torch

    torch.set_num_threads(spec["threads"])
    sys.path.insert(0, str(HERE))
    import memcompile
    from hf_models import build

    overrides = spec.get("overrides", {})

    def make_step(n, backend):
        bench = build(spec["model"], spec["size"], **{**overrides, spec["dim"]: n})
        compiled = torch.compile(bench.module, backend=backend, dynamic=False)
        return lambda: compiled(*bench.inputs).backward()

    t0 = time.perf_counter()
    found = memcompile.max_batch(make_step, spec["budget"], lo=spec["lo"], hi=spec.get("hi"),
                                 time_limit_s=spec["time_limit"])
    search_s = time.perf_counter() - t0
    rec = {**spec, "status": "ok", "max": found.batch, "limit": found.limit, "search_s": search_s,
           "plan_peak_bytes": found.plan.predicted_peak_bytes,
           "probes": [{"value": p.batch, "fits": p.fits, "need_bytes": p.need_bytes, "status": p.status,
                       "seconds": p.seconds} for p in found.probes]}
    if spec.get("measure", True):
        bench = build(spec["model"], spec["size"], **{**overrides, spec["dim"]: found.batch})
        fn = torch.compile(bench.module, backend=memcompile.budget(spec["budget"], time_limit_s=spec["time_limit"]))
        fn(*bench.inputs).backward()
        bench.module.zero_grad(set_to_none=True)
        m = memcompile.measure_peak(lambda: fn(*bench.inputs).backward(), live_at_start=[bench.module, *bench.inputs])
        rec.update(peak_bytes=m.peak_bytes, fits=m.peak_bytes <= spec["budget"], measure_s=time.perf_counter() - t0 - search_s)
    return rec


def child(spec: dict) -> dict:
    import torch

    if spec["method"] == "memcompile_plans":
        return plans_child(spec)
    torch.set_num_threads(spec["threads"])
    sys.path.insert(0, str(HERE))
    import memcompile
    from hf_models import build

    bench = build(spec["model"], spec["size"], **{**spec.get("overrides", {}), spec["dim"]: spec["value"]})
    rec = dict(spec)
    method = spec["method"]
    if method == "inductor_amb":
        import torch._functorch.config as functorch_config

        functorch_config.activation_memory_budget = spec["fraction"]
    if method.startswith("memcompile"):
        extra = {"quantize": "int8"} if method == "memcompile_int8" else {}
        try:
            backend = memcompile.budget(spec["budget"], time_limit_s=spec["time_limit"], **extra)
        except TypeError as e:
            return {**rec, "status": "unavailable", "error": str(e)}
        fn = torch.compile(bench.module, backend=backend)
    else:
        fn = torch.compile(bench.module)
    try:
        fn(*bench.inputs).backward()
    except memcompile.InfeasibleBudgetError as e:
        return {**rec, "status": "infeasible", "fits": False, "min_feasible_bytes": e.min_feasible_bytes}
    bench.module.zero_grad(set_to_none=True)
    fn(*bench.inputs).backward()  # warm-up
    bench.module.zero_grad(set_to_none=True)
    m = memcompile.measure_peak(lambda: fn(*bench.inputs).backward(), live_at_start=[bench.module, *bench.inputs])
    rec.update(status="ok", peak_bytes=m.peak_bytes)
    if spec.get("budget") is not None:
        rec["fits"] = m.peak_bytes <= spec["budget"]
    return rec


def run_child(spec: dict, args: argparse.Namespace) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=args.cache_dir, OMP_NUM_THREADS=str(args.threads))
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)],
                              capture_output=True, text=True, timeout=args.child_timeout, env=env)
    except subprocess.TimeoutExpired:
        return {**spec, "status": "timeout", "fits": False}
    for line in proc.stdout.splitlines():
        if line.startswith(MARK):
            return {**json.loads(line[len(MARK):]), "child_wall_s": time.perf_counter() - t0}
    return {**spec, "status": "crashed", "fits": False, "stderr_tail": proc.stderr[-3000:]}


def largest_fitting(fits, start: int, limit: int, rel_tol: float = 0.0) -> tuple[int, list[int]]:
    """Largest n in [1, limit] with fits(n) (fits assumed monotone): doubling from start, then bisection
    until the first failing size is within rel_tol of the answer (0: exact).

    Returns (n, probed values); n = 0 if even 1 does not fit."""
    probed: list[int] = []

    def probe(n: int) -> bool:
        probed.append(n)
        return fits(n)

    n = start
    if probe(n):
        lo, hi = n, None
        while hi is None:
            nxt = min(2 * lo, limit)
            if nxt == lo:
                return lo, probed
            if probe(nxt):
                lo = nxt
            else:
                hi = nxt
    else:
        hi, lo = n, 0
        while lo == 0 and hi > 1:
            nxt = hi // 2
            if probe(nxt):
                lo = nxt
            else:
                hi = nxt
        if lo == 0:
            return 0, probed
    while hi - lo > max(1, int(rel_tol * lo)):
        mid = (lo + hi) // 2
        if probe(mid):
            lo = mid
        else:
            hi = mid
    return lo, probed


def probe_result(p: dict) -> str:
    """yes; no (measured peak over the budget); infeasible (min_feasible_bytes); timeout; crashed."""
    if p.get("fits"):
        return "yes"
    if p.get("status") == "ok":  # ran, but its measured peak is over the budget
        return f"no ({p['peak_bytes'] / 2**20:.2f} MiB)"
    if p.get("status") == "infeasible" and p.get("min_feasible_bytes"):
        return f"infeasible (min {p['min_feasible_bytes'] / 2**20:.2f} MiB)"
    return str(p.get("status"))


def markdown(rows: list[dict], args: argparse.Namespace, budget: int, base: dict) -> str:
    plain = next((r["max"] for r in rows if r["method"] == "inductor"), None)
    out = [f"# Largest {args.dim} within a fixed budget: {args.model} ({args.size})\n",
           f"Budget {budget:,} B ({budget / 2**20:.2f} MiB) = plain Inductor's measured peak at {args.dim} "
           f"{args.base_batch}." if args.budget is None or args.budget == base.get("peak_bytes")
           else f"Budget {budget:,} B (plain Inductor's peak at {args.dim} {args.base_batch}: {base.get('peak_bytes', 0):,} B).",
           f" torch CPU, {args.threads} threads. Command: `python benchmarks/max_batch.py {' '.join(sys.argv[1:])}`.\n",
           f"| method | max {args.dim} | x plain Inductor | peak at max (MiB) | probes ({args.dim}: fits?) |",
           "| --- | --- | --- | --- | --- |"]
    for r in rows:
        if r.get("unavailable"):
            out.append(f"| {r['label']} | unavailable | - | - | {r['unavailable'][:120]} |")
            continue
        ratio = "-" if not plain else f"{r['max'] / plain:.2f}"
        peak = r.get("peak_at_max")
        ff = r.get("first_failing")
        bound = "" if ff in (None, r["max"] + 1) else f" (< {ff})"
        out.append(f"| {r['label']} | {r['max']}{bound} | {ratio} | {'-' if peak is None else f'{peak / 2**20:.2f}'} | "
                   + ", ".join(f"{p['value']}: {probe_result(p)}" for p in r["probes"]) + " |")
    out.append("\nfits = compiled and ran without InfeasibleBudgetError, and measured peak (memcompile.measure_peak)"
               " <= budget. Targets: memcompile lossless >= 2x plain Inductor, with int8 >= 3x.")
    return "\n".join(out)


def plans_parent(args: argparse.Namespace, common: dict) -> int:
    if args.budget is None:
        base = run_child({**common, "method": "inductor", "value": args.base_batch, "budget": None}, args)
        if base.get("status") != "ok":
            print(base)
            return 2
        args.budget = base["peak_bytes"]
    spec = {**common, "method": "memcompile_plans", "budget": args.budget, "lo": args.lo, "hi": args.hi,
            "measure": not args.no_measure}
    rec = run_child(spec, args)
    (RESULTS / f"max_batch{args.tag}_plans.json").write_text(json.dumps(rec, indent=1) + "\n")
    print(json.dumps(rec, indent=1))
    return 0 if rec.get("status") == "ok" else 2


def parent(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    RESULTS.mkdir(parents=True, exist_ok=True)
    common = {"model": args.model, "size": args.size, "dim": args.dim, "threads": args.threads,
              "time_limit": args.time_limit}
    if args.override:
        common["overrides"] = dict((k, int(v)) for k, v in (o.split("=", 1) for o in args.override))
    if args.plans:
        return plans_parent(args, common)
    done = []
    if args.resume and (RESULTS / f"max_batch{args.tag}.jsonl").exists():
        done = [json.loads(ln) for ln in (RESULTS / f"max_batch{args.tag}.jsonl").read_text().splitlines()]
        done = [r for r in done if r.get("status") in ("ok", "infeasible")]

    new_probes = []

    def probe_child(spec: dict, counted: bool = True) -> dict:
        old = next((r for r in done if all(r.get(k) == v for k, v in spec.items())), None)
        if old is not None:
            return old
        if counted and args.max_new is not None and len(new_probes) >= args.max_new:
            raise _ProbesLeft
        if counted:
            new_probes.append(spec)
        return run_child(spec, args)

    # (the baseline that sets the budget is not a probe of the search: not counted by --max-new)
    base = probe_child({**common, "method": "inductor", "value": args.base_batch, "budget": args.budget},
                       counted=False)
    if base.get("status") != "ok":
        print(base)
        return 2
    budget = args.budget or base["peak_bytes"]
    print(f"[{time.perf_counter() - t0:5.0f}s] budget {budget:,} B", flush=True)
    methods = [("inductor", {}, "plain Inductor"), ("memcompile", {}, "memcompile lossless")]
    methods += [("inductor_amb", {"fraction": f}, f"Inductor activation_memory_budget={f}") for f in args.fractions]
    methods += [("memcompile_int8", {}, "memcompile int8")]
    methods = [m for m in methods if m[0] in args.methods]
    with (RESULTS / f"max_batch{args.tag}.jsonl").open("w") as sink:
        try:
            rows = _searched(methods, common, budget, args, probe_child, sink, t0)
        except _ProbesLeft:
            # the earlier run's probes this one did not reach are kept for the next
            written = [json.loads(line) for line in (RESULTS / f"max_batch{args.tag}.jsonl").read_text().splitlines()]
            sink.write("".join(json.dumps(r) + "\n" for r in done if r not in written))
            print(f"stopped after {len(new_probes)} new probe(s) (--max-new): run again with --resume", flush=True)
            return 3
    amb = [r for r in rows if r["method"] == "inductor_amb"]
    if len(amb) > 1:  # PyTorch's best fraction only
        best = max(amb, key=lambda r: r["max"])
        rows = [r for r in rows if r["method"] != "inductor_amb" or r is best]
    md = markdown(rows, args, budget, base)
    (RESULTS / f"max_batch{args.tag}.md").write_text(md + "\n")
    (RESULTS / f"max_batch{args.tag}_summary.json").write_text(
        json.dumps({"budget": budget, "base": base, "rows": rows}, indent=2) + "\n")
    print(md)
    return 0


class _ProbesLeft(Exception):
    """--max-new probes were run: the search goes on in the next invocation (--resume)."""


def _searched(methods, common: dict, budget: int, args: argparse.Namespace, probe_child, sink, t0: float
              ) -> list[dict]:
    """Each method's row: its largest fitting size, probes written to `sink` as they end."""
    plain_max = None
    rows: list[dict] = []
    for method, extra, label in methods:
        probes: list[dict] = []
        unavailable: list[str] = []

        def fits(n: int) -> bool:
            if unavailable:
                return False
            r = probe_child({**common, **extra, "method": method, "value": n, "budget": budget})
            sink.write(json.dumps(r) + "\n")
            sink.flush()
            probes.append(r)
            print(f"[{time.perf_counter() - t0:5.0f}s] {label} {args.dim}={n}: {r.get('status')} "
                  f"fits={r.get('fits')} peak={r.get('peak_bytes')}", flush=True)
            if r.get("status") == "unavailable":
                unavailable.append(r["error"])
            return bool(r.get("fits"))

        # the others start at 2x plain Inductor's largest (the target): fewer compiles
        start = args.base_batch if plain_max is None else max(1, 2 * plain_max)
        tol = 0.0 if method == "inductor" else args.rel_tol
        best, _ = largest_fitting(fits, start, args.limit, tol)
        if method == "inductor":
            plain_max = best
        failed = sorted(p["value"] for p in probes if not p.get("fits") and p["value"] > best)
        at = next((p for p in probes if p["value"] == best and p.get("fits")), {})
        rows.append({"method": method, "label": label, "max": best, "peak_at_max": at.get("peak_bytes"),
                     "first_failing": failed[0] if failed else None,
                     "probes": probes, "unavailable": unavailable[0] if unavailable else None, **extra})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--size", default="small")
    ap.add_argument("--dim", default="batch", choices=("batch", "seq"))
    ap.add_argument("--base-batch", type=int, default=4, help="the budget is plain Inductor's peak at this size")
    ap.add_argument("--budget", type=int, help="absolute budget in bytes instead")
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.0])
    ap.add_argument("--methods", type=lambda v: v.split(","), default=list(METHODS),
                    help=f"comma-separated subset of {','.join(METHODS)} (plain Inductor always sets the budget)")
    ap.add_argument("--limit", type=int, default=256, help="largest size tried")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--time-limit", type=float, default=5.0)
    ap.add_argument("--child-timeout", type=float, default=900.0)
    ap.add_argument("--tag", default="")
    ap.add_argument("--rel-tol", type=float, default=0.15,
                    help="stop bisecting (all but plain Inductor) when the first failing size is within this of the answer")
    ap.add_argument("--resume", action="store_true", help="reuse probes of an earlier run with the same tag")
    ap.add_argument("--max-new", type=int, help="run at most this many new probes; exit 3 while the search goes on")
    ap.add_argument("--cache-dir", help="Inductor cache directory to use (default: a fresh temporary one)")
    ap.add_argument("--plans", action="store_true", help="memcompile's row by memcompile.max_batch (plans only)")
    ap.add_argument("--lo", type=int, default=1, help="--plans: smallest batch")
    ap.add_argument("--hi", type=int, help="--plans: largest batch (default: doubling)")
    ap.add_argument("--no-measure", action="store_true", help="--plans: do not compile and measure the answer")
    ap.add_argument("--override", nargs="*", default=[], metavar="KEY=INT", help="model config entries")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown:
        ap.error(f"--methods {','.join(unknown)}: expected a subset of {','.join(METHODS)}")
    if args.child is None:
        if args.cache_dir:
            return parent(args)
        with tempfile.TemporaryDirectory(prefix="memcompile_max_batch_inductor_") as d:
            args.cache_dir = d
            return parent(args)
    spec = json.loads(args.child)
    try:
        rec = child(spec)
    except Exception as e:
        rec = {**spec, "status": "crashed", "fits": False, "error": f"{type(e).__name__}: {e}",
               "traceback": traceback.format_exc()[-4000:]}
    print(MARK + json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
