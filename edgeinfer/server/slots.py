"""A model slot: one model the server may hold (its name, how it loads, whether it is resident, its keep-alive).

The served model has the first slot; a request naming another local model gets one too.
`current_slot` says which slot the running request uses (set by the model gate).
"""

from __future__ import annotations

import asyncio
import contextvars
import gc
import logging
import threading
import time
from typing import Any, Callable

log = logging.getLogger("edgeinfer.server")

current_slot: contextvars.ContextVar["Slot | None"] = contextvars.ContextVar("edgeinfer_slot", default=None)

# Ollama PARAMETER names -> the sampling keywords they set (num_ctx and num_keep are load options)
SAMPLING_PARAMETERS = {"num_predict": "max_tokens", "temperature": "temperature", "top_k": "top_k",
                       "top_p": "top_p", "min_p": "min_p", "seed": "seed", "stop": "stop",
                       "repeat_penalty": "repeat_penalty", "repeat_last_n": "repeat_last_n",
                       "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty"}
LOAD_PARAMETERS = {"num_ctx": "n_ctx", "num_keep": "n_keep"}


class Slot:
    """One model: None while not resident; `uses` requests hold it; keep-alive per slot."""

    def __init__(self, name: str, loader: Callable[[], Any] | None, *, path: str = "", named=None) -> None:
        self.name = name
        self.loader = loader
        self.path = path
        self.named = named                   # model_names.NamedModel for names made by copy/create
        self.settings = ""                   # template/system/parameters, to tell shared files apart
        self.aliases: set[str] = set()       # other names meaning the same file and settings
        self.model = None
        self.loaded = threading.Event()      # loaded at least once
        self.loading: asyncio.Future | None = None
        self.overrides: dict[str, Any] = {}   # edgeinfer.load keywords a request asked for (num_ctx...)
        self.reloadable = True                # False: a model handed over as it is, no loader
        self.last_load_s: float | None = None  # how long the last load took
        self.loaded_at = 0.0                  # monotonic time the last load ended
        self.draining = False                 # emptied to make room or to reload: new requests wait
        self._drained: asyncio.Event | None = None
        self.uses = 0
        self.last_used = 0.0                 # monotonic, for least-recently-used eviction
        self.keep_alive_s = -1.0
        self.file_info = None
        self.sampling = sampling_of(named)
        self._expiry: asyncio.TimerHandle | None = None
        self._expires_at: float | None = None

    def load(self):
        """The model, loaded with the server's options and the slot's overrides (a thread's job)."""
        return self.loader(**self.overrides) if self.overrides else self.loader()

    def drain(self, on: bool) -> None:
        """Start (new requests wait in wait_drained) or end draining this slot."""
        self.draining = on
        if self._drained is None:
            self._drained = asyncio.Event()
        if on:
            self._drained.clear()
        else:
            self._drained.set()

    async def wait_drained(self) -> None:
        while self.draining and self._drained is not None:
            await self._drained.wait()

    @property
    def unloaded(self) -> bool:
        return self.model is None and self.loaded.is_set()

    def acquire(self, default_keep_alive: float) -> None:
        self.uses += 1
        self.keep_alive_s = default_keep_alive  # Ollama: a request without keep_alive gets the default
        self.last_used = time.monotonic()
        self._cancel_expiry()

    def release(self) -> None:
        self.uses -= 1
        self.last_used = time.monotonic()
        if self.uses > 0 or self.model is None:
            return
        keep = self.keep_alive_s
        if keep == 0:
            self.unload()
        elif keep > 0:
            self._expiry = asyncio.get_running_loop().call_later(keep, self._expire)
            self._expires_at = time.time() + keep

    def expires_at(self) -> float | None:
        if self._expires_at is not None:
            return self._expires_at
        return None if self.keep_alive_s < 0 else time.time() + self.keep_alive_s

    def _cancel_expiry(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
        self._expiry = self._expires_at = None

    def _expire(self) -> None:
        self._expiry = self._expires_at = None
        if self.uses == 0:
            self.unload()

    def unload(self) -> None:
        """Drop the model (no request uses it), so its weights and mmap can go."""
        self._cancel_expiry()
        if self.model is None:
            return
        log.info("unloading %s", self.name)
        self.model = None
        gc.collect()  # the model's KV pool and caches may sit in reference cycles


def sampling_of(named) -> dict[str, Any]:
    params = named.parameters if named is not None else {}
    return {SAMPLING_PARAMETERS[k]: v for k, v in params.items() if k in SAMPLING_PARAMETERS}


class WithSystem:
    """A loaded model with a created model's SYSTEM: chat() adds it to messages that have none."""

    def __init__(self, model, system: str) -> None:
        self._model, self._system = model, system

    def __getattr__(self, name: str):
        return getattr(self._model, name)

    def chat(self, messages, *args, **kwargs):
        if not any(m.get("role") == "system" for m in messages):
            messages = [{"role": "system", "content": self._system}, *messages]
        return self._model.chat(messages, *args, **kwargs)


def model_loader(path, options: dict[str, Any], named=None) -> Callable[[], Any]:
    """What loads a local model file with the server's options and a created model's settings."""
    kwargs = dict(options)
    if named is not None:
        kwargs.update({LOAD_PARAMETERS[k]: v for k, v in named.parameters.items() if k in LOAD_PARAMETERS})
        if named.template:
            kwargs["chat_template"] = named.template

    def load(**overrides):
        import edgeinfer

        model = edgeinfer.load(str(path), **{**kwargs, **overrides})
        return WithSystem(model, named.system) if named is not None and named.system else model

    return load
