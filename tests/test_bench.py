"""`edgeinfer bench`: llama-bench's tests, table and JSON field names."""

from __future__ import annotations

import json

from edgeinfer.cli import main


def test_bench_json_has_llama_bench_fields(tiny_models, capsys):
    code = main(["bench", str(tiny_models["llama"]), "-p", "16", "-n", "4", "-r", "2", "-t", "1",
                 "--backend", "reference", "--json"])
    assert code == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["test"] for r in rows] == ["pp16", "tg4"]
    for row in rows:
        for key in ("n_prompt", "n_gen", "avg_ts", "stddev_ts", "n_threads", "model_type", "model_size"):
            assert key in row
        assert len(row["samples_ts"]) == 2 and row["avg_ts"] > 0 and row["n_threads"] == 1
    assert rows[0]["n_prompt"] == 16 and rows[0]["n_gen"] == 0
    assert rows[1]["n_prompt"] == 0 and rows[1]["n_gen"] == 4


def test_bench_table_and_skips(tiny_models, capsys):
    assert main(["bench", str(tiny_models["qwen3"]), "-p", "8", "-n", "0", "-r", "1",
                 "--backend", "reference"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "test" in lines[0] and "t/s" in lines[0]
    assert len(lines) == 3 and "pp8" in lines[2]  # header, rule, one row: -n 0 skips tg


def test_bench_rejects_negative_counts(tiny_models, capsys):
    assert main(["bench", str(tiny_models["llama"]), "-p", "-1", "--backend", "reference"]) == 1
    assert "-p, -n and -d" in capsys.readouterr().err


def test_bench_depth_fills_the_context_first(tiny_models, capsys, monkeypatch):
    # -d D: each test starts from a cache holding D tokens (llama-bench's n_depth)
    from edgeinfer import bench

    depths = []
    real = bench._cache_at_depth
    monkeypatch.setattr(bench, "_cache_at_depth",
                        lambda engine, depth, seed: depths.append((depth, (kv := real(engine, depth, seed)).n_used)) or kv)
    assert main(["bench", str(tiny_models["llama"]), "-p", "8", "-n", "3", "-d", "20", "-r", "1", "-t", "1",
                 "--backend", "reference", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["test"] for r in rows] == ["pp8 @ d20", "tg3 @ d20"]
    assert all(r["n_depth"] == 20 for r in rows)
    assert depths and all(d == (20, 20) for d in depths)   # warm-up and timed runs alike


def test_bench_json_names_the_cache_types(tiny_models, capsys):
    assert main(["bench", str(tiny_models["llama"]), "-p", "8", "-n", "2", "-r", "1", "-t", "1",
                 "--backend", "reference", "-ctk", "q8_0", "-ctv", "q4_0", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {(r["type_k"], r["type_v"]) for r in rows} == {("q8_0", "q4_0")}
