"""bench/serve_load.py against a fake streaming server on loopback: duration, ramp and
closed-loop modes, both endpoints, failure kinds, report, chart and RSS sampling."""

import asyncio
import json
import os
import random
import socket
import sys
import threading
import time
from collections import Counter

import pytest

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench"))
import serve_load  # noqa: E402 - a script in bench/, not a package
from fastapi.responses import JSONResponse, StreamingResponse  # noqa: E402

TOKENS = 4  # every successful request streams this many chunks
CLIENT_TIMEOUT = 1.0  # the harness's read timeout; the stalled request waits longer


class FakeServer:
    """Decides each request's fate from a counter, and records what it did."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.n = 0
        self.did: Counter = Counter()
        self.bodies: list[dict] = []
        self.in_flight = self.max_in_flight = 0

    def fate(self) -> str:
        self.n += 1
        if self.n == 4:
            return "read_timeout"
        return {1: "http_503", 3: "garbled", 5: "incomplete", 6: "stream_error"}.get(
            self.n % 8, "ok")

    def failures(self) -> dict:
        return {kind: n for kind, n in sorted(self.did.items()) if kind != "ok"}


def make_app(fake: FakeServer):
    app = fastapi.FastAPI()

    async def respond(body: dict, native: bool):
        fake.bodies.append(body)
        fate = fake.fate()
        fake.did[fate] += 1
        if fate == "http_503":
            return JSONResponse({"error": "busy"}, status_code=503)

        def event(payload: dict | str) -> str:
            if native:
                return (payload if isinstance(payload, str) else json.dumps(payload)) + "\n"
            text = payload if isinstance(payload, str) else json.dumps(payload)
            return f"data: {text}\n\n"

        def chunk(i: int) -> dict:
            last = i == TOKENS - 1
            if native:
                return {"token": f" t{i}", "token_ids": [i], "is_end": int(last),
                        "send_idx": i, "error_code": 0, "error_msg": "",
                        **({"tokens_all_num": TOKENS, "finish_reason": "length"} if last
                           else {})}
            return {"choices": [{"index": 0, "text": f" t{i}",
                                 "finish_reason": "length" if last else None}]}

        async def stream():
            fake.in_flight += 1
            fake.max_in_flight = max(fake.max_in_flight, fake.in_flight)
            try:
                yield event(chunk(0))
                if fate == "garbled":
                    yield "this is not an event\n\n"
                elif fate == "stream_error":
                    yield event({"req_id": body.get("req_id"), "error_msg": "boom",
                                 "error_code": 500} if native else
                                {"error": {"message": "boom", "code": 500}})
                elif fate == "read_timeout":
                    await asyncio.sleep(CLIENT_TIMEOUT + 2)
                if fate != "ok":
                    if fate != "incomplete" and not native:
                        yield event("[DONE]")
                    return
                for i in range(1, TOKENS):
                    await asyncio.sleep(0.005)
                    yield event(chunk(i))
                if not native:
                    yield event({"choices": [], "usage": {"completion_tokens": TOKENS}})
                    yield event("[DONE]")
            finally:
                fake.in_flight -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: fastapi.Request):
        return await respond(await request.json(), native=False)

    @app.post("/v1/chat/completions")
    async def native(request: fastapi.Request):
        return await respond(await request.json(), native=True)

    return app


@pytest.fixture(scope="module")
def fake_server():
    fake = FakeServer()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(make_app(fake), log_level="warning",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started
    yield fake, f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()


def _check_latencies(result: dict) -> None:
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        s = result[metric]
        assert s["mean"] > 0 and 0 < s["p50"] <= s["p99"], (metric, s)
    assert result["request_throughput"] > 0 and result["out_tps"] > 0


def test_duration_mode_openai_cli(fake_server, tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    pytest.importorskip("psutil")
    fake, url = fake_server
    fake.reset()
    monkeypatch.setattr(serve_load, "make_text_prompts",
                        lambda _dir, n, length, seed=0: [f"prompt {i}" for i in range(n)])
    out, png = tmp_path / "load.json", tmp_path / "load.png"
    serve_load.main(["--base-url", url, "--model", "fake", "--tokenizer", "unused",
                     "--duration", "2", "--concurrency", "4", "--num-requests", "8",
                     "--output-len", str(TOKENS), "--timeout", str(CLIENT_TIMEOUT),
                     "--server-pid", str(os.getpid()), "--out", str(out), "--plot", str(png)])
    printed = [line for line in capsys.readouterr().out.splitlines()
               if line.startswith("RESULT ")]
    result = json.loads(out.read_text())
    assert printed and json.loads(printed[-1][len("RESULT "):]) == result

    assert result["mode"] == "duration" and result["seconds"] >= 2
    assert fake.n > 8  # cycled through the 8-prompt pool
    _check_fates(result, fake)
    assert set(fake.failures()) == {"http_503", "garbled", "incomplete", "stream_error",
                                    "read_timeout"}
    assert result["mean_output_tokens"] == TOKENS  # from the usage chunk
    assert result["finish_reasons"] == {"length": fake.did["ok"]}
    _check_latencies(result)
    assert fake.bodies[0]["stream"] and fake.bodies[0]["max_tokens"] == TOKENS

    memory = result["server_memory"]
    assert memory["pid"] == os.getpid() and len(memory["samples"]) >= 2
    assert 0 < memory["start_mb"] <= memory["max_mb"] and memory["end_mb"] > 0
    timeline = result["timeline"]
    assert timeline["bucket_s"] == 1.0 and sum(timeline["completed_per_s"]) == fake.did["ok"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _check_fates(result: dict, fake: FakeServer) -> None:
    """Every request the server began is counted with its fate; a busy machine may also let
    the client give up (timeout, dropped connection) on one the server had not begun yet:
    counted by the client only, as such a failure."""
    extra = result["requests"] - fake.n
    client, server = result["failures"], fake.failures()
    assert extra >= 0 and result["completed"] == fake.did["ok"]
    assert all(client.get(kind, 0) >= n for kind, n in server.items()), (client, server)
    assert sum(client.values()) - sum(server.values()) == extra, (client, server)
    assert set(client) - set(server) <= {"read_timeout", "connect_error",
                                         "remote_protocol_error", "read_error",
                                         "pool_timeout"}


def test_ramp_mode_native(fake_server):
    fake, url = fake_server
    fake.reset()
    prompts = [f"prompt {i}" for i in range(5)]
    result = asyncio.run(serve_load.run_load(
        url, None, prompts, 1, TOKENS, duration=2, ramp=(5.0, 25.0), arrivals="poisson",
        max_concurrency=6, endpoint="native", timeout=CLIENT_TIMEOUT, seed=1))
    expected = serve_load.arrival_times(5.0, 25.0, 2, True, random.Random(1))
    assert result["mode"] == "ramp"
    assert result["requests"] == len(expected)
    _check_fates(result, fake)
    assert result["finish_reasons"] == {"length": fake.did["ok"]}
    assert fake.max_in_flight <= 6
    _check_latencies(result)
    body = fake.bodies[0]
    assert body["text"] == "prompt 0" and body["stream"] is True
    assert body["max_dec_len"] == body["min_dec_len"] == TOKENS
    assert len({b["req_id"] for b in fake.bodies}) == len(fake.bodies)


def test_connect_error_closed_loop():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    result = asyncio.run(serve_load.run_load(f"http://127.0.0.1:{port}", "m", ["a", "b", "c"],
                                             2, TOKENS, timeout=5))
    assert result["mode"] == "num_requests"
    assert result["failures"] == {"connect_error": 3} and result["completed"] == 0
    assert result["ttft_ms"]["p50"] is None


def test_arrival_times():
    rng = random.Random(0)
    assert serve_load.arrival_times(2, 2, 2, False, rng) == [0.25, 0.75, 1.25, 1.75]
    for start, end in ((0, 10), (10, 0), (3, 7)):
        times = serve_load.arrival_times(start, end, 2, False, rng)
        assert len(times) == (start + end)  # integrated rate (start + end) / 2 * 2 s
        assert times == sorted(times) and times[0] > 0 and times[-1] < 2
    up = serve_load.arrival_times(0, 10, 2, False, rng)
    assert up[1] - up[0] > up[-1] - up[-2]  # arrivals get denser as the rate ramps up
    poisson = serve_load.arrival_times(5, 25, 2, True, random.Random(1))
    assert poisson == serve_load.arrival_times(5, 25, 2, True, random.Random(1))
    assert 10 < len(poisson) < 60 and poisson == sorted(poisson)


def test_prompts_fall_back_to_token_ids_where_text_encodes_to_nothing(tmp_path, tiny_models):
    """The Qwen-shaped benchmark model's placeholder vocabulary ("t0", "t1", ...) is read by
    transformers as byte-level BPE that encodes nothing: its W3 prompts are token ids then.
    Either way each prompt must come out about `length` tokens long."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config

    placeholder = str(tmp_path / "placeholder")
    Qwen2Config(vocab_size=3000).save_pretrained(placeholder)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(3000)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(placeholder)
    for folder in (tiny_models("llama")[0], placeholder):
        prompts = serve_load.make_prompts(folder, 3, 40)
        encoder = AutoTokenizer.from_pretrained(folder)
        for prompt in prompts:
            if isinstance(prompt, str):
                assert len(encoder(prompt, add_special_tokens=False).input_ids) >= 20
            else:
                assert len(prompt) == 40 and all(0 <= i < len(encoder) for i in prompt)
