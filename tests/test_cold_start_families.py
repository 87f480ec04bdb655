"""Issue #57: no kernel compiles, or loads from Numba's cache, after load, for any model
family and any prompt length from 1 to 600, on either ISA.

Running 600 prompts a family would take minutes. The kernels a prompt reaches change only
where the dispatch's answer changes (short-batch crossovers, the 8-bit GEMM cut-offs, the
long-prompt attention, the prefill's chunks), so the lengths come from the dispatch
itself: the child groups 1..600 by what CpuBackend.prompt_reach gives for each of its
engine's chunks (an encoder's input: one pass) and runs the first and last length of
every group. The same grouping, on
a forced AVX2 and a forced AVX-512 VNNI host, is checked against the cold start's plan
(kernels_cpu.prompt_plan.prompt_plan) here, without compiling anything.
"""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from gguf_factory import GEMMA4_SHAPE, TinyShape, bpe_vocab, spm_vocab, write_tiny_model
from gguf_factory_embed import write_tiny_encoder

from edgeinfer.backends.cpu import attention_path
from edgeinfer.backends.offload import is_expert_tensor
from edgeinfer.engine import Engine, EngineOptions
from edgeinfer.gguf_file import GGUFFile
from edgeinfer.kernels_cpu import gemm_kquant, repack, tile_gemm
from edgeinfer.kernels_cpu.quant_kernels import Q4_K_X8
from edgeinfer.models import ARCHITECTURES

MATVEC = importlib.import_module("edgeinfer.kernels_cpu.matvec")
PLAN = importlib.import_module("edgeinfer.kernels_cpu.prompt_plan")
MAX_PROMPT = 600
N_CTX = 1024

# Each family in the kinds of types its published files mix (a few kernel sets in all, so
# that a cold cache compiles little). Qwen 3.5's ssm_alpha / ssm_beta have 4 rows here:
# not in eights, they take the dequantizing BLAS path on long prompts.
_K = {"ffn_down.weight": "Q6_K", "ffn_down_exps.weight": "Q6_K"}
FIXTURES = {
    "llama": ("Q4_K", _K), "gemma3": ("Q4_K", _K), "gemma4": ("Q4_K", _K), "qwen3moe": ("Q4_K", _K),
    "qwen35": ("Q4_K", _K), "qwen35moe": ("Q4_K", _K),
    "qwen2": ("Q8_0", {}), "qwen3": ("Q8_0", {}),
    "gpt-oss": ("Q8_0", {"_exps.weight": "MXFP4"}),
    # the encoders (embeddings only): an input of up to 600 tokens fits their position table
    "bert": ("Q8_0", {}), "nomic-bert": ("Q8_0", {}),
}
ENCODERS = {name for name, family in ARCHITECTURES.items() if not family.GENERATES}


def test_every_family_has_a_fixture():
    assert set(FIXTURES) == set(ARCHITECTURES) and ENCODERS < set(FIXTURES)


@pytest.fixture(scope="module")
def family_files(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("families")
    out = {}
    for arch, (qtype, mixed) in FIXTURES.items():
        if arch in ENCODERS:
            out[arch] = str(write_tiny_encoder(root / f"{arch}.gguf", arch, qtype, n_ctx_train=N_CTX))
            continue
        # gemma4: E2B's kinds of layers (gguf_factory.gemma4_file's), two head sizes among them
        shape = (TinyShape(**GEMMA4_SHAPE, n_ff_layers=(256,) * 4 + (512,) * 4, n_ctx=N_CTX) if arch == "gemma4"
                 else TinyShape(n_ctx=N_CTX, n_ff_exp=256))   # experts of 256 columns: K-quant down_exps
        vocab = bpe_vocab("qwen2") if arch.startswith(("qwen", "gpt")) else spm_vocab()
        out[arch] = str(write_tiny_model(root / f"{arch}.gguf", arch, qtype, vocab=vocab, tensor_qtypes=mixed,
                                         shape=shape))
    return out


# -- the plan against every length, on both ISAs, without compiling ------------------------

def _chunks(n: int) -> list[int]:
    """The chunk sizes Engine.prefill cuts a prompt of n tokens into (default options)."""
    cuts = Engine.chunk_bounds(SimpleNamespace(options=EngineOptions()), n)
    return [b - a for a, b in zip(cuts[:-1], cuts[1:])]


def _force_isa(monkeypatch, vnni: bool, avx512: bool) -> None:
    """What the dispatch sees on a Zen 4 (AVX-512 VNNI: the tiles too, Q4_K repacked), an
    AVX-512 CPU without VNNI (the AVX2 GEMMs on repacked Q4_K) or a Zen 3."""
    monkeypatch.setattr(tile_gemm, "has_vnni", lambda: vnni)
    monkeypatch.setattr(gemm_kquant, "host_has_avx2", lambda: True)
    monkeypatch.setattr(repack, "host_repacks", lambda: avx512)


@pytest.mark.parametrize("vnni, avx512", [(False, False), (False, True), (True, True)],
                         ids=["avx2", "avx512", "avx512-vnni"])
def test_the_plan_holds_every_path_of_every_prompt_length(family_files, vnni, avx512, monkeypatch):
    """Every (path, type) a chunk of any prompt of 1..600 tokens reaches is run by the
    warm-up's own pass (two tokens, then one) or is in the plan use_prompt_gemms registers
    kernels for; and the forced ISA did change the dispatch's answers."""
    _force_isa(monkeypatch, vnni, avx512)
    chunks = {c for n in range(1, MAX_PROMPT + 1) for c in _chunks(n)}
    seen, seen_types = set(), set()
    for arch, path in family_files.items():
        lengths = range(1, MAX_PROMPT + 1) if arch in ENCODERS else chunks   # an encoder's input: one pass
        gguf = GGUFFile.open(path)
        experts = [i for name, i in gguf.tensors.items() if len(i.shape) == 3 and is_expert_tensor(name, i.shape)]
        matrices, expert_matrices = PLAN.model_matrices(gguf.tensors.values(), experts)
        plan = PLAN.prompt_plan(matrices, expert_matrices)
        by_the_pass = PLAN.prompt_paths(matrices, 2, expert_matrices) | PLAN.prompt_paths(matrices, 1,
                                                                                                 expert_matrices)
        for c in sorted(lengths):
            for where, qt in PLAN.prompt_paths(matrices, c, expert_matrices):
                seen.add(where)
                seen_types.add((where, qt))
                kernels_of_ours = where.removeprefix("experts-") in PLAN.PROMPT_KERNEL_PATHS and (
                    not where.endswith("blas") and not where.endswith("blas-serial") or MATVEC._fast(qt))
                if kernels_of_ours:
                    assert qt in plan.get(where, ()), (arch, c, where, qt)
                else:
                    assert (where, qt) in by_the_pass, (arch, c, where, qt)
    # the forcing took: a VNNI host's long prompts of the 32-element types take the tiles;
    # the AVX2 GEMMs serve short batches and the K-quants everywhere
    assert ("tiles" in seen) == vnni and "kquant" in seen and "experts-kquant" in seen, seen
    assert {"blas", "blas-serial"} & seen, seen
    assert any(qt == Q4_K_X8 for _, qt in seen_types) == avx512, seen_types


def test_the_attention_path_turns_at_the_exact_limit():
    from edgeinfer.kernels_cpu.kv_attention import EXACT_MAX_QUERIES

    assert [attention_path(n, False) for n in (1, EXACT_MAX_QUERIES, EXACT_MAX_QUERIES + 1)] == \
        ["exact", "exact", "blas"]
    assert attention_path(1, True) == "flash"


# -- the real thing: a child process per family, every group of lengths ---------------------

_CHILD = r"""
import gc, json, sys
import numpy as np
from numba.core import event
from numba.core.dispatcher import Dispatcher
from edgeinfer.kernels_cpu import compile_progress
compile_progress._cores = lambda: 1   # no second process: all the load reaches lands here
# the warm-up's pass runs on a warm cache too, so what shows up after load is what the
# pass misses, warm or cold (a warm start skips the pass and loads lazily: by design)
compile_progress.on_disk = lambda kernel: False
compiled = []
class Listener(event.Listener):
    def on_start(self, ev):
        compiled.append(ev.data["dispatcher"].py_func.__qualname__)
    def on_end(self, ev):
        pass
event.register("numba:compile", Listener())
import edgeinfer

def overloads():
    # every Numba kernel of this package, the per-type copies and GEMM drivers included
    return {id(d): (d.py_func.__qualname__, set(d.overloads)) for d in gc.get_objects()
            if isinstance(d, Dispatcher) and (d.py_func.__module__ or "").startswith("edgeinfer")}

cache = sys.argv[4:6] or ['f16', 'f16']   # K and V types (-ctk / -ctv)
model = edgeinfer.load(sys.argv[1], n_ctx=int(sys.argv[3]), cache_type_k=cache[0], cache_type_v=cache[1])
engine = model.engine
flash = engine.cache_types.flash_order

encoder = not engine.model.GENERATES   # embeds an input in one pass (Model.embed), no chunks

def key(n):
    cuts = [0, n] if encoder else engine.chunk_bounds(n)
    return tuple(engine.backend.prompt_reach(b - a, flash) for a, b in zip(cuts[:-1], cuts[1:]))

keys = [key(n) for n in range(1, int(sys.argv[2]) + 1)]
lengths = sorted({1, len(keys)} | {n + 1 for n in range(1, len(keys)) if keys[n] != keys[n - 1]}
                 | {n for n in range(1, len(keys)) if keys[n] != keys[n - 1]})
at_load, before, new = len(compiled), overloads(), {}
top = engine.config.n_vocab
for n in lengths:
    tokens = (np.arange(n) * 7919) % (top - 3) + 3
    if encoder:
        engine.model.encode(tokens, [n])
    else:
        kv = engine.new_cache()
        engine.prefill(tokens, kv)
        engine.decode(3, kv)
    after = overloads()
    for k, (name, sigs) in after.items():
        if sigs - before.get(k, (name, set()))[1]:
            new.setdefault(name, []).append(n)
    before = after
print(json.dumps({"lengths": lengths, "groups": len(set(keys)), "new": new, "compiled": compiled[at_load:]}))
"""


@pytest.mark.parametrize("arch", sorted(FIXTURES))
def test_no_kernel_compiles_or_loads_after_load(arch, family_files):
    _holds_after_load(family_files[arch])


# quantized K/V caches take the flash order's kernels (kv_quant, the flash attention)
@pytest.mark.parametrize("cache", [("q8_0", "q8_0"), ("q4_0", "f16")], ids=["q8_0", "q4_0-k"])
def test_nothing_compiles_after_load_with_a_quantized_cache(cache, family_files):
    _holds_after_load(family_files["llama"], *cache)


def _holds_after_load(path: str, *cache: str) -> None:
    env = dict(os.environ)   # the suite's Numba cache: warm after the first family of a type set
    out = subprocess.run([sys.executable, "-c", _CHILD, path, str(MAX_PROMPT), str(N_CTX), *cache],
                         env=env, capture_output=True, text=True, timeout=900, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["lengths"][0] == 1 and got["lengths"][-1] == MAX_PROMPT and got["groups"] >= 2, got
    assert got["new"] == {} and got["compiled"] == [], (got["lengths"], got["new"], got["compiled"])


# -- a warm start skips the pass only where this model's pass ran before -------------------

def test_a_models_pass_runs_once_on_a_cache_that_holds_its_listed_kernels(tmp_path, monkeypatch):
    """Another model's pass may have left every listed kernel on disk but not this one's own
    (a recurrent layer's, an expert router's): the pass runs, once per model key."""
    from numba import njit
    from numba.core import config

    from edgeinfer.kernels_cpu import compile_progress as cp

    monkeypatch.setattr(config, "CACHE_DIR", str(tmp_path))

    @njit
    def listed(x):
        return x + 1.0
    listed(1.0)   # compiled: as by another model's pass
    ran = []
    def quiet(*_):
        pass
    for key in ("model A", "model A", "model B", None):
        cp.warm_up(lambda key=key: ran.append(key), [listed], report=quiet, key=key)
    assert ran == ["model A", "model B"]

    def broken():
        raise RuntimeError("stopped mid-pass")
    with pytest.raises(RuntimeError):
        cp.warm_up(broken, [listed], report=quiet, key="model C")
    cp.warm_up(lambda: ran.append("model C"), [listed], report=quiet, key="model C")
    assert ran[-1] == "model C"   # a pass that did not finish leaves no mark
