"""`edgeinfer run` with layers on the GPU (the CUDA emulator where no GPU is) writes the CPU's
text, and says where the layers went.

Greedy text can only be compared up to a near tie: where the CPU's two best tokens are closer
than the GPU kernels' own rounding moves a logit (fp16 GEMM tiles, f32 attention, fast math),
either is a right answer. The prompt is one whose CPU continuation has no such tie for 12
tokens; the test measures that again and compares everything before the first tie.
"""

from __future__ import annotations

import os
import subprocess
import sys

import cuda_device
import pytest

import edgeinfer

cuda_device.require()

# the first of these whose CPU continuation has no near tie in its first 8 greedy tokens (the
# CPU follows the llama.cpp build of its ISA, so where the ties fall differs between CPUs)
PROMPTS = ("def fibonacci(n):", "The three primary colors are", "import numpy as np\n")
N_TOKENS = 12
NEAR_TIE = 0.3  # logits; the emulated GPU moves gemma3-270m's by < 0.1 (test_cuda_kernels' parity)


def _run(gemma_path, prompt: str, *flags: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if cuda_device.KIND == "emulator":
        env["EDGEINFER_CUDA"] = "emulate"
        env["EDGEINFER_CUDA_EMULATE_ORDER"] = "forward"
    return subprocess.run([sys.executable, "-m", "edgeinfer.cli", "run", str(gemma_path), "--raw", "--temp", "0",
                           "-n", str(N_TOKENS), "--verbose", *flags, prompt],
                          capture_output=True, text=True, env=env, timeout=900)


@pytest.mark.slow
def test_run_with_gpu_layers_writes_the_cpus_text(gemma_path):
    cpu_model = edgeinfer.load(str(gemma_path), gpu_layers=0, n_ctx=256)
    for prompt in PROMPTS:
        want = cpu_model.generate(prompt, max_tokens=N_TOKENS, temperature=0, logprobs=2)
        gaps = [lp.top[0][1] - lp.top[1][1] for lp in want.logprobs]
        tie_free = next((i for i, g in enumerate(gaps) if g < NEAR_TIE), len(gaps))
        if tie_free >= 8:
            break
    else:
        pytest.fail("every prompt's CPU continuation has a near tie before token 8: add another to PROMPTS")
    prefix = cpu_model.tokenizer.detokenize(want.tokens[:tie_free])
    cpu = _run(gemma_path, prompt, "-ngl", "0")
    assert cpu.returncode == 0, cpu.stderr
    assert cpu.stdout.startswith(prefix)
    n_layer = cpu_model.config.n_layer
    runs = [("99", f"{n_layer}/{n_layer}"), ("9", f"9/{n_layer}")]
    if cuda_device.KIND == "emulator":   # the whole model on the emulator took minutes; the tiny
        runs = runs[1:]                   # models' tests cover every layer and the head on the GPU
    for ngl, placed in runs:
        gpu = _run(gemma_path, prompt, "-ngl", ngl)
        assert gpu.returncode == 0, gpu.stderr
        assert f"offloading {placed} layers to GPU" in gpu.stderr, gpu.stderr
        if cuda_device.KIND == "emulator":
            assert "emulator" in gpu.stderr
        assert gpu.stdout.startswith(prefix), (ngl, gpu.stdout, prefix)
