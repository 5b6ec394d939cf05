"""ctypes wrappers of the per-layer kernels: decode and prompt attention over the paged KV
cache (paged_attention.c, prompt_attention.c) and the small fused operations of layer_ops.c
(RMSNorm with its residual add, rotary, SiLU-and-multiply, the K/V cache write, the greedy
argmax). Re-exported by `tokenmill.csrc`."""

from __future__ import annotations

import torch

from tokenmill.csrc.build import address
from tokenmill.csrc.build import loaded as _library

__all__ = ["paged_decode_attention", "prompt_attention", "heads_contiguous", "add_rms_norm",
           "rotary_", "argmax_rows", "silu_and_mul", "write_kv", "KV_KINDS", "kv_kind",
           "lora_add"]

# the cache dtypes the kernels read and write, as kv_rows.h numbers their row formats
KV_KINDS = {torch.float32: 0, torch.int8: 1, torch.bfloat16: 2}


def kv_kind(cache: torch.Tensor) -> int:
    """kv_rows.h's number for the cache's row format (int8: D int8 and a float32 scale)."""
    return KV_KINDS[cache.dtype]


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           out: torch.Tensor, window: int | None = None,
                           sinks: torch.Tensor | None = None) -> None:
    """One query token per sequence attending over its cached keys, written into `out`
    [B, Hq, D] (contiguous): q [B, Hq, D] float32 with each token's heads contiguous (any
    token stride); caches [num_blocks, block_size, Hkv, D] float32 or bfloat16, or
    [..., D + 4] int8; block_table int64 [>= B, max_blocks] (rows contiguous); seq_lens int64
    [B]; `window`: the last `window` keys only; `sinks` [Hq] float32: a logit per head in
    each softmax's denominator."""
    b, hq, d = q.shape
    _, block_size, hkv, _ = k_cache.shape
    assert heads_contiguous(q) and out.is_contiguous() and out.shape == q.shape
    assert sinks is None or (sinks.dtype == torch.float32 and sinks.is_contiguous()
                             and sinks.numel() == hq)
    _library().tm_paged_decode_attention(
        address(q), q.stride(0), address(k_cache), address(v_cache), address(block_table),
        block_table.stride(0), address(seq_lens), address(out), b, hq, hkv, d, block_size, scale,
        kv_kind(k_cache), window or 0, address(sinks))


def prompt_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_table: torch.Tensor, seqs: torch.Tensor, scale: float,
                     out: torch.Tensor) -> bool:
    """Causal attention of prompt tokens over their sequences' cached keys (this step's K/V
    written first), into `out` [T, Hq, D] (contiguous): q [T, Hq, D] float32 with each token's
    heads contiguous (any token stride); caches [num_blocks, block_size, Hkv, D] float32 or
    bfloat16, or [..., D + 4] int8;
    block_table int64 [S, max_blocks] (rows contiguous); seqs int64 [S, 3]: each sequence's
    first token row, query tokens and context length. False (nothing written) where the
    kernel does not take the shapes (head size not a multiple of 32, more than 16 query heads
    per KV head)."""
    _, hq, d = q.shape
    _, block_size, hkv, _ = k_cache.shape
    assert heads_contiguous(q) and out.is_contiguous() and out.shape == q.shape
    assert seqs.is_contiguous() and block_table.stride(1) == 1
    return _library().tm_prompt_attention(
        address(q), q.stride(0), address(k_cache), address(v_cache), address(block_table),
        block_table.stride(0), address(seqs), seqs.shape[0], address(out), hq, hkv, d,
        block_size, scale, kv_kind(k_cache)) == 0


def heads_contiguous(x: torch.Tensor) -> bool:
    """x [T, H, D]: each token's H x D values lie contiguous (the token stride is free)."""
    return (x.shape[2] == 1 or x.stride(2) == 1) and (x.shape[1] == 1 or x.stride(1) == x.shape[2])


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """norm(x + residual) with `residual += x` in place (norm(x) without a residual); x and
    residual [..., D] float32 contiguous. Returns the normalized tensor."""
    d = x.shape[-1]
    out = torch.empty_like(x)
    _library().tm_add_rms_norm(address(x), address(residual), address(weight), address(out),
                               x.numel() // d, d, eps)
    return out


def rotary_(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
            positions: torch.Tensor) -> None:
    """Rotate x [T, H, D] in place (heads contiguous, any token stride) by the rows of the
    [max_pos, D] tables at `positions` (int64 [T])."""
    t, h, d = x.shape
    assert heads_contiguous(x)
    _library().tm_rotary(address(x), t, h, d, x.stride(0), address(cos), address(signed_sin),
                         address(positions))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) for x [N, V] float32 with contiguous rows: the first maximum
    of each row (the first NaN where there is one) -> int64 [N]."""
    rows, n = x.shape
    assert x.stride(1) == 1 and n > 0
    out = torch.empty(rows, dtype=torch.int64)
    _library().tm_argmax_rows(address(x), rows, n, x.stride(0), address(out))
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = gate | up [T, 2I] float32 contiguous -> [T, I]."""
    t, two_i = x.shape
    out = torch.empty(t, two_i // 2, dtype=x.dtype)
    _library().tm_silu_and_mul(address(x), address(out), t, two_i // 2)
    return out


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store k, v [T, Hkv, D] (each token's heads contiguous, any token stride) in their cache
    slots: bfloat16 caches rounded to nearest even, int8 ones each row quantized with its
    scale."""
    t, h, d = k.shape
    assert heads_contiguous(k) and heads_contiguous(v)
    _library().tm_write_kv(address(k), address(v), k.stride(0), v.stride(0), address(k_cache),
                           address(v_cache),
                           address(slot_mapping), t, h, d, kv_kind(k_cache))


def lora_add(x: torch.Tensor, y: torch.Tensor, at: torch.Tensor, bt: torch.Tensor,
             slices: int, offsets: torch.Tensor, ranks: torch.Tensor,
             slots: torch.Tensor) -> None:
    """y [T, N] += each row's LoRA product (lora.c): x [T, K] and y float32 contiguous; at
    [slots, K, width] and bt [slots, width, >= N] a layer's slots; offsets [slices + 1] and
    ranks [slots] int64; slots [T] int64, each row's slot (-1: none)."""
    t, k = x.shape
    width = at.shape[-1]
    tmp = torch.empty(t, width)
    _library().tm_lora_add(address(x), address(y), t, k, y.shape[1], address(at), address(bt),
                           bt.shape[-1], width, slices, address(offsets), address(ranks),
                           address(slots), address(tmp))

