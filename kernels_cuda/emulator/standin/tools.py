"""pycuda.tools on the emulator: the memory pool hands out plain allocations."""

from __future__ import annotations

from edgeinfer.kernels_cuda.emulator.standin import driver


class DeviceMemoryPool:
    """Every allocate() is a fresh allocation (a pool would hide use-after-free from the guards)."""

    def __init__(self) -> None:
        self.held_blocks = 0
        self.active_blocks = 0

    def allocate(self, nbytes: int) -> driver.DeviceAllocation:
        return driver.mem_alloc(nbytes)

    def free_held(self) -> None:
        pass

    def stop_holding(self) -> None:
        pass
