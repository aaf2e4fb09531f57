"""PyTorch's own activation-budget cases (test/functorch/test_ac.py: a matmul chain, uneven
matmuls, attention against linear), written anew: for each, the step peak PyTorch's partition
measures at activation_memory_budget 1.0 / 0.5 / 0.2 / 0.0 (CPU), and memcompile
(codegen="aot_eager") at exactly that budget: its measured peak, or the floor it names when it
refuses.

    python benchmarks/pytorch_budget_cases.py                                       # about a minute
    python benchmarks/pytorch_budget_cases.py --baseline aot_eager_decomp_partition

`--baseline aot_eager` (the default) runs PyTorch's ops as they are; memcompile's aot_eager mode,
like `aot_eager_decomp_partition`, runs Inductor's decompositions of them (a softmax backward as
mul, sum, neg and fma: 256 KiB more on the attention case than the one kernel).
"""

from __future__ import annotations

import argparse

import torch

import memcompile
from memcompile.errors import InfeasibleBudgetError

FRACTIONS = (1.0, 0.5, 0.2, 0.0)


def chain(x, ws):
    for w in ws:
        x = torch.mm(x, w).cos()
    return x.sum()


def uneven(x, a, b):
    y = torch.mm(x, a).cos()
    z = torch.mm(y, b).cos()
    return torch.mm(z, b.t()).cos().sum()


def attention_against_linear(x, w):
    q, k = torch.mm(x, w), torch.mm(x, w.t())
    scores = torch.softmax(q @ k.t(), dim=-1)
    return (scores @ x).sin().sum()


def cases():
    """(name, function, () -> fresh leaf tensors: the first the input, the rest weights)."""
    def maker(*shapes):
        def make():
            g = torch.Generator().manual_seed(0)
            return [torch.randn(*s, generator=g, requires_grad=True) for s in shapes]
        return make

    yield "chain x4", lambda x, *ws: chain(x, ws), maker((128, 128), *[(128, 128)] * 4)
    yield "chain x8", lambda x, *ws: chain(x, ws), maker((64, 256), *[(256, 256)] * 8)
    yield "uneven", uneven, maker((256, 64), (64, 512), (512, 512))
    yield "attention vs linear", attention_against_linear, maker((256, 128), (128, 128))


def measured_step_peak(compiled, tensors) -> int:
    compiled(*tensors).backward()  # compiles outside the profiler
    for t in tensors:
        t.grad = None
    return memcompile.measure_peak(lambda: compiled(*tensors).backward(), live_at_start=tensors).peak_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default="aot_eager", choices=["aot_eager", "aot_eager_decomp_partition"],
                        help="PyTorch's backend whose measured peak is the budget")
    baseline = parser.parse_args().baseline
    torch.set_num_threads(1)
    print("| case | fraction | PyTorch's measured peak | memcompile at it |")
    print("| --- | --- | --- | --- |")
    for name, fn, make in cases():
        for fraction in FRACTIONS:
            torch._dynamo.reset()
            with torch._functorch.config.patch(activation_memory_budget=fraction):
                stock = measured_step_peak(torch.compile(fn, backend=baseline), make())
            torch._dynamo.reset()
            try:
                peak = measured_step_peak(torch.compile(fn, backend=memcompile.budget(stock, codegen="aot_eager")),
                                          make())
                verdict = f"{peak:,} ({'within' if peak <= stock else 'OVER'})"
            except InfeasibleBudgetError as error:
                verdict = f"refused: floor {error.min_feasible_bytes:,} (+{error.min_feasible_bytes - stock:,})"
            print(f"| {name} | {fraction} | {stock:,} | {verdict} |", flush=True)


if __name__ == "__main__":
    main()
