"""`edgeinfer chat [NAME]`: the full-screen chat TUI (conversations, settings, model picker).

Without NAME the model picker opens on the local models (`edgeinfer list`). Conversations
are saved sessions: `edgeinfer run NAME --session ID` continues one, and the chat lists the
sessions `run` saved.
"""

from __future__ import annotations

from edgeinfer.commands.run import add_model_options, add_sampling_options, model_kwargs, sampling_from_args


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
    add_model_options(p)
    add_sampling_options(p)
    p.set_defaults(func=chat)


def chat(args) -> int:
    params = sampling_from_args(args)  # bad flag values fail before the screen opens

    from edgeinfer.conversations import ConversationStore
    from edgeinfer.tui.app import ChatApp

    def load(name: str, n_ctx: int):
        import edgeinfer

        return edgeinfer.load(name, **{**model_kwargs(args, context_shift=True), "n_ctx": n_ctx})

    app = ChatApp(args.name, load_model=load, store=ConversationStore(args.data_dir),
                  sampling=params, system=args.system, n_ctx=args.ctx_size, save_kv=args.session_kv)
    app.run()
    return int(app.return_code or 0)
