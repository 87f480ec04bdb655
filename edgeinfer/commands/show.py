"""`edgeinfer show NAME`: what `ollama show` prints, read from the GGUF header."""

from __future__ import annotations

import json
import re
from collections import Counter


# Control characters in a file's text (terminal escapes, carriage returns) are shown as U+FFFD
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _printable(text: str) -> str:
    return _CONTROL.sub("\ufffd", text)


def _kv_per_token(cfg, types=None) -> str:
    """f16 K/V bytes one token of context takes, each shared K/V counted once (gemma4), and
    what the layers that keep none do instead; with quantized `types` (-ctk / -ctv), theirs too."""
    from edgeinfer.kv.pool_sizing import model_kv_bytes_per_token

    if types is not None and types.quantized:
        f16, q = model_kv_bytes_per_token(cfg), model_kv_bytes_per_token(cfg, types=types)
        return (f"{q / 1024:.4g} KiB ({q} bytes, {types}; {q / f16:.2f}x f16's "
                f"{f16 / 1024:.4g} KiB)")

    n = model_kv_bytes_per_token(cfg)
    text = f"{n / 1024:.4g} KiB ({n} bytes, f16"
    shared = sum(1 for i in range(cfg.n_layer) if not cfg.is_recurrent(i) and not cfg.owns_kv(i))
    if shared:
        text += f"; {shared} of {cfg.n_layer} layers reuse an earlier layer's K/V"
    recurrent = sum(1 for i in range(cfg.n_layer) if cfg.is_recurrent(i))
    if recurrent:
        text += f"; {recurrent} recurrent layers keep a fixed-size state instead"
    return text + ")"


def _kv_heads(heads) -> str:
    """'KV 8', or for per-layer counts how many layers have each: 'KV per layer: 8 on 6 layers, 2 on 2'."""
    if not isinstance(heads, list):
        return f"KV {heads}"
    counts = [f"{h} on {n}" for h, n in sorted(Counter(heads).items(), reverse=True)]
    return f"KV per layer: {counts[0]} layers" + "".join(f", {c}" for c in counts[1:])


def _cache_types(args):
    from edgeinfer.commands.model_flags import cache_type_kwargs
    from edgeinfer.kv.cache_types import CacheTypes

    kw = cache_type_kwargs(args)
    return CacheTypes(kw["cache_type_k"], kw["cache_type_v"])


def register(sub) -> None:
    p = sub.add_parser("show", help="show a model's architecture, size and quantization")
    p.add_argument("name", help="model alias, hf.co/owner/repo[:quant] or path to a .gguf file")
    p.add_argument("--json", action="store_true", help="print the facts as JSON")
    from edgeinfer.commands.model_flags import add_cache_type_options

    add_cache_type_options(p)
    p.add_argument("-c", "--ctx-size", type=int, default=4096, help="context size for the GPU plan")
    p.add_argument("-ngl", "--gpu-layers", default="auto", help="GPU layers for the plan (N|auto|0)")
    p.add_argument("--vram-gb", type=float, default=None, metavar="GB",
                   help="plan for a card with this much free VRAM instead of this machine's GPU")
    p.add_argument("--cpu-moe", action="store_true", help="plan every layer's experts on the CPU")
    p.add_argument("--n-cpu-moe", type=int, default=None, metavar="N",
                   help="plan the first N layers' experts on the CPU (default: as many as the card needs)")
    p.set_defaults(func=run)


def run(args) -> int:
    # numpy and gguf: only when the command runs, not for every `edgeinfer --help`
    from edgeinfer.loader import open_model
    from edgeinfer.model_info import describe, human_bytes, human_count
    from edgeinfer.store.registry import resolve

    from edgeinfer.backends.offload import CPU_MOE_ALL, hypothetical_card, plan_for_model

    card = hypothetical_card(args.vram_gb) if args.vram_gb is not None else None  # checked before any output
    mf = open_model(resolve(args.name, download=False))
    info = describe(mf)
    if args.json:
        print(json.dumps(info.to_dict(), indent=2))
        return 0
    rows = [
        ("architecture", info.architecture),
        ("name", _printable(info.name)),
        ("parameters", human_count(info.parameters)),
        ("context length", info.context_length),
        ("embedding length", info.embedding_length),
        ("layers", info.block_count),
        ("attention heads", f"{info.head_count} ({_kv_heads(info.head_count_kv)})"),
        *([("experts", f"{mf.config.n_expert} ({mf.config.n_expert_used} used a token)")]
          if mf.config.n_expert else []),
        ("quantization", info.quantization),
        ("K/V per token", _kv_per_token(mf.config, _cache_types(args))),
    ]
    print("  Model")
    for key, value in rows:
        print(f"    {key:<20}{value}")
    print("\n  Tensors")
    for qtype, count in info.tensor_types.items():
        print(f"    {qtype:<20}{count}")
    print("\n  File")
    print(f"    {'path':<20}{_printable(info.path)}")
    print(f"    {'size':<20}{human_bytes(info.file_size)}")
    print(f"    {'chat template':<20}{'yes' if info.has_chat_template else 'none (a built-in one is used)'}")
    n_cpu_moe = CPU_MOE_ALL if args.cpu_moe else args.n_cpu_moe
    plan = plan_for_model(mf.gguf, mf.config, args.ctx_size, gpu_layers=args.gpu_layers, device=card,
                          n_cpu_moe=n_cpu_moe)
    print(f"\n  Placement (context {args.ctx_size})\n    {plan.describe()}")
    if info.license:
        print(f"\n  License\n    {_printable(info.license)}")
    return 0
