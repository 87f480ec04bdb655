"""Compile-only resource budgets of the CUDA kernels, from ptxas itself (no GPU needed).

For sm_86 and sm_89 (the consumer RTX cards), with the runtime's flags, warnings as errors:
- no spills and no stack frame (local memory) in any kernel;
- registers x the threads the launcher gives it fit a block's 64K registers;
- static shared memory within the 48 KiB a block may have;
- the GEMM kernels use the tensor cores (HMMA for F32/F16 weights, IMMA for the quantized ones,
  in their SASS), where cuobjdump is installed.
`python tests/test_cuda_budgets.py` prints the per-kernel report.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from edgeinfer.kernels_cuda.generated import source_text  # noqa: E402
from edgeinfer.kernels_cuda.runtime import SOURCES, nvcc_options  # noqa: E402

NVCC = shutil.which("nvcc")
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH: no ptxas report")
ARCHS = ("sm_86", "sm_89")
REGISTERS_PER_BLOCK = 65536
MAX_STATIC_SHARED = 48 * 1024
# the most threads kernels_cuda/launch.py gives each kernel a block (one table, checked below
# against the kernel names ptxas reports)
LAUNCH_THREADS = {"matvec": 128, "gemm": 128, "dequant": 256, "kv_store": 128, "flash_attention_prefill": 256,
                  "paged_decode_attention": 128, "rms_norm": 1024, "layer_norm": 1024, "pad_cols": 256, "rope": 256, "silu_mul": 256, "gelu_mul": 256,
                  "gelu": 256, "mul": 256, "mul_rows": 256, "scale_rows": 256, "scale": 256, "add": 256, "add_rows": 256, "swiglu_oai": 256, "add_id": 256, "moe_combine": 256,
                  "gated_delta_net": 128, "ssm_conv_silu": 256, "delta_gates": 256, "l2_norm_rows": 128,
                  "sigmoid_mul": 256, "qkv_split_norm": 128, "kv_store_quant": 32, "hadamard_rows": 32,
                  "kv_positions": 32, "flash_attention_tc": 128}
_ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(sm_\d+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:.*?, (\d+) bytes smem)?")


def threads_for(kernel: str) -> int:
    for prefix in sorted(LAUNCH_THREADS, key=len, reverse=True):
        if kernel == prefix or kernel.startswith(prefix + "_"):
            return LAUNCH_THREADS[prefix]
    raise KeyError(f"{kernel}: add its block size from launch.py to LAUNCH_THREADS")


def ptxas_report(source: str, arch: str, out_dir: Path) -> tuple[list[dict], str, Path]:
    """[{kernel, registers, stack, spill_stores, spill_loads, smem}] and ptxas' whole output."""
    cubin = out_dir / f"{Path(source).stem}_{arch}.cubin"
    compiled = out_dir / f"{Path(source).stem}_{arch}.cu"  # the source as the runtime compiles it
    compiled.write_text(source_text(source))
    cmd = [NVCC, "-cubin", f"-arch={arch}", *nvcc_options(arch), "-Xptxas", "-v,-warn-spills,-warn-lmem-usage",
           "--resource-usage", "-Werror", "all-warnings", str(compiled), "-o", str(cubin)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-3000:]
    rows, current = [], None
    for line in text.splitlines():
        if m := _ENTRY.search(line):
            current = {"kernel": m.group(1)}
            rows.append(current)
        elif current is not None and (m := _FRAME.search(line)):
            current.update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        elif current is not None and (m := _USED.search(line)):
            current.update(registers=int(m.group(1)), smem=int(m.group(2) or 0))
    return rows, text, cubin


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    out = tmp_path_factory.mktemp("ptxas")
    return {(src, arch): ptxas_report(src, arch, out) for src in SOURCES for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("source", SOURCES)
def test_kernels_fit_their_budgets(reports, source, arch):
    rows, text, _ = reports[(source, arch)]
    assert rows, f"ptxas reported no kernel for {source}"
    assert "warning" not in text.lower(), text
    for r in rows:
        name = r["kernel"]
        assert r["stack"] == 0 and r["spill_stores"] == 0 and r["spill_loads"] == 0, (arch, r)
        assert r["registers"] * threads_for(name) <= REGISTERS_PER_BLOCK, (arch, r, threads_for(name))
        assert r["smem"] <= MAX_STATIC_SHARED, (arch, r)


def _cuobjdump() -> str | None:
    """cuobjdump on PATH, or the one the nvidia-cuda-cuobjdump wheel (a test dependency) ships
    (beside nvdisasm, from nvidia-cuda-nvdisasm, which it runs)."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import nvidia
    except ImportError:
        return None
    for root in nvidia.__path__:
        for path in sorted(Path(root).glob("cu*/bin/cuobjdump")):
            return str(path)
    return None


def test_the_gemm_kernels_use_tensor_cores(reports):
    cuobjdump = _cuobjdump()
    if cuobjdump is None:
        pytest.skip("cuobjdump is not installed (pip install nvidia-cuda-cuobjdump): SASS not read")
    _, _, cubin = reports[("quant.cu", "sm_86")]
    env = dict(os.environ, PATH=f"{Path(cuobjdump).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    proc = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    sass = proc.stdout
    functions = re.split(r"\n\s*Function : ", sass)
    gemms = {f.split()[0]: f for f in functions if f.startswith("gemm_")}
    assert gemms
    for name, body in gemms.items():  # float weights on fp16 tensor cores, quantized ones on int8 (MMQ)
        assert ("HMMA" if name.split("_")[-1] in ("f32", "f16") else "IMMA") in body, name


def main() -> None:
    """Print the per-kernel resource report (the closing notes quote it)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        print(f"{'arch':6} {'kernel':26} {'regs':>4} {'threads':>7} {'regs x threads':>14} {'smem':>6} "
              f"{'stack':>5} {'spills':>6}")
        for arch in ARCHS:
            for src in SOURCES:
                for r in ptxas_report(src, arch, Path(tmp))[0]:
                    t = threads_for(r["kernel"])
                    print(f"{arch:6} {r['kernel']:26} {r['registers']:4} {t:7} {r['registers'] * t:14} "
                          f"{r['smem']:6} {r['stack']:5} {r['spill_stores'] + r['spill_loads']:6}")


if __name__ == "__main__":
    main()
