"""The parts of the CUDA sources that are generated from Python, and the text nvcc compiles.

The i-quants' lattice grids and sign table live once, in kernels_cpu/iq_tables.py (the CPU
kernels and the numpy reference read them there, and tests/test_iquants.py holds every entry
to ggml's own dequantization). The CUDA kernels need the same numbers as device arrays; rather
than a second, hand-copied table that could drift, quant.cu names a header that is not a file,

    #include "iq_tables.cuh"

and `source_text` puts the C definitions `iq_tables_cuh` prints from the Python arrays in
that line's place. The arrays are compile-time initialised `__device__` data (global memory
through L1, as ggml-cuda's GGML_TABLE_BEGIN: a warp's lanes gather different entries, which
`__constant__` memory would serialise), so nothing is uploaded at run time and a module can
never run with tables missing. The runtime compile (runtime.module), the emulator, the nvcc
checks of tests/ all compile `source_text(name)`; to run nvcc by hand on quant.cu, write the
header beside it first: `python -m edgeinfer.kernels_cuda.generated > kernels_cuda/iq_tables.cuh`.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import numpy as np

KERNEL_DIR = Path(__file__).resolve().parent
_INCLUDE = re.compile(r'^#include "([\w.]+\.cuh)"[^\n]*$', re.M)


def _array(ctype: str, name: str, values: np.ndarray, per_line: int, width: int, suffix: str) -> str:
    lines = [", ".join(f"0x{int(v):0{width}x}{suffix}" for v in values[i:i + per_line])
             for i in range(0, len(values), per_line)]
    body = ",\n    ".join(lines)
    return f"EI_IQ_TABLE({ctype}, {name}, {len(values)}) = {{\n    {body},\n}};\n"


@functools.lru_cache(maxsize=1)
def iq_tables_cuh() -> str:
    """C definitions of kernels_cpu/iq_tables.py's arrays, under the names quant.cu reads.

    Each definition is `EI_IQ_TABLE(type, name, n) = {...};`: the including source defines
    EI_IQ_TABLE (static const __device__ data; host arrays in nvcc's host pass)."""
    from edgeinfer.kernels_cpu import iq_tables as tb

    parts = ["// generated from kernels_cpu/iq_tables.py by kernels_cuda/generated.py: do not edit\n"]
    for name, values in (("iq2xxs_grid", tb.IQ2XXS_GRID), ("iq2xs_grid", tb.IQ2XS_GRID), ("iq2s_grid", tb.IQ2S_GRID),
                         ("iq1s_grid", tb.IQ1S_GRID)):
        parts.append(_array("uint64_t", name, values, 4, 16, "ull"))
    for name, values in (("iq3xxs_grid", tb.IQ3XXS_GRID), ("iq3s_grid", tb.IQ3S_GRID)):
        parts.append(_array("uint32_t", name, values, 8, 8, "u"))
    parts.append(_array("uint8_t", "ksigns_iq2xs", tb.KSIGNS_IQ2XS, 16, 2, ""))
    return "".join(parts)


GENERATED = {"iq_tables.cuh": iq_tables_cuh}


def source_text(source: str) -> str:
    """The text of kernels_cuda/<source> as it is compiled: each `#include` of a generated
    header replaced by that header's text."""
    text = (KERNEL_DIR / source).read_text()
    return _INCLUDE.sub(lambda m: GENERATED[m.group(1)]() if m.group(1) in GENERATED else m.group(0), text)


if __name__ == "__main__":
    print(iq_tables_cuh(), end="")
