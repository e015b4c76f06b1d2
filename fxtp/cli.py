"""The ``fxtp`` command line (also ``python -m fxtp``).

Examples::

    fxtp demo                    # tiny GPT over 2 local gloo ranks, prints the report
    fxtp demo --world-size 4
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

__all__ = ["get_args_parser", "main"]


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fxtp",
        description="Automatic tensor parallelism for PyTorch models.",
        epilog="example: fxtp demo --world-size 2",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="run a tiny GPT over local gloo ranks and check it against the single-device model",
        epilog="example: fxtp demo --world-size 4",
    )
    demo.add_argument("--world-size", type=int, default=2, help="number of local ranks (default: 2)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = get_args_parser().parse_args(argv)
    if args.command == "demo":
        if args.world_size < 1:
            print("fxtp: error: --world-size must be >= 1", file=sys.stderr)
            return 2
        from fxtp.demo import run_demo

        run_demo(args.world_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
