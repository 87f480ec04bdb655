"""A generation job's answer on its way to the client: whole, or as a stream of events.

The first chunk is awaited (through the queue and the prefill) before any header is sent,
so errors up to then are plain APIErrors; after that a failure is one error event. The
client going away cancels the job.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import AsyncIterator, Callable, Iterable

from fastapi import Request
from fastapi.responses import StreamingResponse

from edgeinfer.errors import ContextOverflowError, EdgeInferError
from edgeinfer.results import GenerationChunk
from edgeinfer.server.access_log import note_usage
from edgeinfer.server.errors import APIError, context_exceeded, error_body, error_of
from edgeinfer.server.worker import Job

log = logging.getLogger("edgeinfer.server")

SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def _fail(exc: BaseException) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ContextOverflowError):
        if exc.n_prompt is not None and exc.n_ctx is not None:
            return context_exceeded(exc.n_prompt, exc.n_ctx)
        return APIError(400, str(exc), code="context_length_exceeded", kind="exceed_context_size_error")
    if isinstance(exc, EdgeInferError):
        return APIError(400, str(exc))
    log.error("generation failed", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}")


def watch_disconnect(job: Job, request: Request) -> None:
    """Cancel the job as soon as the client goes away, whether or not chunks are flowing.

    The body has been read, so the next ASGI message is `http.disconnect`; a task waits
    for it beside the request (both the streamed and the whole-answer paths). The job
    stops the task when it ends.
    """
    if job.watcher is not None:
        return

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                job.cancel_job()
                return

    job.watcher = asyncio.ensure_future(watch())
    scope = request.scope
    job.on_last = lambda last: note_usage(scope, last.usage.prompt_tokens, last.usage.completion_tokens) \
        if last.usage is not None else None


async def _next_chunk(job: Job, request: Request) -> GenerationChunk | None:
    """The job's next chunk; on any failure the job is cancelled and errors become APIError."""
    try:
        return await job.next()
    except BaseException as exc:
        job.cancel_job()
        _finish(job)
        if isinstance(exc, asyncio.CancelledError):
            raise
        raise _fail(exc) from None


async def first_chunk(job: Job, request: Request) -> GenerationChunk | None:
    """Wait (through the queue and the prefill) for the first chunk; errors become APIError."""
    watch_disconnect(job, request)
    chunk = await _next_chunk(job, request)
    if chunk is None and job.timed_out:
        raise APIError(504, "the request timed out while waiting for the model", code="timeout")
    return chunk


async def collect(job: Job, request: Request) -> tuple[str, GenerationChunk]:
    """A whole non-streamed answer: (text, final chunk)."""
    chunks, last = await collect_chunks(job, request)
    return "".join(c.text for c in chunks), last


async def collect_chunks(job: Job, request: Request) -> tuple[list[GenerationChunk], GenerationChunk]:
    """A whole non-streamed answer: (every chunk, final chunk)."""
    parts: list[GenerationChunk] = []
    chunk = await first_chunk(job, request)
    try:
        while chunk is not None:
            parts.append(chunk)
            chunk = await _next_chunk(job, request)
    finally:
        _finish(job)
    if job.timed_out:
        raise APIError(504, f"the request took longer than {request.app.state.server.config.timeout_s}s",
                       code="timeout")
    if job.last is None:  # cancelled before it started
        raise APIError(499, "the request was cancelled")
    return parts, job.last


async def stream_chunks(job: Job, first: GenerationChunk | None) -> AsyncIterator[GenerationChunk]:
    """The rest of a streamed answer. If the client goes away, the watcher (or Starlette
    cancelling this generator) cancels the generation: it stops before its next token."""
    try:
        chunk = first
        while chunk is not None:
            yield chunk
            chunk = await job.next()
    except Exception as exc:  # noqa: BLE001 - headers are sent: the caller turns it into an error event
        raise _fail(exc) from None
    finally:
        _finish(job)
        job.cancel_job()  # no-op when it finished


def _finish(job: Job) -> None:
    if job.timer is not None:
        job.timer.cancel()
    if job.watcher is not None:
        job.watcher.cancel()


async def stream_events(job: Job, first: GenerationChunk | None, path: str, encode: Callable[[dict], str],
                        on_text: Callable[[str], dict],
                        on_last: Callable[[GenerationChunk], Iterable[dict]],
                        done: str = "",
                        on_chunk: Callable[[GenerationChunk], Iterable[dict]] | None = None
                        ) -> AsyncIterator[str]:
    """A streamed answer as encoded events: one a text piece (or, with `on_chunk`, those it
    builds from each chunk: logprobs, several choices), then those `on_last` builds from the
    final chunk, then `done` (OpenAI's `[DONE]` line). A failure or a timeout once the
    headers are out ends the stream with one error event in the path's dialect."""
    last = None
    try:
        async for chunk in stream_chunks(job, first):
            if on_chunk is not None:
                for body in on_chunk(chunk):
                    yield encode(body)
            elif chunk.text:
                yield encode(on_text(chunk.text))
            if chunk.finish_reason is not None:
                last = chunk
    except APIError as exc:
        yield encode(error_of(path, exc))
        return
    if job.timed_out:
        yield encode(error_body(path, 504, "the request timed out", code="timeout"))
        return
    if last is None:  # cancelled before it finished: the client is gone
        return
    for body in on_last(last):
        yield encode(body)
    if done:
        yield done


def sse(obj: dict) -> str:
    """One server-sent event (OpenAI and llama-server streams)."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
