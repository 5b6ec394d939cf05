"""The KV cache's host-memory tier (`--kv-offloading-size`): time to first token of a long
prompt asked again after other prompts pushed its blocks out of the engine's cache, with
and without the tier; greedy tokens compared.

    python bench/kv_host_tier.py [--model PATH] [--prompt 2000] [--rounds 3] [--out FILE]

One engine per case (offline `LLM`) whose cache holds a little more than one prompt
(`num_kv_blocks`), so each prompt evicts the one before; a TTFT is the median over
`--rounds` prompts asked again. On a GPU engine this is the tier's use; on a CPU the cache
is host memory already, so the numbers show what the tier's copies cost against computing."""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from record import prompt_parser, random_prompts, save  # noqa: E402


def run(model, prompts: list[list[int]], **engine) -> tuple[list[float], list[list[int]]]:
    """Each prompt once (evicting the one before), then each again: the second TTFTs."""
    from tokenmill import LLM, SamplingParams

    first = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    tokens = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with LLM(model, **engine) as llm:
        llm.generate([{"prompt_token_ids": list(range(40000, 40100))}], first,
                     use_tqdm=False)  # (warm-up: kernels built, first-step costs paid)
        for ids in prompts:
            llm.generate([{"prompt_token_ids": ids}], first, use_tqdm=False)
        times, outs = [], []
        for ids in prompts[:-1]:  # (the last is still in the engine's cache)
            if llm.engine.core.offload_tier is not None:
                llm.engine.core.offload_tier.flush(600)
            start = time.perf_counter()
            llm.generate([{"prompt_token_ids": ids}], first, use_tqdm=False)
            times.append(time.perf_counter() - start)
            outs.append(list(llm.generate([{"prompt_token_ids": ids}], tokens,
                                          use_tqdm=False)[0].outputs[0].token_ids))
    return times, outs


def main() -> None:
    args = prompt_parser(__doc__).parse_args()
    prompts = random_prompts(args.rounds + 1, args.prompt)
    blocks = args.prompt // 16 + 8
    engine = dict(max_model_len=args.prompt + 64, num_kv_blocks=blocks)
    cases = {"no tier": {}, "--kv-offloading-size 1": {"kv_offloading_size": 1.0}}
    result = {}
    for name, extra in cases.items():
        times, outs = run(args.model, prompts, **engine, **extra)
        result[name] = {"ttft_s": round(statistics.median(times), 4),
                        "ttft_each_s": [round(t, 4) for t in times], "tokens": outs}
        print(name, {k: v for k, v in result[name].items() if k != "tokens"}, flush=True)
    a, b = result.values()
    summary = {"same_tokens": a["tokens"] == b["tokens"], "engine_blocks": blocks,
               "ttft_speedup": round(a["ttft_s"] / b["ttft_s"], 2)}
    print(summary)
    if args.out:
        save(args.out, prompt=args.prompt, rounds=args.rounds, **summary, runs=result)


if __name__ == "__main__":
    main()
