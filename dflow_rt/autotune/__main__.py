"""`python -m dflow_rt.autotune [options]`: the autotune command on its own (same options)."""

import argparse
import sys

from dflow_rt.autotune.cli import add_autotune_parser
from dflow_rt.errors import DflowError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dflow_rt.autotune")
    add_autotune_parser(p.add_subparsers(dest="command", required=True))
    args = p.parse_args(["autotune", *(sys.argv[1:] if argv is None else argv)])
    try:
        args.run(args)
    except DflowError as err:
        print(f"autotune: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
