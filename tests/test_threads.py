"""The default kernel thread count: physical cores in the process's affinity, read from sysfs."""
from __future__ import annotations

import os

import numba
import pytest

from edgeinfer.kernels_cpu import threads


def _fake_sysfs(root, cpus: dict[int, tuple[int, int]], siblings_only: bool = False):
    """cpuN/topology for each logical CPU N -> (package, core)."""
    by_core: dict[tuple[int, int], list[int]] = {}
    for cpu, key in cpus.items():
        by_core.setdefault(key, []).append(cpu)
    for cpu, (package, core) in cpus.items():
        topo = root / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "thread_siblings_list").write_text(",".join(map(str, by_core[(package, core)])) + "\n")
        if not siblings_only:
            (topo / "physical_package_id").write_text(f"{package}\n")
            (topo / "core_id").write_text(f"{core}\n")
    return str(root)


# 4 cores with 2 SMT threads each, numbered as Linux does: cpu N and N + 4 share core N
SMT = {cpu: (0, cpu % 4) for cpu in range(8)}


def test_smt_siblings_count_once(tmp_path):
    sysfs = _fake_sysfs(tmp_path, SMT)
    assert threads.physical_cores(range(8), sysfs) == 4


def test_affinity_limits_the_count(tmp_path):
    sysfs = _fake_sysfs(tmp_path, SMT)
    assert threads.physical_cores({0, 4}, sysfs) == 1        # two threads of one core
    assert threads.physical_cores({0, 1, 5}, sysfs) == 2


def test_core_ids_repeat_across_packages(tmp_path):
    two_sockets = {0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1)}
    assert threads.physical_cores(range(4), _fake_sysfs(tmp_path, two_sockets)) == 4


def test_thread_siblings_list_when_core_ids_are_missing(tmp_path):
    sysfs = _fake_sysfs(tmp_path, SMT, siblings_only=True)
    assert threads.physical_cores(range(8), sysfs) == 4
    assert threads.physical_cores({1, 5, 2}, sysfs) == 2


def test_unreadable_topology_is_unknown(tmp_path):
    assert threads.physical_cores(range(2), str(tmp_path)) is None


def test_default_falls_back_to_the_affinity(monkeypatch):
    monkeypatch.delenv("NUMBA_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "physical_cores", lambda *a, **k: None)
    expected = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert threads.default_threads() == min(expected, numba.config.NUMBA_NUM_THREADS)


def test_default_uses_physical_cores(monkeypatch):
    monkeypatch.delenv("NUMBA_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "physical_cores", lambda *a, **k: 1)
    assert threads.default_threads() == 1


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity on this OS")
def test_this_machine_within_its_affinity():
    n = threads.physical_cores()
    assert n is None or 1 <= n <= len(os.sched_getaffinity(0))
    assert 1 <= threads.default_threads() <= numba.config.NUMBA_NUM_THREADS


def test_kernels_start_from_the_default(monkeypatch):
    monkeypatch.setattr(threads, "_wanted", None)
    monkeypatch.setattr(threads, "default_threads", lambda: 1)
    assert threads.get_threads() == 1
    assert numba.get_num_threads() == 1
