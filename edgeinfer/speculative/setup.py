"""Making a model's drafter (`--draft lookup|NAME`) and each request's Speculation."""

from __future__ import annotations

from typing import Any

from edgeinfer.errors import EdgeInferError
from edgeinfer.speculative.drafter import Speculation, SpeculativeParams
from edgeinfer.speculative.lookup import PromptLookup

DRAFT_KEYS = ("draft_max", "draft_min", "draft_p_min", "draft_adaptive")


def make_drafter(model, draft: str, options):
    """The drafter for `model`: "lookup", or a draft model's name or path."""
    if draft == "lookup":
        return PromptLookup()
    from dataclasses import replace

    from edgeinfer.engine import Engine
    from edgeinfer.loader import open_model
    from edgeinfer.store.registry import resolve
    from edgeinfer.speculative.draft_model import DraftModel, check_same_vocab
    from edgeinfer.tokenizer import load_tokenizer

    path = resolve(str(draft), download=True)
    mf = open_model(path)
    if not mf.family.GENERATES:
        raise EdgeInferError(f"draft model {draft}: a {mf.config.arch} model does not generate text")
    check_same_vocab(model.tokenizer, load_tokenizer(mf.gguf), model.config.n_vocab, mf.config.n_vocab, str(draft))
    engine = Engine(mf, replace(options, gpu_layers=options.gpu_layers))
    return DraftModel(engine, name=str(draft), p_min=model.draft_defaults["draft_p_min"])


def speculation_for(drafter, defaults: dict, params: dict[str, Any]) -> Speculation | None:
    """Pop the request's draft_* keywords; a Speculation when the model has a drafter and
    draft_max > 0."""
    given = {k: params.pop(k) for k in DRAFT_KEYS if k in params}
    given = {k: v for k, v in given.items() if v is not None}
    merged = {**defaults, **given}
    sp = SpeculativeParams(n_max=int(merged["draft_max"]), n_min=min(int(merged["draft_min"]), int(merged["draft_max"])),
                           p_min=float(merged["draft_p_min"]),
                           adaptive=bool(merged.get("draft_adaptive", True))).validate()
    if drafter is None or sp.n_max == 0:
        return None
    if hasattr(drafter, "p_min"):
        drafter.p_min = sp.p_min
    return Speculation(drafter, sp)
