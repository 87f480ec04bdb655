"""Fetch single files from the Hugging Face Hub into its standard cache, resumably and verified.

The file lands where `hf_hub_download` would put it (`$HF_HUB_CACHE/models--owner--repo/
blobs/<etag>` with a `snapshots/<commit>/<file>` link and `refs/<revision>`), so `hf` tools and
`scan_cache_dir` see it. We do the transfer ourselves (with huggingface_hub's `http_get`, which
brings the tqdm bar, Range retries and the Hub's error types) because recent huggingface_hub
deletes a partial download when it fails; a multi-GB model must survive Ctrl-C and resume.

Environment is read at call time (HF_ENDPOINT, HF_HOME, HF_HUB_CACHE, HF_HUB_OFFLINE), not at
import time as huggingface_hub.constants does, so a changed environment takes effect.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
import re
import socket
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from edgeinfer.errors import DownloadError

# huggingface_hub is imported inside the functions that need it: it takes ~0.3 s to import, which
# `edgeinfer run ./model.gguf` and the offline demo model should not pay.

DEFAULT_REVISION = "main"
_TRUE = {"1", "ON", "YES", "TRUE"}
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_GIT_SHA1 = re.compile(r"^[0-9a-f]{40}$")
_SAFE_COMPONENT = re.compile(r"^[\w.-]+$")  # one path component from the Hub's headers
# An unreachable Hub must fail in seconds: huggingface_hub retries a failed connection five
# times with 1-8 s pauses (about 25 s), so a TCP connect with this timeout goes first.
CONNECT_TIMEOUT = 3.0


@dataclass(frozen=True)
class RemoteFile:
    """One file of a Hub repo as the tree API lists it."""

    path: str
    size: int
    sha256: str | None  # LFS files only


# --- environment -------------------------------------------------------------------------


def hub_cache_dir() -> Path:
    """The Hub cache folder: HF_HUB_CACHE, else HF_HOME/hub, else XDG_CACHE_HOME or ~/.cache."""
    def expand(value: str) -> Path:
        return Path(os.path.expandvars(os.path.expanduser(value)))

    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return expand(os.environ[var])
    if os.environ.get("HF_HOME"):
        return expand(os.environ["HF_HOME"]) / "hub"
    return expand(os.environ.get("XDG_CACHE_HOME") or "~/.cache") / "huggingface" / "hub"


def hub_endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def is_offline() -> bool:
    flag = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return flag.upper() in _TRUE


def repo_folder(repo_id: str) -> Path:
    return hub_cache_dir() / ("models--" + repo_id.replace("/", "--"))


# --- the local cache ---------------------------------------------------------------------


def _read_ref(repo_id: str, revision: str) -> str | None:
    if _GIT_SHA1.fullmatch(revision):
        return revision
    ref = repo_folder(repo_id) / "refs" / revision
    return ref.read_text().strip() if ref.is_file() else None


def cached_file(repo_id: str, filename: str, revision: str = DEFAULT_REVISION) -> Path | None:
    """The cached copy of `filename` at `revision`, or None. Never touches the network."""
    commit = _read_ref(repo_id, revision)
    if commit is None:
        return None
    path = repo_folder(repo_id) / "snapshots" / commit / filename
    return path if path.is_file() else None  # is_file follows the link: a dangling one is absent


def cached_filenames(repo_id: str, revision: str = DEFAULT_REVISION) -> list[str]:
    """Files (repo-relative, '/'-separated) cached for `revision`. Never touches the network."""
    commit = _read_ref(repo_id, revision)
    if commit is None:
        return []
    root = repo_folder(repo_id) / "snapshots" / commit
    if not root.is_dir():
        return []
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


# --- the Hub -----------------------------------------------------------------------------


@contextmanager
def _quiet_hub_logs():
    """huggingface_hub logs a warning per retry; the user gets our one-line error instead."""
    logger = logging.getLogger("huggingface_hub")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def http_get(url: str, temp_file, **kwargs) -> None:
    """huggingface_hub's `http_get`: streams with a tqdm bar, retries a dropped link with Range."""
    from huggingface_hub.file_download import http_get as hf_http_get

    hf_http_get(url, temp_file, **kwargs)


def _hub_error(exc: BaseException, what: str) -> DownloadError:
    """Turn huggingface_hub / HTTP exceptions into one line a user can act on."""
    from huggingface_hub import errors as hf_errors

    if isinstance(exc, hf_errors.GatedRepoError):
        return DownloadError(f"{what}: the repo is gated; accept its license on huggingface.co and run `hf auth login`")
    if isinstance(exc, hf_errors.RepositoryNotFoundError):
        return DownloadError(f"{what}: repository not found on {hub_endpoint()} (or it is private)")
    if isinstance(exc, hf_errors.RevisionNotFoundError):
        return DownloadError(f"{what}: revision not found")
    if isinstance(exc, hf_errors.EntryNotFoundError):
        return DownloadError(f"{what}: file not found in the repository")
    if isinstance(exc, hf_errors.OfflineModeIsEnabled):
        return DownloadError(f"{what}: not in the local cache and HF_HUB_OFFLINE is set")
    if isinstance(exc, hf_errors.HfHubHTTPError):
        status = getattr(getattr(exc, "response", None), "status_code", "?")
        return DownloadError(f"{what}: the Hub answered HTTP {status}")
    # Transport errors: httpx2 / httpx / requests all name them ...Error / ...Timeout.
    kind = type(exc).__name__
    if "Timeout" in kind or "Connect" in kind or isinstance(exc, (ConnectionError, TimeoutError)):
        return DownloadError(f"{what}: cannot reach {hub_endpoint()} ({kind}); check your connection or set HF_HUB_OFFLINE=1")
    detail = str(exc).splitlines()[0] if str(exc) else kind
    return DownloadError(f"{what}: {detail}")


def _proxy_for(scheme: str) -> str | None:
    for var in (f"{scheme}_proxy", "all_proxy"):
        value = os.environ.get(var) or os.environ.get(var.upper())
        if value:
            return value
    return None


def _bypasses_proxy(host: str) -> bool:
    rules = os.environ.get("no_proxy") or os.environ.get("NO_PROXY") or ""
    for rule in (r.strip().lstrip(".") for r in rules.split(",")):
        if rule == "*" or (rule and (host == rule or host.endswith("." + rule))):
            return True
    return False


def check_reachable(what: str, timeout: float | None = None) -> None:
    """Raise the one-line DownloadError at once when the Hub (or the proxy the environment
    names for it) does not accept a TCP connection within `timeout` seconds (CONNECT_TIMEOUT)."""
    from urllib.parse import urlsplit

    timeout = CONNECT_TIMEOUT if timeout is None else timeout
    endpoint = hub_endpoint()
    parts = urlsplit(endpoint)
    scheme = parts.scheme or "https"
    target = parts
    proxy = None if _bypasses_proxy(parts.hostname or "") else _proxy_for(scheme)
    if proxy:
        target = urlsplit(proxy if "://" in proxy else "http://" + proxy)
    host = target.hostname
    if not host:
        return  # nothing we can probe: let huggingface_hub report it
    try:
        port = target.port or (443 if target.scheme == "https" else 80)
    except ValueError:
        return
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except socket.timeout:
        raise DownloadError(f"{what}: cannot reach {endpoint} (no answer within {timeout:g} s); "
                            "check your connection or set HF_HUB_OFFLINE=1") from None
    except OSError as exc:
        kind = "DNS lookup failed" if isinstance(exc, socket.gaierror) else (exc.strerror or type(exc).__name__)
        raise DownloadError(f"{what}: cannot reach {endpoint} ({kind}); "
                            "check your connection or set HF_HUB_OFFLINE=1") from None


def _hub_call(what: str, fn, *args, **kwargs):
    """Run a huggingface_hub call, mapping its failures to DownloadError."""
    try:
        with _quiet_hub_logs(), _hub_offline_from_environment():
            return fn(*args, **kwargs)
    except DownloadError:
        raise
    except Exception as exc:  # noqa: BLE001 - the HTTP stack's error types vary by version
        if _is_transport_or_hub_error(exc):
            raise _hub_error(exc, what) from exc
        raise


@contextmanager
def _hub_offline_from_environment():
    """huggingface_hub reads HF_HUB_OFFLINE once, at its import; this call follows the
    environment as it is now (a server started offline may be told the Hub is reachable)."""
    from huggingface_hub import constants

    before = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = is_offline()
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = before


def _is_transport_or_hub_error(exc: BaseException) -> bool:
    from huggingface_hub import errors as hf_errors

    if isinstance(exc, (hf_errors.HfHubHTTPError, hf_errors.EntryNotFoundError, hf_errors.OfflineModeIsEnabled,
                        hf_errors.FileMetadataError, OSError)):
        return True
    module = type(exc).__module__ or ""
    return module.split(".")[0] in {"httpx", "httpx2", "httpcore", "requests", "urllib3"}


def list_remote_files(repo_id: str, revision: str = DEFAULT_REVISION) -> list[RemoteFile]:
    """All files of a Hub repo (recursive), with sizes and LFS sha256."""
    if is_offline():
        raise DownloadError(f"cannot list hf.co/{repo_id}: HF_HUB_OFFLINE is set")
    check_reachable(f"cannot list hf.co/{repo_id}")
    import huggingface_hub

    api = huggingface_hub.HfApi(endpoint=hub_endpoint())

    def _list() -> list[RemoteFile]:
        out = []
        for entry in api.list_repo_tree(repo_id, recursive=True, revision=revision):
            if isinstance(entry, huggingface_hub.hf_api.RepoFile):
                sha = entry.lfs.sha256 if entry.lfs is not None else None
                out.append(RemoteFile(entry.path, entry.size, sha))
        return out

    return _hub_call(f"cannot list hf.co/{repo_id}", _list)


# --- download ----------------------------------------------------------------------------


def fetch(repo_id: str, filename: str, *, revision: str = DEFAULT_REVISION, progress=True) -> Path:
    """Download `filename` of `repo_id` into the Hub cache (resuming a partial download) and
    return its snapshot path. Contacts the Hub even when cached, to pick up a newer revision.
    `progress`: True for a console bar, False for none, or a callable(bytes_done, total)."""
    what = f"cannot download {filename} from hf.co/{repo_id}"
    parts = filename.split("/")
    if filename.startswith("/") or "\\" in filename or any(p in ("", ".", "..") for p in parts):
        raise DownloadError(f"{what}: not a valid file name inside a repository")
    if is_offline():
        local = cached_file(repo_id, filename, revision)
        if local is not None:
            return local
        raise DownloadError(f"{what}: not in the local cache and HF_HUB_OFFLINE is set")

    check_reachable(what)
    import filelock
    import huggingface_hub

    endpoint = hub_endpoint()
    url = huggingface_hub.hf_hub_url(repo_id, filename, revision=revision, endpoint=endpoint)
    meta = _hub_call(what, huggingface_hub.get_hf_file_metadata, url, endpoint=endpoint)
    if not meta.commit_hash or not meta.etag:
        raise DownloadError(f"{what}: {endpoint} did not answer like the Hugging Face Hub (no commit or ETag)")
    # These become path components: refuse anything that could step outside the cache.
    if not all(_SAFE_COMPONENT.fullmatch(v) and v not in (".", "..") for v in (meta.commit_hash, meta.etag)):
        raise DownloadError(f"{what}: the Hub sent a malformed commit hash or ETag")

    storage = repo_folder(repo_id)
    blob = storage / "blobs" / meta.etag
    pointer = storage / "snapshots" / meta.commit_hash / filename
    blob.parent.mkdir(parents=True, exist_ok=True)
    lock_path = hub_cache_dir() / ".locks" / storage.name / f"{meta.etag}.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)

    with filelock.FileLock(str(lock_path)):
        if not (pointer.is_file() or blob.is_file()):
            # xet-backed repos: the resolve URL redirects to the byte server; otherwise use the
            # (signed CDN) location the HEAD returned.
            source = url if getattr(meta, "xet_file_data", None) is not None else (meta.location or url)
            _download_blob(source, blob, expected_size=meta.size, etag=meta.etag,
                           filename=filename, progress=progress, what=what)
        if not pointer.is_file():
            _link(blob, pointer)
        if revision != meta.commit_hash:
            ref = storage / "refs" / revision
            ref.parent.mkdir(parents=True, exist_ok=True)
            if not ref.is_file() or ref.read_text() != meta.commit_hash:
                ref.write_text(meta.commit_hash)
    return pointer


def _download_blob(url: str, blob: Path, *, expected_size: int | None, etag: str, filename: str,
                   progress, what: str) -> None:
    """GET `url` into `blob.incomplete` (appending to what an earlier attempt left), check size
    and hash against the Hub's metadata, then move it to `blob`."""
    partial = blob.with_name(blob.name + ".incomplete")
    resume = partial.stat().st_size if partial.is_file() else 0
    if expected_size is not None and resume > expected_size:  # cannot be ours: start over
        partial.unlink()
        resume = 0
    import huggingface_hub
    from huggingface_hub.file_download import http_get as hf_http_get

    kwargs = {"resume_size": resume, "headers": huggingface_hub.utils.build_hf_headers(),
              "expected_size": expected_size, "displayed_filename": filename}
    if progress is not True and "tqdm_class" in inspect.signature(hf_http_get).parameters:
        kwargs["tqdm_class"] = _silent_tqdm_class(progress if callable(progress) else None)
    try:
        with partial.open("ab") as out, _quiet_hub_logs(), _hub_offline_from_environment():
            http_get(url, out, **kwargs)
    except Exception as exc:  # noqa: BLE001
        if not _is_transport_or_hub_error(exc):
            raise
        done = partial.stat().st_size if partial.is_file() else 0
        total = f" of {expected_size}" if expected_size else ""
        base = _hub_error(exc, what)
        # Keep the partial file: the next attempt continues from it with a Range request.
        raise DownloadError(f"{base} (stopped after {done}{total} bytes; run it again to resume)") from exc
    _verify(partial, expected_size=expected_size, etag=etag, what=what)
    os.replace(partial, blob)


def _silent_tqdm_class(report=None):
    """A bar that draws nothing; with `report`, it calls report(bytes_done, total) as bytes
    arrive (an exception it raises stops the download, keeping the partial file)."""
    from huggingface_hub.utils import tqdm

    class SilentTqdm(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)
            self.done = kwargs.get("initial") or 0  # a disabled bar does not count self.n
            if report is not None:
                report(self.done, self.total)

        def update(self, n=1):
            self.done += n or 0
            if report is not None:
                report(self.done, self.total)
            return super().update(n)

    return SilentTqdm


def _verify(path: Path, *, expected_size: int | None, etag: str, what: str) -> None:
    """Size, then content hash: an LFS ETag is the file's sha256, a plain one its git blob sha1."""
    size = path.stat().st_size
    problem = None
    if expected_size is not None and size != expected_size:
        problem = f"size {size} bytes, expected {expected_size}"
    elif _SHA256.fullmatch(etag):
        digest = file_sha256(path)
        if digest != etag:
            problem = f"sha256 {digest[:12]}…, expected {etag[:12]}…"
    elif _GIT_SHA1.fullmatch(etag):
        digest = _git_blob_sha1(path)
        if digest != etag:
            problem = f"git sha1 {digest[:12]}…, expected {etag[:12]}…"
    if problem:
        path.unlink(missing_ok=True)  # a corrupt file must not be resumed or reused
        raise DownloadError(f"{what}: downloaded file is corrupt ({problem}); it was deleted, try again")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def _git_blob_sha1(path: Path) -> str:
    digest = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def _link(blob: Path, pointer: Path) -> None:
    """snapshots/<commit>/<file> -> ../../blobs/<etag>, as huggingface_hub lays it out."""
    pointer.parent.mkdir(parents=True, exist_ok=True)
    if pointer.is_symlink():  # dangling: its blob was deleted
        pointer.unlink()
    try:
        pointer.symlink_to(os.path.relpath(blob, pointer.parent))
    except OSError:  # no symlinks (Windows without developer mode): keep the file in the snapshot
        os.replace(blob, pointer)
