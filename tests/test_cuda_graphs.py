"""A decode step at -ngl 99 as one CUDA graph (edgeinfer.backends.cuda_graph): recorded on the
second step of a shape, replayed from the third, in three driver calls a token, and giving the
eager step's logits bit for bit after everything a session does to its K/V between steps.

Every case runs the same work twice, with EDGEINFER_CUDA_GRAPHS=0 and =1, on the CUDA
emulator (blocks in order, so both runs are deterministic), and compares every logits array
the engine returned. The emulator counts each call its driver gets.
"""

from __future__ import annotations

import numpy as np
import pytest
from oracles import greedy, random_ids, record_logits

import cuda_device
import edgeinfer
from edgeinfer.backends.base import ReferenceBackend
from edgeinfer.backends.offload import GiB, DeviceInfo, OffloadPlan
from edgeinfer.engine import Engine, EngineOptions
from edgeinfer.errors import EdgeInferError
from edgeinfer.generate import collect
from edgeinfer.loader import open_model
from edgeinfer.session_manager import SessionManager

SIM = DeviceInfo("sim", 8 * GiB, 8 * GiB, (8, 6))


@pytest.fixture
def calls(monkeypatch):
    """The emulated device, blocks in order; the emulated driver's call counts."""
    cuda_device.emulated(monkeypatch, order="forward")
    if cuda_device.KIND != "emulator":
        pytest.skip("counts the emulated driver's calls")
    from edgeinfer.kernels_cuda.emulator.kernel import CALLS

    yield CALLS
    monkeypatch.undo()
    from edgeinfer.kernels_cuda import runtime

    runtime.reset()


def _engine(path, n_ctx: int = 64, gpu_layers: int | None = None, head: bool = True, **options) -> Engine:
    from edgeinfer.backends.hybrid import HybridBackend

    mf = open_model(path)
    engine = Engine(mf, EngineOptions(n_ctx=n_ctx, backend="reference", prefill_chunk=5, **options))
    layers = list(range(mf.config.n_layer if gpu_layers is None else gpu_layers))
    plan = OffloadPlan(layers, head, 0, 0, 0, "test", mf.config.n_layer, SIM)
    engine.backend = HybridBackend(mf.gguf, plan, ReferenceBackend(mf.gguf))
    engine.model = mf.family(mf.config, mf.gguf, engine.backend)
    return engine


def _both(monkeypatch, calls, work) -> tuple[list, list, int]:
    """`work(engine_factory)` eagerly and with graphs: (eager logits, graph logits, graphs replayed)."""
    runs = []
    for value in ("0", "1"):
        monkeypatch.setenv("EDGEINFER_CUDA_GRAPHS", value)
        before = calls["graph_launch"]
        logits: list[np.ndarray] = []

        def factory(*args, **kw):
            engine = _engine(*args, **kw)
            logits_of = record_logits(engine)
            logits.append(logits_of)
            return engine

        work(factory)
        runs.append(([a for one in logits for a in one], calls["graph_launch"] - before))
    (eager, eager_graphs), (graphed, n_graphs) = runs
    assert eager_graphs == 0  # EDGEINFER_CUDA_GRAPHS=0 turns them off
    return eager, graphed, n_graphs


def _greedy_counting(engine, prompt: list[int], n: int, calls) -> list[dict]:
    """A prompt, then n greedy decode steps: each step's driver calls, by kind."""
    kv = engine.new_cache()
    token = int(np.argmax(engine.prefill(prompt, kv)))
    per_token = []
    for _ in range(n):
        before = dict(calls)
        token = int(np.argmax(engine.decode(token, kv)))
        per_token.append({k: v - before.get(k, 0) for k, v in calls.items() if v != before.get(k, 0)})
    return per_token


def _assert_same(eager: list, graphed: list) -> None:
    assert len(eager) == len(graphed)
    for i, (a, b) in enumerate(zip(eager, graphed)):
        assert np.array_equal(a, b), f"step {i}: the graph's logits differ from the eager step's"


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_decoded_token_is_three_driver_calls_and_the_eager_bits(tiny_models, calls, monkeypatch, arch):
    per_token: list[dict] = []

    def work(factory):
        per_token[:] = _greedy_counting(factory(tiny_models[arch]), [1, 5, 9, 20, 7, 3], 12, calls)

    eager, graphed, n_graphs = _both(monkeypatch, calls, work)
    _assert_same(eager, graphed)
    assert n_graphs == 10  # step 1 eager, step 2 recorded, the rest replayed
    for counts in per_token[2:]:
        assert counts == {"htod": 1, "graph_launch": 1, "dtoh": 1}, counts  # inputs, graph, logits


@pytest.mark.parametrize("cache_type", ["f16", "q8_0", "q4_0", "iq4_nl"])
def test_each_kv_cache_type_replays_bit_for_bit(tiny_models, calls, monkeypatch, cache_type):
    def work(factory):
        engine = factory(tiny_models["llama"], cache_type_k=cache_type, cache_type_v=cache_type)
        kv = engine.new_cache()
        token = int(np.argmax(engine.prefill(list(range(3, 12)), kv)))
        for _ in range(6):
            token = int(np.argmax(engine.decode(token, kv)))

    eager, graphed, n_graphs = _both(monkeypatch, calls, work)
    _assert_same(eager, graphed)
    assert n_graphs == 4


def _manager(engine, **kw) -> SessionManager:
    cpu = edgeinfer.load(str(engine.model_file.gguf.path), backend="reference", n_ctx=engine.n_ctx)
    kw.setdefault("block_size", 4)
    return SessionManager(engine, cpu.tokenizer, model_id="tiny", n_ctx=engine.n_ctx, **kw)


def test_sessions_replay_after_prefix_hits_and_context_shifts(tiny_models, calls, monkeypatch):
    """Paged VRAM blocks: a second conversation on a cached prefix (another sequence, other
    blocks in its table), then one that runs past the window and shifts its context."""
    cached: list[int] = []

    def work(factory):
        mgr = _manager(factory(tiny_models["llama"], n_ctx=40), block_size=8, context_shift=True, n_keep=4)
        rng = np.random.default_rng(3)
        vocab = mgr.engine.config.n_vocab
        prompt = random_ids(rng, 12, vocab)
        collect(mgr.generate(prompt, greedy(8)))
        again = collect(mgr.generate(prompt + random_ids(rng, 3, vocab), greedy(8)))
        cached.append(again.usage.cached_tokens)
        collect(mgr.generate(random_ids(rng, 30, vocab), greedy(20)))
        cached.append(mgr.stats()["context_shifts"])
        mgr.check_invariants()

    eager, graphed, n_graphs = _both(monkeypatch, calls, work)
    _assert_same(eager, graphed)
    assert cached[0] >= 8 and cached[1] > 0 and cached[2] == cached[0] and cached[3] == cached[1]
    assert n_graphs >= 20


def test_speculative_rollbacks_replay_bit_for_bit(tiny_models, calls, monkeypatch):
    """Verification batches of 7 rows (their own graph), rejected rows rolled back between them."""
    from test_speculative import OracleDrafter

    from edgeinfer.speculative import Speculation, SpeculativeParams

    counts: list[tuple[int, int]] = []

    def work(factory):
        mgr = _manager(factory(tiny_models["llama"]))
        ids = random_ids(np.random.default_rng(9), 12, mgr.engine.config.n_vocab)
        truth = collect(mgr.generate(ids, greedy(24))).tokens
        mgr.reset()
        spec = Speculation(OracleDrafter(truth, len(ids), 3, mgr.engine.config.n_vocab), SpeculativeParams(n_max=6))
        spec.length.next_k = lambda limit: min(6, limit)
        collect(mgr.generate(ids, greedy(24), speculation=spec))
        counts.append((spec.accepted, spec.drafted))
        mgr.check_invariants()

    eager, graphed, n_graphs = _both(monkeypatch, calls, work)
    _assert_same(eager, graphed)
    assert counts[0] == counts[1] and 0 < counts[0][0] < counts[0][1]
    assert n_graphs > 0


@pytest.mark.parametrize("gpu_layers, head", [(1, False), (1, True)], ids=["first-layer", "first-layer-and-head"])
def test_a_partial_offload_replays_its_gpu_layers(tiny_models, calls, monkeypatch, gpu_layers, head):
    """The GPU layers' span is a graph: its input rows and K/V fields up, the graph, and the CPU
    layers after it read its output."""
    per_token: list[dict] = []

    def work(factory):
        per_token[:] = _greedy_counting(factory(tiny_models["llama"], gpu_layers=gpu_layers, head=head), [3, 4, 5, 9],
                                        8, calls)

    eager, graphed, n_graphs = _both(monkeypatch, calls, work)
    _assert_same(eager, graphed)
    assert n_graphs == 6
    for counts in per_token[2:]:
        assert counts.get("graph_launch") == 1, counts
        # the span's launches and activations are its graph's: only an eager GPU head's are not
        assert counts.get("launch", 0) == (2 if head else 0) and (head or counts.get("alloc", 0) == 0), counts


def test_a_bad_graphs_setting_is_one_clear_error(tiny_models, calls, monkeypatch):
    monkeypatch.setenv("EDGEINFER_CUDA_GRAPHS", "yes")
    engine = _engine(tiny_models["llama"])
    with pytest.raises(EdgeInferError, match="EDGEINFER_CUDA_GRAPHS='yes'"):
        engine.decode(3, engine.new_cache())


def test_a_new_cache_gets_its_own_graph(tiny_models, calls, monkeypatch):
    """A graph reads one cache's VRAM: another cache (llama-bench's fresh one per run) records
    its own, and the first one's graph is never replayed on it."""
    monkeypatch.setenv("EDGEINFER_CUDA_GRAPHS", "1")
    engine = _engine(tiny_models["llama"])
    outs = []
    for _ in range(2):
        kv = engine.new_cache()
        engine.prefill([3, 4, 5], kv)
        outs.append([engine.decode(t, kv) for t in (6, 7, 8, 9)])
        del kv
    for a, b in zip(*outs):
        assert np.array_equal(a, b)
    assert len(engine.step_graphs._graphs) == 1  # the dead cache's graph was dropped


def test_bench_rows_count_the_launches_of_a_decoded_token(tiny_models, calls, monkeypatch):
    from edgeinfer.bench import run_bench

    rows = {}
    for value in ("0", "1"):
        monkeypatch.setenv("EDGEINFER_CUDA_GRAPHS", value)
        engine = _engine(tiny_models["llama"])
        (row,) = run_bench(engine, n_prompt=0, n_gen=12, repetitions=2, n_threads=1, model_type="tiny")
        rows[value] = row.to_dict()
    eager, graphed = rows["0"], rows["1"]
    assert eager["graph_launches_per_token"] == 0 and eager["kernel_launches_per_token"] > 10
    assert graphed["graph_launches_per_token"] == 10 / 12  # two eager steps a fresh cache, then replays
    # the two eager steps' launches, one of them recorded (its positions by a kernel: one more)
    assert graphed["kernel_launches_per_token"] == (eager["kernel_launches_per_token"] * 2 + 1) / 12


def test_run_verbose_says_what_a_token_cost_the_driver(tiny_models, tmp_path):
    import os
    import subprocess
    import sys

    if cuda_device.KIND != "emulator":
        pytest.skip("runs the CLI on the emulator")
    env = dict(os.environ, EDGEINFER_CUDA="emulate", EDGEINFER_CUDA_EMULATE_ORDER="forward")
    env.pop("EDGEINFER_CUDA_GRAPHS", None)
    out = subprocess.run([sys.executable, "-m", "edgeinfer.cli", "run", str(tiny_models["llama"]), "--raw", "--temp",
                          "0", "-n", "12", "-ngl", "99", "--verbose", "hello"], capture_output=True, text=True,
                         env=env, timeout=600)
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stderr.splitlines() if x.startswith("GPU launches:"))
    graphs = float(line.split("+")[1].split("graph")[0])
    assert 0.5 < graphs <= 1.0, line


def test_a_refused_capture_leaves_the_shape_eager_and_says_so(tiny_models, calls, monkeypatch):
    """Where the driver refuses the capture, the step's shape stays eager (its bits unchanged)
    and the reason is noted once, for --verbose."""
    from edgeinfer.kernels_cuda import graph

    monkeypatch.setenv("EDGEINFER_CUDA_GRAPHS", "1")
    driver_api = graph.graph_api

    class Refusing:
        def begin_capture(self, stream):
            raise RuntimeError("cuStreamBeginCapture failed: operation not supported (CUresult 801)")

        def __getattr__(self, name):
            return getattr(driver_api(), name)

    monkeypatch.setattr(graph, "graph_api", lambda: Refusing())
    engine = _engine(tiny_models["llama"])
    kv = engine.new_cache()
    engine.prefill([3, 4, 5], kv)
    before = calls["graph_launch"]
    outs = [engine.decode(t, kv) for t in (6, 7, 8, 9)]
    assert calls["graph_launch"] == before and all(np.isfinite(o).all() for o in outs)
    notes = engine.step_graphs.notes
    assert len(notes) == 1 and "capture failed: cuStreamBeginCapture failed" in notes[0], notes


def test_experts_routed_on_the_host_keep_the_step_eager(tmp_path, calls, monkeypatch):
    """A mixture of experts picks its experts on the host from the router's logits, downloaded
    between the GPU's launches: a replay could not redo that, so the recording finds the download,
    the step stays eager with its bits, and the reason is noted once."""
    from gguf_factory import bpe_vocab, write_tiny_model

    path = write_tiny_model(tmp_path / "moe.gguf", "qwen3moe", "F32", vocab=bpe_vocab("qwen2"))

    def work(factory):
        engine = factory(path)
        kv = engine.new_cache()
        token = int(np.argmax(engine.prefill([3, 4, 5], kv)))
        for _ in range(5):
            token = int(np.argmax(engine.decode(token, kv)))
        notes.extend(engine.step_graphs.notes)

    notes: list[str] = []
    eager, graphed, n_graphs = _both(monkeypatch, calls, work)
    _assert_same(eager, graphed)
    assert n_graphs == 0
    assert notes == ["CUDA graphs: a step runs eagerly: a tensor downloaded in the middle of the step"], notes
