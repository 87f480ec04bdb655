"""llama-server's /slots endpoints for edgeinfer's one slot (id 0): GET /slots describes it,
POST /slots/0?action=save|restore|erase keeps its state on disk (`serve --slot-save-path DIR`).

Actions run as jobs on the generation worker: they wait their turn behind running and queued
generations, as llama-server defers a slot action while its slot is busy, and never touch a
sequence a generation is using.
"""

from __future__ import annotations

import re
from typing import Any, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from edgeinfer.server import slot_files
from edgeinfer.server.errors import APIError
from edgeinfer.server.requests import describe, read_body
from edgeinfer.server.schemas import OneSlot, SlotEraseRequest, SlotFileRequest
from edgeinfer.server.slot_status import slot_json

router = APIRouter()
ACTIONS = ("save", "restore", "erase")
_INT = re.compile(r"[+-]?\d{1,10}")


@router.get("/slots")
async def slots(request: Request) -> JSONResponse:
    state = request.app.state.server
    if not state.config.slots_endpoint:
        raise APIError(501, "This server does not support slots endpoint. Start it with `--slots`",
                       kind="not_supported_error")
    query = _query(request, {"fail_on_no_slot"})
    model = state.require_model()
    slot = slot_json(model, state.worker.running, state.last_task)
    if query.get("fail_on_no_slot") and slot["is_processing"]:  # llama-server: any non-empty value asks
        raise APIError(503, "no slot available")
    return JSONResponse([slot])


@router.post("/slots/{id_slot}")
async def slot_action(request: Request, id_slot: str) -> JSONResponse:
    state = request.app.state.server
    folder = state.config.slot_save_path
    if not folder:  # llama-server's answer, before anything else is looked at
        raise APIError(501, "This server does not support slots action. Start it with `--slot-save-path`",
                       kind="not_supported_error")
    if not _INT.fullmatch(id_slot):
        raise APIError(400, f"Invalid slot ID {id_slot[:40]!r}: {OneSlot}", param="id_slot")
    if int(id_slot) != 0:
        raise APIError(400, f"Invalid slot ID {int(id_slot)}: {OneSlot}", param="id_slot")
    action = _query(request, {"action"}).get("action")
    if action not in ACTIONS:
        raise APIError(400, f"Invalid action {action!r}: use ?action=save, restore or erase", param="action")
    if action == "erase":
        await _empty_body(request, SlotEraseRequest)
        run: Callable[[Any], dict] = slot_files.erase
    else:
        name = slot_files.check_filename((await read_body(request, SlotFileRequest)).filename)
        do = slot_files.save if action == "save" else slot_files.restore
        run = lambda model: do(model, folder, name)  # noqa: E731
    if state.model is None and state.unloaded:  # keep_alive let it go: its slot comes back empty
        await state.ensure_model()
    model = state.require_model()
    state.acquire()  # not unloaded while the action waits or runs (the model gate does not see /slots/0)
    try:
        return JSONResponse(await _on_worker(state, lambda: run(model)))
    finally:
        state.release()


async def _on_worker(state, action: Callable[[], dict]) -> dict:
    """Run `action` on the worker thread, in the generations' queue; its exception is raised here."""
    box: dict[str, dict] = {}

    def start(_cancel):
        box["result"] = action()
        return iter(())

    job = state.submit(start)
    try:
        while await job.next() is not None:
            pass
    finally:
        if job.timer is not None:
            job.timer.cancel()
    if "result" not in box:  # taken out of the queue before it ran (the request timeout)
        raise APIError(504 if job.timed_out else 503, "the slot action was cancelled before it ran; retry")
    return box["result"]


def _query(request: Request, allowed: set[str]) -> dict[str, str]:
    """The query parameters, each named in `allowed`, each once; else a 400 naming it."""
    out: dict[str, str] = {}
    for key, value in request.query_params.multi_items():
        if key not in allowed:
            raise APIError(400, f"unsupported query parameter {key!r}: this endpoint takes "
                                f"{', '.join(sorted(allowed))}", param=key)
        if key in out:
            raise APIError(400, f"query parameter {key!r} is given twice", param=key)
        out[key] = value
    return out


async def _empty_body(request: Request, schema) -> None:
    """A body that may be absent; a present one is validated (so a field sent is never ignored)."""
    limit = request.app.state.server.config.max_body_bytes
    raw = bytearray()
    async for part in request.stream():  # bounded: a chunked body has no length to check first
        raw += part
        if len(raw) > limit:
            raise APIError(413, f"request body is larger than {limit} bytes")
    if not raw.strip():
        return
    try:
        schema.model_validate_json(bytes(raw))
    except ValidationError as exc:
        message, param = describe(exc)
        raise APIError(400, message, param=param) from None
