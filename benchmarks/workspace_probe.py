"""Library kernels' scratch on this CPU against what the liveness passes count for it.

    python benchmarks/workspace_probe.py gemm [--threads 1] [--draws 400] [--seed 7]
    python benchmarks/workspace_probe.py attention [--threads 1] [--draws 150] [--seed 1]
    [ONEDNN_MAX_CPU_ISA=AVX2] python benchmarks/workspace_probe.py conv [--draws 500] [--seed 11]

gemm: float16/bfloat16 mm/addmm/bmm over a grid of skinny shapes (m 1-32, k 1-8192, n 1-64) and
random draws (each side a few rows or up to 300, k up to 2000): scratch = the allocator's rise
during the call less the result, against transient_memory.kernel_workspace_bytes. attention: float32
CPU flash attention forward and backward over random shapes, masks and grad_out layouts: the
distribution of counted - measured. conv: float32 oneDNN convolution forward and backward over
random channels (3-64), batches, sizes, kernels 1/3, strides 1/2, 1-2 threads (drawn), gradient
masks and layouts (contiguous; channels-last, traced contiguous and counted as Inductor's layout);
with ONEDNN_MAX_CPU_ISA=AVX2 an AVX-512 CPU allocates as an AVX2 one does. Channels-last strided
1x1 backwards with < 16 input channels are not run (oneDNN writes past its scratchpad there:
uxlfoundation/oneDNN#6035). Writes benchmarks/results/workspace_probe_<kind>[_<isa cap>].json.
With the fit of 630d4e9 (torch 2.13, AVX-512 EPYC): conv 500 draws, 0 under the count, AVX-512 and
capped at AVX2 (seeds 11 and 21).
At acd48d9 (torch 2.13, Xeon with AMX-BF16 and AVX512-FP16): gemm 0 of 1,480 shapes under the
count; 175 of the same 1,480 with the count before the skinny term (`git show
e1f8546^:passes/graph_facts.py`, its kernel_workspace_bytes patched in for this module's), worst
bf16 1x8192 @ 8192x1: 1,050,624 B measured, 106,502 counted. attention: counted - measured = 0 on
all 150 shapes at 1 thread (forward and backward).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
from pathlib import Path

import torch
from torch.fx.experimental.proxy_tensor import make_fx

import memcompile
from memcompile.cost_models.conv_workspace import onednn_channel_block
from memcompile.cost_models.transient_memory import kernel_workspace_bytes

RESULTS = Path(__file__).resolve().parent / "results"
GEMMS = {"mm": (lambda a, b, c: torch.mm(a, b), False), "addmm": (lambda a, b, c: torch.addmm(c, a, b), False),
         "bmm": (lambda a, b, c: torch.bmm(a, b), True)}
ATTENTION = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
ATTENTION_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _only_node(fn, *inputs, targets):
    (node,) = [n for n in make_fx(fn, tracing_mode="fake")(*inputs).graph.nodes
               if n.op == "call_function" and n.target in targets]
    return node


def gemm_row(op: str, dtype: torch.dtype, m: int, k: int, n: int, batch: int) -> dict:
    fn, batched = GEMMS[op]
    lead = (batch,) if batched else ()
    a, b, c = torch.randn(*lead, m, k, dtype=dtype), torch.randn(*lead, k, n, dtype=dtype), torch.randn(n, dtype=dtype)
    node = _only_node(fn, a, b, c, targets=(torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
                                           torch.ops.aten.bmm.default))
    fn(a, b, c)  # first-call allocations (oneDNN primitive caches) are not per-step scratch
    measured = memcompile.measure_peak(lambda: fn(a, b, c), live_at_start=[a, b, c])
    scratch = measured.rise_bytes - measured.result.numel() * measured.result.element_size()
    return dict(op=op, dtype=str(dtype), m=m, k=k, n=n, batch=batch, scratch=scratch,
                counted=kernel_workspace_bytes(node))


def gemm_rows(draws: int, seed: int) -> list[dict]:
    rows = []
    for dtype in (torch.float16, torch.bfloat16):
        for op in ("mm", "bmm"):
            for m in (1, 2, 4, 8, 16, 32):
                for k in (1, 8, 32, 100, 256, 1024, 2048, 4096, 8192):
                    for n in (1, 2, 8, 19, 64):
                        rows.append(gemm_row(op, dtype, m, k, n, 4 if op == "bmm" else 1))
    rnd = random.Random(seed)
    for _ in range(draws):
        side = lambda hi: rnd.choice([rnd.randint(1, 8), rnd.randint(1, hi)])  # noqa: E731
        rows.append(gemm_row(rnd.choice(sorted(GEMMS)), rnd.choice([torch.float16, torch.bfloat16]),
                             side(300), side(2000), side(300), rnd.randint(1, 4)))
    return rows


def attention_rows(draws: int, seed: int) -> list[dict]:
    rnd, rows = random.Random(seed), []
    for _ in range(draws):
        b, h, d = rnd.randint(1, 3), rnd.randint(1, 6), rnd.choice([16, 32, 64, 128])
        s = rnd.choice([8, 32, 63, 64, 100, 191, 192, 256, 300, 767, 768])
        kv = rnd.choice([None, 24, 63, 64, 600]) or s
        mask_kind, layout = rnd.choice([None, "batch", "scores"]), rnd.choice(["bhsd", "bshd"])
        q, k, v = torch.randn(b, h, s, d), torch.randn(b, h, kv, d), torch.randn(b, h, kv, d)
        mask = {None: None, "batch": torch.randn(b, 1, s, kv), "scores": torch.randn(s, kv)}[mask_kind]

        def forward(q, k, v, m):
            return ATTENTION(q, k, v, attn_mask=m)

        node = _only_node(forward, q, k, v, mask, targets=(ATTENTION,))
        live = [x for x in (q, k, v, mask) if x is not None]
        measured = memcompile.measure_peak(forward, q, k, v, mask, live_at_start=live)
        forward_scratch = measured.rise_bytes - sum(t.nbytes for t in measured.result[:2])
        forward_counted = kernel_workspace_bytes(node)
        out, lse = ATTENTION(q, k, v, attn_mask=mask)[:2]
        grad = torch.randn(b, s, h, d).transpose(1, 2) if layout == "bshd" else torch.randn(b, h, s, d)

        def backward(g, q, k, v, o, lse, m):
            return ATTENTION_BACKWARD(g, q, k, v, o, lse, 0.0, False, attn_mask=m)

        node = _only_node(backward, grad, q, k, v, out, lse, mask, targets=(ATTENTION_BACKWARD,))
        measured = memcompile.measure_peak(backward, grad, q, k, v, out, lse, mask,
                                           live_at_start=[grad, q, k, v, out, lse, *([mask] if mask is not None else [])])
        rows.append(dict(batch=b, heads=h, seq=s, kv_seq=kv, head_dim=d, mask=mask_kind, grad_layout=layout,
                         forward_scratch=forward_scratch, forward_counted=forward_counted,
                         backward_scratch=measured.rise_bytes - q.nbytes - k.nbytes - v.nbytes,
                         backward_counted=kernel_workspace_bytes(node)))
    return rows


CONVOLUTION = torch.ops.aten.convolution.default
CONVOLUTION_BACKWARD = torch.ops.aten.convolution_backward.default


def conv_rows(draws: int, seed: int) -> list[dict]:
    rnd, rows = random.Random(seed), []
    for _ in range(draws):
        c_in, c_out = rnd.choice([3, 4, 8, 12, 16, 24, 32, 64]), rnd.choice([4, 8, 12, 16, 32, 64])
        batch, size, kernel, stride = rnd.choice([2, 7, 16]), rnd.choice([8, 16, 32]), rnd.choice([1, 3]), rnd.choice([1, 2])
        threads, layout = rnd.choice([1, 2]), rnd.choice(["contiguous", "channels_last"])
        mask = rnd.choice([(True, True, True), (False, True, True), (True, False, False)])
        torch.set_num_threads(threads)
        x, w, b = torch.randn(batch, c_in, size, size), torch.randn(c_out, c_in, kernel, kernel), torch.randn(c_out)
        args = ([stride] * 2, [kernel // 2] * 2, [1, 1], False, [0, 0], 1)

        def forward(x, w, b):
            return CONVOLUTION(x, w, b, *args)

        def backward(g, x, w):
            return CONVOLUTION_BACKWARD(g, x, w, [c_out], *args, list(mask))

        row = dict(c_in=c_in, c_out=c_out, batch=batch, size=size, kernel=kernel, stride=stride, threads=threads,
                   layout=layout, mask=mask)
        grad = torch.randn_like(forward(x, w, b))
        phases = [("forward", forward, [x, w, b], CONVOLUTION)]
        if not (layout != "contiguous" and kernel == 1 and stride > 1 and c_in < 16):
            phases.append(("backward", backward, [grad, x, w], CONVOLUTION_BACKWARD))
        for phase, fn, inputs, target in phases:
            node = _only_node(fn, *inputs, targets=(target,))  # traced contiguous, as Inductor's graphs are
            if layout != "contiguous":
                inputs = [t.to(memory_format=torch.channels_last) if t.dim() == 4 else t for t in inputs]
            fn(*inputs)  # oneDNN's primitive caches filled, as in a warm step
            measured = memcompile.measure_peak(fn, *inputs, live_at_start=inputs)
            results = measured.result if isinstance(measured.result, (tuple, list)) else [measured.result]
            row[f"{phase}_scratch"] = measured.rise_bytes - sum(r.nbytes for r in results if r is not None)
            # a channels_last run of a contiguous trace is what kernel_workspace_bytes(inductor=True) counts
            row[f"{phase}_counted"] = kernel_workspace_bytes(node, inductor=layout != "contiguous")
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=("gemm", "attention", "conv"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--draws", type=int, default=None)
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.kind == "gemm":
        rows = gemm_rows(args.draws if args.draws is not None else 400, args.seed if args.seed is not None else 7)
        under = [r for r in rows if r["scratch"] > r["counted"]]
        summary = {"shapes": len(rows), "under_the_count": len(under), "worst": max(
            under, key=lambda r: r["scratch"] - r["counted"], default=None)}
    elif args.kind == "conv":
        rows = conv_rows(args.draws if args.draws is not None else 500, args.seed if args.seed is not None else 11)
        under = [(phase, r) for r in rows for phase in ("forward", "backward")
                 if r.get(f"{phase}_scratch", 0) > r.get(f"{phase}_counted", 0)]
        ratios = sorted(r["forward_counted"] / max(1, r["forward_scratch"]) for r in rows)
        summary = {"shapes": len(rows), "under_the_count": len(under), "channel_block": onednn_channel_block(),
                   "isa_cap": os.environ.get("ONEDNN_MAX_CPU_ISA"), "forward_counted_over_measured_median":
                   ratios[len(ratios) // 2] if ratios else None, "under": under[:10]}
    else:
        rows = attention_rows(args.draws if args.draws is not None else 150, args.seed if args.seed is not None else 1)
        summary = {"shapes": len(rows), "forward_counted_minus_measured": sorted(collections.Counter(
            r["forward_counted"] - r["forward_scratch"] for r in rows).items()),
                   "backward_counted_minus_measured": sorted(collections.Counter(
                       r["backward_counted"] - r["backward_scratch"] for r in rows).items())}
    summary.update(threads=args.threads, torch=torch.__version__)
    print(json.dumps(summary, indent=1))
    RESULTS.mkdir(exist_ok=True)
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA")
    (RESULTS / f"workspace_probe_{args.kind}{'_' + cap.lower() if cap else ''}.json").write_text(json.dumps({"summary": summary, "rows": rows}) + "\n")


if __name__ == "__main__":
    main()
