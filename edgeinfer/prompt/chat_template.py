"""Chat templates: render `tokenizer.chat_template` the way HF `apply_chat_template` does.

The template runs in edgeinfer.prompt.template_sandbox (sandboxed Jinja2 under a time, output and
memory budget, HF's extensions). A file without a template gets a built-in one for its
family (`edgeinfer/data/templates/<name>.jinja`: gemma, llama3, chatml). Any problem while
parsing or rendering is a one-line `TemplateError` naming it (with the template line).

    tmpl = ChatTemplate.for_model(gguf.metadata, override=None)
    prompt = tmpl.render([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
"""

from __future__ import annotations

import threading
from importlib import resources
from typing import Any, Mapping, Sequence

from edgeinfer.errors import TemplateError
from edgeinfer.metadata import MAX_VOCAB, meta_int, meta_str, meta_str_array
from edgeinfer.prompt.template_sandbox import compile_template, render_budgeted

BUILTIN_TEMPLATES = ("gemma", "llama3", "chatml")

# general.architecture -> built-in template for files that carry none
_ARCH_TEMPLATE = {
    "gemma": "gemma", "gemma2": "gemma", "gemma3": "gemma", "gemma3n": "gemma",
    "llama": "llama3",
    "qwen2": "chatml", "qwen2moe": "chatml", "qwen3": "chatml", "qwen3moe": "chatml",
    "qwen35": "chatml", "qwen35moe": "chatml",
}
# Text that ends an assistant turn in each built-in format (a hint for stop strings).
_STOP_STRINGS = {"gemma": ("<end_of_turn>",), "llama3": ("<|eot_id|>",), "chatml": ("<|im_end|>",)}


def builtin_template_source(name: str) -> str:
    if name not in BUILTIN_TEMPLATES:
        raise TemplateError(f"unknown built-in chat template {name!r} "
                            f"(built-ins: {', '.join(BUILTIN_TEMPLATES)})")
    return (resources.files("edgeinfer") / "data" / "templates" / f"{name}.jinja").read_text()


class ChatTemplate:
    """One chat template, compiled once; `render` turns messages into the prompt text."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "",
                 name: str | None = None, *, lazy: bool = False) -> None:
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.name = name or "custom"
        self.from_file = False  # True only for the model file's own template (for_model)
        # a built-in (lazy) compiles at its first render: a plain completion never needs it;
        # any other source compiles now, so a broken one fails the load with its error
        self._compiled = None if lazy else compile_template(source, self.name)

    @property
    def _template(self):
        if self._compiled is None:
            self._compiled = compile_template(self.source, self.name)
        return self._compiled

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """Turn-end markers for the built-in formats ('' for custom: rely on EOG tokens)."""
        return _STOP_STRINGS.get(self.name, ())

    @classmethod
    def builtin(cls, name: str, bos_token: str = "", eos_token: str = "") -> "ChatTemplate":
        return cls(builtin_template_source(name), bos_token, eos_token, name=name, lazy=True)

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
        source = meta_str(metadata, "tokenizer.chat_template", None)
        if source is not None and source.strip():
            tmpl = cls(source, bos, eos, name="model")
            tmpl.from_file = True
            return tmpl
        arch = meta_str(metadata, "general.architecture", "")
        return cls.builtin(_ARCH_TEMPLATE.get(arch, "chatml"), bos, eos)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               tools: Sequence[Any] | None = None, *, cancel: threading.Event | None = None,
               **kwargs: Any) -> str:
        """HF apply_chat_template(tokenize=False): the prompt text, special tokens as text.

        Runs under the render budget (edgeinfer.prompt.template_sandbox): past it,
        TemplateBudgetError; once `cancel` is set, TemplateCancelled."""
        if not isinstance(messages, (list, tuple)) or not all(isinstance(m, Mapping) for m in messages):
            raise TemplateError("chat messages must be a list of {'role': ..., 'content': ...}")
        context = {"bos_token": self.bos_token, "eos_token": self.eos_token, **kwargs,
                   "messages": [dict(m) for m in messages], "tools": tools,
                   "add_generation_prompt": add_generation_prompt}
        text = render_budgeted(self._template, context, self.name, cancel)
        if add_generation_prompt and kwargs.get("enable_thinking") is False:
            text = close_forced_thinking(text)
        return text

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


def close_forced_thinking(prompt: str) -> str:
    """A template that opens the thinking block itself (DeepSeek R1, QwQ: the generation prompt
    ends with `<think>`) has no switch to honour enable_thinking=False: close the block, so
    the answer starts after it, as llama.cpp does with reasoning off."""
    return prompt + "</think>" if prompt.rstrip().endswith("<think>") else prompt


def _special_text(metadata: Mapping[str, Any], which: str) -> str:
    tokens = meta_str_array(metadata, "tokenizer.ggml.tokens", None)
    tid = meta_int(metadata, f"tokenizer.ggml.{which}_token_id", 0, MAX_VOCAB, None)
    if tokens is None or tid is None or tid >= len(tokens):
        return ""
    return tokens[tid]

