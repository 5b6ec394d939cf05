"""Serving load: streaming clients against a running OpenAI-compatible or tokenmill native server.

  python bench/serve_load.py --base-url http://127.0.0.1:9965 --model NAME \\
      --tokenizer HF_DIR --concurrency 16 --num-requests 64 --input-len 128 --output-len 64
  # the same clients for 60 s, with the server's memory and a chart:
  tokenmill bench serve --tokenizer HF_DIR --duration 60 --concurrency 16 \\
      --server-pid PID --plot load.png --out load.json
  # open loop: arrivals ramping from 1 to 8 req/s over 60 s, at most 32 in flight:
  tokenmill bench serve --tokenizer HF_DIR --duration 60 --request-rate-ramp 1:8 \\
      --arrivals poisson --max-concurrency 32

Modes: `--num-requests N` alone is a closed loop (`--concurrency` clients, one request after
another, until N are done); with `--duration T` the clients go on until T seconds have passed
(requests in flight then finish and count), and `--num-requests` is the size of the prompt
pool they cycle through; `--request-rate-ramp START:END` with `--duration T` is an open loop
whose arrival rate (Poisson or uniform) ramps linearly from START to END req/s over T seconds.

`--endpoint openai` (default) sends `/v1/completions` with `stream: true`; `--endpoint native`
sends tokenmill's native body (`text`, `max_dec_len`, `min_dec_len`, `temperature`, `stream`,
`req_id`; the server applies the model's chat template to `text`) to `/v1/chat/completions` and
reads JSON lines. Sampling is greedy on both.
Output lengths are forced (`min_tokens = max_tokens`, honoured by tokenmill, vLLM and llama.cpp's
server). Prompts are random whole words from the served model's tokenizer, so every engine
gets the same text. Metrics follow vLLM's `benchmark_serving` definitions: TTFT (request sent
-> first token), ITL (gap between successive streamed chunks), TPOT ((E2EL - TTFT) / (output
tokens - 1)), E2EL (whole request), in ms. Failures are counted by kind: `http_<status>`,
`connect_error`, `read_timeout`, `stream_error` (an error event in the stream), `incomplete`
(the stream ended before `[DONE]` / `is_end`), `garbled` (a line that is neither `data: <json>`
nor `data: [DONE]`; a native line that is not JSON), `no_tokens`. `--server-pid` samples the RSS
of that process and its children once per second (psutil). Prints one `RESULT {json}` line;
`--out` also writes it to a file and `--plot` draws latency percentiles over time (matplotlib)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import random
import re
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_load_report import build_report, plot  # noqa: E402 - a sibling script, not a package


def make_text_prompts(tokenizer_dir: str, n: int, length: int, seed: int = 0) -> list[str]:
    """`length` random whole-word tokens (" word") each: plain text that encodes back to about
    `length` tokens, and that models continue with ordinary text (random ids decode to byte
    fragments that some servers hold back while streaming)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    pieces = [tok.decode([i]) for i in range(len(tok))]
    words = sorted({p[1:] for p in pieces if re.fullmatch(r" [A-Za-z]{2,}", p)})
    if not words:  # word-level tokenizer: its tokens are the words
        words = sorted({p for p in pieces if re.fullmatch(r"[A-Za-z]\w+", p)})
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(length)) for _ in range(n)]


def make_prompts(tokenizer_dir: str, n: int, length: int,
                 seed: int = 0) -> list[str] | list[list[int]]:
    """Text prompts (`make_text_prompts`), or `length` random token ids each where the
    tokenizer cannot encode them to about `length` tokens: the Qwen-shaped benchmark model
    has a placeholder vocabulary ("t0", "t1", ...) that transformers reads as byte-level BPE
    and encodes to nothing. The OpenAI completions API takes token ids as the prompt."""
    from transformers import AutoTokenizer

    texts = make_text_prompts(tokenizer_dir, n, length, seed)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    if len(tok(texts[0], add_special_tokens=False).input_ids) >= length // 2:
        return texts
    rng = random.Random(seed)
    margin = len(tok) // 10  # clear of the special tokens at either end
    return [[rng.randrange(margin, len(tok) - margin) for _ in range(length)] for _ in range(n)]


class Failure(Exception):
    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


Lines = AsyncIterator[str]
Reader = Callable[[Lines, list[float]], Awaitable[tuple[int | None, str | None]]]


def _json_object(text: str) -> dict:
    """One streamed event or line: a JSON object, else the stream is garbled."""
    try:
        value = json.loads(text)
    except ValueError:
        raise Failure("garbled") from None
    if not isinstance(value, dict):
        raise Failure("garbled")
    return value


def openai_body(model: str | None, prompt: str | list[int], output_len: int,
                req_id: str) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": output_len,
            "min_tokens": output_len, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}


async def read_openai(lines: Lines, chunk_times: list[float]) -> tuple[int | None, str | None]:
    """Server-sent events up to `data: [DONE]`: a time per chunk that carries text; returns
    (completion tokens from `usage` if sent, finish reason)."""
    usage_tokens = finish = None
    async for line in lines:
        if not line or line.startswith(":"):  # event separator, SSE comment (keep-alive)
            continue
        if not line.startswith("data:"):
            raise Failure("garbled")
        data = line[5:].strip()
        if data == "[DONE]":
            return usage_tokens, finish
        event = _json_object(data)
        if "error" in event:
            raise Failure("stream_error")
        if event.get("usage"):
            usage_tokens = event["usage"].get("completion_tokens")
        for choice in event.get("choices") or []:
            finish = choice.get("finish_reason") or finish
            if choice.get("text"):
                chunk_times.append(time.perf_counter())
                break
    raise Failure("incomplete")


def native_body(model: str | None, prompt: str, output_len: int, req_id: str) -> dict:
    return {"text": prompt, "max_dec_len": output_len, "min_dec_len": output_len,
            "temperature": 0.0, "stream": True, "req_id": req_id}


async def read_native(lines: Lines, chunk_times: list[float]) -> tuple[int | None, str | None]:
    """JSON lines up to the one with `is_end`: a time per message that carries text; returns
    (`tokens_all_num`, finish reason) of the last message."""
    async for line in lines:
        if not line.strip():
            continue
        message = _json_object(line)
        if message.get("error_code"):
            raise Failure("stream_error")
        if message.get("token"):
            chunk_times.append(time.perf_counter())
        if message.get("is_end"):
            return message.get("tokens_all_num"), message.get("finish_reason")
    raise Failure("incomplete")


# endpoint -> (default path, request body, stream reader)
ENDPOINTS = {"openai": ("/v1/completions", openai_body, read_openai),
             "native": ("/v1/chat/completions", native_body, read_native)}


def error_kind(exc: httpx.HTTPError) -> str:
    if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
        return "connect_error"
    if isinstance(exc, httpx.ReadTimeout):
        return "read_timeout"
    return re.sub(r"(?<!^)(?=[A-Z])", "_", type(exc).__name__).lower()  # e.g. pool_timeout


async def one_request(client: httpx.AsyncClient, url: str, body: dict, read: Reader,
                      t0: float) -> dict:
    """One streamed request -> a record for `serve_load_report` (times relative to `t0`)."""
    sent = time.perf_counter()
    chunk_times: list[float] = []
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                raise Failure(f"http_{resp.status_code}")
            try:
                tokens, finish = await read(resp.aiter_lines(), chunk_times)
            except (httpx.RemoteProtocolError, httpx.ReadError):
                raise Failure("incomplete") from None  # the connection dropped mid-stream
        if not chunk_times:
            raise Failure("no_tokens")
    except (Failure, httpx.HTTPError) as exc:
        kind = exc.kind if isinstance(exc, Failure) else error_kind(exc)
        return {"sent": sent - t0, "done": time.perf_counter() - t0, "error": kind}
    end = time.perf_counter()
    tokens = tokens or len(chunk_times)
    ttft = chunk_times[0] - sent
    return {"sent": sent - t0, "done": end - t0, "ttft": ttft, "e2el": end - sent,
            "tokens": tokens, "finish": finish,
            "itl": [b - a for a, b in zip(chunk_times, chunk_times[1:])],
            "tpot": (end - sent - ttft) / (tokens - 1) if tokens > 1 else None}


def arrival_times(start_rate: float, end_rate: float, duration: float, poisson: bool,
                  rng: random.Random) -> list[float]:
    """Arrival times in [0, duration) for a rate ramping linearly from `start_rate` to
    `end_rate` req/s: the k-th arrival is where the integrated rate
    L(t) = start * t + (end - start) * t^2 / (2 * duration) reaches s_k, with s_k a sum of k
    unit exponentials (Poisson, by time rescaling) or k - 1/2 (uniform)."""
    a, b = (end_rate - start_rate) / (2 * duration), start_rate
    times: list[float] = []
    s = 0.0 if poisson else -0.5
    while True:
        s += rng.expovariate(1.0) if poisson else 1.0
        disc = b * b + 4 * a * s
        if disc < 0 or b + math.sqrt(disc) <= 0:  # the ramp never reaches s
            return times
        t = 2 * s / (b + math.sqrt(disc))  # the smaller root of a t^2 + b t - s, stably
        if t >= duration:
            return times
        times.append(t)


class RssSampler:
    """Resident memory (MB) of a process and all its descendants, every `interval` seconds."""

    def __init__(self, pid: int, interval: float = 1.0) -> None:
        import psutil

        self.psutil, self.pid, self.interval = psutil, pid, interval
        self.proc = psutil.Process(pid)
        self.samples: list[list[float]] = []  # [seconds since start, MB]

    def take(self, t0: float) -> None:
        ps = self.psutil
        try:
            procs = [self.proc, *self.proc.children(recursive=True)]
        except ps.NoSuchProcess:
            return
        total = 0
        for proc in procs:  # a child may exit between the listing and the read
            with contextlib.suppress(ps.NoSuchProcess, ps.AccessDenied):
                total += proc.memory_info().rss
        self.samples.append([round(time.perf_counter() - t0, 3), total / 1e6])

    async def run(self, t0: float) -> None:
        while True:
            self.take(t0)
            await asyncio.sleep(self.interval)

    def report(self) -> dict:
        mbs = [mb for _, mb in self.samples]
        return {"pid": self.pid, "start_mb": mbs[0] if mbs else None,
                "max_mb": max(mbs, default=None), "end_mb": mbs[-1] if mbs else None,
                "samples": self.samples}


async def run_load(base_url: str, model: str | None, prompts: list[str], concurrency: int,
                   output_len: int, api_key: str | None = None, *,
                   duration: float | None = None, ramp: tuple[float, float] | None = None,
                   arrivals: str = "poisson", max_concurrency: int | None = None,
                   endpoint: str = "openai", path: str | None = None,
                   server_pid: int | None = None, timeout: float = 600.0,
                   seed: int = 0) -> dict:
    """Closed loop over `prompts` (default), for `duration` seconds, or open loop on a
    `ramp` (START, END req/s, needs `duration`); returns `serve_load_report.build_report`."""
    if ramp is not None and duration is None:
        raise ValueError("a request-rate ramp needs a duration")
    default_path, make_body, read = ENDPOINTS[endpoint]
    url = base_url.rstrip("/") + (path or default_path)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    run_id = uuid.uuid4().hex[:8]
    sampler = RssSampler(server_pid) if server_pid else None
    records: list[dict] = []

    async def send(client: httpx.AsyncClient, i: int) -> None:
        body = make_body(model, prompts[i % len(prompts)], output_len, f"bench-{run_id}-{i}")
        records.append(await one_request(client, url, body, read, t0))

    async def client_loop(client: httpx.AsyncClient, indices) -> None:
        for i in indices:  # shared by all clients
            if duration is not None and time.perf_counter() - t0 >= duration:
                return
            await send(client, i)

    async def open_loop(client: httpx.AsyncClient) -> None:
        times = arrival_times(*ramp, duration, arrivals == "poisson", random.Random(seed))
        gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None

        async def fire(i: int) -> None:
            async with gate or contextlib.nullcontext():
                await send(client, i)

        tasks = []
        for i, at in enumerate(times):
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            tasks.append(asyncio.create_task(fire(i)))
        await asyncio.gather(*tasks)

    if ramp is not None:
        mode, connections = "ramp", max_concurrency
    else:
        mode, connections = ("duration" if duration else "num_requests"), concurrency
        indices = itertools.count() if duration else iter(range(len(prompts)))
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout),
                                 headers=headers) as client:
        t0 = time.perf_counter()
        sampling = asyncio.create_task(sampler.run(t0)) if sampler else None
        if ramp is not None:
            await open_loop(client)
        else:
            await asyncio.gather(*(client_loop(client, indices) for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
    if sampling is not None:
        sampling.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampling
        sampler.take(t0)
    return build_report(records, elapsed, mode, sampler.report() if sampler else None)


def _ramp(text: str) -> tuple[float, float]:
    try:
        start, end = (float(v) for v in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError("expected START:END in req/s, e.g. 1:8") from None
    if start < 0 or end < 0 or start + end == 0:
        raise argparse.ArgumentTypeError("rates must be >= 0 and not both 0")
    return start, end


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:9965")
    p.add_argument("--model", default=None,
                   help="the `model` field to send (default: the first of /v1/models)")
    p.add_argument("--tokenizer", required=True, help="HF directory of the served model")
    p.add_argument("--endpoint", choices=sorted(ENDPOINTS), default="openai")
    p.add_argument("--path", default=None, help="request path (default: /v1/completions for "
                   "openai, /v1/chat/completions for native)")
    p.add_argument("--concurrency", type=int, default=16, help="clients of the closed loop")
    p.add_argument("--num-requests", type=int, default=64,
                   help="requests of the closed loop; with --duration, the prompt pool size")
    p.add_argument("--duration", type=float, default=None, help="seconds to send requests for")
    p.add_argument("--request-rate-ramp", type=_ramp, default=None, metavar="START:END",
                   help="open loop: req/s ramping linearly over --duration")
    p.add_argument("--arrivals", choices=["poisson", "uniform"], default="poisson")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="open loop: most requests in flight (default: no cap)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds to connect, and between two streamed chunks")
    p.add_argument("--server-pid", type=int, default=None,
                   help="sample the RSS of this process and its children once per second")
    p.add_argument("--seed", type=int, default=0, help="prompts and Poisson arrivals")
    p.add_argument("--api-key", default=None)
    p.add_argument("--out", default=None, help="write the JSON report here")
    p.add_argument("--plot", default=None, help="write a PNG of latencies over time here")
    args = p.parse_args(argv)
    if args.request_rate_ramp and args.duration is None:
        p.error("--request-rate-ramp needs --duration")
    if args.max_concurrency and not args.request_rate_ramp:
        p.error("--max-concurrency caps the open loop (--request-rate-ramp); "
                "closed loops use --concurrency")
    prompts = make_text_prompts(args.tokenizer, args.num_requests, args.input_len, args.seed)
    if args.model is None and args.endpoint == "openai":
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        models = httpx.get(args.base_url.rstrip("/") + "/v1/models", headers=headers).json()
        args.model = models["data"][0]["id"]
    result = asyncio.run(run_load(
        args.base_url, args.model, prompts, args.concurrency, args.output_len, args.api_key,
        duration=args.duration, ramp=args.request_rate_ramp, arrivals=args.arrivals,
        max_concurrency=args.max_concurrency, endpoint=args.endpoint, path=args.path,
        server_pid=args.server_pid, timeout=args.timeout, seed=args.seed))
    result["config"] = {k: v for k, v in vars(args).items() if k != "api_key"}
    print("RESULT " + json.dumps(result), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    if args.plot:
        plot(result, args.plot)


if __name__ == "__main__":
    main()
