"""`edgeinfer serve` as a user runs it: a subprocess that listens, loads, serves, and stops."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from test_server import fim_model_path  # noqa: F401 - a fixture


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(*args: str) -> subprocess.Popen:
    env = {**os.environ, "EDGEINFER_API_KEY": ""}
    return subprocess.Popen([sys.executable, "-m", "edgeinfer.cli", "serve", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_serve_loads_serves_and_stops(fim_model_path):
    port = free_port()
    proc = serve(str(fim_model_path), "--port", str(port), "--backend", "reference", "-c", "128",
                 "--temp", "0", "-n", "3", "--max-queue", "2")
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        statuses = []
        while True:
            try:
                r = httpx.get(url + "/health", timeout=2)
                statuses.append(r.status_code)
                if r.status_code == 200:
                    break
                assert r.json() == {"status": "loading"}
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else ""
            time.sleep(0.05)
        r = httpx.post(url + "/v1/completions", json={"prompt": "hello"}, timeout=30).json()
        assert r["usage"]["completion_tokens"] == 3  # the -n flag is the server's default
        assert r["model"] == str(fim_model_path)
        assert httpx.get(url + "/api/ps", timeout=5).json()["models"][0]["context_length"] == 128
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        err = proc.stderr.read()
    assert proc.returncode in (0, 130), err  # 130: stopped by Ctrl-C, as `edgeinfer run` does
    assert "Traceback" not in err


def test_serve_bad_model_is_one_line_and_exit_1(tmp_path):
    bad = tmp_path / "not-a-model.gguf"
    bad.write_bytes(b"this is not gguf")
    proc = serve(str(bad), "--port", str(free_port()), "--host", "0.0.0.0")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "exposes the model to the network" in err  # the non-loopback warning
    lines = [line for line in err.splitlines() if line.startswith("edgeinfer: error:")]
    assert len(lines) == 1 and "not-a-model.gguf" in lines[0] and "Traceback" not in err


@pytest.mark.parametrize("flag,code", [(["--port", "70000"], 2), (["--max-queue", "-1"], 2),
                                       (["--timeout", "0"], 1), (["--temp", "-1"], 1)])
def test_serve_rejects_bad_flags(tmp_path, capsys, flag, code):
    from edgeinfer.cli import main

    try:
        rc = main(["serve", str(tmp_path / "x.gguf"), *flag])
    except SystemExit as exc:  # argparse
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == code and "error:" in err and len(err.strip().splitlines()) == 1
