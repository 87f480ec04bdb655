"""`edgeinfer run NAME [PROMPT]`: one answer and exit, or the interactive session
(edgeinfer.commands.repl, like `ollama run`)."""

from __future__ import annotations

import sys

from edgeinfer.commands.answer import answer, messages_for
from edgeinfer.commands.image_input import add_image_options, mmproj_of, user_content
from edgeinfer.commands.model_flags import add_model_options, add_sampling_options, sampling_from_args
from edgeinfer.commands.run_model import completion_mode, load_with_spinner
from edgeinfer.commands.run_session import resume_session, save_run_session
from edgeinfer.errors import EdgeInferError


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
    p.add_argument("--format", default=None, metavar="json|FILE",
                   help="answer in JSON: 'json' (any object) or a JSON schema file the answer must follow")
    p.add_argument("--grammar-file", default=None, metavar="FILE",
                   help="answer following a llama.cpp GBNF grammar")
    add_model_options(p)
    add_image_options(p)
    add_sampling_options(p)
    p.set_defaults(func=run)


def run(args) -> int:
    params = sampling_from_args(args)
    from edgeinfer.commands.repl_commands import constraint_from_args

    constraint = constraint_from_args(args)  # a bad schema or grammar fails before the model loads
    session = getattr(args, "session", None)
    if session is not None:
        from edgeinfer.sessions.session_file import check_name

        check_name(session)  # before the model loads
        if args.raw:
            raise EdgeInferError("--session keeps a chat; it cannot be combined with --raw")
        if args.image:
            raise EdgeInferError("--image cannot be combined with --session yet (saved sessions keep text only)")
    mmproj_of(args)  # a bad flag combination fails before the model loads
    prompt = args.prompt
    if prompt is None and not sys.stdin.isatty():
        from edgeinfer.commands.prompt_input import read_stdin_prompt

        prompt = read_stdin_prompt(sys.stdin, args.ctx_size)  # no more than the context can hold
    if prompt is not None and not prompt.strip():
        print("edgeinfer: error: no prompt given", file=sys.stderr)
        return 2
    model = load_with_spinner(args)
    if args.image and model.images is None:
        raise EdgeInferError(model.mmproj_problem or f"{args.name} takes no images: give its vision encoder with "
                                                     f"--mmproj FILE")
    raw = completion_mode(model, args)
    system, history = args.system, []
    if session is not None:
        system, history = resume_session(model, session, params, args.system)
    if prompt is not None:
        from edgeinfer.commands.prompt_input import check_prompt_length

        check_prompt_length(model, prompt)  # a long prompt is not tokenized whole to find it too long
        one_shot = dict(params, constraint=constraint)
        if one_shot["max_tokens"] < 0:
            # The default -n stops where the window ends; only an explicit -n goes past it.
            one_shot["context_shift"] = False
        content = prompt if raw else user_content(prompt, args.image)
        text = answer(model, messages_for(system, history, content), one_shot, raw, args.verbose,
                      images=args.image if raw else None)
        if session is not None:
            history += [{"role": "user", "content": prompt}, {"role": "assistant", "content": text}]
            save_run_session(model, session, system, history, params, args.session_kv)
        return 0
    from edgeinfer.commands.repl import Repl  # the interactive session only

    return Repl(model, args, params, raw, system, history).loop()
