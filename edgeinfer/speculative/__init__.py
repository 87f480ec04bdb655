"""Speculative decoding: drafters propose tokens, the decode loop verifies them in one pass."""

from edgeinfer.speculative.drafter import BatchCosts, DraftLength, Drafter, Speculation, SpeculativeParams
from edgeinfer.speculative.lookup import PromptLookup
from edgeinfer.speculative.ngram_lookup import LookupCorpus, NgramLookup

__all__ = ["BatchCosts", "DraftLength", "Drafter", "LookupCorpus", "NgramLookup", "PromptLookup",
           "Speculation", "SpeculativeParams"]
