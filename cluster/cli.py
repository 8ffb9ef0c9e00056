"""``swakv`` / ``python -m cluster``: one entry point, one subcommand per job."""
from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    from .demo import run
    run()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swakv", description="Sliding-window-aware LLM serving on Ray.")
    sub = parser.add_subparsers(dest="command", metavar="SUBCOMMAND")
    demo = sub.add_parser("demo", help="walk through the KV-cache manager on a hybrid layout")
    demo.set_defaults(func=_demo)
    from .planner import register as register_plan
    register_plan(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
