"""`epp-sim` command line. Subcommands are added as the simulator lands."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="epp-sim",
        description="Replay request traces against simulated engines with the production scheduler.",
    )
    p.add_subparsers(dest="command", metavar="COMMAND")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        print("\nNo simulator commands are available in this version yet.", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
