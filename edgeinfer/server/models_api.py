"""Model management over HTTP: Ollama's /api/tags, /api/ps, /api/show, /api/pull, /api/delete,
/api/copy, /api/create and OpenAI's /v1/models, /v1/models/{id}.

Names in requests are looked up in the local store (registry.resolve_stored) and checked by
model_names.check_name; they never become paths. Pull, delete, copy and create change the
store, so a server listening beyond loopback refuses them without --api-key.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import stat
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field, ValidationError

from edgeinfer import gguf_split
from edgeinfer.store import model_names, registry
from edgeinfer.errors import DownloadError, EdgeInferError, ModelNotFoundError
from edgeinfer.server.constraints import thinks
from edgeinfer.server.errors import APIError
from edgeinfer.server.state import kv_cache_types
from edgeinfer.server.fim import has_fim
from edgeinfer.server.images import has_image_input
from edgeinfer.server.requests import describe, read_body
from edgeinfer.server.schemas import Body, OllamaOptions, OllamaShowRequest, Unsupported
from edgeinfer.units import human_count

log = logging.getLogger("edgeinfer.server")

router = APIRouter()
NDJSON = "application/x-ndjson"
FOREVER_ISO = "9999-12-31T23:59:59Z"


def iso(ts: float) -> str:
    """A wall-clock time as Ollama writes it (UTC, ending in Z)."""
    return datetime.fromtimestamp(ts, timezone.utc).isoformat().replace("+00:00", "Z")


# -- request bodies -------------------------------------------------------------------------

Name = Annotated[str, Field(min_length=1, max_length=512)]


class PullRequest(Body):
    model: Name | None = None
    name: Name | None = None            # older clients
    stream: bool = True
    insecure: Unsupported("insecure registries are not used: models come from the Hugging Face Hub", False) = None


class DeleteRequest(Body):
    model: Name | None = None
    name: Name | None = None


class CopyRequest(Body):
    source: Name
    destination: Name


class CreateRequest(Body):
    model: Name | None = None
    name: Name | None = None
    from_: Annotated[str, Field(min_length=1, max_length=4096)] | None = Field(None, alias="from")
    files: Annotated[dict[str, str], Field(max_length=1)] | None = None
    template: Annotated[str, Field(max_length=1 << 20)] | None = None
    system: Annotated[str, Field(max_length=1 << 20)] | None = None
    license: str | list[str] | None = None
    parameters: dict[str, Any] | None = None
    modelfile: str | None = None
    stream: bool = True
    quantize: Unsupported("quantizing is not supported") = None
    adapters: Unsupported("adapters (LoRA) are not supported", {}) = None
    messages: Unsupported("seeded messages are not supported", []) = None


def _name(req) -> str:
    name = req.model if req.model is not None else req.name
    if not name:
        raise APIError(400, "invalid field 'model': a model name is required", param="model")
    return name


def check_store_name(name: str) -> str:
    """A name a request gives for the store: an hf.co reference or a plain name; 400 otherwise."""
    try:
        if registry.parse_hf_ref(name) is not None:
            return name
        return model_names.check_name(name)
    except EdgeInferError as exc:
        raise APIError(400, str(exc), param="model") from None


def allow_store_changes(state) -> None:
    """Pull, delete, copy and create need loopback or an API key."""
    if state.config.exposed and not state.config.api_key:
        raise APIError(403, f"changing the model store is refused: this server listens on "
                            f"{state.config.bind_host} without --api-key")


# -- model facts ----------------------------------------------------------------------------

def _facts(state, path) -> Any:
    """model_info.describe of a file, cached by (path, size, mtime); None if it cannot be read."""
    from edgeinfer.loader import open_model
    from edgeinfer.model_info import describe as describe_file

    try:
        st = os.stat(path)
    except OSError:
        return None
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in state.file_facts:
        try:
            state.file_facts[key] = describe_file(open_model(path))
        except EdgeInferError:
            state.file_facts[key] = None
    return state.file_facts[key]


def details(info) -> dict:
    if info is None:
        return {"parent_model": "", "format": "gguf", "family": "", "families": [], "parameter_size": "",
                "quantization_level": ""}
    return {"parent_model": "", "format": "gguf", "family": info.architecture,
            "families": [info.architecture], "parameter_size": human_count(info.parameters),
            "quantization_level": info.quantization}


def _digest(path) -> str:
    """The file's sha256 where the store already knows it (Hub blobs are named by it)."""
    try:
        blob = Path(path).resolve().name
    except OSError:
        return ""
    return blob if len(blob) == 64 and all(c in "0123456789abcdef" for c in blob) else ""


def _entry(state, name: str, path) -> dict:
    info = _facts(state, path)
    try:
        st = os.stat(path)
        size, mtime = st.st_size, st.st_mtime
    except OSError:
        size, mtime = 0, time.time()
    return {"name": name, "model": name, "modified_at": iso(mtime), "size": size, "digest": _digest(path),
            "details": details(info)}


def _served_path(state) -> str:
    slot = state.default
    return slot.path or str(getattr(slot.model, "path", "") or "")


@router.get("/api/tags")
async def tags(request: Request) -> JSONResponse:
    state = request.app.state.server

    def collect() -> list[dict]:
        out, seen = [], set()
        served = _served_path(state)
        if served:
            out.append(_entry(state, state.config.model_name, served))
            seen.add(state.config.model_name)
        for m in registry.list_local():
            if m.name not in seen:
                seen.add(m.name)
                out.append(_entry(state, m.name, m.path))
        return out

    return JSONResponse({"models": await anyio.to_thread.run_sync(collect)})


@router.get("/api/ps")
async def ps(request: Request) -> JSONResponse:
    state = request.app.state.server
    resident = [(s, s.model) for s in state.resident()]

    def collect() -> list[dict]:
        out = []
        for slot, model in resident:
            entry = _entry(state, slot.name, slot.path or model.path)
            expires = slot.expires_at()
            del entry["modified_at"]
            out.append({**entry, "expires_at": FOREVER_ISO if expires is None else iso(expires),
                        "size_vram": 0, "context_length": model.n_ctx, **kv_cache_types(model)})
        return out

    return JSONResponse({"models": await anyio.to_thread.run_sync(collect)})


@router.post("/api/show")
async def show(request: Request) -> JSONResponse:
    state = request.app.state.server
    req = await read_body(request, OllamaShowRequest)
    model = state.require_model()
    state.check_model_name(req.model if req.model is not None else req.name)
    info = await anyio.to_thread.run_sync(_facts, state, model.path)
    if info is None:
        raise APIError(500, f"cannot read the facts of {model.path}")
    arch = info.architecture
    model_info_keys = {
        "general.architecture": arch, "general.name": info.name,
        "general.parameter_count": info.parameters, "general.file_type": info.quantization,
        f"{arch}.context_length": info.context_length, f"{arch}.embedding_length": info.embedding_length,
        f"{arch}.block_count": info.block_count, f"{arch}.attention.head_count": info.head_count,
        f"{arch}.attention.head_count_kv": info.head_count_kv}
    if req.verbose:  # Ollama's verbose: every key of the file, its vocabulary arrays whole
        model_info_keys = {**await anyio.to_thread.run_sync(_file_keys, model.path), **model_info_keys}
    named = state.slot.named
    template = getattr(getattr(model, "template", None), "source", "") or ""
    capabilities = ["completion"] + (["insert"] if has_fim(model.tokenizer) else []) + \
        (["tools"] if getattr(model, "supports_tools", False) else []) + (["thinking"] if thinks(model) else []) + \
        (["vision"] if has_image_input(model) else [])
    params = "\n".join(f"{k} {json.dumps(v) if isinstance(v, str) else v}"
                       for k, vs in (named.parameters.items() if named else [])
                       for v in (vs if isinstance(vs, list) else [vs]))
    license_text = (named.license if named and named.license else None) or info.license or ""
    return JSONResponse({"license": license_text, "modelfile": "", "parameters": params,
                         "template": template, "system": (named.system or "") if named else "",
                         "details": details(info), "model_info": model_info_keys,
                         "capabilities": capabilities, "modified_at": _entry(state, "", model.path)["modified_at"]})


def _file_keys(path) -> dict:
    """The GGUF metadata of `path` as JSON values (its template is /api/show's `template`)."""
    from edgeinfer.loader import open_model

    try:
        metadata = open_model(path).gguf.metadata
    except EdgeInferError as exc:
        raise APIError(500, f"cannot read the metadata of {path}: {exc}") from None
    return {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in metadata.items()
            if k != "tokenizer.chat_template"}


# -- OpenAI ---------------------------------------------------------------------------------

def _openai_model(state, name: str, slot=None) -> dict:
    body = {"id": name, "object": "model", "created": int(time.time()), "owned_by": "edgeinfer"}
    if slot is not None:  # llama-server's fields: every --alias, and --tags (the served model's)
        body["aliases"] = sorted(slot.aliases)
        body["tags"] = list(state.config.tags) if slot is state.default else []
    model = slot.model if slot is not None else None
    if model is not None:
        body["meta"] = {"n_ctx": model.n_ctx, "n_ctx_train": model.config.n_ctx_train}
        # as llama-server lists them: "multimodal" where the model takes images (--mmproj)
        body["capabilities"] = ["completion"] + (["multimodal"] if has_image_input(model) else [])
    return body


@router.get("/v1/models")
@router.get("/models")   # llama-server serves it unprefixed too
async def models(request: Request) -> JSONResponse:
    state = request.app.state.server
    if not state.default.loaded.is_set():
        state.require_model()  # 503 while the served model's first load is under way
    data = [_openai_model(state, state.config.model_name, state.default)]
    data += [_openai_model(state, s.name, s) for s in state.resident() if s is not state.default]
    return JSONResponse({"object": "list", "data": data})


@router.get("/v1/models/{model_id:path}")
async def retrieve(model_id: str, request: Request) -> JSONResponse:
    state = request.app.state.server
    slot = state.find_slot(model_id) if model_id not in ("", "default") else None
    if slot is None:
        path = await anyio.to_thread.run_sync(registry.resolve_stored, model_id)
        if path is None:
            raise APIError(404, f"The model '{model_id[:200]}' does not exist", param="model",
                           code="model_not_found")
    return JSONResponse(_openai_model(state, model_id, slot))


# -- changing the store ---------------------------------------------------------------------

def _line(obj: dict) -> str:
    return json.dumps(obj, ensure_ascii=False) + "\n"


class _Stopped(Exception):
    """The client left: the download stops (its partial file stays for the next pull)."""


def plan_pull(name: str):
    """(repo_id, [RemoteFile]) to download for `name` (every part of a split GGUF, in order),
    or None for the packaged demo model."""
    from edgeinfer.store import download

    ref = registry.parse_hf_ref(name)
    if ref is not None:
        repo, wanted = ref.repo_id, None
    else:
        entry = registry._alias(name)
        if entry is None:
            raise ModelNotFoundError(f"unknown model {name!r}: pull an alias or hf.co/OWNER/REPO[:QUANT]")
        if entry.embedded:
            return None
        repo, wanted = entry.repo, entry.file
    files = download.list_remote_files(repo)
    if wanted is None:
        wanted = registry.pick_gguf([f.path for f in files], ref.quant, repo)
    by_path = {f.path: f for f in files}
    missing = [p for p in gguf_split.part_names(wanted) if p not in by_path]
    if missing:
        raise ModelNotFoundError(f"hf.co/{repo} has no file {missing[0]}")
    return repo, [by_path[p] for p in gguf_split.part_names(wanted)]


def _store_error(exc: EdgeInferError) -> APIError:
    if isinstance(exc, ModelNotFoundError) or "not found" in str(exc):
        return APIError(404, str(exc))
    if isinstance(exc, DownloadError):
        return APIError(502, str(exc))
    return APIError(400, str(exc))


@router.post("/api/pull")
async def pull(request: Request):
    state = request.app.state.server
    req = await read_body(request, PullRequest)
    allow_store_changes(state)
    name = check_store_name(_name(req))
    try:
        plan = await anyio.to_thread.run_sync(plan_pull, name)
    except EdgeInferError as exc:
        raise _store_error(exc) from None
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    stop = threading.Event()
    parts = plan[1] if plan else []  # each part is a layer of its own, as Ollama reports a model's layers
    last = [0.0]

    def reporter(k: int):
        def report(done: int, size) -> None:
            if stop.is_set():
                raise _Stopped()
            now = time.monotonic()
            if now - last[0] >= 0.1 or done == (size or parts[k].size):
                last[0] = now
                loop.call_soon_threadsafe(queue.put_nowait, ("progress", (k, done)))
        return report

    def run() -> None:
        from edgeinfer.store import download

        try:
            if plan is None:
                result = registry.embedded_path(registry._alias(name))
            else:
                for k, part in enumerate(parts):
                    got = download.fetch(plan[0], part.path, progress=reporter(k))
                    result = got if k == 0 else result  # the first part is the model's path
            loop.call_soon_threadsafe(queue.put_nowait, ("done", result))
        except BaseException as exc:  # noqa: BLE001 - handed to the request
            try:
                loop.call_soon_threadsafe(queue.put_nowait, ("error", exc))
            except RuntimeError:
                pass

    def progress_line(k: int, done: int) -> dict:
        digest = f"sha256:{parts[k].sha256}" if parts[k].sha256 else ""
        short = digest.removeprefix("sha256:")[:12]
        return {"status": f"pulling {short}", "digest": digest, "total": parts[k].size, "completed": done}

    async def events():
        try:
            threading.Thread(target=run, name="edgeinfer-pull", daemon=True).start()
            yield {"status": "pulling manifest"}
            while True:
                kind, value = await queue.get()
                if kind == "progress":
                    yield progress_line(*value)
                elif kind == "error":
                    if isinstance(value, EdgeInferError):
                        yield {"error": str(value)}
                    else:
                        yield {"error": f"pull failed: {type(value).__name__}: {value}"}
                    return
                else:
                    if plan is not None:
                        for k, part in enumerate(parts):
                            yield progress_line(k, part.size)
                        yield {"status": "verifying sha256 digest"}  # download.fetch checked size and hash
                    yield {"status": "writing manifest"}
                    yield {"status": "success"}
                    return
        finally:
            stop.set()  # the client left (or it is over): a running download stops at its next piece

    if req.stream:
        async def lines():
            async for obj in events():
                yield _line(obj)
        return StreamingResponse(lines(), media_type=NDJSON)

    watcher = asyncio.ensure_future(_wait_disconnect(request, stop))
    try:
        final = None
        async for obj in events():
            final = obj
            if "error" in obj:
                raise APIError(502 if "cannot reach" in obj["error"] else 400, obj["error"])
        return JSONResponse(final)
    finally:
        watcher.cancel()


async def _wait_disconnect(request: Request, stop: threading.Event) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            stop.set()
            return


@router.delete("/api/delete")
async def delete(request: Request) -> JSONResponse:
    state = request.app.state.server
    req = await read_body(request, DeleteRequest)
    allow_store_changes(state)
    name = check_store_name(_name(req))
    if name in state.names_of(state.default):
        raise APIError(400, f"{name!r} is the model this server was started with; stop the server to delete it")
    try:
        await anyio.to_thread.run_sync(registry.remove, name)
    except OSError as exc:
        raise store_write_error(exc, f"deleting {name!r}") from None
    except EdgeInferError as exc:
        raise APIError(404, f"model {name!r} not found") if isinstance(exc, ModelNotFoundError) \
            else APIError(400, str(exc)) from None
    state.forget(name)
    return JSONResponse({})


async def _source(state, name: str):
    """(path, NamedModel or None) of a model to copy or build on: served, resident or stored."""
    slot = state.find_slot(name)
    if slot is not None and slot.path:
        return slot.path, slot.named
    path = await anyio.to_thread.run_sync(registry.resolve_stored, name)
    if path is None:
        raise APIError(404, f"model {name[:200]!r} not found")
    return str(path), await anyio.to_thread.run_sync(model_names.lookup, name)


def _destination(name: str) -> str:
    try:
        dest = model_names.check_name(name)
    except EdgeInferError as exc:
        raise APIError(400, str(exc)) from None
    if registry._alias(dest) is not None:
        raise APIError(400, f"{dest!r} is a built-in model name; choose another")
    return dest


_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
_READ_ONLY = {errno.EROFS, errno.EACCES, errno.EPERM}


def store_write_error(exc: OSError, what: str) -> APIError:
    """A write to the model store that failed: 507 for a full disk (or quota), 403 for a
    read-only or forbidden one, 500 for the rest; one line naming the problem and the place."""
    where = exc.filename or str(model_names.table_path().parent)
    reason = exc.strerror or type(exc).__name__
    log.warning("%s failed: %s: %s", what, reason, where)
    if exc.errno in _FULL:
        return APIError(507, f"{what} failed: the disk holding the model store is full ({where})")
    if exc.errno in _READ_ONLY:
        return APIError(403, f"{what} failed: the model store is not writable ({reason}: {where})")
    return APIError(500, f"{what} failed: {reason}: {where}")


async def save_name(row) -> None:
    """model_names.save off the loop (an atomic write: the table stays whole if it fails)."""
    try:
        await anyio.to_thread.run_sync(model_names.save, row)
    except OSError as exc:
        raise store_write_error(exc, f"saving the model name {row.name!r}") from None


@router.post("/api/copy")
async def copy(request: Request) -> JSONResponse:
    state = request.app.state.server
    req = await read_body(request, CopyRequest)
    allow_store_changes(state)
    dest = _destination(req.destination)
    path, named = await _source(state, check_store_name(req.source))
    row = model_names.NamedModel(dest, path, source=req.source)
    if named is not None:
        row.template, row.system, row.parameters, row.license = (named.template, named.system,
                                                                 dict(named.parameters), named.license)
    await save_name(row)
    state.forget(dest)  # a slot under the old meaning of the name must not answer for it
    return JSONResponse({})


def _local_gguf(text: str) -> str:
    """The `from` file of /api/create: an absolute path to an existing regular .gguf file."""
    if "\0" in text or not os.path.isabs(text):
        raise APIError(400, "invalid field 'from': give a model name or an absolute path to a .gguf file",
                       param="from")
    if not text.lower().endswith(".gguf"):
        raise APIError(400, "invalid field 'from': the file must be a .gguf file", param="from")
    try:
        st = os.stat(text)
    except OSError as exc:
        raise APIError(400, f"invalid field 'from': {exc.strerror or 'cannot read it'}: {text}", param="from") from None
    if not stat.S_ISREG(st.st_mode):
        raise APIError(400, f"invalid field 'from': {text} is not a regular file", param="from")
    return os.path.realpath(text)


def _check_gguf(path: str) -> None:
    from edgeinfer.loader import open_model

    open_model(path)  # header, tensors and the architecture checked; raises one EdgeInferError line


def _parameters(raw: dict[str, Any]) -> dict[str, Any]:
    try:
        return OllamaOptions.model_validate(raw).model_dump(exclude_none=True)
    except ValidationError as exc:
        message, _ = describe(exc)
        raise APIError(400, message.replace("field '", "field 'parameters.", 1), param="parameters") from None


@router.post("/api/create")
async def create(request: Request):
    from edgeinfer.store import modelfile

    state = request.app.state.server
    req = await read_body(request, CreateRequest)
    allow_store_changes(state)
    dest = _destination(_name(req))
    mf = modelfile.Modelfile()
    if req.modelfile:
        try:
            mf = modelfile.parse(req.modelfile)
        except EdgeInferError as exc:
            raise APIError(400, str(exc), param="modelfile") from None
    source = req.from_ or mf.from_
    if req.files:
        (_file, digest), = req.files.items()
        path, named = _blob(digest), None
        source = digest
    elif not source:
        raise APIError(400, "invalid field 'from': name a model or a .gguf file to create from", param="from")
    elif os.path.isabs(source) or source.lower().endswith(".gguf") or "\0" in source:
        path, named = _local_gguf(source), None
    else:
        path, named = await _source(state, check_store_name(source))
    try:
        await anyio.to_thread.run_sync(_check_gguf, path)
    except EdgeInferError as exc:
        raise APIError(400, f"invalid field 'from': not a usable GGUF model: {exc}", param="from") from None
    template = req.template or mf.template or (named.template if named else None)
    if template and "{{ ." in template.replace("{{- .", "{{ ."):
        raise APIError(400, "invalid field 'template': Go templates are not supported; give a Jinja chat "
                            "template (as in the GGUF file) or a template name", param="template")
    params = {**(named.parameters if named else {}), **mf.parameters, **(req.parameters or {})}
    lic = req.license if req.license is not None else (mf.license or (named.license if named else None))
    row = model_names.NamedModel(dest, path, source=source, template=template,
                                 system=req.system or mf.system or (named.system if named else None),
                                 parameters=_parameters(params),
                                 license="\n".join(lic) if isinstance(lic, list) else lic)
    await save_name(row)
    state.forget(dest)
    steps = [{"status": "parsing GGUF"}, {"status": "writing manifest"}, {"status": "success"}]
    if not req.stream:
        return JSONResponse(steps[-1])
    return StreamingResponse(iter(_line(s) for s in steps), media_type=NDJSON)


def _blob(digest: str) -> str:
    """A GGUF the store already holds, named by its sha256 (Hub blobs are)."""
    from edgeinfer.store import download

    hexdigest = digest.removeprefix("sha256:").removeprefix("sha256-")
    if len(hexdigest) != 64 or any(c not in "0123456789abcdef" for c in hexdigest):
        raise APIError(400, "invalid field 'files': a file is named by its digest, sha256:<64 hex digits>",
                       param="files")
    cache = download.hub_cache_dir()
    for repo in cache.glob("models--*") if cache.is_dir() else []:
        blobs = repo / "blobs"
        if blobs.is_dir() and hexdigest in {p.name for p in blobs.iterdir()}:
            return str(blobs / hexdigest)
    raise APIError(400, f"invalid field 'files': no file with digest sha256:{hexdigest[:12]}… in the local store",
                   param="files")
