"""`edgeinfer bench` times nothing while a background kernel compile is still running, and
warms every path it times (each prompt size and the decode) before its first timed run."""

from __future__ import annotations

import json
import time

from edgeinfer.cli import main
from edgeinfer.kernels_cpu import compile_progress


class _Kernel:
    """Stands in for a Numba dispatcher: only its id keys the pending job."""


def _fake_pending_job(monkeypatch, seconds: float):
    """A real second process (compile_progress's helper) whose one job takes `seconds`,
    registered as pending for a kernel, as a cold start leaves it."""
    helper = compile_progress._Helper([f"import time; time.sleep({seconds})"])
    kernel = _Kernel()
    monkeypatch.setitem(compile_progress._pending, id(kernel), (helper, 0))
    return helper, kernel


def _record_calls(monkeypatch, helper):
    from edgeinfer import bench

    calls = []
    for name in ("time_prompt", "time_generation"):
        real = getattr(bench, name)

        def spy(engine, n, seed=0, depth=0, _real=real, _name=name, **more):
            calls.append((_name, n, seed, helper.proc.poll() is not None, time.perf_counter()))
            return _real(engine, n, seed=seed, depth=depth, **more)
        monkeypatch.setattr(bench, name, spy)
    return calls


def test_bench_waits_for_pending_compiles_before_timing(tiny_models, capsys, monkeypatch):
    helper, _ = _fake_pending_job(monkeypatch, 1.5)
    calls = _record_calls(monkeypatch, helper)
    t0 = time.perf_counter()
    assert main(["bench", str(tiny_models["llama"]), "-p", "8", "-n", "3", "-r", "2", "-t", "1",
                 "--backend", "reference", "--json"]) == 0
    out = capsys.readouterr()
    assert [r["test"] for r in json.loads(out.out)] == ["pp8", "tg3"]
    assert "waiting for 1 kernel compile job" in out.err
    assert calls, "nothing was measured"
    # not one measurement (warm-up or timed) ran while the compile process was alive
    assert all(finished for _, _, _, finished, _ in calls), calls
    assert calls[0][4] - t0 >= 1.0
    # every path warmed up (seed 99) before the first timed run
    kinds = [(name, seed == 99) for name, _, seed, _, _ in calls]
    assert kinds[:2] == [("time_prompt", True), ("time_generation", True)]
    assert all(not warm for _, warm in kinds[2:]) and len(kinds) == 2 + 2 * 2


def test_bench_says_nothing_on_a_warm_cache(tiny_models, capsys, monkeypatch):
    monkeypatch.setattr(compile_progress, "_pending", {})
    assert main(["bench", str(tiny_models["llama"]), "-p", "4", "-n", "2", "-r", "1", "-t", "1",
                 "--backend", "reference", "--json"]) == 0
    assert "waiting" not in capsys.readouterr().err


def test_a_finished_job_is_not_waited_for(monkeypatch, capsys):
    from edgeinfer.bench import wait_for_compiles

    helper, kernel = _fake_pending_job(monkeypatch, 0)
    helper.wait(0)  # done: its kernel is on disk, nothing to wait for
    assert wait_for_compiles() == 0
    assert capsys.readouterr().err == ""
