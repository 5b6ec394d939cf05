"""The engine's host time for n-gram (prompt-lookup) drafts per step, at long contexts.

    python bench/ngram_cost.py [--batch 8] [--lengths 1000,8000,32000] [--out FILE]

`--batch` running requests (8: where n-gram drafts turn off by default; `--batch 64` with
`disable_by_batch_size` raised, as a GPU deployment might) whose contexts hold L tokens
(random ids over a 32,000-token vocabulary: few places to narrow; over 8 tokens: many), each
step one new token per request
then `NgramProposer.propose` for all of them (k=3, n-grams of 2-4 tokens), as the engine core
calls it after each step. Median ms per step over 30 steps, least of 3 runs. No model."""

from __future__ import annotations

import os
import random
import statistics
import sys
import time

from record import parser, save  # (bench/record.py: the script's folder is on the path)

sys.path.append(os.path.join(os.path.dirname(__file__), ".."))  # (PYTHONPATH wins: a worktree)


def step_ms(batch: int, length: int, vocab: int, seed: int = 0) -> float:
    from tokenmill.config.speculative import SpeculativeConfig
    from tokenmill.core.request import Request, RequestStatus
    from tokenmill.sampling_params import SamplingParams
    from tokenmill.spec_decode.proposer import NgramProposer

    rng = random.Random(seed)
    config = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3,
                                      "prompt_lookup_min": 2, "prompt_lookup_max": 4,
                                      "disable_by_batch_size": batch})
    proposer = NgramProposer(config, max_model_len=length + 1000)
    requests = []
    for i in range(batch):
        r = Request(f"r{i}", [rng.randrange(vocab) for _ in range(length // 2)],
                    SamplingParams(max_tokens=length))
        r.output_token_ids.extend(rng.randrange(vocab) for _ in range(length - length // 2))
        r.status = RequestStatus.RUNNING
        requests.append(r)
    times = []
    for step in range(33):
        for r in requests:
            r.output_token_ids.append(rng.randrange(vocab))
        start = time.perf_counter()
        proposer.propose(requests, batch)
        if step >= 3:  # (the first steps build what the proposer keeps)
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = parser(__doc__, batch=8, lengths="1000,8000,32000")
    args = ap.parse_args()
    results = {}
    for length in (int(x) for x in args.lengths.split(",")):
        for vocab in (32000, 8):
            ms = min(step_ms(args.batch, length, vocab) for _ in range(3))
            results[f"{length}_vocab{vocab}"] = round(ms, 3)
            print(f"L={length} vocab={vocab}: {ms:.3f} ms per step", flush=True)
    if args.out:
        save(args.out, batch=args.batch, ms_per_step=results)


if __name__ == "__main__":
    main()
