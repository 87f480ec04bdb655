"""`edgeinfer` command line: one subcommand per module under `edgeinfer.commands`.

Every subcommand module exposes `register(subparsers)`, which adds its parsers and sets
`func=handler` on each; a handler takes the parsed args and returns an exit code.
User errors (`EdgeInferError`) end as one line on stderr and exit code 1.
"""

from __future__ import annotations

import argparse
import importlib
import os
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
    "edgeinfer.commands.embed",
    "edgeinfer.commands.bench",
]


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad flags as one line (exit 2), like every other user error."""

    def error(self, message: str) -> None:  # noqa: D401 - argparse API
        self.exit(2, f"edgeinfer: error: {message}\n")


class _CommandParser(_Parser):
    """A subcommand's parser: options may come before, between or after its positionals
    (`tokenize NAME --pieces TEXT`), as users type them."""

    _intermixing = False

    def parse_known_args(self, args=None, namespace=None):
        # parse_known_intermixed_args calls parse_known_args itself (twice): the guard
        # sends those inner calls to argparse's own parser.
        if self._intermixing:
            return super().parse_known_args(args, namespace)
        self._intermixing = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="edgeinfer", description="Run GGUF language models locally.")
    parser.add_argument("--version", action="version", version=f"edgeinfer {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_CommandParser)
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
    # An unquoted prompt (`run NAME why is the sky blue`) is one prompt, as `ollama run` reads it.
    if extras and hasattr(args, "prompt") and not any(e.startswith("-") for e in extras):
        args.prompt = " ".join(([args.prompt] if args.prompt is not None else []) + extras)
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
    except Exception as exc:  # noqa: BLE001 - a bug or an unforeseen input: one line, not a traceback
        if os.environ.get("EDGEINFER_DEBUG"):
            raise
        print(f"edgeinfer: error: {type(exc).__name__}: {exc} (set EDGEINFER_DEBUG=1 for the traceback)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
