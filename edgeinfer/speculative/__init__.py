"""Speculative decoding: drafters propose tokens, the decode loop verifies them in one pass."""

from edgeinfer.speculative.drafter import DraftLength, Drafter, Speculation, SpeculativeParams
from edgeinfer.speculative.lookup import PromptLookup

__all__ = ["DraftLength", "Drafter", "PromptLookup", "Speculation", "SpeculativeParams"]
