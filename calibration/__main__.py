"""`python -m bastion_sglang.calibration ...`: the same as `bastion calibrate ...`."""

from __future__ import annotations

import argparse
import logging
import sys

from bastion_sglang.calibration import cli


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bastion_sglang.calibration", description=cli.HELP)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    cli.add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return cli.run(args)


if __name__ == "__main__":
    sys.exit(main())
