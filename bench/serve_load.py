"""Serving load: N concurrent streaming clients against any OpenAI-compatible server.

  python bench/serve_load.py --base-url http://127.0.0.1:9965 --model NAME \\
      --tokenizer HF_DIR --concurrency 16 --num-requests 64 --input-len 128 --output-len 64

Each client sends `/v1/completions` with `stream: true`, one request after another, until the
requests run out. Output lengths are forced with `min_tokens = max_tokens` (honoured by
tokenmill, vLLM and llama.cpp's server). Prompts are random token ids decoded to text with the
served model's tokenizer, so every engine gets the same text. Metrics follow vLLM's
`benchmark_serving` definitions: TTFT (request sent -> first token), ITL (gap between
successive streamed chunks), TPOT ((E2EL - TTFT) / (output tokens - 1)), E2EL (whole request).
Prints one `RESULT {json}` line; `--out` also writes it to a file."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import time

import httpx


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


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def summary(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    return {"mean": statistics.fmean(values), "p50": percentile(values, 50),
            "p99": percentile(values, 99)}


async def one_request(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    sent = time.perf_counter()
    chunk_times: list[float] = []
    usage_tokens = finish = None
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return {"error": f"http {resp.status_code}"}
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if event.get("usage"):
                usage_tokens = event["usage"].get("completion_tokens")
            for choice in event.get("choices", []):
                finish = choice.get("finish_reason") or finish
                if choice.get("text"):
                    chunk_times.append(time.perf_counter())
                    break
    end = time.perf_counter()
    if not chunk_times:
        return {"error": "no tokens"}
    tokens = usage_tokens or len(chunk_times)
    ttft = chunk_times[0] - sent
    return {"ttft": ttft, "e2el": end - sent, "tokens": tokens, "finish": finish,
            "itl": [b - a for a, b in zip(chunk_times, chunk_times[1:])],
            "tpot": (end - sent - ttft) / (tokens - 1) if tokens > 1 else None}


async def run_load(base_url: str, model: str, prompts: list[str], concurrency: int,
                   output_len: int, api_key: str | None = None) -> dict:
    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    queue = list(enumerate(prompts))
    results: list[dict] = []

    async def client_loop(client: httpx.AsyncClient) -> None:
        while queue:
            _, prompt = queue.pop(0)
            body = {"model": model, "prompt": prompt, "max_tokens": output_len,
                    "min_tokens": output_len, "temperature": 0.0, "stream": True,
                    "stream_options": {"include_usage": True}}
            try:
                results.append(await one_request(client, url, body))
            except httpx.HTTPError as exc:
                results.append({"error": type(exc).__name__})

    limits = httpx.Limits(max_connections=concurrency)
    timeout = httpx.Timeout(600.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=headers) as client:
        start = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    ok = [r for r in results if "error" not in r]
    failures: dict[str, int] = {}
    for r in results:
        if "error" in r:
            failures[r["error"]] = failures.get(r["error"], 0) + 1
    out_tokens = sum(r["tokens"] for r in ok)
    finishes: dict[str, int] = {}
    for r in ok:
        finishes[str(r["finish"])] = finishes.get(str(r["finish"]), 0) + 1
    return {
        "requests": len(results), "completed": len(ok), "failures": failures,
        "seconds": elapsed, "request_throughput": len(ok) / elapsed,
        "out_tps": out_tokens / elapsed, "mean_output_tokens": out_tokens / max(1, len(ok)),
        "finish_reasons": finishes,
        "ttft": summary([r["ttft"] for r in ok]),
        "tpot": summary([r["tpot"] for r in ok if r["tpot"] is not None]),
        "itl": summary([gap for r in ok for gap in r["itl"]]),
        "e2el": summary([r["e2el"] for r in ok]),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:9965")
    p.add_argument("--model", default=None,
                   help="the `model` field to send (default: the first of /v1/models)")
    p.add_argument("--tokenizer", required=True, help="HF directory of the served model")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--api-key", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    prompts = make_text_prompts(args.tokenizer, args.num_requests, args.input_len)
    if args.model is None:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        models = httpx.get(args.base_url.rstrip("/") + "/v1/models", headers=headers).json()
        args.model = models["data"][0]["id"]
    result = asyncio.run(run_load(args.base_url, args.model, prompts, args.concurrency,
                                  args.output_len, args.api_key))
    result["config"] = {k: v for k, v in vars(args).items() if k != "api_key"}
    print("RESULT " + json.dumps(result), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
