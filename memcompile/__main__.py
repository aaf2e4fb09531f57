"""Command line: `python -m memcompile dump plan.json [--html out.html]`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from memcompile.plan_dump import load_plans, to_html, to_text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memcompile", description="memcompile tools")
    commands = parser.add_subparsers(dest="command", required=True)
    dump = commands.add_parser(
        "dump", help="print a plan file (memcompile.dump(..., format='json') or MEMCOMPILE_DUMP_DIR)")
    dump.add_argument("plan_json", help="a plan file: <graph_id>.json")
    dump.add_argument("--html", metavar="OUT", help="also write the live-memory picture to this HTML file")
    args = parser.parse_args(argv)

    try:
        plans = load_plans(args.plan_json)
    except (OSError, ValueError) as error:  # a bad path or file is the user's to fix: no traceback
        print(f"memcompile dump: {args.plan_json}: {error}", file=sys.stderr)
        return 2
    print(to_text(plans))
    if args.html:
        Path(args.html).write_text(to_html(plans), encoding="utf-8")
        print(f"wrote {args.html}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
