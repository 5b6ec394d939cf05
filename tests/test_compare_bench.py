"""bench/compare.py's own arithmetic: the table's best runs and ratios, and the fp32 rate of
tokenmill's kernel that the roofline's throughput ceiling takes when it beats torch's."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench"))
import compare  # noqa: E402 - a script in bench/, not a package


def _run(engine, workload, tps, repeat=0):
    key = "decode_tps" if workload == "w2" else "out_tps"
    return {"engine": engine, "workload": workload, key: tps, "repeat": repeat}


def test_table_keeps_each_engines_best_run_and_the_ratio_to_the_best_peer():
    runs = [_run("tokenmill", "w1", 100.0), _run("vllm", "w1", 80.0),
            _run("llamacpp", "w1", 90.0), _run("tokenmill", "w1", 120.0, 1),
            _run("vllm", "w1", 60.0, 1), _run("tokenmill", "w2", 10.0),
            _run("llamacpp", "w2", 20.0), {"engine": "vllm", "workload": "w2", "error": "x"}]
    table = compare._table(runs, ["tokenmill", "vllm", "llamacpp"])
    assert table["w1"]["tokenmill"]["out_tps"] == 120.0
    assert table["w1"]["vllm"]["out_tps"] == 80.0
    assert table["w1"]["_ratio_to_best_peer"] == {"peer": "llamacpp", "ratio": round(120 / 90, 3)}
    assert "vllm" not in table["w2"]  # a failed run is no cell
    assert table["w2"]["_ratio_to_best_peer"] == {"peer": "llamacpp", "ratio": 0.5}


def test_tokenmill_matmul_rate_is_measured_on_the_loaders_fp32_kernel(monkeypatch):
    calls = []
    real = compare._timed
    monkeypatch.setattr(compare, "_timed", lambda fn: calls.append(fn) or real(fn))
    x, w = torch.randn(96, 128), torch.randn(192, 128)
    rate = compare.tokenmill_matmul_gflops(x, w)
    if rate is None:  # a torch without oneDNN: fp32 layers stay plain torch
        pytest.skip("no packed fp32 kernel here")
    assert rate > 0 and len(calls) == 5
    # what was timed is the product itself
    torch.testing.assert_close(calls[0](), x @ w.T, rtol=1e-4, atol=1e-4)
