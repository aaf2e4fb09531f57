"""DDP and FSDP2 with memcompile: 2 CPU processes on loopback (gloo), budget per rank.

    python examples/distributed.py --engine ENGINE [--engine ENGINE ...] [--nproc 2] [--out DIR]

Engines (the wrap_* functions below): `ddp` (DDP, compiled, one bucket: one graph),
`ddp_buckets` (DDPOptimizer splits the graph at 1 MB buckets), `fsdp2_whole` (one FSDP2 unit
around a compiled block stack), `fsdp2_compiled_root` (one FSDP2 unit, the sharded root compiled),
`fsdp2` (torchtitan: each block compiled, then sharded).

Each rank runs the same training step twice from the same initial weights on its own batch:
uncompiled (the reference) and compiled with memcompile by name. It writes to DIR (a temporary
folder unless given) `<engine>_rank<r>.json` (budget, reserve, measured peaks, plans) and the
gradients of both runs (`<engine>_rank<r>.pt`), and prints a summary.

The budget is per device, that is per rank: what one process may hold at its peak. Memory the
engine holds outside the compiled graphs is the `reserve` (see reserve_bytes): DDP's gradient
buckets; FSDP2's parameter and gradient shards and its reduce-scatter staging buffer. FSDP2
gathers a unit's parameters only while the unit runs, so with blocks sharded and compiled one by
one each block's graph sees just its own gathered parameters as inputs.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import memcompile


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Body(nn.Module):
    """The block stack (a module of ours: Dynamo does not start graphs in torch.nn's own
    containers such as nn.Sequential, it would compile each block on its own)."""

    def __init__(self, d: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(d) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class Net(nn.Module):
    def __init__(self, d: int, depth: int) -> None:
        super().__init__()
        self.body = Body(d, depth)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.body(x), target)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def batch_for(rank: int, batch: int, seq: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.randn(batch, seq, d, generator=gen), torch.randn(batch, seq, d, generator=gen)


def wrap_ddp(model: Net, options: dict | None, bucket_cap_mb: float | None = None) -> nn.Module:
    """DDP around the model, the DDP module compiled (as DDP's docs do it). With the default
    bucket size this model's gradients fit one bucket: one graph. `.grad` are views of the
    buckets (gradient_as_bucket_view=True, DDP's memory-saving setting)."""
    ddp = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True, bucket_cap_mb=bucket_cap_mb)
    if options is None:
        return ddp
    return torch.compile(ddp, backend="memcompile", options=dict(options))


def wrap_ddp_buckets(model: Net, options: dict | None) -> nn.Module:
    """1 MB buckets (DDPOptimizer wants them >= DDP's 1 MB first bucket) on a model of 1.2 MB:
    Dynamo's DDPOptimizer splits the graph at the bucket boundary, so that the all-reduce of one
    bucket overlaps the backward of the rest; each piece is planned on its own."""
    return wrap_ddp(model, options, bucket_cap_mb=1)


def _cpu_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def wrap_fsdp2_per_block(model: Net, options: dict | None) -> nn.Module:
    """torchtitan's layout: each block compiled, then sharded on its own (its gathered
    parameters exist only while it runs), the root sharded last."""
    from torch.distributed.fsdp import fully_shard

    mesh = _cpu_mesh()
    for block in model.body.layers:
        if options is not None:
            block.compile(backend="memcompile", options=dict(options))
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def wrap_fsdp2_whole(model: Net, options: dict | None) -> nn.Module:
    """One FSDP2 unit (the root: all parameters gathered for the step, like ZeRO-2/3 with one
    group) around one compiled graph (the block stack); FSDP2's hooks run eagerly around it."""
    from torch.distributed.fsdp import fully_shard

    if options is not None:
        model.body.compile(backend="memcompile", options=dict(options))
    fully_shard(model, mesh=_cpu_mesh())
    return model


def wrap_fsdp2_compiled_root(model: Net, options: dict | None) -> nn.Module:
    """One FSDP2 unit, the sharded root module itself compiled. torch 2.13 wraps FSDP2's hooks
    in torch._dynamo.disable, so they run eagerly around the graph of the forward."""
    from torch.distributed.fsdp import fully_shard

    fully_shard(model, mesh=_cpu_mesh())
    if options is not None:
        model.compile(backend="memcompile", options=dict(options))
    return model


WRAP = {"ddp": wrap_ddp, "ddp_buckets": wrap_ddp_buckets, "fsdp2_whole": wrap_fsdp2_whole,
        "fsdp2_compiled_root": wrap_fsdp2_compiled_root, "fsdp2": wrap_fsdp2_per_block}
# Per-rank budget as a fraction of the uncompiled rank's peak: low enough that memcompile must
# recompute, high enough to be feasible (FSDP2's reserve for its shards and staging is larger;
# split graphs pay the step ledger's upper bound, both phases of the other regions summed).
# Per-block FSDP2 finds no plan below the uncompiled peak here (least 1.12x): each compiled
# block's predicted peak counts the decomposed GELU backward's temporaries, which eager's fused
# kernel does not hold, so it runs above it, to show the budget holds across sharded blocks.
FRACTION = {"ddp": 0.8, "ddp_buckets": 0.85, "fsdp2_whole": 0.9, "fsdp2_compiled_root": 0.9, "fsdp2": 1.15}


def local_grads(model: Net) -> list[torch.Tensor]:
    """This rank's gradients as plain tensors (FSDP2's are this rank's shards of DTensors)."""
    out = []
    for p in model.parameters():
        g = p.grad
        out.append((g.to_local() if hasattr(g, "to_local") else g).detach().clone())
    return out


def bucket_bytes(model: Net) -> int:
    """DDP's buckets: one copy of every gradient, allocated when DDP is built (before any
    measurement, so the CPU profiler never sees them)."""
    return sum(p.nbytes for p in model.parameters())


def reserve_bytes(engine: str, model: Net, world: int) -> int:
    """What the engine holds on a rank outside the compiled graphs during a step.

    DDP: its buckets. FSDP2: this rank's parameter shards and gradient shards (the graphs see the
    gathered parameters and full gradients instead), plus the reduce-scatter staging buffer, a
    full-size copy of the gradients of the largest FSDP unit (the whole model for one unit, a
    block when blocks are sharded on their own). An upper bound: it ignores that a unit's
    gathered parameters are freed between its forward and backward.
    """
    total = sum(p.nbytes for p in model.parameters())
    if engine.startswith("ddp"):
        return bucket_bytes(model)
    shards = 2 * -(-total // world)  # parameter and gradient shards, rounded up
    largest_unit = total if engine in ("fsdp2_whole", "fsdp2_compiled_root") else max(
        sum(p.nbytes for p in block.parameters()) for block in model.body.layers)
    return shards + largest_unit


def step(wrapped, x, target) -> None:
    wrapped(x, target).backward()


def warm_up(model: Net, wrapped, x, target) -> None:
    """Two steps: DDP rebuilds its buckets in the second forward (in the order gradients came)."""
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        step(wrapped, x, target)


def measured_step(model: Net, wrapped, x, target) -> int:
    model.zero_grad(set_to_none=True)
    dist.barrier()
    # This rank's memory: local shards of FSDP2's DTensor parameters, whole tensors otherwise.
    live = [x, target] + [(p.to_local() if hasattr(p, "to_local") else p).detach() for p in model.parameters()]
    return memcompile.measure_peak(step, wrapped, x, target, live_at_start=live).peak_bytes


def run_engine(engine: str, rank: int, codegen: str, fraction: float, out: Path) -> dict:
    torch.compiler.reset()
    d, depth, batch, seq = (96 if engine == "ddp_buckets" else 64), 4, 4, 64
    torch.manual_seed(0)
    base = Net(d, depth)
    x, target = batch_for(rank, batch, seq, d)

    eager_model = copy.deepcopy(base)
    eager = WRAP[engine](eager_model, None)
    warm_up(eager_model, eager, x, target)
    eager_peak = measured_step(eager_model, eager, x, target)
    eager_grads = local_grads(eager_model)

    # The per-rank budget: a fraction of what the uncompiled rank holds at its peak, so that
    # memcompile has to recompute to fit.
    invisible = bucket_bytes(base) if engine.startswith("ddp") else 0
    eager_device_peak = eager_peak + invisible
    budget = int(fraction * eager_device_peak)
    reserve = reserve_bytes(engine, base, dist.get_world_size())
    options = {"budget": budget, "reserve": reserve, "codegen": codegen, "time_limit_s": 2.0}
    model = copy.deepcopy(base)
    wrapped = WRAP[engine](model, options)
    warm_up(model, wrapped, x, target)  # compiles
    peak = measured_step(model, wrapped, x, target)
    plans = memcompile.named_backend(options).plans
    torch.save({"eager": eager_grads, "compiled": local_grads(model)}, out / f"{engine}_rank{rank}.pt")
    return {
        "rank": rank, "engine": engine, "budget_bytes": budget, "reserve_bytes": reserve,
        "eager_peak_bytes": eager_peak, "compiled_peak_bytes": peak,
        "eager_device_peak_bytes": eager_device_peak,
        "device_peak_bytes": peak + invisible,  # what the rank holds: measured step + DDP's buckets
        "plans": [{"graph_id": p.graph_id, "predicted_peak_bytes": p.predicted_peak_bytes,
                   "budget_bytes": p.budget_bytes, "status": p.solver_status,
                   "recomputed": sum(dec.choice == "recompute" for dec in p.decisions)} for p in plans],
    }


def worker(rank: int, world: int, port: int, engines: list[str], codegen: str, fraction: float | None,
           out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for engine in engines:
            record = run_engine(engine, rank, codegen, FRACTION[engine] if fraction is None else fraction, Path(out))
            (Path(out) / f"{engine}_rank{rank}.json").write_text(json.dumps(record, indent=1))
    finally:
        dist.destroy_process_group()


def launch(engines: list[str], nproc: int = 2, codegen: str = "aot_eager", fraction: float | None = None,
           out: str | None = None) -> dict[str, list[dict]]:
    """Spawns `nproc` ranks on a free loopback port; returns {engine: [record of each rank]}."""
    out = out or tempfile.mkdtemp(prefix="memcompile-distributed-")
    Path(out).mkdir(parents=True, exist_ok=True)
    mp.spawn(worker, args=(nproc, free_port(), list(engines), codegen, fraction, out), nprocs=nproc, join=True)
    return {e: [json.loads((Path(out) / f"{e}_rank{r}.json").read_text()) for r in range(nproc)] for e in engines}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=sorted(WRAP), action="append", required=True,
                        help="repeat to run several in one launch")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--codegen", default="aot_eager", choices=["inductor", "aot_eager"])
    parser.add_argument("--fraction", type=float, default=None,
                        help="per-rank budget as a fraction of the uncompiled peak (default per engine)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="memcompile-distributed-")
    results = launch(args.engine, args.nproc, args.codegen, args.fraction, out)
    for r in (r for records in results.values() for r in records):
        grads = torch.load(Path(out) / f"{r['engine']}_rank{r['rank']}.pt")
        worst = max((a - b).abs().max().item() for a, b in zip(grads["eager"], grads["compiled"]))
        print(f"rank {r['rank']} {r['engine']}: budget {r['budget_bytes']:,} B (reserve {r['reserve_bytes']:,}); "
              f"eager step {r['eager_peak_bytes']:,} B; memcompile step {r['compiled_peak_bytes']:,} B, "
              f"device {r['device_peak_bytes']:,} B; {len(r['plans'])} plan(s); max |grad diff| {worst:.2e}")
    print(f"results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
