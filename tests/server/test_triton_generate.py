"""Triton's HTTP generate extension, TensorRT-LLM style, against the offline engine."""

import json

import httpx
import pytest

from tokenmill import SamplingParams

PROMPT = "The river runs"


def greedy_text(llm, max_tokens):
    return llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=max_tokens),
                        use_tqdm=False)[0].outputs[0].text


def events(server, path, body):
    with httpx.stream("POST", server + path, json=body, timeout=60) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        return [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: ")]


def test_generate_includes_the_prompt_like_trtllm(server, offline_llm):
    body = {"text_input": PROMPT, "max_tokens": 10, "bad_words": "", "stop_words": ""}
    resp = httpx.post(server + "/v2/models/ensemble/generate", json=body, timeout=60)
    assert resp.status_code == 200
    out = resp.json()
    assert out["model_name"] == "ensemble" and out["model_version"] == "1"
    assert out["text_output"] == PROMPT + greedy_text(offline_llm, 10)
    resp = httpx.post(server + "/v2/models/tiny/versions/1/generate",
                      json={**body, "parameters": {"exclude_input_in_output": True}},
                      timeout=60)
    assert resp.json()["text_output"] == greedy_text(offline_llm, 10)


def test_generate_stream_sends_deltas(server, offline_llm):
    got = events(server, "/v2/models/ensemble/generate_stream",
                 {"text_input": PROMPT, "max_tokens": 12, "stream": True})
    assert len(got) > 1
    assert "".join(e["text_output"] for e in got) == greedy_text(offline_llm, 12)


def test_log_probs_and_sampling_inputs(server, offline_llm):
    body = {"text_input": PROMPT, "max_tokens": 5, "return_log_probs": True}
    out = httpx.post(server + "/v2/models/tiny/generate", json=body, timeout=60).json()
    want = offline_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=5, logprobs=0),
                                use_tqdm=False)[0].outputs[0]
    expect = [lp[t].logprob for t, lp in zip(want.token_ids, want.logprobs)]
    assert out["output_log_probs"] == pytest.approx(expect, abs=1e-4)
    assert out["cum_log_probs"] == pytest.approx(sum(expect), abs=1e-3)
    sampled = {"text_input": PROMPT, "max_tokens": 6, "top_k": 20, "temperature": 0.8,
               "random_seed": 3}
    first = httpx.post(server + "/v2/models/tiny/generate", json=sampled, timeout=60).json()
    again = httpx.post(server + "/v2/models/tiny/generate", json=sampled, timeout=60).json()
    assert first["text_output"] == again["text_output"]


@pytest.mark.parametrize("path,body,status,text", [
    ("/v2/models/nope/generate", {"text_input": "x"}, 404, "unknown model"),
    ("/v2/models/tiny/generate", {"max_tokens": 3}, 400, "text_input is required"),
    ("/v2/models/tiny/generate", {"text_input": "x", "max_tokens": "3"}, 400,
     "max_tokens must be an integer"),
    ("/v2/models/tiny/generate", {"text_input": "x", "colour": 1}, 400, "unexpected"),
    ("/v2/models/tiny/generate", {"text_input": "x", "bad_words": [3]}, 400, "bad_words"),
    ("/v2/models/tiny/generate", {"text_input": "x", "max_tokens": 5000}, 400,
     "context length"),
    ("/v2/models/tiny/generate_stream", {"text_input": "x", "temperature": -2, "top_k": 5},
     400, "temperature"),
])
def test_generate_errors(server, path, body, status, text):
    resp = httpx.post(server + path, json=body, timeout=30)
    assert resp.status_code == status
    assert text in resp.json()["error"]


def test_kserve_metadata_and_readiness(server):
    assert httpx.get(server + "/v2/health/live").status_code == 200
    assert httpx.get(server + "/v2/health/ready").status_code == 200
    assert httpx.get(server + "/v2/models/ensemble/ready").status_code == 200
    assert httpx.get(server + "/v2/models/nope/ready").status_code == 400
    meta = httpx.get(server + "/v2/models/tiny").json()
    assert meta["name"] == "tiny" and meta["outputs"][0]["name"] == "text_output"


def test_bad_words_and_stop_words(server, offline_llm):
    base_out = offline_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16),
                                    use_tqdm=False)[0].outputs[0]
    base = base_out.text
    tokenizer = offline_llm.get_tokenizer()
    word = next(w for w in (tokenizer.decode([t]).strip() for t in base_out.token_ids)
                if w.isalpha())
    body = {"text_input": PROMPT, "max_tokens": 16, "bad_words": [word],
            "exclude_input_in_output": True}
    out = httpx.post(server + "/v2/models/tiny/generate", json=body, timeout=60).json()
    assert out["text_output"] != base
    want = offline_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16,
                                                       bad_words=[word]),
                                use_tqdm=False)[0].outputs[0].text
    assert out["text_output"] == want
    stop = base[len(base) // 2:len(base) // 2 + 2]
    body = {"text_input": PROMPT, "max_tokens": 16, "stop_words": stop,
            "exclude_input_in_output": True}
    out = httpx.post(server + "/v2/models/tiny/generate", json=body, timeout=60).json()
    assert out["text_output"] == base[:base.index(stop)]
