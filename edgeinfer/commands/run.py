"""`edgeinfer run NAME [PROMPT]`: its flags, and the choice between one answer and exit or the
interactive session (edgeinfer.commands.repl, like `ollama run`)."""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager

from edgeinfer.commands.answer import answer, messages_for
from edgeinfer.commands.arg_types import non_negative_int
from edgeinfer.commands.run_session import resume_session, save_run_session
from edgeinfer.errors import EdgeInferError


def add_model_options(p) -> None:
    """Flags shared by commands that load a model (run, chat, serve, bench)."""
    p.add_argument("-c", "--ctx-size", type=_positive_int, default=4096, metavar="N",
                   help="context size in tokens (default 4096)")
    p.add_argument("-t", "--threads", type=_positive_int, default=None, metavar="N",
                   help="CPU threads (default: all cores)")
    p.add_argument("--backend", choices=("cpu", "reference"), default="cpu",
                   help="compute backend (reference = slow numpy, for checking)")
    p.add_argument("-ngl", "--gpu-layers", default="auto", metavar="N|auto",
                   help="layers to offload to a CUDA GPU (default auto: as many as fit; 0 = CPU only)")
    p.add_argument("--chat-template", default=None, metavar="NAME|JINJA",
                   help="built-in template name (gemma, llama3, chatml) or a Jinja template")
    p.add_argument("--prefill-chunk", type=_positive_int, default=256, metavar="N",
                   help="prompt tokens evaluated per forward pass (default 256)")
    p.add_argument("--kv-pool-mb", type=_positive_float, default=None, metavar="MB",
                   help="cap the KV block pool (default: 2 x ctx-size tokens, to keep a cached prefix)")
    p.add_argument("--context-shift", dest="context_shift", action="store_true", default=None,
                   help="when the context fills, drop the oldest half after --keep tokens and go on")
    p.add_argument("--no-context-shift", dest="context_shift", action="store_false",
                   help="stop with finish reason 'length' when the context fills")
    p.add_argument("--keep", type=non_negative_int, default=0, metavar="N",
                   help="tokens at the start kept by a context shift (default 0)")


def model_kwargs(args, context_shift: bool = False) -> dict:
    """edgeinfer.load keywords from the add_model_options flags; `context_shift` = this
    command's default when neither --context-shift nor --no-context-shift is given."""
    if args.keep < 0:
        raise EdgeInferError(f"--keep must be at least 0, got {args.keep}")
    shift = context_shift if args.context_shift is None else args.context_shift
    return dict(n_ctx=args.ctx_size, threads=args.threads, backend=args.backend,
                chat_template=args.chat_template, gpu_layers=args.gpu_layers,
                prefill_chunk=args.prefill_chunk, kv_pool_mb=args.kv_pool_mb,
                context_shift=shift, n_keep=args.keep)


def add_sampling_options(p) -> None:
    p.add_argument("-n", "--max-tokens", type=int, default=-1, metavar="N",
                   help="stop after N tokens (-1 = until the model stops or the context is full)")
    p.add_argument("--temp", type=float, default=0.8, help="temperature; 0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=40, help="top-k (0 = off, default 40)")
    p.add_argument("--top-p", type=float, default=0.95, help="top-p (1 = off, default 0.95)")
    p.add_argument("--min-p", type=float, default=0.05, help="min-p (0 = off, default 0.05)")
    p.add_argument("--repeat-penalty", type=float, default=1.0, help="repetition penalty (1 = off)")
    p.add_argument("--seed", type=int, default=None, help="random seed for a reproducible run")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")


def register(sub) -> None:
    p = sub.add_parser("run", help="answer a prompt, or chat interactively, in the terminal")
    p.add_argument("name", help="model alias, hf.co/owner/repo[:quant] or path to a .gguf file")
    p.add_argument("prompt", nargs="?", help="prompt (default: read stdin when it is not a terminal)")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--raw", action="store_true", help="plain completion: no chat template")
    p.add_argument("--verbose", action="store_true", help="print timings after each answer")
    p.add_argument("--session", default=None, metavar="S",
                   help="resume the saved session S (created if new) and save it after each answer")
    p.add_argument("--session-kv", action="store_true",
                   help="also save the session's KV cache, so resuming needs no prefill")
    add_model_options(p)
    add_sampling_options(p)
    p.set_defaults(func=run)


def sampling_from_args(args) -> dict:
    params = dict(max_tokens=args.max_tokens, temperature=args.temp, top_k=args.top_k,
                  top_p=args.top_p, min_p=args.min_p, repeat_penalty=args.repeat_penalty,
                  seed=args.seed, stop=list(args.stop))
    from edgeinfer.sampling import SamplingParams

    SamplingParams(**params).validate()  # bad flag values fail before the model loads
    return params


def load_with_spinner(args):
    import edgeinfer

    kwargs = model_kwargs(args, context_shift=True)  # as llama-cli: a long chat goes on
    with spinner(f"loading {args.name}"):
        model = edgeinfer.load(args.name, **kwargs)
    if getattr(args, "verbose", False) or args.gpu_layers not in ("auto", "0", 0):
        print(model.placement, file=sys.stderr)
    return model


def run(args) -> int:
    params = sampling_from_args(args)
    session = getattr(args, "session", None)
    if session is not None:
        from edgeinfer.saved_session import check_name

        check_name(session)  # before the model loads
        if args.raw:
            raise EdgeInferError("--session keeps a chat; it cannot be combined with --raw")
    prompt = args.prompt
    if prompt is None and not sys.stdin.isatty():
        prompt = sys.stdin.read()
    if prompt is not None and not prompt.strip():
        print("edgeinfer: error: no prompt given", file=sys.stderr)
        return 2
    model = load_with_spinner(args)
    raw = completion_mode(model, args)
    system, history = args.system, []
    if session is not None:
        system, history = resume_session(model, session, params, args.system)
    if prompt is not None:
        one_shot = dict(params)
        if one_shot["max_tokens"] < 0:
            # The default -n stops where the window ends; only an explicit -n goes past it.
            one_shot["context_shift"] = False
        text = answer(model, messages_for(system, history, prompt), one_shot, raw, args.verbose)
        if session is not None:
            history += [{"role": "user", "content": prompt}, {"role": "assistant", "content": text}]
            save_run_session(model, session, system, history, params, args.session_kv)
        return 0
    from edgeinfer.commands.repl import Repl

    return Repl(model, args, params, raw, system, history).loop()


def completion_mode(model, args) -> bool:
    """Whether `run` completes plain text rather than chatting: --raw, or (as llama-cli) a
    model whose file has no chat template, unless --chat-template or --session asks for chat."""
    if args.raw:
        return True
    if args.chat_template is not None or model.template.from_file:
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


def _positive_float(text: str) -> float:
    import argparse

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
    return value


def _positive_int(text: str) -> int:
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value
