#!/usr/bin/env bash
# llama.cpp's own server test suite (tools/server/tests, from llama-cpp-python 0.3.36's sdist)
# run against `edgeinfer serve` through scripts/llama_server_shim.py, which maps llama-server's
# flags onto serve and the suite's model downloads onto tiny generated models.
#
#   scripts/llama_server_tests.sh                      # the files below, 2 workers
#   scripts/llama_server_tests.sh unit/test_basic.py   # other pytest arguments
#
# Environment: PYTHON (default .venv/bin/python), LLAMA_SERVER_TESTS (a tools/server/tests
# folder; default: extracted from the sdist, downloaded once with pip), WORKERS (default 2),
# PORT_OFFSET (added to the suite's ports 8080, 8090, ...),
# EDGEINFER_LLAMA_TESTS_DIR (work folder: models, deps, results.xml).
# Prints pass/fail counts per file and the failures; results.xml holds the details.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
WORK=${EDGEINFER_LLAMA_TESTS_DIR:-${TMPDIR:-/tmp}/edgeinfer-llama-server-tests}
VERSION=0.3.36
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)

SUITE=${LLAMA_SERVER_TESTS:-}
if [ -z "$SUITE" ]; then
    SUITE=$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp/tools/server/tests
    if [ ! -d "$SUITE" ]; then
        SDIST=$WORK/llama_cpp_python-$VERSION.tar.gz
        [ -f "$SDIST" ] || "$PY" -m pip download -q "llama-cpp-python==$VERSION" --no-deps \
            --no-binary :all: -d "$WORK"
        tar xzf "$SDIST" -C "$WORK" "llama_cpp_python-$VERSION/vendor/llama.cpp/tools/server/tests" \
            "llama_cpp_python-$VERSION/vendor/llama.cpp/models/templates"
    fi
fi

# what the suite imports beyond the project's venv, beside it (not in it)
if ! PYTHONPATH=$WORK/deps "$PY" -c "import wget, aiohttp, filelock, openai, requests, xdist" 2>/dev/null; then
    "$PY" -m pip install -q --no-deps --target "$WORK/deps" wget aiohttp aiohappyeyeballs aiosignal \
        frozenlist multidict propcache yarl
fi

[ -f "$WORK/models/embed.gguf" ] || "$PY" "$ROOT/scripts/llama_server_shim.py" --make-models "$WORK/models"

# the suite puts xdist worker N's servers on port 8080 + 10 N; PORT_OFFSET moves them (two runs at once)
cat > "$WORK/deps/edgeinfer_ports.py" <<'PY'
import os

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    yield
    offset = int(os.environ.get("PORT_OFFSET", "0") or 0)
    if fixturedef.argname == "configure_worker_port" and offset:
        os.environ["PORT"] = str(int(os.environ.get("PORT", "8080")) + offset)
PY

mkdir -p "$WORK/bin"
cat > "$WORK/bin/llama-server" <<SH
#!/bin/sh
exec "$PY" "$ROOT/scripts/llama_server_shim.py" "\$@"
SH
chmod +x "$WORK/bin/llama-server"

FILES=(unit/test_basic.py unit/test_chat_completion.py unit/test_completion.py unit/test_ctx_shift.py
       unit/test_embedding.py unit/test_infill.py unit/test_security.py unit/test_slot_save.py
       unit/test_template.py unit/test_tokenize.py)
[ $# -gt 0 ] && FILES=("$@")

cd "$SUITE"
set +e
LLAMA_SERVER_BIN_PATH=$WORK/bin/llama-server EDGEINFER_SHIM_MODELS=$WORK/models \
PYTHONPATH=$WORK/deps${PYTHONPATH:+:$PYTHONPATH} \
    "$PY" -m pytest -q -p no:cacheprovider -p edgeinfer_ports -n "${WORKERS:-2}" --junitxml="$WORK/results.xml" \
    -o junit_family=xunit1 "${FILES[@]}" > "$WORK/pytest.log" 2>&1
set -e
tail -n 3 "$WORK/pytest.log"
"$PY" - "$WORK/results.xml" <<'PY'
import collections, sys, xml.etree.ElementTree as ET
counts = collections.defaultdict(collections.Counter)
failed = []
for case in ET.parse(sys.argv[1]).iter("testcase"):
    where = case.get("file") or case.get("classname", "").replace(".", "/") + ".py"
    outcome = "passed"
    for tag in ("failure", "error", "skipped"):
        node = case.find(tag)
        if node is not None:
            outcome = "skipped" if tag == "skipped" else "failed"
            if tag != "skipped":
                msg = (node.get("message") or "").splitlines()[0][:160] if node.get("message") else ""
                failed.append(f"{where}::{case.get('name')}  {msg}")
            break
    counts[where][outcome] += 1
total = collections.Counter()
for where, c in sorted(counts.items()):
    total.update(c)
    print(f"{where:40s} passed {c['passed']:3d}  failed {c['failed']:3d}  skipped {c['skipped']:3d}")
print(f"{'total':40s} passed {total['passed']:3d}  failed {total['failed']:3d}  skipped {total['skipped']:3d}")
print("\nfailures:")
print("\n".join(failed))
PY
