"""Host time per decode step: the engine's Python around a forward that costs ~nothing.

The tests' 2-layer, 64-wide random Qwen2 model and byte-level BPE tokenizer
(tests/helpers.py, built with transformers and tokenizers; no download) make the forward
negligible, so a decode step's time is the engine's own work: scheduling, the step's inputs,
sampling, output processing. On a GPU that work is not overlapped with the device's (the
engine waits for each step's tokens before it schedules the next), so it adds to every
decode step; here it is measured on the CPU, where the same Python runs.

    python bench/host_overhead.py [--async-scheduling] [--final-only]
        [--prompt-len-host N] [--out bench/results/host-overhead-DATE.json]

Reports the median over the all-decode steps of `LLMEngine.step()` (the serving path: every
advanced request's result built; `--final-only`: the offline `LLM`'s steps) for batches of
1, 8 and 64 sequences (greedy; and batch 1 with temperature / top-p / a repetition penalty),
in milliseconds of wall time and of the calling thread's CPU time, each the least of
`--repeats` runs' medians (a busy machine only adds time); the host's share of one 2048-token
prompt's `generate()` (`--prompt-len-host`: its wall time less the model's forward); and
`--profile` prints the top
functions by own time for batch 1 (`--profile-batch N`: for N sequences)."""

from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import os
import platform
import pstats
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def step_times(llm, batch: int, params, steps: int, final_only: bool = False,
               prompt_len: int = 16) -> list[float]:
    engine = llm.engine
    for i in range(batch):
        engine.add_request(None, {"prompt_token_ids": [5 + i % 100] * prompt_len}, params)
    # the steps that run the prompts first (chunks of the step's token budget), untimed
    budget = engine.core.scheduler.config.max_num_batched_tokens
    for _ in range(-(-batch * prompt_len // budget) + 1):
        engine.step(final_only)
    wall, cpu = [], []
    for _ in range(steps):
        start, start_cpu = time.perf_counter(), time.thread_time()
        engine.step(final_only)
        wall.append(time.perf_counter() - start)
        cpu.append(time.thread_time() - start_cpu)
    while engine.has_unfinished_requests():
        engine.step()
    return wall, cpu


def prompt_host_ms(root: str, length: int, reps: int = 20) -> dict:
    """A `length`-token prompt's `generate()` (max_tokens=1) and, of it, the model's forward:
    the rest is the host's work around one long prompt (checks, scheduling, the step's
    inputs, sampling, outputs), which on a GPU comes before its first kernel or after its
    last. Medians over `reps` calls."""
    import random

    from helpers import make_model

    from tokenmill import LLM, SamplingParams

    path = os.path.join(root, "tiny_long")
    make_model(path, "qwen2", max_position_embeddings=length + 64)
    llm = LLM(path, kv_cache_memory_gib=0.25, enable_prefix_caching=False,
              max_num_batched_tokens=length, max_model_len=length + 64)
    model = llm.engine.core.runner.model
    forward, spent = model.forward, []

    def timed_forward(*args, **kwargs):
        start = time.perf_counter()
        try:
            return forward(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - start)

    model.forward = timed_forward
    rng = random.Random(0)
    prompt = {"prompt_token_ids": [rng.randrange(5, 200) for _ in range(length)]}
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    walls, rests = [], []
    for i in range(reps + 3):
        spent.clear()
        start = time.perf_counter()
        llm.generate([prompt], one, use_tqdm=False)
        wall = time.perf_counter() - start
        if i >= 3:  # (warm-up)
            walls.append(wall * 1e3)
            rests.append((wall - sum(spent)) * 1e3)
    return {"generate_ms": round(statistics.median(walls), 4),
            "host_ms": round(statistics.median(rests), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--profile-batch", type=int, default=1,
                        help="the batch size --profile profiles (default 1)")
    parser.add_argument("--prompt-len", type=int, default=16,
                        help="tokens per prompt (long ones: a step's block tables grow)")
    parser.add_argument("--final-only", action="store_true",
                        help="steps as the offline LLM runs them: only finished requests' "
                             "results built (and their text)")
    parser.add_argument("--prompt-len-host", type=int, default=2048,
                        help="also time the host's work around one prompt of this many "
                             "tokens (0: skip)")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="the engine with async_scheduling=True (on a CPU nothing "
                             "overlaps: this measures what the asynchronous path costs)")
    args = parser.parse_args()

    from helpers import make_model

    from tokenmill import LLM, SamplingParams

    path = os.path.join(tempfile.mkdtemp(), "tiny")
    make_model(path, "qwen2")
    llm = LLM(path, kv_cache_memory_gib=0.25, enable_prefix_caching=False,
              async_scheduling=args.async_scheduling)
    greedy = SamplingParams(temperature=0, max_tokens=args.steps + 4, ignore_eos=True)
    sampled = greedy.clone(temperature=0.8, top_p=0.9, repetition_penalty=1.1, seed=1)
    step_times(llm, 8, greedy, 20)  # warm-up
    cases = {"batch1_greedy": (1, greedy), "batch8_greedy": (8, greedy),
             "batch64_greedy": (64, greedy), "batch1_sampled": (1, sampled)}
    results = {}
    for name, (batch, params) in cases.items():
        # the least of the repeats' medians: a busy (shared) machine only adds time
        runs = [step_times(llm, batch, params, args.steps, args.final_only, args.prompt_len)
                for _ in range(args.repeats)]
        wall = [statistics.median(w) * 1e3 for w, _ in runs]
        cpu = [statistics.median(c) * 1e3 for _, c in runs]
        results[name] = {"ms_per_step": round(min(wall), 4),
                         "thread_cpu_ms_per_step": round(min(cpu), 4),
                         "medians_ms": [round(m, 4) for m in wall]}
        print(f"{name:16s} {min(wall):.3f} ms/step, engine thread's CPU {min(cpu):.3f} ms "
              f"(wall medians {', '.join(f'{m:.3f}' for m in wall)})")
    if args.prompt_len_host:
        name = f"prompt{args.prompt_len_host}"
        results[name] = prompt_host_ms(os.path.dirname(path), args.prompt_len_host)
        print(f"{name:16s} generate {results[name]['generate_ms']:.3f} ms, of which the "
              f"host's (not the forward) {results[name]['host_ms']:.3f} ms")
    if args.profile:
        profile = cProfile.Profile()
        profile.enable()
        step_times(llm, args.profile_batch, greedy, args.steps, args.final_only,
                   args.prompt_len)
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"date": datetime.date.today().isoformat(),
                       "command": " ".join(["python"] + sys.argv),
                       "machine": f"{platform.processor() or platform.machine()}, "
                                  f"{os.cpu_count()} CPUs",
                       "steps": args.steps, "repeats": args.repeats,
                       "async_scheduling": args.async_scheduling,
                       "final_only": args.final_only, "prompt_len": args.prompt_len,
                       "results": results},
                      f, indent=1)


if __name__ == "__main__":
    main()
