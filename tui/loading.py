"""Where the chat screen's models come from: loading with progress, the first start's compile count, downloads."""

from __future__ import annotations

import inspect
import threading
from contextlib import contextmanager
from typing import Any, Callable

from edgeinfer.errors import EdgeInferError

# (name or path, n_ctx) -> edgeinfer.api.Model. A loader that also takes `progress=` gets a
# callable progress(stage, fraction) to report stages of controller.LOAD_STAGES ("read",
# "prepare", "compile", ...) with the share of the stage done (0..1, or None when unknown).
ModelLoader = Callable[..., Any]
# progress(stage, fraction=None, count=None): count is (done, total) kernels while compiling.
Progress = Callable[..., None]


def default_loader(name: str, n_ctx: int):
    import edgeinfer

    return edgeinfer.load(name, n_ctx=n_ctx)


def accepts_progress(loader: Callable) -> bool:
    """Whether `loader` takes a `progress=` keyword (then it reports its own stages)."""
    try:
        params = inspect.signature(loader).parameters
    except (TypeError, ValueError):
        return False
    return "progress" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


@contextmanager
def compile_reports(progress: Progress):
    """Inside the block, the first start's kernel compile count (kernels_cpu.compile_progress)
    goes to progress("compile", done/total, count=(done, total)) instead of stderr."""
    try:
        from edgeinfer.kernels_cpu import compile_progress
    except ImportError:  # no CPU kernels to compile
        yield
        return

    def report(done: int, total: int, finished: bool) -> None:
        progress("compile", done / max(total, 1), count=(done, total))

    previous = compile_progress.set_reporter(report)
    try:
        yield
    finally:
        if compile_progress.get_reporter() is report:  # a later load may have put its own in
            compile_progress.set_reporter(previous)


def open_model(load_model: ModelLoader, name: str, n_ctx: int, progress: Progress, *, warm_up: bool):
    """Load `name` with `load_model`, reporting stages (and the compile count) to `progress`;
    `warm_up` runs one token so the kernels are compiled (or read from the cache) before the
    first message. Raises what the loader raises."""
    with compile_reports(progress):
        if accepts_progress(load_model):
            model = load_model(name, n_ctx, progress=progress)
        else:
            progress("read")
            model = load_model(name, n_ctx)
        if warm_up:
            # The first forward pass compiles (or loads cached) kernels: say so, not freeze.
            progress("compile")
            model.generate(model.tokenize("Hello"), max_tokens=1, temperature=0.0)
            model.reset()
    return model


def pull_model(name: str, report: Callable[[int, int | None], None]) -> None:
    """Download `name` (alias or hf.co/…) into the Hub cache, reporting bytes done while it runs."""
    from edgeinfer.store.registry import pull

    done = threading.Event()
    watcher = threading.Thread(target=_watch_download, args=(name, report, done), daemon=True)
    watcher.start()
    try:
        pull(name, progress=False)  # a console bar would draw over the screen
    finally:
        done.set()
        watcher.join(2)


def _watch_download(name: str, report: Callable[[int, int | None], None], done: threading.Event) -> None:
    """Report the size of the download's `.incomplete` file every 0.2 s (download.fetch writes it)."""
    from edgeinfer.store import download, registry

    try:
        ref = registry.parse_hf_ref(name)
        entry = registry._alias(name)
        repo = ref.repo_id if ref else (entry.repo if entry else None)
    except EdgeInferError:
        repo = None
    if repo is None:
        return
    blobs = download.repo_folder(repo) / "blobs"
    total = None
    if entry is not None and getattr(entry, "size", None):
        total = entry.size
    while not done.wait(0.2):
        parts = list(blobs.glob("*.incomplete")) if blobs.is_dir() else []
        if parts:
            try:
                report(max(p.stat().st_size for p in parts), total)
            except (OSError, RuntimeError):
                return


def local_models() -> list[tuple[str, str]]:
    """(label, name) for every model `edgeinfer list` shows; its names resolve offline."""
    from edgeinfer.model_info import human_bytes
    from edgeinfer.store.registry import list_local

    return [(f"{m.name}  ({human_bytes(m.size_bytes)})", m.name) for m in list_local()]


def quantization_of(path) -> str:
    """The model file's quantization as `edgeinfer show` names it ("" when it cannot be read)."""
    from edgeinfer.loader import open_model as open_gguf
    from edgeinfer.model_info import describe

    try:
        return describe(open_gguf(path)).quantization
    except EdgeInferError:
        return ""


def short_name(name: str | None) -> str:
    """A model path shown by its file name; a model name as is."""
    if not name:
        return "no model"
    from pathlib import Path

    return Path(name).name if ("/" in name or name.endswith(".gguf")) and not name.startswith("hf.co/") else name
