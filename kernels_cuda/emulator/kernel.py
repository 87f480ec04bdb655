"""A kernel of the emulator, called as PyCUDA calls one: `f(*args, block=, grid=)`.

Before it runs, the call is checked as a GPU would refuse it or a kernel would misread it:
- each argument against the kernel's C++ parameter: a numpy scalar of the parameter's kind
  and width (`np.int32` for `int`, `np.int64` for `long long`, `np.float32` for `float`),
  and a pointer that is NULL or lies inside a live allocation, aligned for its element;
- the launch against the device's limits (1024 threads a block, grid y and z under 65536)
  and the kernel's `__launch_bounds__`;
- its static shared memory against the 48 KiB a block may have.

`EDGEINFER_CUDA_EMULATE_ORDER` picks the order blocks and threads run in: `forward`,
`reverse`, `alternate` (launch by launch) or `both`: run forward, then again in reverse from
the same memory, and fail when the two leave different bytes (a race).
"""

from __future__ import annotations

import ctypes
import os
from collections import Counter
from itertools import count

import numpy as np

from edgeinfer.errors import EdgeInferError
from edgeinfer.kernels_cuda.emulator.build import Built, Kernel
from edgeinfer.kernels_cuda.emulator.memory import MEMORY

MAX_THREADS = 1024
MAX_BLOCK = (1024, 1024, 64)
MAX_GRID = ((1 << 31) - 1, 65535, 65535)
MAX_STATIC_SHARED = 48 * 1024
ORDERS = ("forward", "reverse", "alternate", "both")
_KIND_NAMES = {"i": "signed integer", "u": "unsigned integer", "f": "floating-point", "p": "pointer"}
_launches = count()
# Every call the emulated driver got, by kind (launch, graph_launch, htod, dtoh, dtod, memset,
# alloc): what a test counts to say what a decoded token costs the driver (standin.driver).
CALLS: Counter = Counter()
# pycuda's prepared-call codes (struct format) and the numpy scalar each one packs
_PREPARED_TYPES = {"P": np.intp, "i": np.int32, "I": np.uint32, "q": np.int64, "Q": np.uint64, "f": np.float32,
                   "d": np.float64}


class LaunchError(RuntimeError):
    """The kernel faulted, or was launched in a way a GPU refuses."""


class ArgumentError(TypeError):
    """An argument does not match the kernel's parameter."""


def order() -> str:
    value = os.environ.get("EDGEINFER_CUDA_EMULATE_ORDER", "forward").strip().lower()
    if value not in ORDERS:
        raise EdgeInferError(f"EDGEINFER_CUDA_EMULATE_ORDER={value!r}: expected one of {', '.join(ORDERS)}")
    return value


class Library:
    """One built module loaded into this process."""

    def __init__(self, built: Built) -> None:
        self.built = built
        self.dll = ctypes.CDLL(str(built.library))
        first = next(iter(built.kernels.values()))
        entry = ctypes.cast(getattr(self.dll, f"__emu_sig_{first.name}"), ctypes.c_void_p).value
        self.load_base = entry - first.sig_address

    def function(self, name: str) -> "Function":
        return Function(self, self.built.kernels[name])


class Function:
    def __init__(self, library: Library, kernel: Kernel) -> None:
        self.name = kernel.name
        self.kernel = kernel
        self._launch = getattr(library.dll, f"__emu_launch_{kernel.name}")
        self._launch.restype = ctypes.c_int
        sig = getattr(library.dll, f"__emu_sig_{kernel.name}")
        kinds, sizes, pointee = ctypes.create_string_buffer(64), (ctypes.c_int * 64)(), (ctypes.c_int * 64)()
        n = sig(kinds, sizes, pointee, 64)
        self.params = [(kinds.raw[i:i + 1].decode(), sizes[i], pointee[i]) for i in range(n)]
        shared = kernel.shared_vars
        self._shared_at = (ctypes.c_void_p * max(1, len(shared)))(*[library.load_base + a for a, _ in shared])
        self._shared_size = (ctypes.c_longlong * max(1, len(shared)))(*[s for _, s in shared])
        self._n_shared = len(shared)
        self._prepared: list | None = None

    def __call__(self, *args, block=(1, 1, 1), grid=(1, 1), shared: int = 0, stream=None, **unknown) -> None:
        if unknown:
            raise TypeError(f"{self.name}: the emulator does not take {', '.join(sorted(unknown))}")
        if shared:
            raise LaunchError(f"{self.name}: dynamic shared memory ({shared} bytes) is not emulated")
        if stream is not None:
            raise LaunchError(f"{self.name}: streams are not emulated (launches run at once, in order)")
        block3, grid3 = _dims(block, "block", self.name), _dims(grid, "grid", self.name)
        self._check_launch(block3, grid3)
        packed, pointers = self._pack(args)
        mode = order()
        if mode == "both":
            self._run_both(packed, pointers, block3, grid3)
            return
        reverse = mode == "reverse" or (mode == "alternate" and next(_launches) % 2 == 1)
        self._run(packed, block3, grid3, reverse)

    def prepare(self, arg_types: str) -> "Function":
        """pycuda's Function.prepare: the argument types once, as a struct format ("P" a pointer)."""
        unknown = sorted(set(arg_types) - set(_PREPARED_TYPES))
        if unknown:
            raise ArgumentError(f"{self.name}: prepare() with format codes the emulator does not know: {unknown}")
        self._prepared = [_PREPARED_TYPES[c] for c in arg_types]
        return self

    def prepared_call(self, grid, block, *args, shared_size: int = 0) -> None:
        """pycuda's prepared call: plain values packed by the prepared format, then the same checks
        as a call (a pointer must lie in a live allocation, each width must match the kernel's)."""
        CALLS["launch"] += 1
        self._prepared_run(grid, block, args, shared_size)

    def _prepared_run(self, grid, block, args, shared_size: int = 0) -> None:
        if self._prepared is None:
            raise LaunchError(f"{self.name}: prepared_call before prepare")
        if len(args) != len(self._prepared):
            raise ArgumentError(f"{self.name}: prepared for {len(self._prepared)} arguments, got {len(args)}")
        self(*(t(a) for t, a in zip(self._prepared, args)), block=block, grid=grid, shared=shared_size)

    def prepared_async_call(self, grid, block, stream, *args, shared_size: int = 0) -> None:
        """pycuda's async prepared call: at once, or kept for the graph while `stream` captures
        (its arguments checked again when the graph runs, against the memory live then)."""
        if self._prepared is None:
            raise LaunchError(f"{self.name}: prepared_async_call before prepare")
        stream.issue("launch", lambda: self._prepared_run(grid, block, args, shared_size))

    # -- checks ------------------------------------------------------------------------------
    def _check_launch(self, block: tuple[int, int, int], grid: tuple[int, int, int]) -> None:
        threads = block[0] * block[1] * block[2]
        for axis, (b, limit) in enumerate(zip(block, MAX_BLOCK)):
            if not 1 <= b <= limit:
                raise LaunchError(f"{self.name}: block dimension {'xyz'[axis]} = {b} is outside 1..{limit}")
        for axis, (g, limit) in enumerate(zip(grid, MAX_GRID)):
            if not 1 <= g <= limit:
                raise LaunchError(f"{self.name}: grid dimension {'xyz'[axis]} = {g} is outside 1..{limit}")
        if threads > MAX_THREADS:
            raise LaunchError(f"{self.name}: {threads} threads a block, more than the device's {MAX_THREADS}")
        bound = self.kernel.launch_bounds
        if bound is not None and threads > bound:
            raise LaunchError(f"{self.name}: {threads} threads a block, more than its __launch_bounds__({bound})")
        if self.kernel.static_shared > MAX_STATIC_SHARED:
            raise LaunchError(f"{self.name}: {self.kernel.static_shared} bytes of static shared memory, "
                              f"more than the {MAX_STATIC_SHARED} a block may have")

    def _pack(self, args: tuple) -> tuple[list, list[tuple[int, int]]]:
        if len(args) != len(self.params):
            raise ArgumentError(f"{self.name} takes {len(self.params)} arguments ({', '.join(self.kernel.params)}), "
                                f"got {len(args)}")
        packed, pointers = [], []
        for i, (arg, (kind, size, elem)) in enumerate(zip(args, self.params)):
            pname = self.kernel.params[i] if i < len(self.kernel.params) else f"#{i}"
            what = f"{self.name} argument {i} ({pname})"
            if kind == "p":
                address = _address(arg, what)
                if address:
                    a = MEMORY.check_range(address, 0, what)
                    if elem > 1 and address % min(elem, 16):
                        raise ArgumentError(f"{what}: address {address:#x} is not aligned to its "
                                            f"{elem}-byte elements")
                    pointers.append((a.address, a.size))
                packed.append(ctypes.c_void_p(address))
                continue
            if not isinstance(arg, np.generic):
                raise ArgumentError(f"{what}: a {type(arg).__name__} where the kernel takes a {size}-byte "
                                    f"{_KIND_NAMES.get(kind, kind)}; pass a numpy scalar (np.int32, np.int64, "
                                    f"np.float32), as PyCUDA needs")
            dt = np.dtype(type(arg))
            if dt.itemsize != size or (dt.kind == "f") != (kind == "f"):
                raise ArgumentError(f"{what}: the kernel takes a {size}-byte {_KIND_NAMES.get(kind, kind)}, "
                                    f"got {dt.name} ({dt.itemsize} bytes)")
            packed.append(ctypes.create_string_buffer(np.asarray(arg).tobytes(), size))
        return packed, pointers

    # -- running -------------------------------------------------------------------------------
    def _run(self, packed: list, block, grid, reverse: bool) -> None:
        argv = (ctypes.c_void_p * max(1, len(packed)))(*[ctypes.addressof(p) for p in packed])
        err = ctypes.create_string_buffer(1024)
        rc = self._launch(argv, (ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), int(reverse),
                          self._shared_at, self._shared_size, self._n_shared, err, len(err))
        if rc:
            message = err.value.decode(errors="replace")
            if rc == 2 and " at address " in message:
                address = int(message.split(" at address ")[1].split()[0], 16)
                message += f" ({MEMORY.describe(address)})"
            raise LaunchError(message)

    def _run_both(self, packed: list, pointers: list[tuple[int, int]], block, grid) -> None:
        """Forward, then reverse from the same memory; the two must leave the same bytes."""
        regions = sorted(set(pointers))
        before = [ctypes.string_at(a, n) for a, n in regions]
        self._run(packed, block, grid, reverse=False)
        forward = [ctypes.string_at(a, n) for a, n in regions]
        for (a, n), data in zip(regions, before):
            ctypes.memmove(a, data, n)
        self._run(packed, block, grid, reverse=True)
        for (a, n), want in zip(regions, forward):
            got = ctypes.string_at(a, n)
            if got != want:
                at = next(i for i in range(n) if got[i] != want[i])
                raise LaunchError(f"{self.name}: blocks and threads run in reverse order leave other bytes than in "
                                  f"forward order (a race), first at byte {at} of a {n}-byte allocation")


def _dims(value, what: str, name: str) -> tuple[int, int, int]:
    dims = tuple(int(v) for v in value)
    if not 1 <= len(dims) <= 3:
        raise LaunchError(f"{name}: {what} has {len(dims)} dimensions")
    return dims + (1,) * (3 - len(dims))


def _address(arg, what: str) -> int:
    """The device address a pointer argument stands for (GPUArrays and allocations as PyCUDA reads them)."""
    if hasattr(arg, "gpudata"):  # a GPUArray (views too)
        return int(arg.ptr)
    if hasattr(arg, "__int__") and not isinstance(arg, (np.floating, float, bool)):
        if isinstance(arg, np.generic) and np.dtype(type(arg)).itemsize != 8:
            raise ArgumentError(f"{what}: a pointer is 8 bytes, got {np.dtype(type(arg)).name}")
        if type(arg) is int:
            raise ArgumentError(f"{what}: a plain int where the kernel takes a pointer; pass a GPUArray, "
                                f"an allocation or np.intp")
        return int(arg)
    raise ArgumentError(f"{what}: a {type(arg).__name__} where the kernel takes a pointer")


