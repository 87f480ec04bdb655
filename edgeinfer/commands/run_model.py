"""`edgeinfer run`'s model, for the command and its interactive session: loaded behind a
spinner, and run as a chat or as plain completion."""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager

from edgeinfer.commands.model_flags import model_kwargs


def load_with_spinner(args):
    """The model `args` name, loaded behind a spinner; its placement printed when it matters."""
    import edgeinfer  # the engine (numpy, numba) loads once a command runs, not for --help

    kwargs = model_kwargs(args, context_shift=True)  # as llama-cli: a long chat goes on
    if hasattr(args, "no_mmproj"):  # `run`'s image flags (edgeinfer.commands.image_input)
        from edgeinfer.commands.image_input import mmproj_of, mmproj_offload_of

        kwargs["mmproj"] = mmproj_of(args)
        kwargs["mmproj_offload"] = mmproj_offload_of(args)
    with spinner(f"loading {args.name}"):
        model = edgeinfer.load(args.name, **kwargs)
    if getattr(args, "verbose", False) or args.gpu_layers not in ("auto", "0", 0):
        print(model.placement, file=sys.stderr)
    return model


def completion_mode(model, args) -> bool:
    """Whether `run` completes plain text rather than chatting: --raw, or (as llama-cli) a
    model whose file has no chat template, unless --chat-template(-file) or --session asks for chat."""
    if args.raw:
        return True
    if args.chat_template is not None or getattr(args, "chat_template_file", None) is not None \
            or model.template.from_file:
        return False
    if getattr(args, "session", None) is not None:
        print(f"{args.name} has no chat template: the session chats through the built-in "
              f"'{model.template.name}' template", file=sys.stderr)
        return False
    print(f"{args.name} has no chat template: running as plain completion "
          f"(use --chat-template NAME to chat)", file=sys.stderr)
    if args.system:
        print("--system is not used in plain completion", file=sys.stderr)
    return True


@contextmanager
def spinner(label: str):
    """A spinner on stderr while the body runs (only on a terminal)."""
    if not sys.stderr.isatty():
        yield
        return
    done = threading.Event()
    t0 = time.perf_counter()

    def spin() -> None:
        frames = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"
        i = 0
        while not done.wait(0.1):
            sys.stderr.write(f"\r{frames[i % len(frames)]} {label} {time.perf_counter() - t0:.1f}s")
            sys.stderr.flush()
            i += 1

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        sys.stderr.write("\r\033[K")
        sys.stderr.flush()
