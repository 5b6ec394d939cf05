"""Host time of the step message rank 0 sends the other tensor / pipeline-parallel ranks, at
long contexts: the whole block table every step (StepInputs.encode / decode, the other
rank's table laid out from lists) against the table as what changed (worker/step_sync.py).

    python bench/step_message.py [--batch 64] [--lengths 1000,8000,32000] [--out FILE]

`--batch` requests whose prompts of L - 1 tokens are prefilled in one step, then 30 decode
steps from a real scheduler (16-token blocks); both forms of every step's message are built,
so each side's state sees every step. Median ms per decode step, least of 3 runs; bytes of
a decode step's message. No model, no second process: the broadcast itself is not timed.

    python bench/step_message.py --engine [--tp 2] [--length 2000] [--block-size 1]

The whole engine instead: the tests' tiny random Qwen2 (tests/helpers.py) under `--tp` ranks,
`--batch` prompts of `--length` - 1 tokens prefilled, then the median of 95 all-decode
`LLMEngine.step()`s (after 5). One-token blocks give each sequence `--length` blocks with a
short prefill (the message's cost is per block); the model's forward costs little, so the
step is mostly the host's work and the ranks' exchange. Run it with `PYTHONPATH` at another
checkout for a before / after."""

from __future__ import annotations

import os
import statistics
import sys
import time

from record import parser, save  # (bench/record.py: the script's folder is on the path)

sys.path.append(os.path.join(os.path.dirname(__file__), ".."))  # (PYTHONPATH wins: a worktree)

BLOCK = 16


def run(batch: int, length: int) -> dict[str, float]:
    from tokenmill.core.kv_cache_manager import KVCacheManager
    from tokenmill.core.request import Request
    from tokenmill.core.scheduler import Scheduler, SchedulerConfig
    from tokenmill.sampling_params import SamplingParams
    from tokenmill.worker.step_inputs import StepInputs
    from tokenmill.worker.step_sync import StepReceiver, StepSender

    blocks = batch * (-(-(length + 40) // BLOCK))
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=batch * length,
                                          max_model_len=length + 40),
                          KVCacheManager(blocks, BLOCK, enable_prefix_caching=False))
    for i in range(batch):
        scheduler.add_request(Request(f"r{i}", [1 + i] * (length - 1),
                                      SamplingParams(max_tokens=40)))
    sender, receiver = StepSender(), StepReceiver()
    parts: dict[str, list[float]] = {k: [] for k in ("whole_encode", "whole_decode_layout",
                                                     "delta_encode", "delta_decode_layout")}
    size = {}
    for step in range(31):
        out = scheduler.schedule()
        sender.release(out.finished_ids)
        scheduled = sorted(out.scheduled, key=lambda s: s.num_new_tokens != 1)
        inputs = StepInputs.of(scheduled)
        t0 = time.perf_counter()
        whole = inputs.encode()
        t1 = time.perf_counter()
        StepInputs.decode(whole).layout(BLOCK)
        t2 = time.perf_counter()
        delta = sender.encode(inputs, scheduled)
        t3 = time.perf_counter()
        receiver.decode(delta).layout(BLOCK)
        t4 = time.perf_counter()
        if step:  # (step 0: the prefill)
            for key, t in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                parts[key].append(t)
            size = {"whole_bytes": len(whole), "delta_bytes": len(delta)}
        scheduler.update_from_output(out, {s.request.request_id: [7] for s in scheduled})
    return {**{k: statistics.median(v) * 1e3 for k, v in parts.items()}, **size}


def engine_step_ms(batch: int, length: int, tp: int, block_size: int) -> float:
    import tempfile

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from helpers import make_model

    from tokenmill import LLM, SamplingParams

    path = os.path.join(tempfile.mkdtemp(), "tiny")
    make_model(path, "qwen2", max_position_embeddings=length + 200)
    llm = LLM(path, tensor_parallel_size=tp, kv_cache_memory_gib=0.6, block_size=block_size,
              enable_prefix_caching=False, max_num_batched_tokens=8192,
              max_model_len=length + 100)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    for i in range(batch):
        engine.add_request(None, {"prompt_token_ids": [5 + i % 100] * (length - 1)}, params)
    scheduler = engine.core.scheduler
    while scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                   for r in scheduler.running):
        engine.step(True)
    times = []
    for _ in range(100):
        start = time.perf_counter()
        engine.step(True)
        times.append(time.perf_counter() - start)
    llm.shutdown()
    return statistics.median(times[5:]) * 1e3


def main() -> None:
    ap = parser(__doc__, batch=64, lengths="1000,8000,32000")
    ap.add_argument("--engine", action="store_true", help="time the whole engine's steps")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--length", type=int, default=2000)
    ap.add_argument("--block-size", type=int, default=1)
    args = ap.parse_args()
    if args.engine:
        ms = engine_step_ms(args.batch, args.length, args.tp, args.block_size)
        print(f"tp={args.tp} batch={args.batch} length={args.length} block_size="
              f"{args.block_size}: {ms:.2f} ms per decode step")
        return
    results = {}
    for length in (int(x) for x in args.lengths.split(",")):
        runs = [run(args.batch, length) for _ in range(3)]
        best = {k: round(min(r[k] for r in runs), 4) for k in runs[0]}
        results[str(length)] = best
        print(f"L={length}: " + ", ".join(f"{k} {v}" for k, v in best.items()), flush=True)
    if args.out:
        save(args.out, batch=args.batch, block_size=BLOCK, ms_per_decode_step=results)


if __name__ == "__main__":
    main()
