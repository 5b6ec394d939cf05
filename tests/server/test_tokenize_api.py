"""vLLM's /tokenize and /detokenize: ids equal the tokenizer's (and the chat route's prompt
for messages), round trips, and errors in the OpenAI shape naming the field."""

import httpx
import pytest

from tokenmill.loading.checkpoint import load_tokenizer


@pytest.fixture(scope="module")
def tok(tiny_models):
    return load_tokenizer(tiny_models("llama")[0])


@pytest.mark.parametrize("root", ["", "/v1"])
def test_tokenize_prompt_and_messages(server, tok, root):
    text = "Once upon a time, there was"
    got = httpx.post(f"{server}{root}/tokenize", json={"model": "tiny", "prompt": text,
                                                       "return_token_strs": True}).json()
    assert got["tokens"] == tok.encode(text) and got["count"] == len(got["tokens"])
    assert got["token_strs"] == tok.convert_ids_to_tokens(got["tokens"])
    assert got["max_model_len"] == 512
    bare = httpx.post(f"{server}{root}/tokenize",
                      json={"prompt": text, "add_special_tokens": False}).json()
    assert bare["tokens"] == tok.encode(text, add_special_tokens=False)
    assert bare["token_strs"] is None
    messages = [{"role": "user", "content": "Name a color."}]
    chat = httpx.post(f"{server}{root}/tokenize", json={"model": "tiny",
                                                        "messages": messages}).json()
    assert chat["tokens"] == tok.apply_chat_template(messages, add_generation_prompt=True,
                                                     tokenize=True, return_dict=False)
    # the same prompt the chat route runs: its usage counts it
    usage = httpx.post(f"{server}/v1/chat/completions", json={
        "model": "tiny", "messages": messages, "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == chat["count"]
    back = httpx.post(f"{server}{root}/detokenize",
                      json={"model": "tiny", "tokens": bare["tokens"]}).json()
    assert back == {"prompt": text}


@pytest.mark.parametrize("path,body,status,param", [
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model"),
    ("/tokenize", {"prompt": "x", "unknown": 1}, 400, "unknown"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
])
def test_errors_name_the_field(server, path, body, status, param):
    resp = httpx.post(server + path, json=body)
    assert resp.status_code == status, resp.text
    assert resp.json()["error"]["param"] == param
