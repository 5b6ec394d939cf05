"""Skinny matmuls (decode's 1-16 rows x a 16-bit weight) against cuBLAS, before any of it
goes into the engine: on the H200 a batch-1 decode step of the 0.5B model spent 22.6 us per
layer in cuBLAS's four projections, which read 29.7 MB (7 us at the card's bandwidth), because
its narrow outputs (896, 1152 columns) give too few thread blocks to fill the card
(`bench/results/README.md`, 2026-11-27). This sweeps a Triton kernel that splits the outputs
into narrow column blocks and, optionally, the inputs into K ranges summed with atomics, over
the decode shapes of Qwen2-0.5B and Llama-2-7B, and reports each shape's time by cuBLAS
(`F.linear`) and by the best setting, both replayed in CUDA graphs as the engine runs them.
Every setting is first checked against `F.linear`.

    python bench/gemv_sweep.py [--out bench/results/gemv-sweep-<card>-<date>.json] [--rows 1]

Without a GPU it checks the kernel's settings for correctness in Triton's interpreter
(TRITON_INTERPRET=1, small shapes) and times nothing."""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _skinny_matmul(x_ptr, w_ptr, y_ptr, M, N, K, per_split, stride_xm, stride_wn, stride_ym,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   ATOMIC: tl.constexpr, DOT: tl.constexpr):
    """y[:M, cols] (+)= x[:M, ks] @ w[cols, ks]^T for one column block and one K range."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    k_lo = tl.program_id(1) * per_split
    col_ok = cols < N
    row_ok = rows < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, tl.minimum(k_lo + per_split, K), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        w = tl.load(w_ptr + cols[:, None] * stride_wn + ks[None, :],
                    mask=col_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        if DOT:
            acc += tl.dot(x, tl.trans(w))
        else:  # (one row: products and a sum, no tensor cores)
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], 2)
    out = y_ptr + rows[:, None] * stride_ym + cols[None, :]
    ok = row_ok[:, None] & col_ok[None, :]
    if ATOMIC:
        tl.atomic_add(out, acc, mask=ok)
    else:
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=ok)


def skinny_matmul(x: torch.Tensor, w: torch.Tensor, block_n: int, block_k: int, splits: int,
                  num_warps: int) -> torch.Tensor:
    """x [M <= 16, K] @ w [N, K]^T; `splits` > 1: K ranges summed in float32 by atomics."""
    m, k = x.shape
    n = w.shape[0]
    block_m = 1 if m == 1 else 16
    per_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    y = (torch.zeros(m, n, dtype=torch.float32, device=x.device) if splits > 1
         else torch.empty(m, n, dtype=x.dtype, device=x.device))
    grid = (triton.cdiv(n, block_n), triton.cdiv(k, per_split))
    _skinny_matmul[grid](x, w, y, m, n, k, per_split, x.stride(0), w.stride(0), y.stride(0),
                         BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                         ATOMIC=splits > 1, DOT=block_m > 1, num_warps=num_warps)
    return y.to(x.dtype) if splits > 1 else y


SHAPES = {  # (K, N) of one decode layer's projections
    "qwen05b_qkv": (896, 1152), "qwen05b_o": (896, 896), "qwen05b_gate_up": (896, 9728),
    "qwen05b_down": (4864, 896), "llama7b_qkv": (4096, 12288), "llama7b_o": (4096, 4096),
    "llama7b_gate_up": (4096, 22016), "llama7b_down": (11008, 4096)}
# (block_n, block_k, K splits, warps): 27 settings, each compiled once per row count
SETTINGS = list(itertools.product((8, 16, 32), (128, 256, 512), (1, 2, 4), (4,)))


def check(x, w, setting) -> bool:
    got = skinny_matmul(x, w, *setting).float()
    ref = F.linear(x.float(), w.float())
    return torch.allclose(got, ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


def in_graph_us(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=10) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--rows", default="1")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    if not torch.cuda.is_available():  # the interpreter: correctness of every path only
        for m, setting in itertools.product((1, 3), [(8, 128, 1, 4), (16, 128, 2, 4),
                                                     (32, 256, 4, 4)]):
            x, w = torch.randn(m, 300), torch.randn(70, 300)
            assert check(x, w, setting), (m, setting)
        print("the kernel's paths match F.linear in the interpreter (nothing timed: no GPU)")
        return
    gbps = {}
    res = {"date": datetime.date.today().isoformat(), "command": " ".join(["python"] + sys.argv),
           "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "triton": triton.__version__, "shapes": {}}
    for (name, (k, n)), m in itertools.product(SHAPES.items(), rows):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        weight_bytes = n * k * 2
        cublas = in_graph_us(lambda: F.linear(x, w))  # noqa: B023
        best = None
        for setting in SETTINGS:
            if not check(x, w, setting):
                raise SystemExit(f"{name} rows {m} {setting}: wrong result")
            us = in_graph_us(lambda s=setting: skinny_matmul(x, w, *s))  # noqa: B023
            if best is None or us < best[0]:
                best = (us, setting)
        gbps[name, m] = weight_bytes / best[0] / 1e3
        res["shapes"][f"{name}_rows{m}"] = {
            "k": k, "n": n, "cublas_us": round(cublas, 2), "best_us": round(best[0], 2),
            "best_setting_block_n_block_k_splits_warps": best[1],
            "cublas_gbps": round(weight_bytes / cublas / 1e3), "best_gbps": round(gbps[name, m])}
        print(name, m, res["shapes"][f"{name}_rows{m}"], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
