"""bench/serve_sweep.py's own logic (the load itself comes from vLLM's client, not run here):
the sustained rate, the ShareGPT-shaped file against vLLM's loader rules, the table."""

import json
import os
import sys

import pytest

pytest.importorskip("httpx")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench"))
import serve_sweep  # noqa: E402 - a script in bench/, not a package


def run(rate, throughput, goodput, **more):
    return {"rate": rate, "request_throughput": throughput, "request_goodput": goodput,
            "median_tpot_ms": 50.0, "p99_ttft_ms": 900.0, **more}


def test_sustained_is_the_last_rate_within_slo_with_every_lower_one():
    runs = [run(2, 1.8, 1.6), run(1, 0.95, 0.95), run(1.5, 1.4, 1.34), run(3, 2.0, 1.99)]
    # 1: 100 %, 1.5: 95.7 %, 2: 88.9 % -> 1.5; 3 meets its SLOs again but 2 did not
    assert serve_sweep.sustained(runs) == 1.5
    assert serve_sweep.sustained([run(1, 0.9, 0.5)]) is None
    assert serve_sweep.sustained([run(1, 0.9, 0.0), run(2, 0.0, 0.0)]) is None


def test_sharegpt_file_follows_vllms_loader_rules(tiny_models, tmp_path):
    from transformers import AutoTokenizer

    path = tiny_models("llama")[0]
    file = tmp_path / "sharegpt.json"
    stats = serve_sweep.sharegpt_file(path, 40, str(file), seed=3)
    rows = json.loads(file.read_text())
    assert len(rows) == 40
    tok = AutoTokenizer.from_pretrained(path)
    lengths = []
    for row in rows:
        human, gpt = row["conversations"]
        assert human["from"] == "human" and gpt["from"] == "gpt"
        n_in, n_out = len(human["value"].split()), len(gpt["value"].split())
        assert 4 <= n_in <= 1024 and n_out >= 4 and n_in + n_out <= serve_sweep.CONTEXT
        lengths.append(n_in)
        assert tok(human["value"]).input_ids  # text the served tokenizer encodes
    assert stats["prompt_words_mean"] == sum(lengths) / len(lengths)
    assert len(set(lengths)) > 10  # a spread of lengths, not one
    again = tmp_path / "again.json"
    serve_sweep.sharegpt_file(path, 40, str(again), seed=3)
    assert again.read_text() == file.read_text()  # the same seed, the same file


def test_table_lists_every_engine_and_rate():
    report = {"rate_list": [1.0, 2.0], "datasets": {"random": {}},
              "models": {"default": {"engines": [
                  {"engine": "tokenmill", "runs": {"random": [run(1.0, 0.9, 0.9),
                                                              run(2.0, 1.5, 0.3)]}},
                  {"engine": "vllm", "runs": {"random": [run(1.0, 0.9, 0.4),
                                                         {"rate": 2.0, "error": "x"}]}}]}}}
    lines = serve_sweep.table(report).splitlines()
    assert len(lines) == 4
    assert lines[2].startswith("| default · random | tokenmill | 1.0 | 0.90 / 0.30 |")
    assert lines[3].startswith("| default · random | vllm | < 1 | 0.40 / – |")
