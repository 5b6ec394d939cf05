"""bf16 weights against float32 on this CPU, interleaved in one process (this VM's bandwidth
drifts by a third within minutes, so the two are measured pair by pair, not run after run).

  python bench/bf16_cpu.py [--model DIR] [--pairs 6] [--batch 32]

Per pair, each dtype in turn: batch-1 decode (a 128-token prompt -> 128 tokens, ms per token
after the first) and a batch of `--batch` 128-token prompts -> 64 tokens (output tokens/s).
Then the logits: prompt logprobs over 8 prompts of 256 tokens against transformers' float32
model (the largest and mean difference of its top-5 tokens' logprobs, how often the greedy
next token agrees), for tokenmill in both dtypes and, as the scale of "bf16 tolerance",
transformers itself in bfloat16. Writes bench/results/bf16-cpu-DATE.json."""

from __future__ import annotations

import argparse
import datetime
import os
import random
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from offline_throughput import cpu_model  # noqa: E402 - sibling scripts, not a package
from record import save  # noqa: E402

DTYPES = ("float32", "bfloat16")


def prompts(n: int, length: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(length)]}
            for _ in range(n)]


def decode_ms(llm, params, seed: int) -> float:
    """ms per output token after the first, batch 1."""
    one = params.clone(max_tokens=1)
    (p,) = prompts(1, 128, seed)
    start = time.perf_counter()
    llm.generate([p], one, use_tqdm=False)
    first = time.perf_counter() - start
    start = time.perf_counter()
    llm.generate([p], params, use_tqdm=False)
    return (time.perf_counter() - start - first) / (params.max_tokens - 1) * 1e3


def batch_tps(llm, params, n: int, seed: int) -> float:
    start = time.perf_counter()
    llm.generate(prompts(n, 128, seed), params.clone(max_tokens=64), use_tqdm=False)
    return n * 64 / (time.perf_counter() - start)


def logit_agreement(llms: dict, model: str, params) -> dict:
    """Each against transformers' float32 model: |logprob| difference of every prompt token
    (the largest and the mean) and how often the most likely next token is the same."""
    import torch
    from transformers import AutoModelForCausalLM

    batch = prompts(8, 256, 99)
    ids = torch.tensor([p["prompt_token_ids"] for p in batch])
    hf = {}
    for dtype in DTYPES:
        ref = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
        with torch.no_grad():
            hf[dtype] = torch.log_softmax(ref(ids).logits.float(), dim=-1)
        del ref
    exact = hf["float32"]

    def against_float32(logprob, best) -> dict:  # (i, pos) -> the next token's logprob, top
        diffs, same = [], 0
        for i in range(len(batch)):
            for pos in range(ids.shape[1] - 1):
                diffs.append(abs(float(exact[i, pos, ids[i, pos + 1]]) - logprob(i, pos)))
                same += int(exact[i, pos].argmax()) == best(i, pos)
        return {"max_abs_logprob_diff": round(max(diffs), 4),
                "mean_abs_logprob_diff": round(statistics.fmean(diffs), 5),
                "top1_agreement": round(same / len(diffs), 4)}

    found = {"transformers bfloat16": against_float32(
        lambda i, pos: float(hf["bfloat16"][i, pos, ids[i, pos + 1]]),
        lambda i, pos: int(hf["bfloat16"][i, pos].argmax()))}
    scored = params.clone(max_tokens=1, prompt_logprobs=1)
    for dtype in DTYPES:
        outs = llms[dtype].generate(batch, scored, use_tqdm=False)
        rows = [o.prompt_logprobs for o in outs]
        found[f"tokenmill {dtype}"] = against_float32(
            lambda i, pos, rows=rows: rows[i][pos + 1][int(ids[i, pos + 1])].logprob,
            lambda i, pos, rows=rows: next(t for t, lp in rows[i][pos + 1].items()
                                           if lp.rank == 1))
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.path.expanduser(
        "~/.cache/tokenmill-peers/models/default/hf"))
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--out", default=os.path.join(
        HERE, "results", f"bf16-cpu-{datetime.date.today().isoformat()}.json"))
    args = ap.parse_args()
    from tokenmill import LLM, SamplingParams, csrc

    llms = {d: LLM(args.model, dtype=d, kv_cache_memory_gib=1, seed=0,
                   enable_prefix_caching=False) for d in DTYPES}
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    for llm in llms.values():  # warm-up
        llm.generate(prompts(2, 128, 1), params.clone(max_tokens=4), use_tqdm=False)
    runs = {d: {"decode_ms": [], "batch_tps": []} for d in DTYPES}
    for pair in range(args.pairs):
        order = DTYPES if pair % 2 == 0 else DTYPES[::-1]
        for d in order:
            runs[d]["decode_ms"].append(round(decode_ms(llms[d], params, 10 + pair), 3))
            runs[d]["batch_tps"].append(round(batch_tps(llms[d], params, args.batch,
                                                        100 + pair), 1))
        print(pair, {d: (runs[d]["decode_ms"][-1], runs[d]["batch_tps"][-1]) for d in DTYPES},
              flush=True)
    f32, bf16 = runs["float32"], runs["bfloat16"]
    ratios = {"decode": [a / b for a, b in zip(f32["decode_ms"], bf16["decode_ms"])],
              "batch": [b / a for a, b in zip(f32["batch_tps"], bf16["batch_tps"])]}
    summary = {k: {"median": round(statistics.median(v), 3), "min": round(min(v), 3),
                   "max": round(max(v), 3)} for k, v in ratios.items()}
    agreement = logit_agreement(llms, args.model, params)
    print("bf16 / fp32 speed (per pair):", summary)
    print("logits:", agreement)
    save(args.out, cpu=cpu_model(), bf16_dot_products=csrc.bf16_native(), model=args.model,
         batch=args.batch, runs=runs, ratios=summary, logits=agreement)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
