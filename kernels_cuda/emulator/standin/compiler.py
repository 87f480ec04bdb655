"""pycuda.compiler on the emulator: SourceModule builds the source with g++ and the emulation header."""

from __future__ import annotations

import os
from pathlib import Path

from edgeinfer.kernels_cuda.emulator import build, kernel
from edgeinfer.kernels_cuda.emulator.standin.driver import Error, LogicError

# nvcc options that change nothing the emulator can show; anything else is refused by name
_HARMLESS = ("-O", "-std=", "-lineinfo", "-g", "-Xptxas", "-arch", "--generate-line-info", "-w")
_FAST_MATH = ("--use_fast_math", "-use_fast_math")


class CompileError(Error):
    pass


def default_cache_dir() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return root / "edgeinfer" / "cuda-emulator"


def _label_for(source: str) -> str:
    """The name of the kernels_cuda/*.cu file whose text (as compiled: generated.source_text)
    this is (for messages), else a generic one."""
    from edgeinfer.kernels_cuda.generated import source_text

    folder = Path(__file__).resolve().parents[2]
    for path in sorted(folder.glob("*.cu")):
        if source_text(path.name) == source:
            return path.name
    return "kernel.cu"


class SourceModule:
    def __init__(self, source: str, nvcc: str = "nvcc", options: list[str] | None = None, keep: bool = False,
                 no_extern_c: bool = False, arch: str | None = None, code: str | None = None,
                 cache_dir: str | None = None, include_dirs: tuple[str, ...] = ()) -> None:
        options = list(options or [])
        unknown = [o for o in options if o not in _FAST_MATH and not o.startswith(_HARMLESS)]
        if unknown or include_dirs:
            raise CompileError(f"the CUDA emulator does not take {' '.join(unknown + [*include_dirs])}")
        where = Path(cache_dir) / "emulator" if cache_dir else default_cache_dir()
        try:
            built = build.build(source, where, fast_math=any(o in _FAST_MATH for o in options),
                                wrap_extern_c=not no_extern_c, label=_label_for(source))
        except build.BuildError as exc:
            raise CompileError(str(exc)) from None
        self._library = kernel.Library(built)

    def get_function(self, name: str) -> kernel.Function:
        if name not in self._library.built.kernels:
            raise LogicError(f"cuModuleGetFunction failed: named symbol not found ({name})")
        return self._library.function(name)
