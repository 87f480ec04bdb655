"""Downloads against a local Hub stand-in: cache layout, resume, checksums, errors, the CLI."""

from __future__ import annotations

import hashlib

import gguf
import numpy as np
import pytest
from huggingface_hub import scan_cache_dir

from edgeinfer.store import download, registry
from edgeinfer.cli import main
from edgeinfer.errors import DownloadError, ModelNotFoundError
from edgeinfer.gguf_file import GGUFFile
from gguf_factory import write_tiny_model
from gguf_split_factory import split_gguf
from hub_standin import HubStandin, use_standin

REPO = "acme/Tiny-GGUF"
Q4 = "tiny-Q4_K_M.gguf"
Q8 = "tiny-Q8_0.gguf"


def tiny_gguf(path, n: int) -> bytes:
    """A small valid GGUF file (one f32 tensor of n values) and its bytes."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", np.arange(n, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


@pytest.fixture(scope="module")
def payloads(tmp_path_factory):
    root = tmp_path_factory.mktemp("payload")
    return {Q4: tiny_gguf(root / Q4, 60_000), Q8: tiny_gguf(root / Q8, 1_000)}


@pytest.fixture
def hub(payloads, tmp_path, monkeypatch):
    server = HubStandin().start()
    for name, data in payloads.items():
        server.add_file(REPO, name, data)
    server.add_file(REPO, "README.md", b"# tiny\n")
    use_standin(monkeypatch, server, tmp_path)
    yield server
    server.stop()


def blobs_dir():
    return download.repo_folder(REPO) / "blobs"


# --- pulling -------------------------------------------------------------------------------


def test_pull_default_quant_into_the_hub_cache_layout(hub, payloads, tmp_path):
    path = registry.pull(f"hf.co/{REPO}", progress=False)
    assert path.read_bytes() == payloads[Q4]
    assert path == tmp_path / "hf" / "hub" / f"models--{REPO.replace('/', '--')}" / "snapshots" / hub.commit(REPO) / Q4
    assert path.is_symlink() and path.resolve().parent.name == "blobs"
    assert path.resolve().name == hashlib.sha256(payloads[Q4]).hexdigest()
    # huggingface_hub's own cache scanner accepts what we wrote
    info = scan_cache_dir(tmp_path / "hf" / "hub")
    assert not info.warnings
    assert [f.file_name for r in info.repos for rev in r.revisions for f in rev.files] == [Q4]


def test_pull_follows_the_environment_not_huggingface_hubs_import_time_offline_flag(hub, payloads, monkeypatch):
    """huggingface_hub reads HF_HUB_OFFLINE once at import; a process that imported it offline
    (as every test process does) must still pull once the environment allows it."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    path = registry.pull(f"hf.co/{REPO}:q8_0", progress=False)
    assert path.read_bytes() == payloads[Q8]
    assert constants.HF_HUB_OFFLINE is True  # put back as it was


def test_resolve_cached_model_makes_no_request(hub, payloads):
    first = registry.resolve(f"hf.co/{REPO}:q8_0", progress=False)
    hub.requests.clear()
    assert registry.resolve(f"hf.co/{REPO}:Q8_0") == first
    assert registry.resolve(f"hf.co/{REPO}:{Q8}") == first
    assert hub.requests == []
    assert first.read_bytes() == payloads[Q8]


def test_offline_mode_resolves_only_cached_files(hub, monkeypatch):
    cached = registry.pull(f"hf.co/{REPO}:Q8_0", progress=False)
    hub.requests.clear()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert registry.pull(f"hf.co/{REPO}:Q8_0") == cached
    with pytest.raises(DownloadError, match="HF_HUB_OFFLINE"):
        registry.resolve(f"hf.co/{REPO}:Q4_K_M")
    assert hub.requests == []


@pytest.mark.parametrize("progress", [True, False])
def test_progress_bar_only_when_asked(hub, payloads, capsys, monkeypatch, progress):
    monkeypatch.setenv("TQDM_POSITION", "-1")  # huggingface_hub's switch to draw bars without a TTY
    path = registry.pull(f"hf.co/{REPO}:Q4_K_M", progress=progress)
    assert path.read_bytes() == payloads[Q4]
    err = capsys.readouterr().err
    assert (Q4 in err and "100%" in err) == progress, err


def test_alias_downloads_its_repo_file(hub, payloads, monkeypatch):
    entry = registry.alias_table()["qwen2.5-0.5b"]
    hub.add_file(entry.repo, entry.file, payloads[Q8])
    path = registry.resolve("qwen2.5-0.5b", progress=False)
    assert path.name == entry.file and path.read_bytes() == payloads[Q8]
    assert [r.path for r in hub.gets()] == [f"/{entry.repo}/resolve/main/{entry.file}"]


# --- resume --------------------------------------------------------------------------------


@pytest.fixture
def small_chunks(monkeypatch):
    """http_get writes in DOWNLOAD_CHUNK_SIZE pieces (10 MB); bytes of an unfinished piece are lost
    when the connection drops. Shrink it so a tiny file behaves like a multi-GB one."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 16 * 1024)


def test_dropped_connection_is_resumed_with_a_range_request(hub, payloads, small_chunks):
    cut = len(payloads[Q4]) // 3 + 100
    hub.cut_after, hub.cuts = cut, 1
    path = registry.pull(f"hf.co/{REPO}:Q4_K_M", progress=False)
    ranges = [g.header("range") for g in hub.gets(Q4)]
    assert ranges == [None, f"bytes={cut // (16 * 1024) * 16 * 1024}-"]
    assert path.read_bytes() == payloads[Q4]


def test_second_pull_continues_the_incomplete_file(hub, payloads, monkeypatch):
    """A pull that dies half-way keeps its partial file; the next pull sends Range and finishes."""
    data = payloads[Q4]
    half = len(data) // 2 + 7
    real_http_get = download.http_get

    def drop_half_way(url, temp_file, **kwargs):  # stands in for a link that stays down
        temp_file.write(data[:half])
        raise ConnectionResetError("connection reset by peer")

    monkeypatch.setattr(download, "http_get", drop_half_way)
    with pytest.raises(DownloadError) as info:
        registry.pull(f"hf.co/{REPO}:Q4_K_M", progress=False)
    message = str(info.value)
    assert "\n" not in message and f"stopped after {half} of {len(data)} bytes; run it again to resume" in message
    partial = blobs_dir() / (hashlib.sha256(data).hexdigest() + ".incomplete")
    assert partial.read_bytes() == data[:half]

    monkeypatch.setattr(download, "http_get", real_http_get)  # the real transfer again
    hub.requests.clear()
    path = registry.pull(f"hf.co/{REPO}:Q4_K_M", progress=False)
    assert [g.header("range") for g in hub.gets(Q4)] == [f"bytes={half}-"]
    assert path.read_bytes() == data
    assert not partial.exists()


def test_interrupted_pull_keeps_its_partial_file(hub, payloads, monkeypatch):
    """Ctrl-C mid-download: KeyboardInterrupt passes through and the partial file stays for resume."""
    data = payloads[Q4]

    def interrupted(url, temp_file, **kwargs):
        temp_file.write(data[:1000])
        raise KeyboardInterrupt

    monkeypatch.setattr(download, "http_get", interrupted)
    with pytest.raises(KeyboardInterrupt):
        registry.pull(f"hf.co/{REPO}:Q4_K_M", progress=False)
    partial = blobs_dir() / (hashlib.sha256(data).hexdigest() + ".incomplete")
    assert partial.read_bytes() == data[:1000]


# --- integrity -----------------------------------------------------------------------------


def test_corrupt_bytes_are_refused_and_nothing_is_left_behind(hub):
    hub.corrupt = True
    with pytest.raises(DownloadError, match="corrupt .*sha256") as info:
        registry.pull(f"hf.co/{REPO}:Q8_0", progress=False)
    assert "\n" not in str(info.value)
    assert [p.name for p in blobs_dir().iterdir()] == []
    assert download.cached_file(REPO, Q8) is None
    assert registry.list_local() == []
    hub.corrupt = False
    assert registry.pull(f"hf.co/{REPO}:Q8_0", progress=False).is_file()


def test_verify_rejects_wrong_size(tmp_path):
    f = tmp_path / "x.incomplete"
    f.write_bytes(b"abc")
    with pytest.raises(DownloadError, match="size 3 bytes, expected 4"):
        download._verify(f, expected_size=4, etag=hashlib.sha256(b"abc").hexdigest(), what="w")
    assert not f.exists()


def test_verify_checks_git_sha1_of_non_lfs_files(tmp_path):
    f = tmp_path / "x"
    f.write_bytes(b"hello\n")
    download._verify(f, expected_size=6, etag="ce013625030ba8dba906f756967f9e9ca394464a", what="w")  # git hash-object
    with pytest.raises(DownloadError, match="git sha1"):
        download._verify(f, expected_size=6, etag="0" * 40, what="w")


# --- errors --------------------------------------------------------------------------------


def test_unknown_repo_is_one_clear_line(hub):
    with pytest.raises(DownloadError, match="repository not found") as info:
        registry.pull("hf.co/acme/Missing-GGUF", progress=False)
    assert "\n" not in str(info.value)


def test_unknown_file_is_one_clear_line(hub):
    with pytest.raises(DownloadError, match="file not found in the repository"):
        download.fetch(REPO, "absent-Q4_K_M.gguf", progress=False)


def test_unknown_quant_lists_the_repo_choices(hub):
    with pytest.raises(ModelNotFoundError, match="no Q5_K_M GGUF; choose one of: Q4_K_M, Q8_0"):
        registry.pull(f"hf.co/{REPO}:Q5_K_M", progress=False)


def test_unreachable_host_is_one_clear_line(hub, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: connection refused
    with pytest.raises(DownloadError, match="cannot reach http://127.0.0.1:9") as info:
        download.fetch(REPO, Q8, progress=False)
    assert "\n" not in str(info.value)


# --- store: list / remove ------------------------------------------------------------------


def test_list_names_resolve_back_and_remove_deletes_only_that_file(hub, payloads):
    q4 = registry.pull(f"hf.co/{REPO}", progress=False)
    q8 = registry.pull(f"hf.co/{REPO}:Q8_0", progress=False)
    models = {m.name: m for m in registry.list_local()}
    assert set(models) == {f"hf.co/{REPO}:Q4_K_M", f"hf.co/{REPO}:Q8_0"}
    for name, model in models.items():
        assert registry.resolve(name, download=False) == model.path
        assert model.size_bytes == len(model.path.read_bytes())
    removed = registry.remove(f"hf.co/{REPO}:Q8_0")
    assert q8 in removed and not q8.exists() and q4.read_bytes() == payloads[Q4]
    assert [m.name for m in registry.list_local()] == [f"hf.co/{REPO}:Q4_K_M"]
    registry.remove(f"hf.co/{REPO}:Q4_K_M")
    assert registry.list_local() == [] and not download.repo_folder(REPO).exists()
    with pytest.raises(ModelNotFoundError, match="not in the local store"):
        registry.remove(f"hf.co/{REPO}:Q4_K_M")


def test_list_shows_the_alias_name(hub, payloads):
    entry = registry.alias_table()["qwen3-0.6b"]
    hub.add_file(entry.repo, entry.file, payloads[Q8])
    registry.pull("qwen3-0.6b", progress=False)
    assert [m.name for m in registry.list_local()] == ["qwen3-0.6b"]
    registry.remove("qwen3-0.6b")
    assert registry.list_local() == []


# --- split GGUFs: pulled, listed and removed as one model ------------------------------------

BIG = "acme/Big-GGUF"


@pytest.fixture(scope="module")
def split_payloads(tmp_path_factory):
    root = tmp_path_factory.mktemp("split")
    whole = write_tiny_model(root / "big-Q4_K_M.gguf", "llama", "Q8_0")
    parts = split_gguf(whole, root / "parts", "big-Q4_K_M", 3)
    return {f"Q4_K_M/{p.name}": p.read_bytes() for p in parts}, whole


@pytest.fixture
def split_hub(hub, split_payloads):
    for name, data in split_payloads[0].items():
        hub.add_file(BIG, name, data)
    hub.add_file(BIG, "big-Q8_0.gguf", b"another quant, never fetched here")
    return hub


def test_pull_split_model_downloads_every_part_and_opens_from_the_first(split_hub, split_payloads):
    files, whole = split_payloads
    path = registry.pull(f"hf.co/{BIG}", progress=False)
    assert path.name == "big-Q4_K_M-00001-of-00003.gguf"
    for name, data in files.items():
        assert (path.parent / name.split("/")[1]).read_bytes() == data
    assert split_hub.gets("big-Q8_0.gguf") == []
    gf = GGUFFile.open(path)
    assert len(gf.part_paths) == 3 and list(gf.tensors) == list(GGUFFile.open(whole).tensors)
    assert gf.file_size == sum(len(d) for d in files.values())


def test_resolve_split_model_fetches_only_its_missing_parts(split_hub, split_payloads):
    path = registry.pull(f"hf.co/{BIG}:Q4_K_M", progress=False)
    split_hub.requests.clear()
    assert registry.resolve(f"hf.co/{BIG}:Q4_K_M", progress=False) == path
    assert split_hub.requests == []  # cached: no request at all
    third = path.with_name("big-Q4_K_M-00003-of-00003.gguf")
    blob = third.resolve()
    third.unlink(), blob.unlink()  # as if the pull had stopped before the last part
    assert registry.resolve(f"hf.co/{BIG}:Q4_K_M", progress=False) == path
    assert third.is_file() and [r.path.rsplit("/", 1)[1] for r in split_hub.gets(".gguf")] == [third.name]


def test_offline_split_model_with_a_missing_part_is_not_cached(split_hub, monkeypatch):
    path = registry.pull(f"hf.co/{BIG}:Q4_K_M", progress=False)
    path.with_name("big-Q4_K_M-00002-of-00003.gguf").unlink()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DownloadError, match="not in the local cache"):
        registry.resolve(f"hf.co/{BIG}:Q4_K_M", progress=False)


def test_split_model_is_listed_once_and_removed_whole(split_hub, split_payloads):
    path = registry.pull(f"hf.co/{BIG}:Q4_K_M", progress=False)
    registry.pull(f"hf.co/{REPO}:Q8_0", progress=False)
    models = {m.name: m for m in registry.list_local()}
    assert set(models) == {f"hf.co/{BIG}:Q4_K_M", f"hf.co/{REPO}:Q8_0"}
    big = models[f"hf.co/{BIG}:Q4_K_M"]
    assert big.path == path and big.size_bytes == sum(len(d) for d in split_payloads[0].values())
    assert registry.resolve(big.name, download=False) == path
    removed = registry.remove(big.name)
    assert len(removed) == 6  # three snapshot links and their three blobs
    assert not download.repo_folder(BIG).exists()
    assert [m.name for m in registry.list_local()] == [f"hf.co/{REPO}:Q8_0"]


# --- CLI -----------------------------------------------------------------------------------


def test_cli_unknown_name_exit_1_one_line_with_suggestion(hub, capsys):
    assert main(["pull", "qwen3-0.6"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("edgeinfer: error: ") and "did you mean qwen3-0.6b" in err


def test_cli_pull_list_rm(hub, payloads, capsys):
    assert main(["pull", "-q", f"hf.co/{REPO}:Q8_0"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"pulled hf.co/{REPO}:Q8_0: ") and out.strip().endswith(Q8)

    assert main(["list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "SIZE", "MODIFIED"]
    assert len(lines) == 2 and lines[1].split()[0] == f"hf.co/{REPO}:Q8_0"
    assert "just now" in lines[1] or "minute" in lines[1]

    assert main(["rm", f"hf.co/{REPO}:Q8_0"]) == 0
    assert capsys.readouterr().out.strip() == f"deleted 'hf.co/{REPO}:Q8_0'"
    assert main(["list"]) == 0
    assert capsys.readouterr().out.splitlines() == ["NAME    SIZE    MODIFIED"]
    assert main(["rm", f"hf.co/{REPO}:Q8_0"]) == 1
    assert "not in the local store" in capsys.readouterr().err


def test_human_size_and_age():
    from datetime import datetime, timedelta

    from edgeinfer.commands.store import human_age
    from edgeinfer.units import human_bytes as human_size

    assert human_size(4_920_000_000) == "4.9 GB" and human_size(815_000_000) == "815 MB" and human_size(12) == "12 B"
    now = datetime(2026, 1, 10)
    assert human_age(now - timedelta(days=3), now) == "3 days ago"
    assert human_age(now - timedelta(seconds=5), now) == "just now"


def test_hf_hub_cache_overrides_hf_home(hub, payloads, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    path = registry.pull(f"hf.co/{REPO}:Q8_0", progress=False)
    assert path.is_relative_to(tmp_path / "elsewhere") and path.read_bytes() == payloads[Q8]
    assert [m.path for m in registry.list_local()] == [path]


def test_no_quant_asks_the_hub_when_only_another_quant_is_cached(hub, payloads):
    registry.pull(f"hf.co/{REPO}:Q8_0", progress=False)
    path = registry.resolve(f"hf.co/{REPO}", progress=False)
    assert path.name == Q4 and path.read_bytes() == payloads[Q4]


@pytest.mark.parametrize("bad", ["../evil.gguf", "a/../../evil.gguf", "/etc/x.gguf", "a\\..\\x.gguf"])
def test_file_names_that_leave_the_cache_are_refused(hub, bad):
    with pytest.raises(DownloadError, match="not a valid file name"):
        download.fetch(REPO, bad, progress=False)
    assert hub.requests == []


# --- unreachable hosts fail fast ---------------------------------------------------------------


@pytest.fixture
def silent_port():
    """A local port whose connection attempts hang, as an unroutable host's do: a listener
    that never accepts, its backlog already full, so the kernel drops further SYNs."""
    import socket

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    fillers = []
    for _ in range(4):  # fill the accept queue (Linux keeps backlog + 1 pending connections)
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(server.getsockname())
        fillers.append(s)
    probe = socket.socket()
    probe.settimeout(0.5)
    try:
        probe.connect(server.getsockname())
        hangs = False
    except (socket.timeout, BlockingIOError):
        hangs = True
    except OSError:
        hangs = False
    finally:
        probe.close()
    if not hangs:
        pytest.skip("this kernel answers connections to a full backlog")
    yield server.getsockname()[1]
    for s in fillers:
        s.close()
    server.close()


def _closed_port() -> int:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now: connection refused
    return port


@pytest.mark.parametrize("pull", [f"hf.co/{REPO}", f"hf.co/{REPO}:Q8_0"])
def test_pull_from_a_closed_port_fails_at_once(hub, monkeypatch, pull):
    import time

    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    t0 = time.monotonic()
    with pytest.raises(DownloadError, match="cannot reach http://127.0.0.1") as info:
        registry.pull(pull, progress=False)
    assert time.monotonic() - t0 < 2.0
    assert "\n" not in str(info.value)


def test_pull_from_a_host_that_never_answers_fails_within_the_connect_timeout(hub, monkeypatch, silent_port):
    import time

    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{silent_port}")
    monkeypatch.setattr(download, "CONNECT_TIMEOUT", 1.0)
    t0 = time.monotonic()
    with pytest.raises(DownloadError, match=r"cannot reach .* \(no answer within 1 s\)") as info:
        registry.pull(f"hf.co/{REPO}", progress=False)
    assert time.monotonic() - t0 < 2.5
    assert "\n" not in str(info.value)


def test_default_connect_timeout_is_three_seconds():
    assert download.CONNECT_TIMEOUT == 3.0


def test_the_proxy_is_probed_when_the_environment_names_one(hub, monkeypatch):
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{_closed_port()}")
    with pytest.raises(DownloadError, match="cannot reach"):
        download.check_reachable("probe", timeout=1.0)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    download.check_reachable("probe", timeout=1.0)  # the stand-in hub itself answers


def test_cli_pull_unreachable_is_one_line(hub, monkeypatch, capsys):
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    assert main(["pull", f"hf.co/{REPO}"]) == 1
    err = capsys.readouterr().err
    assert "cannot reach" in err and "Traceback" not in err and err.strip().count("\n") == 0
