"""Build a .cu source for the CUDA emulator: g++ with `include/cuda_emu.h`, one shared library.

- The kernels are found by preprocessing the source with `EMU_SCAN`, which marks every
  `__global__` function and its `__launch_bounds__` in the output.
- Each kernel gets two C entry points: `__emu_launch_<name>` (runs it over a grid) and
  `__emu_sig_<name>` (its parameters' kinds and sizes, for the argument check).
- Static shared memory per kernel is read from the built library: the `emu_shared` symbols
  the kernel's code reaches (objdump), summed.
- The cache is keyed by the text of the source, the headers and the flags, never by a file's
  name or date; a build is written to a temporary name and renamed, under a lock, so two
  processes never build the same key at once or read half a library.
"""

from __future__ import annotations

import ast
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

INCLUDE = Path(__file__).resolve().parent / "include"
# hidden visibility and no unique symbols: a kernel's static __shared__ variables (function-local
# statics, templates' too) become local symbols its code addresses directly, which
# static_shared_vars reads back; only the entry points are exported
CXX_FLAGS = ["-O2", "-std=c++17", "-fPIC", "-shared", "-fno-strict-aliasing", "-U_FORTIFY_SOURCE",
             "-D_FORTIFY_SOURCE=0", "-fvisibility=hidden", "-fvisibility-inlines-hidden", "-fno-gnu-unique",
             "-Wno-unknown-pragmas"]
_META_FORMAT = "2"  # the cached metadata's layout: a change rebuilds rather than misreads old caches
_KERNEL = re.compile(r'(?:extern\s+"C"\s+)?__emu_kernel__\s+void\s+')
_IDENT = re.compile(r"[A-Za-z_]\w*")


class BuildError(RuntimeError):
    """The source does not compile for the emulator (the compiler's message follows)."""


@dataclass(frozen=True)
class Kernel:
    name: str
    params: tuple[str, ...]  # parameter names, in order
    launch_bounds: int | None  # max threads per block from __launch_bounds__, if declared
    shared_vars: tuple[tuple[int, int], ...]  # (offset in the library, bytes) of its static __shared__
    sig_address: int  # where its __emu_sig_ entry point lies in the library file (finds the load base)

    @property
    def static_shared(self) -> int:
        """Bytes of static __shared__ memory the kernel reaches."""
        return sum(size for _, size in self.shared_vars)


@dataclass(frozen=True)
class Built:
    library: Path
    kernels: dict[str, Kernel]


def compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise BuildError("the CUDA emulator needs a C++ compiler (g++ 12 or newer) on PATH")
    return cxx


def _headers_text() -> str:
    return "".join(p.read_text() for p in sorted(INCLUDE.glob("*.h")))


def _compiler_version(cxx: str) -> str:
    return subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[0]


def _defines(fast_math: bool) -> list[str]:
    """-DEMU_FAST_MATH for --use_fast_math; -mf16c where the CPU has F16C (fp16 conversions in
    hardware, same results)."""
    out = ["-DEMU_FAST_MATH"] if fast_math else []
    return out + (["-mf16c"] if _has_f16c() else [])


def _has_f16c() -> bool:
    try:
        return " f16c" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def build(source: str, cache_dir: Path, *, fast_math: bool, wrap_extern_c: bool = False,
          label: str = "kernel.cu") -> Built:
    """The emulator library of `source`, built or taken from `cache_dir`; `label` is the file
    name its messages give (`__FILE__`)."""
    cxx = compiler()
    text = 'extern "C" {\n' + source + "\n}\n" if wrap_extern_c else source
    key = hashlib.sha256("\0".join([text, _headers_text(), " ".join(CXX_FLAGS + _defines(fast_math)),
                                    _compiler_version(cxx), label, _META_FORMAT]).encode()).hexdigest()[:32]
    cache_dir.mkdir(parents=True, exist_ok=True)
    library, meta = cache_dir / f"{key}.so", cache_dir / f"{key}.json"
    with open(cache_dir / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (library.exists() and meta.exists()):
            _build(cxx, text, label, fast_math, library, meta)
    kernels = json.loads(meta.read_text())
    return Built(library, {k["name"]: Kernel(k["name"], tuple(k["params"]), k["launch_bounds"],
                                             tuple(tuple(v) for v in k["shared_vars"]), k["sig_address"])
                           for k in kernels})


def _build(cxx: str, text: str, label: str, fast_math: bool, library: Path, meta: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="edgeinfer-emu-") as tmp:
        src = Path(tmp) / "source.cu"
        src.write_text(text)
        scanned = _run([cxx, "-E", "-P", "-DEMU_SCAN", "-std=c++17", "-I", str(INCLUDE), *_defines(fast_math),
                        "-include", "cuda_emu.h", "-x", "c++", str(src)], label)
        kernels = scan_kernels(scanned)
        if not kernels:
            raise BuildError(f"{label}: no __global__ function found")
        unit = Path(tmp) / "unit.cpp"
        unit.write_text(f'#include "cuda_emu.h"\n#line 1 "{label}"\n{text}\n#line 1 "<emulator entry points>"\n'
                        + "".join(_entry_points(k["name"]) for k in kernels))
        out = Path(tmp) / "lib.so"
        _run([cxx, *CXX_FLAGS, *_defines(fast_math), "-I", str(INCLUDE), "-o", str(out), str(unit)], label)
        symbols = _symbols(out)  # read once: the shared variables and the entry points' addresses
        shared = static_shared_vars(out, [k["name"] for k in kernels], symbols)
        addresses = {name: addr for name, addr, _, _, _ in symbols}
        for k in kernels:
            k["shared_vars"] = shared.get(k["name"], [])
            k["sig_address"] = addresses[f"__emu_sig_{k['name']}"]
        tmp_lib = library.with_suffix(f".so.{os.getpid()}")
        shutil.copyfile(out, tmp_lib)
        os.replace(tmp_lib, library)
        tmp_meta = meta.with_suffix(f".json.{os.getpid()}")
        tmp_meta.write_text(json.dumps(kernels))
        os.replace(tmp_meta, meta)


def _run(cmd: list[str], label: str) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(f"{label} does not compile for the CUDA emulator:\n{proc.stderr.strip()[-4000:]}")
    return proc.stdout


def _entry_points(name: str) -> str:
    # parameter names a kernel's own name cannot clash with
    export = 'extern "C" __attribute__((visibility("default"))) int'
    return (f'{export} __emu_launch_{name}(void** emu_a_, const unsigned* emu_g_, const unsigned* emu_b_, '
            f'int emu_rev_, char* const* emu_sh_, const long long* emu_shn_, int emu_nsh_, char* emu_e_, '
            f'int emu_n_) {{\n    return ::emu::launch_kernel("{name}", &{name}, emu_a_, emu_g_, emu_b_, emu_rev_, '
            f'{{emu_sh_, emu_shn_, emu_nsh_}}, emu_e_, emu_n_);\n}}\n'
            f'{export} __emu_sig_{name}(char* emu_k_, int* emu_s_, int* emu_t_, int emu_m_) {{\n'
            f'    return ::emu::signature(&{name}, emu_k_, emu_s_, emu_t_, emu_m_);\n}}\n')


def _balanced(text: str, start: int) -> int:
    """Index just past the parenthesis group opening at text[start] == '('."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return i + 1
    raise BuildError("unbalanced parentheses in a kernel declaration")


def scan_kernels(pre: str) -> list[dict]:
    """[{name, params, launch_bounds}] of every __global__ function in preprocessed text."""
    found: dict[str, dict] = {}
    for m in _KERNEL.finditer(pre):
        pos = m.end()
        bounds = None
        if pre.startswith("__emu_launch_bounds__", pos):
            open_at = pre.index("(", pos)
            close = _balanced(pre, open_at)
            bounds = _const_int(pre[open_at + 1:close - 1].split(",")[0])
            pos = close
        while pos < len(pre) and pre[pos].isspace():
            pos += 1
        name = _IDENT.match(pre, pos)
        if not name:
            continue
        open_at = pre.index("(", name.end())
        params_text = pre[open_at + 1:_balanced(pre, open_at) - 1]
        params = [p.strip() for p in params_text.split(",") if p.strip() and p.strip() != "void"]
        names = tuple((_IDENT.findall(p) or ["?"])[-1] for p in params)
        found[name.group(0)] = {"name": name.group(0), "params": names, "launch_bounds": bounds}
    return list(found.values())


def _const_int(expr: str) -> int | None:
    """An integer constant expression of numbers and + - * / ( ), or None."""
    try:
        tree = ast.parse(expr.strip().rstrip("uUlL"), mode="eval")
    except SyntaxError:
        return None
    ok = all(isinstance(n, (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Add, ast.Sub, ast.Mult,
                            ast.Div, ast.FloorDiv, ast.USub, ast.UAdd)) for n in ast.walk(tree))
    if not ok:
        return None
    value = eval(compile(tree, "<launch bounds>", "eval"), {"__builtins__": {}})  # numbers only, checked above
    return int(value)


_FUNC = re.compile(r"^[0-9a-f]+ <(.+)>:$")
_REF = re.compile(r"<([^<>+]+)(?:\+0x[0-9a-f]+)?>")


def _symbols(library: Path) -> list[tuple[str, int, int, str, str]]:
    """(name, address, size, section, binding) of each symbol in the library's table."""
    out = []
    for line in subprocess.run(["objdump", "-t", str(library)], capture_output=True, text=True).stdout.splitlines():
        parts = line.split()
        if len(parts) >= 6 and re.fullmatch(r"[0-9a-f]{8,}", parts[0]):
            out.append((parts[-1], int(parts[0], 16), int(parts[-2], 16), parts[-3], parts[1]))
    return out


def static_shared_vars(library: Path, kernels: list[str],
                       symbols: list[tuple[str, int, int, str, str]]) -> dict[str, list[tuple[int, int]]]:
    """(address in the library, bytes) of the static __shared__ variables each kernel's code
    reaches, through the calls it makes: the function-local statics (`_ZZ...`) outside the
    emulator's own namespaces (`symbols`: the library's table, as _symbols reads it)."""
    shared = {name: (addr, size) for name, addr, size, section, _ in symbols
              if name.startswith("_ZZ") and not name.startswith(("_ZZN3emu", "_ZZN6nvcuda"))
              and section in (".bss", ".data") and size > 0}
    if not shared:
        return {}
    code = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(library)], capture_output=True, text=True).stdout
    refs: dict[str, set[str]] = {}
    current = None
    for line in code.splitlines():
        m = _FUNC.match(line.strip())
        if m:
            current = m.group(1)
            refs[current] = set()
        elif current is not None:
            refs[current].update(r.split("@")[0] for r in _REF.findall(line))
    out = {}
    for k in kernels:
        seen, todo = set(), [k]
        while todo:
            f = todo.pop()
            if f not in seen:
                seen.add(f)
                todo.extend(refs.get(f, ()))
        out[k] = sorted(shared[s] for s in seen if s in shared)
    return out

