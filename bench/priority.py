"""Priority scheduling's effect on a high-priority request's time to first token under a
saturating load: an engine kept full of long low-priority requests (each one that ends is
replaced), a short high-priority request arriving every few steps; its TTFT beside the same
request's on an idle engine, under --scheduling-policy fcfs and priority (a fresh engine
each, one process).

    python bench/priority.py [--model PATH] [--slots 8] [--load-prompt 256]
        [--load-output 256] [--arrivals 8] [--every 6] [--out FILE]

The engine loop is driven in-process (EngineCore.step), so the times are the engine's, not
an HTTP client's."""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from record import save  # noqa: E402


def _engine(model: str, policy: str, slots: int):
    from tokenmill.config.engine import EngineConfig
    from tokenmill.engine.engine_core import EngineCore

    return EngineCore(EngineConfig(model=model, max_num_seqs=slots, max_model_len=2048,
                                   scheduling_policy=policy), model)


def idle_ttft(model: str, prompt: list[int], rounds: int = 5) -> float:
    from tokenmill.engine.protocol import EngineCoreRequest
    from tokenmill.sampling_params import SamplingParams

    core = _engine(model, "fcfs", 1)
    times = []
    try:
        for i in range(rounds + 1):  # (the first: warm-up)
            start = time.monotonic()
            core.add_request(EngineCoreRequest(f"idle{i}", prompt, SamplingParams(
                max_tokens=1, temperature=0, ignore_eos=True)))
            while core.has_unfinished_requests():
                core.step()
            times.append(time.monotonic() - start)
    finally:
        core.shutdown()
    return statistics.median(times[1:])


def loaded_ttft(model: str, policy: str, args, rng: random.Random) -> dict:
    from tokenmill.engine.protocol import EngineCoreRequest
    from tokenmill.sampling_params import SamplingParams

    core = _engine(model, policy, args.slots)
    low = SamplingParams(max_tokens=args.load_output, temperature=0, ignore_eos=True)
    high = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    low_priority = 10 if policy == "priority" else 0
    counter = 0

    def add_load():
        nonlocal counter
        counter += 1
        core.add_request(EngineCoreRequest(
            f"load{counter}", [rng.randrange(100, 40000) for _ in range(args.load_prompt)],
            low, priority=low_priority))

    arrived, first = {}, {}
    try:
        for _ in range(args.slots + 2):  # (full, and some waiting)
            add_load()
        steps = 0
        while len(first) < args.arrivals and steps < 20000:
            steps += 1
            if steps > 2 * args.every and steps % args.every == 0 and len(arrived) < args.arrivals:
                rid = f"high{len(arrived)}"
                arrived[rid] = time.monotonic()
                core.add_request(EngineCoreRequest(rid, [rng.randrange(100, 40000)
                                                         for _ in range(64)], high))
            for out in core.step():
                if out.request_id in arrived and out.request_id not in first \
                        and out.new_token_ids:
                    first[out.request_id] = time.monotonic()
                if out.finish_reason is not None and out.request_id.startswith("load"):
                    add_load()
        ttfts = [first[r] - arrived[r] for r in first]
        return {"ttft_median_s": round(statistics.median(ttfts), 4),
                "ttft_max_s": round(max(ttfts), 4), "arrivals": len(ttfts),
                "preemptions": core.scheduler.num_preemptions}
    finally:
        core.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="default: the bundled GGUF model")
    ap.add_argument("--slots", type=int, default=8, help="--max-num-seqs")
    ap.add_argument("--load-prompt", type=int, default=256)
    ap.add_argument("--load-output", type=int, default=256)
    ap.add_argument("--arrivals", type=int, default=8)
    ap.add_argument("--every", type=int, default=6, help="steps between arrivals")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.model is None:
        from tokenmill.loading.gguf import default_model_path
        args.model = default_model_path()
    rng = random.Random(0)
    idle = idle_ttft(args.model, [rng.randrange(100, 40000) for _ in range(64)])
    results = {"idle_ttft_s": round(idle, 4)}
    for policy in ("fcfs", "priority"):
        results[policy] = loaded_ttft(args.model, policy, args, random.Random(1))
        results[policy]["x_idle"] = round(results[policy]["ttft_median_s"] / idle, 2)
        print(policy, results[policy], flush=True)
    print("idle", results["idle_ttft_s"])
    if args.out:
        import subprocess

        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, cwd=os.path.dirname(__file__)).stdout.strip()
        save(args.out, commit=commit, model=os.path.basename(args.model), slots=args.slots,
             load_prompt=args.load_prompt, load_output=args.load_output, every=args.every,
             **results)


if __name__ == "__main__":
    main()
