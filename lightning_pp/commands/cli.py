"""``lightning-pp`` command line: a thin dispatcher over ``lightning_pp.commands.*``.

Each subcommand lives in its own module exposing ``register(subparsers)``, which adds its parser
and sets ``func`` (called with the parsed namespace, returning an exit code).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Modules that provide subcommands; each exposes ``register(subparsers)``.
COMMAND_MODULES: tuple[str, ...] = (
    "lightning_pp.commands.schedule",
    "lightning_pp.commands.fit",
    "lightning_pp.commands.plan",
    "lightning_pp.commands.consolidate",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-pp",
        description="Pipeline-parallel training for PyTorch Lightning.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
