"""The `bastion` command: one entry point, one module per subcommand (imported only when used).

Each subcommand module defines `HELP: str`, `add_arguments(parser)` and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import sys

SUBCOMMANDS: dict[str, str] = {
    "demo": "bastion_sglang.demo.target",
    "train-drafter": "bastion_sglang.training.cli",
    "compare-drafters": "bastion_sglang.training.compare_cli",
    "draft-vocab": "bastion_sglang.training.draft_vocab_cli",
    "calibrate": "bastion_sglang.calibration.cli",
    "profile": "bastion_sglang.calibration.profile_cli",
    "bench": "bastion_sglang.bench.cli",
    "step-anatomy": "bastion_sglang.bench.anatomy_cli",
}


def _available() -> dict[str, str]:
    """Subcommands whose module is present in this installation."""
    found = {}
    for name, path in SUBCOMMANDS.items():
        try:
            if importlib.util.find_spec(path) is not None:
                found[name] = path
        except ModuleNotFoundError:  # the parent package of the module is absent
            continue
    return found


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bastion",
        description="BASTION adaptive tree speculative decoding for SGLang: setup, calibration, benchmarks.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, path in _available().items():
        module = importlib.import_module(path)
        command = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(command)
        command.set_defaults(handler=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
