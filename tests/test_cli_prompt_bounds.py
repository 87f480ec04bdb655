"""`edgeinfer run` with a prompt far past the window, and a context size far past memory:
one line and a non-zero exit, without reading or tokenizing the whole prompt and without
a bare MemoryError (issue #36, CLI stdin)."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

from edgeinfer.cli import main

FAST = ["--raw", "--backend", "reference", "--temp", "0"]


class _EndlessStdin(io.TextIOBase):
    """A pipe with `total` characters of text that fails the test when read whole or past `budget`."""

    def __init__(self, total: int, budget: int) -> None:
        self.left, self.budget, self.read_chars = total, budget, 0

    def isatty(self) -> bool:
        return False

    def read(self, n: int = -1) -> str:
        if n is None or n < 0:
            raise AssertionError("stdin was read whole")
        n = min(n, self.left)
        self.left -= n
        self.read_chars += n
        if self.read_chars > self.budget:
            raise AssertionError(f"read {self.read_chars} characters of stdin")
        return ("hello world " * (n // 12 + 1))[:n]


def test_huge_stdin_is_refused_after_reading_what_the_context_can_hold(tiny_models, monkeypatch, capsys):
    stdin = _EndlessStdin(total=100 * 2**20, budget=4 * 2**20)  # 100 MB on the pipe
    monkeypatch.setattr(sys, "stdin", stdin)
    assert main(["run", str(tiny_models["llama"]), "-c", "64", *FAST]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--ctx-size" in err and "stdin" in err, err
    assert stdin.read_chars <= 64 * 256 + 1


def test_long_prompt_is_not_tokenized_whole(tiny_models, monkeypatch, capsys):
    """Under the read bound but far past the window: only prefixes are tokenized."""
    from edgeinfer.api import Model

    seen: list[int] = []
    tokenize = Model.tokenize

    def spy(self, text, *a, **kw):
        seen.append(len(text))
        return tokenize(self, text, *a, **kw)

    monkeypatch.setattr(Model, "tokenize", spy)
    text = "hello world " * 10_000  # 120k characters (under the read bound), a context of 512
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))
    assert main(["run", str(tiny_models["llama"]), "-c", "512", *FAST]) == 1
    err = capsys.readouterr().err
    assert err.strip() == ("edgeinfer: error: prompt has more than 512 tokens but the context holds 512; "
                           "shorten it or raise --ctx-size"), err
    assert seen and max(seen) < 20_000, seen


def test_huge_stdin_in_a_subprocess_ends_in_seconds(tiny_models):
    proc = subprocess.run([sys.executable, "-m", "edgeinfer.cli", "run", str(tiny_models["llama"]), *FAST],
                          input="hello world " * 500_000, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1 and "--ctx-size" in proc.stderr and "Traceback" not in proc.stderr


class _FakeModel:
    """A model whose every `chars` characters are one token, counting what it tokenizes."""

    def __init__(self, n_ctx: int, chars: int) -> None:
        self.n_ctx, self.chars, self.tokenized = n_ctx, chars, 0

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        self.tokenized += len(text)
        return [0] * (len(text) // self.chars)


@pytest.mark.parametrize("chars", [1, 3, 20, 200])
def test_prefix_check_errs_only_past_the_window(chars):
    """Long in characters but within the window: no error (the exact check follows); past
    it: one error, after tokenizing a few times what the window holds."""
    from edgeinfer.commands.prompt_input import check_prompt_length
    from edgeinfer.errors import ContextOverflowError

    fits = _FakeModel(512, chars)
    check_prompt_length(fits, "abcdefghi " * (51 * chars))  # 510 tokens
    over = _FakeModel(512, chars)
    with pytest.raises(ContextOverflowError, match="more than 512 tokens"):
        check_prompt_length(over, "abcdefghi " * (10_000 * chars))  # 100,000 tokens
    assert over.tokenized < 8 * 528 * chars


def test_absurd_ctx_size_is_one_line_naming_the_flag(tiny_models, capsys):
    assert main(["run", str(tiny_models["llama"]), "hi", "-c", str(10**12), *FAST]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "MemoryError" not in err, err
    assert err.startswith("edgeinfer: error: --ctx-size 1000000000000 needs about ") and "fits" in err, err


def test_ctx_size_check_suggests_a_size_that_fits(tiny_models):
    """What the message names as fitting passes the check; one token more does not; a pool
    that would not fit at 2 x n_ctx is capped instead of refused."""
    import edgeinfer
    from edgeinfer.context_budget import (ContextTooLargeError, check_context_memory, largest_fitting,
                                          pool_host_bytes)

    engine = edgeinfer.load(str(tiny_models["llama"]), n_ctx=64, backend="reference").engine
    available = 64 * 2**20
    fits = largest_fitting(engine, available)
    assert fits > 1000
    check_context_memory(engine, fits, None, available=available)
    with pytest.raises(ContextTooLargeError, match=f"at most --ctx-size {fits} fits"):
        check_context_memory(engine, fits + 64, None, available=available)
    assert check_context_memory(engine, fits // 4, None, available=available) is None  # the default pool fits
    capped = check_context_memory(engine, fits - 1, None, available=available)
    assert capped is not None and capped * 2**20 <= available
    assert pool_host_bytes(engine, fits - 1, capped) <= available
