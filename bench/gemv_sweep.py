"""Skinny matmuls (decode's 1-16 rows x a 16-bit weight) against cuBLAS: the engine's kernel behind
TOKENMILL_GPU_SKINNY_LINEAR=1 (layers/triton_ops.py), off until measured. On the H200 a batch-1
decode step of the 0.5B model spent 22.6 us per layer in cuBLAS's four projections, which read
29.7 MB (7 us at the card's bandwidth), because its narrow outputs (896, 1152 columns) give too
few thread blocks to fill the card (`bench/results/README.md`, 2026-11-27). This sweeps that
Triton kernel, which splits the outputs into narrow column blocks and, optionally, the inputs
into K ranges summed with atomics, over the decode shapes of Qwen2-0.5B and Llama-2-7B, and
reports each shape's time by cuBLAS (`F.linear`), by the engine's autotuned launch and by the
best setting, all replayed in CUDA graphs as the engine runs them; for gate|up also cuBLAS + the
gated kernel against the gated product in one launch. Every setting is first checked against
`F.linear`.

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

from tokenmill.layers import triton_ops  # noqa: E402


def skinny_matmul(x: torch.Tensor, w: torch.Tensor, block_n: int, block_k: int, splits: int,
                  num_warps: int) -> torch.Tensor:
    """x [M <= 16, K] @ w [N, K]^T by the engine's kernel with one setting; `splits` > 1: K
    ranges summed in float32 by atomics."""
    return triton_ops.skinny_linear(x, w, None, (block_n, block_k, num_warps), splits)


SHAPES = {  # (K, N) of one decode layer's projections, and the 0.5B model's LM head
    "qwen05b_qkv": (896, 1152), "qwen05b_o": (896, 896), "qwen05b_gate_up": (896, 9728),
    "qwen05b_down": (4864, 896), "qwen05b_lm_head": (896, 151936),
    "llama7b_qkv": (4096, 12288), "llama7b_o": (4096, 4096), "llama7b_gate_up": (4096, 22016),
    "llama7b_down": (11008, 4096)}
# (block_n, block_k, K splits, warps): 27 settings, each compiled once per row count (more
# than one row: tl.dot, 16 columns at least)
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
        for m, setting in itertools.product((1, 3), [(16, 128, 1, 4), (16, 128, 2, 4),
                                                     (32, 256, 4, 4)]):
            x, w = torch.randn(m, 300), torch.randn(70, 300)
            assert check(x, w, setting), (m, setting)
        print("the kernel's paths match F.linear in the interpreter (nothing timed: no GPU)")
        return
    res = {"date": datetime.date.today().isoformat(), "command": " ".join(["python"] + sys.argv),
           "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "triton": triton.__version__, "shapes": {}}
    for (name, (k, n)), m in itertools.product(SHAPES.items(), rows):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        weight_bytes = n * k * 2
        cublas = in_graph_us(lambda: F.linear(x, w))  # noqa: B023
        # the engine's launch (TOKENMILL_GPU_SKINNY_LINEAR=1): its settings autotuned
        if not torch.allclose(triton_ops.skinny_linear(x, w, None).float(),
                              F.linear(x.float(), w.float()), rtol=2e-2, atol=2e-2):
            raise SystemExit(f"{name} rows {m} autotuned: wrong result")
        engine = in_graph_us(lambda: triton_ops.skinny_linear(x, w, None))  # noqa: B023
        best = None
        for setting in SETTINGS:
            if m > 1 and setting[0] < 16:
                continue
            if not check(x, w, setting):
                raise SystemExit(f"{name} rows {m} {setting}: wrong result")
            us = in_graph_us(lambda s=setting: skinny_matmul(x, w, *s))  # noqa: B023
            if best is None or us < best[0]:
                best = (us, setting)
        res["shapes"][f"{name}_rows{m}"] = {
            "k": k, "n": n, "cublas_us": round(cublas, 2), "engine_us": round(engine, 2),
            "best_us": round(best[0], 2),
            "best_setting_block_n_block_k_splits_warps": best[1],
            "cublas_gbps": round(weight_bytes / cublas / 1e3),
            "engine_gbps": round(weight_bytes / engine / 1e3),
            "best_gbps": round(weight_bytes / best[0] / 1e3)}
        if name.endswith("gate_up"):  # the product and SiLU gating, one launch or two
            entry = res["shapes"][f"{name}_rows{m}"]
            entry["cublas_then_gated_us"] = round(in_graph_us(
                lambda: triton_ops.gated(F.linear(x, w), gelu=False)), 2)  # noqa: B023
            entry["engine_gated_us"] = round(in_graph_us(
                lambda: triton_ops.skinny_linear(x, w, None, gated=True)), 2)  # noqa: B023
        print(name, m, res["shapes"][f"{name}_rows{m}"], flush=True)
        if args.out:  # after every shape: a run cut by its time bound keeps what it measured
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
