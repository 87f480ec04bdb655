"""Hostile model metadata: wrong types, absurd sizes, lying counts and non-UTF-8 text end in
one line naming the key and the file (or show as U+FFFD), never a traceback or a huge allocation."""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest
from gguf import GGUFValueType as V
from gguf_factory import Typed, gemma4_sized_file, replace_bytes, spm_vocab, write_tiny_model

from edgeinfer.cli import main
from edgeinfer.errors import EdgeInferError, GGUFError, MetadataError, UnsupportedModelError
from edgeinfer.gguf_file import GGUFFile
from edgeinfer.loader import open_model
from edgeinfer.metadata import Metadata, meta_float, meta_int, meta_str, meta_str_array
from edgeinfer.tokenizer import Tokenizer, load_tokenizer


def _one_line(exc: BaseException, *fragments: str) -> str:
    message = str(exc)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


# -- the accessors ----------------------------------------------------------------------------

def test_accessors_check_type_and_range():
    md = Metadata("m.gguf", {"n": 5, "s": "x", "f": float("nan"), "a": ["a", "b"], "b": True})
    assert meta_int(md, "n", 1, 10) == 5 and meta_int(md, "missing", 1, 10, 7) == 7
    assert meta_str(md, "s") == "x" and meta_str_array(md, "a") == ["a", "b"]
    for call, fragment in [
        (lambda: meta_int(md, "n", 6, 10), "from 6 to 10, got 5"),
        (lambda: meta_int(md, "s", 0, 10), "got the string 'x'"),
        (lambda: meta_int(md, "a", 0, 10), "got an array of 2 values"),
        (lambda: meta_int(md, "b", 0, 10), "got the boolean True"),  # a bool is not a count
        (lambda: meta_float(md, "f", 0, 1), "finite number"),
        (lambda: meta_str(md, "n"), "must be a string, got 5"),
        (lambda: meta_str_array(md, "s"), "an array of strings"),
        (lambda: meta_int(md, "missing", 0, 1), "missing metadata key 'missing'"),
    ]:
        with pytest.raises(MetadataError) as info:
            call()
        _one_line(info.value, "m.gguf", fragment)


# -- model config keys -------------------------------------------------------------------------

BAD_CONFIG = [
    # (arch, key, value, fragment of the message)
    ("llama", "llama.block_count", "2", "an integer"),
    ("llama", "llama.block_count", [2, 2], "an array of 2 values"),
    ("llama", "llama.block_count", 0, "from 1 to"),
    ("llama", "llama.block_count", Typed(V.INT32, -5), "got -5"),
    ("llama", "llama.embedding_length", "256", "an integer"),
    ("llama", "llama.embedding_length", 0, "from 1 to"),
    ("llama", "llama.embedding_length", 1 << 30, "from 1 to"),
    ("llama", "llama.attention.head_count", 0, "from 1 to"),
    ("llama", "llama.attention.head_count", "4", "an integer"),
    ("llama", "llama.attention.head_count", 1 << 20, "from 1 to"),
    ("llama", "llama.attention.head_count", [4, 4, 4], "3 values for 2 layers"),
    ("llama", "llama.attention.head_count_kv", 3, "llama.attention.head_count_kv"),
    ("llama", "llama.attention.head_count_kv", Typed(V.INT32, -2), "from 1 to"),
    ("llama", "llama.feed_forward_length", Typed(V.INT32, -1), "from 1 to"),
    ("llama", "llama.feed_forward_length", "512", "an integer"),
    ("llama", "llama.context_length", "4096", "an integer"),
    ("llama", "llama.context_length", 0, "from 1 to"),
    ("llama", "llama.context_length", Typed(V.UINT64, 1 << 40), "from 1 to"),
    ("llama", "llama.attention.key_length", 0, "from 1 to"),
    ("llama", "llama.attention.value_length", Typed(V.UINT64, 1 << 50), "from 1 to"),
    ("llama", "llama.rope.freq_base", float("nan"), "got nan"),
    ("llama", "llama.rope.freq_base", float("inf"), "got inf"),
    ("llama", "llama.rope.freq_base", -1.0, "> 0"),
    ("llama", "llama.rope.freq_base", 0.0, "> 0"),
    ("llama", "llama.rope.freq_base", "1e6", "a finite number"),
    ("llama", "llama.rope.dimension_count", 1000, "from 1 to 64"),
    ("llama", "llama.rope.dimension_count", 63, "must be even"),
    ("llama", "llama.rope.scaling.factor", float("nan"), "a finite number"),
    ("llama", "llama.rope.scaling.type", 5, "a string"),
    ("llama", "llama.attention.layer_norm_rms_epsilon", float("nan"), "a finite number"),
    ("llama", "llama.attention.layer_norm_rms_epsilon", -1e-5, "a finite number"),
    ("llama", "llama.vocab_size", 7, "token_embd.weight has"),
    ("gemma3", "gemma3.attention.sliding_window", "16", "an integer"),
    ("gemma3", "gemma3.attention.sliding_window", Typed(V.INT32, -1), "from 0 to"),
    ("qwen2", "qwen2.block_count", 3_000_000, "from 1 to 65536"),
    ("qwen2", "qwen2.block_count", 50_000, "claims 50000 layers but the file has tensors for 2"),
    # keys every front end reads
    ("llama", "general.file_type", [1, 2], "an integer"),
    ("llama", "general.file_type", "Q4_K_M", "an integer"),
    ("llama", "general.name", 5, "a string"),
    ("llama", "general.license", ["mit", "apache"], "a string"),
    ("llama", "general.architecture", 7, "a string"),
    ("llama", "general.alignment", "32", "an integer"),
    ("llama", "tokenizer.chat_template", 5, "a string"),
    ("llama", "tokenizer.ggml.model", [1], "a string"),
    ("llama", "tokenizer.ggml.bos_token_id", "1", "an integer"),
    ("llama", "tokenizer.ggml.eos_token_id", float("nan"), "an integer"),
    ("llama", "tokenizer.ggml.add_bos_token", "yes", "a boolean"),
    ("llama", "tokenizer.ggml.tokens", list(range(300)), "an array of strings"),
    ("llama", "tokenizer.ggml.token_type", ["a", "b"], "an array of integers"),
    ("llama", "tokenizer.ggml.scores", ["a", "b"], "an array of numbers"),
    ("llama", "tokenizer.ggml.tokens", ["a", "b", "c"], "has 3 tokens but token_embd.weight has"),
]


@pytest.mark.parametrize("arch, key, value, fragment", BAD_CONFIG,
                         ids=[f"{k}={v!r}"[:60] for _, k, v, _ in BAD_CONFIG])
def test_bad_metadata_is_one_line_naming_key_and_file(tmp_path, arch, key, value, fragment):
    path = write_tiny_model(tmp_path / "bad.gguf", arch, extra_metadata={key: value})
    with pytest.raises(GGUFError) as info:
        open_model(path)
    _one_line(info.value, str(path), repr(key), fragment)


def test_missing_required_key_is_named(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf", "llama", extra_metadata={"llama.embedding_length": None})
    with pytest.raises(MetadataError) as info:
        open_model(path)
    _one_line(info.value, str(path), "missing metadata key 'llama.embedding_length'")


def test_uniform_per_layer_arrays_still_load(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf", "llama",
                            extra_metadata={"llama.attention.head_count_kv": [2, 2]})
    assert open_model(path).config.n_head_kv == 2


def test_differing_per_layer_kv_heads_are_refused_where_unsupported(tmp_path):
    path = write_tiny_model(tmp_path / "m.gguf", "llama", extra_metadata={"llama.attention.head_count_kv": [2, 1]})
    with pytest.raises(UnsupportedModelError) as info:
        open_model(path)
    _one_line(info.value, str(path), "'llama.attention.head_count_kv'", "not supported for llama")


KV_HEADS = "gemma4.attention.head_count_kv"
BAD_KV_HEADS = [  # a tiny 31B-kind file: 6 layers, 8 Q heads, tensors for K/V heads (4, 4, 1) * 2
    ([4, 4, 1, 4, 4], "5 values for 6 layers"),
    ([4, 4, 1] * 3, "9 values for 6 layers"),
    ([4, 4, 0] * 2, "from 1 to"),
    ([4, 4, 3] * 2, "cannot share 3 KV heads (layer 2)"),
    ([4, 4, 16] * 2, "cannot share 16 KV heads (layer 2)"),
    (["4", "4", "1"] * 2, "an array of integers"),
    ([4.0, 4.0, 1.0] * 2, "an array of integers"),
    ([4, 4, 2] * 2, "'blk.2.attn_k.weight' has shape [256, 64], expected [256, 128]"),  # tensors of 1 head
]


@pytest.mark.parametrize("value, fragment", BAD_KV_HEADS, ids=[str(v) for v, _ in BAD_KV_HEADS])
def test_bad_per_layer_kv_heads_are_one_line(tmp_path, value, fragment):
    path = gemma4_sized_file(tmp_path, "31B", "F32", extra={KV_HEADS: value})
    with pytest.raises(GGUFError) as info:
        open_model(path)
    message = _one_line(info.value, str(path), fragment)
    if "blk." not in fragment:  # the metadata's fault, not a tensor's
        assert repr(KV_HEADS) in message


@pytest.mark.parametrize("command", ["show", "run"])
def test_cli_gives_one_line_and_exit_1(tmp_path, capsys, command):
    path = write_tiny_model(tmp_path / "bad.gguf", "llama",
                            extra_metadata={"llama.rope.freq_base": float("nan")})
    argv = [command, str(path)] + (["--raw", "-n", "1", "hi"] if command == "run" else [])
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("edgeinfer: error:"), err
    assert "llama.rope.freq_base" in err and str(path) in err and "Traceback" not in err


def test_cli_subprocess_file_type_array(tmp_path):
    path = write_tiny_model(tmp_path / "bad.gguf", "llama", extra_metadata={"general.file_type": [1, 2]})
    proc = subprocess.run([sys.executable, "-m", "edgeinfer.cli", "show", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1
    assert "'general.file_type'" in proc.stderr and str(path) in proc.stderr


def test_library_load_raises_edgeinfer_error(tmp_path):
    import edgeinfer

    path = write_tiny_model(tmp_path / "bad.gguf", "llama", extra_metadata={"llama.block_count": "2"})
    with pytest.raises(EdgeInferError, match="llama.block_count"):
        edgeinfer.load(str(path), backend="reference", n_ctx=64)


def test_tokenizer_metadata_is_checked():
    vocab = spm_vocab()
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": vocab["tokens"],
            "tokenizer.ggml.scores": vocab["scores"], "tokenizer.ggml.token_type": vocab["types"]}
    assert Tokenizer.from_metadata(meta).vocab_size == len(vocab["tokens"])
    for key, value in [("tokenizer.ggml.bos_token_id", "1"), ("tokenizer.ggml.add_bos_token", "no"),
                       ("tokenizer.ggml.tokens", np.arange(5)), ("tokenizer.ggml.model", 3),
                       ("tokenizer.ggml.scores", ["x"] * len(vocab["tokens"]))]:
        with pytest.raises(MetadataError) as info:
            Tokenizer.from_metadata({**meta, key: value})
        _one_line(info.value, repr(key))


# -- sizes the file claims -----------------------------------------------------------------------

@pytest.mark.parametrize("n_layer, fragment", [(3_000_000, "from 1 to 65536, got 3000000"),
                                               (60_000, "claims 60000 layers but the file has tensors for 2")])
def test_claimed_layers_allocate_nothing(tmp_path, n_layer, fragment):
    """A small file claiming absurd layer counts fails before anything is built per layer."""
    path = write_tiny_model(tmp_path / "huge.gguf", "gemma3", extra_metadata={"gemma3.block_count": n_layer})
    tracemalloc.start()
    try:
        with pytest.raises(MetadataError) as info:
            open_model(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    _one_line(info.value, str(path), "'gemma3.block_count'", fragment)
    assert peak < 20 << 20, f"peak {peak / 2**20:.1f} MiB"


def test_serve_with_claimed_layers_is_one_line_and_small(tmp_path):
    import os
    import socket

    path = write_tiny_model(tmp_path / "huge.gguf", "llama", extra_metadata={"llama.block_count": 65_000})
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    code = ("import resource, sys\nfrom edgeinfer.cli import main\nrc = main(sys.argv[1:])\n"
            "print('maxrss', int([l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM:')][0]))\nsys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code, "serve", str(path), "--port", str(port)],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "EDGEINFER_API_KEY": ""})
    assert proc.returncode == 1, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("edgeinfer: error:")]
    assert len(errors) == 1 and "claims 65000 layers" in errors[0] and "Traceback" not in proc.stderr
    maxrss_kb = int(proc.stdout.split("maxrss")[-1])
    assert maxrss_kb < 115 << 10  # building 65k layers of tensor dicts first took ~160 MiB


def test_block_count_needs_every_block_present(tmp_path):
    # one block more than the file has: refused before the per-block tensor checks
    path = write_tiny_model(tmp_path / "m.gguf", "llama", extra_metadata={"llama.block_count": 3})
    with pytest.raises(MetadataError, match="claims 3 layers but the file has tensors for 2"):
        open_model(path)


def _s(text: bytes | str) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def _kv(key: bytes | str, vtype: int, payload: bytes) -> bytes:
    return _s(key) + struct.pack("<I", vtype) + payload


def _raw_gguf(path, kvs=(), tensors=(), n_kv=None, n_tensors=None, data=b""):
    """A GGUF v3 written byte by byte, counts as given (or the true ones)."""
    body = b"".join(kvs)
    for name, dims, type_id, offset in tensors:
        body += _s(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        body += struct.pack("<IQ", type_id, offset)
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors) if n_tensors is None else n_tensors,
                                 len(kvs) if n_kv is None else n_kv)
    blob = head + body
    blob += b"\0" * (-len(blob) % 32) + data
    path.write_bytes(blob)
    return path


def _open_error(path) -> str:
    with pytest.raises(GGUFError) as info:
        GGUFFile.open(path)
    return _one_line(info.value, str(path))


@pytest.mark.parametrize("item_type, item_size", [(8, 8), (4, 4), (10, 8)])
def test_array_length_checked_against_file(tmp_path, item_type, item_size):
    payload = struct.pack("<IQ", item_type, 1 << 40) + b"\0" * 64
    path = _raw_gguf(tmp_path / "a.gguf", [_kv("general.tags", 9, payload)])
    tracemalloc.start()
    try:
        message = _open_error(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert "'general.tags' claims 1099511627776" in message and peak < 1 << 20


def test_kv_and_tensor_counts_checked_against_file(tmp_path):
    path = _raw_gguf(tmp_path / "c.gguf", [_kv("a", 4, struct.pack("<I", 1))], n_kv=1 << 19)
    assert "corrupt header" in _open_error(path)
    path = _raw_gguf(tmp_path / "t.gguf", [], n_tensors=1 << 19)
    assert "corrupt header" in _open_error(path)


def test_tensor_element_count_overflow(tmp_path):
    # 2**32 * 2**32 * 32 elements wraps to 0 in int64: it must not pass as an empty tensor
    path = _raw_gguf(tmp_path / "o.gguf", [], [("w", (32, 1 << 32, 1 << 32), 0, 0)])
    assert "overflows 64 bits" in _open_error(path)


def test_duplicate_key_is_refused(tmp_path):
    kv = _kv("general.name", 8, _s("a"))
    assert "'general.name' appears twice" in _open_error(_raw_gguf(tmp_path / "d.gguf", [kv, kv]))


# -- text that is not UTF-8 -----------------------------------------------------------------------

BAD_NAME = (b"NAME@@@@", b"N\xffM\xfe\xc3(@@")
BAD_LICENSE = (b"LIC@@@@@", b"L\xff\xfeC\xed\xa0\x80@")  # an encoded lone surrogate too
BAD_TEMPLATE = (b"TPL@@@@@", b"T\xffP\x80\xc0@@@")
BAD_TOKEN = (b"TOK@@@@@", b"T\xff\xfeK\x80@@@")
BAD_KEY = (b"KEY@@@@@", b"K\xffY\xfe@@@@")


@pytest.fixture(scope="module")
def bad_text_model(tmp_path_factory):
    vocab = spm_vocab()
    vocab["tokens"] = vocab["tokens"] + [BAD_TOKEN[0].decode()]
    vocab["types"] = vocab["types"] + [1]
    vocab["scores"] = vocab["scores"] + [-1000.0]
    template = ("{{ bos_token }}" + BAD_TEMPLATE[0].decode()
                + "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    path = write_tiny_model(tmp_path_factory.mktemp("utf8") / "bad-text.gguf", "llama", vocab=vocab,
                            chat_template=template,
                            extra_metadata={"general.name": BAD_NAME[0].decode(),
                                            "general.license": BAD_LICENSE[0].decode(),
                                            "x." + BAD_KEY[0].decode(): "v"})
    for old, new in (BAD_NAME, BAD_LICENSE, BAD_TEMPLATE, BAD_TOKEN, BAD_KEY):
        replace_bytes(path, old, new)
    return path


def _clean(text: str) -> bool:
    """Valid text with at least one replacement character and no smuggled surrogates."""
    text.encode("utf-8")  # strict: raises on surrogates
    return "\ufffd" in text


def test_parser_replaces_invalid_utf8(bad_text_model):
    md = GGUFFile.open(bad_text_model).metadata
    assert _clean(md["general.name"]) and md["general.name"].startswith("N\ufffdM")
    assert _clean(md["general.license"]) and _clean(md["tokenizer.chat_template"])
    assert _clean(md["tokenizer.ggml.tokens"][-1])
    assert any(_clean(k) for k in md)
    tok = load_tokenizer(GGUFFile.open(bad_text_model))
    assert _clean(tok.token_text(tok.vocab_size - 1))


def test_cli_show_prints_replacement_characters(bad_text_model):
    for extra in ([], ["--json"]):
        proc = subprocess.run([sys.executable, "-m", "edgeinfer.cli", "show", str(bad_text_model), *extra],
                              capture_output=True, timeout=120)
        assert proc.returncode == 0, proc.stderr.decode("utf-8", "replace")
        assert b"Traceback" not in proc.stderr
        out = proc.stdout.decode("utf-8")  # strict: what show prints is valid UTF-8
        if extra:
            info = json.loads(out)
            assert _clean(info["name"]) and _clean(info["license"])
        else:
            assert "\ufffd" in out and "N\ufffdM" in out


def test_cli_show_hides_terminal_escapes(tmp_path, capsys):
    path = write_tiny_model(tmp_path / "esc.gguf", "llama",
                            extra_metadata={"general.license": "mit\x1b[2J\x1b]0;owned\x07"})
    assert main(["show", str(path)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "mit\ufffd[2J" in out


@pytest.fixture(scope="module")
def bad_text_client(bad_text_model):
    import edgeinfer
    from starlette.testclient import TestClient

    from edgeinfer.server import ServerConfig, create_app

    model = edgeinfer.load(str(bad_text_model), backend="reference", n_ctx=128)
    app = create_app(ServerConfig(model_name="tiny", sampling={"temperature": 0.0, "max_tokens": 2}), model)
    with TestClient(app, base_url="http://127.0.0.1") as client:
        yield client, model


def test_server_endpoints_show_replacement_characters(bad_text_client):
    client, model = bad_text_client
    r = client.post("/api/show", json={"model": "tiny"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert _clean(body["license"]) and _clean(body["model_info"]["general.name"]) and _clean(body["template"])
    r = client.get("/api/tags")
    assert r.status_code == 200, r.text
    assert r.json()["models"][0]["details"]["family"] == "llama"
    r = client.get("/props")
    assert r.status_code == 200, r.text
    assert _clean(r.json()["chat_template"])
    r = client.post("/apply-template", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    assert _clean(r.json()["prompt"]) and r.json()["prompt"].endswith("hi")
    r = client.post("/detokenize", json={"tokens": [model.tokenizer.vocab_size - 1]})
    assert r.status_code == 200, r.text
    assert _clean(r.json()["content"])


def test_real_sizes_are_within_bounds():
    # the bounds leave room for today's biggest models (Llama 3.1 405B, 10M-token contexts)
    from edgeinfer import metadata as m

    assert m.MAX_LAYERS >= 200 and m.MAX_EMBD >= 32768 and m.MAX_CTX >= 10_000_000
    assert m.MAX_VOCAB >= 262144 and m.MAX_ROPE_BASE >= 1e8 and math.isfinite(m.MAX_ROPE_BASE)
