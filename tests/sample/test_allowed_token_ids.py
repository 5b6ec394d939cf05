"""vLLM's `allowed_token_ids`: only those tokens are generated. Greedy tokens equal
transformers' argmax over the allowed set step by step, sampled tokens stay in it, n-gram
speculation verifies with the same restriction; over HTTP ids out of the vocabulary and an
empty list are refused naming the field."""

import httpx
import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.sample.sampler import SamplingBatch, adjusted

PROMPT = [5, 9, 23, 41, 7, 3]
ALLOWED = [3, 17, 41, 99, 150, 151]


def _restricted_greedy(model, prompt, allowed, steps):
    ids = list(prompt)
    keep = torch.tensor(allowed)
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(allowed[int(logits[keep].argmax())])
    return ids[len(prompt):]


def test_adjusted_keeps_only_the_allowed():
    logits = torch.randn(3, 20)
    batch = SamplingBatch(temperature=torch.zeros(3), allowed=[(1, [2, 5, 19])])
    want = logits.clone()
    out = adjusted(logits.clone(), batch)
    assert torch.equal(out[0], want[0]) and torch.equal(out[2], want[2])
    assert torch.equal(out[1, [2, 5, 19]], want[1, [2, 5, 19]])
    assert torch.isinf(out[1]).sum() == 17


@pytest.fixture(scope="module")
def llm(tiny_models):
    with LLM(tiny_models("llama")[0], max_model_len=256) as llm:
        yield llm


def test_greedy_and_sampled(llm, tiny_models):
    hf = tiny_models("llama")[1]
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                             allowed_token_ids=ALLOWED),
              SamplingParams(temperature=1.0, seed=3, max_tokens=24, ignore_eos=True,
                             allowed_token_ids=ALLOWED[:2]),
              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)]
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * 3, params, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == _restricted_greedy(hf, PROMPT, ALLOWED, 8)
    assert set(outs[1].outputs[0].token_ids) <= set(ALLOWED[:2])
    assert not set(outs[2].outputs[0].token_ids) <= set(ALLOWED)  # (its neighbour: free)


def test_with_ngram_speculation(tiny_models):
    hf = tiny_models("llama")[1]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}
    prompt = [3, 17, 41, 3, 17, 41, 3, 17]
    with LLM(tiny_models("llama")[0], max_model_len=256, speculative_config=spec) as llm:
        out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(
            temperature=0, max_tokens=10, ignore_eos=True, allowed_token_ids=ALLOWED),
            use_tqdm=False)[0]
    assert out.outputs[0].token_ids == _restricted_greedy(hf, prompt, ALLOWED, 10)


@pytest.mark.parametrize("value,fragment", [([], "allowed_token_ids"),
                                            ([1, 10**6], "allowed_token_ids token ids")])
def test_refused_over_http(server, value, fragment):
    resp = httpx.post(server + "/v1/completions", json={
        "model": "tiny", "prompt": "hi", "max_tokens": 2, "allowed_token_ids": value},
        timeout=30)
    assert resp.status_code == 400 and fragment in resp.json()["error"]["message"], resp.text
    assert resp.json()["error"]["param"] == "allowed_token_ids"


def test_over_http(server, offline_llm):
    """Greedy over HTTP with allowed_token_ids answers as the engine does offline."""
    resp = httpx.post(server + "/v1/completions", json={
        "model": "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
        "allowed_token_ids": ALLOWED}, timeout=30)
    assert resp.status_code == 200, resp.text
    want = offline_llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(
        temperature=0, max_tokens=6, allowed_token_ids=ALLOWED), use_tqdm=False)[0].outputs[0]
    assert set(want.token_ids) <= set(ALLOWED)
    assert resp.json()["choices"][0]["text"] == want.text
