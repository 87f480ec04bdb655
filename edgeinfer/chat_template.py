"""Chat templates: render `tokenizer.chat_template` the way HF `apply_chat_template` does.

Sandboxed Jinja2 (ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks, the
`loopcontrols` extension, HF's `tojson`, `raise_exception`, `strftime_now` and the
`{% generation %}` tag). A file without a template gets a built-in one for its family
(`edgeinfer/data/templates/<name>.jinja`: gemma, llama3, chatml). Any problem while
parsing or rendering is a one-line `TemplateError` naming it (with the template line).

    tmpl = ChatTemplate.for_model(gguf.metadata, override=None)
    prompt = tmpl.render([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from importlib import resources
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from edgeinfer.errors import TemplateError

BUILTIN_TEMPLATES = ("gemma", "llama3", "chatml")

# general.architecture -> built-in template for files that carry none
_ARCH_TEMPLATE = {
    "gemma": "gemma", "gemma2": "gemma", "gemma3": "gemma", "gemma3n": "gemma",
    "llama": "llama3",
    "qwen2": "chatml", "qwen2moe": "chatml", "qwen3": "chatml", "qwen3moe": "chatml",
}
# Text that ends an assistant turn in each built-in format (a hint for stop strings).
_STOP_STRINGS = {"gemma": ("<end_of_turn>",), "llama3": ("<|eot_id|>",), "chatml": ("<|im_end|>",)}


class _GenerationTag(jinja2.ext.Extension):
    """HF's `{% generation %}...{% endgeneration %}` marks assistant text; render it as-is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


class _RaisedByTemplate(Exception):
    """raise_exception() from inside a template; becomes TemplateError with its message."""


def _raise_exception(message: str) -> None:
    raise _RaisedByTemplate(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # HF's tojson: no HTML escaping, unicode kept (jinja's own filter escapes < > & ').
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def builtin_template_source(name: str) -> str:
    if name not in BUILTIN_TEMPLATES:
        raise TemplateError(f"unknown built-in chat template {name!r} "
                            f"(built-ins: {', '.join(BUILTIN_TEMPLATES)})")
    return (resources.files("edgeinfer") / "data" / "templates" / f"{name}.jinja").read_text()


def _template_line(exc: BaseException) -> int | None:
    """The template line a render error came from (jinja rewrites tracebacks to it)."""
    line = None
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


class ChatTemplate:
    """One chat template, compiled once; `render` turns messages into the prompt text."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "",
                 name: str | None = None) -> None:
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.name = name or "custom"
        self.from_file = False  # True only for the model file's own template (for_model)
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise TemplateError(f"chat template {self.name}: syntax error at line {exc.lineno}: "
                                f"{exc.message}") from None

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """Turn-end markers for the built-in formats ('' for custom: rely on EOG tokens)."""
        return _STOP_STRINGS.get(self.name, ())

    @classmethod
    def builtin(cls, name: str, bos_token: str = "", eos_token: str = "") -> "ChatTemplate":
        return cls(builtin_template_source(name), bos_token, eos_token, name=name)

    @classmethod
    def for_model(cls, metadata: Mapping[str, Any], override: str | None = None) -> "ChatTemplate":
        """The file's template, or `override` (a built-in name or raw Jinja), or a built-in."""
        bos, eos = _special_text(metadata, "bos"), _special_text(metadata, "eos")
        if override is not None:
            if override in BUILTIN_TEMPLATES:
                return cls.builtin(override, bos, eos)
            if "{{" in override or "{%" in override:
                return cls(override, bos, eos, name="override")
            raise TemplateError(f"unknown chat template {override!r}: give a built-in name "
                                f"({', '.join(BUILTIN_TEMPLATES)}) or Jinja source")
        source = metadata.get("tokenizer.chat_template")
        if isinstance(source, str) and source.strip():
            tmpl = cls(source, bos, eos, name="model")
            tmpl.from_file = True
            return tmpl
        arch = str(metadata.get("general.architecture", ""))
        return cls.builtin(_ARCH_TEMPLATE.get(arch, "chatml"), bos, eos)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               tools: Sequence[Any] | None = None, **kwargs: Any) -> str:
        """HF apply_chat_template(tokenize=False): the prompt text, special tokens as text."""
        if not isinstance(messages, (list, tuple)) or not all(isinstance(m, Mapping) for m in messages):
            raise TemplateError("chat messages must be a list of {'role': ..., 'content': ...}")
        context = {"bos_token": self.bos_token, "eos_token": self.eos_token, **kwargs,
                   "messages": [dict(m) for m in messages], "tools": tools,
                   "add_generation_prompt": add_generation_prompt}
        try:
            return self._template.render(**context)
        except _RaisedByTemplate as exc:
            raise TemplateError(f"chat template {self.name}: {exc}") from None
        except jinja2.TemplateError as exc:
            line = _template_line(exc)
            where = f" at line {line}" if line else ""
            raise TemplateError(f"chat template {self.name}{where}: {type(exc).__name__}: "
                                f"{exc}") from None
        except Exception as exc:  # noqa: BLE001 - any failure inside user-supplied Jinja
            line = _template_line(exc)
            where = f" at line {line}" if line else ""
            raise TemplateError(f"chat template {self.name}{where}: {type(exc).__name__}: "
                                f"{exc}") from None

    def render_prompt(self, messages: Sequence[Mapping[str, Any]], add_bos: bool,
                      add_eos: bool = False, **kwargs: Any) -> str:
        """`render`, minus a leading BOS / trailing EOS text the tokenizer adds itself
        (llama.cpp does the same, so the prompt never starts with two BOS tokens)."""
        text = self.render(messages, **kwargs)
        if add_bos and self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token):]
        if add_eos and self.eos_token and text.endswith(self.eos_token):
            text = text[:-len(self.eos_token)]
        return text


def _special_text(metadata: Mapping[str, Any], which: str) -> str:
    tokens = metadata.get("tokenizer.ggml.tokens")
    tid = metadata.get(f"tokenizer.ggml.{which}_token_id")
    if tokens is None or tid is None or not 0 <= int(tid) < len(tokens):
        return ""
    return str(tokens[int(tid)])

