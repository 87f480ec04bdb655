"""Numba's cache folder is keyed to every kernel source: editing a helper module moves it."""
from __future__ import annotations

import shutil
from pathlib import Path

from edgeinfer.kernels_cpu import cache_dir

SOURCES = Path(cache_dir.__file__).resolve().parent


def _copy_sources(tmp_path: Path) -> Path:
    folder = tmp_path / "kernels_cpu"
    folder.mkdir()
    for path in SOURCES.glob("*.py"):
        shutil.copy(path, folder / path.name)
    return folder


def test_editing_a_helper_module_changes_the_key(tmp_path):
    folder = _copy_sources(tmp_path)
    before = cache_dir.source_key(folder, ("0.1", "0.2"))
    assert cache_dir.source_key(folder, ("0.1", "0.2")) == before   # stable
    # the modules other files' kernels are built from, and every other source
    assert {"ir_helpers.py", "dot_q32.py", "dot_kquant.py", "ggml_math.py", "kv_attention_ir.py"} <= {
        p.name for p in folder.glob("*.py")}
    keys = {before}
    for path in sorted(folder.glob("*.py")):
        text = path.read_text()
        path.write_text(text + "\n# an edit\n")
        keys.add(cache_dir.source_key(folder, ("0.1", "0.2")))
        path.write_text(text)
    assert len(keys) == 1 + len(list(folder.glob("*.py")))
    assert cache_dir.source_key(folder, ("0.1", "0.2")) == before
    (folder / "new_helper.py").write_text('"""A new module."""\n')
    assert len({before, cache_dir.source_key(folder, ("0.1", "0.2"))}) == 2


def test_numba_or_llvmlite_version_changes_the_key(tmp_path):
    folder = _copy_sources(tmp_path)
    keys = {cache_dir.source_key(folder, v) for v in (("0.1", "0.2"), ("0.1", "0.3"), ("0.2", "0.2"))}
    assert len(keys) == 3


def test_folder_under_an_explicit_numba_cache_dir_or_the_user_cache(tmp_path):
    assert cache_dir.cache_dir("abc", {"NUMBA_CACHE_DIR": str(tmp_path)}) == tmp_path / "kernels-abc"
    # a child process handed the keyed folder itself uses it as it is
    assert cache_dir.cache_dir("abc", {"NUMBA_CACHE_DIR": str(tmp_path / "kernels-abc")}) == tmp_path / "kernels-abc"
    assert cache_dir.cache_dir("abc", {"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "edgeinfer" / "numba" / "kernels-abc"


def test_old_folders_pruned_keeping_the_recent_ones(tmp_path):
    import os

    for i in range(6):
        d = tmp_path / f"kernels-{i}"
        d.mkdir()
        os.utime(d, (1000 + i, 1000 + i))
    (tmp_path / "unrelated").mkdir()
    cache_dir.prune(tmp_path / "kernels-5", keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kernels-3", "kernels-4", "kernels-5", "unrelated"]


def test_the_kernels_use_the_keyed_folder():
    from numba.core import config

    import edgeinfer.kernels_cpu  # noqa: F401 - configures the cache folder

    assert Path(config.CACHE_DIR).name == "kernels-" + cache_dir.source_key()
