"""`edgeinfer chat [NAME]`: the full-screen chat TUI (conversations, settings, model picker).

Without NAME the model picker opens on the local models (`edgeinfer list`). Conversations
are saved sessions: `edgeinfer run NAME --session ID` continues one, and the chat lists the
sessions `run` saved.
"""

from __future__ import annotations

from edgeinfer.commands.image_input import add_offload_option, mmproj_offload_of
from edgeinfer.commands.model_flags import (add_model_options, add_sampling_options, model_kwargs,
                                           sampling_from_args)


def register(sub) -> None:
    p = sub.add_parser("chat", help="full-screen chat in the terminal (Textual TUI)")
    p.add_argument("name", nargs="?", default=None,
                   help="model alias, hf.co/owner/repo[:quant] or .gguf path (default: pick one)")
    p.add_argument("--system", default="", help="system prompt for new conversations")
    p.add_argument("--data-dir", default=None, metavar="DIR",
                   help="where conversations are saved, as saved sessions (default $EDGEINFER_HOME/sessions "
                        "or ~/.local/share/edgeinfer/sessions, where `edgeinfer run --session` finds them)")
    p.add_argument("--session-kv", action="store_true",
                   help="new conversations also save their KV cache, so resuming one prefills nothing "
                        "(bigger files; a per-conversation setting, Ctrl+S)")
    p.add_argument("--mmproj", default=None, metavar="FILE",
                   help="NAME's vision encoder GGUF: messages may then carry images (/image PATH or Ctrl+G); "
                        "default: the mmproj-*.gguf beside a model named from the store")
    p.add_argument("--no-mmproj", action="store_true", help="load no mmproj, even one found beside a model")
    add_offload_option(p)
    add_model_options(p)
    add_sampling_options(p)
    p.set_defaults(func=chat)


def mmproj_loader(args):
    """edgeinfer.load's mmproj for a model `name`: --mmproj's file for the named model, else the
    one beside a store model ("auto"), none with --no-mmproj."""
    from pathlib import Path

    from edgeinfer.errors import EdgeInferError

    if args.no_mmproj and args.mmproj is not None:
        raise EdgeInferError("--no-mmproj loads no vision encoder: it cannot go with --mmproj")
    if args.mmproj is not None and not Path(args.mmproj).expanduser().is_file():
        raise EdgeInferError(f"--mmproj: no such file: {args.mmproj}")

    def mmproj(name: str):
        if args.no_mmproj:
            return None
        if args.mmproj is not None and name == args.name:
            return str(Path(args.mmproj).expanduser())
        return "auto"

    return mmproj


def chat(args) -> int:
    params = sampling_from_args(args)  # bad flag values fail before the screen opens

    import edgeinfer
    from edgeinfer.sessions.conversations import ConversationStore
    from edgeinfer.errors import EdgeInferError
    from edgeinfer.kernels_cpu import compile_progress
    from edgeinfer.tui.app import ChatApp

    # The named model loads before the screen opens, so a first start's kernel compile
    # count shows on stderr; a model that is not local yet is left to the app's download.
    kwargs = model_kwargs(args, context_shift=True)  # a bad flag or lookup cache file: one line, before the screen
    kwargs["mmproj_offload"] = mmproj_offload_of(args)
    mmproj = mmproj_loader(args)
    preloaded = {}
    if args.name:
        try:
            preloaded[(args.name, args.ctx_size)] = edgeinfer.load(args.name, download=False, **kwargs,
                                                                   mmproj=mmproj(args.name))
        except EdgeInferError:
            pass

    def load(name: str, n_ctx: int):
        model = preloaded.pop((name, n_ctx), None)
        if model is not None:
            return model
        return edgeinfer.load(name, **{**kwargs, "n_ctx": n_ctx, "mmproj": mmproj(name)})

    app = ChatApp(args.name, load_model=load, store=ConversationStore(args.data_dir),
                  sampling=params, system=args.system, n_ctx=args.ctx_size, save_kv=args.session_kv)
    previous = compile_progress.set_reporter(None)  # stderr lines would break the full screen
    try:
        app.run()
    finally:
        compile_progress.set_reporter(previous)
    return int(app.return_code or 0)
