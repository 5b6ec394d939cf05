"""`tokenmill serve` as users run it: a real process tree on loopback ports, driven from
outside (health, metrics, overload, disconnects, SIGTERM drain, engine death, start/stop)."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.serving import (
    DRAIN_TOKENS,
    HOLD_TOKENS,
    Served,
    alive,
    children,
    metric,
    metric_sum,
    wait_until,
)


@pytest.fixture
def model(tiny_models):
    """The long-context model: requests that outlast whatever the test does meanwhile."""
    return tiny_models("llama_long")[0]


def stream_first_chunk(api: str, body: dict, chunks: list, opened: threading.Event,
                       close: threading.Event):
    with httpx.stream("POST", api + "/v1/completions", json={**body, "stream": True},
                      timeout=120) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                chunks.append(line[6:])
                opened.set()
                if close.is_set():
                    return
    opened.set()


def stream_in_flight(api: str, max_tokens: int) -> tuple[threading.Thread, list]:
    """A streamed completion of `max_tokens` tokens, read in a thread (chunks appended to the
    list) and open, its first chunk in, when this returns."""
    chunks, opened = [], threading.Event()
    body = {"model": "tiny", "prompt": "go", "max_tokens": max_tokens, "ignore_eos": True}
    t = threading.Thread(target=stream_first_chunk,
                         args=(api, body, chunks, opened, threading.Event()))
    t.start()
    assert opened.wait(60)
    return t, chunks


def test_warmup_metrics_overload_and_disconnect(model, tmp_path):
    served = Served(model, tmp_path, "--max-num-seqs", "1", "--max-cached-task-num", "1")
    served.env["USE_WARMUP"] = "1"
    served.start()
    try:
        served.wait_ready()
        # USE_WARMUP=1: one warm-up request ran before the server reported ready.
        assert metric(served.metrics, "tokenmill:request_success_total") == 1
        assert httpx.get(served.health + "/v2/health/live").status_code == 200
        assert metric(served.metrics, "tokenmill:kv_cache_blocks_total") > 0
        assert metric(served.metrics, "inference_server_metrics",
                      max_batch_size="max_batch_size") == 1
        assert metric(served.metrics, "inference_server_metrics", block_num="block_num") == \
            metric(served.metrics, "tokenmill:kv_cache_blocks_total")
        # One running, one waiting: the next request is refused with 503 (the seed's text).
        body = {"model": "tiny", "prompt": "go", "max_tokens": HOLD_TOKENS, "ignore_eos": True}
        close = threading.Event()
        threads = []
        for _ in range(2):
            opened = threading.Event()
            t = threading.Thread(target=stream_first_chunk,
                                 args=(served.api, body, [], opened, close), daemon=True)
            t.start()
            threads.append(t)
        assert wait_until(lambda: metric(served.metrics, "tokenmill:num_requests_running") == 1
                          and metric(served.metrics, "tokenmill:num_requests_waiting") == 1)
        native = httpx.post(served.api + "/v1/chat/completions",
                            json={"text": "hi", "max_dec_len": 3}, timeout=30)
        assert native.status_code == 503 and "cached task num" in native.json()["error_msg"]
        openai_style = httpx.post(served.api + "/v1/completions",
                                  json={"prompt": "hi", "max_tokens": 3}, timeout=30)
        assert openai_style.status_code == 503
        # Clients leave: both requests are aborted and every KV block comes back.
        close.set()
        for t in threads:
            t.join(60)
        assert wait_until(lambda: metric(served.metrics, "tokenmill:num_requests_running") == 0
                          and metric(served.metrics, "tokenmill:num_requests_waiting") == 0
                          and metric(served.metrics, "tokenmill:kv_cache_blocks_used") == 0)
        assert metric(served.metrics, "tokenmill:generation_tokens_total") < HOLD_TOKENS
    finally:
        served.stop()


def test_ctrl_c_drains_in_flight_requests_then_exits_cleanly(model, tmp_path):
    # The drain timeout only has to outlast the stream, however slow the machine.
    served = Served(model, tmp_path, "--shutdown-timeout", "600", "--num-kv-blocks", "200",
                    "--block-size", "16").start()
    try:
        served.wait_ready()
        # A prompt that can never fit the 3,200-token cache is refused, not queued forever.
        huge = httpx.post(served.api + "/v1/chat/completions",
                          json={"input_ids": [7] * 3300, "max_dec_len": 5}, timeout=30)
        assert huge.status_code == 400 and "(3200)" in huge.json()["error_msg"]
        kids = children(served.process.pid)
        assert kids  # the engine-core process
        # In flight for seconds (DRAIN_TOKENS), so the draining state is there to see.
        t, chunks = stream_in_flight(served.api, DRAIN_TOKENS)
        # Ctrl-C: SIGINT reaches every process of the group; only the server acts on it.
        os.killpg(served.process.pid, signal.SIGINT)
        # Not ready at once; new work refused while the old one finishes.
        assert wait_until(lambda: httpx.get(served.health + "/v2/health/ready",
                                            timeout=5).status_code == 503, 10)
        refused = httpx.post(served.api + "/v1/completions",
                             json={"prompt": "x", "max_tokens": 2}, timeout=10)
        assert refused.status_code == 503
        t.join(600)
        assert chunks[-1] == "[DONE]"
        finals = [json.loads(c) for c in chunks[:-1]]
        assert "choices" in finals[-1], finals[-1]
        assert finals[-1]["choices"][0]["finish_reason"] == "length"
        assert served.process.wait(120) == 0
        log = served.process.stdout.read().decode()
        for line in ("shutting down: readiness is false", "draining: 1 in-flight request(s)",
                     "drained in", "tokenmill stopped (exit code 0)"):
            assert line in log, log[-3000:]
        # (multiprocessing's resource tracker leaves a moment after its parent)
        assert wait_until(lambda: not any(alive(pid) for pid in kids), 60)
        assert wait_until(served.ports_free, 60)
    finally:
        served.stop()


def test_engine_death_fails_requests_fast_and_exits_nonzero(model, tmp_path):
    served = Served(model, tmp_path).start()
    try:
        served.wait_ready()
        chunks, opened, close = [], threading.Event(), threading.Event()
        body = {"model": "tiny", "prompt": "go", "max_tokens": HOLD_TOKENS, "ignore_eos": True}
        t = threading.Thread(target=stream_first_chunk,
                             args=(served.api, body, chunks, opened, close))
        t.start()
        assert opened.wait(60)
        for pid in children(served.process.pid):
            os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        t.join(300)  # bounds a hang only
        print(f"engine killed: the stream's error came {time.monotonic() - killed:.2f} s later")
        # Ended by the engine's death, long before its HOLD_TOKENS could have been generated.
        errors = [json.loads(c) for c in chunks if c.startswith('{"error"')]
        assert errors and errors[0]["error"]["code"] == 503
        assert len(chunks) < HOLD_TOKENS // 2
        assert served.process.wait(60) == 1
        assert wait_until(served.ports_free, 60)
    finally:
        served.stop()


def test_start_server_and_stop_server(model, tmp_path):
    served = Served(model, tmp_path, "--shutdown-timeout", "600")
    bin_dir = os.path.dirname(sys.executable)
    start = subprocess.run([os.path.join(bin_dir, "start_server"), *served.args],
                           env=served.env, cwd=tmp_path, capture_output=True, text=True,
                           timeout=60)
    assert start.returncode == 0, start.stderr
    for name, port in (("service", "port"), ("health", "health"), ("metrics", "metrics"),
                       ("gRPC", "grpc")):
        assert f"{name} port {served.ports[port]}" in start.stdout, start.stdout
    pid = int((tmp_path / "log" / "server.pid").read_text())
    try:
        assert wait_until(served.ready, 120)
        again = subprocess.run([os.path.join(bin_dir, "start_server"), *served.args],
                               env=served.env, cwd=tmp_path, capture_output=True, text=True,
                               timeout=60)
        assert again.returncode == 1
        assert f"PORT: {served.ports['port']} occupied! Please change the port!" in again.stderr
        # Still in flight when stop_server runs, so the drain is what ends it: HOLD_TOKENS, as
        # stop_server's own start-up comes between (DRAIN_TOKENS, ~1 s of decoding, was
        # outrun in CI once the API got faster, with a second start_server run in between).
        t, chunks = stream_in_flight(served.api, HOLD_TOKENS)
        # Its TIMEOUT (before SIGKILL) only has to outlast the drain on a busy machine.
        stop = subprocess.run([os.path.join(bin_dir, "stop_server"), "600"], env=served.env,
                              cwd=tmp_path, capture_output=True, text=True, timeout=900)
        assert stop.returncode == 0 and "all process terminated." in stop.stdout
        t.join(120)  # the server is gone: its stream has ended, however busy the machine
        assert not t.is_alive()
        assert chunks[-1] == "[DONE]"  # the request in flight was drained, not cut
        assert json.loads(chunks[-2])["choices"][0]["finish_reason"] == "length"
        assert not alive(pid)
        assert not (tmp_path / "log" / "server.pid").exists()
        log = (tmp_path / "log" / "server.log").read_text()
        for line in ("draining: 1 in-flight request(s)", "drained in",
                     "tokenmill stopped (exit code 0)"):
            assert line in log, log[-3000:]
        assert wait_until(served.ports_free, 60)
    finally:
        if alive(pid):
            os.killpg(pid, signal.SIGKILL)


def test_several_http_workers_share_one_engine(model, tmp_path):
    served = Served(model, tmp_path)
    served.env["PUSH_MODE_HTTP_WORKERS"] = "2"
    served.start()
    try:
        served.wait_ready()
        assert len(children(served.process.pid)) >= 3  # engine core + two API processes
        body = {"model": "tiny", "prompt": "same prompt", "max_tokens": 8, "temperature": 0}
        results = [None] * 12

        def call(i):
            results[i] = httpx.post(served.api + "/v1/completions", json=body, timeout=60)

        threads = [threading.Thread(target=call, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert all(r.status_code == 200 for r in results)
        assert len({r.json()["choices"][0]["text"] for r in results}) == 1
        native = httpx.post(served.api + "/v1/chat/completions",
                            json={"text": "same prompt", "max_dec_len": 4}, timeout=60)
        assert native.status_code == 200 and native.json()["error_code"] == 0
        # Request counters of both workers are merged on the metrics port.
        assert wait_until(lambda: metric_sum(served.metrics, "tokenmill:request_success_total")
                          == 13, 10)
        kids = children(served.process.pid)
        served.process.send_signal(signal.SIGTERM)
        assert served.process.wait(60) == 0
        # (multiprocessing's resource tracker leaves a moment after its parent)
        assert wait_until(lambda: not any(alive(pid) for pid in kids), 60)
        assert wait_until(served.ports_free, 60)
    finally:
        served.stop()


def test_serves_a_tokenmill_quantize_checkpoint_with_the_seeds_int8_kv(model, tmp_path):
    """`tokenmill quantize` output served as it is, USE_CACHE_KV_INT8=1 from the seed's env:
    the same greedy text as the offline API gives for that checkpoint and KV dtype."""
    from tokenmill import LLM, SamplingParams
    from tokenmill.entrypoints.cli import main as cli

    out = str(tmp_path / "int4")
    assert cli(["quantize", "--model", model, "--out", out, "--method", "int4"]) == 0
    expected = LLM(out, kv_cache_memory_gib=0.02, kv_cache_dtype="int8").generate(
        "The mill", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        use_tqdm=False)[0].outputs[0].text
    served = Served(out, tmp_path)
    served.env["USE_CACHE_KV_INT8"] = "1"
    served.start()
    try:
        served.wait_ready()
        resp = httpx.post(served.api + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "The mill", "max_tokens": 12, "temperature": 0,
            "ignore_eos": True})
        assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == expected
    finally:
        served.stop()


def test_idle_connections_outlive_common_client_pools():
    """A server closing idle keep-alive connections when a client's pool expires them (httpx:
    5 s) races the client's next request on that connection: under load an overload ramp lost
    a request to a read error that way. The server's keep-alive is longer than that."""
    from fastapi import FastAPI

    from tokenmill.entrypoints.api_worker import make_server

    server = make_server(FastAPI())
    assert server.config.timeout_keep_alive > httpx.Limits().keepalive_expiry


def test_a_tensor_parallel_size_the_heads_refuse_is_a_clean_start_up_error(tiny_models,
                                                                           tmp_path):
    """Refused before any rank starts: the cause in one line naming the sizes that work, a
    non-zero exit, no traceback (the tiny llama: 4 attention heads, 2 key/value heads)."""
    served = Served(tiny_models("llama")[0], tmp_path, "--tensor-parallel-size", "3").start()
    try:
        served.process.wait(300)  # (bounded: import and config read only, no model load)
        out = served.process.stdout.read().decode()
    finally:
        served.stop()
    assert served.process.returncode != 0
    assert "Traceback" not in out, out[-3000:]
    assert out.strip().splitlines()[-1] == (
        "error: The engine core failed to start: ValueError: tensor parallel size 3 "
        "(--tensor-parallel-size / MP_NUM) must divide the model's attention heads (4; and its "
        "2 key/value heads, or be a multiple of them): sizes that can: 1, 2, 4.")


def test_a_hub_name_with_no_hub_reachable_is_a_clean_start_up_error(tmp_path):
    """The hub's one-line error and a non-zero exit, no server traceback (the health port
    answers while a hub name downloads, and used to log one as it closed)."""
    from tests.serving import free_port

    served = Served("someorg/somemodel", tmp_path)
    served.env["HF_ENDPOINT"] = f"http://127.0.0.1:{free_port()}"  # (nothing listens there)
    served.start()
    try:
        served.process.wait(300)
        out = served.process.stdout.read().decode()
    finally:
        served.stop()
    assert served.process.returncode != 0
    assert "Traceback" not in out, out[-3000:]
    assert out.strip().splitlines()[-1].startswith(
        "error: 'someorg/somemodel' is not a local path"), out[-1000:]


def test_ports_given_as_zero_are_chosen_and_named_in_the_start_up_line(model, tmp_path):
    """Health, metrics and gRPC on port 0: the OS picks each, and the start-up line names
    every port the server listens on, so a client can find them there."""
    import re

    served = Served(model, tmp_path)
    for name in ("HEALTH_HTTP_PORT", "METRICS_HTTP_PORT", "SERVICE_GRPC_PORT"):
        served.env[name] = "0"
    served.start()
    try:
        def line():
            found = re.search(rb"ports: API (\d+), gRPC (\d+), health (\d+), metrics (\d+)",
                              served.process.stdout.read())
            served.process.stdout.seek(0)
            return found
        assert wait_until(lambda: line() or served.process.poll() is not None, 300)
        api, grpc, health, metrics = (int(p) for p in line().groups())
        assert api == served.ports["port"] and len({api, grpc, health, metrics}) == 4
        base = "http://127.0.0.1:"
        assert httpx.get(f"{base}{health}/v2/health/ready", timeout=10).status_code == 200
        assert "tokenmill:request_success_total" in httpx.get(f"{base}{metrics}/metrics",
                                                              timeout=10).text
        import tritonclient.grpc as grpcclient
        assert grpcclient.InferenceServerClient(f"127.0.0.1:{grpc}").is_server_live()
    finally:
        served.stop()
