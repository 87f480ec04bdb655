"""The first start's compile progress: counted, shown on stderr, silent when nothing compiles."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time

import numpy as np
from numba import njit

from edgeinfer.kernels_cpu import compile_progress as cp


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self._tty = tty

    def isatty(self) -> bool:
        return self._tty


def _fresh_kernels():
    """Two new kernels (no cache): `outer` calls `inner`, so compiling it compiles both."""
    @njit
    def inner(x):
        return x * 2.0

    @njit
    def outer(x):
        return inner(x) + 1.0

    @njit
    def other(x):
        return x - 1.0
    return outer, other


def test_plain_lines_when_not_a_terminal():
    stream = _Stream(tty=False)
    report = cp.stderr_reporter(stream)
    report(0, 3, False)
    report(1, 3, False)
    report(3, 3, False)
    report(3, 3, True)   # the end repeats nothing
    assert stream.getvalue().splitlines() == [f"{cp.MESSAGE}: 0/3", f"{cp.MESSAGE}: 1/3", f"{cp.MESSAGE}: 3/3"]
    assert "\r" not in stream.getvalue()


def test_one_line_updated_in_place_on_a_terminal():
    stream = _Stream(tty=True)
    report = cp.stderr_reporter(stream)
    report(0, 2, False)
    report(1, 2, False)
    report(2, 2, True)
    text = stream.getvalue()
    assert text.count("\n") == 1 and text.endswith(f"{cp.MESSAGE}: 2/2\n")
    assert text.count("\r") == 3


def test_counts_top_level_compilations_only():
    outer, other = _fresh_kernels()
    calls = []
    with cp.reporting(2, lambda d, t, f: calls.append((d, t, f))) as counter:
        outer(np.float64(1.0))   # inner compiles inside outer: one kernel
        other(np.float64(1.0))
    assert counter.done == 2
    assert calls[0] == (0, 2, False) and calls[-1] == (2, 2, True)
    assert (1, 2, False) in calls


def test_silent_when_nothing_compiles():
    outer, _ = _fresh_kernels()
    outer(np.float64(1.0))
    calls = []
    with cp.reporting(5, lambda *a: calls.append(a)):
        outer(np.float64(2.0))   # compiled already
    assert calls == []


def test_warm_up_skips_the_pass_when_every_kernel_is_ready():
    outer, other = _fresh_kernels()
    outer(np.float64(1.0))
    other(np.float64(1.0))
    ran = []
    assert cp.warm_up(lambda: ran.append(1), [outer, other], report=lambda *a: None) == 0
    assert ran == []


def test_warm_up_compiles_and_reports_what_is_missing():
    outer, other = _fresh_kernels()
    stream = _Stream(tty=False)
    compiled = cp.warm_up(lambda: (outer(np.float64(1.0)), other(np.float64(1.0))), [outer, other],
                          report=cp.stderr_reporter(stream))
    assert compiled == 2
    assert stream.getvalue().splitlines()[-1] == f"{cp.MESSAGE}: 2/2"


def test_a_failing_reporter_does_not_stop_the_load():
    outer, _ = _fresh_kernels()

    def broken(*_):
        raise OSError("stderr closed")
    assert cp.warm_up(lambda: outer(np.float64(1.0)), [outer], report=broken) == 1


def test_set_reporter_swaps_the_default():
    mine = lambda *a: None  # noqa: E731
    previous = cp.set_reporter(mine)
    try:
        assert cp.get_reporter() is mine
    finally:
        cp.set_reporter(previous)


# -- the second process (cold start on 2+ cores) -------------------------------------------

def test_second_process_runs_jobs_in_order_and_wait_blocks_until_each_is_done(tmp_path):
    marker = tmp_path / "first"
    helper = cp._Helper([f"import time; time.sleep(0.4); open({str(marker)!r}, 'w').close()", "pass"])
    helper.wait(0)
    assert marker.exists()          # job 0 had finished when wait returned
    helper.wait(1)
    assert helper.done == {0, 1} and helper.proc.returncode == 0   # reaped after its last job


def test_a_failing_job_neither_stops_the_next_nor_hangs_the_wait(tmp_path):
    marker = tmp_path / "second"
    helper = cp._Helper(["raise RuntimeError('no compiler today')", f"open({str(marker)!r}, 'w').close()"])
    helper.wait(1)
    assert marker.exists()


def test_a_dead_second_process_releases_the_wait():
    helper = cp._Helper(["import os; os._exit(3)", "pass"])
    t0 = time.perf_counter()
    helper.wait(1)                  # ends at EOF: the caller compiles the kernel itself
    assert 1 not in helper.done and time.perf_counter() - t0 < 30


def test_cold_start_shares_registered_kernels_and_compiles_before_ones_first(tmp_path, monkeypatch):
    outer, other = _fresh_kernels()
    shared = tmp_path / "shared"
    early = tmp_path / "early"
    monkeypatch.setattr(cp, "_cores", lambda: 2)
    monkeypatch.setattr(cp, "_elsewhere", {})
    monkeypatch.setattr(cp, "_before", {})
    monkeypatch.setattr(cp, "_pending", {})
    cp.compile_elsewhere(other, f"open({str(shared)!r}, 'w').close()")
    cp.compile_before(outer, f"open({str(early)!r}, 'w').close()")
    seen = []

    def forward():
        seen.append(early.exists())  # the before-job ran first
        outer(np.float64(1.0))
        cp.wait_for(other)           # as a kernel's entry point does before its first call
        seen.append(shared.exists())
        other(np.float64(1.0))
    assert cp.warm_up(forward, [outer, other], report=lambda *a: None) == 2
    assert seen == [True, True] and cp._pending == {}


def test_nothing_is_shared_on_one_core(monkeypatch):
    outer, other = _fresh_kernels()
    monkeypatch.setattr(cp, "_cores", lambda: 1)
    monkeypatch.setattr(cp, "_elsewhere", {})
    monkeypatch.setattr(cp, "_pending", {})
    cp.compile_elsewhere(other, "pass")
    assert cp._start_elsewhere([outer, other]) is False and cp._pending == {}


_COLD_CHILD = r"""
import json, sys
from numba.core import event
from edgeinfer.kernels_cpu import compile_progress
compile_progress._cores = lambda: 2      # share the work as on a 2-core machine
depth, compiled = [0], []
class Listener(event.Listener):
    def on_start(self, ev):
        depth[0] += 1
        if depth[0] == 1:
            compiled.append(ev.data["dispatcher"].py_func.__qualname__)
    def on_end(self, ev):
        depth[0] -= 1
event.register("numba:compile", Listener())
import edgeinfer
model = edgeinfer.load(sys.argv[1], n_ctx=256)
at_load = len(compiled)
text = model.generate("The capital of France is", max_tokens=6, temperature=0).text
# an 80-token prompt: past every type's short-batch GEMM crossover and the long-prompt
# attention's threshold (64 queries)
model.generate(model.tokenize("one two three four five six seven eight nine ten " * 8)[:80], max_tokens=1,
               temperature=0)
print(json.dumps({"compiled": compiled, "after_load": compiled[at_load:], "text": text}))
"""


def _load_in_child(model_path, cache) -> dict:
    """_COLD_CHILD on this model with this Numba cache folder: what it compiled and said."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache)}
    out = subprocess.run([sys.executable, "-c", _COLD_CHILD, str(model_path)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_cold_start_splits_the_kernels_between_two_processes(tmp_path, gemma_path):
    """The second process's jobs compile with the exact signatures the forward pass
    calls (else this process would compile them again), the decode step's kernels
    compile before the pass, and the answer is the warm start's."""
    cold = _load_in_child(gemma_path, tmp_path)
    names = cold["compiled"]
    # this process: the decode step's kernels first (compile_before), then the pass's own
    assert names[:2] and names[0].startswith("_matvec_kernel") and names[1] == "quantize_act", names
    for elsewhere in ("attention_rows", "quantize_rows_q8_k", "_gelu_mul_kernel"):
        assert not any(elsewhere in n for n in names), (elsewhere, names)
    # the prompt GEMMs and the long-prompt attention are compiled at load, not at a
    # first prompt long enough to take them
    assert cold["after_load"] == [], cold["after_load"]
    warm = _load_in_child(gemma_path, tmp_path)
    assert warm["compiled"] == [] and warm["text"] == cold["text"]


def test_a_swiglu_model_compiles_its_fused_decode_kernel_first(tmp_path):
    """A SwiGLU model's decode MLP (fused_layer), its largest kernel, compiles before the
    pass with the signature decoding uses (not again at the first decoded token)."""
    from gguf_factory import TinyShape, spm_vocab, write_tiny_model

    path = write_tiny_model(tmp_path / "llama.gguf", "llama", "Q4_K", vocab=spm_vocab(),
                            shape=TinyShape(n_embd=256, n_layer=1, n_head=2, n_head_kv=1, head_dim=128,
                                            n_ff=256, n_ctx=256))
    names = _load_in_child(path, tmp_path / "cache")["compiled"]
    assert names[0].startswith("_matvec_kernel") and names[1].startswith("_norm_swiglu_residual"), names
    assert sum(n.startswith("_norm_swiglu_residual") for n in names) == 1, names
