"""backends/huge_pages.py: the CPU backend's copies of its matrices in 2 MiB pages."""
from __future__ import annotations

import numpy as np
import pytest

from edgeinfer.backends import huge_pages
from edgeinfer.backends.cpu import CpuBackend
from edgeinfer.gguf_file import GGUFFile
from gguf_factory import TinyShape, spm_vocab, write_tiny_model


def test_arena_copies_are_equal_read_only_and_aligned():
    arena = huge_pages.HugePageArena()
    rng = np.random.default_rng(0)
    first = rng.integers(0, 256, (100, 37), dtype=np.uint8)
    a, b = arena.copy(first), arena.copy(rng.integers(0, 256, (3, 5), dtype=np.uint8))
    np.testing.assert_array_equal(a, first)
    assert not a.flags.writeable and a.flags.c_contiguous
    assert a.ctypes.data % huge_pages.PAGE == 0          # a chunk starts on a huge page
    assert b.ctypes.data % 64 == 0 and b.ctypes.data >= a.ctypes.data + a.nbytes
    big = np.ones((3, huge_pages._CHUNK // 2), np.uint8)  # more than the chunk's room: a chunk of its own
    c = arena.copy(big)
    np.testing.assert_array_equal(c, big)
    assert arena.n_bytes == first.nbytes + 15 + big.nbytes
    a_again = np.asarray(a)
    np.testing.assert_array_equal(a_again, first)        # earlier pieces untouched by later chunks


def test_empty_gives_the_asked_dtype_and_shape():
    e = huge_pages.HugePageArena().empty((4, 6), np.float32)
    assert e.shape == (4, 6) and e.dtype == np.float32 and e.flags.writeable


@pytest.mark.parametrize("setting, want", [("always [madvise] never", True), ("[always] madvise never", True),
                                           ("always madvise [never]", False)])
def test_available_follows_the_thp_setting(tmp_path, monkeypatch, setting, want):
    f = tmp_path / "enabled"
    f.write_text(setting + "\n")
    monkeypatch.setattr(huge_pages, "_THP_SETTING", str(f))
    monkeypatch.delenv("EDGEINFER_NO_HUGE_PAGES", raising=False)
    assert huge_pages.available() is want
    monkeypatch.setenv("EDGEINFER_NO_HUGE_PAGES", "1")
    assert huge_pages.available() is False


def test_no_thp_file_means_not_available(tmp_path, monkeypatch):
    monkeypatch.setattr(huge_pages, "_THP_SETTING", str(tmp_path / "missing"))
    monkeypatch.delenv("EDGEINFER_NO_HUGE_PAGES", raising=False)
    assert huge_pages.available() is False


def _backend(path, monkeypatch, on: bool) -> CpuBackend:
    monkeypatch.setattr(huge_pages, "available", lambda: on)
    return CpuBackend(GGUFFile.open(path))


@pytest.mark.parametrize("tied", [False, True])
def test_backend_copies_matrices_not_embedding_tables(tmp_path, monkeypatch, tied):
    path = write_tiny_model(tmp_path / "m.gguf", "llama", "Q8_0", shape=TinyShape(n_embd=256, n_ff=512),
                            vocab=spm_vocab(), seed=3, tie_embeddings=tied)
    be = _backend(path, monkeypatch, True)
    be.prepare_weights()
    names = [n for n, info in be.gguf.tensors.items() if len(info.shape) == 2]
    for name in names:
        raw = be.gguf.raw(name)
        if name in be._weights:
            w, _ = be._weights[name]
            assert not np.shares_memory(w, raw) and not w.flags.writeable
        else:   # an embedding table of a file with its own output matrix stays in the file
            assert name == "token_embd.weight" and not tied
    assert any("attn_q" in n for n in be._weights)
    ids = np.array([1, 5, 2])
    plain = _backend(path, monkeypatch, False)
    np.testing.assert_array_equal(be.get_rows("token_embd.weight", ids), plain.get_rows("token_embd.weight", ids))
    x = np.random.default_rng(1).standard_normal((3, be.gguf.tensors["blk.0.attn_q.weight"].n_cols)).astype(np.float32)
    for n_tok in (1, 3):   # the copy gives the file's bits
        np.testing.assert_array_equal(be.linear("blk.0.attn_q.weight", x[:n_tok]),
                                      plain.linear("blk.0.attn_q.weight", x[:n_tok]))


def test_a_kernel_refusing_populate_still_gets_its_copy(monkeypatch):
    # MADV_POPULATE_WRITE is Linux 5.14+: an older kernel's EINVAL leaves the faults to the copy
    monkeypatch.setattr(huge_pages, "_POPULATE_WRITE", 9999)
    src = np.arange(5000, dtype=np.uint8).reshape(50, 100)
    np.testing.assert_array_equal(huge_pages.HugePageArena().copy(src), src)
