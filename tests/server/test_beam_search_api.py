"""Beam search over the APIs, against transformers' `generate(num_beams=...)` on the same
tiny model: the OpenAI `use_beam_search` extension (completions and chat, whole and
streamed, `length_penalty`), Triton generate's `beam_width` (TensorRT-LLM's outputs: one
text and `cum_log_probs` per beam) and what beam search refuses rather than ignores."""

import json

import httpx
import openai
import pytest
import torch

PROMPT = [5, 9, 17, 33, 2, 40]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="x", max_retries=0)


def hf_beams(hf, ids, width, max_tokens, **kw) -> tuple[list[list[int]], list[float]]:
    """transformers' beams (generated tokens, padding removed) and their scores."""
    out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                                                                     dtype=torch.long),
                      num_beams=width, num_return_sequences=width, do_sample=False,
                      max_new_tokens=max_tokens, return_dict_in_generate=True,
                      output_scores=True, pad_token_id=1, eos_token_id=1, **kw)
    beams = []
    for row in out.sequences.tolist():
        gen = row[len(ids):]
        while gen and gen[-1] == 1 and len(gen) > 1 and gen[-2] == 1:
            gen.pop()  # (padding after an EOS)
        beams.append(gen)
    return beams, out.sequences_scores.tolist()


@pytest.mark.parametrize("kw", [{}, {"length_penalty": 0.5}])
def test_completions_equal_transformers(client, tiny_models, kw):
    path, hf = tiny_models("llama")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    want, _ = hf_beams(hf.eval(), PROMPT, 3, 7, **kw)
    resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=7, n=3,
                                     extra_body={"use_beam_search": True, **kw})
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert [c.text for c in resp.choices] == [tok.decode(b, skip_special_tokens=True)
                                              for b in want]
    assert resp.usage.completion_tokens == sum(len(b) for b in want)
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=7, n=3,
                                            stream=True, extra_body={"use_beam_search": True,
                                                                     **kw}))
    streamed = {c.choices[0].index: c.choices[0].text for c in chunks}
    assert [streamed[i] for i in range(3)] == [c.text for c in resp.choices]


def test_chat_beams_are_the_rendered_prompts_beams(client, server):
    messages = [{"role": "user", "content": "The quick brown fox"}]
    ids = httpx.post(server + "/tokenize", json={"model": "tiny", "messages": messages}
                     ).json()["tokens"]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, n=2,
                                          extra_body={"use_beam_search": True})
    plain = client.completions.create(model="tiny", prompt=ids, max_tokens=5, n=2,
                                      extra_body={"use_beam_search": True})
    assert [c.message.content for c in chat.choices] == [c.text for c in plain.choices]
    assert all(c.finish_reason in ("stop", "length") for c in chat.choices)


@pytest.mark.parametrize("extra, param", [
    ({"use_beam_search": True, "stop": ["x"]}, "stop"),
    ({"use_beam_search": True, "logprobs": 2}, "logprobs"),
    ({"use_beam_search": True, "frequency_penalty": 0.5}, "frequency_penalty"),
    ({"use_beam_search": True, "guided_regex": "[0-9]+"}, "guided_regex"),
    ({"length_penalty": 0.5}, "length_penalty"),
    ({"use_beam_search": True, "early_stopping": "sometimes"}, "early_stopping"),
])
def test_what_beam_search_refuses(client, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, n=2,
                                  extra_body=extra)
    assert info.value.body["param"] == param, info.value.body


def test_triton_beam_width_and_cum_log_probs(server, tiny_models):
    path, hf = tiny_models("llama")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    text = "Paris is the capital"
    want, scores = hf_beams(hf.eval(), tok.encode(text), 3, 6)
    body = {"text_input": text, "max_tokens": 6, "beam_width": 3, "return_log_probs": True,
            "exclude_input_in_output": True}
    out = httpx.post(server + "/v2/models/tiny/generate", json=body).json()
    assert out["text_output"] == [tok.decode(b, skip_special_tokens=True) for b in want]
    assert out["cum_log_probs"] == pytest.approx([s * len(b) for s, b in zip(scores, want)],
                                                 abs=1e-3)
    assert [len(lp) for lp in out["output_log_probs"]] == [len(b) for b in want]
    two = httpx.post(server + "/v2/models/tiny/generate",
                     json={**body, "num_return_sequences": 2}).json()
    assert two["text_output"] == out["text_output"][:2]
    stream = httpx.post(server + "/v2/models/tiny/generate_stream", json=body).text
    events = [json.loads(line[6:]) for line in stream.splitlines() if line.startswith("data: ")]
    assert [e["text_output"] for e in events] == [out["text_output"]]


@pytest.mark.parametrize("extra, text", [
    ({"beam_width": 2, "stop_words": ["x"]}, "stop_words"),
    ({"beam_width": 2, "num_return_sequences": 3}, "num_return_sequences"),
    ({"num_return_sequences": 2}, "num_return_sequences"),
    ({"beam_width": 0}, "beam_width"), ({"beam_width": 99}, "beam_width"),
    ({"length_penalty": 0.5}, "length_penalty"),
])
def test_triton_beam_errors(server, extra, text):
    r = httpx.post(server + "/v2/models/tiny/generate",
                   json={"text_input": "hi", "max_tokens": 4, **extra})
    assert r.status_code == 400 and text in r.json()["error"]


def test_best_of_returns_the_n_likeliest_samples(client):
    """best_of=4, n=2: the 2 of the 4 seeded samples (the same as n=4 with that seed draws)
    with the highest cumulative logprob, best first; usage counts all 4."""
    args = dict(model="tiny", prompt=PROMPT, max_tokens=6, temperature=1.0, seed=11)
    four = client.completions.create(**args, n=4, logprobs=0)
    ranked = sorted(four.choices, key=lambda c: -sum(c.logprobs.token_logprobs))
    best = client.completions.create(**args, n=2, best_of=4)
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert [c.index for c in best.choices] == [0, 1]
    assert all(c.logprobs is None for c in best.choices)  # (not asked for)
    assert best.usage.completion_tokens == four.usage.completion_tokens
    with_lp = client.completions.create(**args, n=2, best_of=4, logprobs=1)
    assert [c.text for c in with_lp.choices] == [c.text for c in best.choices]
    assert all(len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) for c in with_lp.choices)
    for extra, text in (({"n": 3, "best_of": 2}, "at least n"),
                        ({"n": 1, "best_of": 2, "stream": True}, "streamed")):
        with pytest.raises(openai.BadRequestError, match=text):
            client.completions.create(**{**args, **extra})


@pytest.mark.parametrize("penalty", [1000.0, -1000.0])
def test_extreme_length_penalties_are_answered_on_every_route(client, server, penalty):
    """length_penalty ±1000 (in range) overflowed the beam score: 500 on the OpenAI, native
    and Triton routes. Each answers with its beams now."""
    out = client.completions.create(model="tiny", prompt="Paris is", max_tokens=6, n=2,
                                    extra_body={"use_beam_search": True,
                                                "length_penalty": penalty})
    assert len(out.choices) == 2
    triton = httpx.post(server + "/v2/models/tiny/generate", json={
        "text_input": "Paris is", "max_tokens": 6, "beam_width": 2, "length_penalty": penalty},
        timeout=60)
    assert triton.status_code == 200 and len(triton.json()["text_output"]) == 2
