"""Prefill/decode disaggregation's cost on one machine: for a long prompt, the time to first
token of one engine computing it, against a prefill engine (its own process) computing it
and a decode engine reading its KV blocks over NIXL (UCX on loopback) and computing the
last partial block (tokens equal to one engine's: tests/engine/test_kv_transfer.py).

    python bench/disaggregation.py [--model PATH] [--prompt 2000] [--rounds 3] [--out FILE]

Engines are offline `LLM`s (the bundled model by default), the prefill one in a child
process; every prompt is new to both (no prefix-cache hits); times are medians over
`--rounds` prompts. What this does not show is disaggregation's point (decode steps not
stalled by other requests' prefills): on one 2-core machine both instances share the cores."""

from __future__ import annotations

import multiprocessing
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from record import prompt_parser, random_prompts, save  # noqa: E402

CONFIG = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}


def prefill_worker(model, engine: dict, pipe) -> None:
    from tokenmill import LLM, SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True,
                            kv_transfer_params={"do_remote_decode": True})
    with LLM(model, kv_transfer_config=CONFIG, **engine) as llm:
        pipe.send("ready")
        while (ids := pipe.recv()) is not None:
            start = time.perf_counter()
            out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
            pipe.send((time.perf_counter() - start, out.kv_transfer_params))


def timed(llm, ids: list[int], **params) -> tuple[float, object]:
    from tokenmill import SamplingParams

    start = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(
        temperature=0, ignore_eos=True, **params), use_tqdm=False)[0]
    return time.perf_counter() - start, out


def main() -> None:
    args = prompt_parser(__doc__).parse_args()
    from tokenmill import LLM

    cases = random_prompts(2 * args.rounds + 1, args.prompt)
    engine = dict(max_model_len=args.prompt + 64, kv_cache_memory_gib=1.0)
    ours, theirs = multiprocessing.get_context("spawn").Pipe()
    child = multiprocessing.get_context("spawn").Process(
        target=prefill_worker, args=(args.model, engine, theirs), daemon=True)
    child.start()
    rows = {"one engine": [], "prefill": [], "decode (read + last block)": [],
            "prefill + decode": []}
    try:
        assert ours.recv() == "ready"
        with LLM(args.model, kv_transfer_config=CONFIG, **engine) as llm:
            transfer = llm.engine.core.kv_transfer
            ours.send(cases[-1])  # (warm-up of both: kernels built, the peer connected)
            timed(llm, cases[-1], max_tokens=1, kv_transfer_params=ours.recv()[1])
            for i in range(args.rounds):
                alone, _ = timed(llm, cases[2 * i], max_tokens=1)
                ours.send(cases[2 * i + 1])
                prefill_s, params = ours.recv()
                read_before = transfer.num_read_blocks
                decode_s, _ = timed(llm, cases[2 * i + 1], max_tokens=1,
                                      kv_transfer_params=params)
                assert transfer.num_read_blocks - read_before == len(params["remote_block_ids"])
                for name, value in zip(rows, (alone, prefill_s, decode_s, prefill_s + decode_s)):
                    rows[name].append(round(value, 4))
                print({k: v[-1] for k, v in rows.items()}, flush=True)
            blocks = len(params["remote_block_ids"])
            block_bytes = int(transfer.widths.sum())
    finally:
        ours.send(None)
        child.join(60)
        if child.is_alive():
            child.kill()
    summary = {"blocks_read_per_prompt": blocks,
               "mib_read_per_prompt": round(blocks * block_bytes / 2**20, 1),
               **{f"{k}_ttft_s": round(statistics.median(v), 4) for k, v in rows.items()}}
    summary["end_to_end_over_one_engine"] = round(
        summary["prefill + decode_ttft_s"] / summary["one engine_ttft_s"], 3)
    print(summary)
    if args.out:
        save(args.out, prompt=args.prompt, rounds=args.rounds, **summary, runs=rows)


if __name__ == "__main__":
    main()
