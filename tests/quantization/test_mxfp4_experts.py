"""The compiled MXFP4 experts (csrc/fp4_experts.c): one call a mixture-of-experts layer,
built for AVX2 (what every x86 CPU here runs) against the obvious dequantized formula; the
AVX-512 VNNI build, which the engine uses, against the per-expert loop in
tests/models/test_gpt_oss.py."""

import ctypes

import pytest
import torch
from helpers import build_kernels_without

from tokenmill.quantization.mxfp4 import _fp4_panels, dequantize_mxfp4, mxfp4_int8

ALPHA, LIMIT = 1.702, 7.0


def _weights(gen, experts, hidden, inter):
    """Each expert's (gate|up, down) MXFP4 blocks and scales, and float biases."""
    out = []
    for _ in range(experts):
        pair = []
        for rows, cols in ((2 * inter, hidden), (hidden, inter)):
            blocks = torch.randint(0, 256, (rows, cols // 32, 16), generator=gen,
                                   dtype=torch.uint8)
            scales = torch.randint(122, 127, (rows, cols // 32), generator=gen,
                                   dtype=torch.uint8)
            pair.append((blocks, scales, torch.randn(rows, generator=gen) * 0.5))
        out.append(pair)
    return out


def _reference(x, ids, weights, experts):
    """Token by token, expert by expert, in float64 over the dequantized weights."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            (gu, gu_s, gu_b), (d, d_s, d_b) = experts[ids[t, j]]
            h = x[t].double() @ dequantize_mxfp4(gu, gu_s).double().T + gu_b.double()
            gate, up = h.chunk(2)
            gate, up = gate.clamp(max=LIMIT), up.clamp(-LIMIT, LIMIT)
            act = (up + 1) * gate * torch.sigmoid(gate * ALPHA)
            y = act @ dequantize_mxfp4(d, d_s).double().T + d_b.double()
            out[t] += weights[t, j].double() * y
    return out.float()


@pytest.mark.parametrize("rows", [1, 3, 13])
def test_the_avx2_build_gives_the_dequantized_sums(tmp_path, rows):
    """fp4_experts.c built without AVX-512 (so on any x86 CPU with AVX2): tokens routed to
    repeated and shared experts, against the float64 formula (the activations rounded to
    int16 per 32 inputs on the way: a relative error of ~1e-4)."""
    lib = build_kernels_without(tmp_path, ["-mno-avx512f"], "fp4_experts.c", "gemm.c")
    gen = torch.Generator().manual_seed(rows)
    experts, hidden, inter, top_k = 5, 64, 96, 3
    weights_of = _weights(gen, experts, hidden, inter)
    x = torch.randn(rows, hidden, generator=gen)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(rows)])
    weights = torch.softmax(torch.randn(rows, top_k, generator=gen), dim=-1)
    parts, keep = [], []
    for (gu, gu_s, gu_b), (d, d_s, d_b) in weights_of:
        row = []
        for half, bias in ((slice(0, inter), gu_b[:inter]), (slice(inter, None), gu_b[inter:])):
            shard = mxfp4_int8(gu[half], gu_s[half]).tensors
            keep.append((*_fp4_panels(shard["qweight"], shard["scale"]), bias.contiguous()))
            row += [t.data_ptr() for t in keep[-1]]
        shard = mxfp4_int8(d, d_s).tensors
        keep.append((*_fp4_panels(shard["qweight"], shard["scale"]), d_b))
        parts.append(row + [t.data_ptr() for t in keep[-1]])
    parts = torch.tensor(parts, dtype=torch.int64)
    out = torch.empty(rows, hidden)
    i64, f32, ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
    lib.tm_fp4_experts(ptr(x.data_ptr()), i64(rows), i64(hidden), i64(inter), i64(top_k),
                       ptr(ids.data_ptr()), ptr(weights.data_ptr()), i64(experts),
                       ptr(parts.data_ptr()), f32(ALPHA), f32(LIMIT), ptr(out.data_ptr()))
    ref = _reference(x, ids, weights, weights_of)
    torch.testing.assert_close(out, ref, rtol=2e-3, atol=2e-3 * ref.abs().max().item())
