"""Load cached kernels without Numba's full context refresh: a quarter second off every warm start.

Numba's `Cache.load_overload` refreshes the whole CPU target context before it unpickles a
cached kernel. That refresh imports and registers the typing and lowering of all of Numba's
built-ins (linalg, random, typed containers, datetime...) — about 0.25 s of Python on these
machines, a sixth of a warm `edgeinfer run`. A kernel loaded from the cache is machine code
plus its wrapper; running it needs Numba's runtime (NRT, which kernels allocating arrays
use), not the compiler's registries. So the load here initializes only the runtime. A cache
miss still compiles through Numba's normal path, which does its own full refresh first.

`install()` patches only a Numba whose `Cache` has the methods this relies on; any other
version keeps its own loader. EDGEINFER_NUMBA_FULL_REFRESH=1 turns it off.
"""
from __future__ import annotations

import os

_installed = False


def _light_load_overload(self, sig, target_context):
    """Numba's Cache.load_overload minus the context refresh: the runtime is all a load needs."""
    from numba.core.runtime import rtsys

    rtsys.initialize(target_context)   # idempotent; what the refresh would have done first
    with self._guard_against_spurious_io_errors():
        return self._load_overload(sig, target_context)


def install() -> bool:
    """Use the light loader for this process; True when it is in place."""
    global _installed
    if _installed:
        return True
    if os.environ.get("EDGEINFER_NUMBA_FULL_REFRESH", "").strip() not in ("", "0"):
        return False
    try:
        from numba.core import caching
        from numba.core.runtime import rtsys
    except ImportError:
        return False
    cache = getattr(caching, "Cache", None)
    needed = ("load_overload", "_load_overload", "_guard_against_spurious_io_errors")
    if cache is None or not all(hasattr(cache, n) for n in needed) or not hasattr(rtsys, "initialize"):
        return False
    cache.load_overload = _light_load_overload
    _installed = True
    return True
