"""Step time of a compiled Hugging Face model with its loss head whole and chunked at several chunk
sizes (logits of 2x, 4x, 8x the hidden states), all in one process, interleaved.

    OMP_NUM_THREADS=1 python benchmarks/chunk_count_speed.py [--model gpt2] [--rounds 30]

Each variant is memcompile with a budget nothing needs recomputing for (chunk_loss=False, or True
with passes.loss_head._CHUNK_LOGITS_OVER_HIDDEN set before its compile); the whole head is timed
twice (its second copy: the noise). Each timed step follows an untimed one of the same variant
(steady state; pareto.interleaved_medians). Writes benchmarks/results/chunk_count_speed_<model>.{json,md}.
GPT-2 small, 1 thread, two runs (an ad-hoc one of the same loop, then this script at a8f466b):
8 chunks (2x) 1.050 / 1.037 of the whole head, 4 chunks (4x) 1.010 / 1.021, 2 chunks (8x)
1.004 / 1.011; the whole head's second copy 1.009 / 1.014 (the noise).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import hf_models  # noqa: E402
from pareto import interleaved_medians  # noqa: E402

import memcompile  # noqa: E402
from memcompile.passes import loss_head  # noqa: E402

RESULTS = HERE / "results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2", choices=("gpt2", "llama", "bert"))
    ap.add_argument("--size", default="small")
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(1)
    default = loss_head._CHUNK_LOGITS_OVER_HIDDEN
    runs, names, chunks = [], [], []
    for name, factor in (("whole", None), ("2x", 2), ("4x", 4), ("8x", 8), ("whole again", None)):
        bench = hf_models.build(args.model, args.size)
        loss_head._CHUNK_LOGITS_OVER_HIDDEN = factor or default
        backend = memcompile.budget("1GB", chunk_loss=factor is not None)
        compiled = torch.compile(bench.module, backend=backend)
        compiled(*bench.inputs).backward()  # compiles (the rewrite reads the factor here)
        rewrites = backend.plans[0].graph_rewrites if backend.plans else ()
        chunks.append(rewrites[0].split("chunked into ")[1].split(" ")[0] if rewrites else "-")
        runs.append((compiled, bench.module))
        names.append(name)
        inputs = bench.inputs
    loss_head._CHUNK_LOGITS_OVER_HIDDEN = default
    times = interleaved_medians(runs, inputs, args.rounds)
    base = statistics.median(times[0])
    rows = [{"variant": n, "chunks": c, "median_ms": 1e3 * statistics.median(t), "ratio": statistics.median(t) / base}
            for n, c, t in zip(names, chunks, times)]
    meta = {"model": args.model, "size": args.size, "rounds": args.rounds, "torch": torch.__version__}
    RESULTS.mkdir(exist_ok=True)
    stem = RESULTS / f"chunk_count_speed_{args.model}"
    stem.with_suffix(".json").write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    table = [f"# Loss head whole vs chunked, compiled step ({meta})\n", "| variant | chunks | median ms | ratio |",
             "| --- | --- | --- | --- |"]
    table += [f"| {r['variant']} | {r['chunks']} | {r['median_ms']:.2f} | {r['ratio']:.3f} |" for r in rows]
    stem.with_suffix(".md").write_text("\n".join(table) + "\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()
