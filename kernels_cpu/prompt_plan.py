"""The cold start's plan of prompt kernels, derived from the dispatch itself (matvec.matmul_path
and the expert dispatch): what a prompt chunk of n tokens reaches (`prompt_paths`), the union
over every length (`prompt_plan`), and the registration (`use_prompt_gemms`) that hands those
kernels to the cold start's second process and warms them at load (`warm_prompt_gemms`), so
no first prompt stops to compile. tests/test_cold_start_families.py holds every family and
prompt length 1..600 to it."""
from __future__ import annotations

import importlib

import numpy as np

from . import compile_progress, dispatch, gemm_kquant, gemm_q32, tile_gemm
from . import quant_kernels as qk
from .quant_types import quant_info, row_bytes
from .threads import get_threads

# the module (the package's own `matvec` name is the function): its dispatch, looked up at each call
mv = importlib.import_module(".matvec", __package__)


def model_matrices(tensors, experts=()) -> tuple[list, list]:
    """A model's matrices as the kernels see them: (type id, n_rows) of its 2-D tensors
    (`tensors`: objects with .qtype, .n_rows and .shape; repacked ids as `repack` will give
    them) and (type id, rows an expert) of its 3-D expert tensors (`experts`)."""
    from .repack import repacks

    mats = [t for t in tensors if len(t.shape) == 2]
    return ([(qk.Q4_K_X8 if repacks(t.qtype, t.n_rows) else int(t.qtype), t.n_rows) for t in mats],
            [(int(t.qtype), t.shape[1]) for t in experts])


def use_model_types(tensors, experts=()) -> list:
    """Register the types of a model's matrices (model_matrices) so that one kernel set
    serves all of them and only their code compiles (dispatch.use_types), and the kernels
    of every path its prompts take (`use_prompt_gemms`). Returns the kernels its first
    tokens and prompts compile."""
    matrices, expert_matrices = model_matrices(tensors, experts)
    ks = dispatch.use_types([qt for qt, _ in matrices + expert_matrices])
    return (ks.forward_kernels() if ks is not None else []) + use_prompt_gemms(matrices, expert_matrices)


def prompt_paths(matrices, n_tokens: int, experts=()) -> frozenset:
    """What a prompt chunk of n_tokens reaches in the matmuls, as the dispatch below picks
    it: (path, type id) for every matrix (type id, n_rows) (matmul_path; "blas-serial":
    the BLAS path's row tiles dequantized on each worker thread), and ("experts-" + path,
    type id) for every 3-D expert tensor (type id, rows an expert): the row kernels, and
    from _GEMM_MIN_TOKENS tokens the expert GEMM (one expert may get every token)."""
    got = set()
    for qt, n_rows in matrices:
        path = mv.matmul_path(qt, n_rows, n_tokens)
        if path == "blas" and mv._serial_tiles(int(qt), n_rows):
            path = "blas-serial"
        got.add((path, int(qt)))
    for qt, n_per in experts:   # each tensor as if alone (a pair of two types may take less)
        qt = int(qt)
        got.add(("experts-rows" if mv._fast(qt) else "experts-plain", qt))
        path = mv._expert_gemm_path([qt], n_per, n_tokens) if mv._fast(qt) else None
        if path and n_tokens >= mv._GEMM_MIN_TOKENS[qt]:
            got.add(("experts-" + path, qt))
    return frozenset(got)


def prompt_plan(matrices, experts=()) -> dict:
    """{path: type ids} of every path a prompt of any length reaches (prompt_paths): matmul_path's
    answers change only up to one past _INT8_MATMUL_MAX_TOKENS (tests/test_cold_start_families.py
    checks every length to 600 against this plan)."""
    plan: dict = {}
    for n in range(1, mv._INT8_MATMUL_MAX_TOKENS + 2):
        for path, qt in prompt_paths(matrices, n, experts):
            plan.setdefault(path, set()).add(qt)
    return plan


_PROMPT_GEMMS: list = []   # (path, types, experts) of the prompt kernels the loaded models' prompts run
# the paths whose kernels use_prompt_gemms registers (the BLAS ones: for the fast types);
# the others ("rows", "f32", "bf16", a slow type's "blas") the warm-up's two-token pass runs itself
PROMPT_KERNEL_PATHS = ("kquant", "q32", "tiles", "blas", "blas-serial")


def use_prompt_gemms(matrices, experts=()) -> list:
    """Make one driver of each prompt GEMM serve all the types of a model's matrices
    (gemm_parallel.Drivers.use_types) and return the kernels of every path prompt_plan
    finds (the GEMMs, their experts' regions, the BLAS path's dequantizing tiles), given
    to a cold start's second process to compile. `warm_prompt_gemms` then loads them, so
    a first prompt does not stop for seconds to compile them unannounced. `matrices`:
    (type id, n_rows) pairs or bare type ids (then 8 rows), `experts` likewise the expert
    tensors' (type id, rows an expert), or True: the same matrices as experts."""
    matrices = [(int(m), 8) if not isinstance(m, tuple) else (int(m[0]), m[1]) for m in matrices]
    if experts is True:
        experts = matrices
    plan = prompt_plan(matrices, [(int(m[0]), m[1]) for m in experts or ()])
    kernels = []
    for path in PROMPT_KERNEL_PATHS:
        types = sorted(plan.get(path, set()) | plan.get("experts-" + path, set()))
        if path.startswith("blas"):   # ours only for the fast types (F16 & co: the pass's own)
            types = [qt for qt in types if mv._fast(qt)]
        if not types:
            continue
        with_experts = bool(plan.get("experts-" + path))
        if path == "tiles":   # one kernel for every tile type, and the activations' packing
            path_kernels = [tile_gemm._matmul_rows, tile_gemm._quantize_packed]
        elif path.startswith("blas"):   # a long prompt's float tiles (matmul's _tiled_gemm)
            ks = dispatch.kernels_for(*types)
            types = list(ks.types)
            path_kernels = [ks.dequant_kernel_serial if path == "blas-serial" else ks.dequant_kernel]
        else:
            driver = (gemm_kquant if path == "kquant" else gemm_q32).DRIVERS.use_types(types)
            if driver is None:   # none of these types is this GEMM's
                continue
            path_kernels = [driver.kernel] + ([driver.expert_kernel] if with_experts else [])
        if (path, tuple(types), with_experts) not in _PROMPT_GEMMS:
            _PROMPT_GEMMS.append((path, tuple(types), with_experts))
        job = (f"import importlib; importlib.import_module('edgeinfer.kernels_cpu.prompt_plan')"
               f".compile_prompt_gemm({path!r}, {tuple(types)!r}, {with_experts})")
        # the second process gets the first GEMM; a second one compiles here after the
        # warm-up pass, while that process is still busy (~5 s a type each)
        elsewhere = not kernels
        for kernel in path_kernels:
            if elsewhere:
                compile_progress.compile_elsewhere(kernel, job, 4)
            kernels.append(kernel)
    return kernels


def warm_prompt_gemms() -> None:
    """Compile (or load) the registered prompt GEMM drivers: Engine.warm_up's forward pass
    is too short to reach them."""
    for path, types, experts in _PROMPT_GEMMS:
        compile_prompt_gemm(path, types, experts)


def compile_prompt_gemm(path: str, types: tuple, experts: bool = False) -> None:
    """Call the `path` GEMM's driver for `types` (and its experts' region) once on zeros,
    with the argument types a prompt passes: it compiles, or loads from Numba's cache."""
    if path == "tiles":
        _compile_tiles(int(types[0]))
        return
    if path.startswith("blas"):   # types: the model's kernel set, whose dequantizer serves them all
        ks, qt = dispatch.kernel_set(types), int(types[0])
        y = np.empty((8, quant_info(qt).block_size), np.float32)
        w = dispatch.zero_weights(qt, 8, y.shape[1])
        (ks.dequant_kernel_serial if path == "blas-serial" else ks.dequant_kernel)(w, qt, 0, y)
        return
    gemm = gemm_kquant if path == "kquant" else gemm_q32
    driver = gemm.DRIVERS.use_types(types)
    qt = int(types[0])
    info = quant_info(qt)
    k = info.act_block
    w = mv._readonly(np.zeros((8, row_bytes(qt, k)), np.uint8))
    xq, xd, xs = mv.quantize_activation_rows(np.zeros((4, k), np.float32), info)
    out = np.empty((4, 8), np.float32)
    if compile_progress._pending:
        compile_progress.wait_for(driver.kernel)
    driver.run([w], [qt], gemm.pack_activations(xq, xd, xs), [out], get_threads())
    if gemm is gemm_kquant:
        gemm.warm_pack()
    if experts:
        packed, seg = gemm.pack_segments(xq, xd, xs, [4])
        if compile_progress._pending:
            compile_progress.wait_for(driver.expert_kernel)
        one = np.zeros(1, np.int64)
        driver.run_experts([w], [qt], one, seg, one, np.array([4]), 8, packed, [out], get_threads())


def _compile_tiles(qt: int) -> None:
    """tile_gemm's kernels for a long prompt (VNNI hosts), called once on zeros with the
    argument types matmul_many passes: they compile, or load from Numba's cache."""
    w = mv._readonly(np.zeros((8, row_bytes(qt, 256)), np.uint8))   # 8 rows: a whole Q4_K_X8 group
    out = np.empty((4, 8), np.float32)
    for kernel in (tile_gemm._quantize_packed, tile_gemm._matmul_rows):
        if compile_progress._pending:
            compile_progress.wait_for(kernel)
    tile_gemm.matmul_rows(w, qt, 0, 8, tile_gemm.pack_activations(np.zeros((4, 256), np.float32)), out)
