"""`edgeinfer run --session S` and `/save`: a conversation (and its K/V) saved and resumed by name."""

from __future__ import annotations

import sys

from edgeinfer.errors import EdgeInferError


def resume_session(model, name: str, params: dict, system: str | None) -> tuple[str | None, list[dict]]:
    """Load saved session `name` (if it exists): its sampling settings replace `params`,
    its K/V (if saved) become the cached prefix. Returns (system prompt, history)."""
    from edgeinfer.sessions.session_file import SessionFileError, load_session, session_path

    path = session_path(name)
    if not path.exists():
        return system, []
    saved = load_session(path, model.identity, config=model.config, n_ctx=model.n_ctx)
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
        model.sessions.import_kv(*saved.saved_kv())
    print(f"Resumed session '{name}' ({len(messages) // 2} turn(s)).", file=sys.stderr)
    return system, messages


def save_run_session(model, name: str, system: str | None, history: list[dict], params: dict,
                     with_kv: bool) -> None:
    from edgeinfer.sessions.session_file import SavedSession, save_session, session_path

    saved = SavedSession(messages=_messages_only(system, history), tokens=model.sessions.resident_tokens(),
                         sampling=dict(params))
    if with_kv:
        kv = model.sessions.export_kv()
        if kv is not None:
            saved.set_kv(kv)
    save_session(session_path(name), saved, model.identity)


def _messages_only(system: str | None, history: list[dict]) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + list(history)
