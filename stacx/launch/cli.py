"""The `stacx` command. Each subcommand lives in its own module under stacx/launch/commands/
and is imported only when it runs, so `stacx --help` stays fast.

A command module defines `HELP` (one line), `add_arguments(parser)` and `run(args) -> int`; one that passes
another program's flags through sets `PREFIX_CHARS` (e.g. "+"), so that its `-`/`--` arguments are its own.
"""

from __future__ import annotations

import argparse
import difflib
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
    "tasks": "tasks",
    "torchrun": "torchrun",
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
        command_parser = sub.add_parser(name, help=module.HELP, description=module.HELP, allow_abbrev=False,
                                        prefix_chars=getattr(module, "PREFIX_CHARS", "-"))
        module.add_arguments(command_parser)
        command_parser.set_defaults(_run=module.run)
    return parser


def close_flags(flag: str, parser: argparse.ArgumentParser, limit: int = 3) -> list[str]:
    """The parser's long flags closest to a mistyped `flag` (difflib ratio >= 0.6), best first."""
    known = [option for action in parser._actions for option in action.option_strings if option.startswith("--")]
    return difflib.get_close_matches(flag.split("=", 1)[0], known, n=limit, cutoff=0.6)


def unknown_flags_message(extras: list[str], parser: argparse.ArgumentParser) -> str:
    """'unrecognized arguments: ...' plus a 'did you mean' for every mistyped flag that has close matches."""
    lines = [f"unrecognized arguments: {' '.join(extras)}"]
    for token in extras:
        if token.startswith("--"):
            matches = close_flags(token, parser)
            if matches:
                lines.append(f"{token.split('=', 1)[0]}: did you mean {' or '.join(matches)}?")
    return "\n".join(lines)


def _command_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[command]
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:  # the command's own parser reports them (its usage line), with close matches
        command_parser = _command_parser(parser, args.command)
        command_parser.error(unknown_flags_message(extras, command_parser))
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
