"""What an answer cost, in the dialects' words: OpenAI's `usage`, llama-server's `timings`."""

from __future__ import annotations

from edgeinfer.results import GenerationChunk


def usage_dict(last: GenerationChunk) -> dict:
    u = last.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens, "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def llama_timings(last: GenerationChunk) -> dict:
    """llama-server's `timings` object (milliseconds, tokens/s)."""
    u, t = last.usage, last.timings
    prompt_n = u.prompt_tokens - u.cached_tokens
    prompt_ms, pred_ms = t.prompt_s * 1e3, t.gen_s * 1e3
    return {"cache_n": u.cached_tokens, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
            "prompt_per_second": t.prompt_tps,
            "predicted_n": u.completion_tokens, "predicted_ms": pred_ms,
            "predicted_per_token_ms": t.tpot_s * 1e3, "predicted_per_second": t.gen_tps,
            **({"draft_n": t.draft_n, "draft_n_accepted": t.draft_n_accepted} if t.draft_n else {})}
