"""LangChain's standard integration tests against `edgeinfer serve` (issue #36).

Starts `edgeinfer serve MODEL` on a free port and runs langchain-tests'
`ChatModelIntegrationTests` for ChatOllama and ChatOpenAI (base_url = the server's /v1) and
`EmbeddingsIntegrationTests` for OllamaEmbeddings, then prints pass/fail counts per suite.
ChatOpenAI forces tool calls with `tool_choice` ("any" becomes OpenAI's "required");
Ollama's API has no tool_choice, so ChatOllama runs with `has_tool_choice = False`, as
langchain-ollama's own standard tests do.

The LangChain packages are not edgeinfer dependencies; give them a venv of their own (they
bring pytest 9 and pytest plugins the project's suite does not want):

    python3 -m venv build/langchain-venv
    build/langchain-venv/bin/pip install langchain-tests langchain-ollama langchain-openai
    build/langchain-venv/bin/python scripts/langchain_standard_tests.py [--suite chat-openai] [-- -k tool]

The server runs from the repository's .venv (`--edgeinfer CMD` to change it). With the
default model, Gemma 3 270M (a base model with no chat template: edgeinfer chats through its
built-in gemma template), many tests ask for what a 270M base model cannot do; see
KNOWN_MODEL_LIMITED below for which and why. Every other failure is edgeinfer's.

This file is also the pytest module the runner hands to pytest (the suites read the
server's address from EDGEINFER_LC_URL and the model from EDGEINFER_LC_MODEL).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUITES = {
    "chat-ollama": "TestChatOllama",
    "chat-openai": "TestChatOpenAI",
    "embeddings-ollama": "TestOllamaEmbeddings",
}

# Tests that need a model able to follow instructions (or inputs edgeinfer's text-only
# models do not take); with Gemma 3 270M, a base model, they fail on the model, not the server.
_NO_TOOLS = ("Gemma 3's template renders no tools: a request with tools is a 400, as Ollama answers for "
             "gemma3 (with --chat-template qwen2.5-instruct.jinja, forced calls are made)")
_BASE = "a 270M base model does not follow the instruction"
KNOWN_MODEL_LIMITED: dict[str, str] = {
    # tools with the default gemma template (see _NO_TOOLS); with a template that renders them,
    # ChatOpenAI's forced calls come back, but the base model repeats the call until max tokens
    # (the tests want exactly one) and, unforced (ChatOllama), writes text instead of a call
    "test_tool_calling": _NO_TOOLS, "test_tool_calling_async": _NO_TOOLS,
    "test_tool_calling_with_no_arguments": _NO_TOOLS, "test_agent_loop": _NO_TOOLS,
    "test_unicode_tool_call_integration": _NO_TOOLS, "test_bind_runnables_as_tools": _NO_TOOLS,
    "test_tool_message_histories_string_content": _NO_TOOLS,
    "test_tool_message_histories_list_content": _NO_TOOLS, "test_tool_choice": _NO_TOOLS,
    "test_tool_message_error_status": _NO_TOOLS, "test_structured_few_shot_examples": _NO_TOOLS,
    "test_structured_output_pydantic_2_v1": _NO_TOOLS + " (function_calling)",
    # constrained JSON follows the schema, but the model never closes a string / keeps adding keys
    "test_structured_output": _BASE + ": its strings never end, so the JSON is cut off at max tokens",
    "test_structured_output_async": _BASE + ": its strings never end, so the JSON is cut off at max tokens",
    "test_structured_output_optional_param": _BASE + ": its strings never end (cut off at max tokens)",
    "test_json_mode": _BASE + ": it keeps adding keys until max tokens",
    # Gemma's template (as Google's and llama.cpp's) refuses two user turns in a row
    "test_double_messages_conversation": "Gemma's chat template requires alternating user/assistant roles",
}


# -- the suites (collected by pytest from this file) --------------------------------------------

if os.environ.get("EDGEINFER_LC_URL"):
    from langchain_ollama import ChatOllama, OllamaEmbeddings
    from langchain_openai import ChatOpenAI
    from langchain_tests.integration_tests import ChatModelIntegrationTests, EmbeddingsIntegrationTests

    _URL = os.environ["EDGEINFER_LC_URL"]
    _MODEL = os.environ.get("EDGEINFER_LC_MODEL", "gemma3-270m")

    class _TextOnly:
        """What edgeinfer's text models take: no images, PDFs, audio or Anthropic blocks."""

        @property
        def supports_image_inputs(self) -> bool:
            return False

        @property
        def supports_image_urls(self) -> bool:
            return False

        @property
        def supports_pdf_inputs(self) -> bool:
            return False

        @property
        def supports_audio_inputs(self) -> bool:
            return False

        @property
        def supports_image_tool_message(self) -> bool:
            return False

        @property
        def supports_pdf_tool_message(self) -> bool:
            return False

        @property
        def supports_anthropic_inputs(self) -> bool:
            return False

        @property
        def supports_json_mode(self) -> bool:
            return True  # OpenAI response_format json_object, Ollama format "json"

    class TestChatOllama(_TextOnly, ChatModelIntegrationTests):
        @property
        def chat_model_class(self):
            return ChatOllama

        @property
        def chat_model_params(self) -> dict:
            return {"model": _MODEL, "base_url": _URL, "temperature": 0}

        @property
        def has_tool_choice(self) -> bool:
            return False  # Ollama's API has no tool_choice (ChatOllama.bind_tools ignores it)

    class TestChatOpenAI(_TextOnly, ChatModelIntegrationTests):
        @property
        def chat_model_class(self):
            return ChatOpenAI

        @property
        def chat_model_params(self) -> dict:
            return {"model": _MODEL, "base_url": _URL + "/v1", "api_key": "unused", "temperature": 0,
                    "stream_usage": True}

        @property
        def has_tool_choice(self) -> bool:
            return True  # "any" is sent as tool_choice "required": the call is forced

    class TestOllamaEmbeddings(EmbeddingsIntegrationTests):
        @property
        def embeddings_class(self):
            return OllamaEmbeddings

        @property
        def embedding_model_params(self) -> dict:
            return {"model": _MODEL, "base_url": _URL}


# -- the runner ---------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"edgeinfer serve exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"edgeinfer serve was not ready after {timeout:.0f} s")


def run_suite(suite: str, url: str, model: str, extra: list[str], report_dir: Path) -> dict:
    report = report_dir / f"{suite}.json"
    env = dict(os.environ, EDGEINFER_LC_URL=url, EDGEINFER_LC_MODEL=model)
    cmd = [sys.executable, "-m", "pytest", f"{Path(__file__).resolve()}::{SUITES[suite]}", "-q", "-rfEs", "-p", "no:cacheprovider",
           "-p", "no:randomly", "--rootdir", str(report_dir), "-c", os.devnull, "-o", "asyncio_mode=auto", "-o", "asyncio_default_fixture_loop_scope=session", "-o", "asyncio_default_test_loop_scope=session",
           "--junitxml", str(report.with_suffix(".xml")), *extra]
    print(f"\n=== {suite}: {' '.join(cmd[3:])}", flush=True)
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env, cwd=report_dir)
    return {"suite": suite, "returncode": proc.returncode, "seconds": round(time.monotonic() - t0),
            **junit_counts(report.with_suffix(".xml"))}


def junit_counts(path: Path) -> dict:
    """passed / failed / errors / skipped and the failing test names, from pytest's JUnit XML."""
    import xml.etree.ElementTree as ET

    if not path.exists():
        return {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "failures": []}
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "xfailed": 0, "failures": []}
    for case in ET.parse(path).iter("testcase"):
        name = re.sub(r"^.*\.", "", case.get("classname", "")) + "::" + case.get("name", "")
        kinds = [child.tag for child in case]
        if "failure" in kinds:
            counts["failed"] += 1
            counts["failures"].append(name)
        elif "error" in kinds:
            counts["errors"] += 1
            counts["failures"].append(name)
        elif "skipped" in kinds:
            skipped = case.find("skipped")
            key = "xfailed" if skipped is not None and "xfail" in (skipped.get("type") or "") else "skipped"
            counts[key] += 1
        else:
            counts["passed"] += 1
    return counts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3-270m", help="model the server loads (default gemma3-270m)")
    ap.add_argument("--suite", action="append", choices=sorted(SUITES), help="suite to run (repeatable; default all)")
    ap.add_argument("--edgeinfer", default=None,
                    help="command that runs edgeinfer (default: the repository's .venv/bin/edgeinfer)")
    ap.add_argument("--max-tokens", type=int, default=128,
                    help="the server's default -n, so a rambling base model ends (default 128)")
    ap.add_argument("--threads", type=int, default=1,
                    help="the server's -t (default 1: on a shared machine, more threads than free cores "
                         "slow every step to the slowest thread's turn)")
    ap.add_argument("--chat-template", default=None, metavar="FILE",
                    help="serve with this Jinja chat template (e.g. tests/data/templates/qwen2.5-instruct.jinja, "
                         "which renders tools, to run the tool tests on a model whose template has none)")
    ap.add_argument("--url", default=None, help="use a server already running at this URL instead")
    ap.add_argument("--json", default=None, metavar="FILE", help="write the counts here as JSON")
    ap.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = ap.parse_args()

    suites = args.suite or list(SUITES)
    server = None
    url = args.url
    log = None
    if url is None:
        edgeinfer = args.edgeinfer or str(ROOT / ".venv" / "bin" / "edgeinfer")
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        log = tempfile.NamedTemporaryFile("w+", prefix="edgeinfer-serve-", suffix=".log", delete=False)
        cmd = [*edgeinfer.split(), "serve", args.model, "--port", str(port), "-n", str(args.max_tokens), "-t", str(args.threads),
               "--log-format", "text"]
        print("starting:", " ".join(cmd), f"(log: {log.name})", flush=True)
        if args.chat_template:
            cmd += ["--chat-template", Path(args.chat_template).read_text()]
            print("  with --chat-template", args.chat_template, flush=True)
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        if server is not None:
            wait_ready(url, server, timeout=600)
        results = []
        with tempfile.TemporaryDirectory(prefix="lc-standard-") as tmp:
            for suite in suites:
                results.append(run_suite(suite, url, args.model, args.pytest_args, Path(tmp)))
    finally:
        if server is not None:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
    print("\n=== summary")
    for r in results:
        print(f"{r['suite']:<18} passed {r['passed']:>3}  failed {r['failed']:>3}  errors {r['errors']:>3}  "
              f"skipped {r['skipped']:>3}  xfailed {r.get('xfailed', 0):>3}  ({r['seconds']} s)")
        for name in r["failures"]:
            why = KNOWN_MODEL_LIMITED.get(name.split("::")[-1].split("[")[0])
            print(f"    FAIL {name}" + (f"  (model-limited: {why})" if why else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0 if all(r["failed"] == r["errors"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
