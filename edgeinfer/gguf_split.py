"""Split GGUF files (llama.cpp's gguf-split format): part names and the checks that tie parts together.

A model published in parts is `{prefix}-00001-of-0000N.gguf` ... `{prefix}-0000N-of-0000N.gguf`
(llama.cpp's `llama_split_path`). Each part is a complete GGUF holding its own tensors, with
`split.no` (0-based), `split.count` and `split.tensors.count` (the tensors over all parts); the
first part also carries all the model's metadata. As in llama.cpp, the path a user opens must be
the first part, and the others are found next to it by name.

This module knows names and keys only; `gguf_file` maps the parts and asks it what to open and
whether what it found agrees. Every problem is a one-line `GGUFError` naming the file.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

from edgeinfer.errors import GGUFError
from edgeinfer.metadata import meta_int

KEY_NO, KEY_COUNT, KEY_TENSORS = "split.no", "split.count", "split.tensors.count"
# llama.cpp reads split.count as u16; real splits have tens of parts. More is a corrupt header,
# and checking it before looking for the parts keeps a hostile count from costing 65k stat calls.
MAX_PARTS = 9999
_PART_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)


@dataclass(frozen=True)
class SplitKeys:
    no: int      # 0-based
    count: int
    n_tensors: int


def part_name(prefix: str, no: int, count: int) -> str:
    """The file name of part `no` (0-based) of `count`, as llama.cpp's llama_split_path writes it."""
    return f"{prefix}-{no + 1:05d}-of-{count:05d}.gguf"


def parse_part_name(name: str) -> tuple[str, int, int] | None:
    """`big-Q4_K_M-00002-of-00003.gguf` -> ('big-Q4_K_M', 1, 3); None for a name of no part."""
    m = _PART_NAME.match(name)
    if m is None or not 1 <= int(m["no"]) <= int(m["count"]):
        return None
    return m["prefix"], int(m["no"]) - 1, int(m["count"])


def part_names(name: str) -> list[str]:
    """Every part's name of the split set `name` belongs to (repo paths keep their folder);
    `[name]` for a file that is not a part."""
    folder, _, base = name.rpartition("/")
    parsed = parse_part_name(base)
    if parsed is None:
        return [name]
    prefix, _, count = parsed
    # the set's own spelling of ".gguf": a repo on a case-sensitive filesystem may use ".GGUF"
    ext = base[-len(".gguf"):]
    lead = folder + "/" if folder else ""
    return [lead + part_name(prefix, i, count)[: -len(".gguf")] + ext for i in range(count)]


def read_keys(md: Mapping[str, Any], path: Path) -> SplitKeys | None:
    """The split keys of a part, checked before any is believed; None for an unsplit file
    (no split.count, or a count of 1, which llama.cpp loads as one file)."""
    if md.get(KEY_COUNT) is None:
        return None
    count = meta_int(md, KEY_COUNT, 1, MAX_PARTS)
    if count == 1:
        return None
    no = meta_int(md, KEY_NO, 0, count - 1)
    n_tensors = meta_int(md, KEY_TENSORS, 0, 1 << 20)
    # every part but a metadata-only first one holds a tensor: more parts is a corrupt count
    if count > n_tensors + 1:
        raise GGUFError(f"{path}: corrupt split header: {count} parts for {n_tensors} tensors")
    return SplitKeys(no, count, n_tensors)


def other_parts(first: Path, keys: SplitKeys) -> list[Path]:
    """Paths of parts 2..N of the split set whose first part is `first`, each checked to exist."""
    parsed = parse_part_name(first.name)
    if keys.no != 0:
        hint = (part_name(parsed[0], 0, keys.count) if parsed and parsed[2] == keys.count
                else f"the file named ...-00001-of-{keys.count:05d}.gguf")
        raise GGUFError(f"{first}: is part {keys.no + 1} of {keys.count} of a split GGUF; "
                        f"open its first part, {hint}")
    if parsed is None or parsed[1:] != (0, keys.count):
        raise GGUFError(f"{first}: split GGUF part 1 of {keys.count}, but its name does not end in "
                        f"-00001-of-{keys.count:05d}.gguf, so its other parts cannot be found")
    paths = [first.with_name(name) for name in part_names(first.name)[1:]]
    for i, path in enumerate(paths, start=2):
        if not path.is_file():
            raise GGUFError(f"{first}: split GGUF part {i} of {keys.count} is missing: {path}")
    return paths


def check_part(md: Mapping[str, Any], path: Path, no: int, first: SplitKeys) -> None:
    """A non-first part must say it is part `no` of the same set."""
    if md.get(KEY_COUNT) is None or md.get(KEY_NO) is None:
        got = "no split keys"
    else:
        count, its_no = meta_int(md, KEY_COUNT, 1, MAX_PARTS), meta_int(md, KEY_NO, 0, MAX_PARTS - 1)
        if (its_no, count) == (no, first.count):
            return
        got = f"split.no {its_no}, split.count {count}"
    raise GGUFError(f"{path}: expected split GGUF part {no + 1} of {first.count} "
                    f"(split.no {no}, split.count {first.count}), found {got}")


def join_tensors(parts: list[tuple[Path, dict]], first: SplitKeys) -> dict:
    """One tensor table over all parts, each entry marked with the part that holds it."""
    joined: dict = {}
    where: dict[str, Path] = {}
    for no, (path, tensors) in enumerate(parts):
        for name, info in tensors.items():
            if name in joined:
                raise GGUFError(f"{path}: tensor {name!r} is also in {where[name].name}")
            joined[name] = replace(info, part=no)
            where[name] = path
    if len(joined) != first.n_tensors:
        raise GGUFError(f"{parts[0][0]}: split GGUF holds {len(joined)} tensors over {first.count} parts, "
                        f"but split.tensors.count says {first.n_tensors}")
    return joined
