"""Fair share and queue-time limits on a real server (`tokenmill serve`, the bundled model
unless --model, 8 slots), driven over HTTP by asyncio clients.

share: closed-loop clients of two tenants, 24 each (both always have requests waiting) and
  24 for a against 8 for b (b cannot fill its share: each of its clients has one request at
  a time, and a slot freed while b's client sends its next goes to a); the output tokens
  each tenant got in the window, under --scheduling-policy fcfs and under fair with
  --tenant-weights a=1,b=3.
deadline: open-loop Poisson arrivals at twice the throughput the share phase measured, each
  request streamed; without a limit (TTFT grows with the queue), and with X-Max-Queue-Time
  (refused at once with 429 + Retry-After, or served within its limit): TTFT percentiles of
  those served, how many were refused and how fast.

    python bench/fair_share.py [--model PATH] [--seconds 30] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from record import save  # noqa: E402
from server_process import start_server, stop_server, wait_ready  # noqa: E402

PROMPT_LEN, OUTPUT_LEN = 64, 64


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(model: str | None, flags: list[str], log_dir: str):
    port = free_port()
    tokenmill = os.path.join(os.path.dirname(sys.executable), "tokenmill")
    cmd = [tokenmill, "serve", *([model] if model else []), "--host", "127.0.0.1", "--port",
           str(port), "--health-port", str(free_port()), "--metrics-port", str(free_port()),
           "--grpc-port", str(free_port()), "--max-num-seqs", "8", "--max-model-len", "512",
           "--no-enable-prefix-caching", "--log-dir", log_dir, *flags]
    proc = start_server(cmd, os.path.join(log_dir, "server.log"), dict(os.environ))
    base = f"http://127.0.0.1:{port}"
    if wait_ready(proc, base, 300) is None:
        stop_server(proc)
        raise RuntimeError(f"the server did not start: {log_dir}/server.log")
    return proc, base


def prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(100, 5000) for _ in range(PROMPT_LEN)]


async def request(http: httpx.AsyncClient, rng, tenant: str, headers=None) -> dict:
    """One streamed completion: its status, TTFT (or time to refusal), tokens, end."""
    start = time.monotonic()
    body = {"prompt": prompt(rng), "max_tokens": OUTPUT_LEN,
            "ignore_eos": True, "stream": True, "temperature": 0}
    async with http.stream("POST", "/v1/completions", json=body,
                           headers={"X-Tenant-Id": tenant, **(headers or {})}) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return {"status": resp.status_code, "t": time.monotonic() - start,
                    "retry_after": resp.headers.get("retry-after")}
        first, tokens = None, 0
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                if '"code":429' in line.replace(" ", ""):
                    return {"status": 429, "t": time.monotonic() - start, "late": True}
                first = first or time.monotonic() - start
                tokens += 1
        return {"status": 200, "ttft": first, "tokens": tokens, "end": time.monotonic()}


async def share(base: str, seconds: float, clients: dict[str, int]) -> dict:
    """Closed-loop clients per tenant for `seconds` (after a warm-up of a fifth of it): the
    output tokens of the requests each tenant finished in the window."""
    rng = random.Random(0)
    done: list[tuple[str, dict]] = []
    stop = time.monotonic() + seconds * 1.2

    async def client(http, tenant):
        while time.monotonic() < stop:
            done.append((tenant, await request(http, rng, tenant)))

    window_start = time.monotonic() + seconds * 0.2
    async with httpx.AsyncClient(base_url=base, timeout=600,
                                 limits=httpx.Limits(max_connections=200)) as http:
        await asyncio.gather(*(client(http, t) for t, n in clients.items() for _ in range(n)))
    tokens = {t: sum(r["tokens"] for tt, r in done if tt == t and r["status"] == 200
                     and window_start <= r["end"] <= stop) for t in clients}
    finished = sum(1 for _, r in done if r["status"] == 200 and window_start <= r["end"] <= stop)
    return {"clients": clients, "tokens": tokens, "b_over_a": tokens["b"] / max(tokens["a"], 1),
            "requests_per_s": finished / seconds}


async def deadline(base: str, seconds: float, rate: float, limit: float | None) -> dict:
    rng, arrivals = random.Random(1), random.Random(2)
    headers = {"X-Max-Queue-Time": str(limit)} if limit else None
    tasks = []
    async with httpx.AsyncClient(base_url=base, timeout=600,
                                 limits=httpx.Limits(max_connections=1000)) as http:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            tasks.append(asyncio.create_task(request(http, rng, "a", headers)))
            await asyncio.sleep(arrivals.expovariate(rate))
        results = await asyncio.gather(*tasks)
    served = sorted(r["ttft"] for r in results if r["status"] == 200)
    early = sorted(r["t"] for r in results if r["status"] == 429 and not r.get("late"))
    late = [r for r in results if r.get("late")]
    pct = lambda xs, q: round(xs[min(len(xs) - 1, int(q * len(xs)))], 3) if xs else None  # noqa: E731
    return {"limit_s": limit, "rate": rate, "sent": len(results), "served": len(served),
            "ttft_p50_s": pct(served, 0.5), "ttft_p99_s": pct(served, 0.99),
            "ttft_max_s": pct(served, 1.0), "refused_at_once": len(early),
            "refusal_p50_s": pct(early, 0.5), "refusal_p99_s": pct(early, 0.99),
            "refused_after_waiting": len(late),
            "retry_after_median": statistics.median(
                [int(r["retry_after"]) for r in results if r.get("retry_after")] or [0])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--limit", type=float, default=2.0, help="X-Max-Queue-Time of phase 2")
    ap.add_argument("--out")
    args = ap.parse_args()
    log_dir = tempfile.mkdtemp(prefix="fair-share-")
    result = {}
    for policy, flags in (("fcfs", []), ("fair", ["--scheduling-policy", "fair",
                                                  "--tenant-weights", "a=1,b=3"])):
        proc, base = serve(args.model, flags, log_dir)
        try:
            for a, b in ((24, 24), (24, 8)):
                key = f"{policy}_{a}_{b}"
                result[key] = asyncio.run(share(base, args.seconds, {"a": a, "b": b}))
                print(key, result[key], flush=True)
            if policy == "fair":
                rate = 2 * result["fair_24_24"]["requests_per_s"]
                for limit in (None, args.limit):
                    key = f"deadline_{limit or 'none'}"
                    result[key] = asyncio.run(deadline(base, args.seconds, rate, limit))
                    print(key, result[key], flush=True)
        finally:
            stop_server(proc)
    if args.out:
        save(args.out, prompt_len=PROMPT_LEN, output_len=OUTPUT_LEN, slots=8, **result)


if __name__ == "__main__":
    main()
