"""`edgeinfer` command line: one subcommand per module under `edgeinfer.commands`.

Every subcommand module exposes `register(subparsers)`, which adds its parsers and sets
`func=handler` on each; a handler takes the parsed args and returns an exit code.
User errors (`EdgeInferError`) end as one line on stderr and exit code 1.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from edgeinfer import __version__
from edgeinfer.errors import EdgeInferError

# Order here is the order `edgeinfer --help` lists them.
COMMAND_MODULES = [
    "edgeinfer.commands.run",
    "edgeinfer.commands.chat",
    "edgeinfer.commands.serve",
    "edgeinfer.commands.store",
    "edgeinfer.commands.show",
    "edgeinfer.commands.tokenize",
    "edgeinfer.commands.bench",
]


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad flags as one line (exit 2), like every other user error."""

    def error(self, message: str) -> None:  # noqa: D401 - argparse API
        self.exit(2, f"edgeinfer: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="edgeinfer", description="Run GGUF language models locally.")
    parser.add_argument("--version", action="version", version=f"edgeinfer {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # that command is not built yet
                continue
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    # argparse binds an optional positional (run's PROMPT) before later flags are seen, so
    # `run NAME -n 8 "prompt"` leaves the prompt over; take it back here.
    if extras and getattr(args, "prompt", "") is None and not any(e.startswith("-") for e in extras):
        args.prompt = " ".join(extras)
    elif extras:
        parser.error(f"unrecognized arguments: {' '.join(extras)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return int(args.func(args) or 0)
    except EdgeInferError as exc:
        print(f"edgeinfer: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
