"""Acceptance run: memcompile on a GPT stack at 0.9 / 0.7 / 0.5 of plain Inductor's peak.

    python benchmarks/budget_acceptance.py            # 8 blocks, d_model=128 (~10-15 min on 2 cores)
    python benchmarks/budget_acceptance.py --quick    # 4 blocks, d_model=64 (a few minutes)

The parent measures plain Inductor's peak P in a child process, then runs one fresh child process
per budget (`--variant memcompile --budget N`), so no compile cache, config or dynamo state leaks
between variants. In each memcompile child plain Inductor is compiled first in the same process and the two are timed step by step, interleaved, so the step-time
ratio compares like with like on a noisy shared machine.

Compile caches: the parent gives all children one fresh TORCHINDUCTOR_CACHE_DIR. The plain child
compiles cold (its first-call time is the reference for compile ratios) and fills the cache; the
memcompile children get plain Inductor back from that cache (fast) and compile memcompile with the
FX-graph and AOT-autograd caches switched off (no plan reused from disk; the C++ kernel cache of the
run is shared, so memcompile's compile time is "warm kernels" for kernels identical to plain's).

Per budget: measured peak (memcompile.measure_peak: tensors live at start + allocator peak rise),
predicted peak (plans[0]), max abs / relative gradient difference against eager PyTorch (same
weights, same input, every parameter), step time (median of forward+backward steps, alternating
with plain Inductor), solve time, compile time (first forward+backward call).
Writes benchmarks/results/budget_acceptance.json and .md (or *_quick.* with --quick).
"""

from __future__ import annotations

import os

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from models import WithMSELoss, make_gpt, make_input, make_target  # noqa: E402

RESULTS = HERE / "results"
FRACTIONS = (0.9, 0.7, 0.5)
MARK = "ACCEPTANCE_JSON:"
CONFIGS = {
    "full": dict(n_blocks=8, d_model=128, n_heads=4, batch=8, seq=128),
    "quick": dict(n_blocks=4, d_model=64, n_heads=4, batch=4, seq=64),
}


# ------------------------------------------------------------------------------------------------
# child side


def fresh(cfg: dict) -> WithMSELoss:
    return WithMSELoss(make_gpt(cfg["n_blocks"], cfg["d_model"], cfg["n_heads"], seed=0))


def grads_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def grad_diff(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict:
    """max |got - ref| over all parameters, and max over parameters of max|got - ref| / max|ref|."""
    max_abs = max_rel = 0.0
    worst = ""
    for name, r in ref.items():
        d = (got[name] - r).abs().max().item()
        rel = d / max(r.abs().max().item(), 1e-30)
        if d > max_abs:
            max_abs, worst = d, name
        max_rel = max(max_rel, rel)
    return {"grad_max_abs_diff": max_abs, "grad_max_rel_diff": max_rel, "grad_worst_param": worst}


def first_step(cm, model, x, target) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    cm(x, target).backward()
    elapsed = time.perf_counter() - t0
    g = grads_of(model)
    model.zero_grad(set_to_none=True)
    return elapsed, g


def measured_peak(cm, model, x, target) -> int:
    import memcompile

    model.zero_grad(set_to_none=True)
    r = memcompile.measure_peak(lambda: cm(x, target).backward(), live_at_start=[model, x, target])
    model.zero_grad(set_to_none=True)
    return r.peak_bytes


def timed_steps(runs: list, n: int) -> list[float]:
    """Median forward+backward time of each (cm, model), interleaving them step by step."""
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(n):
        for i, (cm, model) in enumerate(runs):
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            cm(x_g, t_g).backward()
            times[i].append(time.perf_counter() - t0)
    for _, model in runs:
        model.zero_grad(set_to_none=True)
    return [statistics.median(t) for t in times]


def child(args: argparse.Namespace) -> dict:
    global x_g, t_g
    import memcompile

    torch.set_num_threads(args.threads)
    cfg = CONFIGS["quick" if args.quick else "full"]
    x_g = x = make_input(cfg["batch"], cfg["seq"], cfg["d_model"], seed=1)
    t_g = target = make_target(cfg["batch"], cfg["seq"], cfg["d_model"], seed=2)
    rec: dict = {"variant": args.variant, **cfg, "threads": torch.get_num_threads(),
                 "torch": torch.__version__}

    eager = fresh(cfg)
    eager(x, target).backward()
    ref = grads_of(eager)
    del eager
    rec["n_params"] = sum(g.numel() for g in ref.values())

    plain_model = fresh(cfg)
    plain = torch.compile(plain_model)
    plain_compile_s, plain_grads = first_step(plain, plain_model, x, target)
    rec["plain_compile_s" if args.variant == "plain" else "plain_compile_s_cached"] = plain_compile_s
    rec["plain_peak_bytes"] = measured_peak(plain, plain_model, x, target)
    rec.update({f"plain_{k}": v for k, v in grad_diff(plain_grads, ref).items()})

    if args.variant == "plain":
        (rec["plain_step_s"],) = timed_steps([(plain, plain_model)], args.steps)
        return rec

    budget = args.budget
    rec.update(budget_bytes=budget, budget_fraction=args.fraction, time_limit_s=args.time_limit)
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = False
    functorch_config.enable_autograd_cache = False
    plain_compile_s = args.plain_compile_s
    mc_model = fresh(cfg)
    backend = memcompile.budget(budget, time_limit_s=args.time_limit)
    mc = torch.compile(mc_model, backend=backend)
    try:
        compile_s, mc_grads = first_step(mc, mc_model, x, target)
    except memcompile.InfeasibleBudgetError as e:
        rec.update(status="infeasible", min_feasible_bytes=e.min_feasible_bytes,
                   min_feasible_fraction_of_plain=e.min_feasible_bytes / args.plain_peak,
                   message=str(e), n_plans=len(backend.plans))
        (rec["plain_step_s"],) = timed_steps([(plain, plain_model)], args.steps)
        return rec
    rec["status"] = "ok"
    rec["compile_s"] = compile_s
    rec["compile_ratio_vs_plain"] = compile_s / plain_compile_s
    rec.update(grad_diff(mc_grads, ref))
    rec["measured_peak_bytes"] = peak = measured_peak(mc, mc_model, x, target)
    rec["measured_le_budget"] = peak <= budget
    rec["measured_over_budget_bytes"] = max(0, peak - budget)
    rec["n_plans"] = len(backend.plans)
    if backend.plans:
        p = backend.plans[0]
        rec.update(predicted_peak_bytes=p.predicted_peak_bytes,
                   predicted_peak_before_bytes=p.predicted_peak_before_bytes,
                   predicted_over_measured=p.predicted_peak_bytes / peak,
                   solve_s=p.solve_s, solver_status=p.solver_status, added_time_s=p.added_time_s,
                   choices=p.choices(), plan_summary=p.summary())
    rec["plain_step_s"], rec["step_s"] = timed_steps([(plain, plain_model), (mc, mc_model)], args.steps)
    rec["step_ratio_vs_plain"] = rec["step_s"] / rec["plain_step_s"]
    return rec


# ------------------------------------------------------------------------------------------------
# parent side


def run_child(args: argparse.Namespace, extra: list[str]) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--steps", str(args.steps),
           "--threads", str(args.threads), "--time-limit", str(args.time_limit), *extra]
    if args.quick:
        cmd.append("--quick")
    t0 = time.perf_counter()
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=args.cache_dir)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.child_timeout, env=env)
    wall = time.perf_counter() - t0
    for line in proc.stdout.splitlines():
        if line.startswith(MARK):
            rec = json.loads(line[len(MARK):])
            rec["child_wall_s"] = wall
            return rec
    return {"variant": " ".join(extra), "status": "crashed", "returncode": proc.returncode,
            "child_wall_s": wall, "stderr_tail": proc.stderr[-4000:], "stdout_tail": proc.stdout[-2000:]}


def mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def markdown(rows: list[dict], plain: dict) -> str:
    cfg = (f"GPT {plain.get('n_blocks')} blocks, d_model={plain.get('d_model')}, heads={plain.get('n_heads')}, "
           f"input ({plain.get('batch')}, {plain.get('seq')}, {plain.get('d_model')}) fp32, MSE loss, "
           f"{plain.get('n_params', 0):,} params; torch {plain.get('torch')} CPU, {plain.get('threads')} threads")
    out = [
        f"# memcompile budget acceptance\n\n{cfg}.\n",
        f"Plain Inductor: measured peak P = {plain['plain_peak_bytes']:,} B ({mib(plain['plain_peak_bytes'])} MiB), "
        f"step {plain['plain_step_s'] * 1e3:.1f} ms, first call (compile) {plain['plain_compile_s']:.1f} s, "
        f"grad max abs diff vs eager {plain['plain_grad_max_abs_diff']:.2e}.\n",
        "| budget | budget MiB | status | measured MiB | <= budget | predicted MiB | pred/meas | plans "
        "| grad max abs | grad max rel | step ms | step ratio | solve s | solver | compile s | compile ratio |",
        "| --- " * 16 + "|",
    ]
    for r in rows:
        name = r.get("label", "?")
        if r.get("status") == "ok":
            out.append(
                f"| {name} | {mib(r['budget_bytes'])} | ok | {mib(r['measured_peak_bytes'])} | "
                f"{'yes' if r['measured_le_budget'] else '**NO**'} | {mib(r.get('predicted_peak_bytes'))} | "
                f"{r.get('predicted_over_measured', float('nan')):.3f} | {r['n_plans']} | "
                f"{r['grad_max_abs_diff']:.2e} | {r['grad_max_rel_diff']:.2e} | {r['step_s'] * 1e3:.1f} | "
                f"{r['step_ratio_vs_plain']:.2f} | {r.get('solve_s', float('nan')):.2f} | {r.get('solver_status', '-')} | "
                f"{r['compile_s']:.1f} | {r['compile_ratio_vs_plain']:.2f} |")
        elif r.get("status") == "infeasible":
            out.append(
                f"| {name} | {mib(r['budget_bytes'])} | infeasible: min_feasible {mib(r['min_feasible_bytes'])} MiB "
                f"({r['min_feasible_fraction_of_plain']:.3f} P) |" + " - |" * 13)
        else:
            out.append(f"| {name} | {mib(r.get('budget_bytes'))} | {r.get('status')} (rc {r.get('returncode')}) |"
                       + " - |" * 13)
    out.append(
        "\nmeasured = memcompile.measure_peak (tensors live at start: params, input, target; + allocator peak rise"
        " during one forward+backward after a warm-up step, grads set to None). predicted = plans[0]."
        "predicted_peak_bytes. grad diffs vs eager PyTorch, same weights and input, every parameter"
        " (rel = max over params of max|diff| / max|eager grad|). step = median forward+backward time,"
        " interleaved with plain Inductor in the same process (ratio = memcompile / plain). compile = wall time"
        " of the first forward+backward call (FX-graph/autograd caches off, C++ kernel cache shared within the"
        " run); ratio vs plain Inductor's cold first call in the plain child. The machine (2 cores) was shared"
        " with other jobs, so times are noisy.")
    return "\n".join(out)


def parent(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    print(f"[{time.perf_counter() - t_start:6.0f}s] plain Inductor (child process) ...", flush=True)
    plain = run_child(args, ["--variant", "plain"])
    if plain.get("status") == "crashed":
        print(plain["stderr_tail"])
        return 2
    P = plain["plain_peak_bytes"]
    print(f"[{time.perf_counter() - t_start:6.0f}s] P = {P:,} B, step {plain['plain_step_s'] * 1e3:.1f} ms, "
          f"compile {plain['plain_compile_s']:.1f} s", flush=True)
    rows: list[dict] = []
    budgets = [(f"{f}P", f, int(f * P)) for f in FRACTIONS]
    extra_min_feasible = args.min_feasible
    while budgets:
        label, frac, budget = budgets.pop(0)
        print(f"[{time.perf_counter() - t_start:6.0f}s] memcompile at {label} = {budget:,} B ...", flush=True)
        rec = run_child(args, ["--variant", "memcompile", "--budget", str(budget), "--fraction", str(frac),
                               "--plain-peak", str(P), "--plain-compile-s", str(plain["plain_compile_s"])])
        rec["label"], rec["budget_bytes"], rec["budget_fraction"] = label, budget, frac
        rows.append(rec)
        st = rec.get("status")
        if st == "ok":
            print(f"    measured {rec['measured_peak_bytes']:,} B (<= budget: {rec['measured_le_budget']}), "
                  f"predicted {rec.get('predicted_peak_bytes')}, grad max abs {rec['grad_max_abs_diff']:.2e}, "
                  f"step ratio {rec['step_ratio_vs_plain']:.2f}, compile {rec['compile_s']:.1f} s", flush=True)
        elif st == "infeasible":
            print(f"    infeasible; min_feasible_bytes = {rec['min_feasible_bytes']:,} "
                  f"({rec['min_feasible_fraction_of_plain']:.3f} P)", flush=True)
            if extra_min_feasible:
                extra_min_feasible = False
                m = rec["min_feasible_bytes"]
                budgets.append(("min_feasible", m / P, m))
        else:
            print(f"    CRASHED rc={rec.get('returncode')}\n{rec.get('stderr_tail', '')[-2000:]}", flush=True)
    suffix = "_quick" if args.quick else ""
    RESULTS.mkdir(parents=True, exist_ok=True)
    plain["label"] = "plain"
    records = [plain, *rows]
    (RESULTS / f"budget_acceptance{suffix}.json").write_text(json.dumps(records, indent=2) + "\n")
    md = markdown(rows, plain)
    (RESULTS / f"budget_acceptance{suffix}.md").write_text(md + "\n")
    print()
    print(md)
    print(f"\ntotal {time.perf_counter() - t_start:.0f} s; wrote {RESULTS / f'budget_acceptance{suffix}.json'} and .md")
    bad = [r for r in rows if r.get("status") == "crashed" or (r.get("status") == "ok" and not r["measured_le_budget"])]
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="4 blocks, d_model=64, batch 4, seq 64")
    ap.add_argument("--steps", type=int, default=7, help="timed steps per variant (median)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--time-limit", type=float, default=10.0, help="memcompile solver time_limit_s")
    ap.add_argument("--child-timeout", type=float, default=900.0)
    ap.add_argument("--no-min-feasible", dest="min_feasible", action="store_false",
                    help="do not add a run at the first infeasible budget's min_feasible_bytes")
    ap.add_argument("--variant", choices=("plain", "memcompile"), help=argparse.SUPPRESS)
    ap.add_argument("--budget", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--fraction", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--plain-peak", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--plain-compile-s", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.variant is None:
        with tempfile.TemporaryDirectory(prefix="memcompile_acceptance_inductor_") as d:
            args.cache_dir = d
            return parent(args)
    try:
        rec = child(args)
    except Exception as e:  # a crash inside memcompile/torch: report it, parent records it
        rec = {"variant": args.variant, "status": "crashed", "error": f"{type(e).__name__}: {e}",
               "traceback": traceback.format_exc()[-6000:]}
    print(MARK + json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
