"""What evaluation harnesses send over HTTP, through the `openai` SDK: completions with
`echo` and `logprobs` return the prompt's tokens scored (the first unscored, as OpenAI sends
it), `max_tokens: 0` with `echo` returns the prompt alone, and vLLM's `prompt_logprobs`;
every log probability equal to transformers' log-softmax over the same tiny model."""

import httpx
import openai
import pytest
import torch

PROMPT_IDS = [5, 9, 23, 41, 7, 3, 100, 12]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference(tiny_models):
    """transformers' log-probability of each prompt token given those before it."""
    model = tiny_models("llama")[1]
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT_IDS])).logits[0].float()
    scores = torch.log_softmax(logits, -1)
    return [scores[i - 1, PROMPT_IDS[i]].item() for i in range(1, len(PROMPT_IDS))], scores


def test_echo_with_max_tokens_zero_scores_the_prompt(client, reference, tiny_models):
    """The loglikelihood request (lm-evaluation-harness's local-completions): the prompt
    echoed, scored token by token, nothing generated."""
    from transformers import AutoTokenizer

    want, scores = reference
    resp = client.completions.create(model="tiny", prompt=PROMPT_IDS, max_tokens=0, echo=True,
                                     logprobs=1, temperature=0)
    choice = resp.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(PROMPT_IDS) and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    for i, (chosen, top) in enumerate(zip(lp.token_logprobs[1:], lp.top_logprobs[1:])):
        # (the token and the 1 best, keyed by text: where the tiny tokenizer gives both the
        # same text, one entry)
        assert (chosen in top.values() or lp.tokens[i + 1] in top) and len(top) <= 2
        assert max(top.values()) == pytest.approx(scores[i].max().item(), abs=1e-4)
    tokenizer = AutoTokenizer.from_pretrained(tiny_models("llama")[0])
    assert choice.text == tokenizer.decode(PROMPT_IDS)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert choice.finish_reason == "length" and resp.usage.completion_tokens == 0


def test_echo_with_new_tokens(client, reference):
    """Echo with logprobs and 3 new tokens: the prompt's part, then the generated part as a
    request without echo returns it."""
    want, _ = reference
    echoed = client.completions.create(model="tiny", prompt=PROMPT_IDS, max_tokens=3,
                                       echo=True, logprobs=2, temperature=0).choices[0]
    plain = client.completions.create(model="tiny", prompt=PROMPT_IDS, max_tokens=3,
                                      logprobs=2, temperature=0).choices[0]
    n = len(PROMPT_IDS)
    assert echoed.logprobs.token_logprobs[1:n] == pytest.approx(want, abs=1e-4)
    assert echoed.logprobs.tokens[n:] == plain.logprobs.tokens
    assert echoed.logprobs.token_logprobs[n:] == pytest.approx(plain.logprobs.token_logprobs,
                                                               abs=1e-5)
    assert echoed.text.endswith(plain.text)
    chunks = [c.choices[0] for c in client.completions.create(
        model="tiny", prompt=PROMPT_IDS, max_tokens=3, echo=True, logprobs=2, temperature=0,
        stream=True)]
    assert sum((c.logprobs.tokens for c in chunks), []) == echoed.logprobs.tokens
    assert "".join(c.text for c in chunks) == echoed.text


def test_prompt_logprobs(client, server, reference):
    """vLLM's prompt_logprobs on completions (per choice) and chat (beside the choices)."""
    want, scores = reference
    resp = client.completions.create(model="tiny", prompt=PROMPT_IDS, max_tokens=2,
                                     temperature=0, extra_body={"prompt_logprobs": 3})
    positions = resp.choices[0].model_extra["prompt_logprobs"]
    assert positions[0] is None and len(positions) == len(PROMPT_IDS)
    for i, (token, position) in enumerate(zip(PROMPT_IDS[1:], positions[1:])):
        assert position[str(token)]["logprob"] == pytest.approx(want[i], abs=1e-4)
        best = torch.topk(scores[i], 3).indices.tolist()
        assert set(map(str, best)) <= set(position)
        assert {v["rank"] for k, v in position.items() if int(k) in best} == {1, 2, 3}
    chat = httpx.post(server + "/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "prompt_logprobs": 0}, timeout=60).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) > 1
    assert all(len(p) == 1 for p in chat["prompt_logprobs"][1:])


@pytest.mark.parametrize("body,fragment", [
    ({"max_tokens": 0}, "needs echo"),
    ({"max_tokens": 0, "echo": True, "stream": True}, "needs echo, without stream"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
])
def test_refusals(server, body, fragment):
    resp = httpx.post(server + "/v1/completions", json={"model": "tiny", "prompt": "hi",
                                                        **body}, timeout=30)
    assert resp.status_code == 400 and fragment in resp.json()["error"]["message"], resp.text
