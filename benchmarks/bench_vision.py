"""Seconds to encode one image: edgeinfer's projector against libmtmd, same file, same pixels, one run.

    python benchmarks/bench_vision.py [-r 3] [-t 2] [--size 896] [--type F16] [--keep /tmp/g3-4b-mmproj.gguf]

The mmproj is Gemma-3-4B-shaped (SigLIP-So400m: 27 layers, width 1152, 16 heads, FFN 4304,
14-pixel patches, 896-pixel input, 4x4 pooling, projection to 2560), random weights written
by tests/mmproj_factory.py, F16 (~0.8 GB) or --type Q8_0 (as llama.cpp's converter: the
matrices whose width is not a multiple of 32 stay F16); --keep reuses the file. libmtmd needs a text model of the
same width beside it: a one-layer gemma3 of width 2560. Both encode the same decoded RGB image;
the engines alternate per repetition and the medians are compared. libmtmd runs with its
defaults (flash attention as it picks it), as its users get it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

GEMMA3_4B_VISION = dict(image_size=896, patch_size=14, n_embd=1152, n_head=16, n_ff=4304, n_layer=27, merge=4)
TEXT_WIDTH = 2560


def _files(keep: str | None, tmp: Path, qtype: str) -> tuple[Path, Path]:
    from gguf_factory import TinyShape, write_tiny_model
    from mmproj_factory import VisionShape, write_gemma3_mmproj

    text = write_tiny_model(tmp / "text.gguf", "gemma3", "F16",
                            shape=TinyShape(n_embd=TEXT_WIDTH, n_layer=1, n_head=8, n_head_kv=4, head_dim=256,
                                            n_ff=256))
    mmproj = Path(keep) if keep else tmp / "mmproj.gguf"
    if not mmproj.exists():
        write_gemma3_mmproj(mmproj, TEXT_WIDTH, qtype, shape=VisionShape(**GEMMA3_4B_VISION))
    return text, mmproj


def _picture(size: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:size, 0:size]
    base = np.stack([x * 255 // (size - 1), y * 255 // (size - 1), (x + y) % 256], -1)
    return np.clip(base + rng.integers(-40, 40, base.shape), 0, 255).astype(np.uint8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-r", "--repetitions", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--size", type=int, default=896, help="the image's side in pixels")
    ap.add_argument("--keep", help="write the mmproj here once and reuse it")
    ap.add_argument("--type", default="F16", choices=("F16", "Q8_0"), help="the mmproj's matrices")
    args = ap.parse_args()

    from edgeinfer.kernels_cpu import set_threads
    from edgeinfer.vision.image_io import from_pixels
    from edgeinfer.vision.mmproj import load_mmproj
    from mtmd_oracle import Mtmd

    set_threads(args.threads)   # (the encoder keeps numpy's BLAS to one thread itself)
    with tempfile.TemporaryDirectory() as tmp:
        text, mmproj = _files(args.keep, Path(tmp), args.type)
        pixels = _picture(args.size)
        ours = load_mmproj(mmproj)
        theirs = Mtmd(text, mmproj, n_threads=args.threads, flash_attn=None)
        engines = {"edgeinfer": lambda: ours.encode(from_pixels(pixels)).embeddings,
                   "llama.cpp": lambda: theirs.encode(pixels)}
        times: dict[str, list[float]] = {name: [] for name in engines}
        outs = {}
        for rep in range(args.repetitions + 1):   # the first round warms up, untimed
            for name, run in engines.items():
                t0 = time.perf_counter()
                outs[name] = run()
                if rep:
                    times[name].append(time.perf_counter() - t0)
        theirs.close()
    err = float(np.abs(outs["edgeinfer"] - outs["llama.cpp"]).max() / np.abs(outs["llama.cpp"]).max())
    print(f"{args.size}x{args.size} image, {outs['edgeinfer'].shape[0]} tokens, threads {args.threads}, "
          f"median of {args.repetitions} (relative max difference {err:.2g})")
    for name, ts in times.items():
        print(f"  {name:10s} {statistics.median(ts):7.2f} s  (min {min(ts):.2f}, max {max(ts):.2f})")
    ratio = statistics.median(times["llama.cpp"]) / statistics.median(times["edgeinfer"])
    print(f"  speed ratio (llama.cpp time / edgeinfer time): {ratio:.2f}x")


if __name__ == "__main__":
    main()
