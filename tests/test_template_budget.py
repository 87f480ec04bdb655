"""Chat templates from a model file run under a budget: time, output and memory, and the
request's cancel flag; directly, through `edgeinfer run`, at load and through the server."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import pytest

import edgeinfer
from gguf_factory import write_tiny_model

from edgeinfer.prompt.chat_template import ChatTemplate
from edgeinfer.errors import TemplateError, TokenizerError
from edgeinfer.results import FinishReason
from edgeinfer.prompt.template_sandbox import MAX_OUTPUT_CHARS, MAX_RENDER_S, TemplateBudgetError, TemplateCancelled

SLOW_LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}"
HOSTILE = {
    "nested_range": SLOW_LOOP,
    "empty_body": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "repeat_1e10": "{{ 'x' * 10**10 }}",
    "print_100kB_100k_times": "{% set s = 'x' * 100000 %}{% for i in range(100000) %}{{ s }}{% endfor %}",
    "power": "{{ 10 ** (10 ** 10) }}",
    "huge_range": "{% for i in range(10**12) %}{% endfor %}",
    "macro_buffer": "{% macro f() %}{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}{% endmacro %}"
                    "{{ f()|length }}",
    "literal_in_macro": "{% macro f() %}{% for i in range(100000) %}{% for j in range(100000) %}abcdefgh"
                        "{% endfor %}{% endfor %}{% endmacro %}{{ f()|length }}",
    "doubling_concat": "{% set ns = namespace(x='x') %}{% for i in range(60) %}{% set ns.x = ns.x ~ ns.x %}"
                       "{% endfor %}{{ ns.x|length }}",
    "doubling_plus": "{% set ns = namespace(x='x') %}{% for i in range(60) %}{% set ns.x = ns.x + ns.x %}"
                     "{% endfor %}{{ ns.x|length }}",
    "squaring": "{% set ns = namespace(x=10) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
    "branching_macro": "{% macro f(n) %}{% if n > 0 %}{{ f(n-1) }}{{ f(n-1) }}{% endif %}{% endmacro %}{{ f(40) }}",
    "kept_copies": "{% set ns = namespace(l=[]) %}{% for i in range(100000) %}"
                   "{% set ns.l = ns.l + [('x' * 100000) ~ i] %}{% endfor %}",
    "center": "{{ 'x'|center(10**10) }}",
    "center_method": "{{ 'x'.center(10**10) }}",
    "filter_block": "{% filter center(10**9) %}x{% endfilter %}",
    "indent": "{{ ('\n' * 1000000)|indent('x' * 1000, blank=true)|length }}",
    "wordwrap": "{{ ('a ' * 1000000)|wordwrap(1, wrapstring='x' * 1000) }}",
    "format_filter": "{{ '%100000000000s'|format('x') }}",
    "percent_precision": "{{ '%.100000000f' % 1.0 }}",
    "str_format_width": "{{ '{:>100000000}'.format('x') }}",
    "join_filter": "{% set s = 'x' * 1000000 %}{{ ([s] * 10000)|join|length }}",
    "join_method": "{% set s = 'x' * 1000000 %}{{ s.join(['a'] * 10000)|length }}",
    "join_generator": "{% set s = 'x' * 1000000 %}{{ ([s] * 10000)|select|join|length }}",
    "replace": "{% set s = 'x' * 100000 %}{{ s|replace('x', s)|length }}",
    "truncate": "{{ 'x'|truncate(10**10, end='y') }}",
    "print_shared_list": "{% set s = 'x' * 1000000 %}{{ [[s, s, s, s, s, s, s, s, s, s]] * 1000 }}",
    "tojson_shared_list": "{% set s = 'x' * 1000000 %}{{ ([s] * 1000)|tojson|length }}",
    "tojson_indent": "{{ [[[[1]]]]|tojson(indent=10**6) }}",
    "batch": "{{ [1]|batch(10**9, 0)|list|length }}",
    "expandtabs": "{{ ('\t' * 1000000).expandtabs(1000) }}",
    "translate": "{{ ('x' * 100000).translate({120: 'y' * 100000}) }}",
    "to_bytes": "{{ (1).to_bytes(10**9, 'big')|length }}",
    "lipsum": "{{ lipsum(10**6) }}",
    "messages_cubed": "{% for a in messages %}{% for b in messages %}{% for c in messages %}{% endfor %}"
                      "{% endfor %}{% endfor %}",
}
MESSAGES = [{"role": "user", "content": "hi"}] * 3000  # for messages_cubed: 2.7e10 iterations


def _outcome(source: str, limit_s: float = MAX_RENDER_S + 3) -> BaseException | str:
    """Compile and render on a daemon thread: a render that hangs fails the test, not the run."""
    box: list = []

    def work() -> None:
        try:
            box.append(ChatTemplate(source, name="model").render(MESSAGES))
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box.append(exc)

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    thread.join(limit_s)
    assert box, f"no answer within {limit_s} s"
    return box[0]


@pytest.mark.parametrize("source", HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_template_fails_within_the_budget(source):
    t0 = time.perf_counter()
    err = _outcome(source)
    assert isinstance(err, TemplateBudgetError), repr(err)[:300]
    assert time.perf_counter() - t0 < MAX_RENDER_S + 1.5
    message = str(err)
    assert "\n" not in message and message.startswith("chat template model exceeded its ")
    assert "budget" in message


def test_the_time_budget_is_named_in_seconds():
    with pytest.raises(TemplateBudgetError, match=r"exceeded its 2 s render budget \(line 1\)"):
        ChatTemplate(HOSTILE["empty_body"], name="model").render([])


def test_output_is_counted_as_it_comes():
    # just under the limit renders; one character more is refused
    ok = "{{ 'x' * %d }}" % MAX_OUTPUT_CHARS
    assert len(ChatTemplate(ok).render([])) == MAX_OUTPUT_CHARS
    with pytest.raises(TemplateBudgetError, match="output budget"):
        ChatTemplate(ok + "y").render([])


def test_budget_is_per_render_and_normal_features_still_work():
    tmpl = ChatTemplate(
        "{% for m in messages %}{{ loop.index }}:{{ m.role|upper }}={{ m.content|trim }};{% endfor %}"
        "{{ range(3)|list }}{{ range(10)[2:5]|join(',') }}{{ range(4)|length }}{{ 2 ** 10 }}{{ 'ab' * 3 }}"
        "{{ '%05d' % 42 }}{{ '{:>4}'.format('x') }}{{ 'a-b'|replace('-', '+') }}{{ 'x'|center(5) }}"
        "{{ [1, 2]|tojson }}{{ {'k': 1}|tojson(indent=2) }}{{ range(5)|reverse|join }}"
        "{% for i in range(3) recursive %}{{ i }}{% endfor %}{{ [3, 1, 2]|sort|join }}")
    for _ in range(3):  # a failed render leaves nothing behind for the next one
        out = tmpl.render([{"role": "user", "content": " hi "}])
        assert out == ('1:USER=hi;[0, 1, 2]2,3,441024ababab00042   xa+b  x  [1, 2]{\n  "k": 1\n}43210'
                       "012123")
        with pytest.raises(TemplateBudgetError):
            ChatTemplate(HOSTILE["repeat_1e10"]).render([])


def test_compiling_a_hostile_template_evaluates_nothing():
    # Jinja folds constant expressions while compiling; none of these may be built then
    for source in ("{{ 'x' * 10**10 }}", "{{ 'x'|center(10**10) }}", "{{ 10 ** (10 ** 10) }}",
                   "{{ ('x' ~ 'y')|indent(10**10) }}", "{{ '%.100000000f'|format(1.0) }}"):
        t0 = time.perf_counter()
        ChatTemplate(source)
        assert time.perf_counter() - t0 < 1.0, source


def test_oversized_or_too_deep_source_is_one_line_error():
    with pytest.raises(TemplateError, match="characters long"):
        ChatTemplate("x" * (2 << 20))
    with pytest.raises(TemplateError, match="chat template custom") as err:
        ChatTemplate("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}")
    assert "\n" not in str(err.value)


def test_cancel_stops_a_render():
    cancel = threading.Event()
    threading.Timer(0.2, cancel.set).start()
    t0 = time.perf_counter()
    with pytest.raises(TemplateCancelled, match="chat template model was cancelled"):
        ChatTemplate(HOSTILE["empty_body"], name="model").render([], cancel=cancel)
    assert time.perf_counter() - t0 < 1.0


def test_cancel_stops_tokenizing(tiny_models):
    tok = edgeinfer.load(str(tiny_models["llama"]), backend="reference", n_ctx=64).tokenizer
    text = "hello world <s> " * 2000
    assert tok.tokenize(text, cancel=threading.Event()) == tok.tokenize(text)
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(TokenizerError, match="cancelled"):
        tok.tokenize(text, cancel=cancel)
    calls = []

    class LateCancel:  # set after the first check: the loop itself must look again
        def is_set(self):
            calls.append(1)
            return len(calls) > 1

    with pytest.raises(TokenizerError, match="cancelled"):
        tok.tokenize(text, parse_special=True, cancel=LateCancel())


# -- a model file with a hostile template ---------------------------------------------------------

# Loops for long only when asked to, so one server shows both the failure and the next request.
PICKY = ("{% if messages[-1].content == 'loop' %}" + SLOW_LOOP + "{% endif %}"
         "{% if messages[-1].content == 'big' %}{{ 'x' * 10**10 }}{% endif %}"
         "{% for m in messages %}{{ m.content }}{% endfor %}")


@pytest.fixture(scope="module")
def picky_model(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("tmpl") / "picky.gguf", "llama", "F32", chat_template=PICKY)
    model = edgeinfer.load(str(path), backend="reference", n_ctx=256)
    model.chat([{"role": "user", "content": "hi"}], max_tokens=1)  # the first run is slow: warm up
    return model


def test_model_chat_cancelled_while_rendering_ends_like_a_cancelled_generation(picky_model):
    cancel = threading.Event()
    threading.Timer(0.2, cancel.set).start()
    t0 = time.perf_counter()
    chunks = list(picky_model.chat([{"role": "user", "content": "loop"}], stream=True, cancel=cancel))
    assert time.perf_counter() - t0 < 1.0
    assert len(chunks) == 1 and chunks[0].finish_reason == FinishReason.CANCELLED
    result = picky_model.chat([{"role": "user", "content": "loop"}], cancel=cancel)  # already set
    assert result.finish_reason == FinishReason.CANCELLED and result.text == ""
    with pytest.raises(TemplateBudgetError):  # no cancel: the budget's own error
        picky_model.chat([{"role": "user", "content": "big"}])
    assert picky_model.chat([{"role": "user", "content": "hi"}], max_tokens=2).usage.completion_tokens == 2


def test_server_timeout_covers_rendering_and_the_worker_stays_free(picky_model):
    from test_server import start_server

    timeout_s = 1.0  # under the 2 s render budget: the request's own timeout must stop it
    srv = start_server(picky_model, timeout_s=timeout_s, sampling={"temperature": 0.0, "max_tokens": 1})
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            hi = {"messages": [{"role": "user", "content": "hi"}]}
            t0 = time.perf_counter()
            r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "loop"}]})
            assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
            assert time.perf_counter() - t0 < timeout_s + 0.8
            r = c.post("/v1/chat/completions", json=hi)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1
    finally:
        srv.stop()


@pytest.mark.parametrize("content, wanted", [("loop", "render budget"), ("big", "memory budget")])
def test_server_answers_400_past_the_budget_and_serves_the_next_request(picky_model, content, wanted):
    from test_server import start_server

    srv = start_server(picky_model, sampling={"temperature": 0.0, "max_tokens": 2})
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            t0 = time.perf_counter()
            r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}]})
            assert r.status_code == 400 and wanted in r.json()["error"]["message"]
            assert time.perf_counter() - t0 < MAX_RENDER_S + 1.5
            r = c.post("/api/chat", json={"messages": [{"role": "user", "content": content}], "stream": False})
            assert r.status_code == 400 and wanted in r.text
            assert c.get("/health").json() == {"status": "ok"}
            r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    finally:
        srv.stop()


# -- edgeinfer run and load, in a fresh process -----------------------------------------------------

CLI_CASES = ["nested_range", "empty_body", "repeat_1e10", "print_100kB_100k_times", "power", "huge_range"]


@pytest.fixture(scope="module")
def hostile_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    return {name: write_tiny_model(root / f"{name}.gguf", "llama", "F32", chat_template=HOSTILE[name])
            for name in CLI_CASES}


@pytest.mark.parametrize("name", CLI_CASES)
def test_run_with_a_hostile_template_is_one_line_and_exit_1(hostile_files, name):
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "edgeinfer.cli", "run", str(hostile_files[name]), "hi",
                           "--backend", "reference", "-c", "64", "-n", "2"],
                          capture_output=True, text=True, timeout=120)
    elapsed = time.perf_counter() - t0
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("edgeinfer: error: chat template model exceeded its "), proc.stderr
    assert elapsed < 20  # interpreter start and imports included; the render itself is <= 2 s


LOAD_AND_MEASURE = textwrap.dedent("""
    import json, resource, sys, time
    import edgeinfer
    from edgeinfer.errors import EdgeInferError
    t0 = time.perf_counter()
    try:
        edgeinfer.load(sys.argv[1], backend="reference", n_ctx=64)
        outcome = "loaded"
    except EdgeInferError as exc:
        outcome = str(exc)
    print(json.dumps({"outcome": outcome, "load_s": time.perf_counter() - t0,
                      "maxrss_mb": int([l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM:')][0]) / 1024}))
""")


def test_loading_a_file_with_a_hostile_template_stays_small(tmp_path):
    # each of these used to be evaluated while compiling (constant folding) at load
    source = "{{ 'x' * 10**10 }}{{ 'y'|center(10**10) }}{{ 10 ** (10 ** 10) }}{{ '%.1000000000f'|format(1.0) }}"
    path = write_tiny_model(tmp_path / "fold.gguf", "llama", "F32", chat_template=source)
    # a cap on the address space keeps a regression from taking the machine's memory
    limit = "import resource; resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))\n"
    proc = subprocess.run([sys.executable, "-c", limit + LOAD_AND_MEASURE, str(path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["outcome"] == "loaded"
    assert report["load_s"] < 30
    assert report["maxrss_mb"] < 400, report
