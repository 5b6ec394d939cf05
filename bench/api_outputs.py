"""The API process's work per engine step for long outputs (R1-style reasoning runs to tens
of thousands of tokens), which must stay below the device's step time or the API process
becomes the bottleneck of every stream.

    python bench/api_outputs.py [--batch 64] [--lengths 1000,8000,32000] [--out FILE]

For `--batch` sequences that have each generated L tokens (the tests' byte-level BPE
tokenizer, random ids; no model), the median milliseconds per step, over 30 steps of one
new token per sequence, of:
- `processor_cumulative` / `processor_delta`: `OutputProcessor.process_outputs` building
  cumulative results (the offline path; serving's before delta results) or delta results;
- `reasoning_whole_text` / `reasoning_stream`: one `--reasoning-parser deepseek_r1` split of
  each sequence's new text (the whole-text reference or the incremental stream);
- `async_llm_interval_K`: the whole API side: AsyncLLM (`stream_interval=K`) over a scripted
  engine-core client (tests/scripted_client.py), each step's outputs processed and handed to
  `--batch` readers of delta results, each feeding the incremental reasoning split and
  writing its chunk's JSON line (no socket), until the output loop asks for the next step;
  the mean over the steps (a reader with an interval wakes on some steps only).
Each number is the least of `--repeats` runs' medians (means for the AsyncLLM ones)."""

from __future__ import annotations

import asyncio
import functools
import os
import random
import statistics
import sys
import tempfile
import time

from record import parser, save  # (bench/record.py: the script's folder is on the path)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

STEPS = 32  # (a multiple of the stream intervals timed)


def _steps(rng, batch, vocab, length):
    """(warm-up chunks of 100 tokens up to `length`, then STEPS one-token steps)."""
    warm = [[[rng.randrange(3, vocab) for _ in range(100)] for _ in range(batch)]
            for _ in range(length // 100)]
    timed = [[[rng.randrange(3, vocab)] for _ in range(batch)] for _ in range(STEPS)]
    return warm, timed


def processor_ms(tokenizer, batch, length, delta, seed=0):
    from tokenmill.engine.output_processor import OutputProcessor
    from tokenmill.engine.protocol import EngineCoreOutput
    from tokenmill.sampling_params import SamplingParams

    warm, timed = _steps(random.Random(seed), batch, len(tokenizer) - 8, length)
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(max_tokens=10 ** 6)
    ids = [processor.add_request(f"r{i}", None, [5] * 16, params, delta=delta)[0]
           for i in range(batch)]
    for step in warm:
        processor.process_outputs([EngineCoreOutput(c, t) for c, t in zip(ids, step)])
    times = []
    for step in timed:
        outs = [EngineCoreOutput(c, t) for c, t in zip(ids, step)]
        start = time.perf_counter()
        processor.process_outputs(outs)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def reasoning_ms(tokenizer, batch, length, whole_text, seed=0):
    from tokenmill.entrypoints.parsers.reasoning import (
        ReasoningParser,
        ReasoningStream,
        WholeTextReasoningStream,
    )

    parser = ReasoningParser("deepseek_r1")
    cls = WholeTextReasoningStream if whole_text else ReasoningStream
    warm, timed = _steps(random.Random(seed), batch, len(tokenizer) - 8, length)
    streams = [cls(parser) for _ in range(batch)]
    for step in warm:
        for stream, ids in zip(streams, step):
            stream.feed(tokenizer.decode(ids), False)
    texts = [[tokenizer.decode(ids) for ids in step] for step in timed]
    times = []
    for step in texts:
        start = time.perf_counter()
        for stream, text in zip(streams, step):
            stream.feed(text, False)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def async_llm_ms(tokenizer, batch, length, interval=1, seed=0):
    from tests.scripted_client import ScriptedClient
    from tokenmill.engine.async_engine import AsyncLLM
    from tokenmill.engine.protocol import EngineCoreOutput
    from tokenmill.entrypoints.http.streaming import json_line
    from tokenmill.entrypoints.parsers.reasoning import ReasoningParser, ReasoningStream
    from tokenmill.outputs import OutputKind
    from tokenmill.sampling_params import SamplingParams

    warm, timed = _steps(random.Random(seed), batch, len(tokenizer) - 8, length)
    parser = ReasoningParser("deepseek_r1")

    async def body():
        client = ScriptedClient()
        llm = AsyncLLM(client, tokenizer, [2], stream_interval=interval)
        await llm.start()

        async def reader(i):
            stream = ReasoningStream(parser)
            async for out in llm.generate([5] * 16, SamplingParams(max_tokens=10 ** 6),
                                          request_id=f"r{i}", output_kind=OutputKind.DELTA):
                reasoning, content = stream.feed(out.outputs[0].text, out.finished)
                json_line({"reasoning_content": reasoning, "content": content})  # (its chunk)

        tasks = [asyncio.create_task(reader(i)) for i in range(batch)]
        while len(client.added) < batch:
            await asyncio.sleep(0)
        ids = list(client.added)
        await client.drained()
        times = []
        for k, step in enumerate(warm + timed):
            outs = [EngineCoreOutput(c, t) for c, t in zip(ids, step)]
            start = time.perf_counter()
            client.send(outs)
            await client.drained()  # (the batch processed and every reader it woke run)
            if k >= len(warm):
                times.append(time.perf_counter() - start)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await llm.shutdown()
        return statistics.mean(times) * 1e3

    return asyncio.run(body())


def main() -> None:
    ap = parser(__doc__, batch=64, lengths="1000,8000,32000")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from tests.helpers import make_tokenizer

    tokenizer = make_tokenizer(tempfile.mkdtemp())
    cases = {"processor_cumulative": lambda n: processor_ms(tokenizer, args.batch, n, False),
             "processor_delta": lambda n: processor_ms(tokenizer, args.batch, n, True),
             "reasoning_whole_text": lambda n: reasoning_ms(tokenizer, args.batch, n, True),
             "reasoning_stream": lambda n: reasoning_ms(tokenizer, args.batch, n, False),
             **{f"async_llm_interval_{k}": functools.partial(async_llm_ms, tokenizer,
                                                              args.batch, interval=k)
                for k in (1, 4, 16)}}
    results = {}
    for length in (int(x) for x in args.lengths.split(",")):
        row = {name: round(min(run(length) for _ in range(args.repeats)), 3)
               for name, run in cases.items()}
        results[str(length)] = row
        print(f"L={length}: " + ", ".join(f"{k} {v} ms" for k, v in row.items()), flush=True)
    if args.out:
        save(args.out, batch=args.batch, ms_per_step=results)


if __name__ == "__main__":
    main()
