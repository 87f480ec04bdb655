"""Saved sessions and conversations against hostile files: FIFOs, devices and links out of the
folder refused at once; archive members checked before they are read (zip bombs, lying .npy
headers, too many members); bad K/V (NaN, Inf, positions out of range) dropped with the
messages kept and the file untouched; temp files of killed saves swept, live ones kept."""

from __future__ import annotations

import fcntl
import io
import json
import os
import resource
import struct
import subprocess
import sys
import textwrap
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

from edgeinfer import atomic_file

from edgeinfer.sessions import session_file
from edgeinfer.sessions.conversations import ConversationError, ConversationStore
from edgeinfer.sessions.session_file import (SavedSession, SessionFileError, load_session, read_session_info,
                                     save_session)

IDENTITY = {"name": "tiny", "size": 1234, "digest": "ab" * 32}
MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
RUN = [sys.executable, "-m", "edgeinfer.cli", "run"]


@pytest.fixture(autouse=True)
def _fresh_sweep(monkeypatch):
    """Each test is a fresh process as far as the once-per-folder sweep is concerned."""
    monkeypatch.setattr(session_file, "_swept", set())


def _kv_session(n: int = 3, layers: int = 2, tokens: int | None = None) -> SavedSession:
    rng = np.random.default_rng(0)
    k = [rng.standard_normal((n, 1, 4)).astype(np.float16) for _ in range(layers)]
    v = [rng.standard_normal((n, 1, 4)).astype(np.float16) for _ in range(layers)]
    return SavedSession(messages=list(MESSAGES), tokens=list(range(5, 5 + (tokens or n))),
                        sampling={"temperature": 0.0}, k=k, v=v, pos=np.arange(n))


def _within(fn, seconds: float = 1.0, fifo: Path | None = None):
    """fn()'s result or exception, failing the test if it takes longer than `seconds` (a FIFO a
    blocked reader waits on is then opened for writing, so the thread ends)."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    start = time.monotonic()
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        if fifo is not None:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)
        pytest.fail(f"still blocked after {seconds}s")
    assert time.monotonic() - start < seconds
    return box


def _one_line_error(box: dict, kind=SessionFileError) -> str:
    assert isinstance(box.get("error"), kind), box
    text = str(box["error"])
    assert "\n" not in text
    return text


# -- only regular files inside the folder --------------------------------------------------------
def test_fifo_named_like_a_session_is_refused_at_once(tmp_path):
    fifo = tmp_path / "trap.npz"
    os.mkfifo(fifo)
    text = _one_line_error(_within(lambda: load_session(fifo, IDENTITY), fifo=fifo))
    assert "FIFO" in text and "trap.npz" in text
    assert "FIFO" in _one_line_error(_within(lambda: read_session_info(fifo), fifo=fifo))


def test_listing_skips_a_fifo_without_blocking(tmp_path):
    store = ConversationStore(tmp_path)
    save_session(tmp_path / "good.npz", _kv_session(), IDENTITY)
    fifo = tmp_path / "trap.npz"
    os.mkfifo(fifo)
    convs, problems = _within(store.list, fifo=fifo)["value"]
    assert [c.id for c in convs] == ["good"]
    assert len(problems) == 1 and "trap.npz" in problems[0] and "FIFO" in problems[0]
    assert "FIFO" in _one_line_error(_within(lambda: store.load("trap"), fifo=fifo), ConversationError)


def test_legacy_migration_skips_a_fifo(tmp_path):
    legacy = tmp_path / "conversations"
    legacy.mkdir()
    fifo = legacy / ("ab" * 16 + ".json")
    os.mkfifo(fifo)
    store = ConversationStore(tmp_path / "sessions", legacy=legacy)
    problems = _within(store.migrate, fifo=fifo)["value"]
    assert len(problems) == 1 and "FIFO" in problems[0]
    assert fifo.exists() and not (legacy / "migrated").exists()


def _memory_limited() -> None:
    """For a child that might read /dev/zero: MemoryError at 4 GiB instead of taking the machine."""
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


DEV_ZERO_SCRIPT = textwrap.dedent("""
    import json, sys
    from edgeinfer.sessions.conversations import ConversationStore
    from edgeinfer.sessions.session_file import load_session, read_session_info
    out = []
    for read in (lambda: load_session(sys.argv[1], {}), lambda: read_session_info(sys.argv[1])):
        try:
            read()
            out.append("loaded")
        except Exception as exc:
            out.append(type(exc).__name__ + ": " + str(exc))
    convs, problems = ConversationStore(sys.argv[2]).list()
    print(json.dumps({"errors": out, "convs": len(convs), "problems": problems}))
""")


def test_symlink_to_dev_zero_is_refused(tmp_path):
    link = tmp_path / "zero.npz"
    link.symlink_to("/dev/zero")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", DEV_ZERO_SCRIPT, str(link), str(tmp_path)],
                          capture_output=True, text=True, timeout=60, preexec_fn=_memory_limited)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    for error in out["errors"]:
        assert error.startswith("SessionFileError: session file zero.npz is a symbolic link pointing out")
    assert out["convs"] == 0 and len(out["problems"]) == 1 and "zero.npz" in out["problems"][0]
    assert time.monotonic() - start < 30


def test_symlink_to_a_session_outside_the_folder_is_refused(tmp_path):
    outside = tmp_path / "elsewhere"
    real = save_session(outside / "real.npz", _kv_session(), IDENTITY)
    folder = tmp_path / "sessions"
    folder.mkdir()
    (folder / "link.npz").symlink_to(real)
    assert "out of its folder" in _one_line_error(_within(lambda: load_session(folder / "link.npz", IDENTITY)))
    # A link to another session of the same folder is an ordinary alias.
    (outside / "alias.npz").symlink_to("real.npz")
    assert load_session(outside / "alias.npz", IDENTITY).messages == MESSAGES


def test_a_directory_named_like_a_session_is_refused(tmp_path):
    (tmp_path / "dir.npz").mkdir()
    assert "directory" in _one_line_error(_within(lambda: load_session(tmp_path / "dir.npz", IDENTITY)))


# -- archive members checked before they are read -----------------------------------------------
def _npy(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.lib.format.write_array(out, np.asarray(array), allow_pickle=False)
    return out.getvalue()


def _npy_header(shape: tuple, dtype: str) -> bytes:
    out = io.BytesIO()
    np.lib.format.write_array_header_1_0(out, {"descr": dtype, "fortran_order": False, "shape": shape})
    return out.getvalue()


def _zip(members: list[tuple[str, bytes, int, int, int]]) -> bytes:
    """A zip of (name, stored or deflated bytes, crc, uncompressed size, method), written by hand
    so a member may be a bomb whose expanded bytes never exist here."""
    body, directory = b"", b""
    for name, data, crc, size, method in members:
        raw = name.encode()
        local = struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, 0, method, 0, 0, crc, len(data), size, len(raw), 0)
        directory += struct.pack("<4s6H3L5H2L", b"PK\x01\x02", 20, 20, 0, method, 0, 0, crc, len(data), size,
                                 len(raw), 0, 0, 0, 0, 0, len(body)) + raw
        body += local + raw + data
    end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, len(members), len(members), len(directory), len(body), 0)
    return body + directory + end


def _stored(name: str, data: bytes) -> tuple:
    return (name, data, zlib.crc32(data), len(data), 0)


def _header(n_kv: int, **extra) -> bytes:
    header = {"format": "edgeinfer-session", "version": 1, "model": IDENTITY, "messages": MESSAGES,
              "sampling": {}, "n_kv": n_kv, **extra}
    return _npy(np.frombuffer(json.dumps(header).encode(), dtype=np.uint8))


def _deflated_zeros_member(name: str, prefix: bytes, zeros: int) -> tuple:
    """A deflated member: `prefix` then `zeros` zero bytes, compressed about 1000:1 without ever
    holding the zeros (a full flush makes every 1 MiB piece of output the same)."""
    block = 1 << 20
    assert zeros % block == 0
    head = zlib.compressobj(9, zlib.DEFLATED, -15)
    data = head.compress(prefix) + head.flush(zlib.Z_FULL_FLUSH)
    piece = zlib.compressobj(9, zlib.DEFLATED, -15)
    one = piece.compress(bytes(block)) + piece.flush(zlib.Z_FULL_FLUSH)
    data += one * (zeros // block) + zlib.compressobj(9, zlib.DEFLATED, -15).flush()
    crc, chunk = zlib.crc32(prefix), bytes(block)
    for _ in range(zeros // block):
        crc = zlib.crc32(chunk, crc)
    return (name, data, crc, len(prefix) + zeros, 8)


BOMB_SCRIPT = textwrap.dedent("""
    import json, resource, sys
    from edgeinfer.sessions.session_file import load_session
    before = int([l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM:')][0])
    out = {}
    try:
        s = load_session(sys.argv[1], json.loads(sys.argv[2]))
        out = {"n_kv": s.n_kv, "messages": len(s.messages), "refused": getattr(s, "kv_refused", None)}
    except Exception as exc:
        out = {"error": type(exc).__name__, "text": str(exc)}
    out["grew_kib"] = int([l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM:')][0]) - before
    print(json.dumps(out))
""")


def _load_in_subprocess(path: Path) -> dict:
    proc = subprocess.run([sys.executable, "-c", BOMB_SCRIPT, str(path), json.dumps(IDENTITY)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_zip_bomb_kv_member_is_refused_without_reading_it(tmp_path):
    """~1 MB on disk, 1 GiB expanded: refused from the zip directory, peak memory unchanged."""
    n, row = 4096, 1 << 16  # (4096, 1, 65536) f16 = 512 MiB per member
    members = [_stored("header.npy", _header(n)), _stored("tokens.npy", _npy(np.arange(n, dtype=np.int64))),
               _stored("pos.npy", _npy(np.arange(n, dtype=np.int64)))]
    for name in ("k0.npy", "v0.npy"):
        members.append(_deflated_zeros_member(name, _npy_header((n, 1, row), "<f2"), n * row * 2))
    path = tmp_path / "bomb.npz"
    path.write_bytes(_zip(members))
    assert path.stat().st_size < 4 << 20
    out = _load_in_subprocess(path)
    assert out.get("n_kv") == 0 and out["messages"] == 2, out
    assert "zip bomb" in (out["refused"] or "") and "\n" not in out["refused"]
    assert out["grew_kib"] < 64 << 10, out  # less than 64 MiB more than the imports took


def test_zip_bomb_header_member_is_refused(tmp_path):
    path = tmp_path / "bomb.npz"
    path.write_bytes(_zip([_deflated_zeros_member("header.npy", _npy_header((256 << 20,), "|u1"), 256 << 20)]))
    out = _load_in_subprocess(path)
    assert out.get("error") == "SessionFileError" and "corrupt" in out["text"], out
    assert out["grew_kib"] < 64 << 10, out


def test_npy_header_larger_than_the_member_refuses_the_file(tmp_path):
    """tokens.npy declares 2**50 tokens and holds 3: refused, nothing allocated."""
    lying = _npy_header((1 << 50,), "<i8") + np.arange(3, dtype=np.int64).tobytes()
    path = tmp_path / "liar.npz"
    path.write_bytes(_zip([_stored("header.npy", _header(0)), _stored("tokens.npy", lying)]))
    text = _one_line_error(_within(lambda: load_session(path, IDENTITY)))
    assert "liar.npz" in text and "declares" in text


def test_kv_member_whose_shape_disagrees_with_its_size_is_refused(tmp_path):
    lying = _npy_header((3, 1000, 1000), "<f2") + bytes(24)
    members = [_stored("header.npy", _header(3)), _stored("tokens.npy", _npy(np.arange(3, dtype=np.int64))),
               _stored("pos.npy", _npy(np.arange(3, dtype=np.int64))), _stored("k0.npy", lying),
               _stored("v0.npy", _npy(np.zeros((3, 1, 4), np.float16)))]
    path = tmp_path / "liar.npz"
    path.write_bytes(_zip(members))
    warned: list[str] = []
    saved = load_session(path, IDENTITY, 1, warn=warned.append)
    assert saved.messages == MESSAGES and saved.n_kv == 0
    assert len(warned) == 1 and "declares" in warned[0] and "liar.npz" in warned[0]


def test_kv_shape_is_checked_against_the_model_config(tmp_path):
    class Config:
        n_layer, n_head_kv, head_dim, head_dim_v = 2, 1, 8, 8  # the file holds head_dim 4

    path = save_session(tmp_path / "s.npz", _kv_session(), IDENTITY)
    warned: list[str] = []
    saved = load_session(path, IDENTITY, config=Config, warn=warned.append)
    assert saved.n_kv == 0 and "(3, 1, 8)" in warned[0]
    Config.head_dim = Config.head_dim_v = 4
    assert load_session(path, IDENTITY, config=Config, n_ctx=64).n_kv == 3


def test_too_many_members_are_refused_before_parsing(tmp_path):
    members = [_stored("header.npy", _header(0)), _stored("tokens.npy", _npy(np.arange(3, dtype=np.int64)))]
    members += [_stored(f"x{i}.npy", _npy(np.zeros(1))) for i in range(5000)]
    path = tmp_path / "many.npz"
    path.write_bytes(_zip(members))
    assert "members" in _one_line_error(_within(lambda: load_session(path, IDENTITY)))


def test_deeply_nested_json_header_is_one_line_error(tmp_path):
    deep = b'{"format": "edgeinfer-session", "version": 1, "messages": ' + b"[" * 200000 + b"]" * 200000 + b"}"
    path = tmp_path / "deep.npz"
    path.write_bytes(_zip([_stored("header.npy", _npy(np.frombuffer(deep, np.uint8))),
                           _stored("tokens.npy", _npy(np.arange(0, dtype=np.int64)))]))
    assert "corrupt" in _one_line_error(_within(lambda: read_session_info(path), seconds=5))


def test_no_memory_for_the_kv_drops_them_with_one_line(tmp_path, monkeypatch):
    path = save_session(tmp_path / "s.npz", _kv_session(), IDENTITY)
    real_empty = np.empty

    def empty(shape, *args, **kwargs):
        if len(np.atleast_1d(shape)) == 3:
            raise MemoryError
        return real_empty(shape, *args, **kwargs)

    monkeypatch.setattr(np, "empty", empty)
    warned: list[str] = []
    saved = load_session(path, IDENTITY, 2, warn=warned.append)
    assert saved.messages == MESSAGES and saved.n_kv == 0 and "no memory" in warned[0]


# -- bad K/V values: dropped, messages kept, file untouched ---------------------------------------
def _tamper(path: Path, **arrays) -> None:
    """Rewrite a session with some arrays replaced (header n_kv kept)."""
    with np.load(path) as z:
        data = {k: z[k] for k in z.files}
    data.update(arrays)
    with open(path, "wb") as f:
        np.savez(f, **data)


def _nan_kv(k):
    k = [a.copy() for a in k]
    k[1][1, 0, 2] = np.nan
    return {"k1": k[1]}


def _inf_kv(k):
    k = [a.copy() for a in k]
    k[0][2, 0, 0] = np.inf
    return {"k0": k[0]}


BAD_KV = {
    "nan": (_nan_kv, "NaN"),
    "inf": (_inf_kv, "Inf"),
    "negative": (lambda k: {"pos": np.array([-1, 0, 1])}, "negative"),
    "not_increasing": (lambda k: {"pos": np.array([0, 2, 1])}, "increasing"),
    "past_the_tokens": (lambda k: {"pos": np.array([0, 1, 9])}, "past the"),
    "beyond_n_ctx": (lambda k: {"pos": np.array([0, 1, 80])}, "context"),
    "pos_length": (lambda k: {"pos": np.array([0, 1])}, "pos has shape"),
    "n_kv_over_tokens": (lambda k: {"tokens": np.array([5, 6], dtype=np.int64)}, "for 2 tokens"),
}


@pytest.mark.parametrize("damage", sorted(BAD_KV))
def test_bad_kv_is_dropped_and_the_messages_load(tmp_path, damage):
    session = _kv_session(tokens=100 if damage == "beyond_n_ctx" else 3)
    path = save_session(tmp_path / "s.npz", session, IDENTITY)
    make, reason = BAD_KV[damage]
    _tamper(path, **make(session.k))
    os.utime(path, (1_000_000_000, 1_000_000_000))
    before, mtime = path.read_bytes(), path.stat().st_mtime_ns
    warned: list[str] = []
    saved = load_session(path, IDENTITY, 2, n_ctx=64, warn=warned.append)
    assert saved.messages == MESSAGES and saved.n_kv == 0 and saved.k is None and saved.pos is None
    assert len(warned) == 1 and "\n" not in warned[0] and reason in warned[0] and "s.npz" in warned[0]
    assert saved.kv_refused == warned[0]
    # The conversation view reads it too, and the TUI is told why its K/V are not restored.
    store = ConversationStore(tmp_path)
    conv = store.load("s")
    assert conv.messages == MESSAGES
    with pytest.raises(SessionFileError, match=reason):
        store.load_kv(conv, IDENTITY, 2, n_ctx=64)
    assert path.read_bytes() == before and path.stat().st_mtime_ns == mtime


def test_default_warning_is_one_stderr_line(tmp_path, capsys):
    session = _kv_session()
    path = save_session(tmp_path / "s.npz", session, IDENTITY)
    _tamper(path, **_inf_kv(session.k))
    assert load_session(path, IDENTITY, 2).n_kv == 0
    err = capsys.readouterr().err
    assert err.startswith("edgeinfer: warning: session file s.npz") and err.count("\n") == 1


def test_whole_nan_rows_of_a_sliding_window_layer_still_load(tmp_path):
    """export_kv marks rows a sliding-window layer no longer holds as whole NaN rows in K and V."""
    session = _kv_session()
    for a in (session.k[1], session.v[1]):
        a[0] = np.nan
    path = save_session(tmp_path / "s.npz", session, IDENTITY)
    saved = load_session(path, IDENTITY, 2, warn=pytest.fail)
    assert saved.n_kv == 3 and np.isnan(saved.k[1][0]).all()


# -- temp files of killed saves ------------------------------------------------------------------
def _temp(folder: Path, name: str, age: float) -> Path:
    path = folder / name
    path.write_bytes(b"half a save")
    then = time.time() - age
    os.utime(path, (then, then))
    return path


def test_leftover_temp_files_are_removed_on_start_fresh_and_locked_ones_kept(tmp_path):
    old = _temp(tmp_path, ".chat-1.k2j3h4_x.tmp", 3600)
    fresh = _temp(tmp_path, ".chat-2.a8b7c6d5.tmp", 0)
    locked = _temp(tmp_path, ".chat-3.zzyyxxww.tmp", 3600)
    other = _temp(tmp_path, "notes.tmp", 3600)  # not a name atomic_file makes
    outside = _temp(tmp_path, "target", 3600)
    link = tmp_path / ".chat-4.qqwweerr.tmp"
    link.symlink_to(outside)
    sub = tmp_path / "sub"
    sub.mkdir()
    deeper = _temp(sub, ".chat-5.aabbccdd.tmp", 3600)
    with open(locked, "rb") as holder:
        fcntl.flock(holder.fileno(), fcntl.LOCK_EX)  # a save under way in another process
        ConversationStore(tmp_path)
        assert locked.exists()
    assert not old.exists()
    assert fresh.exists() and other.exists() and link.is_symlink() and outside.exists() and deeper.exists()


def test_first_load_in_a_folder_sweeps_it(tmp_path):
    path = save_session(tmp_path / "s.npz", _kv_session(), IDENTITY)
    session_file._swept.clear()
    old = _temp(tmp_path, ".s.abcdefgh.tmp", 3600)
    load_session(path, IDENTITY)
    assert not old.exists() and path.exists()


def test_a_save_holds_a_lock_on_its_temp_file(tmp_path):
    seen: list[bool] = []

    def write(f):
        f.write(b"data")
        temps = [p for p in tmp_path.iterdir() if atomic_file.is_temp_name(p.name)]
        assert len(temps) == 1
        fd = os.open(temps[0], os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            seen.append(False)
        except BlockingIOError:
            seen.append(True)
        finally:
            os.close(fd)
        os.utime(temps[0], (0, 0))  # even an old-looking temp file is kept while locked
        assert atomic_file.remove_stale_temps(tmp_path) == []

    atomic_file.write_atomically(tmp_path / "x.npz", write)
    assert seen == [True] and (tmp_path / "x.npz").read_bytes() == b"data"


# -- through the CLI -----------------------------------------------------------------------------
@pytest.mark.parametrize("kind, says", [("fifo", "is a FIFO"), ("dev_zero", "is a symbolic link pointing out")])
def test_run_with_a_hostile_session_file_is_one_line_and_does_not_hang(tiny_models, tmp_path, kind, says):
    folder = tmp_path / "sessions"
    folder.mkdir()
    trap = folder / "trap.npz"
    if kind == "fifo":
        os.mkfifo(trap)
    else:
        trap.symlink_to("/dev/zero")
    env = {**os.environ, "EDGEINFER_HOME": str(tmp_path)}
    try:
        proc = subprocess.run(RUN + [str(tiny_models["llama"]), "hi", "-n", "2", "--backend", "reference",
                                     "-c", "64", "--session", "trap"],
                              capture_output=True, text=True, timeout=120, env=env, preexec_fn=_memory_limited)
    except subprocess.TimeoutExpired:
        if kind == "fifo":
            os.close(os.open(trap, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"edgeinfer run blocked on a {kind} session")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("edgeinfer: error: session file trap.npz " + says)


def test_run_with_nan_kv_warns_once_and_answers(tiny_models, tmp_path, monkeypatch, capsys):
    from edgeinfer.cli import main

    monkeypatch.setenv("EDGEINFER_HOME", str(tmp_path))
    common = [str(tiny_models["llama"]), "-n", "2", "--temp", "0", "--backend", "reference", "-c", "256"]
    assert main(["run", *common, "hello world", "--session", "s", "--session-kv"]) == 0
    path = tmp_path / "sessions" / "s.npz"
    with np.load(path) as z:
        k0 = z["k0"].copy()
    k0[0, 0, 0] = np.nan
    _tamper(path, k0=k0)
    capsys.readouterr()
    assert main(["run", *common, "and then?", "--session", "s"]) == 0
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "s.npz" in warnings[0] and "NaN" in warnings[0], err
    assert "Resumed session 's' (1 turn(s))" in err and "Traceback" not in err


def test_token_ids_outside_the_vocabulary_drop_the_kv(tmp_path):
    from types import SimpleNamespace

    session = _kv_session()
    path = save_session(tmp_path / "s.npz", session, IDENTITY)
    _tamper(path, tokens=np.array([5, 6, 1 << 40], dtype=np.int64))
    shape = session.k[0].shape
    config = SimpleNamespace(n_layer=2, n_head_kv=shape[1], head_dim=shape[2], head_dim_v=session.v[0].shape[2],
                             n_vocab=1000)
    warned: list[str] = []
    saved = load_session(path, IDENTITY, config=config, warn=warned.append)
    assert saved.messages == MESSAGES and saved.n_kv == 0 and "outside the vocabulary" in warned[0]
