"""GPU benchmark, `python bench/attention_sweep.py OUT.json` (issue 30): the Triton
paged-attention kernel on one fresh 2048-token prompt (Qwen2-0.5B's heads: 14 query, 2 KV,
head size 64, bf16, 16-token blocks) under several launch settings, beside cuDNN / flash SDPA
on the same contiguous tensors."""
import functools
import itertools
import json
import sys

import torch
import torch.nn.functional as F
import triton

from tokenmill.attention.triton import kernels

torch.manual_seed(0)
dev, dt = "cuda", torch.bfloat16
T, HQ, HKV, D, BS = 2048, 14, 2, 64, 16
q, k, v = (torch.randn(T, h, D, device=dev, dtype=dt) for h in (HQ, HKV, HKV))
nb = T // BS + 4
kc = torch.zeros(nb, BS, HKV, D, device=dev, dtype=dt)
vc = torch.zeros_like(kc)
table = torch.randperm(nb, device=dev)[: T // BS].view(1, -1)
pos = torch.arange(T, device=dev)
slots = table[0, pos // BS] * BS + pos % BS
kernels.write_kv(k, v, kc, vc, slots)
seq_lens = torch.tensor([T], device=dev)
q_start = torch.tensor([0, T], dtype=torch.int32, device=dev)
out = torch.empty_like(q)
flops = 2 * 2 * (T * T / 2) * HQ * D
sdpa = lambda: F.scaled_dot_product_attention(  # noqa: E731
    q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True,
    enable_gqa=True)
ref = sdpa()[0].transpose(0, 1)
res = {"sdpa_ms": triton.testing.do_bench(sdpa), "configs": []}
for rows, bn, warps, stages in itertools.product((64, 128), (32, 64), (4, 8), (2, 3)):
    tune = dict(rows=rows, block_n=bn, num_warps=warps, num_stages=stages)
    try:
        fn = functools.partial(kernels.paged_attention, q, kc, vc, out, table, seq_lens,
                               q_start, T, D ** -0.5, tune=tune)
        fn()
        err = (out.float() - ref.float()).abs().max().item()
        ms = triton.testing.do_bench(fn)
        res["configs"].append([tune, round(ms, 4), round(flops / ms / 1e9, 1), err])
    except Exception as e:  # noqa: BLE001
        res["configs"].append([tune, None, None, str(e)[:200]])
res["configs"].sort(key=lambda c: c[1] or 1e9)
res["sdpa_tflops"] = flops / res["sdpa_ms"] / 1e9
print(json.dumps(res))
with open(sys.argv[1], "w") as f:
    json.dump(res, f, indent=1)
