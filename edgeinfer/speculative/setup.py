"""Making a model's drafter (`--draft lookup|mtp|NAME`, with `--lookup-cache-static/-dynamic`)
and each request's Speculation (its draft lengths chosen from the drafter's measured
batch costs, kept across requests)."""

from __future__ import annotations

import weakref
from typing import Any

from edgeinfer.errors import EdgeInferError
from edgeinfer.speculative.drafter import BatchCosts, Speculation, SpeculativeParams
from edgeinfer.speculative.ngram_lookup import LookupCorpus, NgramLookup, is_lookup

DRAFT_KEYS = ("draft_max", "draft_min", "draft_p_min", "draft_adaptive")


def make_drafter(model, draft: str, options):
    """The drafter for `model`: "lookup" (or a LookupCorpus naming its files), "mtp" (the
    model's own multi-token-prediction block), or a draft model's name or path."""
    if is_lookup(draft):
        corpus = draft if isinstance(draft, LookupCorpus) else None
        if corpus is not None:
            corpus.check_files()
        return NgramLookup.for_model(model, corpus)
    if draft == "mtp":
        from edgeinfer.speculative.mtp import MtpDrafter

        return MtpDrafter(model.engine, p_min=model.draft_defaults["draft_p_min"])
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
    return Speculation(drafter, sp, costs_of(drafter))


_costs: "weakref.WeakKeyDictionary[Any, BatchCosts]" = weakref.WeakKeyDictionary()


def costs_of(drafter) -> BatchCosts | None:
    """The drafter's BatchCosts, one per drafter for as long as it lives (None: per request)."""
    try:
        costs = _costs.get(drafter)
        if costs is None:
            costs = _costs[drafter] = BatchCosts()
        return costs
    except TypeError:  # not weakly referenceable
        return None
