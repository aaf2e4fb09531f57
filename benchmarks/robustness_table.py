"""Graph breaks, per-block compilation and dynamic shapes under one step budget: a table.

    OMP_NUM_THREADS=1 python benchmarks/robustness_table.py      # ~5-10 min on 2 shared cores

codegen="aot_eager" (the FX interpreter frees values as the liveness pass models). For each
scenario: whether gradients equal eager PyTorch's (rtol 1e-4, atol 1e-5), the predicted peak
(graph breaks: the step ledger's max over regions of own peak + what the others hold; dynamic
shapes: the plan covering that size), the measured peak of the whole step
(memcompile.measure_peak, live at start = model + input), and the budget. Writes
benchmarks/results/robustness.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch
import torch.nn as nn

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import memcompile  # noqa: E402
from models import WithLoss, build  # noqa: E402
from test_graph_breaks import Dense, _build, _unconstrained_step_peak, _warm_up  # noqa: E402

TOL = dict(rtol=1e-4, atol=1e-5)


def _grads(params, x, fn):
    for p in params:
        p.grad = None
    x.grad = None
    fn(x).backward()
    return [p.grad.clone() for p in params] + [x.grad.clone()]


def _match(a, b) -> bool:
    return all(torch.allclose(u, v, **TOL) for u, v in zip(a, b))


def graph_breaks(name, arch, depth, batch, breaks, below):
    model, x = _build(arch, depth, 32, batch, "tanh", breaks, torch.float32)
    regions = len(breaks) + 1
    high = _unconstrained_step_peak(model, x, regions)
    rows = []
    for cut in below:
        budget = high - cut
        torch.compiler.reset()
        backend = memcompile.budget(budget, codegen="aot_eager", time_limit_s=2)
        compiled = torch.compile(model, backend=backend)
        expected = _grads(list(model.parameters()), x, model)
        try:
            steps = _warm_up(backend, compiled, model, x, regions + 3)
        except memcompile.InfeasibleBudgetError as error:
            rows.append(dict(scenario=f"{name}, budget = unconstrained - {cut // 1024} KiB", grads_match=None,
                             predicted=None, measured=None, budget=budget,
                             note=f"InfeasibleBudgetError, min_feasible_bytes={error.min_feasible_bytes}"))
            continue
        got = _grads(list(model.parameters()), x, compiled)
        model.zero_grad(set_to_none=True)
        x.grad = None
        measured = memcompile.measure_peak(lambda: compiled(x).backward(), live_at_start=[model, x])
        recomputed = sum(d.choice == "recompute" for p in backend.plans[-regions:] for d in p.decisions)
        rows.append(dict(scenario=f"{name}, budget = unconstrained - {cut // 1024} KiB", grads_match=_match(expected, got),
                         predicted=backend.predicted_step_peak(), measured=measured.peak_bytes, budget=budget,
                         note=f"{regions} regions, converged in {steps} steps, {len(backend.plans)} plans, "
                              f"{recomputed} recomputed"))
    torch.compiler.reset()
    return rows


def per_block():
    torch.manual_seed(0)
    blocks = nn.ModuleList(Dense(32, "gelu") for _ in range(4))
    x = torch.randn(128, 32, requires_grad=True)

    def run(bs, inp):
        for b in bs:
            inp = b(inp)
        return inp.pow(2).mean()

    backend = memcompile.budget(10**12, codegen="aot_eager", time_limit_s=2)
    compiled = [torch.compile(b, backend=backend) for b in blocks]
    for _ in range(4):
        _grads(list(blocks.parameters()), x, lambda i: run(compiled, i))
    high = backend.predicted_step_peak()
    torch.compiler.reset()
    budget = high - 32768
    backend = memcompile.budget(budget, codegen="aot_eager", time_limit_s=2)
    compiled = [torch.compile(b, backend=backend) for b in blocks]
    expected = _grads(list(blocks.parameters()), x, lambda i: run(blocks, i))
    for _ in range(6):
        got = _grads(list(blocks.parameters()), x, lambda i: run(compiled, i))
    blocks.zero_grad(set_to_none=True)
    x.grad = None
    measured = memcompile.measure_peak(lambda: run(compiled, x).backward(), live_at_start=[blocks, x])
    torch.compiler.reset()
    return [dict(scenario="4 blocks compiled one by one (1 graph, 4 positions)", grads_match=_match(expected, got),
                 predicted=backend.predicted_step_peak(), measured=measured.peak_bytes, budget=budget,
                 note="eager loss (pow/mean, 32 KiB) outside the regions is in the measured peak only")]


def dynamic(name, arch, lengths, dynamic_flag):
    model, _ = build(arch, 16, 2, 2)

    def make(n):
        torch.manual_seed(n)
        shape = (2, n, 16) if arch == "attention" else (n, 16)
        return torch.randn(*shape, requires_grad=True)

    big = make(max(lengths))
    backend = memcompile.budget(10**12, codegen="aot_eager", time_limit_s=2)
    torch.compile(WithLoss(model), backend=backend, dynamic=False)(big).backward()
    high = backend.plans[-1].predicted_peak_before_bytes
    torch.compiler.reset()
    try:
        torch.compile(WithLoss(model), backend=memcompile.budget(1, codegen="aot_eager", time_limit_s=2),
                      dynamic=False)(big)
    except memcompile.InfeasibleBudgetError as error:
        low = error.min_feasible_bytes
    torch.compiler.reset()
    budget = (low + high) // 2
    backend = memcompile.budget(budget, codegen="aot_eager", time_limit_s=2)
    compiled = torch.compile(WithLoss(model), backend=backend, dynamic=dynamic_flag)
    rows = []
    for n in lengths:
        x = make(n)
        expected = _grads(list(model.parameters()), x, WithLoss(model))
        got = _grads(list(model.parameters()), x, compiled)
        model.zero_grad(set_to_none=True)
        x.grad = None
        measured = memcompile.measure_peak(lambda: compiled(x).backward(), live_at_start=[model, x])
        plan = backend.plans[-1]
        rows.append(dict(scenario=f"{name}, size {n}", grads_match=_match(expected, got),
                         predicted=plan.predicted_peak_bytes, measured=measured.peak_bytes, budget=budget,
                         note=f"plan covers {dict(plan.size_bounds) or 'static'}; {len(backend.plans)} plans so far"))
    torch.compiler.reset()
    return rows


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    rows = []
    rows += graph_breaks("dense x4, 3 graph breaks", "dense", 4, 256, frozenset({0, 1, 2}), [0, 32768, 65536, 131072])
    rows += graph_breaks("attention x3, break after block 0", "attention", 3, 16, frozenset({0}), [0, 16384, 65536])
    rows += per_block()
    rows += dynamic("attention dynamic=True, seq len", "attention", [8, 32, 16, 24], True)
    rows += dynamic("mlp automatic dynamic, batch", "mlp", [16, 48, 32, 64], None)
    out = ROOT / "benchmarks" / "results"
    (out / "robustness.json").write_text(json.dumps(rows, indent=1))
    lines = ["| scenario | gradients match | predicted peak | measured peak | budget | note |", "|---|---|---|---|---|---|"]
    for r in rows:
        fmt = lambda v: "-" if v is None else f"{v:,}"  # noqa: E731
        lines.append(f"| {r['scenario']} | {r['grads_match']} | {fmt(r['predicted'])} | {fmt(r['measured'])} | "
                     f"{fmt(r['budget'])} | {r['note']} |")
    (out / "robustness.md").write_text("# Robustness: graph breaks, per-block, dynamic shapes (aot_eager, bytes)\n\n"
                                       + "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
