#!/usr/bin/env python3
"""A stand-in `llama-server` binary for llama.cpp's server test suite: llama-server's flags
mapped onto `edgeinfer serve`, the suite's downloads (`--hf-repo`, `--hf-file`) mapped onto
tiny local models that `scripts/llama_server_tests.sh` generated with tests/gguf_factory.py.

    EDGEINFER_SHIM_MODELS=DIR llama_server_shim.py --port 8080 --hf-repo ggml-org/models ...

Flags with no counterpart are dropped where they change nothing an edgeinfer server does
(`--cont-batching`, `-fa`, `--parallel`: one slot), and named on stderr.
"""

from __future__ import annotations

import os
import sys

# llama-server flag -> (edgeinfer serve flag or None to drop, takes a value)
FLAGS: dict[str, tuple[str | None, bool]] = {
    "--port": ("--port", True), "--host": ("--host", True), "--temp": ("--temp", True),
    "--seed": ("--seed", True), "--ctx-size": ("--ctx-size", True), "-c": ("--ctx-size", True),
    "--n-predict": ("--max-tokens", True), "-n": ("--max-tokens", True),
    "--batch-size": ("--prefill-chunk", True), "-b": ("--prefill-chunk", True),
    "--threads": ("--threads", True), "-t": ("--threads", True),
    "--n-gpu-layers": ("--gpu-layers", True), "-ngl": ("--gpu-layers", True),
    "--api-key": ("--api-key", True), "--alias": ("--alias", True), "-a": ("--alias", True),
    "--context-shift": ("--context-shift", False), "--pooling": ("--pooling", True),
    "--slot-save-path": ("--slot-save-path", True), "--slots": ("--slots", False),
    "--no-slots": ("--no-slots", False), "--reasoning": ("--reasoning", True),
    "--cors-origins": (None, True),  # split below into --cors-origin each
    "--chat-template": ("--chat-template", True), "--chat-template-file": ("--chat-template-file", True),
    "--model-draft": (None, True),
    # no effect on an edgeinfer server (one slot, jinja templates always, metrics always on)
    "--ubatch-size": (None, True), "-ub": (None, True), "--parallel": (None, True), "-np": (None, True),
    "-ctk": (None, True), "-ctv": (None, True), "-fa": (None, True), "--grp-attn-n": (None, True),
    "--grp-attn-w": (None, True), "--reasoning-format": (None, True),
    "--tags": ("--tags", True), "--cache-ram": (None, True), "--sleep-idle-seconds": (None, True),
    "--spec-type": (None, True), "--spec-draft-n-max": (None, True), "--spec-draft-n-min": (None, True),
    "--models-dir": (None, True), "--models-max": (None, True), "--models-preset": (None, True),
    "--media-path": (None, True), "--mmproj-url": (None, True), "--lora": (None, True),
    "--cont-batching": (None, False), "--embedding": (None, False), "--embeddings": (None, False),
    "--reranking": (None, False), "--metrics": (None, False), "--kv-unified": (None, False),
    "--swa-full": (None, False),
    "--no-ui": (None, False), "--jinja": (None, False), "--no-jinja": (None, False),
    "--offline": (None, False), "--verbose": ("--verbose", False), "--no-mmproj": (None, False),
    "--no-models-autoload": (None, False), "--no-cache-idle-slots": (None, False),
}


def model_for(repo: str | None, file: str | None, model: str | None, models: str) -> str:
    """The tiny local model standing in for the suite's download."""
    if model:
        return model
    name = f"{repo or ''}/{file or ''}".lower()
    for key, local in (("bge", "embed.gguf"), ("reranker", "embed.gguf"), ("infill", "infill.gguf"),
                       ("gemma", "gemma3.gguf")):
        if key in name:
            return os.path.join(models, local)
    return os.path.join(models, "llama.gguf")  # stories260K, stories15M_MOE, the router's


def translate(argv: list[str], models: str) -> list[str]:
    out: list[str] = []
    repo = file = model = None
    dropped: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        value = argv[i + 1] if i + 1 < len(argv) else None
        if arg in ("--hf-repo", "-hf", "-hfr"):
            repo, i = value, i + 2
            continue
        if arg in ("--hf-file", "-hff"):
            file, i = value, i + 2
            continue
        if arg in ("--model", "-m"):
            model, i = value, i + 2
            continue
        if arg == "--cors-origins":
            for origin in (value or "").split(","):
                if origin.strip():
                    out += ["--cors-origin", origin.strip()]
            i += 2
            continue
        mapped, takes = FLAGS.get(arg, (None, False))
        if arg not in FLAGS:
            dropped.append(arg)
        elif mapped is None:
            dropped.append(arg)
        else:
            out.append(mapped)
            if takes:
                out.append(value)
        i += 2 if takes else 1
    if dropped:
        print(f"llama-server shim: dropped {' '.join(dropped)}", file=sys.stderr)
    # llama-server splits --ctx-size among --parallel slots; edgeinfer has one slot: give it
    # the window one of llama-server's slots would have
    slots = _value(argv, "--parallel", "-np")
    if slots and int(slots) > 1 and "--ctx-size" in out:
        k = out.index("--ctx-size") + 1
        out[k] = str(int(out[k]) // int(slots))
    return [model_for(repo, file, model, models), *out]


def _value(argv: list[str], *names: str) -> str | None:
    for i, arg in enumerate(argv[:-1]):
        if arg in names:
            return argv[i + 1]
    return None


def make_models(out: str) -> None:
    """The stand-ins, written once: a llama (SPM vocabulary) for the stories models, the same
    with FIM tokens for the infill preset, a gemma3, and a BERT encoder for the embedding and
    reranking presets. Random weights: their text is noise, their shapes are right."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root / "tests"))
    from gguf_factory import TinyShape, spm_vocab, write_tiny_model
    from gguf_factory_embed import write_tiny_encoder

    dest = Path(out)
    dest.mkdir(parents=True, exist_ok=True)
    shape = TinyShape(n_embd=64, n_layer=2, n_head=4, n_head_kv=2, head_dim=16, n_ff=128, n_ctx=4096)
    write_tiny_model(dest / "llama.gguf", "llama", shape=shape, seed=1)
    vocab = spm_vocab()
    for token in ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"):
        vocab["tokens"].append(token)
        vocab["types"].append(3)
        vocab["scores"].append(0.0)
    write_tiny_model(dest / "infill.gguf", "llama", shape=shape, vocab=vocab, seed=2)
    write_tiny_model(dest / "gemma3.gguf", "gemma3", shape=shape, seed=3)
    write_tiny_encoder(dest / "embed.gguf", "bert", n_ctx_train=512, seed=4)


def main() -> None:
    if sys.argv[1:2] == ["--make-models"]:
        make_models(sys.argv[2])
        return
    models = os.environ.get("EDGEINFER_SHIM_MODELS")
    if not models:
        sys.exit("llama-server shim: set EDGEINFER_SHIM_MODELS to the folder of generated models")
    args = translate(sys.argv[1:], models)
    if "--max-tokens" not in args:
        args += ["--max-tokens", "-1"]
    args = known_to_serve(args)
    os.execvp(sys.executable, [sys.executable, "-c", "import sys; from edgeinfer.cli import main; "
                               "sys.exit(main(sys.argv[1:]))", "serve", *args])


def known_to_serve(args: list[str]) -> list[str]:
    """Drop the mapped flags this version of `edgeinfer serve` lacks (an older checkout: the
    runner's "before" count), naming them."""
    from edgeinfer.cli import build_parser

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    known = {o for a in serve._actions for o in a.option_strings}
    out, i, dropped = [args[0]], 1, []
    while i < len(args):
        flag = args[i]
        n = 1 if flag in _SWITCHES else 2
        if flag in known:
            out += args[i:i + n]
        else:
            dropped.append(flag)
        i += n
    if dropped:
        print(f"llama-server shim: this edgeinfer serve lacks {' '.join(dropped)}", file=sys.stderr)
    return out


# serve flags that take no value: the mapped llama-server flags that take none
_SWITCHES = {mapped for mapped, takes in FLAGS.values() if mapped is not None and not takes}


if __name__ == "__main__":
    main()
