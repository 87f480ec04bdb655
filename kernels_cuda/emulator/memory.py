"""The emulated device's memory: each allocation its own mapping between guard pages.

- New memory is NaN (every byte 0xFF: NaN as f32 and as f16, -1 as an integer), so a kernel
  that reads what nobody wrote shows it.
- An allocation ends against a guard page (its start is rounded to 16 bytes), so a kernel
  that reads or writes past its end faults, and the launch reports the address; a freed
  allocation is unmapped, so a use after free faults too.
- `find(address)` says which live allocation holds an address: kernel pointer arguments and
  copies are checked against it.
- The device's size is `EDGEINFER_CUDA_EMULATE_VRAM_MB` (8192 by default); an allocation
  past it fails as cuMemAlloc does.
- A freed mapping is kept (up to 256 MiB of them) for the next allocation of the same size,
  refilled with NaN: fresh pages cost the kernel more than the kernels here cost. A use after
  free then reads NaN instead of faulting.
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import os
import threading
from dataclasses import dataclass

from edgeinfer.errors import EdgeInferError

PAGE = mmap.PAGESIZE
ALIGN = 16
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_PROT_NONE, _PROT_RW = 0, 3
_MAP_PRIVATE_ANON = 0x02 | 0x20
_MAP_FAILED = ctypes.c_void_p(-1).value
_KEEP_FREED = 256 << 20  # bytes of freed mappings kept for reuse


class OutOfMemory(MemoryError):
    """More than the emulated VRAM was asked for."""


def vram_bytes() -> int:
    raw = os.environ.get("EDGEINFER_CUDA_EMULATE_VRAM_MB", "8192")
    try:
        mb = int(raw)
    except ValueError:
        raise EdgeInferError(f"EDGEINFER_CUDA_EMULATE_VRAM_MB={raw!r}: expected a whole number of MiB") from None
    if not 0 <= mb <= 1 << 24:
        raise EdgeInferError(f"EDGEINFER_CUDA_EMULATE_VRAM_MB={mb}: expected 0 to {1 << 24}")
    return mb << 20


@dataclass
class Allocation:
    address: int  # first byte handed out
    size: int  # bytes asked for
    number: int  # 1, 2, ... in allocation order, for messages
    _map: int  # the mapping: guard page, data pages, guard page
    _map_size: int

    @property
    def end(self) -> int:
        return self.address + self.size


class DeviceMemory:
    """Every live allocation of the emulated device, by address."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._starts: list[int] = []
        self._allocs: dict[int, Allocation] = {}
        self._count = 0
        self.in_use = 0
        self._freed: dict[int, list[tuple[int, int]]] = {}  # span -> [(mapping, map size)]
        self._freed_bytes = 0

    def alloc(self, size: int) -> Allocation:
        if size < 0:
            raise ValueError(f"cannot allocate {size} bytes")
        total = vram_bytes()
        if self.in_use + size > total:
            raise OutOfMemory(f"cuMemAlloc failed: out of memory ({size} bytes asked, "
                              f"{total - self.in_use} of {total} free on the emulated device)")
        span = max(ALIGN, -(-size // ALIGN) * ALIGN)
        data_pages = -(-span // PAGE) * PAGE
        with self._lock:
            kept = self._freed.get(span)
            base, map_size = kept.pop() if kept else (None, data_pages + 2 * PAGE)
            if base is not None:
                self._freed_bytes -= map_size
        if base is None:
            base = _libc.mmap(None, map_size, _PROT_RW, _MAP_PRIVATE_ANON, -1, 0)
            if base in (None, _MAP_FAILED):
                raise OutOfMemory(f"cuMemAlloc failed: the host could not map {map_size} bytes")
            _libc.mprotect(base, PAGE, _PROT_NONE)
            _libc.mprotect(base + PAGE + data_pages, PAGE, _PROT_NONE)
        address = base + PAGE + data_pages - span
        ctypes.memset(address, 0xFF, span)
        with self._lock:
            self._count += 1
            a = Allocation(address, size, self._count, base, map_size)
            bisect.insort(self._starts, address)
            self._allocs[address] = a
            self.in_use += size
        return a

    def free(self, a: Allocation) -> None:
        with self._lock:
            if self._allocs.pop(a.address, None) is None:
                return  # freed already
            self._starts.remove(a.address)
            self.in_use -= a.size
            if self._freed_bytes + a._map_size <= _KEEP_FREED:
                span = a._map_size - 2 * PAGE - (a.address - a._map - PAGE)
                self._freed.setdefault(span, []).append((a._map, a._map_size))
                self._freed_bytes += a._map_size
                return
        _libc.munmap(a._map, a._map_size)

    def find(self, address: int) -> Allocation | None:
        """The live allocation holding `address` (its end counts: an empty range there is fine)."""
        with self._lock:
            i = bisect.bisect_right(self._starts, address) - 1
            if i < 0:
                return None
            a = self._allocs[self._starts[i]]
        return a if address <= a.end else None

    def check_range(self, address: int, nbytes: int, what: str) -> Allocation:
        """The allocation that holds [address, address + nbytes), or ValueError naming `what`."""
        a = self.find(address)
        if a is None:
            raise ValueError(f"{what}: address {address:#x} is in no live allocation of the emulated device")
        if address + nbytes > a.end:
            raise ValueError(f"{what}: {nbytes} bytes at offset {address - a.address} run past the end of "
                             f"allocation #{a.number} ({a.size} bytes)")
        return a

    def describe(self, address: int) -> str:
        """Where an address lies, for a fault message."""
        with self._lock:
            near = min(self._allocs.values(), key=lambda a: min(abs(address - a.address), abs(address - a.end)),
                       default=None)
        if near is None:
            return "no allocation is live"
        if near.address <= address < near.end:
            return f"inside allocation #{near.number} ({near.size} bytes)"
        if address >= near.end:
            return f"{address - near.end} bytes past the end of allocation #{near.number} ({near.size} bytes)"
        return f"{near.address - address} bytes before allocation #{near.number} ({near.size} bytes)"

    def live(self) -> list[Allocation]:
        with self._lock:
            return list(self._allocs.values())


MEMORY = DeviceMemory()
