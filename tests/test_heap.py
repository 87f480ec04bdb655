"""kernels_cpu/heap.py: a layer's big temporaries come back from the heap, without page faults."""
from __future__ import annotations

import subprocess
import sys

import pytest

# a prefill step's pattern: buffers of 2-30 MB allocated, touched, some kept while the next
# come, freed; after a first round, later rounds of the same sizes
_PROBE = """
import resource, sys, numpy as np
from edgeinfer.kernels_cpu import heap
took = heap.keep_freed_buffers() if sys.argv[1] == "1" else None
def one_round():
    live = []
    for mb in (16, 16, 8, 24, 16, 2, 30):
        live.append(np.ones(mb << 18, np.float32))
        if len(live) > 2:
            live.pop(0)
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
one_round()
before = faults()
one_round()
one_round()
print(took, faults() - before)
"""


def _run(setting: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", _PROBE, setting], capture_output=True, text=True, timeout=120,
                         check=True)
    took, n = out.stdout.split()
    return took, int(n)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's (Linux)")
def test_later_rounds_of_big_buffers_fault_no_pages():
    took, kept = _run("1")
    if took != "True":
        pytest.skip("this C library takes no mallopt thresholds (not glibc)")
    _, plain = _run("0")
    assert plain > 1000, plain    # without the setting the pages are faulted in again
    assert kept < plain // 20, (kept, plain)
