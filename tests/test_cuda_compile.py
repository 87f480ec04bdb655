"""The CUDA sources compile with nvcc (no GPU needed), export the kernels the launchers call,
and their GGUF block decoding matches gguf.quants (checked by running it on the host).

Every source for sm_75 (the oldest, WMMA) and sm_90; sm_86 and sm_89 (the consumer cards) are
compiled by test_cuda_budgets (warnings as errors, with ptxas's report), and .ci/run compiles
all four again; all compiles start at once to stay around a minute on two cores. What nvcc
compiles is each source as the runtime compiles it (generated.source_text: quant.cu with the
i-quant tables generated from kernels_cpu/iq_tables.py in place of its iq_tables.cuh).
"""

from __future__ import annotations

import re
import shutil
import struct
import subprocess

import numpy as np
import pytest
from gguf import quants
from gguf_factory import random_blocks

from edgeinfer.kernels_cpu import iquant_ref
from edgeinfer.kernels_cuda.generated import source_text
from edgeinfer.kernels_cuda.launch import KERNEL_NAMES, QTYPE_SUFFIX
from edgeinfer.kernels_cuda.runtime import KERNEL_DIR, SOURCES, nvcc_options

NVCC = shutil.which("nvcc")
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH: CUDA sources not compiled")
ARCHS = ("sm_75", "sm_90")   # sm_86, sm_89: test_cuda_budgets

HARNESS = r"""
#include "quant.cu"
#include <cstdio>
#include <vector>
template <int T> void run(const std::vector<uint8_t>& w, long long rb, int nr, int nc, std::vector<float>& out) {
    for (int r = 0; r < nr; ++r)
        for (int c = 0; c < nc / 32; ++c) dequant32<T>(w.data() + r * rb, c, &out[(size_t)r * nc + 32 * c]);
}
int main() {
    int t, nr, nc; long long rb;
    if (fread(&t, 4, 1, stdin) != 1 || fread(&nr, 4, 1, stdin) != 1 || fread(&nc, 4, 1, stdin) != 1 ||
        fread(&rb, 8, 1, stdin) != 1) return 2;
    std::vector<uint8_t> w((size_t)nr * rb);
    if (fread(w.data(), 1, w.size(), stdin) != w.size()) return 3;
    std::vector<float> out((size_t)nr * nc);
    switch (t) {
%CASES%
        default: return 4;
    }
    fwrite(out.data(), 4, out.size(), stdout);
    return 0;
}
"""
_TYPE_MACRO = {"f32": "T_F32", "f16": "T_F16", "q4_0": "T_Q4_0", "q4_1": "T_Q4_1", "q5_0": "T_Q5_0",
               "q5_1": "T_Q5_1", "q8_0": "T_Q8_0", "q4_k": "T_Q4_K", "q5_k": "T_Q5_K", "q6_k": "T_Q6_K",
               "mxfp4": "T_MXFP4", "iq2_xxs": "T_IQ2_XXS", "iq2_xs": "T_IQ2_XS", "iq2_s": "T_IQ2_S",
               "iq3_xxs": "T_IQ3_XXS", "iq3_s": "T_IQ3_S", "iq1_s": "T_IQ1_S", "iq1_m": "T_IQ1_M"}


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """Start every nvcc job in parallel; returns {job: (returncode, output, artefact dir)}."""
    out = tmp_path_factory.mktemp("nvcc")
    sources = out / "src"
    sources.mkdir()
    for src in SOURCES:
        (sources / src).write_text(source_text(src))
    jobs = {}
    for src in SOURCES:
        for arch in ARCHS:
            keep = out / f"{src}-{arch}"
            keep.mkdir()
            cmd = [NVCC, f"-arch={arch}", *nvcc_options(arch), "-c", str(sources / src), "-o",
                   str(keep / "k.o"), "--keep", "--keep-dir", str(keep)]
            jobs[(src, arch)] = (subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                  text=True, cwd=keep), keep)
    cases = "\n".join(f"        case {int(q)}: run<{_TYPE_MACRO[s]}>(w, rb, nr, nc, out); break;"
                      for q, s in QTYPE_SUFFIX.items())
    harness = out / "harness.cu"
    harness.write_text(HARNESS.replace("%CASES%", cases))
    cmd = [NVCC, "-DEI_HOST_ONLY", f"-I{sources}", str(harness), "-o", str(out / "harness")]
    jobs["harness"] = (subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), out)
    done = {}
    for key, (proc, where) in jobs.items():
        text, _ = proc.communicate(timeout=300)
        done[key] = (proc.returncode, text, where)
    return done


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("src", SOURCES)
def test_compiles(builds, src, arch):
    rc, text, where = builds[(src, arch)]
    assert rc == 0, f"nvcc -arch={arch} {src} failed:\n{text}"
    assert (where / "k.o").stat().st_size > 0


@pytest.mark.parametrize("src", SOURCES)
def test_launcher_kernels_exist(builds, src):
    """Every name the launchers look up is an exported (extern "C", unmangled) PTX entry."""
    _, _, where = builds[(src, "sm_75")]
    ptx = "".join(p.read_text() for p in where.glob("*.ptx"))
    entries = set(re.findall(r"\.entry\s+(\w+)\s*\(", ptx))
    missing = sorted(set(KERNEL_NAMES[src]) - entries)
    assert not missing, f"{src}: launcher kernels missing from the PTX: {missing} (have {sorted(entries)})"


def test_every_source_is_listed():
    assert sorted(p.name for p in KERNEL_DIR.glob("*.cu")) == sorted(SOURCES) == sorted(KERNEL_NAMES)


@pytest.mark.parametrize("qtype", list(QTYPE_SUFFIX), ids=lambda q: q.name)
def test_dequant32_matches_gguf_on_host(builds, qtype):
    """quant.cu's block decoding (the code both GPU matrix kernels use), run on the CPU: the
    i-quants bit for bit as kernels_cpu.iquant_ref (ggml's dequantize_row_*), the rest as gguf.quants."""
    rc, text, where = builds["harness"]
    assert rc == 0, f"host harness failed to build:\n{text}"
    rng = np.random.default_rng(int(qtype))
    n_rows, n_cols = 5, 768
    raw = np.ascontiguousarray(random_blocks(qtype, n_rows, n_cols, rng)).view(np.uint8).reshape(n_rows, -1)
    payload = struct.pack("<iiiq", int(qtype), n_rows, n_cols, raw.shape[1]) + raw.tobytes()
    res = subprocess.run([str(where / "harness")], input=payload, capture_output=True, timeout=60)
    assert res.returncode == 0, res.stderr
    got = np.frombuffer(res.stdout, np.float32).reshape(n_rows, n_cols)
    if int(qtype) in iquant_ref.BLOCK_BYTES:
        want = iquant_ref.dequantize(int(qtype), raw)
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    else:
        want = quants.dequantize(raw, qtype).astype(np.float32).reshape(n_rows, n_cols)
        np.testing.assert_array_equal(got, want)
