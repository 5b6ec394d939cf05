"""Prefill/decode disaggregation as a user runs it: two `tokenmill serve` processes with
--kv-transfer-config on 127.0.0.1 and `tokenmill disagg-proxy` in front; the OpenAI client
through the proxy gets what one engine answers (whole and streamed, completions and chat),
the decode instance reads the prompt's blocks instead of computing them; with the prefill
instance gone, the proxy answers 502 and the decode instance refuses parameters it can no
longer read with a 503 naming the cause, and goes on serving."""

import contextlib
import os
import subprocess
import sys

import httpx
from helpers import require_nixl
from serving import Served, free_port, metric_sum, wait_until

require_nixl()

CONFIG = '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'
PROMPT = [(i * 7) % 300 + 3 for i in range(200)]  # (12 full blocks of 16 and 8)
GREEDY = {"temperature": 0, "max_tokens": 10, "ignore_eos": True}


@contextlib.contextmanager
def proxy(prefill: str, decode: str, tmp_path):
    port = free_port()
    with open(os.path.join(str(tmp_path), f"proxy-{port}.log"), "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "tokenmill.entrypoints.cli", "disagg-proxy", "--prefill",
             prefill, "--decode", decode, "--port", str(port)],
            stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(url + "/health", timeout=5).status_code == 200
        except httpx.TransportError:
            return process.poll() is not None

    try:
        assert wait_until(up, 300) and process.poll() is None
        yield url
    finally:
        process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(30)
        if process.poll() is None:
            process.kill()
            process.wait(30)


def test_through_the_proxy_as_one_engine(tiny_models, tmp_path):
    from openai import OpenAI

    path = tiny_models("llama")[0]
    flags = ("--max-model-len", "512", "--kv-transfer-config", CONFIG)
    prefill, decode = Served(path, tmp_path, *flags), Served(path, tmp_path, *flags)
    with prefill.running(), decode.running(), proxy(prefill.api, decode.api, tmp_path) as url:
        one = httpx.post(prefill.api + "/v1/completions", timeout=120,
                         json={"model": "tiny", "prompt": PROMPT, **GREEDY}).json()
        client = OpenAI(base_url=url + "/v1", api_key="none")
        got = client.completions.create(model="tiny", prompt=PROMPT, temperature=0,
                                        max_tokens=10, extra_body={"ignore_eos": True})
        assert got.choices[0].text == one["choices"][0]["text"]
        assert got.usage.completion_tokens == 10
        assert metric_sum(decode.metrics, "tokenmill:kv_transfer_blocks_read_total") == 12
        streamed = client.completions.create(model="tiny", prompt=PROMPT, temperature=0,
                                             max_tokens=10, stream=True,
                                             extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in streamed) == one["choices"][0]["text"]
        messages = [{"role": "user", "content": "say something about the sea " * 6}]
        chat_one = httpx.post(prefill.api + "/v1/chat/completions", timeout=120, json={
            "model": "tiny", "messages": messages, **GREEDY}).json()
        chat = client.chat.completions.create(model="tiny", messages=messages, temperature=0,
                                              max_tokens=10, extra_body={"ignore_eos": True})
        assert chat.choices[0].message.content == chat_one["choices"][0]["message"]["content"]
        assert metric_sum(decode.metrics, "tokenmill:kv_transfer_blocks_read_total") > 12
        bad = httpx.post(url + "/v1/completions", timeout=60,
                         json={"model": "tiny", "prompt": "x", "n": 2})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "n"
        for body in (b"{", b"[1]", b"[" * 200 + b"]" * 200):
            bad = httpx.post(url + "/v1/completions", content=body, timeout=60)
            assert bad.status_code == 400 and bad.json()["error"]["message"]

        # the prefill instance gone: its parameters cannot be read any more (a prompt the
        # decode instance has not cached, else it reads nothing)
        other = [(i * 11) % 300 + 5 for i in range(200)]
        held = httpx.post(prefill.api + "/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": other, **GREEDY, "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True}}).json()["kv_transfer_params"]
        prefill.stop()
        gone = httpx.post(url + "/v1/completions", timeout=60,
                          json={"model": "tiny", "prompt": PROMPT, **GREEDY})
        assert gone.status_code == 502 and "prefill instance" in gone.json()["error"]["message"]
        refused = httpx.post(decode.api + "/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": other, **GREEDY, "kv_transfer_params": held})
        assert refused.status_code == 503, refused.text
        assert "prefill instance" in refused.json()["error"]["message"]
        assert metric_sum(decode.metrics, "tokenmill:kv_transfer_failed_requests_total") == 1
        assert httpx.post(decode.api + "/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": PROMPT, **GREEDY}).json()["choices"][0]["text"] == \
            one["choices"][0]["text"]
        malformed = httpx.post(decode.api + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "x", "kv_transfer_params": {"do_remote_prefill": True}})
        assert malformed.status_code == 400
        assert malformed.json()["error"]["param"] == "kv_transfer_params"
