"""What a chunked MLP (memcompile/mlp_ops.py) costs against the unchunked one, eager, one thread:
forward + backward of Llama small's gated SiLU MLP and ViT small's GELU MLP, at several chunk
sizes. The chunked backward recomputes the up / gate projections: the price of its lower
working set. Writes benchmarks/results/mlp_chunk_cost.{json,md}.

    OMP_NUM_THREADS=1 python benchmarks/mlp_chunk_cost.py
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import torch
import torch.nn.functional as F

from memcompile import mlp_ops

SHAPES = (("llama small", 512, 128, 344, True, "silu"), ("vit small", 520, 128, 512, False, "gelu"))


def _median_ms(fn, runs: int = 30) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows_out = []
    for name, tokens, hidden, inner, gated, activation in SHAPES:
        x = torch.randn(tokens, hidden, requires_grad=True)
        w_up = (torch.randn(inner, hidden) * 0.1).requires_grad_()
        w_gate = (torch.randn(inner, hidden) * 0.1).requires_grad_() if gated else None
        w_down = (torch.randn(hidden, inner) * 0.1).requires_grad_()
        params = [t for t in (x, w_up, w_gate, w_down) if t is not None]
        act = F.silu if activation == "silu" else F.gelu

        def whole():
            up = F.linear(x, w_up)
            y = F.linear(act(F.linear(x, w_gate)) * up if gated else act(up), w_down)
            torch.autograd.grad(y, params, torch.ones_like(y))

        baseline = _median_ms(whole)
        rows_out.append({"mlp": name, "chunks": 0, "rows": tokens, "ms": baseline, "ratio": 1.0})
        for chunks in (1, 2, 4, 6, 8):
            rows = -(-tokens // chunks)

            def chunked(rows=rows):
                y = mlp_ops.chunked_mlp(x, w_up, None, w_gate, None, w_down, None, activation, rows)
                torch.autograd.grad(y, params, torch.ones_like(y))

            ms = _median_ms(chunked)
            rows_out.append({"mlp": name, "chunks": chunks, "rows": rows, "ms": ms, "ratio": ms / baseline})
    out = pathlib.Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / "mlp_chunk_cost.json").write_text(json.dumps({"torch": torch.__version__, "rows": rows_out}, indent=1))
    lines = [f"# Chunked MLP vs whole, eager forward + backward, 1 thread (torch {torch.__version__})", "",
             "| MLP | chunks (0: whole, ATen autograd) | rows | median ms | ratio |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r['mlp']} | {r['chunks']} | {r['rows']} | {r['ms']:.3f} | {r['ratio']:.3f} |" for r in rows_out]
    (out / "mlp_chunk_cost.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
