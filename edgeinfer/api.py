"""The front door: `edgeinfer.load(name)` returns a `Model` that tokenizes, generates and chats.

The CLI, the TUI, the REST server and `edgeinfer bench` all go through it.

    import edgeinfer
    model = edgeinfer.load("gemma3-270m")
    print(model.generate("The capital of France is", max_tokens=16, temperature=0).text)
    for chunk in model.chat([{"role": "user", "content": "Hi!"}], stream=True):
        print(chunk.text, end="", flush=True)
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from dataclasses import fields, replace
from pathlib import Path
from typing import Any, Iterator

from edgeinfer.engine import Engine, EngineOptions
from edgeinfer.errors import EdgeInferError, TemplateError, TokenizerError
from edgeinfer.generate import collect
from edgeinfer.loader import open_model
from edgeinfer.metadata import meta_str
from edgeinfer.prompt.literal_text import LiteralText
from edgeinfer.results import FinishReason, GenerationChunk, GenerationResult, Timings, TokenLogprob, Usage
from edgeinfer.sampling import SamplingParams
from edgeinfer.sessions.session_file import model_identity
from edgeinfer.session_manager import SessionManager

_SAMPLING_FIELDS = {f.name for f in fields(SamplingParams)}


def load(name_or_path: str | os.PathLike[str], *, n_ctx: int = 4096, threads: int | None = None,
         backend: str = "cpu", chat_template: str | None = None, download: bool = True,
         prefill_chunk: int = 256, gpu_layers: int | str = "auto", kv_pool_mb: float | None = None,
         context_shift: bool = False, n_keep: int = 0, draft: str | None = None, draft_max: int = 16,
         draft_min: int = 0, draft_p_min: float = 0.75, n_cpu_moe: int | None = None,
         cache_type_k: str = "f16", cache_type_v: str = "f16", flash_attn: str = "auto",
         mmproj: str | os.PathLike[str] | None = None, mmproj_offload: bool = True) -> "Model":
    """Resolve a model name (alias, hf.co/..., or path), open and check it, build the engine.

    `n_cpu_moe` is llama.cpp's --n-cpu-moe: the first N layers keep their experts on the
    CPU (>= the layer count: all of them, --cpu-moe); None lets the offload plan put the last
    GPU layers' experts in VRAM as far as it goes.

    `kv_pool_mb` caps the paged KV pool (default 2 x n_ctx tokens, see edgeinfer.session_manager);
    `context_shift` drops the oldest half of the context after `n_keep` tokens when a
    generation fills the window; off by default for the library and the server (a full
    window ends with finish_reason "length", predictable for API clients), on in
    `edgeinfer run` / `chat` (as llama-cli), off there with --no-context-shift.

    `draft` turns on speculative decoding (edgeinfer.speculative): "lookup" drafts from
    n-grams of the prompt and the answer so far, any other value names a draft model with
    the same vocabulary; `draft_max` / `draft_min` / `draft_p_min` are the defaults of the
    per-request `draft_max` / `draft_min` / `draft_p_min` keywords (draft_max=0: off).

    `cache_type_k` / `cache_type_v` are llama.cpp's -ctk / -ctv (edgeinfer.kv.cache_types):
    f16 (default), q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl, on the CPU and in VRAM alike;
    `flash_attn` is -fa: "on" runs llama.cpp's flash-attention order on the CPU for an f16 cache
    too, "auto" (default) only where the cache is quantized, "off" refuses a quantized one.

    `mmproj` is the vision encoder's GGUF (llama.cpp's --mmproj): then `generate(prompt,
    images=[...])` and chat image parts take images (edgeinfer.vision). "auto": the
    `mmproj-*.gguf` beside a model named from the store (none for a model given by path); one
    found so that does not load leaves the model without images, `model.mmproj_problem` says why.
    `mmproj_offload` (llama.cpp's --mmproj-offload, on by default): with text layers on the GPU,
    the vision encoder's matrices and attention run there too (edgeinfer.vision.gpu_encoder);
    False keeps the encoder on the CPU (--no-mmproj-offload). Without GPU layers it is on the CPU.
    """
    if not isinstance(mmproj_offload, bool):
        raise EdgeInferError(f"mmproj_offload must be True or False, got {mmproj_offload!r}")
    from edgeinfer.store.registry import resolve

    path = resolve(str(name_or_path), download=download)
    found = mmproj == "auto"
    if found:  # a model named from the store brings its mmproj along (llama.cpp's -hf)
        from edgeinfer.store.mmproj_lookup import mmproj_beside

        mmproj = None if Path(str(name_or_path)).expanduser().is_file() else mmproj_beside(path)
    return Model(str(name_or_path), path, EngineOptions(
        n_ctx=n_ctx, threads=threads, backend=backend, prefill_chunk=prefill_chunk,
        gpu_layers=gpu_layers, n_cpu_moe=n_cpu_moe, cache_type_k=cache_type_k, cache_type_v=cache_type_v,
        flash_attn=flash_attn),
        chat_template=chat_template, kv_pool_mb=kv_pool_mb, context_shift=context_shift, n_keep=n_keep,
        draft=draft, draft_defaults=dict(draft_max=draft_max, draft_min=draft_min, draft_p_min=draft_p_min),
        mmproj=mmproj, mmproj_found=found, mmproj_offload=mmproj_offload)


def _vram_exhausted(exc: BaseException) -> bool:
    """Whether `exc` is the CUDA driver's out-of-memory (pycuda's driver.MemoryError)."""
    try:
        from pycuda import driver
    except ImportError:
        return False
    return isinstance(exc, getattr(driver, "MemoryError", ()))


class Model:
    """A loaded model; requests go through its SessionManager, so a request reuses the
    longest cached prefix (a growing conversation prefills only its new tokens)."""

    def __init__(self, name: str, path, options: EngineOptions, chat_template: str | None = None, *,
                 kv_pool_mb: float | None = None, context_shift: bool = False, n_keep: int = 0,
                 draft: str | None = None, draft_defaults: dict | None = None,
                 mmproj: str | os.PathLike[str] | None = None, mmproj_found: bool = False,
                 mmproj_offload: bool = True) -> None:
        from edgeinfer.prompt.chat_template import ChatTemplate
        from edgeinfer.tokenizer import load_tokenizer

        self.name = name
        self.path = path
        model_file = open_model(path)
        self.config = model_file.config
        self.tokenizer = load_tokenizer(model_file.gguf)
        self.template = ChatTemplate.for_model(model_file.gguf.metadata, chat_template)
        if mmproj is not None and mmproj_offload and options.gpu_layers != 0:
            from edgeinfer.vision.vram_estimate import encoder_vram_bytes

            # the offload plan leaves the encoder its VRAM (used only where layers go to a GPU)
            options = replace(options, vram_reserve=encoder_vram_bytes(mmproj))
        self.engine = Engine(model_file, options)
        general_name = meta_str(model_file.gguf.metadata, "general.name", "") or ""
        self.identity = model_identity(path, general_name)  # for saved sessions and cache keys
        from edgeinfer.context_budget import ContextTooLargeError, check_context_memory

        kv_pool_mb = check_context_memory(self.engine, self.engine.n_ctx, kv_pool_mb)
        try:
            self.sessions = SessionManager(self.engine, self.tokenizer, n_ctx=self.engine.n_ctx,
                                           model_id=self.identity["digest"], kv_pool_mb=kv_pool_mb,
                                           context_shift=context_shift, n_keep=n_keep)
        except MemoryError:  # where the memory available could not be read beforehand
            raise ContextTooLargeError(f"--ctx-size {self.engine.n_ctx} needs more memory for its K/V cache "
                                       f"than this machine can allocate; use a smaller --ctx-size") from None
        self._lock = self.sessions.lock  # held while a generation runs (one at a time)
        from edgeinfer.speculative.setup import make_drafter

        self.draft_defaults = {"draft_max": 16, "draft_min": 0, "draft_p_min": 0.75, **(draft_defaults or {})}
        self.drafter = make_drafter(self, draft, options) if draft else None
        self.images = None  # edgeinfer.vision.request_images.ImageEncoder once a projector is attached
        self.mmproj_problem = ""  # why an mmproj found beside the model was not taken
        if mmproj is not None:
            try:
                self.use_projector(self._load_projector(mmproj, mmproj_offload))
            except EdgeInferError as exc:
                if not mmproj_found:  # asked for by name: its problem is the caller's error
                    raise
                self.mmproj_problem = str(exc)  # only found: the text model works without it

    def _load_projector(self, path, offload: bool) -> Any:
        """The mmproj at `path` with its encoder where `_encoder_ops` puts it; on the CPU after
        all when its upload runs out of VRAM (the plan's reserve is an estimate, and other
        programs take VRAM too), said in `placement` rather than failing the load."""
        import gc

        from edgeinfer.vision.encoder_ops import CpuOps
        from edgeinfer.vision.mmproj import load_mmproj

        ops = self._encoder_ops(offload)
        try:
            return load_mmproj(path, ops=ops)
        except Exception as exc:
            if getattr(ops, "where", "CPU") != "GPU" or not _vram_exhausted(exc):
                raise
        del ops
        gc.collect()   # its partial upload goes with it
        return load_mmproj(path, ops=CpuOps("its upload ran out of VRAM"))

    def _encoder_ops(self, offload: bool) -> Any:
        """Where the vision encoder runs (edgeinfer.vision.encoder_ops): in VRAM beside text layers
        on the GPU, as llama.cpp puts it, unless `offload` is off; None: the CPU's."""
        plan = self.engine.offload
        if plan is None or not plan.gpu_layers or self.engine.backend.name != "hybrid":
            return None
        if not offload:
            from edgeinfer.vision.encoder_ops import CpuOps

            return CpuOps("--no-mmproj-offload")
        from edgeinfer.vision.gpu_encoder import GpuOps

        return GpuOps()

    def use_projector(self, projector: Any) -> None:
        """Take images through `projector` (edgeinfer.vision.mmproj.Projector: `n_embd`,
        `projector_type`, `encode(image) -> ImageChunk`); its width must be the text model's."""
        from edgeinfer.vision.request_images import ImageEncoder

        self.images = ImageEncoder(projector, self.config.n_embd)

    @property
    def tool_format(self) -> str:
        """How this model writes tool calls: "hermes", "llama3", "mistral", "harmony", "gemma4" or "generic"."""
        from edgeinfer.prompt.tool_calls import detect_format

        return detect_format(self.template.source)

    @property
    def supports_tools(self) -> bool:
        from edgeinfer.prompt.tool_calls import supports_tools

        return supports_tools(self.template.source)

    def _polyfills(self, messages: list[dict]) -> bool:
        """Whether a history's calls and tool results need writing as text for this template."""
        from edgeinfer.prompt.tool_polyfill import needs_polyfill

        return not self.supports_tools and needs_polyfill(messages, None)

    @property
    def n_ctx(self) -> int:
        return self.engine.n_ctx

    @property
    def placement(self) -> str:
        """One line: where the layers run (the GPU offload split, or why all are on the CPU)."""
        plan = self.engine.offload
        where = f"{self.engine.backend.name} backend" if plan is None else plan.describe()
        if self.images is not None:   # and where the image encoder runs
            ops = getattr(self.images.projector, "ops", None)
            where += "; " + (ops.describe() if ops is not None else "vision encoder on the CPU")
        return where

    # -- text <-> tokens ------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        return self.tokenizer.tokenize(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.detokenize(ids)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kw) -> str:
        from edgeinfer.prompt.tool_calls import CHANNEL_FORMATS, template_history

        if self.tool_format in CHANNEL_FORMATS:  # assistants' reasoning as its template reads it
            messages = template_history(messages, self.template.source)
        return self.template.render(messages, add_generation_prompt=add_generation_prompt, **kw)

    # -- generation -------------------------------------------------------------------------
    def generate(self, prompt: str | list[int], *, stream: bool = False, raw: bool = True,
                 cancel: threading.Event | None = None, images: list | None = None, **params: Any
                 ) -> GenerationResult | Iterator[GenerationChunk]:
        """Complete `prompt` (text or token ids). Sampling keywords as in `SamplingParams`
        (`logprobs=N` puts each token's log-probability and N alternatives on its chunk);
        constrained output with one of json_schema=SCHEMA, json=True, grammar=GBNF, regex=RE
        (edgeinfer.prompt.grammar): the answer ends with finish_reason "stop" once it is complete.

        `images` (paths or bytes; a model loaded with an mmproj) go where the text prompt has
        the marker `<__media__>`, one each, or before the text when it has none."""
        media = None
        try:
            if images is not None and not isinstance(images, (list, tuple)):
                raise EdgeInferError("images must be a list of paths or bytes")
            if images:
                if not isinstance(prompt, str):
                    raise EdgeInferError("images go with a text prompt (its <__media__> markers), not token ids")
                from edgeinfer.vision.prompt_images import MARKER, with_markers

                ids, media = self._image_prompt(with_markers(prompt, len(images)), images, MARKER, cancel,
                                                lambda piece: self.tokenizer.tokenize(piece, add_special=False,
                                                                                      cancel=cancel))
            else:
                ids = prompt if isinstance(prompt, list) else \
                    self.tokenizer.tokenize(prompt, add_special=True, cancel=cancel)
        except TokenizerError:
            if cancel is None or not cancel.is_set():
                raise
            chunks = _cancelled()
        else:
            chunks = self._run(ids, params, cancel, media)
        return chunks if stream else collect(chunks)

    def _image_prompt(self, text: str, images: list, marker: str, cancel, tokenize_text):
        """(ids, MediaRows) of a text prompt whose markers stand for `images`, in order."""
        from edgeinfer.vision.media_ids import MediaRows
        from edgeinfer.vision.prompt_images import image_prompt_ids, wrap_for

        if self.images is None:
            raise EdgeInferError(self.mmproj_problem or "this model takes no images: load it with its mmproj file "
                                 "(--mmproj)")
        n_markers = text.count(marker)
        if n_markers != len(images):  # before any image is decoded
            raise EdgeInferError(f"the prompt has {n_markers} image marker(s) for {len(images)} image(s): "
                                 f"give one image per marker")
        chunks = []
        for image in images:
            if cancel is not None and cancel.is_set():
                raise TokenizerError("tokenizing stopped: the request was cancelled")
            chunks.append(self.images.encode(image))
        media = MediaRows(chunks, self.config.n_embd, mrope=bool(self.config.rope_sections))
        ids = image_prompt_ids(text, chunks, self.tokenizer, wrap_for(self.images.projector_type), tokenize_text,
                               marker=marker)
        return ids, media

    def chat(self, messages: list[dict], *, stream: bool = False,
             cancel: threading.Event | None = None, **params: Any
             ) -> GenerationResult | Iterator[GenerationChunk]:
        """Answer the conversation `messages` ({"role", "content"} dicts) through the chat template.

        `tools` (OpenAI's list of functions) go to the template's `tools` variable (a template
        without one gets them as text: edgeinfer.prompt.tool_polyfill); `tool_choice` "required" or a named function
        constrains the answer to calls whose arguments validate, "auto" (default) only once a
        call begins, and one call unless `parallel_tool_calls` is true (llama-server's default);
        `enable_thinking` and `reasoning_effort` (gpt-oss: "low", "medium",
        "high") are passed to the template. Read calls and reasoning out of the text with
        `edgeinfer.prompt.tool_calls.parse_output(text, model.tool_format, ...)`."""
        # As llama.cpp: drop a BOS the template wrote (the tokenizer adds it), and parse the
        # template's special-token text as special tokens (edgeinfer.prompt.literal_text:
        # the same text inside a message stays text). Rendering (bounded by the template
        # budget) and tokenizing run here, in the caller: for the server that is the job on
        # the worker thread, so its timeout's `cancel` stops them as it stops generation.
        from edgeinfer.prompt.tool_calls import CHANNEL_FORMATS, markup_token_ids

        tools, tool_choice = params.pop("tools", None), params.pop("tool_choice", None)
        parallel = params.pop("parallel_tool_calls", False)  # llama-server's default: one call
        thinking = params.pop("enable_thinking", None)
        effort = params.pop("reasoning_effort", None)
        channels = self.tool_format in CHANNEL_FORMATS  # the answer's structure is control tokens
        if channels and "preserved_tokens" not in params:
            params["preserved_tokens"] = markup_token_ids(self.tokenizer, self.tool_format)
        if tools:  # the template renders them; tool_choice may constrain the answer
            from edgeinfer.prompt import tool_calls

            constraint = tool_calls.tool_constraint(tools, tool_choice, self.tool_format,
                                                    self.tokenizer, parallel=parallel)
            if constraint is not None and not any(params.get(k) for k in ("constraint", *_CONSTRAINT_KEYS)):
                params["constraint"] = constraint
        from edgeinfer.vision.request_images import chat_images

        marker = f"<__media_{secrets.token_hex(8)}__>"  # no message text can forge it
        messages, images = chat_images(messages, marker)
        media = None
        try:
            # only the template's markup becomes control tokens, never the callers' text
            literal = LiteralText(self.tokenizer)
            messages, shown_tools = literal.protect(messages), literal.protect(tools)
            # a channel template also needs its history reshaped (reasoning where it reads it)
            if tools or thinking is not None or effort is not None or channels or self._polyfills(messages):
                from edgeinfer.prompt.tool_calls import render_with_tools

                text = render_with_tools(self.template, messages, shown_tools, add_bos=self.tokenizer.add_bos,
                                         enable_thinking=thinking, reasoning_effort=effort, cancel=cancel)
            else:
                text = self.template.render_prompt(messages, add_bos=self.tokenizer.add_bos,
                                                   add_generation_prompt=True, cancel=cancel)
            if images:
                ids, media = self._image_prompt(text, images, marker, cancel, lambda piece: (
                    self.tokenizer.tokenize_parts(literal.parts(piece), add_special=False, cancel=cancel)))
            else:
                ids = literal.tokenize(text, add_special=True, cancel=cancel)
        except (TemplateError, TokenizerError):
            if cancel is None or not cancel.is_set():
                raise
            chunks = _cancelled()  # ends like a generation cancelled before its first token
        else:
            chunks = self._run(ids, params, cancel, media)
        return chunks if stream else collect(chunks)

    def _run(self, ids: list[int], params: dict[str, Any],
             cancel: threading.Event | None, media=None) -> Iterator[GenerationChunk]:
        # Ollama's `context`: continue after these ids (they begin with their own BOS), and
        # tell the caller the whole prompt so it can hand back prompt + answer.
        context = params.pop("context", None)
        if context:
            bos = self.tokenizer.bos_id if self.tokenizer.add_bos else None
            ids = list(context) + (ids[1:] if ids and bos is not None and ids[0] == bos else ids)
        on_prompt = params.pop("on_prompt", None)
        if on_prompt is not None:
            on_prompt(list(ids))
        if not ids:
            raise EdgeInferError("the prompt is empty")
        # Per-request context-shift settings ride along with the sampling keywords.
        shift = params.pop("context_shift", None)
        _constraint(params)
        n_keep = params.pop("n_keep", None)
        report = bool(params.pop("prompt_progress", False))  # PromptProgress chunks while the prompt runs
        from edgeinfer.speculative.setup import speculation_for

        spec = speculation_for(self.drafter, self.draft_defaults, params)
        return self.sessions.generate(ids, _sampling(params), cancel, context_shift=shift, n_keep=n_keep,
                                      speculation=spec, report_progress=report, media=media)

    def embed(self, inputs, *, truncate: bool = False, dimensions: int | None = None,
              normalize: bool = True) -> list[list[float]]:
        """Embedding vectors of texts (or token ids), pooled as the file says and L2-normalised
        (edgeinfer.embedding); an input past the context is an error unless `truncate`."""
        from edgeinfer.embedding import embed

        return embed(self, inputs, truncate=truncate, dimensions=dimensions,
                     normalize=2 if normalize else -1).vectors

    def rerank(self, query: str, documents: list[str]) -> list[float]:
        """Relevance scores of `documents` for `query`, in their order: a reranker's (a
        file with rank pooling: a cross-encoder, Qwen3-Reranker) classifier output, as llama-server's
        /v1/rerank gives it."""
        from edgeinfer.embedding import rerank

        return rerank(self, query, list(documents)).scores

    def prompt_logprobs(self, prompt: str | list[int], top_n: int = 0
                        ) -> list[tuple[int, TokenLogprob | None]]:
        """(token id, log-probability given the tokens before it) for each prompt token as
        `generate` tokenizes it (None for the first, which follows nothing), with `top_n`
        alternatives: what OpenAI's echo + logprobs returns. A pass over the prompt on a
        scratch cache (the prefix cache is untouched)."""
        from edgeinfer.generate import prompt_logprobs

        ids = prompt if isinstance(prompt, list) else self.tokenizer.tokenize(prompt, add_special=True)
        if not ids:
            raise EdgeInferError("the prompt is empty")
        with self._lock:
            return list(zip(ids, prompt_logprobs(self.engine, ids, top_n)))

    def stats(self) -> dict:
        """KV pool and prefix-cache figures (blocks used/free/cached, hit rates)."""
        return self.sessions.stats()

    def reset(self) -> None:
        """Forget every cached prefix."""
        self.sessions.reset()


def _cancelled() -> Iterator[GenerationChunk]:
    """The stream of a request cancelled while its prompt was rendered or tokenized."""
    now = time.perf_counter()
    yield GenerationChunk(text="", token=None, finish_reason=FinishReason.CANCELLED,
                          usage=Usage(prompt_tokens=0, completion_tokens=0),
                          timings=Timings.from_clock(now, None, now, 0, 0))


_CONSTRAINT_KEYS = ("json_schema", "grammar", "regex", "json")


def _constraint(params: dict[str, Any]) -> None:
    """Turn the constraint keywords into `params["constraint"]` (compiled; GrammarError if bad):
    json_schema=SCHEMA (dict or JSON text), json=True (any JSON object), grammar=GBNF text,
    regex=PATTERN; or constraint=edgeinfer.prompt.grammar.Constraint directly."""
    given = {k: params.pop(k) for k in _CONSTRAINT_KEYS if k in params}
    given = {k: v for k, v in given.items() if v is not None and v is not False}
    if not given:
        return
    if params.get("constraint") is not None:
        raise EdgeInferError(f"give either constraint or {', '.join(given)}, not both")
    from edgeinfer.prompt import grammar

    params["constraint"] = grammar.from_request(**given)


def _sampling(params: dict[str, Any]) -> SamplingParams:
    unknown = set(params) - _SAMPLING_FIELDS
    if unknown:
        raise EdgeInferError(f"unknown generation parameter(s): {', '.join(sorted(unknown))}")
    return SamplingParams(**params).validate()
