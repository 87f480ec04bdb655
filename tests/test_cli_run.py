"""`edgeinfer run`: one-shot, stdin, interactive (through a pseudo-terminal), bad flags."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time

import pytest

from edgeinfer.cli import main

RUN = [sys.executable, "-m", "edgeinfer.cli", "run"]


def test_one_shot_prompt_streams_and_exits(tiny_models, capsys):
    code = main(["run", str(tiny_models["llama"]), "hello world", "--raw", "-n", "5", "--temp", "0",
                 "--backend", "reference", "-c", "64", "--verbose"])
    assert code == 0
    captured = capsys.readouterr()
    assert captured.out.endswith("\n")
    assert "eval rate:" in captured.err and "prompt eval count:" in captured.err


def test_same_seed_same_answer(tiny_models, capsys):
    args = ["run", str(tiny_models["qwen2"]), "hello", "-n", "8", "--temp", "1", "--seed", "7",
            "--backend", "reference", "-c", "256"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == first


def test_prompt_from_stdin(tiny_models):
    proc = subprocess.run(RUN + [str(tiny_models["llama"]), "--raw", "-n", "3", "--temp", "0",
                                 "--backend", "reference", "-c", "64"],
                          input="hello world", capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("flag, value", [("--temp", "-1"), ("--top-p", "0"), ("-c", "0"),
                                          ("--top-k", "-3"), ("-t", "zero"), ("-fa", "maybe"), ("-ctk", "q9")])
def test_bad_flag_values_are_one_line_errors(tiny_models, flag, value):
    proc = subprocess.run(RUN + [str(tiny_models["llama"]), "hi", flag, value],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 or proc.stderr.startswith("usage:"), proc.stderr
    assert "error" in proc.stderr


def test_prompt_longer_than_context(tiny_models):
    proc = subprocess.run(RUN + [str(tiny_models["llama"]), "hello world " * 50, "--raw", "-c", "16",
                                 "--backend", "reference"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "--ctx-size" in proc.stderr and "Traceback" not in proc.stderr


def test_unknown_model_name_suggests(capsys):
    assert main(["run", "gemma3-27", "hi"]) == 1
    err = capsys.readouterr().err
    assert "gemma3" in err and err.count("\n") == 1


def _read_until(fd, needle: bytes, timeout: float = 120) -> bytes:
    buf = b""
    deadline = time.time() + timeout
    while needle not in buf:
        if time.time() > deadline:
            raise AssertionError(f"timed out waiting for {needle!r}; got {buf[-500:]!r}")
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:
                break
            if not chunk:
                break
            buf += chunk
    return buf


def test_interactive_chat_in_a_terminal(tiny_models, tmp_path):
    """Drive the interactive mode through a pty: /set, a message, multi-line, /clear, /bye."""
    pid, fd = pty.fork()
    if pid == 0:  # child: the CLI on a terminal, its line history kept out of the real home
        os.environ["EDGEINFER_HOME"] = str(tmp_path)
        os.execv(sys.executable, RUN + [str(tiny_models["gemma3"]), "-n", "4", "--temp", "0",
                                        "--backend", "reference", "-c", "512"])
    try:
        _read_until(fd, b">>> ")
        os.write(fd, b"/set parameter temperature 0\n")
        out = _read_until(fd, b">>> ")
        assert b"Set parameter 'temperature' to '0'" in out
        os.write(fd, b"/set parameter top_p 7\n")
        out = _read_until(fd, b">>> ")
        assert b"top_p" in out and b"error" in out
        os.write(fd, b"hello world\n")
        _read_until(fd, b">>> ")
        os.write(fd, b'"""\nfirst line\nsecond line\n"""\n')
        _read_until(fd, b">>> ")
        os.write(fd, b"/clear\n")
        out = _read_until(fd, b">>> ")
        assert b"Cleared" in out
        os.write(fd, b"/bye\n")
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
        assert "hello world" in (tmp_path / "history").read_text().splitlines()
    finally:
        try:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(fd)
