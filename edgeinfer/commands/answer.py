"""Stream one answer of a loaded model to the terminal (Ctrl-C stops it), with `--verbose` timings."""

from __future__ import annotations

import sys
import threading


def answer(model, messages_or_prompt, params: dict, raw: bool, verbose: bool, out=None, err=None,
           images: list[str] | None = None) -> str:
    """Stream one answer to `out` (stdout); Ctrl-C stops it. `raw` completes the last user
    text as it is, with `images` (files) at its markers; otherwise the messages go through the
    chat template (images as their image parts), and the answer is shown as
    edgeinfer.prompt.shown_answer says (reasoning as a `<think>` block). Returns the text shown."""
    from edgeinfer.kernels_cuda.graph import COUNTS
    from edgeinfer.prompt.shown_answer import ShownAnswer

    launched: dict | None = None  # the GPU launch counts once the first token is out (the prompt's are before)
    out = out if out is not None else sys.stdout
    cancel = threading.Event()
    if raw:
        prompt = messages_or_prompt if isinstance(messages_or_prompt, str) else messages_or_prompt[-1]["content"]
        if images:
            from edgeinfer.commands.image_input import read_image_file

            params = dict(params, images=[read_image_file(p) for p in images])
        chunks = model.generate(prompt, stream=True, cancel=cancel, **params)
    else:
        chunks = model.chat(messages_or_prompt, stream=True, cancel=cancel, **params)
    view = ShownAnswer(None) if raw else ShownAnswer.for_model(model)
    shown: list[str] = []
    last = None

    def show(text: str) -> None:
        if text:
            out.write(text)
            out.flush()
            shown.append(text)

    try:
        for chunk in chunks:
            if launched is None:
                launched = dict(COUNTS)
            show(view.push(chunk.text))
            last = chunk
    except KeyboardInterrupt:
        cancel.set()
        for chunk in chunks:  # let the loop see the cancel and release the model
            last = chunk
    show(view.finish())
    out.write("\n")
    out.flush()
    if verbose and last is not None and last.timings is not None:
        print_timings(last, err if err is not None else sys.stderr)
        print_gpu_launches(model, last, launched or {}, err if err is not None else sys.stderr)
    return "".join(shown)


def print_gpu_launches(model, last, before: dict, err) -> None:
    """With layers on the GPU: what each decoded token (after the first, which the prompt's step
    gives) cost the driver, and why steps ran without a CUDA graph (each reason once)."""
    from edgeinfer.kernels_cuda.graph import COUNTS

    graphs = getattr(getattr(model, "engine", None), "step_graphs", None)
    if graphs is None:
        return
    n = max(1, last.usage.completion_tokens - 1)
    kernels, replays = COUNTS["kernels"] - before.get("kernels", 0), COUNTS["graphs"] - before.get("graphs", 0)
    print(f"GPU launches:         {kernels / n:.1f} kernel(s) + {replays / n:.2f} graph(s) a decoded token",
          file=err)
    for note in graphs.notes[graphs.notes_shown:]:
        print(note, file=err)
    graphs.notes_shown = len(graphs.notes)


def print_timings(last, err) -> None:
    """What `ollama run --verbose` prints after an answer."""
    t, u = last.timings, last.usage
    lines = [
        f"total duration:       {t.prompt_s + t.gen_s:.3f}s",
        f"prompt eval count:    {u.prompt_tokens} token(s) ({u.cached_tokens} cached)",
        f"prompt eval rate:     {t.prompt_tps:.2f} tokens/s",
        f"time to first token:  {t.ttft_s * 1000:.1f}ms",
        f"eval count:           {u.completion_tokens} token(s)",
        f"eval rate:            {t.gen_tps:.2f} tokens/s",
        f"finish reason:        {last.finish_reason}",
    ]
    if t.draft_n:
        lines.append(f"draft acceptance:     {t.acceptance_rate:.1%} ({t.draft_n_accepted} of {t.draft_n} drafted)")
    print("\n".join(lines), file=err)


def messages_for(system: str | None, history: list[dict], user: str) -> list[dict]:
    """The conversation to send: system prompt (if any), earlier turns, the new user text."""
    msgs = [{"role": "system", "content": system}] if system else []
    return msgs + history + [{"role": "user", "content": user}]
