"""Where a model's mmproj file is: an `mmproj-*.gguf` beside the model file, as llama.cpp's -hf finds it."""

from __future__ import annotations

from pathlib import Path

from edgeinfer.errors import EdgeInferError

MAX_CANDIDATES = 64  # a store folder with more mmproj files than this is not one model's


def mmproj_beside(model_path: str | Path) -> Path | None:
    """The mmproj file in the model file's folder, or None. Several: the F16 one (llama.cpp's
    -hf prefers it), else the first by name."""
    model = Path(model_path)
    try:
        found = sorted(p for p in model.parent.glob("mmproj*.gguf") if p.is_file() and p != model)
    except OSError:
        return None
    if not found:
        return None
    if len(found) > MAX_CANDIDATES:
        raise EdgeInferError(f"{model.parent}: {len(found)} mmproj files beside the model; pick one with --mmproj")
    f16 = [p for p in found if "f16" in p.name.lower()]
    return (f16 or found)[0]
