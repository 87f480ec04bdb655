"""Cached kernels load without Numba's full registry refresh, and compute the same."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

# rms_norm from a cold cache (compiles), then warm (loads); reports what it computed and
# whether Numba's linalg lowering (imported only by the full refresh) got imported
_CHILD = r"""
import json, sys
import numpy as np
from edgeinfer.kernels_cpu import cache_load, rms_norm
x = np.linspace(-3, 3, 64, dtype=np.float32).reshape(2, 32)
w = np.linspace(0.5, 1.5, 32, dtype=np.float32)
y = rms_norm(x, w, 1e-6)
print(json.dumps({"y": y.ravel().tolist(), "light": cache_load._installed,
                  "refreshed": "numba.np.linalg" in sys.modules}))
"""


def _child(cache: str, **env: str) -> dict:
    full_env = {k: v for k, v in os.environ.items() if k != "EDGEINFER_NUMBA_FULL_REFRESH"}
    full_env.update(NUMBA_CACHE_DIR=cache, **env)
    out = subprocess.run([sys.executable, "-c", _CHILD], env=full_env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_warm_load_skips_the_refresh_and_computes_the_same(tmp_path):
    cold = _child(str(tmp_path))
    assert cold["light"] and cold["refreshed"]          # a cache miss compiles: full refresh
    warm = _child(str(tmp_path))
    assert warm["light"] and not warm["refreshed"]      # loaded from the cache: none
    assert warm["y"] == cold["y"]
    x = np.linspace(-3, 3, 64, dtype=np.float32).reshape(2, 32)
    w = np.linspace(0.5, 1.5, 32, dtype=np.float32)
    ref = x / np.sqrt((x.astype(np.float64) ** 2).mean(axis=1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(np.array(warm["y"]).reshape(2, 32), ref, rtol=1e-5)


def test_switch_turns_the_light_loader_off(tmp_path):
    _child(str(tmp_path))
    full = _child(str(tmp_path), EDGEINFER_NUMBA_FULL_REFRESH="1")
    assert not full["light"] and full["refreshed"]
