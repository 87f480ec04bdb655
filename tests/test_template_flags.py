"""--chat-template-file (run, chat, serve) and serve --reasoning, as llama.cpp has them: a
template read from a file, and the thinking switch for requests that do not set one (a
template that opens <think> itself gets it closed when thinking is off)."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from starlette.testclient import TestClient

import edgeinfer
from edgeinfer.commands.model_flags import MAX_TEMPLATE_FILE, chat_template_of
from edgeinfer.errors import EdgeInferError
from edgeinfer.prompt.chat_template import close_forced_thinking
from edgeinfer.server import ServerConfig, create_app
from test_server import fim_model_path  # noqa: F401 - a fixture

USER = [{"role": "user", "content": "What is today?"}]
# QwQ / DeepSeek R1 style: the generation prompt opens the thinking block, no enable_thinking switch
FORCED = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")
# Qwen 3 style: a switch
SWITCH = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n"
          "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")


def _args(chat_template_file=None):
    return SimpleNamespace(chat_template=None, chat_template_file=chat_template_file)


def test_template_file_is_read_and_checked(tmp_path):
    good = tmp_path / "t.jinja"
    good.write_text(FORCED)
    assert chat_template_of(_args(chat_template_file=str(good))) == FORCED
    plain = tmp_path / "plain.txt"
    plain.write_text("This is not a chat template, it is")
    literal = chat_template_of(_args(chat_template_file=str(plain)))
    from edgeinfer.prompt.chat_template import ChatTemplate

    assert ChatTemplate(literal, "", "").render(USER) == "This is not a chat template, it is"
    big = tmp_path / "big.jinja"
    big.write_bytes(b"{{ x }}" + b" " * MAX_TEMPLATE_FILE)
    bad = tmp_path / "bad.jinja"
    bad.write_bytes(b"{{ \xff }}")
    empty = tmp_path / "empty.jinja"
    empty.write_text("  \n")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, needle in ((big, "larger than"), (bad, "not UTF-8"), (empty, "empty"), (tmp_path, "not a regular"),
                         (fifo, "not a regular"), (tmp_path / "missing", "cannot open")):
        with pytest.raises(EdgeInferError, match=needle):
            chat_template_of(_args(chat_template_file=str(path)))
    with pytest.raises(EdgeInferError, match="give one of them"):
        chat_template_of(SimpleNamespace(chat_template="chatml", chat_template_file=str(good)))


def test_cli_refuses_a_bad_template_file_in_one_line(fim_model_path, tmp_path):
    r = subprocess.run([sys.executable, "-m", "edgeinfer.cli", "run", str(fim_model_path), "--chat-template-file",
                        str(tmp_path / "missing.jinja"), "hi"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("edgeinfer: error: --chat-template-file")


def test_forced_thinking_is_closed_only_where_it_is_open():
    assert close_forced_thinking("<|im_start|>assistant\n<think>\n") == "<|im_start|>assistant\n<think>\n</think>"
    done = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert close_forced_thinking(done) == done
    assert close_forced_thinking("<|im_start|>assistant\n") == "<|im_start|>assistant\n"


@pytest.mark.parametrize("template,reasoning,request_think,end", [
    (FORCED, "auto", None, "assistant\n<think>\n"),
    (FORCED, "on", None, "assistant\n<think>\n"),
    (FORCED, "off", None, "assistant\n<think>\n</think>"),
    (FORCED, "off", True, "assistant\n<think>\n"),        # the request's own switch wins
    (SWITCH, "auto", None, "assistant\n"),
    (SWITCH, "off", None, "assistant\n<think>\n\n</think>\n\n"),
    (SWITCH, "on", False, "assistant\n<think>\n\n</think>\n\n"),
])
def test_serve_reasoning_sets_the_default_switch(fim_model_path, template, reasoning, request_think, end):
    model = edgeinfer.load(str(fim_model_path), backend="reference", n_ctx=128, chat_template=template)
    app = create_app(ServerConfig(model_name="tiny", reasoning=reasoning), model)
    body = {"messages": USER}
    if request_think is not None:
        body["chat_template_kwargs"] = {"enable_thinking": request_think}
    with TestClient(app, base_url="http://127.0.0.1") as c:
        prompt = c.post("/apply-template", json=body).json()["prompt"]
        assert prompt.endswith(end), prompt
        if reasoning == "off" and request_think is None:  # a chat answers after the closed block
            r = c.post("/v1/chat/completions", json={**body, "max_tokens": 2, "temperature": 0})
            assert r.status_code == 200 and r.json()["choices"][0]["message"].get("reasoning_content") is None
