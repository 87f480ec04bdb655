"""`edgeinfer pull | list | rm`: the local model store, as `ollama pull/list/rm` present it."""

from __future__ import annotations

import argparse
from datetime import datetime

from edgeinfer.units import human_bytes


def register(subparsers) -> None:
    p = subparsers.add_parser("pull", help="download a model into the local store",
                              description="Download a model: an alias, or hf.co/OWNER/REPO[:QUANT].")
    p.add_argument("name", metavar="NAME")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    p.set_defaults(func=pull_command)

    p = subparsers.add_parser("list", aliases=["ls"], help="list the models in the local store")
    p.set_defaults(func=list_command)

    p = subparsers.add_parser("rm", help="delete a model from the local store")
    p.add_argument("name", metavar="NAME")
    p.set_defaults(func=rm_command)


def pull_command(args: argparse.Namespace) -> int:
    from edgeinfer.store import registry

    path = registry.pull(args.name, progress=not args.quiet)
    print(f"pulled {args.name}: {path}")
    return 0


def list_command(args: argparse.Namespace) -> int:
    from edgeinfer.store import registry

    rows = [(m.name, human_bytes(m.size_bytes), human_age(m.modified)) for m in registry.list_local()]
    header = ("NAME", "SIZE", "MODIFIED")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(3)]
    for row in [header, *rows]:
        print("    ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    return 0


def rm_command(args: argparse.Namespace) -> int:
    from edgeinfer.store import registry

    registry.remove(args.name)
    print(f"deleted '{args.name}'")
    return 0


def human_age(when: datetime, now: datetime | None = None) -> str:
    seconds = max(0.0, ((now or datetime.now()) - when).total_seconds())
    for unit, size in (("year", 365 * 86400), ("month", 30 * 86400), ("week", 7 * 86400),
                       ("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds >= size:
            count = int(seconds // size)
            return f"{count} {unit}{'s' if count > 1 else ''} ago"
    return "just now"
