"""Writing llama.cpp's Q4_K blocks (gguf-py reads them but cannot write them).

A block holds 256 weights of a row as 8 sub-blocks of 32: `w ≈ d * sc_j * q - dmin * m_j`
with 4-bit `q`, 6-bit sub-block scales `sc_j` and mins `m_j`, and the block's float16 `d`
and `dmin`. Each sub-block's range is taken whole (min to max, the min clamped at 0 so zero
is exact), then the sub-block scales and mins are quantized against the block's largest;
llama.cpp's converter additionally searches each sub-block's scale, so its errors are a
little smaller (tests/test_convert.py bounds ours)."""

from __future__ import annotations

import numpy as np

QK_K = 256
BLOCK_BYTES = 144  # d, dmin (2 x f16), 12 bytes of scales, 128 bytes of 4-bit weights


def quantize_q4_k(weights: np.ndarray) -> np.ndarray:
    """[rows, cols] float (cols a multiple of 256) -> [rows, cols / 256 * 144] uint8."""
    rows, cols = weights.shape
    if cols % QK_K:
        raise ValueError(f"Q4_K rows must be whole blocks of {QK_K}, got {cols}.")
    x = weights.astype(np.float32).reshape(-1, 8, 32)  # [blocks, sub-blocks, 32]
    lo = np.minimum(x.min(axis=2), 0.0)
    hi = np.maximum(x.max(axis=2), lo)
    scale = (hi - lo) / 15.0  # per sub-block
    minimum = -lo
    d = scale.max(axis=1) / 63.0  # per block
    dmin = minimum.max(axis=1) / 63.0
    d16, dmin16 = d.astype(np.float16), dmin.astype(np.float16)
    d, dmin = d16.astype(np.float32), dmin16.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.rint(scale / d[:, None]), 0).clip(0, 63)
        m = np.where(dmin[:, None] > 0, np.rint(minimum / dmin[:, None]), 0).clip(0, 63)
        step = d[:, None] * sc  # what each sub-block's q counts in
        offset = dmin[:, None] * m
        q = np.where(step[:, :, None] > 0,
                     np.rint((x + offset[:, :, None]) / step[:, :, None]), 0).clip(0, 15)
    sc, m, q = sc.astype(np.uint8), m.astype(np.uint8), q.astype(np.uint8)
    scales = np.empty((x.shape[0], 12), dtype=np.uint8)
    scales[:, 0:4] = (sc[:, 0:4] & 0x3F) | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = (m[:, 0:4] & 0x3F) | ((m[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((m[:, 4:8] & 0x0F) << 4)
    # 32 bytes per pair of sub-blocks: the first's weights in the low nibbles, the second's
    # in the high ones
    pairs = q.reshape(-1, 4, 2, 32)
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    blocks = np.concatenate([d16.view(np.uint8).reshape(-1, 2),
                             dmin16.view(np.uint8).reshape(-1, 2), scales, qs], axis=1)
    return blocks.reshape(rows, cols // QK_K * BLOCK_BYTES)
