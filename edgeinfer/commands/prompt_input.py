"""`edgeinfer run`'s one-shot prompt, bounded by the context before it is read or tokenized whole.

A 100 MB stdin used to be read and tokenized whole before the context check (minutes).
Now:

- `read_stdin_prompt` reads at most `--ctx-size` x MAX_CHARS_PER_TOKEN characters (no
  tokenizer's token covers more; Gemma 3's longest covers 31) and stops there: more
  cannot fit, whatever the model. It runs before the model loads.
- `check_prompt_length` tokenizes growing prefixes of a long prompt and stops as soon as
  one holds more tokens than the window, so a too-long prompt costs about as much as one
  that fills the context. A prompt that may fit goes on to the exact check
  (edgeinfer.generate.check_prompt_fits) with its template and special tokens.
"""

from __future__ import annotations

from edgeinfer.errors import ContextOverflowError

MAX_CHARS_PER_TOKEN = 256
MAX_STDIN_CHARS = 1 << 30  # 1 Gi characters, whatever --ctx-size says
READ_CHUNK = 1 << 20
PREFIX_MARGIN = 16  # tokens a prefix cut mid-word may gain over the same text uncut
SHORT_PROMPT_CHARS_PER_TOKEN = 8  # prompts up to 8 characters a token are tokenized whole, as before


def read_stdin_prompt(stream, n_ctx: int) -> str:
    """The text on `stream`, read in chunks; more than a context of `n_ctx` tokens can hold
    is one error line, raised as soon as that much has been read."""
    limit = min(n_ctx * MAX_CHARS_PER_TOKEN, MAX_STDIN_CHARS)
    parts: list[str] = []
    n = 0
    while True:
        chunk = stream.read(min(READ_CHUNK, limit + 1 - n))
        if not chunk:
            return "".join(parts)
        parts.append(chunk)
        n += len(chunk)
        if n > limit:
            if limit == MAX_STDIN_CHARS:
                raise ContextOverflowError(f"the prompt on stdin is over {MAX_STDIN_CHARS} characters, more than "
                                           f"edgeinfer reads; shorten it")
            raise ContextOverflowError(f"the prompt on stdin is over {limit} characters, more than a context of "
                                       f"{n_ctx} tokens holds; shorten it or raise --ctx-size")


def check_prompt_length(model, text: str) -> None:
    """Raise ContextOverflowError when `text` alone holds more tokens than the model's
    window, tokenizing no more of it than that takes."""
    n_ctx = model.n_ctx
    if len(text) <= n_ctx * SHORT_PROMPT_CHARS_PER_TOKEN:
        return
    need = n_ctx + PREFIX_MARGIN
    length = 2 * need
    while True:
        cut = _cut(text, length)
        n = len(model.tokenize(text[:cut], add_special=False))
        if n >= need:
            raise ContextOverflowError(f"prompt has more than {n_ctx} tokens but the context holds {n_ctx}; "
                                       f"shorten it or raise --ctx-size")
        if cut >= len(text):
            return  # it may fit: the exact check follows, on the prompt as the model reads it
        # characters per token so far, and a quarter more, so one more prefix usually settles it
        length = max(length * 3 // 2, cut * need * 5 // (4 * max(n, 1)))


def _cut(text: str, length: int) -> int:
    """Where a prefix of about `length` characters ends: after a whitespace when one is near."""
    if length >= len(text):
        return len(text)
    space = max(text.rfind(" ", length - 64, length), text.rfind("\n", length - 64, length))
    return space + 1 if space > 0 else length
