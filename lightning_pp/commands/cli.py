"""``lightning-pp`` command line: a thin dispatcher over ``lightning_pp.commands.*``.

Each subcommand lives in its own module exposing ``register(subparsers)``, which adds its parser
and sets ``func`` (called with the parsed namespace, returning an exit code).
"""

from __future__ import annotations

import argparse
import importlib
import re
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


def attach_negative_values(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """``--opt -1GiB`` -> ``--opt=-1GiB`` for every option (of any subcommand) taking a value.

    argparse reads a value that starts with ``-`` and is not a plain number as another option,
    so ``--memory-per-device -1GiB`` ended in ``expected one argument``, an error about the
    command line instead of the value. Attached, the value reaches the option's own check,
    which says what a valid value looks like.
    """
    takes_value: set[str] = set()
    parsers = [parser]
    while parsers:
        p = parsers.pop()
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                parsers.extend(action.choices.values())
            elif action.option_strings and action.nargs is None:
                takes_value.update(action.option_strings)
    out: list[str] = []
    it = iter(argv)
    for token in it:
        if token in takes_value:
            value = next(it, None)
            if value is not None and re.match(r"-[0-9.]", value):
                out.append(f"{token}={value}")
                continue
            out.append(token)
            if value is not None:
                out.append(value)
            continue
        out.append(token)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(attach_negative_values(parser, sys.argv[1:] if argv is None else argv))
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
