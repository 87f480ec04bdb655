"""The CUDA emulator itself: it computes what CUDA computes, and it catches each fault class a
GPU would show (or silently miscompute) as an error: barriers and warp operations not reached
by every thread, shuffles in partial warps, launches past the device's limits, too much static
shared memory, arguments of the wrong width, pointers outside allocations, out-of-bounds
accesses, races (forward and reversed order differ). Small kernels of its own, built with g++.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from edgeinfer.kernels_cuda.emulator import build
from edgeinfer.kernels_cuda.emulator.kernel import ArgumentError, LaunchError
from edgeinfer.kernels_cuda.emulator.memory import MEMORY
from edgeinfer.kernels_cuda.emulator.standin import driver, gpuarray
from edgeinfer.kernels_cuda.emulator.standin.compiler import CompileError, SourceModule

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++: the CUDA emulator cannot build")


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("emulator-builds")


@pytest.fixture(autouse=True)
def _order(monkeypatch):
    monkeypatch.setenv("EDGEINFER_CUDA_EMULATE_ORDER", "forward")
    monkeypatch.delenv("EDGEINFER_CUDA_EMULATE_VRAM_MB", raising=False)


def _module(source: str, cache_dir, fast_math: bool = False) -> SourceModule:
    return SourceModule(source, no_extern_c=True, options=["--use_fast_math"] if fast_math else [],
                        cache_dir=str(cache_dir))


# -- what it computes ---------------------------------------------------------------------------

WARP_SOURCE = r"""
extern "C" __global__ void warp_ops(const float* x, float* sum, float* bcast, float* down, float* up) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x, lane = threadIdx.x & 31;
    float v = x[i], s = v;
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    sum[i] = s;
    bcast[i] = __shfl_sync(0xffffffffu, v, 5);
    down[i] = __shfl_down_sync(0xffffffffu, v, 3);
    up[i] = __shfl_up_sync(0xffffffffu, v, 1, 8);
    (void)lane;
}
"""


def test_shuffles_exchange_across_the_warp(build_dir):
    f = _module(WARP_SOURCE, build_dir).get_function("warp_ops")
    x = np.arange(128, dtype=np.float32) * 0.5
    outs = [gpuarray.empty(128, np.float32) for _ in range(4)]
    f(gpuarray.to_gpu(x), *outs, block=(64, 1, 1), grid=(2, 1))
    warps = x.reshape(4, 32)
    np.testing.assert_array_equal(outs[0].get().reshape(4, 32), np.repeat(warps.sum(1, keepdims=True), 32, 1))
    np.testing.assert_array_equal(outs[1].get().reshape(4, 32), np.repeat(warps[:, 5:6], 32, 1))
    lane = np.arange(32)
    np.testing.assert_array_equal(outs[2].get().reshape(4, 32), warps[:, np.where(lane + 3 < 32, lane + 3, lane)])
    # width 8: lane l reads l - 1 within its group of 8, the group's first lane reads itself
    src = np.where(lane % 8 == 0, lane, lane - 1)
    np.testing.assert_array_equal(outs[3].get().reshape(4, 32), warps[:, src])


WMMA_SOURCE = r"""
#include <cuda_fp16.h>
#include <mma.h>
using namespace nvcuda;
extern "C" __global__ void tile(const __half* a, const __half* b, float* c) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> fa;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> fb;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::fill_fragment(acc, 1.0f);
    wmma::load_matrix_sync(fa, a, 16);
    wmma::load_matrix_sync(fb, b, 16);
    wmma::mma_sync(acc, fa, fb, acc);
    wmma::store_matrix_sync(c, acc, 16, wmma::mem_row_major);
}
"""


def test_wmma_tile_is_a_matrix_product(build_dir):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((16, 16)).astype(np.float16)
    bt = rng.standard_normal((16, 16)).astype(np.float16)  # col_major B: row n holds B[:, n]
    c = gpuarray.empty((16, 16), np.float32)
    _module(WMMA_SOURCE, build_dir).get_function("tile")(gpuarray.to_gpu(a), gpuarray.to_gpu(bt), c,
                                                        block=(32, 1, 1), grid=(1, 1))
    want = a.astype(np.float64) @ bt.astype(np.float64).T + 1.0
    np.testing.assert_allclose(c.get(), want, rtol=1e-5, atol=1e-5)


INT8_WMMA_SOURCE = r"""
#include <mma.h>
using namespace nvcuda;
extern "C" __global__ void tile8(const signed char* a, const signed char* b, int* c, int shift, int ldm) {
    __shared__ __align__(32) signed char sa[16 * 64];
    for (int i = threadIdx.x; i < 16 * 64; i += 32) sa[i] = i < 256 ? a[i] : 0;
    __syncwarp();
    wmma::fragment<wmma::matrix_a, 16, 16, 16, signed char, wmma::row_major> fa;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, signed char, wmma::col_major> fb;
    wmma::fragment<wmma::accumulator, 16, 16, 16, int> acc;
    wmma::fill_fragment(acc, 3);
    wmma::load_matrix_sync(fa, sa + shift, ldm);
    wmma::load_matrix_sync(fb, b, 16);
    wmma::mma_sync(acc, fa, fb, acc);
    wmma::store_matrix_sync(c, acc, 16, wmma::mem_row_major);
}
"""


def test_int8_wmma_sums_exactly_and_wants_aligned_tiles(build_dir):
    """8-bit operands with int32 sums, exact (as IMMA); a tile pointer off 32 bytes or an ldm
    that is not a multiple of 16 bytes is refused as the CUDA guide requires (a GPU would not say)."""
    from edgeinfer.kernels_cuda.emulator.kernel import LaunchError

    rng = np.random.default_rng(1)
    a = rng.integers(-128, 128, (16, 16)).astype(np.int8)
    bt = rng.integers(-128, 128, (16, 16)).astype(np.int8)
    f = _module(INT8_WMMA_SOURCE, build_dir).get_function("tile8")
    c = gpuarray.empty((16, 16), np.int32)
    f(gpuarray.to_gpu(a), gpuarray.to_gpu(bt), c, np.int32(0), np.int32(16), block=(32, 1, 1), grid=(1, 1))
    np.testing.assert_array_equal(c.get(), a.astype(np.int64) @ bt.astype(np.int64).T + 3)
    for shift, ldm, what in ((16, 16, "not 32-byte aligned"), (0, 24, "not a multiple of 16 bytes")):
        with pytest.raises(LaunchError, match=what):
            f(gpuarray.to_gpu(a), gpuarray.to_gpu(bt), c, np.int32(shift), np.int32(ldm), block=(32, 1, 1),
              grid=(1, 1))


def test_new_device_memory_is_nan():
    assert np.isnan(gpuarray.empty(100, np.float32).get()).all()
    assert np.isnan(gpuarray.empty(10, np.float16).get()).all()
    assert (gpuarray.zeros(7, np.int32).get() == 0).all()


def test_f16_fill_is_refused_as_pycuda_refuses_it():
    """pycuda's fill kernel (behind gpuarray.zeros) has no float16; launch.zeros memsets instead."""
    with pytest.raises(ValueError, match="unable to map dtype 'float16'"):
        gpuarray.zeros(4, np.float16)
    with pytest.raises(ValueError, match="float16"):
        gpuarray.empty(4, np.float16).fill(0)
    zeroed = gpuarray.empty((3, 5), np.float16)
    driver.memset_d8(zeroed.gpudata, 0, zeroed.nbytes)
    assert (zeroed.get() == 0).all()


FAST_MATH_SOURCE = r"""
extern "C" __global__ void funcs(const float* x, float* e, float* t, float* s, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        e[i] = expf(x[i]);
        t[i] = tanhf(x[i]);
        float c;
        sincosf(x[i], &s[i], &c);
    }
}
"""


@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast_math"])
def test_fast_math_carries_the_documented_error(build_dir, fast):
    x = np.linspace(-3, 3, 257).astype(np.float32)
    outs = [gpuarray.empty(257, np.float32) for _ in range(3)]
    f = _module(FAST_MATH_SOURCE, build_dir, fast).get_function("funcs")
    f(gpuarray.to_gpu(x), *outs, np.int32(257), block=(128, 1, 1), grid=(3, 1))
    e, t, s = (o.get().astype(np.float64) for o in outs)
    xd = x.astype(np.float64)
    t_err = np.abs(t - np.tanh(xd)) / np.maximum(np.abs(np.tanh(xd)), 1e-30)
    if not fast:
        np.testing.assert_allclose(e, np.exp(xd), rtol=3e-7)
        assert t_err.max() < 1e-6
        return
    # tanh.approx.f32: relative error up to 2^-10.987; __expf: 2 + floor(1.173 |x|) ulp
    assert 1e-4 < t_err.max() <= 5e-4
    ulps = np.abs(e - np.exp(xd)) / np.spacing(np.exp(xd).astype(np.float32)).astype(np.float64)
    assert (ulps <= 2 + np.floor(1.173 * np.abs(xd)) + 1).all() and ulps.max() >= 2
    assert 1e-7 < np.abs(s - np.sin(xd)).max() <= 4e-7  # __sinf: 2^-21.41 in [-pi, pi]


# -- what it catches ----------------------------------------------------------------------------

def _launch_fails(source: str, name: str, build_dir, *args, match: str, block=(64, 1, 1), grid=(1, 1),
                  error=LaunchError):
    f = _module(source, build_dir).get_function(name)
    with pytest.raises(error, match=match):
        f(*args, block=block, grid=grid)


def test_a_barrier_some_threads_skip_is_an_error(build_dir):
    src = r"""extern "C" __global__ void k(float* out) {
        if (threadIdx.x < 16) __syncthreads();
        out[threadIdx.x] = 1.0f; }"""
    _launch_fails(src, "k", build_dir, gpuarray.empty(64, np.float32), match="not reached by every thread")


def test_threads_at_different_barriers_is_an_error(build_dir):
    src = r"""extern "C" __global__ void k(float* out) {
        if (threadIdx.x < 40) {
            __syncthreads();
        } else {
            __syncthreads();
        }
        out[threadIdx.x] = 1.0f; }"""
    _launch_fails(src, "k", build_dir, gpuarray.empty(64, np.float32), match="24 at __syncthreads")


def test_a_barrier_after_some_threads_returned_is_an_error(build_dir):
    src = r"""extern "C" __global__ void k(float* out, int n) {
        if (threadIdx.x >= n) return;
        __syncthreads();
        out[threadIdx.x] = 1.0f; }"""
    _launch_fails(src, "k", build_dir, gpuarray.empty(64, np.float32), np.int32(40), match="24 exited")


def test_a_shuffle_in_divergent_code_is_an_error(build_dir):
    src = r"""extern "C" __global__ void k(float* out) {
        float v = threadIdx.x;
        if ((threadIdx.x & 31) < 16) v = __shfl_xor_sync(0xffffffffu, v, 1);
        out[threadIdx.x] = v; }"""
    _launch_fails(src, "k", build_dir, gpuarray.empty(64, np.float32), match="exits while its warp waits")


def test_a_lane_leaving_a_warp_mid_shuffle_is_an_error(build_dir):
    src = r"""extern "C" __global__ void k(float* out) {
        if (threadIdx.x == 3) return;
        out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.0f, 1); }"""
    _launch_fails(src, "k", build_dir, gpuarray.empty(64, np.float32), match="lane 3 .*exited|exits while")


def test_a_full_mask_shuffle_in_a_partial_warp_is_an_error(build_dir):
    src = r"""extern "C" __global__ void k(float* out) {
        out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, (float)threadIdx.x, 1); }"""
    _launch_fails(src, "k", build_dir, gpuarray.empty(48, np.float32), block=(48, 1, 1), match="partial warp of 16")


LIMITS_SOURCE = r"""
extern "C" __global__ void __launch_bounds__(128) bounded(float* out) { out[threadIdx.x] = 0.0f; }
extern "C" __global__ void free_size(float* out) { out[0] = 0.0f; }
extern "C" __global__ void big_shared(float* out) {
    __shared__ float big[13 * 1024];
    big[threadIdx.x] = 1.0f;
    __syncthreads();
    out[threadIdx.x] = big[(threadIdx.x + 1) % blockDim.x]; }
"""


def test_launches_past_the_limits_are_errors(build_dir):
    m = _module(LIMITS_SOURCE, build_dir)
    out = gpuarray.empty(2048, np.float32)
    with pytest.raises(LaunchError, match=r"__launch_bounds__\(128\)"):
        m.get_function("bounded")(out, block=(256, 1, 1), grid=(1, 1))
    with pytest.raises(LaunchError, match="more than the device's 1024"):
        m.get_function("free_size")(out, block=(32, 32, 2), grid=(1, 1))
    with pytest.raises(LaunchError, match="grid dimension y"):
        m.get_function("free_size")(out, block=(1, 1, 1), grid=(1, 70000))
    with pytest.raises(LaunchError, match="53248 bytes of static shared memory"):
        m.get_function("big_shared")(out, block=(64, 1, 1), grid=(1, 1))
    m.get_function("bounded")(out, block=(128, 1, 1), grid=(2, 1))  # within its bounds: runs


ARGS_SOURCE = r"""
extern "C" __global__ void scale(float* y, const float* x, long long n, float a) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i]; }
"""


def test_arguments_are_checked_against_the_signature(build_dir):
    f = _module(ARGS_SOURCE, build_dir).get_function("scale")
    x, y = gpuarray.to_gpu(np.ones(64, np.float32)), gpuarray.empty(64, np.float32)
    f(y, x, np.int64(64), np.float32(2.0), block=(64, 1, 1), grid=(1, 1))
    np.testing.assert_array_equal(y.get(), 2.0)
    with pytest.raises(ArgumentError, match=r"argument 2 \(n\).*8-byte signed integer, got int32"):
        f(y, x, np.int32(64), np.float32(2.0), block=(64, 1, 1), grid=(1, 1))
    with pytest.raises(ArgumentError, match=r"argument 3 \(a\).*got float64"):
        f(y, x, np.int64(64), np.float64(2.0), block=(64, 1, 1), grid=(1, 1))
    with pytest.raises(ArgumentError, match="pass a numpy scalar"):
        f(y, x, 64, np.float32(2.0), block=(64, 1, 1), grid=(1, 1))
    with pytest.raises(ValueError, match="in no live allocation"):
        f(y, np.intp(0x1234), np.int64(64), np.float32(2.0), block=(64, 1, 1), grid=(1, 1))
    with pytest.raises(ArgumentError, match="not aligned"):
        f(y, np.intp(x.ptr + 2), np.int64(64), np.float32(2.0), block=(64, 1, 1), grid=(1, 1))
    with pytest.raises(ArgumentError, match="takes 4 arguments"):
        f(y, x, np.int64(64), block=(64, 1, 1), grid=(1, 1))


def test_prepared_calls_are_checked_as_calls_are(build_dir):
    """launch.py launches through prepare/prepared_call: the format's widths and the pointers are checked."""
    x, y = gpuarray.to_gpu(np.ones(64, np.float32)), gpuarray.empty(64, np.float32)
    f = _module(ARGS_SOURCE, build_dir).get_function("scale").prepare("PPqf")
    f.prepared_call((1, 1), (64, 1, 1), y.ptr, x.ptr, 64, 3.0)
    np.testing.assert_array_equal(y.get(), 3.0)
    with pytest.raises(ValueError, match="in no live allocation"):
        f.prepared_call((1, 1), (64, 1, 1), y.ptr, 0x1234, 64, 3.0)
    with pytest.raises(ArgumentError, match="prepared for 4 arguments, got 3"):
        f.prepared_call((1, 1), (64, 1, 1), y.ptr, x.ptr, 64)
    g = _module(ARGS_SOURCE, build_dir).get_function("scale").prepare("PPif")  # n is a long long
    with pytest.raises(ArgumentError, match=r"argument 2 \(n\).*8-byte signed integer, got int32"):
        g.prepared_call((1, 1), (64, 1, 1), y.ptr, x.ptr, 64, 3.0)


def test_an_access_past_an_allocation_faults_and_says_where(build_dir):
    f = _module(ARGS_SOURCE, build_dir).get_function("scale")
    x, y = gpuarray.to_gpu(np.ones(1024, np.float32)), gpuarray.empty(1024, np.float32)
    with pytest.raises(LaunchError, match="invalid memory access .*past the end of allocation"):
        f(y, x, np.int64(1024 + 4096), np.float32(1.0), block=(256, 1, 1), grid=(20, 1))
    f(y, x, np.int64(1024), np.float32(3.0), block=(256, 1, 1), grid=(4, 1))  # the process goes on
    np.testing.assert_array_equal(y.get(), 3.0)


def test_a_race_shows_as_a_difference_between_orders(build_dir, monkeypatch):
    src = r"""extern "C" __global__ void last_writer(int* out) { out[0] = blockIdx.x * blockDim.x + threadIdx.x; }
    extern "C" __global__ void reduce_no_barrier(const float* x, float* out) {
        __shared__ float s[64];
        s[threadIdx.x] = x[threadIdx.x];
        if (threadIdx.x == 0) { float t = 0; for (int i = 0; i < 64; ++i) t += s[i]; out[0] = t; } }"""
    m = _module(src, build_dir)
    monkeypatch.setenv("EDGEINFER_CUDA_EMULATE_ORDER", "both")
    with pytest.raises(LaunchError, match="race"):
        m.get_function("last_writer")(gpuarray.zeros(1, np.int32), block=(32, 1, 1), grid=(2, 1))
    with pytest.raises(LaunchError, match="race"):  # thread 0 sums before (or after) the others wrote
        m.get_function("reduce_no_barrier")(gpuarray.to_gpu(np.ones(64, np.float32)), gpuarray.zeros(1, np.float32),
                                            block=(64, 1, 1), grid=(1, 1))


def test_the_build_cache_is_keyed_by_the_text(tmp_path):
    a = build.build(ARGS_SOURCE, tmp_path, fast_math=False)
    assert build.build(ARGS_SOURCE, tmp_path, fast_math=False).library == a.library
    assert build.build(ARGS_SOURCE + "\n// changed\n", tmp_path, fast_math=False).library != a.library
    assert build.build(ARGS_SOURCE, tmp_path, fast_math=True).library != a.library


def test_a_source_that_does_not_compile_says_why(build_dir):
    with pytest.raises(CompileError, match="does not compile"):
        _module('extern "C" __global__ void k(float* o) { o[0] = undefined_name; }', build_dir)
    with pytest.raises(driver.LogicError, match="named symbol not found"):
        _module(ARGS_SOURCE, build_dir).get_function("missing")


def test_vram_size_and_out_of_memory(monkeypatch):
    monkeypatch.setenv("EDGEINFER_CUDA_EMULATE_VRAM_MB", "64")
    free, total = driver.mem_get_info()
    assert total == 64 << 20 and free <= total
    with pytest.raises(driver.MemoryError, match="out of memory"):
        gpuarray.empty(65 << 18, np.float32)  # 65 MiB
    before = MEMORY.in_use
    a = gpuarray.empty(1 << 20, np.float32)
    assert MEMORY.in_use == before + (4 << 20)
    del a
    assert MEMORY.in_use == before


def test_bad_settings_are_one_line_errors(monkeypatch):
    from edgeinfer.errors import EdgeInferError
    from edgeinfer.kernels_cuda import runtime
    from edgeinfer.kernels_cuda.emulator import kernel

    monkeypatch.setenv("EDGEINFER_CUDA", "1")
    with pytest.raises(EdgeInferError, match="EDGEINFER_CUDA='1': the only value it takes is 'emulate'"):
        runtime.emulating()
    monkeypatch.setenv("EDGEINFER_CUDA_EMULATE_VRAM_MB", "lots")
    with pytest.raises(EdgeInferError, match="whole number of MiB"):
        driver.mem_get_info()
    monkeypatch.setenv("EDGEINFER_CUDA_EMULATE_ORDER", "sideways")
    with pytest.raises(EdgeInferError, match="forward, reverse, alternate, both"):
        kernel.order()
