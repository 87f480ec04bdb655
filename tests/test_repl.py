"""The interactive `edgeinfer run`: slash commands fed as lines, the readline history, a real terminal."""

from __future__ import annotations

import io
import re
import shlex
import shutil
import subprocess
import sys
import time

import pytest

from edgeinfer.cli import build_parser
from edgeinfer.commands import line_input
from edgeinfer.commands.line_input import LineReader
from edgeinfer.commands.repl import Repl

TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny llama with a chat template and a license, and one without either."""
    from gguf_factory import spm_vocab, write_tiny_model

    root = tmp_path_factory.mktemp("repl")
    return {
        "chat": write_tiny_model(root / "chatty.gguf", "llama", "F32", vocab=spm_vocab(), chat_template=TEMPLATE,
                                 extra_metadata={"general.license": "apache-2.0"}),
        "base": write_tiny_model(root / "base.gguf", "gemma3", "F32", vocab=spm_vocab()),
    }


@pytest.fixture(scope="module")
def loaded(models):
    import edgeinfer

    return {k: edgeinfer.load(str(p), n_ctx=128, backend="reference", context_shift=True) for k, p in models.items()}


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEINFER_HOME", str(tmp_path))


class Session:
    """A Repl fed `lines` through the plain (non-terminal) reader; what it printed."""

    def __init__(self, model, path, lines: list[str], raw: bool = False, extra: tuple[str, ...] = ()) -> None:
        from edgeinfer.commands.model_flags import sampling_from_args

        self.args = build_parser().parse_args(["run", str(path), "-n", "3", "--temp", "0", "-c", "128",
                                               "--backend", "reference", *extra])
        self.params = sampling_from_args(self.args)
        self.out, self.err = io.StringIO(), io.StringIO()
        reader = LineReader(stdin=io.StringIO("".join(f"{line}\n" for line in lines)), stdout=self.out,
                            terminal=False)
        self.repl = Repl(model, self.args, self.params, raw, reader=reader, out=self.out, err=self.err)
        self.code = self.repl.loop()

    @property
    def errors(self) -> list[str]:
        return [line for line in self.err.getvalue().splitlines() if line.startswith("error:")]


def _chat(loaded, models, lines, **kw) -> Session:
    return Session(loaded["chat"], models["chat"], lines, **kw)


# -- /set parameter ----------------------------------------------------------------------------

def test_stop_values_are_parsed_like_a_shell(loaded, models):
    s = _chat(loaded, models, ['/set parameter stop "<|end|>" "###"'])
    assert s.params["stop"] == ["<|end|>", "###"]
    assert "Set parameter 'stop' to '<|end|>, ###'" in s.out.getvalue()
    s = _chat(loaded, models, ['/set parameter stop "."', "/set parameter stop 'two words'"])
    assert s.params["stop"] == ["two words"]  # as Ollama: the new list replaces the old
    assert not s.errors


def test_numbers_are_set(loaded, models):
    s = _chat(loaded, models, ["/set parameter temperature 0.5", "/set parameter num_predict 7",
                               "/set parameter seed 42", "/set parameter top_k 5"])
    assert (s.params["temperature"], s.params["max_tokens"], s.params["seed"], s.params["top_k"]) == (0.5, 7, 42, 5)


@pytest.mark.parametrize("line, says", [
    ("/set parameter foo 1", "unknown parameter 'foo'"),
    ("/set parameter temperature hot", "temperature needs a number, got 'hot'"),
    ("/set parameter top_k 1.5", "top_k needs a whole number"),
    ("/set parameter top_p 7", "top_p"),
    ("/set parameter num_predict -5", "num_predict"),
    ("/set parameter seed 1 2", "seed takes one value"),
    ("/set parameter temperature", "usage: /set parameter temperature"),
    ('/set parameter stop "unclosed', "cannot parse"),
    ("/set parameter num_ctx 8192", "restart with -c/--ctx-size"),
    ("/set format /no/such.schema.json", "cannot read"),
    ("/set colour on", "unknown /set option"),
    ("/show everything", "unknown /show topic"),
    ("/frobnicate", "unknown command '/frobnicate'"),
    ("/save ../escape", "invalid session name"),
    ("/load", "usage: /load"),
])
def test_bad_commands_are_one_line_and_the_repl_goes_on(loaded, models, line, says):
    s = _chat(loaded, models, [line, "/set parameter temperature 0.25", "/show parameters"])
    assert s.code == 0
    assert len(s.errors) == 1 and says in s.errors[0], s.err.getvalue()
    assert "Traceback" not in s.err.getvalue()
    assert s.params["temperature"] == 0.25 and s.params["top_p"] == 0.95 and s.params["stop"] == []
    assert re.search(r"^\s*temperature\s+0\.25$", s.out.getvalue(), re.M)


# -- /show -------------------------------------------------------------------------------------

def test_show_info_is_readable(loaded, models):
    text = _chat(loaded, models, ["/show info"]).out.getvalue()
    for label, value in (("architecture", "llama"), ("context length", r"\d+"), ("embedding length", r"\d+"),
                         ("quantization", "F32"), ("parameters", r"[\d.]+[KMB]?")):
        assert re.search(rf"^\s+{label}\s+{value}$", text, re.M), text
    assert "{" not in text


def test_show_parameters_system_template_license_modelfile(loaded, models):
    s = _chat(loaded, models, ["/show system", '/set system "You are terse."', "/show system",
                               '/set parameter stop "###"', "/show parameters", "/show template",
                               "/show license", "/show modelfile"])
    text = s.out.getvalue()
    assert "No system message was specified" in text
    assert re.search(r"^(>>> )?You are terse\.$", text, re.M)  # quotes removed, as Ollama does
    assert re.search(r"^\s+temperature\s+0\.0$", text, re.M) and re.search(r"^\s+top_k\s+40$", text, re.M)
    assert re.search(r'^\s+stop\s+"###"$', text, re.M)
    assert TEMPLATE in text and re.search(r"^(>>> )?apache-2\.0$", text, re.M)
    assert f"FROM {models['chat']}" in text and 'SYSTEM """You are terse."""' in text
    assert "PARAMETER temperature" in text and 'LICENSE """apache-2.0"""' in text
    assert not s.errors


def test_show_template_of_a_base_model(loaded, models):
    s = Session(loaded["base"], models["base"], ["/show template", "/show license"], raw=True)
    assert "plain completion" in s.out.getvalue() and "No license was specified" in s.out.getvalue()


# -- help, modes, conversation ---------------------------------------------------------------------

def test_help_topics(loaded, models):
    s = _chat(loaded, models, ["/?", "/help", "/? shortcuts", "/? set", "/help show", "/? parameters"])
    text = s.out.getvalue()
    for command in ("/set", "/show", "/load", "/save", "/clear", "/bye", "/? shortcuts", '"""'):
        assert command in text
    assert "Ctrl + r" in text and "/set verbose" in text and "/show modelfile" in text
    assert "/set parameter stop <string> <string> ..." in text
    assert text.count("Available Commands:") == 4 and not s.errors


def test_verbose_and_quiet(loaded, models):
    s = _chat(loaded, models, ["/set verbose", "hello", "/set quiet", "world"])
    assert len(re.findall(r"^eval rate:", s.err.getvalue(), re.M)) == 1
    assert "Set 'verbose' mode." in s.out.getvalue() and "Set 'quiet' mode." in s.out.getvalue()


def test_turns_accumulate_and_clear_forgets_them(loaded, models, monkeypatch):
    sent = []
    model = loaded["chat"]
    chat = type(model).chat
    monkeypatch.setattr(type(model), "chat", lambda self, messages, **kw: sent.append(messages) or chat(
        self, messages, **kw))
    s = _chat(loaded, models, ["/set system be brief", "hello", "the code", "/clear", "world", "/bye", "never"])
    assert [len(m) for m in sent] == [2, 4, 2]
    assert sent[1][0] == {"role": "system", "content": "be brief"} and sent[1][1]["content"] == "hello"
    assert "Cleared session context." in s.out.getvalue()
    assert len(s.repl.history) == 2 and s.code == 0  # nothing after /bye was read


def test_multi_line_messages(loaded, models, monkeypatch):
    sent = []
    model = loaded["chat"]
    chat = type(model).chat
    monkeypatch.setattr(type(model), "chat", lambda self, messages, **kw: sent.append(messages) or chat(
        self, messages, **kw))
    s = _chat(loaded, models, ['"""', "first line", "second line", '"""', '"""one line"""',
                               '/set system """', "be", "brief", '"""'])
    assert [m[-1]["content"] for m in sent] == ["first line\nsecond line", "one line"]
    assert s.repl.system == "be\nbrief"


def test_save_then_load_a_session(loaded, models, tmp_path):
    s = _chat(loaded, models, ["/set system be brief", "hello", "/save mine"])
    assert (tmp_path / "sessions" / "mine.npz").exists()
    assert "Saved session 'mine'" in s.out.getvalue()
    s = _chat(loaded, models, ["/load mine"])
    assert len(s.repl.history) == 2 and s.repl.system == "be brief" and not s.errors


def test_load_another_model(loaded, models):
    s = _chat(loaded, models, [f"/load {models['base']}", "/show info", "/load no-such-model-here", "/show info"])
    assert s.repl.name == str(models["base"]) and s.repl.raw  # the base model completes
    assert f"Loaded model '{models['base']}'." in s.out.getvalue()
    assert s.out.getvalue().count("gemma3") >= 2  # the failed /load kept the loaded model
    assert len(s.errors) == 1 and "no-such-model-here" in s.errors[0]


def test_base_model_completes_each_line(loaded, models, monkeypatch):
    prompts = []
    model = loaded["base"]
    generate = type(model).generate
    monkeypatch.setattr(type(model), "generate", lambda self, prompt, **kw: prompts.append(prompt) or generate(
        self, prompt, **kw))
    s = Session(model, models["base"], ["hello world", "the code", "/save x"], raw=True)
    assert prompts == ["hello world", "the code"]
    assert len(s.errors) == 1 and "plain completion" in s.errors[0]


# -- the readline history ------------------------------------------------------------------------

def test_history_file_is_written_bounded_and_read_back(tmp_path):
    readline = pytest.importorskip("readline")
    path = tmp_path / "deep" / "history"
    line_input.load_history(readline, path)  # no file yet: empty
    assert readline.get_current_history_length() == 0
    for i in range(line_input.HISTORY_LENGTH + 250):
        readline.add_history(f"line {i}")
    line_input.save_history(readline, path)
    lines = [x for x in path.read_text().splitlines() if not x.startswith("_HiStOrY")]
    assert len(lines) == line_input.HISTORY_LENGTH and lines[-1] == f"line {line_input.HISTORY_LENGTH + 249}"
    readline.clear_history()
    line_input.load_history(readline, path)
    n = readline.get_current_history_length()
    assert n == line_input.HISTORY_LENGTH
    assert readline.get_history_item(n) == f"line {line_input.HISTORY_LENGTH + 249}"
    readline.clear_history()


def test_history_lives_in_the_edgeinfer_home(tmp_path):
    assert line_input.history_path() == tmp_path / "history"


def test_plain_input_never_uses_readline(tmp_path):
    reader = LineReader(stdin=io.StringIO("hi\n"), stdout=io.StringIO())
    assert not reader.editing
    assert reader.read_message() == "hi"
    with pytest.raises(EOFError):
        reader.read_message()
    assert not (tmp_path / "history").exists()


# -- a real terminal ---------------------------------------------------------------------------

def _tmux(sock: str, *args: str) -> str:
    return subprocess.run(["tmux", "-L", sock, *args], check=True, capture_output=True, text=True).stdout


def _wait_for(sock: str, predicate, what: str, timeout: float = 90) -> str:
    deadline = time.monotonic() + timeout
    pane = ""
    while time.monotonic() < deadline:
        pane = _tmux(sock, "capture-pane", "-p", "-t", "repl")
        if predicate(pane):
            return pane
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}; the pane shows:\n{pane}")


def test_up_arrow_recalls_the_previous_line_in_a_terminal(models, tmp_path):
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (apt-get install tmux)")
    sock = f"edgeinfer-repl-{tmp_path.name}"
    command = " ".join(shlex.quote(a) for a in [
        "env", f"EDGEINFER_HOME={tmp_path}", sys.executable, "-m", "edgeinfer.cli", "run", str(models["base"]),
        "-n", "2", "--temp", "0", "-c", "64", "--backend", "reference"])
    try:
        for round_ in range(2):  # the second start recalls the line from the history file
            _tmux(sock, "new-session", "-d", "-s", "repl", "-x", "120", "-y", "30", command)
            _wait_for(sock, lambda p: p.rstrip().endswith(">>>"), "the prompt")
            if round_ == 0:
                _tmux(sock, "send-keys", "-t", "repl", "/set parameter seed 3", "Enter")
                _wait_for(sock, lambda p: "Set parameter 'seed'" in p and p.rstrip().endswith(">>>"), "the reply")
            _tmux(sock, "send-keys", "-t", "repl", *(["Up"] if round_ == 0 else ["Up", "Up"]))  # then /bye
            pane = _wait_for(sock, lambda p: p.rstrip().endswith(">>> /set parameter seed 3"), "the recalled line")
            assert "^[[A" not in pane
            _tmux(sock, "send-keys", "-t", "repl", "C-u", "/bye", "Enter")
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and subprocess.run(
                    ["tmux", "-L", sock, "has-session", "-t", "repl"], capture_output=True).returncode == 0:
                time.sleep(0.2)
        assert "/set parameter seed 3" in (tmp_path / "history").read_text()
    finally:
        subprocess.run(["tmux", "-L", sock, "kill-server"], capture_output=True)


class _Keys:
    """A reader that replays typed lines and Ctrl-C presses (None)."""

    def __init__(self, items):
        self.items = list(items)
        self.history_enabled = True

    def read_message(self):
        if not self.items:
            raise EOFError
        item = self.items.pop(0)
        if item is None:
            raise KeyboardInterrupt
        return item


@pytest.mark.parametrize("keys, explained, shown", [([None, "/show system", None, None, "/show system"], 2, 1),
                                                    ([None, None, "/show system"], 1, 0)])
def test_ctrl_c_at_the_prompt_explains_and_a_second_leaves(loaded, models, keys, explained, shown):
    args = build_parser().parse_args(["run", str(models["chat"]), "--backend", "reference"])
    out, err = io.StringIO(), io.StringIO()
    repl = Repl(loaded["chat"], args, {}, False, reader=_Keys(keys), out=out, err=err)
    assert repl.loop() == 0
    assert err.getvalue().count("Use Ctrl + d or /bye to exit.") == explained
    assert out.getvalue().count("No system message") == shown
