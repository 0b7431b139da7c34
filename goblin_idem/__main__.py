"""Command line: `python -m goblin_idem <command>`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _build_module(args: argparse.Namespace) -> int:
    from goblin_idem.native import build_module

    try:
        path = build_module(args.out, cc=args.cc)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    # The path is the last line of output, so scripts can take it with `tail -n 1`.
    print(path)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m goblin_idem")
    sub = parser.add_subparsers(dest="command", required=True)

    build = sub.add_parser(
        "build-module",
        help="compile the GOBLIN.* server module and print the path of the .so",
    )
    build.add_argument(
        "--out",
        metavar="DIR",
        default=None,
        help="output directory (default: a per-user cache directory keyed by the source)",
    )
    build.add_argument(
        "--cc", metavar="COMPILER", default=None, help="C compiler to use (default: $CC or cc)"
    )
    build.set_defaults(func=_build_module)

    from goblin_idem.inspect import add_subcommand as add_inspect

    add_inspect(sub)

    args = parser.parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
