"""Memory an idle engine gives back in sleep mode, and how long sleeping and waking take.

One offline engine (`--model`, default the bundled model) fills its KV cache with
`--prompts` prompts of `--length` tokens, then sleeps at level 1 (the KV cache freed), wakes,
fills it again, sleeps at level 2 (the weights freed too) and wakes; the resident anonymous
memory (RssAnon: what the process holds, not the file pages it maps) after each, and each
call's seconds. The outputs after each wake are checked equal to the first run's.

    python bench/sleep_mode.py [--model PATH] [--prompts 8] [--length 1500] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from record import save  # noqa: E402


def rss_anon_mib() -> int:
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["RssAnon"].split()[0]) // 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--length", type=int, default=1500)
    ap.add_argument("--kv-gib", type=float, default=1.0)
    ap.add_argument("--out")
    args = ap.parse_args()
    from tokenmill import LLM, SamplingParams

    llm = LLM(args.model, enable_sleep_mode=True, kv_cache_memory_gib=args.kv_gib,
              max_model_len=args.length + 16, enable_prefix_caching=False)
    prompts = [{"prompt_token_ids": [(17 * i + 5 * j) % 4000 + 100 for j in range(args.length)]}
               for i in range(args.prompts)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    def run() -> list:
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params,
                                                                    use_tqdm=False)]

    memory, seconds = {"loaded": rss_anon_mib()}, {}

    def timed(name: str, call) -> None:
        start = time.perf_counter()
        call()
        seconds[name] = round(time.perf_counter() - start, 3)
        memory[name] = rss_anon_mib()

    first = run()
    memory["kv_filled"] = rss_anon_mib()
    timed("sleep_1", lambda: llm.sleep(1))
    timed("wake_from_1", llm.wake_up)
    assert run() == first
    memory["kv_filled_again"] = rss_anon_mib()
    timed("sleep_2", lambda: llm.sleep(2))
    timed("wake_from_2", llm.wake_up)
    assert run() == first
    kv_touched = memory["kv_filled"] - memory["loaded"]
    result = {"model": args.model or "default", "prompts": args.prompts, "length": args.length,
              "rss_anon_mib": memory, "seconds": seconds,
              "freed_by_level_1_mib": memory["kv_filled"] - memory["sleep_1"],
              "freed_by_level_2_mib": memory["kv_filled_again"] - memory["sleep_2"],
              "kv_touched_mib": kv_touched}
    print(result)
    if args.out:
        import subprocess

        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, cwd=os.path.dirname(__file__)).stdout.strip()
        save(args.out, commit=commit, **result)
    llm.shutdown()


if __name__ == "__main__":
    main()
