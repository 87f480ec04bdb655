"""`edgeinfer run NAME [PROMPT]`: one answer and exit, or an interactive chat like `ollama run`.

Interactive commands: /bye, /clear, /set parameter NAME VALUE, /set system TEXT, /show,
/help; a line of three double quotes starts and ends multi-line input; Ctrl-C stops the
current answer (a second Ctrl-C at the prompt, or Ctrl-D, leaves).
"""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager

from edgeinfer.commands.arg_types import non_negative_int
from edgeinfer.errors import EdgeInferError

# `/set parameter` names (Ollama's) -> SamplingParams fields.
PARAMETERS = {
    "temperature": ("temperature", float), "top_k": ("top_k", int), "top_p": ("top_p", float),
    "min_p": ("min_p", float), "seed": ("seed", int), "num_predict": ("max_tokens", int),
    "repeat_penalty": ("repeat_penalty", float), "repeat_last_n": ("repeat_last_n", int),
    "presence_penalty": ("presence_penalty", float), "frequency_penalty": ("frequency_penalty", float),
    "stop": ("stop", str),
}


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
    args.raw = completion_mode(model, args)
    system, history = args.system, []
    if session is not None:
        system, history = resume_session(model, session, params, args.system)
    if prompt is not None:
        one_shot = dict(params)
        if one_shot["max_tokens"] < 0:
            # The default -n stops where the window ends; only an explicit -n goes past it.
            one_shot["context_shift"] = False
        text = answer(model, _messages(system, history, prompt), one_shot, args.raw, args.verbose)
        if session is not None:
            history += [{"role": "user", "content": prompt}, {"role": "assistant", "content": text}]
            save_run_session(model, session, system, history, params, args.session_kv)
        return 0
    return interactive(model, args, params, system, history)


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


def resume_session(model, name: str, params: dict, system: str | None) -> tuple[str | None, list[dict]]:
    """Load saved session `name` (if it exists): its sampling settings replace `params`,
    its K/V (if saved) become the cached prefix. Returns (system prompt, history)."""
    from edgeinfer.saved_session import SessionFileError, load_session, session_path

    path = session_path(name)
    if not path.exists():
        return system, []
    saved = load_session(path, model.identity, model.config.n_layer)
    restored = {**params, **{k: v for k, v in saved.sampling.items() if k in params}}
    try:
        from edgeinfer.sampling import SamplingParams

        SamplingParams(**restored).validate()
    except (TypeError, ValueError, EdgeInferError):
        raise SessionFileError(f"session file {path.name} has invalid sampling settings; not loaded") from None
    params.update(restored)
    messages = list(saved.messages)
    if messages and messages[0]["role"] == "system":
        saved_system = messages.pop(0)["content"]
        system = system or saved_system  # --system given now replaces the saved one
    if saved.n_kv:
        model.sessions.import_kv(saved.tokens, saved.k, saved.v, saved.pos)
    print(f"Resumed session '{name}' ({len(messages) // 2} turn(s)).", file=sys.stderr)
    return system, messages


def save_run_session(model, name: str, system: str | None, history: list[dict], params: dict,
                     with_kv: bool) -> None:
    from edgeinfer.saved_session import SavedSession, save_session, session_path

    saved = SavedSession(messages=_messages_only(system, history), tokens=model.sessions.resident_tokens(),
                         sampling=dict(params))
    if with_kv:
        kv = model.sessions.export_kv()
        if kv is not None:
            saved.tokens, saved.k, saved.v, saved.pos = kv
    save_session(session_path(name), saved, model.identity)


def _messages_only(system: str | None, history: list[dict]) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + list(history)


def answer(model, messages_or_prompt, params: dict, raw: bool, verbose: bool) -> str:
    """Stream one answer to stdout; Ctrl-C stops it. Returns the text shown."""
    cancel = threading.Event()
    if raw:
        prompt = messages_or_prompt if isinstance(messages_or_prompt, str) else messages_or_prompt[-1]["content"]
        chunks = model.generate(prompt, stream=True, cancel=cancel, **params)
    else:
        chunks = model.chat(messages_or_prompt, stream=True, cancel=cancel, **params)
    shown: list[str] = []
    last = None
    try:
        for chunk in chunks:
            if chunk.text:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                shown.append(chunk.text)
            last = chunk
    except KeyboardInterrupt:
        cancel.set()
        for chunk in chunks:  # let the loop see the cancel and release the model
            last = chunk
    sys.stdout.write("\n")
    sys.stdout.flush()
    if verbose and last is not None and last.timings is not None:
        _print_timings(last)
    return "".join(shown)


def _print_timings(last) -> None:
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
    print("\n".join(lines), file=sys.stderr)


def _messages(system: str | None, history: list[dict], user: str) -> list[dict]:
    msgs = [{"role": "system", "content": system}] if system else []
    return msgs + history + [{"role": "user", "content": user}]


def interactive(model, args, params: dict, system: str | None = None,
                history: list[dict] | None = None) -> int:
    session = getattr(args, "session", None)
    system = system if system is not None else args.system
    history = history if history is not None else []
    print(f"{args.name} is ready. Send a message (/? for help, /bye to quit)", file=sys.stderr)
    while True:
        try:
            line = read_message()
        except (EOFError, KeyboardInterrupt):
            print("", file=sys.stderr)
            return 0
        if line is None:
            continue
        cmd = line.strip()
        if cmd in ("/bye", "/exit", "/quit"):
            return 0
        if cmd in ("/?", "/help"):
            print(__doc__.split("\n\n", 1)[1].strip(), file=sys.stderr)
            continue
        if cmd == "/clear":
            history.clear()
            print("Cleared session context.", file=sys.stderr)
            continue
        if cmd.startswith("/set system"):
            system = cmd[len("/set system"):].strip() or None
            print("Set system message.", file=sys.stderr)
            continue
        if cmd.startswith("/set parameter"):
            try:
                set_parameter(params, cmd[len("/set parameter"):].split(maxsplit=1))
            except EdgeInferError as exc:
                print(f"error: {exc}", file=sys.stderr)
            continue
        if cmd == "/show":
            print(f"model {args.name}, context {model.n_ctx}, parameters {params}", file=sys.stderr)
            continue
        if cmd.startswith("/"):
            print(f"Unknown command '{cmd.split()[0]}'. Type /? for help", file=sys.stderr)
            continue
        if not cmd:
            continue
        messages = _messages(system, history, line)
        try:
            text = answer(model, messages if not args.raw else line, params, args.raw, args.verbose)
        except EdgeInferError as exc:
            print(f"error: {exc}", file=sys.stderr)
            continue
        history += [{"role": "user", "content": line}, {"role": "assistant", "content": text}]
        if session is not None:
            try:
                save_run_session(model, session, system, history, params, args.session_kv)
            except (EdgeInferError, OSError) as exc:
                print(f"error: session not saved: {exc}", file=sys.stderr)


def set_parameter(params: dict, words: list[str]) -> None:
    from edgeinfer.sampling import SamplingParams

    if len(words) != 2:
        raise EdgeInferError("usage: /set parameter NAME VALUE")
    name, raw = words[0], words[1].strip()
    if name not in PARAMETERS:
        raise EdgeInferError(f"unknown parameter {name!r} (known: {', '.join(sorted(PARAMETERS))})")
    field, kind = PARAMETERS[name]
    try:
        value = kind(raw)
    except ValueError:
        raise EdgeInferError(f"{name} needs a {kind.__name__}, got {raw!r}") from None
    trial = dict(params)
    trial[field] = (params.get("stop", []) + [value]) if field == "stop" else value
    SamplingParams(**trial).validate()
    params.update(trial)
    print(f"Set parameter '{name}' to '{raw}'", file=sys.stderr)


def read_message() -> str | None:
    """One message from the terminal; a line of \"\"\" opens and closes a multi-line message."""
    line = input(">>> ")
    if line.strip().startswith('"""'):
        first = line.strip()[3:]
        lines = [first] if first else []
        while True:
            more = input("... ")
            if more.rstrip().endswith('"""'):
                lines.append(more.rstrip()[:-3])
                return "\n".join(lines).strip("\n")
            lines.append(more)
    return line


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
