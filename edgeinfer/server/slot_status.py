"""What GET /slots says about edgeinfer's one slot, in llama-server's shape (its
server_slot::to_json): id, n_ctx, speculative, is_processing, and once a request has run,
id_task, the prompt token counts, params and next_token.

The worker keeps no finished job (a job's closure holds the model, which keep_alive must be
able to free): the state keeps `LastTask`, plain numbers and settings, instead; a running
generation is read live from its job.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# edgeinfer's sampling names -> llama-server's, for the params llama-server shows
_LLAMA_NAMES = {"max_tokens": "n_predict", "logprobs": "n_probs"}
_SHOWN = ("max_tokens", "seed", "temperature", "top_k", "top_p", "min_p", "repeat_last_n", "repeat_penalty",
          "presence_penalty", "frequency_penalty", "stop", "logprobs", "post_sampling_probs")


@dataclass(frozen=True)
class LastTask:
    """The last generation: its id, settings and counts (no model, no job)."""

    id_task: int
    params: dict[str, Any]
    n_decoded: int
    n_prompt: int | None = None   # prompt tokens, from the final chunk's usage
    n_cached: int | None = None   # of which were reused from the cache

    @classmethod
    def of(cls, job) -> "LastTask":
        u = job.last.usage if job.last is not None else None
        return cls(job.id, params_json(job.params or {}), job.n_decoded,
                   u.prompt_tokens if u is not None else None, u.cached_tokens if u is not None else None)


def params_json(params: dict[str, Any]) -> dict[str, Any]:
    """A request's sampling settings under llama-server's names, defaults filled in."""
    import dataclasses

    from edgeinfer.sampling import SamplingParams  # (numpy: not at import time)

    defaults = {f.name: f.default for f in dataclasses.fields(SamplingParams)
                if f.default is not dataclasses.MISSING}
    merged = {**defaults, "stop": [], **{k: v for k, v in params.items() if v is not None}}
    out: dict[str, Any] = {}
    for key in _SHOWN:
        out[_LLAMA_NAMES.get(key, key)] = merged.get(key)
    stop = out["stop"]
    out["stop"] = [stop] if isinstance(stop, str) else list(stop or [])
    out["seed"] = -1 if out["seed"] is None else out["seed"]
    out["n_probs"] = out["n_probs"] or 0
    out["n_keep"] = merged.get("n_keep", 0)
    return out


def slot_json(model, running, last: LastTask | None) -> dict[str, Any]:
    """Slot 0 as llama-server describes a slot. `running`: the worker's job now (None when
    idle; a /slots action has no params and shows the last generation's)."""
    # a job whose final chunk is out has answered its client, though the worker may still be
    # tidying up: it is done, as the client that asks next must see
    busy = running is not None and getattr(running, "last", None) is None
    out: dict[str, Any] = {"id": 0, "n_ctx": model.n_ctx, "speculative": False, "is_processing": busy}
    if running is not None and running.params is not None:
        task = LastTask(running.id, params_json(running.params), running.n_decoded) if busy else LastTask.of(running)
    else:
        task = last
    live = busy and task is not last
    if task is None:
        return out
    sessions = getattr(model, "sessions", None)
    n_predict = task.params["n_predict"]
    out.update({
        "id_task": task.id_task,
        # the tokens the slot holds K/V for: what the next request can reuse (0 while one runs)
        "n_prompt_tokens": len(sessions.resident_tokens()) if sessions is not None else 0,
        "n_prompt_tokens_processed": (task.n_prompt or 0) - (task.n_cached or 0),
        "n_prompt_tokens_cache": task.n_cached or 0,
        "params": task.params,
        "next_token": [{"has_next_token": live,
                        "n_remain": n_predict - task.n_decoded if n_predict is not None and n_predict >= 0 else -1,
                        "n_decoded": task.n_decoded}],
    })
    return out
