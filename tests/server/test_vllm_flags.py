"""vLLM's serve flags that R1-style deployment command lines carry: accepted, the ones that
mean something here in effect (`--chat-template`, `--max-logprobs`, `--enable-chunked-prefill`),
the ones with no effect logged once (the ones asking for what tokenmill does not do are
refused by name: test_server_config.py's table of invalid values)."""

import re

import httpx
import pytest

from tests.serving import Served, with_think_tokens
from tokenmill.config.server import build_server_config
from tokenmill.loading.checkpoint import load_tokenizer
from tokenmill.tokenizer import load_chat_template

R1_LINE = ("--max-model-len 4096 --max-num-seqs 64 --gpu-memory-utilization 0.9 "
           "--enable-reasoning --reasoning-parser deepseek_r1 --disable-log-requests "
           "--enable-chunked-prefill --max-num-batched-tokens 512 --swap-space 16 "
           "--max-seq-len-to-capture 32768 --uvicorn-log-level warning --disable-log-stats "
           "--guided-decoding-backend xgrammar --scheduling-policy fcfs "
           "--preemption-mode recompute --disable-frontend-multiprocessing --trust-remote-code")
NO_EFFECT = ("--enable-reasoning", "--disable-log-requests", "--swap-space",
             "--max-seq-len-to-capture", "--uvicorn-log-level", "--disable-log-stats",
             "--preemption-mode", "--disable-frontend-multiprocessing", "--trust-remote-code")
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"


def test_an_r1_command_line_parses_with_its_flags_in_effect():
    config = build_server_config(["/models/r1", *R1_LINE.split()], {})
    assert config.engine.enable_chunked_prefill and config.engine.max_num_batched_tokens == 512
    assert config.reasoning_parser == "deepseek_r1" and config.api.max_logprobs == 20
    assert set(NO_EFFECT) == {flag for flag, _ in config.ignored_flags}
    off = build_server_config(["m", "--no-enable-chunked-prefill", "--max-logprobs", "3"], {})
    assert not off.engine.enable_chunked_prefill and off.api.max_logprobs == 3
    more = build_server_config([
        "org/m", "--revision", "v2", "--download-dir", "/d", "--disable-fastapi-docs",
        "--root-path", "/api", "--load-format", "safetensors", "--tokenizer-mode", "auto",
        "-O", "3", "--additional-config", "{}"], {})
    assert (more.engine.revision, more.engine.download_dir) == ("v2", "/d")
    assert more.api.disable_docs and more.api.root_path == "/api"
    assert {flag for flag, _ in more.ignored_flags} == {
        "--load-format", "--tokenizer-mode", "--compilation-config", "--additional-config"}


def test_without_the_flags_none_of_it_is_on(server):
    """The shared test server, started without them: no X-Request-Id, no /load, no
    prompt_tokens_details, no CORS headers, the docs served, role assistant."""
    got = httpx.post(server + "/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1})
    assert "x-request-id" not in got.headers
    assert "prompt_tokens_details" not in got.json()["usage"]
    assert got.json()["choices"][0]["message"]["role"] == "assistant"
    assert httpx.get(server + "/load").status_code == 404
    assert httpx.get(server + "/openapi.json").status_code == 200
    preflight = httpx.options(server + "/v1/chat/completions", headers={
        "Origin": "http://ui.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in preflight.headers


def test_a_chat_template_is_a_file_or_the_template(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert load_chat_template(str(path)) == TEMPLATE
    assert load_chat_template(TEMPLATE) == TEMPLATE
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="'/no/such.jinja' looks like a file, but it cannot"):
        load_chat_template("/no/such.jinja")


def test_a_reasoning_parser_needs_the_model_to_have_its_markers(tiny_models, tmp_path):
    """The parser's constraint starts after the </think> token: a model without one would
    never write it and its json_schema / named tool_choice would never apply (free text)."""
    from tokenmill.entrypoints.parsers.reasoning import ReasoningParser

    plain = load_tokenizer(tiny_models("llama")[0])
    for name in ("deepseek_r1", "qwen3"):
        with pytest.raises(ValueError, match=f"--reasoning-parser {name} needs a model whose "
                           "vocabulary has <think> and </think> as tokens; this model's has no "
                           "<think> or </think> token"):
            ReasoningParser(name, plain)
        ReasoningParser(name, load_tokenizer(with_think_tokens(tiny_models("llama")[0],
                                                               tmp_path / name)))
    served = Served(tiny_models("llama")[0], tmp_path, "--reasoning-parser", "qwen3").start()
    try:
        served.process.wait(300)
        out = served.process.stdout.read().decode()
    finally:
        served.stop()
    assert served.process.returncode == 2
    assert "Traceback" not in out, out[-3000:]
    assert out.strip().splitlines()[-1].startswith(
        "error: --reasoning-parser qwen3 needs a model whose vocabulary"), out[-1000:]


def test_the_r1_command_line_serves_with_its_template_and_logprobs_cap(tiny_models, tmp_path):
    path = with_think_tokens(tiny_models("llama")[0], tmp_path / "r1")
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    served = Served(path, tmp_path, *R1_LINE.replace("4096", "512").split(),
                    "--chat-template", str(template), "--max-logprobs", "2",
                    "--disable-fastapi-docs", "--root-path", "/api", "--response-role", "bot",
                    "--enable-request-id-headers", "--enable-server-load-tracking",
                    "--enable-prompt-tokens-details", "--allowed-origins",
                    '["http://ui.example"]', "--return-tokens-as-token-ids")
    long_prompt = {"model": "tiny", "prompt": "Once upon a time " * 12, "max_tokens": 2}
    messages = [{"role": "user", "content": "Name a color."}]
    with served.running():
        tokens = httpx.post(served.api + "/tokenize", json={"messages": messages}).json()
        chat = httpx.post(served.api + "/v1/chat/completions", json={
            "model": "tiny", "messages": messages, "max_tokens": 3, "logprobs": True,
            "top_logprobs": 2}).json()
        over = httpx.post(served.api + "/v1/completions", json={
            "model": "tiny", "prompt": "Once", "max_tokens": 3, "logprobs": 3})
        docs = [httpx.get(served.api + p).status_code for p in ("/docs", "/openapi.json")]
        prefixed = httpx.get(served.api + "/api/v1/models").json()
        cold, warm = (httpx.post(served.api + "/v1/completions", json=long_prompt,
                                 headers={"X-Request-Id": f"mine-{k}"}) for k in range(2))
        load = httpx.get(served.api + "/load").json()
        stream = httpx.post(served.api + "/v1/chat/completions", json={
            "model": "tiny", "messages": messages, "max_tokens": 2, "stream": True}).text
        allowed, other = (httpx.options(served.api + "/v1/chat/completions", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST"})
            for origin in ("http://ui.example", "http://elsewhere.example"))
    tok = load_tokenizer(path)
    rendered = "<user>Name a color.<assistant>"
    assert tokens["tokens"] == tok.encode(rendered, add_special_tokens=False)
    assert chat["usage"]["prompt_tokens"] == tokens["count"]
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content[0]["top_logprobs"]) == 2
    shown = [t["token"] for t in content] + [t["token"] for t in content[0]["top_logprobs"]]
    assert all(re.fullmatch(r"token_id:\d+", t) for t in shown), shown
    assert content[0]["bytes"] == list(content[0]["token"].encode())
    ids = [int(t["token"].split(":")[1]) for t in content]
    message = chat["choices"][0]["message"]  # (the R1 reasoning split: all of it reasoning)
    assert tok.decode(ids) == (message["reasoning_content"] or "") + (message["content"] or "")
    assert over.status_code == 400 and over.json()["error"]["param"] == "logprobs"
    assert "at most 2" in over.json()["error"]["message"]
    assert docs == [404, 404] and prefixed["data"][0]["id"] == "tiny"
    assert chat["choices"][0]["message"]["role"] == "bot" and '"role":"bot"' in stream
    assert [r.headers["x-request-id"] for r in (cold, warm)] == ["mine-0", "mine-1"]
    assert over.headers["x-request-id"]  # (one made up for a request without)
    cached = [r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in (cold, warm)]
    assert cached[0] == 0 < cached[1] < cold.json()["usage"]["prompt_tokens"]
    assert load == {"server_load": 0}
    assert allowed.headers["access-control-allow-origin"] == "http://ui.example"
    assert "access-control-allow-origin" not in other.headers
    log = served.process.stdout.read().decode()
    for flag in NO_EFFECT:
        assert f"{flag}: accepted, no effect here" in log, log[-2000:]
