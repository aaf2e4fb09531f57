"""The smallest budget memcompile reports (InfeasibleBudgetError.min_feasible_bytes) for the GPT
benchmark model, keep/recompute only and with int8, planned for the FX interpreter (aot_eager)
or, with --codegen inductor, for Inductor (checked over Inductor's schedule unless
MEMCOMPILE_FUSION_CHECK=0).

    .venv/bin/python benchmarks/smallest_budget.py [--blocks 4] [--batch 8] [--codegen inductor]

Prints one JSON line per variant. Uses only the public API, so it runs on older commits too.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import memcompile  # noqa: E402
from models import WithMSELoss, make_gpt, make_input, make_target  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--codegen", default="aot_eager", choices=("aot_eager", "inductor"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = make_gpt(n_blocks=args.blocks, d_model=128)
    x, y = make_input(args.batch, 128, 128), make_target(args.batch, 128, 128)
    for variant, options in (("recompute only", {}), ("int8", {"quantize": "int8"})):
        torch.compiler.reset()
        backend = memcompile.budget(1, time_limit_s=8, codegen=args.codegen, **options)
        try:
            torch.compile(WithMSELoss(model), backend=backend)(x, y)
        except memcompile.InfeasibleBudgetError as error:
            print(json.dumps({"blocks": args.blocks, "batch": args.batch, "variant": variant, "codegen": args.codegen,
                              "min_feasible_bytes": error.min_feasible_bytes,
                              "min_feasible_mib": round(error.min_feasible_bytes / 2**20, 2)}))
        else:
            raise AssertionError("a 1-byte budget was accepted")


if __name__ == "__main__":
    main()
