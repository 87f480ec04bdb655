"""`edgeinfer run` at its edges: empty prompts, models without a chat template, the default -n."""

from __future__ import annotations

import io
import re
import subprocess
import sys

import pytest

from edgeinfer.cli import main

RUN = [sys.executable, "-m", "edgeinfer.cli", "run"]
NO_PROMPT = "edgeinfer: error: no prompt given\n"
FAST = ["--backend", "reference", "--temp", "0"]


@pytest.fixture(scope="module")
def templated(tmp_path_factory):
    """A tiny llama whose file carries a chat template."""
    from gguf_factory import spm_vocab, write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tmpl") / "chatty.gguf", "llama", "F32", vocab=spm_vocab(),
                            chat_template="{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                                          "assistant:")


@pytest.fixture
def calls(monkeypatch):
    """Which Model entry point each answer went through: 'chat' or 'generate'."""
    from edgeinfer.api import Model

    seen: list[str] = []
    chat, generate = Model.chat, Model.generate

    def spy_chat(self, *a, **kw):
        seen.append("chat")
        return chat(self, *a, **kw)

    def spy_generate(self, *a, **kw):
        seen.append("generate")
        return generate(self, *a, **kw)

    monkeypatch.setattr(Model, "chat", spy_chat)
    monkeypatch.setattr(Model, "generate", spy_generate)
    return seen


class _Terminal(io.StringIO):
    """Lines typed at a terminal, for the interactive mode."""

    def isatty(self) -> bool:
        return True


# -- empty prompts ----------------------------------------------------------------------------

@pytest.mark.parametrize("prompt", ["", "   ", " \n\t "])
def test_empty_prompt_argument_is_one_line_exit_2(tiny_models, capsys, prompt):
    assert main(["run", str(tiny_models["llama"]), prompt, *FAST]) == 2
    captured = capsys.readouterr()
    assert captured.err == NO_PROMPT and captured.out == ""


@pytest.mark.parametrize("stdin", ["", "\n  \n"])
def test_empty_stdin_is_one_line_exit_2(tiny_models, stdin):
    proc = subprocess.run(RUN + [str(tiny_models["llama"]), *FAST, "-c", "64"], input=stdin,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr == NO_PROMPT and proc.stdout == ""


# -- models without a chat template --------------------------------------------------------------

def test_model_without_template_runs_as_completion(tiny_models, capsys, calls):
    path = str(tiny_models["llama"])  # the factory writes no tokenizer.chat_template
    assert main(["run", path, "hello world", "-n", "4", "-c", "64", *FAST]) == 0
    assert calls == ["generate"]
    err = capsys.readouterr().err
    assert f"{path} has no chat template: running as plain completion (use --chat-template NAME to chat)" in err
    assert err.count("no chat template") == 1


def test_completion_output_is_the_plain_completion(tiny_models, capsys):
    import edgeinfer

    path = str(tiny_models["gemma3"])
    expected = edgeinfer.load(path, n_ctx=64, backend="reference").generate(
        "hello world", max_tokens=6, temperature=0).text
    assert main(["run", path, "hello world", "-n", "6", "-c", "64", *FAST]) == 0
    assert capsys.readouterr().out == expected + "\n"


def test_chat_template_flag_forces_chat(tiny_models, capsys, calls):
    assert main(["run", str(tiny_models["gemma3"]), "hello", "--chat-template", "gemma", "-n", "3",
                 "-c", "128", *FAST]) == 0
    assert calls == ["chat"]
    assert "no chat template" not in capsys.readouterr().err


def test_model_with_template_chats_and_raw_still_completes(templated, capsys, calls):
    assert main(["run", str(templated), "hello", "-n", "3", "-c", "128", *FAST]) == 0
    assert calls == ["chat"]
    assert "no chat template" not in capsys.readouterr().err
    calls.clear()
    assert main(["run", str(templated), "hello", "--raw", "-n", "3", "-c", "128", *FAST]) == 0
    assert calls == ["generate"]


def test_interactive_without_template_completes_each_line(tiny_models, monkeypatch, capsys, calls, tmp_path):
    monkeypatch.setenv("EDGEINFER_HOME", str(tmp_path))
    monkeypatch.setattr(sys, "stdin", _Terminal("hello world\nthe code\n/bye\n"))
    assert main(["run", str(tiny_models["llama"]), "-n", "3", "-c", "64", *FAST]) == 0
    assert calls == ["generate", "generate"]
    assert capsys.readouterr().err.count("running as plain completion") == 1


# -- the default -n of a one-shot run -------------------------------------------------------------

def _eval_counts(err: str) -> tuple[int, int, str]:
    prompt = int(re.search(r"prompt eval count:\s+(\d+)", err).group(1))
    gen = int(re.search(r"eval count:\s+(\d+) token", err.split("prompt eval count")[1]).group(1))
    return prompt, gen, re.search(r"finish reason:\s+(\w+)", err).group(1)


def test_one_shot_default_stops_at_the_window(tiny_models, capsys):
    """Context shift is on by default for `run`, yet a one-shot answer ends with the window:
    the last token is sampled from the window's last position and never evaluated."""
    n_ctx = 48
    assert main(["run", str(tiny_models["llama"]), "hello world", "-c", str(n_ctx), "--verbose", *FAST]) == 0
    prompt, gen, finish = _eval_counts(capsys.readouterr().err)
    assert finish == "length"
    assert prompt + gen == n_ctx + 1


def test_explicit_n_past_the_window_still_shifts(tiny_models, capsys):
    assert main(["run", str(tiny_models["llama"]), "hello world", "-c", "32", "-n", "70", "--verbose", *FAST]) == 0
    _, gen, finish = _eval_counts(capsys.readouterr().err)
    assert (gen, finish) == (70, "length")


# -- the real default model -------------------------------------------------------------------------

@pytest.mark.slow
def test_readme_example_on_gemma3_270m_is_a_completion(gemma_path, capsys):
    import edgeinfer

    question = "Why is the sky blue?"
    expected = edgeinfer.load(str(gemma_path), n_ctx=256).generate(question, max_tokens=12, temperature=0).text
    assert main(["run", str(gemma_path), question, "-n", "12", "--temp", "0", "-c", "256"]) == 0
    captured = capsys.readouterr()
    assert captured.out == expected + "\n"
    assert "has no chat template: running as plain completion" in captured.err
