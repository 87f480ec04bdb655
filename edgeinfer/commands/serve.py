"""`edgeinfer serve NAME`: the local REST API (OpenAI, Ollama and llama-server endpoints).

The server listens at once and answers `/health` with 503 while the model loads on a
thread; a model that fails to load, for whatever reason, stops the server with that
one-line error and exit status 1.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys
import threading
from pathlib import Path

from edgeinfer.commands.arg_types import non_negative_int, port_number, positive_float, positive_int
from edgeinfer.commands.image_input import add_offload_option, mmproj_offload_of
from edgeinfer.commands.model_flags import (add_model_options, add_sampling_options, model_kwargs,
                                           sampling_from_args)
from edgeinfer.errors import EdgeInferError

log = logging.getLogger("edgeinfer.server")
seconds = positive_float(86400, "a number of seconds", " seconds")  # --read-timeout, --idle-timeout


def keep_alive_duration(text: str) -> float:
    """argparse type: Ollama's keep_alive (\"5m\", \"1h30m\", seconds, 0, negative = for ever)."""
    from edgeinfer.server.keep_alive import parse_duration

    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over HTTP (OpenAI, Ollama and llama-server APIs)")
    p.add_argument("name", help="model alias, hf.co/owner/repo[:quant] or path to a .gguf file")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1; other addresses expose the server)")
    p.add_argument("--port", type=port_number, default=11434, help="port (default 11434, Ollama's)")
    p.add_argument("--max-queue", type=non_negative_int, default=8, metavar="N",
                   help="requests that may wait while one runs; more get 429 (default 8)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require Authorization: Bearer KEY (default: $EDGEINFER_API_KEY; /health stays open)")
    p.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="also allow browser requests from ORIGIN (repeatable or comma-separated; a '*' in it "
                        "stands for any part, '*' alone allows any, 'none' refuses all; $OLLAMA_ORIGINS adds "
                        "more). Default: pages on this machine (localhost, 127.0.0.1, [::1], any port) and "
                        "app://, file://, tauri://, vscode-webview://, vscode-file://")
    p.add_argument("--allowed-host", action="append", default=[], metavar="HOST",
                   help="accept this Host header besides localhost/127.0.0.1/::1 (repeatable; "
                        "'*' accepts any, only behind a proxy that checks Host)")
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="cancel a request after S seconds, queue wait included (default: none)")
    p.add_argument("--max-body", type=positive_int, default=None, metavar="BYTES",
                   help="largest request body accepted (default 2 MiB; 32 MiB where the model may take images, "
                        "which come as base64)")
    p.add_argument("--keep-alive", type=keep_alive_duration, default=-1.0, metavar="DURATION",
                   help="unload the model after this long idle, as Ollama's keep_alive: '5m', '1h30m', "
                        "seconds, 0 = after each request; requests may set their own (default: never)")
    p.add_argument("--read-timeout", type=seconds, default=30.0, metavar="S",
                   help="a request's headers and body must arrive within S seconds, else 408 (default 30)")
    p.add_argument("--idle-timeout", type=seconds, default=5.0, metavar="S",
                   help="close a kept-alive connection after S idle seconds (default 5)")
    p.add_argument("--max-models", type=positive_int, default=1, metavar="N",
                   help="models kept loaded at once: a request naming another local model loads it and the "
                        "least recently used one goes (default 1)")
    p.add_argument("--log-format", choices=("text", "json"), default="text",
                   help="access log on stderr, one line per request: text (default) or json")
    p.add_argument("-a", "--alias", action="append", type=name_list, default=[], metavar="NAMES",
                   help="names the served model answers to, comma-separated (repeatable); the first in "
                        "alphabetical order names it in responses, as llama-server's (default: NAME as given)")
    p.add_argument("--tags", action="append", type=name_list, default=[], metavar="TAGS",
                   help="tags listed with the model on /v1/models, comma-separated (informational)")
    p.add_argument("--strict-model-names", action="store_true",
                   help="answer 404 to a request naming a model the server does not know, even when it "
                        "serves one model file (default: such a server answers to any name)")
    p.add_argument("--pooling", choices=("none", "mean", "cls", "last", "rank"), default=None,
                   help="embeddings' pooling, over the file's: none gives a vector per token (/embeddings only)")
    p.add_argument("--rerank", "--reranking", action="store_true",
                   help="enable llama-server's reranking endpoint, POST /v1/rerank (/rerank, /v1/reranking): "
                        "the model must be a reranker (rank pooling: a bert cross-encoder, Qwen3-Reranker)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="llama-server's --verbose: every answer carries __verbose, the prompt as the model saw "
                        "it (a request's \"verbose\": false still turns it off)")
    p.add_argument("--reasoning", choices=("on", "off", "auto"), default="auto",
                   help="thinking for requests that do not say (llama-server's flag): on, off (a template "
                        "that opens <think> itself gets it closed), or auto, the template's default")
    p.add_argument("--slots", dest="slots_endpoint", action=argparse.BooleanOptionalAction, default=True,
                   help="llama-server's GET /slots monitoring endpoint (default: on; --no-slots answers 501)")
    p.add_argument("--slot-save-path", default=None, metavar="DIR",
                   help="enable llama-server's POST /slots/0?action=save|restore|erase, with files in DIR "
                        "(an existing folder; default: those are refused)")
    p.add_argument("--mmproj", default=None, metavar="FILE",
                   help="the served model's vision encoder GGUF (llama-server's --mmproj): requests may then send "
                        "images, in every dialect (default: the mmproj-*.gguf beside a model named from the store)")
    p.add_argument("--no-mmproj", action="store_true", help="load no mmproj, even one found beside the model")
    add_offload_option(p)
    p.add_argument("--allow-image-urls", action="store_true",
                   help="fetch the http(s) image URLs requests name (10 s a wait, 30 s and 20 MiB an image); "
                        "the server then reaches any address a client names, local network included "
                        "(default: only images sent as data, base64)")
    add_model_options(p)
    p.set_defaults(kv_cache_env=True)   # OLLAMA_KV_CACHE_TYPE when -ctk / -ctv are absent
    add_sampling_options(p)
    p.set_defaults(func=serve)


def name_list(text: str) -> list[str]:
    """argparse type: comma-separated names (--alias, --tags), spaces trimmed, empty ones dropped."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r} holds no name")
    return names


def serve(args) -> int:
    import uvicorn

    from edgeinfer.server import ServerConfig, access_log, create_app
    from edgeinfer.server.http_protocol import uvicorn_config

    if args.timeout is not None and args.timeout <= 0:
        raise EdgeInferError(f"--timeout must be positive, got {args.timeout}")
    slot_save_path = _slot_folder(args.slot_save_path)
    mmproj = _mmproj_of(args)
    origins = _origins(args.cors_origin)
    aliases = sorted({a for names in args.alias for a in names})
    config = ServerConfig(
        model_name=aliases[0] if aliases else args.name, aliases=aliases,
        tags=sorted({t for names in args.tags for t in names}), any_model_name=any_model_name(args),
        pooling=args.pooling, rerank=args.rerank, max_queue=args.max_queue,
        timeout_s=args.timeout,
        api_key=args.api_key or os.environ.get("EDGEINFER_API_KEY") or None,
        cors_origins=origins, allowed_hosts=list(args.allowed_host) + _bind_names(args.host),
        max_body_bytes=args.max_body or ((32 if mmproj is not None else 2) << 20),
        sampling=sampling_from_args(args), keep_alive_s=args.keep_alive,
        max_models=args.max_models, bind_host=args.host, slot_save_path=slot_save_path,
        slots_endpoint=args.slots_endpoint, reasoning=args.reasoning, verbose=args.verbose,
        allow_image_urls=args.allow_image_urls,
        # other local models load with the same options, but their own chat templates
        model_options={k: v for k, v in model_kwargs(args).items() if k != "chat_template"})
    if not _is_loopback(args.host):
        print(f"edgeinfer: warning: listening on {args.host} exposes the model to the network"
              + ("" if config.api_key else "; consider --api-key (without one, pull, delete, copy "
                 "and create are refused)"), file=sys.stderr)
    kwargs = model_kwargs(args)
    if mmproj is not None:  # the served model's only: other local models load without one
        kwargs["mmproj"] = mmproj
        kwargs["mmproj_offload"] = mmproj_offload_of(args)

    def load_model(**overrides):  # overrides: load options a request asked for (Ollama's num_ctx...)
        import edgeinfer

        return edgeinfer.load(args.name, **{**kwargs, **overrides})

    app = create_app(config, loader=load_model)
    state = app.state.server
    access_log.configure(args.log_format)
    if args.verbose:
        _log_info_lines()
    server = uvicorn.Server(uvicorn_config(app, host=args.host, port=args.port,
                                           read_timeout_s=args.read_timeout, idle_timeout_s=args.idle_timeout))

    def load() -> None:
        try:
            model = load_model()
            state.set_model(model)
            if args.verbose:   # where the layers and the vision encoder run
                print(f"edgeinfer: {model.placement}", file=sys.stderr)
            print(f"edgeinfer: serving {args.name} on http://{_url_host(args.host)}:{args.port}", file=sys.stderr)
        except EdgeInferError as exc:
            state.load_error = str(exc)
            server.should_exit = True
        except BaseException as exc:  # noqa: BLE001 - any failure ends the server, never a 503 for ever
            log.debug("loading failed", exc_info=exc)
            state.load_error = f"failed to load {args.name}: {type(exc).__name__}: {exc}"
            server.should_exit = True

    print(f"edgeinfer: loading {args.name} ...", file=sys.stderr)
    threading.Thread(target=load, name="edgeinfer-load", daemon=True).start()
    server.run()
    if state.load_error:
        raise EdgeInferError(state.load_error)
    return 0


def _log_info_lines() -> None:
    """--verbose: the server's info lines on stderr too (a name mapped to the served model, a
    refused origin, a client gone mid-body); without it only warnings reach stderr."""
    if not any(getattr(h, "edgeinfer_verbose", False) for h in log.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.edgeinfer_verbose = True
        log.addHandler(handler)
        log.propagate = False
    log.setLevel(logging.INFO)


def any_model_name(args) -> bool:
    """One model file served and no store of several: any model name means it, as llama-server
    and LM Studio answer (clients configured with gpt-3.5-turbo work). A model named from the
    store, or --max-models above 1, serves the store: an unknown name stays a 404, as in Ollama."""
    one_file = Path(args.name).expanduser().is_file() and args.max_models == 1
    return one_file and not args.strict_model_names


def _origins(flags: list[str]) -> list[str]:
    """--cors-origin values and $OLLAMA_ORIGINS, checked now: a bad one stops serve with one line."""
    from edgeinfer.server.cors import BadOrigin, configured_origins, origin_policy

    origins = configured_origins(flags, os.environ.get("OLLAMA_ORIGINS"))
    for source, values in (("--cors-origin", flags), ("$OLLAMA_ORIGINS", origins[len(flags):])):
        try:
            origin_policy(values)
        except BadOrigin as exc:
            raise EdgeInferError(f"{source}: {exc}") from None
    return origins


def _mmproj_of(args) -> str | None:
    """edgeinfer.load's mmproj for the served model: --mmproj's file (checked to exist before
    the model loads), None with --no-mmproj or for a model given as a file, else "auto" (the
    mmproj beside a model named from the store, as llama-server's -hf and `run` find it)."""
    if args.no_mmproj:
        if args.mmproj is not None:
            raise EdgeInferError("--no-mmproj loads no vision encoder: it cannot go with --mmproj")
        return None
    if args.mmproj is not None:
        file = Path(args.mmproj).expanduser()
        if not file.is_file():
            raise EdgeInferError(f"--mmproj: no such file: {args.mmproj}")
        return str(file)
    return None if Path(args.name).expanduser().is_file() else "auto"


def _slot_folder(path: str | None) -> str | None:
    """--slot-save-path: an existing folder (as llama-server requires), made absolute."""
    if path is None:
        return None
    if not os.path.isdir(path):
        raise EdgeInferError(f"--slot-save-path {path!r} is not a folder; create it first")
    return os.path.abspath(path)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _bind_names(host: str) -> list[str]:
    """A server bound to one specific address accepts that address as Host too."""
    if host in ("0.0.0.0", "::", "") or _is_loopback(host):
        return []
    return [host]


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
