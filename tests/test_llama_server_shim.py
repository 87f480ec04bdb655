"""scripts/llama_server_shim.py, the stand-in llama-server binary for llama.cpp's server suite:
its flags become `edgeinfer serve` flags that serve's own parser accepts."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import llama_server_shim as shim  # noqa: E402

from edgeinfer.cli import build_parser  # noqa: E402


def test_flags_map_onto_serve_and_parse(tmp_path):
    argv = ["--host", "127.0.0.1", "--port", "8080", "--hf-repo", "ggml-org/models", "--hf-file", "x.gguf",
            "--alias", "tinyllama-2,fim", "--tags", "chat,small", "--cors-origins", "localhost,http://a.example",
            "--ctx-size", "512", "--parallel", "2", "--no-slots", "--verbose",
            "--reasoning", "off", "--chat-template-file", "t.jinja", "--slot-save-path", str(tmp_path), "-fa", "on"]
    args = shim.known_to_serve(shim.translate(argv, str(tmp_path)))
    parsed = build_parser().parse_args(["serve", *args])
    assert parsed.alias == [["tinyllama-2", "fim"]] and parsed.tags == [["chat", "small"]]
    assert parsed.cors_origin == ["localhost", "http://a.example"]
    assert parsed.slots_endpoint is False and parsed.verbose
    assert parsed.reasoning == "off" and parsed.chat_template_file == "t.jinja"
    assert parsed.ctx_size == 256  # --parallel 2 splits 512 as llama-server's slots would
    assert all(flag in shim._SWITCHES for flag in ("--no-slots", "--verbose", "--context-shift"))
