"""`edgeinfer chat gemma3-270m` in a real terminal (tmux): type a message, read the answer off the pane.

The expected answer comes from the model API directly (greedy), not from the TUI.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"
MAX_TOKENS = 8


def _tmux(sock: str, *args: str) -> str:
    return subprocess.run(["tmux", "-L", sock, *args], check=True, capture_output=True, text=True).stdout


def _wait_for(sock: str, predicate, timeout: float, what: str) -> str:
    deadline = time.monotonic() + timeout
    pane = ""
    while time.monotonic() < deadline:
        pane = _tmux(sock, "capture-pane", "-p", "-t", "chat")
        if predicate(pane):
            return pane
        time.sleep(1.0)
    raise AssertionError(f"timed out waiting for {what}; the pane shows:\n{pane}")


def _squash(text: str) -> str:
    return " ".join(text.split())


def _answer_box(pane: str) -> str:
    """The text inside the assistant's box (titled with the model name), borders and wrapping removed."""
    lines = pane.splitlines()
    start = next(i for i, line in enumerate(lines) if "╭─ gemma3-270m" in line)
    inside = []
    for line in lines[start + 1:]:
        if "╰" in line:
            break
        inside.append(line.split("│")[1] if line.count("│") >= 2 else "")
    return _squash(" ".join(inside))


def test_chat_in_tmux_answers_like_the_api(gemma_path, tmp_path):
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (apt-get install tmux)")
    import edgeinfer

    expected = edgeinfer.load("gemma3-270m", n_ctx=1024, backend="cpu").chat(
        [{"role": "user", "content": QUESTION}], temperature=0.0, max_tokens=MAX_TOKENS).text
    assert expected.strip()

    sock = f"edgeinfer-test-{os.getpid()}"  # our own tmux server: it inherits this environment
    env = {"EDGEINFER_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1", "TERM": "xterm-256color"}
    command = " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.quote(sys.executable),
                        "-m", "edgeinfer.cli", "chat", "gemma3-270m", "--backend", "cpu", "-c", "1024",
                        "--temp", "0", "-n", str(MAX_TOKENS), "; sleep 600"])
    _tmux(sock, "new-session", "-d", "-s", "chat", "-x", "120", "-y", "40", "env " + command)
    try:
        ready = _wait_for(sock, lambda p: "Q4_K_M" in p and "ctx 0/1024" in p and "loading" not in p
                          and "compiling" not in p, 300, "the model to load")
        assert "Welcome to edgeinfer chat" in ready and "gemma3-270m" in ready and "F1 help" in ready
        _tmux(sock, "send-keys", "-t", "chat", "-l", QUESTION)
        _tmux(sock, "send-keys", "-t", "chat", "Enter")
        # tok/s shows while the answer streams too: finished means no longer "answering".
        pane = _wait_for(sock, lambda p: "tok/s" in p and "answering" not in p, 300, "the answer to finish")
        shown = _answer_box(pane)
        assert shown == _squash(expected), f"answer on screen {shown!r} != API answer {expected!r}"
        _tmux(sock, "send-keys", "-t", "chat", "C-q")
        # Saved as a saved session, the file `edgeinfer run gemma3-270m --session ID` resumes.
        from edgeinfer.sessions.session_file import read_session_info

        saved = list((tmp_path / "sessions").glob("*.npz"))
        assert len(saved) == 1
        info = read_session_info(saved[0])
        assert [m["content"] for m in info.messages] == [QUESTION, expected]
        assert info.model["size"] == gemma_path.stat().st_size
    finally:
        subprocess.run(["tmux", "-L", sock, "kill-server"], capture_output=True)
