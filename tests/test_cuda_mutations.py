"""Mutating a CUDA source makes its tests fail: the GPU tests (on the emulator where no GPU is)
see a deleted barrier, an unrescaled flash-attention output, a warp reduction that starts at 8 lanes instead of 16, and swapped
block indices. Each mutant is built from the real source with one edit and swapped in for the
launchers; the unmodified tests of tests/test_cuda_kernels.py then run against it.
"""

from __future__ import annotations

import cuda_device
import pytest

from edgeinfer.kernels_cuda import launch, runtime
from edgeinfer.kernels_cuda.generated import source_text
from edgeinfer.kernels_cuda.emulator.kernel import LaunchError

cuda_device.require()


def _mutant(monkeypatch, source: str, old: str, new: str, count: int = 1) -> None:
    """launch's kernels of `source` come from its text with `old` replaced by `new` (`count` times)."""
    from pycuda.compiler import SourceModule

    text = source_text(source)
    assert text.count(old) >= count, f"{source} no longer holds {old!r}: update the mutation"
    mutated = SourceModule(text.replace(old, new, count), no_extern_c=True,
                           options=runtime.nvcc_options(runtime.arch_name((8, 6))),
                           cache_dir=str(runtime.cache_dir("mutants")))
    real = launch.kernel
    monkeypatch.setattr(launch, "kernel", lambda src, name: mutated.get_function(name) if src == source
                        else real(src, name))


@pytest.fixture(autouse=True)
def _device():
    with cuda_device.device(order="both"):
        runtime.context()
        yield


def test_the_unmutated_sources_pass():
    import test_cuda_kernels as k

    k.test_paged_attention(20, 64, 0, False)
    k.test_linear(launch.Q.Q8_0, 1)


def test_an_unrescaled_output_in_the_tensor_core_flash_attention_fails(monkeypatch):
    import test_cuda_kernels as k

    # O kept as it was when a later key tile raises a row's maximum
    _mutant(monkeypatch, "attention.cu", "os[warp][row * HD + d] *= corr;", "os[warp][row * HD + d] *= 1.0f;")
    with pytest.raises(AssertionError):
        k.test_paged_attention(20, 64, 0, False)


def test_a_deleted_barrier_in_flash_attention_fails(monkeypatch):
    """(The f32 kernel of devices without tensor cores. In the tensor-core kernel the barrier
    between staging a tile and the WMMA that reads it is out of the emulator's sight: a warp
    waiting at a warp-wide WMMA lets the block's other warps run, and they finish staging.)"""
    import test_cuda_kernels as k

    monkeypatch.setattr(launch, "tensor_cores", lambda: False)
    _mutant(monkeypatch, "attention.cu", "        __syncthreads();\n        if (!active) continue;",
            "        if (!active) continue;")
    with pytest.raises((AssertionError, LaunchError)):
        k.test_paged_attention(20, 64, 0, False)


def test_a_warp_reduction_from_8_lanes_fails(monkeypatch):
    import test_cuda_kernels as k

    _mutant(monkeypatch, "quant.cu", "for (int off = 16; off > 0; off >>= 1)", "for (int off = 8; off > 0; off >>= 1)")
    with pytest.raises(AssertionError):
        k.test_linear(launch.Q.Q8_0, 1)


def test_swapped_block_indices_fail(monkeypatch):
    import test_cuda_kernels as k

    _mutant(monkeypatch, "attention.cu", "const int t = blockIdx.x, h = blockIdx.y;",
            "const int t = blockIdx.y, h = blockIdx.x;")
    with pytest.raises((AssertionError, LaunchError, ValueError)):
        k.test_paged_attention(3, 64, 16, False)
