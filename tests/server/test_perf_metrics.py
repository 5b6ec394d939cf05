"""TensorRT-LLM's `return_perf_metrics` outputs on Triton's HTTP generate and the gRPC
`ensemble`, from a real `tokenmill serve` that speculates (n-gram): the request's draft
counts equal the server's own counters' increase, times in order, KV block counts from the
prompt's and output's lengths (prefix-cache hits on a repeat)."""

import json
import math

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tests.server.test_grpc import ensemble_inputs
from tests.serving import Served, metric

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 2}
PROMPT = "block after block, batch after batch, block after block, batch after batch, " * 3
TIMES = ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns",
         "last_token_time_ns")


@pytest.fixture(scope="module")
def served(tiny_models, tmp_path_factory):
    with Served(tiny_models("llama")[0], tmp_path_factory.mktemp("perf"), "--block-size", "8",
                "--speculative-config", json.dumps(NGRAM)).running() as s:
        yield s


def _drafts(served):
    return (metric(served.metrics, "tokenmill:spec_decode_num_draft_tokens_total"),
            metric(served.metrics, "tokenmill:spec_decode_num_accepted_tokens_total"))


def _check(perf: dict, before, after, prompt_tokens: int, output_tokens: int):
    drafts, accepted = after[0] - before[0], after[1] - before[1]
    assert perf["total_draft_tokens"] == drafts > 0
    assert perf["total_accepted_draft_tokens"] == accepted
    assert perf["acceptance_rate"] == pytest.approx(accepted / drafts)
    times = [perf[name] for name in TIMES]
    assert 0 < times[0] <= times[1] <= times[2] <= times[3]
    total = math.ceil((prompt_tokens + output_tokens) / 8)
    assert perf["kv_cache_alloc_total_blocks"] == total
    assert perf["kv_cache_alloc_new_blocks"] + perf["kv_cache_reused_blocks"] == total


def test_http_generate_perf_metrics(served, tiny_models):
    from transformers import AutoTokenizer

    prompt_tokens = len(AutoTokenizer.from_pretrained(tiny_models("llama")[0]).encode(PROMPT))
    url = served.api + "/v2/models/ensemble/generate"
    body = {"text_input": PROMPT, "max_tokens": 16, "return_perf_metrics": True}
    reused = []
    for _ in range(2):  # the second time, the prompt's full blocks come from the cache
        before = _drafts(served)
        out = httpx.post(url, json=body, timeout=120).json()
        _check(out, before, _drafts(served), prompt_tokens, 16)
        reused.append(out["kv_cache_reused_blocks"])
    assert reused[0] == 0 and reused[1] == (prompt_tokens - 1) // 8
    plain = httpx.post(url, json={"text_input": PROMPT, "max_tokens": 4}, timeout=60).json()
    assert "total_draft_tokens" not in plain
    bad = httpx.post(url, json={**body, "return_perf_metrics": "yes"}, timeout=60)
    assert bad.status_code == 400 and "return_perf_metrics must be a boolean" in bad.text


def test_grpc_ensemble_perf_metrics(served, tiny_models):
    from transformers import AutoTokenizer

    prompt_tokens = len(AutoTokenizer.from_pretrained(tiny_models("llama")[0]).encode(PROMPT))
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{served.ports['grpc']}")
    try:
        before = _drafts(served)
        result = client.infer("ensemble", ensemble_inputs(
            PROMPT, 12, return_perf_metrics=("BOOL", True)))
        perf = {name: result.as_numpy(name) for name in
                ("total_draft_tokens", "total_accepted_draft_tokens", "acceptance_rate",
                 "kv_cache_alloc_total_blocks", "kv_cache_alloc_new_blocks",
                 "kv_cache_reused_blocks", *TIMES)}
        assert all(v.shape == (1,) for v in perf.values())
        assert perf["total_draft_tokens"].dtype == np.int64
        assert perf["acceptance_rate"].dtype == np.float32
        perf = {k: v[0].item() for k, v in perf.items()}
        _check(perf, before, _drafts(served), prompt_tokens, 12)
        names = {o.name for o in client.get_model_metadata("ensemble").outputs}
        assert {"acceptance_rate", "total_draft_tokens", "last_token_time_ns"} <= names
    finally:
        client.close()
