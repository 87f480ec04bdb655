"""Decode matvec throughput of the CPU kernels against the machine's read bandwidth.

    python benchmarks/bench_kernels.py [--rows 4096 --cols 14336 --repeat 21 --types Q4_K_X8,Q4_K,Q8_0,Q6_K,Q5_0]

Q4_K_X8 is a Q4_K matrix in the layout the CPU backend copies Q4_K into on AVX-512 hosts
(rows interleaved in eights, kernels_cpu/repack.py): what decode reads there.

Read bandwidth = a Numba prange sum over a 512 MiB float32 array (far larger than L3).
matvec GB/s = weight bytes / median time of one call (activation quantization included),
three calls alternating with three read-bandwidth calls, so "% of read" compares two
medians taken in the same minutes (the machine's bandwidth drifts a lot between runs).
Three copies of the weights take turns, as consecutive matrices do in decode, so a matrix
smaller than L3 is still read from memory.
"L2-resident" runs the same kernel on ~384 KiB of rows a thread (they stay in L2): its
compute speed without DRAM, to tell a memory-bound matvec from a compute-bound one.
Also times the plain Numba kernel (the portable reference path), and a prefill matmul
(GFLOP/s) for a batch of tokens. Cells are "median / best": medians, because 2-thread
timings stall sometimes; best, because on a shared machine it shows the uncontended speed.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from quant_blocks import random_blocks  # noqa: E402

import edgeinfer.kernels_cpu as K  # noqa: E402
from edgeinfer.kernels_cpu import dispatch, quant_kernels, repack  # noqa: E402
from edgeinfer.kernels_cpu.quant_types import RepackedType  # noqa: E402
from read_bandwidth import big_array, prange_sum as _prange_sum  # noqa: E402


def _times(fn, repeat):
    """(median, best) seconds of `repeat` calls after one warm-up call."""
    fn()
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)), float(min(ts))


def _paired_times(fn, ref, repeat):
    """(median, best) seconds of fn and of ref, called alternately three at a time,
    `repeat` times each."""
    fn()
    ref()
    ts, rs = [], []
    for _ in range(0, repeat, 3):
        for f, acc in ((fn, ts), (ref, rs)):
            for _ in range(3):
                t0 = time.perf_counter()
                f()
                acc.append(time.perf_counter() - t0)
    return (float(np.median(ts)), float(min(ts))), (float(np.median(rs)), float(min(rs)))


def _cell(work, times, unit_scale=1e-9):
    med, best = times
    return f"{work / med * unit_scale:6.1f} / {work / best * unit_scale:5.1f}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=14336)
    ap.add_argument("--repeat", type=int, default=21)
    ap.add_argument("--types", default="Q4_K_X8,Q4_K,Q8_0,Q6_K,Q5_0")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--no-plain", action="store_true", help="skip the plain-kernel comparison")
    ap.add_argument("--prefill-tokens", type=int, default=64)
    args = ap.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")]
    rng = np.random.default_rng(0)

    big = big_array()
    print(f"the CPU backend {'copies Q4_K to Q4_K_X8' if repack.host_repacks() else 'reads Q4_K as stored'} here")
    print(f"{'(median / best)':<30}" + "".join(f"{f'{t} thread(s)':>18}" for t in threads))
    row = []
    for t in threads:
        K.set_threads(t)
        row.append(_cell(big.nbytes, _times(lambda: _prange_sum(big), max(5, args.repeat // 3))))
    print(f"{'read bandwidth GB/s':<30}" + "".join(f"{v:>18}" for v in row))

    x = rng.standard_normal(args.cols).astype(np.float32)
    X = rng.standard_normal((args.prefill_tokens, args.cols)).astype(np.float32)
    for name in args.types.split(","):
        if name in RepackedType.__members__:   # Q4_K_X8: random Q4_K blocks, interleaved
            qtype = RepackedType[name]
            w = repack.interleave_q4_k(random_blocks(T.Q4_K, args.rows, args.cols, rng))
        else:
            qtype = T[name]
            w = random_blocks(qtype, args.rows, args.cols, rng)
        w.flags.writeable = False
        copies = [w, w.copy(), w.copy()]
        turn = [0]

        def mv():
            turn[0] = (turn[0] + 1) % 3
            K.matvec(copies[turn[0]], qtype, x, out)
        out = np.empty(args.rows, np.float32)
        info = K.quant_info(qtype)
        xq, xd, xs = K.quantize_activations(x, info) if info.act_block else (None, None, None)
        cells, pcts, cached, plain, pre = [], [], [], [], []
        for t in threads:
            K.set_threads(t)
            mv_t, bw_t = _paired_times(mv, lambda: _prange_sum(big), args.repeat)
            cells.append(_cell(w.nbytes, mv_t))
            pcts.append(f"{(w.nbytes / mv_t[0]) / (big.nbytes / bw_t[0]):.0%} of {big.nbytes / bw_t[0] / 1e9:.1f}")
            if dispatch.has_fast_path(int(qtype)):
                # the same kernel on ~384 KiB of rows a thread, which stay in L2, activations
                # quantized beforehand: the compute alone. Far above the DRAM figure, the
                # matvec waits on memory; close to it, on compute.
                per_thread = max(16, (384 * 1024 // w.shape[1]) // 16 * 16)
                small = np.ascontiguousarray(w[:per_thread * t])   # whole 8-row groups
                out_small = np.empty(small.shape[0], np.float32)
                cached.append(_cell(small.nbytes * 50, _times(
                    lambda: [dispatch.matvec_fast(small, int(qtype), xq, xd, xs, out_small) for _ in range(50)],
                    max(5, args.repeat // 3))))
            if dispatch.has_fast_path(int(qtype)) and not args.no_plain and isinstance(qtype, T):
                plain.append(_cell(w.nbytes, _times(lambda: quant_kernels.matvec_q_kernel(
                    w, w.view(np.int8), int(qtype), xq, xd, xs, out, 16, 32), max(3, args.repeat // 5))))
            if args.prefill_tokens:
                flop = 2 * args.rows * args.cols * args.prefill_tokens
                pre.append(_cell(flop, _times(lambda: K.matmul(w, qtype, X), 3)))
        print(f"{f'{name} {args.rows}x{args.cols} matvec GB/s':<30}" + "".join(f"{c:>18}" for c in cells))
        print(f"{'  median % of read alongside':<30}" + "".join(f"{c:>18}" for c in pcts))
        if cached:
            print(f"{'  L2-resident GB/s (compute)':<30}" + "".join(f"{c:>18}" for c in cached))
        if plain:
            print(f"{'  plain kernel GB/s':<30}" + "".join(f"{c:>18}" for c in plain))
        if pre:
            path = "int8" if K.matmul_uses_int8(qtype, args.prefill_tokens, args.rows) else "BLAS"
            print(f"{f'  matmul {args.prefill_tokens} tok GFLOP/s ({path})':<30}" + "".join(f"{c:>18}" for c in pre))


if __name__ == "__main__":
    main()
