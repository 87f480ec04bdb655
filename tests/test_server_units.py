"""Server parts without a server: FIM layout, Host parsing, the worker's queue, strict schemas."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from edgeinfer.results import GenerationChunk, Usage
from edgeinfer.server.errors import APIError
from edgeinfer.server.fim import CHUNK_SEPARATOR, infill_tokens
from edgeinfer.server.schemas import ChatCompletionRequest, InfillRequest
from edgeinfer.server.security import SecurityMiddleware, host_name
from edgeinfer.server.worker import QueueFullError, Worker

PRE, SUF, MID, REP, SEP, BOS = 1001, 1002, 1003, 1004, 1005, 1


class CharTokenizer:
    """One token per character (its code point): token layouts can be read off by eye."""

    def __init__(self, rep_sep: bool = False, add_bos: bool = True) -> None:
        self.fim_pre_id, self.fim_suf_id, self.fim_mid_id = PRE, SUF, MID
        self.fim_rep_id, self.fim_sep_id = (REP, SEP) if rep_sep else (None, None)
        self.bos_id, self.add_bos = BOS, add_bos

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        assert not add_special
        return [ord(c) for c in text]


def ords(s: str) -> list[int]:
    return [ord(c) for c in s]


def test_fim_layout_psm():
    ids = infill_tokens(CharTokenizer(), "ab", "cd", prompt="P", n_ctx=256, n_predict=4)
    assert ids == [BOS, PRE, *ords("ab"), *ords("P"), SUF, *ords("cd"), MID]
    assert infill_tokens(CharTokenizer(add_bos=False), "", "", n_ctx=256, n_predict=4) == [PRE, SUF, MID]


def test_fim_truncates_like_llama_server():
    # n_batch = min(2048, n_ctx) = 16: prefix keeps its last 12 tokens, suffix its first 16/4 - 2 = 2
    ids = infill_tokens(CharTokenizer(add_bos=False), "0123456789abcdefghij", "ABCDEFG", n_ctx=16, n_predict=0)
    assert ids == [PRE, *ords("89abcdefghij"), SUF, *ords("AB"), MID]


def test_fim_extra_context_with_repo_and_file_separators():
    # extra chunks only fit when n_ctx - n_batch - 2 n_predict > 0: n_ctx 4096, n_batch 2048
    tok = CharTokenizer(rep_sep=True)
    ids = infill_tokens(tok, "x", "y", extra=[("a.py", "T")], n_ctx=4096, n_predict=10)
    extra = [REP, *ords("myproject\n"), SEP, *ords("a.py\n"), *ords("T"), SEP, *ords("filename\n")]
    assert ids == extra + [BOS, PRE, ord("x"), SUF, ord("y"), MID]
    # without FIM_SEP the chunks are separated by llama-server's snippet marker
    ids = infill_tokens(CharTokenizer(), "x", "y", extra=[("a.py", "T")], n_ctx=4096, n_predict=10)
    assert ids[:len(CHUNK_SEPARATOR) + 1] == ords(CHUNK_SEPARATOR + "T")
    # and with a small context they are dropped, as llama-server drops them
    assert REP not in infill_tokens(tok, "x", "y", extra=[("a.py", "T")], n_ctx=256, n_predict=10)


def test_fim_needs_fim_tokens():
    tok = CharTokenizer()
    tok.fim_mid_id = None
    with pytest.raises(APIError) as e:
        infill_tokens(tok, "a", "b", n_ctx=64, n_predict=1)
    assert e.value.status == 400 and "FIM" in e.value.message


@pytest.mark.parametrize("header,name", [("localhost", "localhost"), ("LOCALHOST:11434", "localhost"),
                                         ("127.0.0.1:8080", "127.0.0.1"), ("[::1]:11434", "::1"),
                                         ("[::1]", "::1"), ("example.com.", "example.com")])
def test_host_name(header, name):
    assert host_name(header) == name


def test_origin_rules():
    mw = SecurityMiddleware(None, cors_origins=["https://ok.example"])
    assert mw.origin_allowed("https://ok.example/")
    assert mw.origin_allowed("http://localhost:5173") and mw.origin_allowed("vscode-webview://abc")
    assert not mw.origin_allowed("https://evil.example") and not mw.origin_allowed("null")
    assert not mw.origin_allowed("http://localhost.evil.example")
    assert not SecurityMiddleware(None, cors_origins=["none"]).origin_allowed("http://localhost:5173")


def test_schemas_are_strict():
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate_json('{"messages": [{"role": "user", "content": "x"}], "max_tokens": "5"}')
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate_json('{"messages": [{"role": "user", "content": "x"}], "stream": 1}')
    with pytest.raises(ValidationError):
        InfillRequest.model_validate_json('{"n_keep": -2}')
    req = ChatCompletionRequest.model_validate_json(
        '{"messages": [{"role": "user", "content": "x"}], "temperature": 1}')
    assert req.temperature == 1.0
    with pytest.raises(ValidationError):  # unknown fields are refused, never dropped
        ChatCompletionRequest.model_validate_json(
            '{"messages": [{"role": "user", "content": "x"}], "unknown_field": 3}')


# -- the worker ------------------------------------------------------------------------------------

def fake_generation(n: int, delay: float = 0.0, log: list | None = None, name: str = ""):
    """A stand-in for Model.generate(stream=True): n tokens, honours cancel between tokens."""
    def start(cancel: threading.Event):
        if log is not None:
            log.append(name)
        done = 0
        for i in range(n):
            if cancel.is_set():
                break
            time.sleep(delay)
            done += 1
            yield GenerationChunk(text=f"{i} ", token=i)
        finish = "cancelled" if cancel.is_set() else "length"
        yield GenerationChunk("", None, finish, Usage(3, done, 0), None)
    return start


async def drain(job) -> list[GenerationChunk]:
    out = []
    while (c := await job.next()) is not None:
        out.append(c)
    return out


def test_worker_runs_jobs_in_order_one_at_a_time():
    async def main():
        w = Worker(max_queue=8)
        w.start()
        loop = asyncio.get_running_loop()
        log: list[str] = []
        jobs = [w.submit(fake_generation(3, 0.001, log, str(i)), loop) for i in range(4)]
        results = await asyncio.gather(*(drain(j) for j in jobs))
        w.stop()
        return log, results

    log, results = asyncio.run(main())
    assert log == ["0", "1", "2", "3"]
    for chunks in results:
        assert "".join(c.text for c in chunks) == "0 1 2 " and chunks[-1].finish_reason == "length"


def test_worker_queue_bound_and_queued_cancel():
    async def main():
        w = Worker(max_queue=2)
        w.start()
        loop = asyncio.get_running_loop()
        log: list[str] = []
        running = w.submit(fake_generation(1000, 0.001, log, "running"), loop)
        while not running.started:
            await asyncio.sleep(0.001)
        waiting = [w.submit(fake_generation(1, 0, log, f"w{i}"), loop) for i in range(2)]
        with pytest.raises(QueueFullError) as e:
            w.submit(fake_generation(1, 0, log, "rejected"), loop)
        assert e.value.retry_after_s >= 1
        waiting[0].cancel_job()          # leaves the line at once...
        assert w.queue_depth == 1
        assert await waiting[0].next() is None
        late = w.submit(fake_generation(1, 0, log, "late"), loop)  # ...so its place is free again
        running.cancel_job()             # the running one stops at its next token
        chunks = await drain(running)
        assert chunks[-1].finish_reason == "cancelled" and chunks[-1].usage.completion_tokens < 1000
        await drain(waiting[1])
        await drain(late)
        w.stop()
        return log

    assert asyncio.run(main()) == ["running", "w1", "late"]


def test_worker_hands_exceptions_to_the_request():
    def broken(cancel):
        raise ValueError("boom")

    async def main():
        w = Worker()
        w.start()
        job = w.submit(broken, asyncio.get_running_loop())
        with pytest.raises(ValueError, match="boom"):
            await job.next()
        ok = w.submit(fake_generation(2), asyncio.get_running_loop())  # the worker survived
        chunks = await drain(ok)
        w.stop()
        return chunks

    assert asyncio.run(main())[-1].usage.completion_tokens == 2
