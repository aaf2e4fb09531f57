"""The smallest budget memcompile finds for the GPT-style model (benchmarks/gpt_style.py) where its
loss head dominates, and the peak measured when it runs at that budget.

The step is the way a training loop runs it: `logits, loss = model(idx, targets)`, then
`loss.backward()` with the logits still held; a sixth of the targets are `ignore_index` (-1).
For each chunk_loss setting: `memcompile.budget(1, codegen="aot_eager")` raises
InfeasibleBudgetError on the first call, naming `min_feasible_bytes` (the floor); the model
is then compiled at the floor and one step measured (memcompile.measure_peak) after a warm-up.

    .venv/bin/python benchmarks/gpt_style_floor.py                     # vocab 16384, d128, 2 layers, 2 x 256
    .venv/bin/python benchmarks/gpt_style_floor.py --vocab 50304 --embd 256
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import memcompile  # noqa: E402
from gpt_style import GPT, GPTConfig  # noqa: E402


def _chunk_loss(text: str):
    return {"auto": "auto", "true": True, "false": False}[text.lower()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--embd", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--chunk-loss", type=_chunk_loss, nargs="+", default=[False, "auto"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = GPTConfig(block_size=args.seq, vocab_size=args.vocab, n_layer=args.layers, n_head=args.heads,
                       n_embd=args.embd)
    model = GPT(config)
    idx = torch.randint(0, args.vocab, (args.batch, args.seq))
    targets = torch.roll(idx, -1, dims=1)
    targets[:, ::6] = config.ignore_index
    params = list(model.parameters())
    logits_mib = args.batch * args.seq * args.vocab * 4 / 2**20
    print(f"GPT-style: vocab {args.vocab}, d{args.embd}, {args.layers} layers, batch {args.batch} x {args.seq}; "
          f"{sum(p.numel() for p in params) / 1e6:.2f}M parameters; float32 logits {logits_mib:.1f} MiB")

    def step(compiled):
        def run():
            logits, loss = compiled(idx, targets)
            loss.backward()
            return logits  # held through the backward, as a training loop holds it
        return run

    for chunk_loss in args.chunk_loss:
        torch.compiler.reset()
        compiled = torch.compile(model, backend=memcompile.budget(1, codegen="aot_eager", chunk_loss=chunk_loss))
        try:
            step(compiled)()
            raise SystemExit("a budget of 1 byte was met?")
        except memcompile.InfeasibleBudgetError as error:
            floor = error.min_feasible_bytes
        torch.compiler.reset()
        backend = memcompile.budget(floor, codegen="aot_eager", chunk_loss=chunk_loss)
        compiled = torch.compile(model, backend=backend)
        for p in params:
            p.grad = None
        step(compiled)()  # warm-up: the first step compiles
        for p in params:
            p.grad = None
        measured = memcompile.measure_peak(step(compiled), live_at_start=[model, idx, targets])
        rewrites = [r for plan in backend.plans for r in plan.graph_rewrites]
        print(f"chunk_loss={chunk_loss!r}: floor (min_feasible_bytes) {floor:,} B ({floor / 2**20:.2f} MiB); "
              f"measured peak at it {measured.peak_bytes:,} B ({measured.peak_bytes / 2**20:.2f} MiB); "
              f"rewrites: {rewrites or 'none'}")


if __name__ == "__main__":
    main()
