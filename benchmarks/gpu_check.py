"""One short device check: is the plan honoured on a real accelerator, and what does it cost?

On CUDA, in one run (a few minutes):
1. The host link: pinned device->host and host->device copy bandwidth (the offload cost model's input).
2. The asynchronous offload path (memcompile/transfer_ops.py) under Inductor, on a float32
   stack where offloading pays: measured peak (max_memory_allocated) <= budget, gradients equal
   to the keep-all plan's, no copy left in flight, the share of copy time that overlapped compute.
3. A GPT stack: plain Inductor, memcompile keep-all, and for each variant (recompute only /
   + offload / + offload with the link assumed free, which makes the solver offload as much as
   memory allows: a stress test of the async copies / + int8) budgets from its smallest one to
   keep-all's predicted peak. Per row: budget, predicted and measured peak, step time (median
   of 5 after warm-up) as a ratio to plain Inductor, what the plan chose, gradient error
   against keep-all.
Without CUDA it runs the same on the CPU in a degraded mode: offload off (no separate host
memory), a smaller model, peak from the CPU allocator events.

    python benchmarks/gpu_check.py [--out DIR] [--blocks N]

Rows are printed as they finish and appended to DIR/gpu_check.jsonl, so a run cut short keeps
what it measured.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
import traceback

import torch
import torch.nn as nn

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import memcompile  # noqa: E402
import memcompile.planner  # noqa: E402
from memcompile import transfer_ops  # noqa: E402
from models import WithMSELoss, make_gpt, make_input, make_target  # noqa: E402

MIB = 2**20
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def peak_of(step, live) -> int:
    """Peak bytes of one step: max_memory_allocated on CUDA (everything allocated, parameters
    included), the allocator events on the CPU."""
    if CUDA:
        sync()
        torch.cuda.reset_peak_memory_stats()
        step()
        sync()
        return torch.cuda.max_memory_allocated()
    return memcompile.measure_peak(step, live_at_start=live).peak_bytes


def host_link() -> dict:
    """Pinned copy bandwidth each way, GB/s (256 MiB, median of 5)."""
    if not CUDA:
        return {}
    dev = torch.randn(64 * MIB, device="cuda")
    host = torch.empty(dev.shape, pin_memory=True)
    result = {}
    for name, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
        times = []
        for _ in range(6):
            sync()
            began = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            sync()
            times.append(time.perf_counter() - began)
        result[name] = dev.nbytes / statistics.median(times[1:]) / 1e9
    return result


def record(out: pathlib.Path | None, row: dict) -> None:
    if out is not None:
        with open(out / "gpu_check.jsonl", "a") as f:
            f.write(json.dumps(row, default=str) + "\n")


class Gated(nn.Module):
    """tanh/sigmoid gating over a linear layer: activations cheap to store, several readers."""

    def __init__(self, d: int):
        super().__init__()
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(d, d)

    def forward(self, x):
        a, b = self.up(x).chunk(2, dim=-1)
        g = torch.tanh(a) * torch.sigmoid(b)
        return x + self.down(g * g)


class Summed(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x).sum()


def grads_of(model: nn.Module, step) -> list[torch.Tensor]:
    """Gradients after one step, copied to the host: kept on the device they would count in every
    later peak measured (the first run of this check measured up to three sets too many)."""
    model.zero_grad(set_to_none=True)
    step()
    grads = [p.grad.detach().to("cpu", copy=True) for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def relative_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max(float((g.float() - w.float()).norm() / w.float().norm().clamp_min(1e-30)) for g, w in zip(got, want))


def copy_overlap(step) -> dict:
    """From a CUDA trace of one step: how much of the host<->device copy time ran while some
    compute kernel ran too (the asynchronous copies' point)."""
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as trace:
        step()
        sync()
    copies, kernels = [], []
    for event in trace.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        span = (event.time_range.start, event.time_range.end)
        (copies if "Memcpy" in event.name and ("DtoH" in event.name or "HtoD" in event.name) else kernels).append(span)
    kernels.sort()
    merged: list[list[float]] = []
    for start, end in kernels:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    total = sum(end - start for start, end in copies)
    hidden = sum(max(0.0, min(end, m_end) - max(start, m_start)) for start, end in copies for m_start, m_end in merged)
    everything = copies + kernels
    return {"copies": len(copies), "copy_ms": total / 1e3, "overlapped": hidden / total if total else 0.0,
            "step_ms": (max(e for _, e in everything) - min(s for s, _ in everything)) / 1e3 if everything else 0.0}


def offload_totals(plan) -> dict:
    """What the plan moves over the link and what the solver thought it costs: with the trace's
    copy time this tells slow copies (bytes / copy time below the link) from exposed ones."""
    offloaded = [d for d in plan.decisions if d.choice == "offload"] if plan is not None else []
    return {"offloaded_bytes": sum(d.nbytes for d in offloaded),
            "offload_estimated_s": sum(d.time_cost_s for d in offloaded)} if offloaded else {}


def memory_snapshot(step, out: pathlib.Path, index: int) -> str:
    """One step under the allocator's history recorder (Python stacks, so each block names the
    line of Inductor's generated code that allocated it): read offline where the measured peak
    exceeded the prediction."""
    path = out / f"snapshot_{index}.pickle"
    try:
        sync()
        torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
        step()
        sync()
        torch.cuda.memory._dump_snapshot(str(path))
    except Exception:
        traceback.print_exc()
        return ""
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return path.name


def offload_correctness(out) -> dict:
    """Async offload on a gated float32 stack wide enough (d=4096) that a float32 matmul outlasts
    copying its output over the host link, so the solver offloads for real: fits, exact, no copy
    left in flight, and how much of the copying ran behind compute."""
    torch.manual_seed(0)
    d, rows, depth = (4096, 8192, 6) if CUDA else (64, 512, 6)
    model = nn.Sequential(*[Gated(d) for _ in range(depth)]).to(DEVICE)
    x = torch.randn(rows, d, device=DEVICE)

    def compiled(limit, **options):
        torch.compiler.reset()
        backend = memcompile.budget(limit, time_limit_s=5, **options)
        return backend, torch.compile(Summed(model), backend=backend)

    keep_backend, keep_step = compiled(10**14)
    want = grads_of(model, lambda: keep_step(x).backward())
    live = [x, *model.parameters()]
    model.zero_grad(set_to_none=True)
    keep_peak = peak_of(lambda: keep_step(x).backward(), live)
    limit = int(0.6 * keep_peak)
    # The CPU has no link: there the "host" copies stay in memory and cost what a free link would.
    backend, step = compiled(limit, offload=True, **({} if CUDA else {"host_link_gbps": 10_000}))
    got = grads_of(model, lambda: step(x).backward())
    model.zero_grad(set_to_none=True)
    peak = peak_of(lambda: step(x).backward(), live)
    plan = backend.plans[0]
    row = {"check": "async offload", "budget": limit, "keep_all_peak": keep_peak, "peak": peak,
           "fits": peak <= limit, "choices": plan.choices(), "grad_rel_err": relative_error(got, want),
           "in_flight_after": transfer_ops.copies_in_flight()}
    if CUDA:
        try:
            model.zero_grad(set_to_none=True)
            row.update(copy_overlap(lambda: step(x).backward()))
        except Exception:
            traceback.print_exc()
    record(out, row)
    print(f"async offload: budget {limit / MIB:.1f} MiB, measured {peak / MIB:.1f} MiB "
          f"({'fits' if row['fits'] else 'OVER'}; keep-all {keep_peak / MIB:.1f}), choices {row['choices']}, "
          f"grad rel err vs keep-all {row['grad_rel_err']:.2e}, copies in flight after {row['in_flight_after']}",
          flush=True)
    if "copy_ms" in row:
        print(f"  copies: {row['copies']} taking {row['copy_ms']:.2f} ms, {row['overlapped']:.0%} of it while "
              f"a compute kernel ran; step {row['step_ms']:.2f} ms", flush=True)
    return row


VARIANTS = {  # name -> options; offload ones only where the device has separate memory
    "recompute only": {"offload": False},
    "+ offload": {"offload": True},
    "+ offload (free link)": {"offload": True, "host_link_gbps": 10_000},
    "+ int8": {"offload": False, "quantize": "int8"},
}


def smallest_budget(model, x, y, options) -> int:
    """min_feasible_bytes from compiling at an impossible budget (planning only: no code is made)."""
    torch.compiler.reset()
    step = torch.compile(WithMSELoss(model), backend=memcompile.budget(1, time_limit_s=5, **options))
    try:
        step(x, y)
    except memcompile.InfeasibleBudgetError as error:
        return error.min_feasible_bytes
    raise RuntimeError("a budget of 1 byte was accepted")


def gpt_table(out, blocks: int, positions: tuple[float, ...], variants: list[str], dtype: torch.dtype) -> list[dict]:
    """Budgets at `positions` between each variant's smallest budget (0) and the keep-all plan's
    predicted peak (1), so every row is feasible and the ladder shows the trade."""
    d, heads, batch, seq = (1024, 16, 8, 1024) if CUDA else (128, 4, 8, 128)
    model = make_gpt(n_blocks=blocks, d_model=d, n_heads=heads).to(DEVICE, dtype)
    x = make_input(batch, seq, d).to(DEVICE, dtype)
    y = make_target(batch, seq, d).to(DEVICE, dtype)
    live = [x, y, *model.parameters()]
    print(f"GPT {blocks}x{d}, {heads} heads, batch {batch}, seq {seq}, {dtype}, "
          f"Inductor-schedule check {'on' if memcompile.planner.FUSION_CHECK else 'off'}", flush=True)

    def measure(backend, overlap: bool = False) -> dict:
        torch.compiler.reset()
        step = torch.compile(WithMSELoss(model), backend=backend)
        began = time.perf_counter()
        try:
            grads = grads_of(model, lambda: step(x, y).backward())
        except memcompile.InfeasibleBudgetError as error:
            return {"feasible": False, "min_feasible": error.min_feasible_bytes}
        compile_s = time.perf_counter() - began
        model.zero_grad(set_to_none=True)
        peak = peak_of(lambda: step(x, y).backward(), live)
        times = []
        for _ in range(6):
            model.zero_grad(set_to_none=True)
            sync()
            began = time.perf_counter()
            step(x, y).backward()
            sync()
            times.append(time.perf_counter() - began)
        forward_peak = None
        if CUDA:  # where the peak is: the forward's alone, then the whole step's
            model.zero_grad(set_to_none=True)
            sync()
            torch.cuda.reset_peak_memory_stats()
            loss = step(x, y)
            sync()
            forward_peak = torch.cuda.max_memory_allocated()
            loss.backward()
            del loss
        plans = getattr(backend, "plans", None) or []
        row = {"feasible": True, "peak": peak, "forward_peak": forward_peak,
               "predicted_peak_phase": plans[0].peak_phase if plans else "", "step_s": statistics.median(times[1:]), "compile_s": compile_s,
               "grads": grads,
               # the step's predicted peak plus what the budget holds outside it (cuBLAS workspaces)
               "predicted": plans[0].predicted_peak_bytes + plans[0].reserve_bytes if plans else None,
               "reserve": plans[0].reserve_bytes if plans else None,
               "choices": plans[0].choices() if plans else {},
               "status": plans[0].solver_status if plans else "",
               "predicted_added_s": plans[0].added_time_s if plans else None,
               "in_flight_after": transfer_ops.copies_in_flight(),
               **offload_totals(plans[0] if plans else None),
               "plan_text": memcompile.dump(backend) if plans else ""}
        if overlap and CUDA and row["choices"].get("offload"):
            try:
                model.zero_grad(set_to_none=True)
                row.update(copy_overlap(lambda: step(x, y).backward()))
            except Exception:
                traceback.print_exc()
        if CUDA and out is not None and row["predicted"] and row["peak"] > row["predicted"]:
            model.zero_grad(set_to_none=True)
            row["snapshot"] = memory_snapshot(lambda: step(x, y).backward(), out, len(list(out.glob("snapshot_*"))))
        return row

    rows = []

    def report(label, limit, r, reference):
        row = {"variant": label, "budget": limit, "dtype": str(dtype), "blocks": blocks,
               **{k: v for k, v in r.items() if k != "grads"}}
        if r.get("feasible") and reference is not None:
            row["grad_rel_err"] = relative_error(r["grads"], reference["grads"])
            row["ratio_vs_plain"] = r["step_s"] / rows[0]["step_s"]
        rows.append(row)
        record(out, row)
        if not r.get("feasible"):
            print(f"{label:<30} {limit / MIB:>8.0f}  {r.get('error') or 'infeasible (smallest budget %.0f MiB)' % (r['min_feasible'] / MIB)}",
                  flush=True)
            return
        fits = "" if limit is None else ("yes" if r["peak"] <= limit else "NO")
        predicted = f"{r['predicted'] / MIB:>8.0f}" if r.get("predicted") else f"{'':>8}"
        overlap = f" copies {r['copy_ms']:.1f} ms, {r['overlapped']:.0%} overlapped" if "copy_ms" in r else ""
        if r.get("offloaded_bytes"):
            overlap += f" offloaded {r['offloaded_bytes'] / MIB:.0f} MiB, estimated {r['offload_estimated_s'] * 1e3:.1f} ms"
        if r.get("snapshot"):
            overlap += f" [over the prediction: {r['snapshot']}]"
        if r.get("forward_peak"):
            overlap += f" [measured forward peak {r['forward_peak'] / MIB:.0f}; predicted peak in {r['predicted_peak_phase']}]"
        print(f"{label:<30} {(limit or 0) / MIB:>8.0f} {predicted} {r['peak'] / MIB:>8.0f} {fits:>4} "
              f"{r['step_s'] * 1e3:>8.2f} {row.get('ratio_vs_plain', 1.0):>6.2f} {row.get('grad_rel_err', 0.0):>8.1e} "
              f"{r['compile_s']:>5.0f}  {r['choices']}{overlap}", flush=True)

    print(f"{'variant':<30} {'budget':>8} {'predict':>8} {'peak':>8} {'<=':>4} {'step ms':>8} {'ratio':>6} "
          f"{'grad err':>8} {'comp':>5}  choices   (MiB; ratio: step time / plain Inductor's)", flush=True)
    plain = measure("inductor")
    report("plain Inductor", None, plain, None)
    keep_all = measure(memcompile.budget(10**14, time_limit_s=5))
    report("memcompile keep-all", None, keep_all, plain)
    for label in variants:
        options = VARIANTS[label]
        if options.get("offload") and not CUDA:
            continue
        try:
            low = smallest_budget(model, x, y, options)
        except Exception as error:  # keep the rest of the table; the traceback says what broke
            traceback.print_exc()
            report(label, 0, {"feasible": False, "error": repr(error)}, keep_all)
            continue
        for position in positions:
            limit = int(low + position * max(0, keep_all["predicted"] - low))
            try:
                r = measure(memcompile.budget(limit, time_limit_s=5, **options), overlap="offload" in label)
            except Exception as error:
                traceback.print_exc()
                r = {"feasible": False, "error": repr(error)}
            report(f"{label} @{position:g}", limit, r, keep_all)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="folder for gpu_check.jsonl")
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--positions", default="0.5,0",
                        help="budgets between each variant's smallest budget (0) and keep-all's prediction (1)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of: {', '.join(VARIANTS)}")
    parser.add_argument("--dtype", default="bfloat16" if CUDA else "float32", choices=["bfloat16", "float32"])
    parser.add_argument("--skip-offload-check", action="store_true")
    args = parser.parse_args()
    out = pathlib.Path(args.out) if args.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name() if CUDA else "CPU, degraded: no offload"
    print(f"device {DEVICE} ({name}), torch {torch.__version__}", flush=True)
    link = host_link()
    if link:
        print(f"host link (pinned, 256 MiB): d2h {link['d2h']:.1f} GB/s, h2d {link['h2d']:.1f} GB/s", flush=True)
        record(out, {"check": "host link GB/s", **link})
    if not args.skip_offload_check:  # on the CPU: the test switch, the same graphs (its "host" is measured)
        try:
            offload_correctness(out)
        except Exception:
            traceback.print_exc()
    positions = tuple(float(f) for f in args.positions.split(","))
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    gpt_table(out, args.blocks, positions, variants, getattr(torch, args.dtype))


if __name__ == "__main__":
    main()
