"""The OpenAI API through the real `openai` SDK, checked against the offline engine."""

import json

import httpx
import openai
import pytest

from tests.serving import HOLD_TOKENS, service_thread, wait_until
from tokenmill import SamplingParams
from tokenmill.config.api import ApiOptions


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


PROMPT = "Once upon a time"


def test_completion_matches_offline_engine(client, offline_llm):
    resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0)
    want = offline_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=10),
                                use_tqdm=False)[0]
    choice = resp.choices[0]
    assert choice.text == want.outputs[0].text
    assert choice.finish_reason == want.outputs[0].finish_reason
    assert resp.object == "text_completion" and resp.model == "tiny"
    assert resp.usage.prompt_tokens == len(want.prompt_token_ids)
    assert resp.usage.completion_tokens == len(want.outputs[0].token_ids)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_streamed_completion_equals_whole_and_reports_usage(client):
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert sum(1 for c in text_chunks if c.choices[0].text) > 1  # really incremental
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_a_stream_interval_sends_fewer_larger_chunks_of_the_same_text(engine_address, client):
    """A second API over the same engine with `--stream-interval 5`: the stream's text and
    tokens equal the whole response's; after the first chunk every chunk but the last holds at
    least 5 tokens (a reader that fell behind only gets more)."""
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=23, temperature=0,
                                      logprobs=1)
    path, address = engine_address
    with service_thread(path, address, api=ApiOptions(stream_interval=5),
                        max_dec_len=256) as thread:
        chunked = openai.OpenAI(base_url=thread.base + "/v1", api_key="unused", max_retries=0)
        chunks = [c.choices[0] for c in chunked.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=23, temperature=0, logprobs=1, stream=True)]
    assert "".join(c.text for c in chunks) == whole.choices[0].text
    tokens = [c.logprobs.tokens for c in chunks]
    assert sum(tokens, []) == whole.choices[0].logprobs.tokens
    assert all(len(t) >= 5 for t in tokens[1:-1]) and 2 <= len(tokens) <= 6
    assert chunks[-1].finish_reason == "length"


def test_chat_matches_offline_chat_and_streams_the_same(client, offline_llm):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Name a color."}]
    resp = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10,
                                          temperature=0)
    want = offline_llm.chat(messages, SamplingParams(temperature=0, max_tokens=10),
                            use_tqdm=False)[0].outputs[0]
    assert resp.choices[0].message.content == want.text
    assert resp.choices[0].message.role == "assistant" and resp.object == "chat.completion"
    chunks = list(client.chat.completions.create(model="tiny", messages=messages,
                                                 max_tokens=10, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason


def test_several_prompts_n_and_seed(client):
    resp = client.completions.create(model="tiny", prompt=["a b", "c d e"], max_tokens=5,
                                     n=2, temperature=1.0, seed=7)
    assert sorted(c.index for c in resp.choices) == [0, 1, 2, 3]
    again = client.completions.create(model="tiny", prompt=["a b", "c d e"], max_tokens=5,
                                      n=2, temperature=1.0, seed=7)
    assert [c.text for c in resp.choices] == [c.text for c in again.choices]
    streamed = list(client.completions.create(model="tiny", prompt=["a b", "c d e"],
                                              max_tokens=5, n=2, temperature=1.0, seed=7,
                                              stream=True))
    by_index = {}
    for chunk in streamed:
        for c in chunk.choices:
            by_index[c.index] = by_index.get(c.index, "") + c.text
    assert [by_index[c.index] for c in resp.choices] == [c.text for c in resp.choices]


def test_logprobs_match_offline(client, offline_llm):
    resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0,
                                     logprobs=2)
    want = offline_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4, logprobs=2),
                                use_tqdm=False)[0].outputs[0]
    got = resp.choices[0].logprobs.token_logprobs
    expect = [lp[t].logprob for t, lp in zip(want.token_ids, want.logprobs)]
    assert got == pytest.approx(expect, abs=1e-4)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user",
                                                                   "content": "hi"}],
                                          max_tokens=3, temperature=0, logprobs=True,
                                          top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(p.top_logprobs) == 2 for p in content)
    assert all(p.top_logprobs[0].logprob >= p.top_logprobs[1].logprob for p in content)


def test_stop_string_never_reaches_the_client(client):
    base = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16,
                                     temperature=0).choices[0].text
    stop = base[len(base) // 2:len(base) // 2 + 3]
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16,
                                      temperature=0, stop=[stop])
    assert whole.choices[0].text == base[:base.index(stop)]
    assert whole.choices[0].finish_reason == "stop"
    pieces = [c.choices[0].text for c in client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop], stream=True)]
    assert "".join(pieces) == whole.choices[0].text


def test_models_and_aliases(client):
    assert [m.id for m in client.models.list().data] == ["tiny", "tiny-alias"]
    resp = client.completions.create(model="tiny-alias", prompt="x", max_tokens=2)
    assert resp.model == "tiny-alias"


def test_errors_have_openai_shape(client, server):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    assert "does not exist" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt="x", max_tokens=2, temperature=-1)
    assert "temperature" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt="x", max_tokens=10_000)
    assert "maximum context length is 512 tokens" in err.value.message
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[], max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt=[10**9], max_tokens=2)
    resp = httpx.post(server + "/v1/completions", content=b"{not json", timeout=10)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == 400
    resp = httpx.post(server + "/v1/completions", json={"model": "tiny", "prompt": "x",
                                                        "n": "many"}, timeout=10)
    body = resp.json()["error"]
    assert resp.status_code == 400 and body["type"] == "BadRequestError" and "n" in body["message"]
    assert set(body) == {"message", "type", "param", "code"}
    assert "Traceback" not in resp.text


def test_seed_base_url_paths_ignore_model(server):
    seed_client = openai.OpenAI(base_url=server + "/v1/chat/completions", api_key="x",
                                max_retries=0)
    chat = seed_client.chat.completions.create(
        model="anything", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        temperature=0)
    assert chat.choices[0].message.content is not None
    comp = seed_client.completions.create(model="anything", prompt="hi", max_tokens=3)
    assert comp.usage.completion_tokens == 3


def test_client_disconnect_frees_the_request(long_server):
    state, server = long_server.app.state.server, long_server.base
    # 16 prompts x HOLD_TOKENS: still generating whenever the client leaves.
    body = {"model": "tiny", "prompt": [f"long story {i}" for i in range(16)],
            "max_tokens": HOLD_TOKENS, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server + "/v1/completions", json=body, timeout=30) as resp:
        # Kept in a name: a line iterator dropped by `break` closes the response at once,
        # and the server could see the client gone before the check below.
        lines = resp.iter_lines()
        for line in lines:
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                break
        assert state.engine.num_in_flight() > 0
    assert wait_until(lambda: state.engine.num_in_flight() == 0
                      and state.engine.stats.num_running == 0)
    # A non-streaming request whose client gives up is aborted too.
    aborted = state.engine.num_aborted
    many = {**body, "stream": False, "prompt": [f"story {i}" for i in range(16)]}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server + "/v1/completions", json=many, timeout=0.5)
    assert wait_until(lambda: state.engine.num_in_flight() == 0
                      and state.engine.stats.num_running == 0)
    assert state.engine.num_aborted == aborted + 16
    assert state.engine.stats.kv_blocks_used == 0


def test_vllm_extras_echo_and_max_completion_tokens(client, offline_llm):
    extras = {"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.3, "min_tokens": 3}
    resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8,
                                     temperature=0.9, seed=11, extra_body=extras)
    want = offline_llm.generate(PROMPT, SamplingParams(temperature=0.9, seed=11, max_tokens=8,
                                                       **extras), use_tqdm=False)[0]
    assert resp.choices[0].text == want.outputs[0].text
    echoed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8,
                                       temperature=0, echo=True)
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8,
                                      temperature=0)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user",
                                                                   "content": "hi"}],
                                          max_completion_tokens=3, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 3 and chat.choices[0].finish_reason == "length"


def test_logit_bias_matches_the_offline_engine(client, offline_llm):
    ids = offline_llm.get_tokenizer().encode(PROMPT)
    bias = {ids[1]: 100.0}
    resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5,
                                     temperature=0, logit_bias={str(k): v for k, v in
                                                                bias.items()})
    want = offline_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=5,
                                                       logit_bias=bias), use_tqdm=False)[0]
    assert resp.choices[0].text == want.outputs[0].text
    assert want.outputs[0].token_ids == [ids[1]] * 5
