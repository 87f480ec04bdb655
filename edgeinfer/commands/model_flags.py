"""The flags of the commands that load a model (run, chat, serve) and what they turn into:
edgeinfer.load keywords and sampling parameters (speculative decoding's --draft* and
llama.cpp's --lookup-cache-static/-dynamic among them)."""

from __future__ import annotations

import os
import stat

from edgeinfer.commands.arg_types import non_negative_int, positive_float, positive_int
from edgeinfer.errors import EdgeInferError


CPU_MOE_ALL = 1 << 30  # --cpu-moe: an --n-cpu-moe past every layer (as edgeinfer.backends.offload's)


def add_model_options(p) -> None:
    """Flags shared by commands that load a model (run, chat, serve)."""
    p.add_argument("-c", "--ctx-size", type=positive_int, default=4096, metavar="N",
                   help="context size in tokens (default 4096)")
    p.add_argument("-t", "--threads", type=positive_int, default=None, metavar="N",
                   help="CPU threads (default: all cores)")
    p.add_argument("--backend", choices=("cpu", "reference"), default="cpu",
                   help="compute backend (reference = slow numpy, for checking)")
    p.add_argument("-ngl", "--gpu-layers", default="auto", metavar="N|auto",
                   help="layers to offload to a CUDA GPU (default auto: as many as fit; 0 = CPU only)")
    p.add_argument("--cpu-moe", action="store_true",
                   help="keep every layer's experts (mixtures of experts) on the CPU")
    p.add_argument("--n-cpu-moe", type=non_negative_int, default=None, metavar="N",
                   help="keep the first N layers' experts on the CPU (default: the GPU takes the last "
                        "layers' experts as far as its VRAM goes)")
    add_cache_type_options(p)
    p.add_argument("--chat-template", default=None, metavar="NAME|JINJA",
                   help="built-in template name (gemma, llama3, chatml) or a Jinja template")
    p.add_argument("--chat-template-file", default=None, metavar="FILE",
                   help="a Jinja chat template read from FILE (llama.cpp's flag), in place of the model's")
    p.add_argument("--prefill-chunk", type=positive_int, default=256, metavar="N",
                   help="prompt tokens evaluated per forward pass (default 256)")
    p.add_argument("--kv-pool-mb", type=positive_float(), default=None, metavar="MB",
                   help="cap the KV block pool (default: 2 x ctx-size tokens, to keep a cached prefix)")
    p.add_argument("--context-shift", dest="context_shift", action="store_true", default=None,
                   help="when the context fills, drop the oldest half after --keep tokens and go on")
    p.add_argument("--no-context-shift", dest="context_shift", action="store_false",
                   help="stop with finish reason 'length' when the context fills")
    p.add_argument("--keep", type=non_negative_int, default=0, metavar="N",
                   help="tokens at the start kept by a context shift (default 0)")
    p.add_argument("--draft", default=None, metavar="lookup|mtp|NAME",
                   help="speculative decoding: 'lookup' drafts from n-grams of the prompt and answer, "
                        "'mtp' from the model's own multi-token-prediction layer (Qwen3.5 files that "
                        "have one), NAME is a draft model with the same vocabulary")
    p.add_argument("--draft-max", type=non_negative_int, default=16, metavar="N",
                   help="most tokens drafted per step (default 16; 0 = off)")
    p.add_argument("--draft-min", type=non_negative_int, default=0, metavar="N",
                   help="fewer drafted tokens than this are not verified (default 0)")
    p.add_argument("--draft-p-min", type=float, default=0.75, metavar="P",
                   help="a draft model stops drafting below this probability (default 0.75)")
    p.add_argument("-lcs", "--lookup-cache-static", default=None, metavar="FILE",
                   help="lookup drafting also from this file: text or code (tokenized with the model's "
                        "tokenizer) or a saved n-gram cache; read only (implies --draft lookup)")
    p.add_argument("-lcd", "--lookup-cache-dynamic", default=None, metavar="FILE",
                   help="n-gram cache that lookup drafting reads if it exists and that learns "
                        "every answer; written atomically when the session ends (implies --draft lookup)")


def add_cache_type_options(p) -> None:
    """llama.cpp's -ctk / -ctv (run, chat, serve, bench)."""
    from edgeinfer.kv.cache_types import ALLOWED

    for short, name, what in (("-ctk", "--cache-type-k", "K"), ("-ctv", "--cache-type-v", "V")):
        p.add_argument(short, name, default=None, metavar="TYPE",
                       help=f"{what} cache type: {', '.join(ALLOWED)} (default f16; quantized types run "
                            f"llama.cpp's flash-attention order on the CPU)")
    p.add_argument("-fa", "--flash-attn", default="auto", metavar="on|off|auto",
                   help="llama.cpp's flash-attention order on the CPU: auto (default) where the K/V cache is "
                        "quantized, on for f16 too (a reference for comparisons: slow with f16 keys), "
                        "off (refused with a quantized cache)")


def cache_type_kwargs(args) -> dict:
    """cache_type_k / cache_type_v from -ctk / -ctv, checked (one line naming the flag); where
    the command takes it (serve), OLLAMA_KV_CACHE_TYPE sets both when neither flag is given."""
    from edgeinfer.kv.cache_types import parse

    k, v = getattr(args, "cache_type_k", None), getattr(args, "cache_type_v", None)
    env = os.environ.get("OLLAMA_KV_CACHE_TYPE", "").strip() if getattr(args, "kv_cache_env", False) else ""
    if k is None and v is None and env:
        k = v = parse(env, "OLLAMA_KV_CACHE_TYPE")
    from edgeinfer.kv.cache_types import flash_types

    k, v = parse(k or "f16", "--cache-type-k"), parse(v or "f16", "--cache-type-v")
    fa = getattr(args, "flash_attn", None) or "auto"
    flash_types(k, v, fa)  # a bad value or combination: one line before the model loads
    return dict(cache_type_k=k, cache_type_v=v, flash_attn=str(fa).strip().lower())


def model_kwargs(args, context_shift: bool = False) -> dict:
    """edgeinfer.load keywords from the add_model_options flags; `context_shift` = this
    command's default when neither --context-shift nor --no-context-shift is given."""
    if args.keep < 0:
        raise EdgeInferError(f"--keep must be at least 0, got {args.keep}")
    shift = context_shift if args.context_shift is None else args.context_shift
    return dict(n_ctx=args.ctx_size, threads=args.threads, backend=args.backend,
                chat_template=chat_template_of(args), gpu_layers=args.gpu_layers,
                prefill_chunk=args.prefill_chunk, kv_pool_mb=args.kv_pool_mb,
                context_shift=shift, n_keep=args.keep, n_cpu_moe=CPU_MOE_ALL if args.cpu_moe else args.n_cpu_moe,
                **cache_type_kwargs(args), **draft_kwargs(args))


MAX_TEMPLATE_FILE = 1 << 20  # bytes: the largest chat templates in use are ~20 KB


def chat_template_of(args) -> str | None:
    """--chat-template, or the text of --chat-template-file (a regular UTF-8 file of at most
    MAX_TEMPLATE_FILE bytes). Text with no Jinja markup is still a template, as llama.cpp
    takes it: it renders as itself."""
    path = getattr(args, "chat_template_file", None)
    if path is None:
        return args.chat_template
    if args.chat_template is not None:
        raise EdgeInferError("--chat-template and --chat-template-file: give one of them")
    flag = f"--chat-template-file {path!r}"
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise EdgeInferError(f"{flag}: cannot open it ({exc.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # a folder, a FIFO, a device: never read
        os.close(fd)
        raise EdgeInferError(f"{flag}: not a regular file")
    with os.fdopen(fd, "rb") as fh:
        data = fh.read(MAX_TEMPLATE_FILE + 1)
    if len(data) > MAX_TEMPLATE_FILE:
        raise EdgeInferError(f"{flag}: larger than {MAX_TEMPLATE_FILE} bytes; is it a chat template?")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise EdgeInferError(f"{flag}: not UTF-8 text (byte {exc.start})") from None
    if not text.strip():
        raise EdgeInferError(f"{flag}: the file is empty")
    return text if "{{" in text or "{%" in text else "{% raw %}" + text + "{% endraw %}"


def draft_kwargs(args) -> dict:
    """edgeinfer.load's draft keywords from --draft / --draft-max / --draft-min / --draft-p-min
    and --lookup-cache-static / --lookup-cache-dynamic (checked here, so a bad value or a
    missing file fails before the model loads; `draft` is then a LookupCorpus)."""
    from edgeinfer.speculative import LookupCorpus, SpeculativeParams

    SpeculativeParams(n_max=args.draft_max, n_min=min(args.draft_min, args.draft_max),
                      p_min=args.draft_p_min).validate()
    draft = args.draft
    static = getattr(args, "lookup_cache_static", None)
    dynamic = getattr(args, "lookup_cache_dynamic", None)
    if static is not None or dynamic is not None:
        if draft not in (None, "lookup"):
            flag = "--lookup-cache-static" if static is not None else "--lookup-cache-dynamic"
            raise EdgeInferError(f"{flag} is for --draft lookup, not a draft model ({draft})")
        if static is not None and dynamic is not None and _same_file(static, dynamic):
            raise EdgeInferError("--lookup-cache-static and --lookup-cache-dynamic name the same file")
        draft = LookupCorpus(static=static, dynamic=dynamic)
        draft.check_files()
    return dict(draft=draft, draft_max=args.draft_max, draft_min=args.draft_min,
                draft_p_min=args.draft_p_min)


def _same_file(a: str, b: str) -> bool:
    import os

    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.abspath(a) == os.path.abspath(b)


def add_sampling_options(p) -> None:
    p.add_argument("-n", "--max-tokens", type=int, default=-1, metavar="N",
                   help="stop after N tokens (-1 = until the model stops or the context is full)")
    p.add_argument("--temp", type=float, default=0.8, help="temperature; 0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=40, help="top-k (0 = off, default 40)")
    p.add_argument("--top-p", type=float, default=0.95, help="top-p (1 = off, default 0.95)")
    p.add_argument("--min-p", type=float, default=0.05, help="min-p (0 = off, default 0.05)")
    p.add_argument("--repeat-penalty", type=float, default=1.0, help="repetition penalty (1 = off)")
    p.add_argument("--seed", type=int, default=None, help="random seed for a reproducible run")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")


def sampling_from_args(args) -> dict:
    params = dict(max_tokens=args.max_tokens, temperature=args.temp, top_k=args.top_k,
                  top_p=args.top_p, min_p=args.min_p, repeat_penalty=args.repeat_penalty,
                  seed=args.seed, stop=list(args.stop))
    from edgeinfer.sampling import SamplingParams

    SamplingParams(**params).validate()  # bad flag values fail before the model loads
    return params
