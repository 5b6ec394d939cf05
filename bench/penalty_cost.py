"""Host time of a step's sampling batch (`RequestSampling.batch`) with a penalty on every
request, in steady decoding and on a busy server where the request list changes (one request
leaves and one arrives) between steps: what a model whose generation_config.json sets a
repetition penalty (Qwen2.5: 1.05, applied to every OpenAI request by default) costs per step.

    python bench/penalty_cost.py [--batch 64] [--lengths 2000,8000] [--out FILE]

`--batch` requests with contexts of L tokens (half prompt, half output; random ids over a
151,936-token vocabulary), CPU tensors; 40 steps of one new token per request, every other
step one request replaced by a new one of the same length. Median ms of the steady and of the
changed steps, least of 3 runs. Run with `PYTHONPATH` at another checkout for a before /
after. No model."""

from __future__ import annotations

import os
import random
import statistics
import sys
import time

from record import parser, save  # (bench/record.py: the script's folder is on the path)

sys.path.append(os.path.join(os.path.dirname(__file__), ".."))  # (PYTHONPATH wins: a worktree)

VOCAB = 151_936


def step_ms(batch: int, length: int, penalty: dict, seed: int = 0) -> dict[str, float]:
    import torch

    from tokenmill.core.request import Request, RequestStatus
    from tokenmill.sample.request_sampling import RequestSampling
    from tokenmill.sampling_params import SamplingParams

    rng = random.Random(seed)

    def request(i: int) -> Request:
        r = Request(f"r{i}", [rng.randrange(VOCAB) for _ in range(length // 2)],
                    SamplingParams(temperature=0.7, top_p=0.8, top_k=20, max_tokens=10 ** 6,
                                   **penalty))
        r.output_token_ids.extend(rng.randrange(VOCAB) for _ in range(length - length // 2))
        r.status = RequestStatus.RUNNING
        return r

    running = [request(i) for i in range(batch)]
    sampling = RequestSampling(VOCAB, torch.device("cpu"))
    sampling.batch(running)
    times: dict[str, list[float]] = {"steady": [], "changed": []}
    for step in range(40):
        for r in running:
            r.output_token_ids.append(rng.randrange(VOCAB))
        kind = "changed" if step % 2 else "steady"
        if kind == "changed":
            running.pop(rng.randrange(len(running)))
            running.append(request(batch + step))
        start = time.perf_counter()
        sampling.batch(running)
        times[kind].append(time.perf_counter() - start)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def main() -> None:
    ap = parser(__doc__, batch=64, lengths="2000,8000")
    args = ap.parse_args()
    results = {}
    for name, penalty in (("repetition", {"repetition_penalty": 1.05}),
                          ("frequency", {"frequency_penalty": 0.3})):
        for length in (int(x) for x in args.lengths.split(",")):
            runs = [step_ms(args.batch, length, penalty) for _ in range(3)]
            best = {k: round(min(r[k] for r in runs), 3) for k in runs[0]}
            results[f"{name}_{length}"] = best
            print(f"{name} penalty, L={length}: steady {best['steady']} ms, request list "
                  f"changed {best['changed']} ms", flush=True)
    if args.out:
        save(args.out, batch=args.batch, ms_per_step=results)


if __name__ == "__main__":
    main()
