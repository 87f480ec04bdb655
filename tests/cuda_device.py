"""Where the GPU tests run: on the GPU that pycuda finds, else on the CUDA emulator
(edgeinfer.kernels_cuda.emulator, which needs only a C++ compiler), so that they run in every CI.

`EDGEINFER_TEST_CUDA=emulate` picks the emulator even where a GPU is.
- `require()` at a module's top skips it, with the reason, only where neither can run;
- `device(order)` (a context) puts the emulator in pycuda's place while it is open;
- `emulated(monkeypatch)` does the same for one test and counts the launchers' calls (the
  `cuda_emulator` fixture of conftest.py, which also undoes it);
- `gpuarray` is `pycuda.gpuarray` looked up at each use: the stand-in while emulating.
"""

from __future__ import annotations

import functools
import importlib
import os
import shutil
from contextlib import contextmanager
from typing import Iterator

import pytest

from edgeinfer.kernels_cuda import launch, runtime

_ENV = ("EDGEINFER_CUDA", "EDGEINFER_CUDA_EMULATE_ORDER", "EDGEINFER_CUDA_EMULATE_VRAM_MB")
# launchers whose calls emulated() counts, plus "kv_store_tokens" (tokens kv_store or rope_qk_store wrote)
COUNTED = ("linear", "linear_many", "linear_glu", "rope_qk", "rope_qk_store", "rms_norm", "rope", "silu_mul", "gelu_mul", "add",
           "add_rows", "kv_store", "attention",
           "copy_rows", "expert_linear", "add_id", "moe_combine", "swiglu_oai", "gelu", "mul", "mul_rows", "scale",
           "scale_rows")


def _choose() -> tuple[str | None, str]:
    if os.environ.get("EDGEINFER_TEST_CUDA") != "emulate" and not runtime.emulating():
        ok, name = runtime.cuda_available()
        runtime.reset()
        if ok:
            return "gpu", name
    if shutil.which(os.environ.get("CXX") or "g++"):
        return "emulator", "the CUDA emulator"
    return None, "no GPU, and no C++ compiler (g++) for the CUDA emulator"


KIND, REASON = _choose()


def require() -> None:
    if KIND is None:
        pytest.skip(REASON, allow_module_level=True)


@contextmanager
def device(order: str = "both", vram_mb: int | None = None) -> Iterator[None]:
    """The GPU, or the emulator running each launch in the given block/thread order."""
    if KIND != "emulator":
        yield
        return
    saved = {k: os.environ.get(k) for k in _ENV}
    os.environ["EDGEINFER_CUDA"] = "emulate"
    os.environ["EDGEINFER_CUDA_EMULATE_ORDER"] = order
    if vram_mb is not None:
        os.environ["EDGEINFER_CUDA_EMULATE_VRAM_MB"] = str(vram_mb)
    runtime.reset()
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        runtime.reset()


def emulated(monkeypatch, order: str = "alternate") -> dict[str, int]:
    """The emulated device for one test (whatever hardware there is); returns the launchers' call counts."""
    if KIND is None:
        pytest.skip(REASON)
    monkeypatch.setenv("EDGEINFER_CUDA", "emulate")
    monkeypatch.setenv("EDGEINFER_CUDA_EMULATE_ORDER", order)
    monkeypatch.delenv("EDGEINFER_CUDA_EMULATE_VRAM_MB", raising=False)
    runtime.reset()
    calls: dict[str, int] = {}
    for name in COUNTED:
        monkeypatch.setattr(launch, name, _counted(getattr(launch, name), calls))
    return calls


def _counted(fn, calls: dict[str, int]):
    @functools.wraps(fn)
    def wrapper(*args, **kw):
        calls[fn.__name__] = calls.get(fn.__name__, 0) + 1
        if fn.__name__ in ("kv_store", "rope_qk_store"):  # the K/V store, alone or with RoPE
            calls["kv_store_tokens"] = calls.get("kv_store_tokens", 0) + args[5 if fn.__name__ == "kv_store" else 7].size
        return fn(*args, **kw)

    return wrapper


class _LazyModule:
    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str):
        return getattr(importlib.import_module(self._name), attr)


gpuarray = _LazyModule("pycuda.gpuarray")


def kv_stores(calls: dict[str, int]) -> int:
    """Launches that wrote new K/V rows into VRAM: kv_store, or rope_qk_store (RoPE and the store in one)."""
    return calls.get("kv_store", 0) + calls.get("rope_qk_store", 0)
