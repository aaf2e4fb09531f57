"""memcompile demo: train a small GPT under half of plain Inductor's peak memory.

    python benchmarks/demo.py          (or: make demo)

1. measures the peak tensor bytes of one forward+backward step with plain Inductor (P);
2. compiles an identical copy with memcompile.budget(0.5 * P) (or the smallest feasible budget
   that memcompile reports, when 0.5 * P is impossible);
3. trains both for a few SGD steps on the same data and compares the losses;
4. prints the plan, the measured peak against the budget and the step times.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import memcompile  # noqa: E402
from memcompile.plan import format_bytes  # noqa: E402
from models import WithMSELoss, make_gpt, make_input, make_target  # noqa: E402

N_BLOCKS, D_MODEL, N_HEADS, BATCH, SEQ = 4, 128, 4, 8, 128
TRAIN_STEPS, TIMED_STEPS, LR = 5, 7, 0.05


def fresh_model() -> WithMSELoss:
    return WithMSELoss(make_gpt(N_BLOCKS, D_MODEL, N_HEADS, seed=0))


def first_step(cm, model, x, target) -> float:
    """Warm-up (compiling) forward+backward; returns its wall time."""
    t0 = time.perf_counter()
    cm(x, target).backward()
    elapsed = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    return elapsed


def peak_of_step(cm, model, x, target) -> int:
    model.zero_grad(set_to_none=True)
    r = memcompile.measure_peak(lambda: cm(x, target).backward(), live_at_start=[model, x, target])
    model.zero_grad(set_to_none=True)
    return r.peak_bytes


def train(cm, model, batches) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for x, target in batches:
        opt.zero_grad(set_to_none=True)
        loss = cm(x, target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main() -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    torch.set_num_threads(2)
    x = make_input(BATCH, SEQ, D_MODEL, seed=1)
    target = make_target(BATCH, SEQ, D_MODEL, seed=2)
    print(f"model: GPT, {N_BLOCKS} pre-LN blocks, d_model={D_MODEL}, heads={N_HEADS}, "
          f"input ({BATCH}, {SEQ}, {D_MODEL}) float32, MSE loss; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")

    # -- plain Inductor ------------------------------------------------------------------------
    plain_model = fresh_model()
    n_params = sum(p.numel() for p in plain_model.parameters())
    print(f"parameters: {n_params:,} ({format_bytes(4 * n_params)})")
    plain = torch.compile(plain_model)
    plain_compile_s = first_step(plain, plain_model, x, target)
    plain_peak = peak_of_step(plain, plain_model, x, target)
    print(f"plain Inductor: first step (compile) {plain_compile_s:.1f} s, "
          f"measured peak P = {plain_peak:,} B ({format_bytes(plain_peak)})")

    # -- memcompile at 0.5 P ---------------------------------------------------------------------
    budget = int(0.5 * plain_peak)
    mc_model = fresh_model()
    backend = memcompile.budget(budget)
    mc = torch.compile(mc_model, backend=backend)
    try:
        mc_compile_s = first_step(mc, mc_model, x, target)
        print(f"memcompile budget: 0.5 * P = {budget:,} B ({format_bytes(budget)})")
    except memcompile.InfeasibleBudgetError as e:
        print(f"memcompile: 0.5 * P = {budget:,} B is infeasible for this model; "
              f"smallest feasible budget reported: {e.min_feasible_bytes:,} B "
              f"({format_bytes(e.min_feasible_bytes)} = {e.min_feasible_bytes / plain_peak:.2f} P)")
        print(f"memcompile budget: USING min_feasible_bytes = {e.min_feasible_bytes:,} B instead of 0.5 * P")
        budget = e.min_feasible_bytes
        mc_model = fresh_model()
        backend = memcompile.budget(budget)
        mc = torch.compile(mc_model, backend=backend)
        mc_compile_s = first_step(mc, mc_model, x, target)
    mc_peak = peak_of_step(mc, mc_model, x, target)

    print("\n== memcompile.dump(backend) ==")
    print(memcompile.dump(backend))
    picture = Path(__file__).resolve().parent / "results" / "demo_plan.html"
    picture.parent.mkdir(exist_ok=True)
    memcompile.dump(backend, format="html", path=str(picture))
    print(f"live-memory picture (before/after the plan, budget line, peak): {picture}")
    print()
    if not backend.plans:
        print("WARNING: backend.plans is empty (no graph went through the memcompile partitioner)")
    verdict = "OK (<= budget)" if mc_peak <= budget else "OVER BUDGET"
    print(f"memcompile: first step (compile) {mc_compile_s:.1f} s ({mc_compile_s / plain_compile_s:.2f}x plain)")
    print(f"measured peak plain Inductor : {plain_peak:>12,} B ({format_bytes(plain_peak)})")
    print(f"budget                       : {budget:>12,} B ({format_bytes(budget)}, {budget / plain_peak:.2f} P)")
    if backend.plans:
        print(f"predicted peak (plan 0 of {len(backend.plans)}) : {backend.plans[0].predicted_peak_bytes:>12,} B")
    print(f"measured peak memcompile     : {mc_peak:>12,} B ({format_bytes(mc_peak)}, "
          f"{mc_peak / plain_peak:.2f} P) -> {verdict}")

    # -- training: identical weights and data ----------------------------------------------------
    batches = [(make_input(BATCH, SEQ, D_MODEL, seed=100 + i), make_target(BATCH, SEQ, D_MODEL, seed=200 + i))
               for i in range(TRAIN_STEPS)]
    plain_losses = train(plain, plain_model, batches)
    mc_losses = train(mc, mc_model, batches)
    print(f"\n== {TRAIN_STEPS} SGD steps (lr={LR}) from identical weights and data ==")
    print(f"{'step':>4}  {'plain Inductor':>16}  {'memcompile':>16}  {'abs diff':>10}")
    for i, (a, b) in enumerate(zip(plain_losses, mc_losses)):
        print(f"{i:>4}  {a:>16.8f}  {b:>16.8f}  {abs(a - b):>10.3g}")
    max_diff = max(abs(a - b) for a, b in zip(plain_losses, mc_losses))
    print(f"loss max abs diff: {max_diff:.3g}")
    max_wdiff = max((p - q).abs().max().item() for p, q in zip(plain_model.parameters(), mc_model.parameters()))
    print(f"weights after training, max abs diff: {max_wdiff:.3g}")

    # -- step time: forward+backward, alternating the two so machine noise hits both ----------------
    times: dict[str, list[float]] = {"plain": [], "memcompile": []}
    for _ in range(TIMED_STEPS):
        for name, cm, model in (("plain", plain, plain_model), ("memcompile", mc, mc_model)):
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            cm(x, target).backward()
            times[name].append(time.perf_counter() - t0)
    tp_, tm = statistics.median(times["plain"]), statistics.median(times["memcompile"])
    print(f"\nstep time (forward+backward, median of {TIMED_STEPS}): plain Inductor {tp_ * 1e3:.1f} ms, "
          f"memcompile {tm * 1e3:.1f} ms, ratio {tm / tp_:.2f}x")
    ok = mc_peak <= budget and max_diff < 1e-3
    print(f"\nRESULT: {'PASS' if ok else 'FAIL'} (measured peak <= budget: {mc_peak <= budget}; "
          f"losses match within 1e-3: {max_diff < 1e-3})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
