"""The fast decode and prefill-tile kernels compiled for other CPUs than this one, in subprocesses.

NUMBA_CPU_NAME / NUMBA_CPU_FEATURES make Numba compile for another target:
- haswell (AVX2, FMA, F16C, no AVX-512): the AVX2 intrinsic path (on AVX-512 hosts; an
  AVX2-only host runs it itself),
- x86-64 with SSE2 only: the portable-IR path (no AVX2 intrinsics, no F16C).
Numba keys its on-disk cache by (triple, CPU name, feature string), so these runs
share the cache directory with the host's without mixing code; the last run (host
target) checks that loading the cache after them still gives correct results.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

HASWELL = ("+64bit,+avx,+avx2,+bmi,+bmi2,+cmov,+cx16,+cx8,+f16c,+fma,+fxsr,+lzcnt,+mmx,+movbe,"
           "+pclmul,+popcnt,+sahf,+sse,+sse2,+sse3,+sse4.1,+sse4.2,+ssse3,+xsave,"
           "-avx512f,-avx512bw,-avx512vl,-avx512vnni,-avxvnni")
SSE2_ONLY = "+64bit,+sse,+sse2,+cx8,+fxsr,+mmx,+cmov"

_SCRIPT = r"""
import sys
import numpy as np
from gguf import GGMLQuantizationType as T
from numba.core.registry import cpu_target
import edgeinfer.kernels_cpu as K
from edgeinfer.kernels_cpu import dispatch, quant_types
from edgeinfer.kernels_cpu.reference import reference_quantize_act
from quant_blocks import random_blocks

cg = cpu_target.target_context.codegen()
print("target", cg.magic_tuple()[1], "+avx2" in cg._tm_features.split(","))
rng = np.random.default_rng(7)
results = {}
FAST_TYPES = [int(t) for t in quant_types.fast_types()]
dispatch.use_types(FAST_TYPES + [1012])   # one kernel set for every type, as a model's
# 19 rows: the per-row orders, and Q8_0's and Q6_K's four rows a loop with 3 leftover rows;
# 16 x 1024 and 8 x 14336: Q4_K four rows in lanes; 9 x 4096: Q8_0 four rows a loop
cases = [(T(t), 19, 1024) for t in FAST_TYPES] + [(T.Q4_K, 16, 1024), (T.Q8_0, 9, 4096),
                                                           (T.Q4_K, 8, 14336)]
for qt, n_rows, n_cols in cases:
    w = random_blocks(qt, n_rows, n_cols, rng)
    if qt == T.Q8_0:  # fp16 scales that are subnormal, zero, negative, large
        d = np.array([1e-7, 0.0, -3e-6, 6e4], np.float16).view(np.uint8)
        for i in range(4):
            w[i, 0:2] = d[2 * i:2 * i + 2]
    w.flags.writeable = False
    x = rng.standard_normal(n_cols).astype(np.float32)
    y = K.matvec(w, qt, x)
    results[f"{qt.name}_{n_rows}x{n_cols}"] = y
    W = K.reference_dequantize(w, qt).astype(np.float64)
    xq = reference_quantize_act(x, K.quant_info(qt).act_block)
    tol = 2e-5 * (np.abs(W) @ np.abs(xq)) + 1e-30
    err = np.abs(y - W @ xq)
    if not np.all(err <= tol):
        sys.exit(f"{qt.name}: max err {err.max()} rows {np.nonzero(err > tol)[0]}")
# F16 rows (vcvtph2ps, or integer conversion without F16C) with a 32-value tail and specials
wh = (rng.standard_normal((13, 100)) * 0.5).astype(np.float16)
wh[0, :4] = [6e-8, -0.0, 6.5e4, 1e-5]
x = rng.standard_normal(100).astype(np.float32)
y = K.matvec(wh.view(np.uint8).reshape(13, -1), T.F16, x)
if not np.allclose(y, wh.astype(np.float64) @ x, rtol=1e-5, atol=1e-4):
    sys.exit("F16 matvec off the float64 product")
results["F16_13x100"] = y
# Q4_K_X8, the backend's interleaved copy (the 256-bit loop off AVX-512): the plain layout's bits
from edgeinfer.kernels_cpu import repack
for n_rows, n_cols in ((16, 1024), (8, 14336)):
    w = random_blocks(T.Q4_K, n_rows, n_cols, rng)
    x = rng.standard_normal(n_cols).astype(np.float32)
    y = K.matvec(repack.interleave_q4_k(w), 1012, x)
    if not np.array_equal(y, K.matvec(w, T.Q4_K, x)):
        sys.exit(f"Q4_K_X8 {n_rows}x{n_cols} differs from Q4_K")
    results[f"Q4_K_X8_{n_rows}x{n_cols}"] = y
# attention (the F16C vector dot or its scalar twin) and the F16 conversions
from edgeinfer.kernels_cpu import f16, kv_attention
q = rng.standard_normal((3, 4, 64)).astype(np.float32)
k, v = (rng.standard_normal((40, 2, 64)).astype(np.float16) for _ in range(2))
results["attention"] = kv_attention.attention(q, k, v, np.arange(40), np.arange(37, 40), 0.125, 16)
results["f16_bits"] = f16.to_f16_bits(q * 1e3)
results["f16_to_f32"] = f16.f16_to_f32(k)
# ggml-order float products (tinyBLAS tiles, F16 widened by vcvtph2ps or integer ops) and
# the encoders' non-flash attention: lanes of 8 or 16 as the build's ggml
from edgeinfer.kernels_cpu import attention_f32_ggml, f32_ggml
wh = (rng.standard_normal((8, 64)) * 0.5).astype(np.float16)
xh = rng.standard_normal((5, 64)).astype(np.float16).astype(np.float32)
y = f32_ggml.matmul_f16(wh, xh, np.empty((5, 8), np.float32))
if not np.allclose(y, xh.astype(np.float64) @ wh.astype(np.float64).T, rtol=1e-5, atol=1e-4):
    sys.exit("F16 tinyBLAS product off the float64 product")
results["f16_tinyblas"] = y
qa = rng.standard_normal((20, 2, 16)).astype(np.float32)
results["attention_f32"] = attention_f32_ggml.attention(qa, qa[::-1].copy(), qa, 0.25)
# the prefill tiles: vpdpbusd with VNNI, its portable emulation elsewhere (exact integers);
# matmul takes them on VNNI hosts only, so only the host's run computes them
from edgeinfer.kernels_cpu import tile_gemm
rng = np.random.default_rng(8)   # each section its own draws: a run that skips one sees the same inputs after it
X = rng.standard_normal((19, 256)).astype(np.float32)
packed = tile_gemm.pack_activations(X)
for qt in (T.Q8_0, T.Q4_0, T.Q5_0, T.Q4_K, T.Q6_K) if "tiles" in sys.argv[2] else ():
    w = random_blocks(qt, 6, 256, rng)
    out = np.empty((19, 6), np.float32)
    tile_gemm.matmul_rows(w, int(qt), 0, 6, packed, out)
    results[f"tiles_{qt.name}"] = out
    if qt == T.Q4_K:
        w8 = random_blocks(qt, 8, 256, rng)
        out8, plain8 = np.empty((19, 8), np.float32), np.empty((19, 8), np.float32)
        tile_gemm.matmul_rows(repack.interleave_q4_k(w8), 1012, 0, 8, packed, out8)
        tile_gemm.matmul_rows(w8, int(qt), 0, 8, packed, plain8)
        if not np.array_equal(out8, plain8):
            sys.exit("Q4_K_X8 tiles differ from Q4_K's")
        results["tiles_Q4_K_X8"] = out8
# the K-quant prefill GEMM (AVX2's vpmaddubsw or the portable IR): Q4_K tokens get matvec's bits;
# matmul takes it on AVX2 hosts only (so not in the SSE2 run)
import importlib
from edgeinfer.kernels_cpu import gemm_kquant
MV = importlib.import_module("edgeinfer.kernels_cpu.matvec")
rng = np.random.default_rng(9)
X = rng.standard_normal((7, 512)).astype(np.float32)
packed = gemm_kquant.pack_activations(*MV.quantize_activation_rows(X, K.quant_info(T.Q4_K)))
for qt in (T.Q4_K, T.Q6_K, T.Q3_K, T.Q2_K, T.IQ4_XS, T.IQ2_XS, T.IQ3_S) if "gemm" in sys.argv[2] else ():
    w = random_blocks(qt, 16, 512, rng)
    w.flags.writeable = False
    out = np.empty((7, 16), np.float32)
    gemm_kquant.matmul_rows(w, int(qt), 0, 2, packed, out)
    for t in range(7 if qt == T.Q4_K else 0):
        if not np.array_equal(out[t], K.matvec(w, T.Q4_K, X[t])):
            sys.exit(f"gemm_kquant token {t} differs from matvec")
    results[f"gemm_{qt.name}"] = out
np.savez(sys.argv[1], **results)
from edgeinfer.kernels_cpu import ggml_math
print("ggml build avx512", ggml_math.AVX512)
print("ok", dispatch.kernels_for(*FAST_TYPES).matvec_kernel.stats.cache_hits)
"""


def _run(out_file, parts, cpu_name=None, features=None):
    env = dict(os.environ)
    env.pop("NUMBA_CPU_NAME", None)
    env.pop("NUMBA_CPU_FEATURES", None)
    if cpu_name:
        env["NUMBA_CPU_NAME"] = cpu_name
        env["NUMBA_CPU_FEATURES"] = features
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    p = subprocess.run([sys.executable, "-c", _SCRIPT, str(out_file), parts], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def _host_is_avx2_only() -> bool:
    from numba.core.registry import cpu_target

    from edgeinfer.kernels_cpu.ir_helpers import target_features

    feats = target_features(cpu_target.target_context)
    return "+avx2" in feats and "+avx512f" not in feats


def test_fast_kernels_on_other_cpu_targets_give_the_host_bits(tmp_path):
    # the AVX2 intrinsics and the portable IR do the same integer and float operations in
    # the same order, so every target must produce the host's results bit for bit. Each
    # target compiles the paths matmul can take there: the SSE2 build has neither the
    # K-quant GEMM (AVX2 hosts) nor the tiles (VNNI hosts); an AVX2 host without AVX-512
    # runs the AVX2 path itself, so the haswell build would repeat the host's
    targets = [("sse2-portable", "x86-64", SSE2_ONLY, False, "rows")]
    if not _host_is_avx2_only():
        targets.insert(0, ("avx2", "haswell", HASWELL, True, "rows,gemm"))
    outs, builds = {}, {}
    for name, cpu_name, features, has_avx2, parts in targets:
        out = _run(tmp_path / f"{name}.npz", parts, cpu_name, features)
        assert f"target {cpu_name} {has_avx2}" in out
        assert "ok" in out
        outs[name] = np.load(tmp_path / f"{name}.npz")
        builds[name] = "ggml build avx512 True" in out
    # last: the host target, loading the on-disk cache the other targets wrote beside it
    out = _run(tmp_path / "host.npz", "rows,gemm,tiles")
    assert "ok" in out
    host, host_avx512 = np.load(tmp_path / "host.npz"), "ggml build avx512 True" in out
    assert {"gemm_Q4_K", "tiles_Q4_K"} <= set(host.files)
    for name, got in outs.items():
        left_out = set(host.files) - set(got.files)
        assert all(k.startswith(("gemm_", "tiles_")) for k in left_out), (name, left_out)
        for key in got.files:
            if key in ("attention", "f16_tinyblas", "attention_f32") and builds[name] != host_avx512:
                # each target holds the order of llama.cpp's build for it (ggml_math.AVX512):
                # an AVX2 target's attention is llama.cpp's AVX2 one, not the AVX-512 host's
                continue
            np.testing.assert_array_equal(got[key], host[key], err_msg=f"{name} {key}")
