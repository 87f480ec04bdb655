"""What a chat answer is read into: its tool calls (`ToolCall`) and its parts (`ParsedOutput`).

Kept apart from the parsers (edgeinfer.prompt.tool_calls, edgeinfer.prompt.harmony) so each
can build them without importing the other.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))

    @property
    def arguments_json(self) -> str:
        """OpenAI's `function.arguments` (a JSON string)."""
        return json.dumps(self.arguments, ensure_ascii=False)

    def openai(self, index: int | None = None) -> dict:
        d = {"id": self.id, "type": "function",
             "function": {"name": self.name, "arguments": self.arguments_json}}
        if index is not None:
            d["index"] = index
        return d

    def ollama(self) -> dict:
        return {"function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedOutput:
    content: str
    tool_calls: list[ToolCall]
    reasoning: str | None = None
