"""Numba's on-disk cache keyed to the kernel sources: one folder per hash of kernels_cpu/*.py.

`cache=True` checks only the cached function's own file, so a kernel built from IR helpers
in another file (ir_helpers.py, dot_q32.py and dot_kquant.py under tile_gemm, dispatch, fused_layer) would
load stale code after the helper changed. The kernels' cache therefore lives in a folder
named by a hash of every source file here and the Numba and llvmlite versions:
`<base>/kernels-<hash>`, where base is $NUMBA_CACHE_DIR when set, else the user cache
directory ($XDG_CACHE_HOME or ~/.cache)/edgeinfer/numba. Any change of a source gives a new,
empty folder; folders of older sources are pruned (the few most recently used stay, for
other installs sharing the base). A $NUMBA_CACHE_DIR that already is such a folder (a
child process started by one) is used as it is.
"""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

PREFIX = "kernels-"
KEEP = 3          # folders of other sources kept (most recently used first)
_HERE = Path(__file__).resolve().parent


def source_key(folder: Path = _HERE, versions: tuple[str, ...] | None = None) -> str:
    """A hash of the .py files in `folder` (names and contents) and the Numba and llvmlite
    versions."""
    if versions is None:
        import llvmlite
        import numba

        versions = (numba.__version__, llvmlite.__version__)
    h = hashlib.sha256("\0".join(versions).encode())
    for path in sorted(Path(folder).glob("*.py")):
        h.update(b"\0" + path.name.encode() + b"\0")
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def cache_dir(key: str, env=None) -> Path:
    """The folder for sources with this key (see the module docstring)."""
    env = os.environ if env is None else env
    explicit = env.get("NUMBA_CACHE_DIR")
    if explicit:
        base = Path(explicit)
        if base.name == PREFIX + key:
            return base
    else:
        base = Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "edgeinfer" / "numba"
    return base / (PREFIX + key)


def prune(current: Path, keep: int = KEEP) -> None:
    """Remove the kernel cache folders beside `current` but the `keep` most recently used."""
    try:
        others = [p for p in current.parent.iterdir()
                  if p.name.startswith(PREFIX) and p != current and p.is_dir()]
    except OSError:
        return
    others.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    for old in others[keep:]:
        shutil.rmtree(old, ignore_errors=True)


def configure() -> str:
    """Point Numba's cache at this sources' folder (before any kernel is defined); returns it."""
    from numba.core import config

    path = cache_dir(source_key())
    try:
        fresh = not path.exists()
        path.mkdir(parents=True, exist_ok=True)
        os.utime(path)   # most recently used: pruning keeps it
    except OSError:
        return config.CACHE_DIR   # unwritable: Numba's own choice stands
    if fresh:
        prune(path)
    config.CACHE_DIR = str(path)
    return config.CACHE_DIR
