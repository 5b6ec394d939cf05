"""--max-queue-time and fair share over HTTP, with real clients where there is one: a request
the queue would keep past its limit is refused at once (429 with Retry-After, before its
stream starts, on the OpenAI, Anthropic, native and Triton routes; the engine never sees
it); one kept waiting past it while a request holds the only slot is refused then (429 on
each route, in a started stream as its error); a request with no limit is never refused for
load; tenants come from their header into per-tenant metrics, a bad header is a 400."""

import anthropic
import httpx
import openai
import pytest

from tests.serving import HOLD_TOKENS, service_over_engine, wait_until
from tokenmill.config.engine import EngineConfig
from tokenmill.metrics import Metrics

PROMPT = [5, 9, 23, 41, 7, 3]
FAIR = {"scheduling_policy": "fair", "tenant_weights": "gold=3", "max_num_seqs": 1}


@pytest.fixture(scope="module")
def served(tiny_models):
    path = tiny_models("llama_long")[0]
    with service_over_engine(path, metrics=Metrics("tiny", 1), engine=FAIR,
                             engine_config=EngineConfig(model=path, **FAIR)) as thread:
        yield thread


def sample(served, name: str, **labels) -> float:
    value = served.metrics.registry.get_sample_value(name, {"model_name": "tiny", **labels})
    return value or 0.0


def _openai(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)


def _routes(base: str, headers: dict) -> dict:
    """The answer of each route family to one short request carrying `headers`."""
    out = {}
    with httpx.Client(base_url=base, headers=headers, timeout=120) as http:
        out["completions"] = http.post("/v1/completions", json={
            "model": "tiny", "prompt": PROMPT, "max_tokens": 2})
        out["chat-stream"] = http.post("/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2, "stream": True})
        out["native"] = http.post("/v1/chat/completions", json={
            "input_ids": PROMPT, "max_dec_len": 2, "stream": False})
        out["triton"] = http.post("/v2/models/ensemble/generate", json={
            "text_input": "hi", "max_tokens": 2})
    return out


def test_a_request_expected_to_wait_too_long_is_refused_at_once(served):
    engine = served.app.state.server.engine
    admitted = engine.stats.num_admitted
    engine.queue_wait.estimate_s = lambda tenant, priority, waiting: 12.0  # (a long queue)
    try:
        refused = _routes(served.base, {"X-Max-Queue-Time": "5"})
        client = anthropic.Anthropic(base_url=served.base, api_key="x", max_retries=0,
                                     default_headers={"X-Max-Queue-Time": "5"})
        with pytest.raises(anthropic.RateLimitError):
            client.messages.create(model="tiny", max_tokens=2,
                                   messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(openai.RateLimitError) as caught:
            _openai(served.base).completions.create(
                model="tiny", prompt=PROMPT, max_tokens=2,
                extra_headers={"X-Max-Queue-Time": "5"})
        unlimited = _routes(served.base, {})  # (no limit asked, none configured)
    finally:
        del engine.queue_wait.estimate_s
    assert "max_queue_time (5 s)" in caught.value.message
    for route, response in refused.items():
        assert response.status_code == 429, (route, response.text)
        assert response.headers["retry-after"] == "7", route  # (12 s expected less 5)
    assert refused["completions"].json()["error"]["type"] == "RateLimitError"
    assert refused["native"].json()["error_code"] == 429
    assert all(r.status_code == 200 for r in unlimited.values()), unlimited
    assert engine.stats.num_admitted == admitted + 4  # (only the unlimited ones ran)
    assert sample(served, "tokenmill:request_rejected_total", reason="queue_time") == 6
    # (the clients' API key names their tenant, one --tenant-weights does not name)
    assert sample(served, "tokenmill:tenant_requests_total", tenant="default",
                  outcome="refused") == 4
    assert sample(served, "tokenmill:tenant_requests_total", tenant="other",
                  outcome="refused") == 2


def test_a_request_kept_waiting_past_its_limit_is_refused_then(served):
    client = _openai(served.base)
    hold = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=HOLD_TOKENS,
                                     temperature=0, stream=True,
                                     extra_body={"ignore_eos": True})
    next(iter(hold))  # (it holds the only slot now)
    limit = {"X-Max-Queue-Time": "0.2"}
    late = lambda tenant: sample(served, "tokenmill:tenant_requests_total",  # noqa: E731
                                 tenant=tenant, outcome="refused")
    before = late("default"), late("other")
    try:
        refused = _routes(served.base, limit)
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(model="tiny", max_tokens=2, extra_headers=limit,
                                           messages=[{"role": "user", "content": "hi"}])
        stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2,
                                           stream=True, extra_headers=limit)
        with pytest.raises(openai.APIError, match="max_queue_time"):
            list(stream)
    finally:
        hold.close()
    for route in ("completions", "native", "triton"):
        assert refused[route].status_code == 429, (route, refused[route].text)
        assert int(refused[route].headers["retry-after"]) >= 1
    assert '"code":429' in refused["chat-stream"].text.replace(" ", "")  # (started: in-stream)
    engine = served.app.state.server.engine
    assert wait_until(lambda: engine.num_in_flight() == 0 and not engine.stats.num_running, 60)
    # (counted as refused, by tenant: the four httpx requests, the openai client's two)
    assert (late("default") - before[0], late("other") - before[1]) == (4, 2)


def test_tenants_from_their_header_into_metrics(served):
    def tokens(tenant):
        return sample(served, "tokenmill:tenant_generation_tokens_total", tenant=tenant)

    before = {t: tokens(t) for t in ("gold", "other", "default")}
    client = _openai(served.base)  # (its API key "x": tenant key-2d711642b726, unnamed)
    for tenant, n in (("gold", 3), ("someone-else", 2), (None, 4)):
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=n, temperature=0,
                                  extra_body={"ignore_eos": True},
                                  extra_headers={"X-Tenant-Id": tenant} if tenant else {})
    httpx.post(served.base + "/v1/completions", timeout=60, json={  # (no key, no header)
        "model": "tiny", "prompt": PROMPT, "max_tokens": 5, "ignore_eos": True})
    assert tokens("gold") - before["gold"] == 3
    assert tokens("other") - before["other"] == 2 + 4  # (not named by --tenant-weights)
    assert tokens("default") - before["default"] == 5
    bad = httpx.post(served.base + "/v1/completions", headers={"X-Tenant-Id": "a b"},
                     json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2}, timeout=60)
    assert bad.status_code == 400 and "tenant header" in bad.json()["error"]["message"]
    bad = httpx.post(served.base + "/v1/completions", headers={"X-Max-Queue-Time": "soon"},
                     json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2}, timeout=60)
    assert bad.status_code == 400 and "X-Max-Queue-Time" in bad.json()["error"]["message"]
