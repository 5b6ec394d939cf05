"""The API process's time per streamed token: what bounds one API process's tokens per second
when the engine is fast (a GPU's 64-sequence decode step is ~1.3 ms: ~50k streamed tokens a
second to turn into SSE chunks).

    python bench/api_chunk_cost.py [--streams 64] [--tokens 900] [--repeats 2] [--out FILE]

`tokenmill serve` of the tests' tiny random Llama (tests/helpers.py; 2 layers, 64 wide, no
download) on 127.0.0.1, `--streams` concurrent `/v1/completions` streams of `--tokens` forced
tokens each (greedy, `min_tokens`), read by raw-socket clients that only count `data:` lines
(an HTTP client library would take more of the machine than the server). Reported per
streamed chunk: the CPU time (user + system) of the API process (HTTP, SSE, output
processing, detokenizing, metrics) and of the engine core process, from psutil, and the
chunks per second end to end. Each configuration runs `--repeats` times, alternated:

- `default`: as installed (uvloop's event loop and uvicorn's httptools parser, where present);
- `plain`: asyncio's own loop and uvicorn's h11 parser (uvloop and httptools hidden from the
  server by a `sitecustomize` on its PYTHONPATH), as before they were dependencies.

Set PYTHONPATH to another checkout to run its code (a before / after)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import psutil
from record import free_port, save  # (bench/record.py: the script's folder is on the path)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

_HIDE = "import sys\nsys.modules['uvloop'] = None\nsys.modules['httptools'] = None\n"


async def _request(port: int, method: str, path: str, body: bytes = b""):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"{method} {path} HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                 .encode() + body)
    await writer.drain()
    return reader, writer


async def _stream(port: int, model: str, tokens: int, seed: int) -> int:
    """One streamed completion; returns its `data:` lines."""
    body = json.dumps({"model": model, "prompt": [5, 6, 7, 10 + seed % 50], "stream": True,
                       "max_tokens": tokens, "min_tokens": tokens, "temperature": 0}).encode()
    reader, writer = await _request(port, "POST", "/v1/completions", body)
    lines = 0
    while chunk := await reader.read(1 << 16):
        lines += chunk.count(b"data: ")
    writer.close()
    return lines


async def _ready(port: int, server: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and server.poll() is None:
        try:
            reader, writer = await _request(port, "GET", "/health")
            status = (await reader.read()).split(b"\r\n", 1)[0]
            writer.close()
            if b" 200 " in status:
                return
        except OSError:
            pass
        await asyncio.sleep(0.5)
    raise SystemExit("the server did not start (see its log)")


async def _measure(port: int, server: subprocess.Popen, model: str, streams: int,
                   tokens: int) -> dict:
    await _ready(port, server)
    api = psutil.Process(server.pid)
    engine = [p for p in api.children(recursive=True) if "resource_tracker" not in
              " ".join(p.cmdline())]
    await asyncio.gather(*(_stream(port, model, 16, i) for i in range(4)))  # (warm-up)
    api0, engine0, start = cpu([api]), cpu(engine), time.perf_counter()
    lines = await asyncio.gather(*(_stream(port, model, tokens, i) for i in range(streams)))
    wall = time.perf_counter() - start
    chunks = sum(lines) - streams  # (less each stream's [DONE])
    return {"chunks": chunks, "chunks_per_s": round(chunks / wall),
            "api_us_per_chunk": round((cpu([api]) - api0) / chunks * 1e6, 1),
            "engine_us_per_chunk": round((cpu(engine) - engine0) / chunks * 1e6, 1)}


def cpu(procs: list[psutil.Process]) -> float:
    return sum(sum(p.cpu_times()[:2]) for p in procs)


def run(model: str, streams: int, tokens: int, plain: bool, folder: str) -> dict:
    port, env = free_port(), dict(os.environ)
    if plain:
        hide = os.path.join(folder, "hide")
        os.makedirs(hide, exist_ok=True)
        with open(os.path.join(hide, "sitecustomize.py"), "w") as f:
            f.write(_HIDE)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (hide, env.get("PYTHONPATH")) if p)
    with open(os.path.join(folder, "server.log"), "w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", model, "--port",
             str(port), "--max-num-seqs", str(streams), "--max-model-len", "1024"],
            env=env, stdout=subprocess.DEVNULL, stderr=log)
        try:
            return asyncio.run(_measure(port, server, model, streams, tokens))
        finally:
            server.terminate()
            server.wait(60)


def main() -> None:
    from helpers import make_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=900)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", help="a JSON result file")
    args = ap.parse_args()
    folder = tempfile.mkdtemp()
    model = os.path.join(folder, "tiny")
    make_model(model, "llama")
    results: dict[str, list[dict]] = {"default": [], "plain": []}
    for _ in range(args.repeats):
        for name in results:
            results[name].append(run(model, args.streams, args.tokens, name == "plain", folder))
            print(name, results[name][-1], flush=True)
    summary = {name: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
               for name, runs in results.items()}
    print("RESULT", json.dumps(summary))
    if args.out:
        save(args.out, streams=args.streams, tokens=args.tokens, runs=results,
             median=summary)


if __name__ == "__main__":
    main()
