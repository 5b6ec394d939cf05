"""The compiled CPU prompt-attention kernel (`tokenmill/csrc/prompt_attention.c`) alone: one
sequence's chunk of query tokens after a cached context, over a paged float32 cache, in
GFLOP/s (the causal product's multiply-adds: QK^T and P @ V, 4 FLOPs a visible key and dim).

    python bench/prompt_attention_cpu.py [--shapes 2048:14000,2048:0] [--heads 14:2:64]
        [--repeats 5] [--against OLD.c] [--out result.json]

`--against` builds another version of the source (say `git show REV:tokenmill/csrc/
prompt_attention.c > old.c`) into a library of its own and times both, alternating call by
call, so a drifting machine moves both alike; the largest difference of their outputs is
reported beside. Defaults: Qwen2.5-0.5B's heads (14 query, 2 KV, head size 64), 16-token
blocks laid out in order, a 16k prompt's last 2,048-token chunk and a fresh 2,048 one."""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from record import save  # noqa: E402

from tokenmill.csrc import build  # noqa: E402


def other_kernel(source: str):
    """tm_prompt_attention of `source`, built as tokenmill builds its kernels."""
    folder = tempfile.mkdtemp()
    lib = os.path.join(folder, "other.so")
    include = os.path.dirname(build.__file__)
    subprocess.run(["gcc", *build._FLAGS, f"-I{include}", source, "-o", lib], check=True)
    fn = ctypes.CDLL(lib).tm_prompt_attention
    fn.restype = ctypes.c_int64
    fn.argtypes = build.loaded().tm_prompt_attention.argtypes
    return fn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="2048:14000,2048:0",
                    help="query tokens:cached context, comma-separated")
    ap.add_argument("--heads", default="14:2:64", help="query heads:KV heads:head size")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--against", help="another prompt_attention.c to time beside")
    ap.add_argument("--out")
    args = ap.parse_args()
    hq, hkv, d = (int(v) for v in args.heads.split(":"))
    block = 16
    kernels = {"current": build.loaded().tm_prompt_attention}
    if args.against:
        kernels["against"] = other_kernel(args.against)
    torch.manual_seed(0)
    rows = []
    for shape in args.shapes.split(","):
        t, ctx = (int(v) for v in shape.split(":"))
        n = ctx + t
        blocks = -(-n // block)
        k_cache, v_cache = (torch.randn(blocks, block, hkv, d) for _ in range(2))
        table = torch.arange(blocks).view(1, -1)
        q = torch.randn(t, hq, d)
        seqs = torch.tensor([[0, t, ctx]], dtype=torch.int64)
        outs = {name: torch.empty_like(q) for name in kernels}
        flops = 4 * hq * d * (t * ctx + t * (t + 1) / 2)
        times = {name: [] for name in kernels}
        for _ in range(args.repeats + 1):  # (the first call of each: a warm-up)
            for name, fn in kernels.items():
                start = time.perf_counter()
                fn(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                   table.data_ptr(), table.stride(0), seqs.data_ptr(), 1, outs[name].data_ptr(),
                   hq, hkv, d, block, d ** -0.5, 0)
                times[name].append(time.perf_counter() - start)
        row = {"query_tokens": t, "context": ctx}
        for name, ts in times.items():
            median = sorted(ts[1:])[len(ts[1:]) // 2]
            row[name] = {"median_ms": round(median * 1e3, 2),
                         "gflops": round(flops / median / 1e9, 1)}
        if "against" in outs:
            row["max_abs_difference"] = float((outs["current"] - outs["against"]).abs().max())
        rows.append(row)
        print(row)
    if args.out:
        save(args.out, heads=args.heads, block_size=block, threads=torch.get_num_threads(),
             cpu_flags=sorted(build._cpu_flags() & {"avx2", "avx512f", "avx512_bf16"}),
             rows=rows)


if __name__ == "__main__":
    main()
