"""The plan picture as a user sees it: `memcompile.dump(backend, format="html")`, rendered headless.

    python benchmarks/plan_picture.py                                # GPT-2 tiny at 0.7 of its keep-all peak
    python benchmarks/plan_picture.py --model llama --fraction 0.5 --screenshot
    python benchmarks/plan_picture.py --fraction least               # at its smallest workable budget

Plans one step of a Hugging Face model built from a config (benchmarks/hf_models.py, random
weights) under Inductor's check, plan-only (the graphs are planned, no code is generated, no step
runs), at `--fraction` of its keep-all peak, and writes the page to
benchmarks/results/plan_picture_<model>.html. With --screenshot it renders it in Debian's
chromium (`apt-get install -y chromium`) to a .png beside it; opt-in, so nothing else needs a
browser.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import memcompile  # noqa: E402
from memcompile.errors import PlannedOnly  # noqa: E402

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run")


def plan_at(bench, budget: int, codegen: str, time_limit_s: float) -> memcompile.Plan:
    """The step's plan at `budget`, or at its smallest workable budget if none fits."""
    torch.compiler.reset()
    backend = memcompile.Backend(memcompile.make_options(budget, codegen=codegen, time_limit_s=time_limit_s))
    backend.plan_only = True
    try:
        torch.compile(bench.module, backend=backend)(*bench.inputs).backward()
    except PlannedOnly as planned:
        return planned.plan
    except memcompile.InfeasibleBudgetError as error:
        print(f"budget {budget:,} B does not fit; planning at min_feasible_bytes={error.min_feasible_bytes:,}")
        return plan_at(bench, error.min_feasible_bytes, codegen, time_limit_s)
    raise RuntimeError("the step ran without being planned")


def screenshot(html: Path, png: Path, size: str) -> None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        raise SystemExit("--screenshot needs chromium (apt-get install -y chromium)")
    subprocess.run([browser, *CHROMIUM_FLAGS, f"--screenshot={png}", f"--window-size={size}", html.as_uri()],
                   check=True, capture_output=True, timeout=120)
    print(f"wrote {png}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--fraction", default="0.7", help="of the keep-all peak, or 'least' (the smallest budget)")
    ap.add_argument("--codegen", default="inductor", choices=("inductor", "aot_eager"))
    ap.add_argument("--time-limit", type=float, default=5.0)
    ap.add_argument("--screenshot", action="store_true")
    ap.add_argument("--window-size", default="1400,1000")
    ap.add_argument("--out", type=Path, help="the page to write (default: benchmarks/results/plan_picture_<model>.html)")
    args = ap.parse_args()
    from hf_models import build

    bench = build(args.model, args.size)
    keep_all = plan_at(bench, 2**50, args.codegen, args.time_limit).predicted_peak_before_bytes
    budget = 1 if args.fraction == "least" else int(float(args.fraction) * keep_all)
    plan = plan_at(bench, budget, args.codegen, args.time_limit)
    out = args.out or HERE / "results" / f"plan_picture_{args.model}.html"
    out.parent.mkdir(parents=True, exist_ok=True)
    memcompile.dump(plan, format="html", path=out)
    print(f"keep-all peak {keep_all:,} B; planned at {plan.budget_bytes:,} B: peak {plan.predicted_peak_bytes:,} B "
          f"({plan.solver_status}); wrote {out}")
    if args.screenshot:
        screenshot(out, out.with_suffix(".png"), args.window_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
