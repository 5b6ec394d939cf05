"""The KV cache's disk tier across a restart: time to first token of a long prompt on a cold
engine without the tier, on a cold engine writing through to an empty folder (the cost of
writing), and on a restarted engine over that folder (the blocks read back), for the same
prompt and for a new question after it (a chat's next turn); greedy tokens compared.

    python bench/kv_disk_tier.py [--model PATH] [--prefix 2000] [--question 64] [--out FILE]

Each engine is fresh (offline `LLM`, one process); a TTFT is the median of 3 prompts of the
same shape that share nothing with each other, the files in the OS page cache (a restart
on the same machine) unless --drop-caches (needs root)."""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from record import save  # noqa: E402


def prompts(n: int, prefix: int, question: int, seed: int) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        shared = [rng.randrange(100, 30000) for _ in range(prefix)]
        out.append((shared, shared + [rng.randrange(100, 30000) for _ in range(question)]))
    return out


def ttfts(llm, batch: list[list[int]]) -> tuple[list[float], list[list[int]], list[int]]:
    from tokenmill import SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    first = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": list(range(40000, 40100))}], params,
                 use_tqdm=False)  # (warm-up: kernels built, first-step costs paid)
    times, tokens, cached = [], [], []
    for ids in batch:
        start = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ids}], first, use_tqdm=False)[0]
        times.append(time.perf_counter() - start)
        cached.append(out.num_cached_tokens)
        # (the answer, for the comparison: this prompt's blocks are in memory now)
        tokens.append(list(llm.generate([{"prompt_token_ids": ids}], params,
                                        use_tqdm=False)[0].outputs[0].token_ids))
    return times, tokens, cached


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--prefix", type=int, default=2000)
    ap.add_argument("--question", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--drop-caches", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    from tokenmill import LLM

    cases = prompts(args.rounds, args.prefix, args.question, seed=0)
    folder = tempfile.mkdtemp(prefix="kv-disk-")
    engine = dict(max_model_len=args.prefix + args.question + 64, kv_cache_memory_gib=1.0)
    result = {}
    try:
        runs = (("no tier", {}, 0), ("no tier: next turn", {}, 1),
                ("tier, empty folder", {"kv_cache_disk_dir": folder}, 0),
                ("tier, after a restart", {"kv_cache_disk_dir": folder}, 0),
                ("tier, after a restart: next turn", {"kv_cache_disk_dir": folder}, 1))
        for name, extra, which in runs:
            if args.drop_caches and name.startswith("tier, after"):
                os.system("sync; echo 3 > /proc/sys/vm/drop_caches")
            with LLM(args.model, **engine, **extra) as llm:
                times, tokens, cached = ttfts(llm, [case[which] for case in cases])
                tier = llm.engine.core.offload_tier
                if tier is not None:
                    tier.flush(600)
                result[name] = {"ttft_s": round(statistics.median(times), 4),
                                "ttft_each_s": [round(t, 4) for t in times],
                                "cached_tokens": cached, "tokens": tokens,
                                **({"blocks_read": tier.num_read_blocks,
                                    "blocks_written": tier.store.num_saved}
                                   if tier is not None else {})}
            print(name, {k: v for k, v in result[name].items() if k != "tokens"}, flush=True)
        folder_bytes = sum(os.path.getsize(os.path.join(d, f))
                           for d, _, fs in os.walk(folder) for f in fs)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    same = (result["no tier"]["tokens"] == result["tier, empty folder"]["tokens"]
            == result["tier, after a restart"]["tokens"]
            and result["no tier: next turn"]["tokens"]
            == result["tier, after a restart: next turn"]["tokens"])
    base = result["no tier"]["ttft_s"]
    summary = {"same_tokens": same, "folder_mib": round(folder_bytes / 2**20, 1),
               "restart_ttft_speedup": round(base / result["tier, after a restart"]["ttft_s"], 2),
               "next_turn_ttft_speedup": round(result["no tier: next turn"]["ttft_s"] / result[
                   "tier, after a restart: next turn"]["ttft_s"], 2),
               "write_through_ttft_cost": round(result["tier, empty folder"]["ttft_s"] / base, 3)}
    print(summary)
    if args.out:
        save(args.out, prefix=args.prefix, question=args.question, **summary, runs=result)


if __name__ == "__main__":
    main()
