"""Latent attention (DeepSeek's MLA) for a step's decodes on the CPU backend: the
one-sequence-at-a-time reference (attention/mla.py `mla_attention`) against the batched
groups `TorchSDPABackend.mla` runs (`mla_decodes`), on a random paged cache.

    python bench/mla_decode.py [--out FILE]

DeepSeek-V2-Lite's widths (16 heads, latent rank 512, rotary 64), 16-token blocks in random
order, batches of 1 / 8 / 64 decodes at contexts of ~512 and ~2048 (each up to 63 shorter),
float32 and bfloat16; best of 5 runs after one warm-up, ms per layer call."""

from __future__ import annotations

import os
import random
import sys
import time

import torch
from record import parser, save  # (bench/record.py: the script's folder is on the path)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def best_ms(fn, *args, runs: int = 5) -> float:
    fn(*args)
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    from helpers import paged_step

    from tokenmill.attention.mla import mla_attention
    from tokenmill.attention.torch_sdpa import TorchSDPABackend

    args = parser(__doc__, 64, "512,2048").parse_args()
    heads, rank, rope = 16, 512, 64
    torch.manual_seed(0)
    rows = []
    for batch, length in [(1, 512), (8, 512), (args.batch, 512), (args.batch, 2048)]:
        rng = random.Random(0)
        seqs = [(length - rng.randrange(0, 64), 1) for _ in range(batch)]
        blocks = sum(-(-(c + 1) // 16) for c, _ in seqs) + 4
        meta = paged_step(seqs, 16, blocks, rng)
        for dtype in (torch.float32, torch.bfloat16):
            cache = torch.randn(blocks, 16, 1, rank + rope).to(dtype)
            q = torch.randn(batch, heads, rank, dtype=dtype)
            q_pe = torch.randn(batch, heads, rope, dtype=dtype)
            backend = TorchSDPABackend()
            ref = best_ms(mla_attention, q, q_pe, cache, meta, rank, 0.1)
            ours = best_ms(backend.mla, q, q_pe, cache, meta, rank, 0.1)
            rows.append({"batch": batch, "context": length, "dtype": str(dtype)[6:],
                         "reference_ms": round(ref, 2), "batched_ms": round(ours, 2)})
            print(rows[-1], flush=True)
    if args.out:
        save(args.out, rows=rows, threads=torch.get_num_threads())


if __name__ == "__main__":
    main()
