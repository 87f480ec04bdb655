"""The CUDA emulator: edgeinfer's .cu sources built with g++ and run on the CPU, behind a
`pycuda` stand-in, so the GPU half runs (and is tested) where no GPU is.

- `include/cuda_emu.h` is what the sources need from CUDA (fibers for threads, barriers and
  warp operations that check every thread reaches them, __half, WMMA, device math);
- `build` compiles a source with it and finds its kernels; `kernel` launches one, checking
  its arguments and launch against the kernel and the device; `memory` is the device memory;
- `standin` is the PyCUDA subset edgeinfer uses (driver, gpuarray, compiler, tools).

`EDGEINFER_CUDA=emulate` makes edgeinfer.kernels_cuda.runtime install it, for any command:
`EDGEINFER_CUDA=emulate edgeinfer run gemma3-270m -ngl 99`. Knobs:
`EDGEINFER_CUDA_EMULATE_VRAM_MB` (the device's size, 8192 by default) and
`EDGEINFER_CUDA_EMULATE_ORDER` (forward, reverse, alternate, both; see `kernel`).

What it cannot see: timing, the real SASS (register spills, occupancy), races between blocks
through global memory (blocks run one after another), driver errors, and a real device's
out-of-memory behaviour.
"""

from __future__ import annotations

import sys

_NAMES = ("pycuda", "pycuda.driver", "pycuda.gpuarray", "pycuda.compiler", "pycuda.tools")
_saved: dict[str, object] | None = None


def install() -> None:
    """Make `import pycuda...` give the stand-in (what real pycuda modules were loaded is kept)."""
    global _saved
    from edgeinfer.kernels_cuda.emulator import standin

    if _saved is None:
        _saved = {name: sys.modules[name] for name in _NAMES if name in sys.modules}
    sys.modules["pycuda"] = standin
    for sub in ("driver", "gpuarray", "compiler", "tools"):
        sys.modules[f"pycuda.{sub}"] = getattr(standin, sub)


def uninstall() -> None:
    """Undo install(): `pycuda` is again what it was before."""
    global _saved
    if _saved is None:
        return
    for name in _NAMES:
        sys.modules.pop(name, None)
    sys.modules.update(_saved)
    _saved = None


def installed() -> bool:
    return _saved is not None
