"""Catalogue L1-L6, P3 and S4's runtime half on `tokenmill serve` process trees: a soak of
streaming clients on three front ends at once (plus a client that keeps crashing mid-stream),
memory and fds while it runs, the metrics draining to zero after it, an overload ramp against
small limits, and what listens on which address. `pytest --long` soaks for 600 s (CI: 60 s)."""

import functools
import json
import os
import pickle
import queue
import random
import stat
import threading
import time

import httpx
import numpy as np
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.reliability.checks import assert_openai_error, sse_events
from tests.serving import Served, wait_until

WORDS = ["river", "stone", "cloud", "lamp", "garden", "window", "signal", "paper", "orbit",
         "copper", "meadow", "engine", "harbor", "violet", "thunder", "pocket"]


def prompt(rng: random.Random) -> str:
    """About 8 to 460 tokens (the tiny model's tokenizer spends ~5.7 tokens on a word)."""
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 80)))


def scrape(url: str) -> dict[tuple, float]:
    """Every sample of the metrics port, parsed by prometheus_client's own parser."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def total(samples: dict, name: str, **labels) -> float:
    return sum(v for (n, ls), v in samples.items()
               if n == name and all(dict(ls).get(k) == w for k, w in labels.items()))


def tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def tree_rss_mb(pid: int) -> float:
    return sum(p.memory_info().rss for p in tree(pid)) / 1e6


def tree_fds(pid: int) -> int:
    return sum(p.num_fds() for p in tree(pid))


@pytest.fixture(scope="module")
def soaked(served_llama):
    return served_llama


# S4 (runtime) -------------------------------------------------------------------------------
def test_only_the_configured_ports_listen_and_ipc_drops_garbage(soaked, tmp_path):
    import zmq

    listening = set()
    for proc in tree(soaked.process.pid):
        for conn in proc.net_connections(kind="inet"):
            if conn.status == psutil.CONN_LISTEN:
                # gRPC binds an IPv6 socket to the IPv4-mapped loopback address
                listening.add((conn.laddr.ip.removeprefix("::ffff:"), conn.laddr.port))
    assert listening == {("127.0.0.1", port) for port in soaked.ports.values()}, listening
    sockets = {c.laddr for p in tree(soaked.process.pid) for c in p.net_connections(kind="unix")
               if c.laddr}
    engine = [path for path in sockets if path.endswith("engine.sock")]
    assert engine, sockets  # the engine's IPC is a unix socket in a private directory
    assert stat.S_IMODE(os.stat(os.path.dirname(engine[0])).st_mode) == 0o700
    canary = tmp_path / "canary"

    class Bomb:  # unpickling this would create the canary file
        def __reduce__(self):
            return (open, (str(canary), "w"))

    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"ipc://{engine[0]}")
    for frames in ([b"1", pickle.dumps(Bomb())], [b"\x80\x04garbage"], [b"9", b"x"],
                   [b"1", b"\xc1\xc1"], [b"1", b"a", b"b", b"c"], [pickle.dumps(Bomb())]):
        dealer.send_multipart(frames)
    dealer.close()
    time.sleep(0.5)  # bounded: let the engine read them
    assert not canary.exists()
    resp = httpx.post(soaked.api + "/v1/completions", timeout=60,
                      json={"model": "tiny", "prompt": "still here", "max_tokens": 4})
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 4


# L1 / L2 / L3 / L4 / P3 ---------------------------------------------------------------------
class Soak:
    """Client threads on three front ends until the deadline; every request is checked."""

    def __init__(self, served: Served, seconds: float) -> None:
        self.served, self.deadline = served, time.monotonic() + seconds
        self.problems: list[str] = []
        self.counts = {"openai": 0, "native": 0, "grpc": 0, "crash": 0, "sample": 0}
        self.lock = threading.Lock()

    def count(self, kind: str) -> None:
        with self.lock:
            self.counts[kind] += 1

    def problem(self, text: str) -> None:
        with self.lock:
            self.problems.append(text[:500])

    def openai(self, seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(timeout=120) as client:
            while time.monotonic() < self.deadline:
                n = rng.randint(16, 128)
                body = {"model": "tiny", "messages": [{"role": "user", "content": prompt(rng)}],
                        "max_tokens": n, "ignore_eos": True, "temperature": 0, "stream": True,
                        "stream_options": {"include_usage": True}}
                self.count("openai")
                with client.stream("POST", self.served.api + "/v1/chat/completions",
                                   json=body) as resp:
                    lines = list(resp.iter_lines())
                try:
                    events, done = sse_events(lines)
                    assert resp.status_code == 200 and done == 1 and lines[-2:] == [
                        "data: [DONE]", ""] or lines[-1] == "data: [DONE]"
                    assert len({e["id"] for e in events}) == 1
                    choices = [e for e in events if e["choices"]]
                    assert choices[-1]["choices"][0]["finish_reason"] == "length"
                    assert events[-1]["usage"]["completion_tokens"] == n
                    text = "".join(e["choices"][0]["delta"].get("content") or ""
                                   for e in choices)
                except (AssertionError, KeyError, ValueError, IndexError) as exc:
                    self.problem(f"openai: {exc!r} {lines[-3:]}")
                    continue
                if rng.random() < 0.1:  # the same request whole: the same text
                    self.count("sample")
                    whole = client.post(self.served.api + "/v1/chat/completions",
                                        json={**body, "stream": False,
                                              "stream_options": None}).json()
                    if whole["choices"][0]["message"]["content"] != text:
                        self.problem(f"openai: stream != whole for seed {seed}")

    def native(self, seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(timeout=120) as client:
            while time.monotonic() < self.deadline:
                n = rng.randint(16, 128)
                body = {"text": prompt(rng), "max_dec_len": n, "min_dec_len": n,
                        "stream": True, "req_id": f"native-{seed}-{rng.random()}"}
                self.count("native")
                with client.stream("POST", self.served.api + "/v1/chat/completions",
                                   json=body) as resp:
                    lines = [json.loads(x) for x in resp.iter_lines() if x]
                try:
                    assert all(m["error_code"] == 0 for m in lines), lines[-1]
                    # send_idx: tokens sent before this message (the final one: all of them)
                    sent = [0]
                    for m in lines[:-1]:
                        sent.append(sent[-1] + len(m["token_ids"]))
                    assert [m["send_idx"] for m in lines[:-1]] == sent[:-1]
                    assert lines[-1]["is_end"] == 1 and all(m["is_end"] == 0 for m in lines[:-1])
                    assert lines[-1]["tokens_all_num"] == lines[-1]["send_idx"] <= n
                except (AssertionError, KeyError, IndexError) as exc:
                    self.problem(f"native: {exc!r}")

    def grpc(self, seed: int) -> None:
        import tritonclient.grpc as grpcclient

        rng = random.Random(seed)
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{self.served.ports['grpc']}")
        try:
            while time.monotonic() < self.deadline:
                n = rng.randint(16, 128)
                payload = json.dumps([{"text": prompt(rng), "max_dec_len": n, "min_dec_len": n,
                                       "req_id": f"grpc-{seed}-{rng.random()}"}]).encode()
                inp = grpcclient.InferInput("IN", [1], "BYTES")
                inp.set_data_from_numpy(np.array([payload], dtype=object))
                results: queue.Queue = queue.Queue()
                self.count("grpc")
                client.start_stream(callback=functools.partial(_put_result, results))
                messages = []
                try:
                    client.async_stream_infer("model", [inp])
                    while True:
                        result, error = results.get(timeout=120)
                        assert error is None, error
                        messages.append(json.loads(result.as_numpy("OUT")[0])[0])
                        if result.get_response().parameters[
                                "triton_final_response"].bool_param:
                            break
                    assert messages[-1]["is_end"] == 1
                    assert all(m["error_code"] == 0 for m in messages)
                except (AssertionError, KeyError, queue.Empty) as exc:
                    self.problem(f"grpc: {exc!r}")
                finally:
                    client.stop_stream()
        finally:
            client.close()

    def crasher(self) -> None:
        """Every 2 s: open a long stream, read two chunks, drop the connection. The stream
        asks for as many tokens as the model's 1024 positions allow: it must still be running
        when the API process notices the drop (on CI a 300-token one once finished first,
        counted a success, not an abort)."""
        while time.monotonic() < self.deadline - 2:
            self.count("crash")
            with httpx.stream("POST", self.served.api + "/v1/completions", timeout=60,
                              json={"model": "tiny", "prompt": "crash", "max_tokens": 1000,
                                    "ignore_eos": True, "stream": True}) as resp:
                for i, _ in enumerate(resp.iter_lines()):
                    if i >= 3:
                        break
            time.sleep(2)


def _put_result(results: queue.Queue, result, error) -> None:
    results.put((result, error))


def trimmed_mean(values: list[float], cut: float = 0.05) -> float:
    k = int(len(values) * cut)
    kept = sorted(values)[k:len(values) - k] or values
    return sum(kept) / len(kept)


def test_soak_on_three_front_ends_with_a_crashing_client(soaked, request):
    seconds = 600 if request.config.getoption("--long") else 60
    pid = soaked.process.pid
    httpx.post(soaked.api + "/v1/completions", timeout=60,
               json={"model": "tiny", "prompt": "warm", "max_tokens": 2})
    fds_before = tree_fds(pid)
    before = scrape(soaked.metrics)
    soak = Soak(soaked, seconds)
    workers = ([threading.Thread(target=soak.openai, args=(i,)) for i in range(24)]
               + [threading.Thread(target=soak.native, args=(100 + i,)) for i in range(24)]
               + [threading.Thread(target=soak.grpc, args=(200 + i,)) for i in range(16)]
               + [threading.Thread(target=soak.crasher)])
    for w in workers:
        w.start()
    rss, api_rss, scrapes, live = [], [], [before], []
    while any(w.is_alive() for w in workers):
        rss.append(tree_rss_mb(pid))
        api_rss.append(psutil.Process(pid).memory_info().rss / 1e6)
        scrapes.append(scrape(soaked.metrics))
        live.append(httpx.get(soaked.health + "/v2/health/live", timeout=5).status_code)
        time.sleep(1)
    for w in workers:
        w.join(300)
    assert not soak.problems, soak.problems[:5]
    assert soak.counts["openai"] >= 24 and soak.counts["grpc"] >= 16, soak.counts
    assert set(live) == {200}
    # L2: bounded memory in the second half (Triton's formula, on RSS) and fds back. The
    # engine process climbs for about a minute to the high-water mark of the step shapes it
    # has met (glibc keeps freed step buffers, see ModelRunner; oneDNN caches a primitive per
    # shape), then stays flat: the whole tree is held to the formula in the --long soak;
    # the API process (request state, streams, metrics: where leaks would be) always.
    watched = rss if request.config.getoption("--long") else api_rss
    second = watched[len(watched) // 2:]
    growth = max(second) - trimmed_mean(second)
    assert growth < 50, (growth, " ".join(str(round(x)) for x in watched))
    print(f"soak {seconds} s: {soak.counts}; tree RSS MB {' '.join(str(round(x)) for x in rss)}")
    assert wait_until(lambda: tree_fds(pid) <= fds_before + 5, 60), (tree_fds(pid), fds_before)
    # L3 / P3: everything drains to zero once the clients are done, and the counters add up.
    def drained():
        now = scrape(soaked.metrics)
        return all(total(now, name) == 0 for name in (
            "tokenmill:num_requests_running", "tokenmill:num_requests_waiting",
            "tokenmill:kv_cache_blocks_used", "tokenmill:num_requests_in_flight"))

    assert wait_until(drained, 60)  # reached once every client is done, however slow
    after = scrape(soaked.metrics)
    issued = sum(soak.counts.values())
    finished = (total(after, "tokenmill:request_success_total")
                - total(before, "tokenmill:request_success_total"))
    assert finished == issued, (finished, soak.counts)
    aborts = (total(after, "tokenmill:request_success_total", outcome="abort")
              - total(before, "tokenmill:request_success_total", outcome="abort"))
    disconnects = (total(after, "tokenmill:client_disconnects_total")
                   - total(before, "tokenmill:client_disconnects_total"))
    assert aborts == disconnects == soak.counts["crash"]
    for name in ("tokenmill:request_success_total", "tokenmill:generation_tokens_total",
                 "tokenmill:time_to_first_token_seconds_count",
                 "tokenmill:inter_token_latency_seconds_count"):
        series = [total(s, name) for s in scrapes + [after]]
        assert series == sorted(series), name  # counters only go up
    required = {"tokenmill:request_success_total", "tokenmill:num_requests_waiting",
                "tokenmill:num_requests_running", "tokenmill:kv_cache_blocks_used",
                "tokenmill:kv_cache_blocks_total", "tokenmill:num_preemptions",
                "tokenmill:client_disconnects_total", "tokenmill:request_rejected_total",
                "tokenmill:time_to_first_token_seconds_bucket",
                "tokenmill:inter_token_latency_seconds_bucket",
                "tokenmill:num_requests_in_flight"}
    assert required <= {name for name, _ in after}, required - {name for name, _ in after}


# L5 / L6 ------------------------------------------------------------------------------------
def test_overload_ramp_rejects_fast_and_accepted_requests_complete(tiny_models,
                                                                   tmp_path_factory, request):
    import sys

    sys.path.insert(0, str(request.config.rootpath / "bench"))
    import asyncio

    from serve_load import run_load

    seconds = 30 if request.config.getoption("--long") else 12  # the catalogue's 30 s
    served = Served(tiny_models("llama")[0], tmp_path_factory.mktemp("ramp"),
                    "--max-num-seqs", "4", "--max-cached-task-num", "16").start()
    try:
        served.wait_ready()
        live: list[int] = []
        stop = threading.Event()

        def probe():
            while not stop.is_set():
                live.append(httpx.get(served.health + "/v2/health/live", timeout=60).status_code)
                time.sleep(0.25)

        prober = threading.Thread(target=probe)
        prober.start()
        rng = random.Random(0)
        prompts = [prompt(rng) for _ in range(64)]
        report = asyncio.run(run_load(served.api, "tiny", prompts, 0, 48,
                                      duration=seconds, ramp=(1, 200), arrivals="uniform",
                                      max_concurrency=256, server_pid=served.process.pid,
                                      timeout=120))
        stop.set()
        prober.join(10)
        failures = report["failures"]
        assert set(failures) <= {"http_503"}, failures  # nothing lost, garbled or dropped
        assert report["completed"] > 0 and failures.get("http_503", 0) > 0
        assert report["finish_reasons"] == {"length": report["completed"]}
        # Seen by this client, a refusal's time includes its own event loop and new
        # connections on a 2-CPU box shared with the server at ~200 req/s, so it is held
        # against the accepted requests of the same run, not a clock: a refusal is answered
        # without queueing, well before an accepted request ends (the server's own cost per
        # refusal is measured in test_faults' F8 test).
        refusals, accepted = report["failure_latency_ms"], report["e2el_ms"]
        print(f"ramp {seconds} s: {report['requests']} requests, {report['completed']} "
              f"completed, {failures}; refusal latency ms {refusals}; accepted e2el ms "
              f"{accepted}")
        assert refusals["p50"] < accepted["p50"] / 2, (refusals, accepted)
        assert set(live) == {200}
        memory = report["server_memory"]
        assert memory["max_mb"] - memory["start_mb"] < 200, memory
        rejected = total(scrape(served.metrics), "tokenmill:request_rejected_total")
        assert rejected == failures["http_503"]
        refused = httpx.post(served.api + "/v1/completions", timeout=10,
                             json={"model": "tiny", "prompt": "x", "max_tokens": 1,
                                   "n": 100})
        assert_openai_error(refused, 400, "n")
    finally:
        served.stop()
