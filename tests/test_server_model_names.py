"""Model names (#58): a server of one model file answers to any name, as llama-server and LM
Studio do (the response names the real model; --verbose logs the mapping once); a server of
the store keeps Ollama's 404; --strict-model-names keeps it for one file too. --alias takes
several names and --tags lists tags, both on /v1/models and /models, as llama-server's."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from edgeinfer.cli import build_parser
from edgeinfer.commands.serve import any_model_name
from test_server import MODEL, fim_model_path, load_tiny, start_server  # noqa: F401 - a fixture

CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def model(fim_model_path):  # noqa: F811
    return load_tiny(fim_model_path)


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture()
def server_log():
    """The server logger's messages (attached to it: serve's access log stops propagation)."""
    logger, handler = logging.getLogger("edgeinfer.server"), Records()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler.lines
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_one_model_server_answers_to_any_name(model, server_log):
    srv = start_server(model, any_model_name=True, verbose=True)
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        for _ in range(2):
            r = client.chat.completions.create(model="gpt-3.5-turbo", messages=CHAT, max_tokens=2)
            assert r.model == MODEL and r.choices[0].message.content is not None   # the real model's name
        assert client.completions.create(model="local-model", prompt="hi", max_tokens=2).model == MODEL
        import ollama

        assert ollama.Client(host=srv.url).chat(model="llama3", messages=CHAT,
                                                options={"num_predict": 1}).model == MODEL
        mapped = [line for line in server_log if "gpt-3.5-turbo" in line]
        assert mapped == [(f"the model name 'gpt-3.5-turbo' means the served model {MODEL!r} "
                           "(serve --strict-model-names refuses it)")]          # once, not per request
        assert sum("'local-model'" in line for line in server_log) == 1
    finally:
        srv.stop()


def test_without_verbose_the_mapping_is_not_logged(model, server_log):
    srv = start_server(model, any_model_name=True)
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        assert client.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=1).model == MODEL
        assert not [line for line in server_log if "gpt-4o" in line]
    finally:
        srv.stop()


def test_store_server_keeps_the_404(model):
    srv = start_server(model)   # any_model_name off: what serve gives a store name or --max-models N
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.NotFoundError) as e:
            client.chat.completions.create(model="gpt-3.5-turbo", messages=CHAT, max_tokens=2)
        assert e.value.body["code"] == "model_not_found" and "gpt-3.5-turbo" in e.value.body["message"]
        assert client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1).model == MODEL
    finally:
        srv.stop()


def test_which_servers_answer_to_any_name(fim_model_path, tmp_path):  # noqa: F811
    def decide(*argv) -> bool:
        return any_model_name(build_parser().parse_args(["serve", *argv]))

    assert decide(str(fim_model_path))
    assert not decide(str(fim_model_path), "--strict-model-names")
    assert not decide(str(fim_model_path), "--max-models", "2")   # a store of several models
    assert not decide("gemma3")                                   # a model of the store
    assert not decide(str(tmp_path / "missing.gguf"))


def test_aliases_and_tags_are_listed(model):
    srv = start_server(model, model_name="code", aliases=["code", "fim", "tinyllama-2"], tags=["chat", "small"])
    try:
        for path in ("/v1/models", "/models"):
            data = httpx.get(srv.url + path).json()["data"]
            assert len(data) == 1
            assert data[0]["id"] == "code" and data[0]["aliases"] == ["code", "fim", "tinyllama-2"]
            assert data[0]["tags"] == ["chat", "small"]
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        assert client.chat.completions.create(model="fim", messages=CHAT, max_tokens=1).model == "code"
        with pytest.raises(openai.NotFoundError):   # a store server: an alias is a name, others are not
            client.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=1)
    finally:
        srv.stop()


def test_alias_and_tags_flags_split_on_commas():
    args = build_parser().parse_args(["serve", "m.gguf", "-a", "tinyllama-2, fim,code", "--alias", "x",
                                      "--tags", "chat,fim,small"])
    assert args.alias == [["tinyllama-2", "fim", "code"], ["x"]] and args.tags == [["chat", "fim", "small"]]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "m.gguf", "--alias", " , "])


# -- `edgeinfer serve FILE` itself, with the official openai client ------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_serve(path, *flags):
    """`edgeinfer serve` in a process of its own: (process, base url), once /health says ok."""
    port = free_port()
    code = "import sys; from edgeinfer.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.Popen([sys.executable, "-c", code, "serve", str(path), "--port", str(port),
                             "--backend", "reference", "--ctx-size", "256", *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OLLAMA_ORIGINS": ""})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"serve did not come up: {proc.communicate()[1][-2000:]}")


def stop(proc) -> str:
    proc.terminate()
    try:
        return proc.communicate(timeout=30)[1]
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate()[1]


def test_serve_file_answers_gpt_3_5_turbo(fim_model_path):  # noqa: F811
    proc, url = run_serve(fim_model_path, "--verbose", "--alias", "tinyllama-2,fim", "--tags", "chat")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        for _ in range(2):
            r = client.chat.completions.create(model="gpt-3.5-turbo", messages=CHAT, max_tokens=2)
            assert r.model == "fim" and len(r.choices) == 1
        listed = client.models.list().data[0]
        assert listed.id == "fim" and listed.aliases == ["fim", "tinyllama-2"] and listed.tags == ["chat"]
    finally:
        err = stop(proc)
    assert err.count("the model name 'gpt-3.5-turbo' means the served model 'fim'") == 1, err[-2000:]


def test_serve_file_strict_model_names_keeps_the_404(fim_model_path):  # noqa: F811
    proc, url = run_serve(fim_model_path, "--strict-model-names")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="gpt-3.5-turbo", messages=CHAT, max_tokens=2)
        r = client.chat.completions.create(model=fim_model_path.name, messages=CHAT, max_tokens=1)
        assert r.model == str(fim_model_path)
    finally:
        stop(proc)
