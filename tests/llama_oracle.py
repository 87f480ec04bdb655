"""The llama.cpp oracle (llama-cpp-python) the parity tests compare against. A plain README
install has not got it, and those tests skip saying so; .ci/run installs it (a wheel built
for this CPU kind, from ../shared/wheels) before it runs the suite."""
from __future__ import annotations

import pytest

MISSING = "the llama.cpp oracle (llama-cpp-python) is not installed; .ci/run installs it from ../shared/wheels"


def importorskip_oracle(module: str = "llama_cpp"):
    """The oracle's module, or skip the test with MISSING as its reason."""
    return pytest.importorskip(module, reason=MISSING)
