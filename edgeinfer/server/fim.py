"""Fill-in-the-middle prompts built the way llama-server's `format_infill` builds them.

    [extra context: FIM_REP "myproject\\n" (FIM_SEP filename "\\n" text)* FIM_SEP "filename\\n"]
    [BOS] FIM_PRE prefix prompt FIM_SUF suffix FIM_MID

The prefix keeps its last 3/4 of a batch, the suffix its first 1/4 (minus the prompt),
and the extra chunks fill what the context has left after a batch and twice n_predict,
newest last. Same layout => editor plugins get the completions they were tuned for,
and a keystroke-sized edit keeps the long common prefix cached.
"""

from __future__ import annotations

import threading
from typing import Iterator

from edgeinfer.server.errors import APIError

N_BATCH = 2048  # llama-server's default batch, capped by the context as llama.cpp does
# llama-server's separator for extra chunks when the vocabulary has no FIM_SEP token
CHUNK_SEPARATOR = "\n\n--- snippet ---\n\n"


def has_fim(tokenizer) -> bool:
    return all(getattr(tokenizer, a, None) is not None for a in ("fim_pre_id", "fim_suf_id", "fim_mid_id"))


def infill_tokens(tokenizer, prefix: str, suffix: str, *, extra: list[tuple[str, str]] = (),
                  prompt: str = "", n_ctx: int, n_predict: int) -> list[int]:
    """Token ids of the FIM prompt; `extra` holds (filename, text) context chunks."""
    if not has_fim(tokenizer):
        raise APIError(400, "model has no FIM tokens: fill-in-the-middle needs a code model "
                            "with FIM_PRE/FIM_SUF/FIM_MID tokens")

    def tok(text: str, parse_special: bool = False) -> list[int]:
        return tokenizer.tokenize(text, add_special=False, parse_special=parse_special) if text else []

    n_batch = min(N_BATCH, n_ctx)
    extra_tokens: list[int] = []
    rep, sep = getattr(tokenizer, "fim_rep_id", None), getattr(tokenizer, "fim_sep_id", None)
    if rep is not None:
        extra_tokens += [rep] + tok("myproject\n")
    for filename, text in extra:
        if sep is not None:
            extra_tokens += [sep] + tok(filename + "\n")
        else:
            extra_tokens += tok(CHUNK_SEPARATOR)
        extra_tokens += tok(text)
    if sep is not None:
        extra_tokens += [sep] + tok("filename\n")

    prompt_tokens = tok(prompt, parse_special=True)
    prefix_tokens, suffix_tokens = tok(prefix), tok(suffix)
    n_prefix_take = min(len(prefix_tokens), 3 * (n_batch // 4))
    n_suffix_take = min(len(suffix_tokens), max(0, n_batch // 4 - (2 + len(prompt_tokens))))
    n_extra_take = min(max(0, n_ctx - n_batch - 2 * max(n_predict, 0)), len(extra_tokens))

    head = [tokenizer.fim_pre_id] + prefix_tokens[len(prefix_tokens) - n_prefix_take:] + prompt_tokens
    tail = [tokenizer.fim_suf_id] + suffix_tokens[:n_suffix_take]
    if getattr(tokenizer, "add_bos", False) and tokenizer.bos_id is not None:
        head = [tokenizer.bos_id] + head
    extra_part = extra_tokens[len(extra_tokens) - n_extra_take:] if n_extra_take else []
    return extra_part + head + tail + [tokenizer.fim_mid_id]


def fim_start(model, params: dict, *, prefix: str, suffix: str, extra: list[tuple[str, str]] = (),
              prompt: str = ""):
    """A worker start function: build the FIM prompt (on the worker thread) and generate."""
    if not has_fim(model.tokenizer):
        infill_tokens(model.tokenizer, prefix, suffix, n_ctx=model.n_ctx, n_predict=0)  # raises the 400
    n_predict = params.get("max_tokens", -1)

    def start(cancel: threading.Event) -> Iterator:
        ids = infill_tokens(model.tokenizer, prefix, suffix, extra=list(extra), prompt=prompt,
                            n_ctx=model.n_ctx, n_predict=n_predict)
        return model.generate(ids, stream=True, cancel=cancel, **params)

    return start
