"""The VRAM an mmproj's encoder takes when it runs beside GPU text layers (gpu_encoder.GpuOps).

The offload plan is made before the mmproj loads; without this figure it would give every
byte it may use to text layers, and the encoder's upload would then run out of memory. Counted: every tensor of the file as stored (float matrices whose rows are
no multiple of 32 are padded by at most 31 columns: counted as a 5% margin) and the
activations of the largest image the projector takes (as libmtmd reserves its compute buffer
for it at load): its patch rows times the buffers alive at once in one block (residual,
normed input, Q, K, V, attention out, FFN up and gate), plus attention's F16 K and V.
"""
from __future__ import annotations

import importlib
import os

from edgeinfer.errors import EdgeInferError
from edgeinfer.gguf_file import GGUFFile

# float32 rows alive at once in one block: FFN up and gate; residual, normed input, Q, K, V and
# the attention's output
LIVE_FF_ROWS, LIVE_EMBD_ROWS = 2, 6
PAD_MARGIN = 0.05      # row padding of float matrices (<= 31 columns a row)


def encoder_vram_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes to keep free in VRAM for the encoder of the mmproj at `path`; 0 for a file that
    does not open as an mmproj (its load reports the problem in its own line)."""
    from edgeinfer.vision.mmproj import PROJECTORS, MmprojFile, projector_type_of

    try:
        gf = GGUFFile.open(path)
        mm = MmprojFile(gf, projector_type_of(gf))
    except (EdgeInferError, OSError, ValueError):
        return 0
    module = PROJECTORS.get(mm.projector_type)
    if module is None:
        return 0
    weights = sum(int(info.n_bytes) for info in gf.tensors.values())
    vp = mm.vision
    # the projector's module knows its largest image (a fixed square, or a token ceiling)
    patches = importlib.import_module(f"edgeinfer.vision.{module}").max_patches(mm)
    width = vp.n_head * vp.head_dim
    row_values = LIVE_FF_ROWS * vp.n_ff + LIVE_EMBD_ROWS * max(vp.n_embd, width)
    activations = patches * row_values * 4 + 2 * patches * width * 2
    return int(weights * (1.0 + PAD_MARGIN)) + activations

