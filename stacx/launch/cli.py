"""The `stacx` command. Each subcommand lives in its own module under stacx/launch/commands/
and is imported only when it runs, so `stacx --help` stays fast.

A command module defines `HELP` (one line), `add_arguments(parser)` and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> module under stacx.launch.commands
COMMANDS = {
    "train": "train",
    "demo": "demo",
    "recipes": "recipes",
    "serve": "serve",
    "convert": "convert",
    "eval": "eval",
}


def _available_commands() -> dict:
    found = {}
    for name, module_name in COMMANDS.items():
        try:
            found[name] = importlib.import_module(f"stacx.launch.commands.{module_name}")
        except ModuleNotFoundError as err:
            if err.name != f"stacx.launch.commands.{module_name}":
                raise
    return found


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stacx", description="RL and distillation post-training on megatron-core.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module in _available_commands().items():
        # No prefix matching: a mistyped flag must be an error, not silently another flag.
        command_parser = sub.add_parser(name, help=module.HELP, description=module.HELP, allow_abbrev=False)
        module.add_arguments(command_parser)
        command_parser.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
