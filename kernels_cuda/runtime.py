"""The CUDA runtime seen from Python: is there a usable GPU, which one, and the compiled kernels.

pycuda is imported lazily, only here, so `import edgeinfer.kernels_cuda` works on machines
without pycuda, a driver or a GPU; `cuda_available()` says which of those is missing in
one line, and callers fall back to the CPU.

`EDGEINFER_CUDA=emulate` puts the CUDA emulator (edgeinfer.kernels_cuda.emulator) in pycuda's
place: the same kernels, launchers and backends then run on the CPU. `reset()` forgets the
probe and the compiled modules, for a process that switches between the two.
"""

from __future__ import annotations

import atexit
import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KERNEL_DIR = Path(__file__).resolve().parent
SOURCES = ("quant.cu", "attention.cu", "elementwise.cu", "recurrent.cu", "kv_quant.cu")
_CPU = "; running on the CPU"


def emulating() -> bool:
    """Whether EDGEINFER_CUDA asks for the emulator."""
    value = os.environ.get("EDGEINFER_CUDA", "").strip().lower()
    if value not in ("", "emulate"):
        from edgeinfer.errors import EdgeInferError

        raise EdgeInferError(f"EDGEINFER_CUDA={value!r}: the only value it takes is 'emulate' (unset it for a GPU)")
    return value == "emulate"


@functools.lru_cache(maxsize=1)
def cuda_available() -> tuple[bool, str]:
    """(True, device name) when pycuda, the driver and a device are all there, else (False, reason)."""
    from edgeinfer.kernels_cuda import emulator

    if emulating():
        emulator.install()
    elif emulator.installed():
        emulator.uninstall()
    try:
        import pycuda.driver as cuda
    except ModuleNotFoundError:
        return False, f"CUDA unavailable: pycuda is not installed (pip install 'edgeinfer[cuda]'){_CPU}"
    except ImportError as exc:  # pycuda present, libcuda.so missing
        return False, f"CUDA unavailable: no NVIDIA driver ({_first_line(exc)}){_CPU}"
    try:
        cuda.init()
        count = cuda.Device.count()
    except Exception as exc:  # noqa: BLE001 - any driver failure means "no GPU", with its text
        return False, f"CUDA unavailable: the NVIDIA driver failed to start ({_first_line(exc)}){_CPU}"
    if count == 0:
        return False, f"CUDA unavailable: no CUDA device found{_CPU}"
    return True, cuda.Device(0).name()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


@functools.lru_cache(maxsize=1)
def context() -> Any:
    """The primary context of device 0, made current once for this process."""
    ok, reason = cuda_available()
    if not ok:
        raise RuntimeError(reason)
    import pycuda.driver as cuda

    ctx = cuda.Device(0).retain_primary_context()
    ctx.push()
    atexit.register(ctx.pop)
    return ctx


@dataclass(frozen=True)
class DeviceInfo:
    """One GPU as the offload planner sees it. compute_capability is (major, minor), e.g. (8, 6)."""

    name: str
    total_vram: int
    free_vram: int
    compute_capability: tuple[int, int]


def device_info() -> DeviceInfo:
    """DeviceInfo of device 0 with its current free VRAM (after our context exists)."""
    import pycuda.driver as cuda

    context()
    dev = cuda.Device(0)
    free, total = cuda.mem_get_info()
    return DeviceInfo(dev.name(), int(total), int(free), tuple(dev.compute_capability()))


@functools.lru_cache(maxsize=1)
def compute_capability() -> tuple[int, int]:
    """(major, minor) of device 0: what a launcher picks kernels by."""
    import pycuda.driver as cuda

    context()
    return tuple(cuda.Device(0).compute_capability())


def arch_name(cc: tuple[int, int]) -> str:
    return f"sm_{cc[0]}{cc[1]}"


def cache_dir(arch: str) -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    path = root / "edgeinfer" / "cuda" / arch
    path.mkdir(parents=True, exist_ok=True)
    return path


def nvcc_options(arch: str) -> list[str]:
    """Flags shared by the runtime compile and the nvcc check in CI."""
    return ["-O3", "--use_fast_math", "-std=c++17"] if arch else []


@functools.lru_cache(maxsize=None)
def module(source: str) -> Any:
    """The compiled SourceModule of kernels_cuda/<source>, cached on disk per GPU architecture.

    PyCUDA keys its cache on the source text, the options and nvcc's version, so a changed
    .cu or a new toolkit recompiles; otherwise the cubin is loaded from cache_dir. The text is
    generated.source_text's: the file with its generated headers (the i-quant tables) in place.
    """
    from pycuda.compiler import SourceModule

    from edgeinfer.kernels_cuda.generated import source_text

    arch = arch_name(compute_capability())  # (the context made current first)
    text = source_text(source)
    return SourceModule(text, arch=arch, no_extern_c=True, options=nvcc_options(arch),
                        cache_dir=str(cache_dir(arch)))


@functools.lru_cache(maxsize=None)
def kernel(source: str, name: str) -> Any:
    return module(source).get_function(name)


@functools.lru_cache(maxsize=1)
def allocator() -> Any:
    """A memory pool for activations: per-op cuMemAlloc/cuMemFree would dominate a decode step."""
    context()
    from pycuda.tools import DeviceMemoryPool

    return DeviceMemoryPool().allocate


def reset() -> None:
    """Forget the device probe, the context and every compiled module (the next call probes
    again, so a change of EDGEINFER_CUDA takes effect); out of emulation, `pycuda` is pycuda again."""
    from edgeinfer.kernels_cuda import emulator

    for cached in (cuda_available, context, module, kernel, allocator, compute_capability):
        cached.cache_clear()
    if emulator.installed() and not emulating():
        emulator.uninstall()
