"""Ollama Modelfiles read into their parts: FROM, TEMPLATE, SYSTEM, PARAMETER, LICENSE.

Values are a bare rest of line, a "quoted" string or a \"\"\"triple-quoted\"\"\" block over several
lines; `#` starts a comment line. Commands are case-insensitive, as in Ollama. ADAPTER and
MESSAGE are refused (no LoRA adapters, no seeded conversations here).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from edgeinfer.errors import EdgeInferError

MAX_MODELFILE = 1 << 20


class ModelfileError(EdgeInferError):
    """A Modelfile that cannot be read; the message names the line."""


@dataclass
class Modelfile:
    from_: str | None = None
    template: str | None = None
    system: str | None = None
    license: list[str] = field(default_factory=list)
    parameters: dict[str, Any] = field(default_factory=dict)


def parse(text: str) -> Modelfile:
    if len(text) > MAX_MODELFILE:
        raise ModelfileError(f"the Modelfile is longer than {MAX_MODELFILE} characters")
    out = Modelfile()
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line, number = lines[i].strip(), i + 1
        i += 1
        if not line or line.startswith("#"):
            continue
        command, _, rest = line.partition(" ")
        command, rest = command.upper(), rest.strip()
        if command in ("TEMPLATE", "SYSTEM", "LICENSE", "FROM"):
            value, i = _value(rest, lines, i, number)
            if command == "FROM":
                out.from_ = value
            elif command == "LICENSE":
                out.license.append(value)
            else:
                setattr(out, command.lower(), value)
        elif command == "PARAMETER":
            key, _, raw = rest.partition(" ")
            if not key or not raw.strip():
                raise ModelfileError(f"Modelfile line {number}: PARAMETER needs a name and a value")
            value, i = _value(raw.strip(), lines, i, number)
            if key == "stop":
                out.parameters.setdefault("stop", []).append(value)
            else:
                out.parameters[key] = _number(value)
        elif command in ("ADAPTER", "MESSAGE"):
            raise ModelfileError(f"Modelfile line {number}: {command} is not supported")
        else:
            raise ModelfileError(f"Modelfile line {number}: unknown command {command!r}")
    return out


def _value(rest: str, lines: list[str], i: int, number: int) -> tuple[str, int]:
    """The value starting at `rest` (a triple-quoted one may go on over the next lines)."""
    if rest.startswith('"""'):
        body = rest[3:]
        if '"""' in body:
            return body[: body.index('"""')], i
        parts = [body]
        while i < len(lines):
            line = lines[i]
            i += 1
            if '"""' in line:
                parts.append(line[: line.index('"""')])
                return "\n".join(parts).strip("\n"), i
            parts.append(line)
        raise ModelfileError(f"Modelfile line {number}: unclosed \"\"\"")
    if len(rest) >= 2 and rest[0] == rest[-1] == '"':
        return rest[1:-1], i
    if not rest:
        raise ModelfileError(f"Modelfile line {number}: missing value")
    return rest, i


def _number(value: str) -> Any:
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(value.lower(), value)
