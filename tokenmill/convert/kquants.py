"""Writing llama.cpp's K-quant blocks, Q2_K, Q3_K, Q4_K, Q5_K and Q6_K (gguf-py reads them but
cannot write them), and llama.cpp's Q4_K_M / Q5_K_M mixes.

Each block holds 256 weights of a row in sub-blocks:
- Q4_K / Q5_K: 8 sub-blocks of 32, `w ≈ d * sc_j * q - dmin * m_j` with 4 / 5-bit `q`, 6-bit
  sub-block scales `sc_j` and mins `m_j`, the block's float16 `d` and `dmin`;
- Q2_K: 16 sub-blocks of 16, the same form with 2-bit `q` and 4-bit scales and mins;
- Q3_K: 16 sub-blocks of 16, `w ≈ d * sc_j * q`, `q` in [-4, 3], 6-bit signed scales;
- Q6_K: 16 sub-blocks of 16, `q` in [-32, 31], 8-bit signed scales.
Each sub-block's range is taken whole (min to max with the min clamped at 0 so zero is exact,
or the largest magnitude mapped to the most negative level for the symmetric types), then the
sub-block scales and mins are quantized against the block's largest. llama.cpp's quantizer
additionally searches each sub-block's scale, so its errors are a little smaller
(tests/test_convert.py bounds ours against gguf-py's dequantizer)."""

from __future__ import annotations

import numpy as np

QK_K = 256
BLOCK_BYTES = {"Q2_K": 84, "Q3_K": 110, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def _f16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float16 bytes of x, and the float32 values they hold."""
    h = x.astype(np.float16)
    return h.view(np.uint8).reshape(-1, 2), h.astype(np.float32)


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(den != 0, num / np.where(den != 0, den, 1), 0)


def _affine(x: np.ndarray, qmax: int, smax: int):
    """Sub-blocks x [blocks, subs, n] as `d * sc * q - dmin * m`: q in [0, qmax], sc and m
    in [0, smax]. Returns the f16 bytes of d and dmin, sc, m and q (uint8)."""
    lo = np.minimum(x.min(axis=2), 0.0)
    hi = np.maximum(x.max(axis=2), lo)
    scale, minimum = (hi - lo) / qmax, -lo
    d_bytes, d = _f16(scale.max(axis=1) / smax)
    dmin_bytes, dmin = _f16(minimum.max(axis=1) / smax)
    sc = np.rint(_ratio(scale, d[:, None])).clip(0, smax)
    m = np.rint(_ratio(minimum, dmin[:, None])).clip(0, smax)
    step, offset = d[:, None] * sc, dmin[:, None] * m
    q = np.rint(_ratio(x + offset[:, :, None], step[:, :, None])).clip(0, qmax)
    return d_bytes, dmin_bytes, sc.astype(np.uint8), m.astype(np.uint8), q.astype(np.uint8)


def _extreme(v: np.ndarray) -> np.ndarray:
    """The value of largest magnitude along the last axis (sign kept)."""
    return np.take_along_axis(v, np.abs(v).argmax(axis=-1)[..., None], axis=-1)[..., 0]


def _symmetric(x: np.ndarray, qmin: int, smin: int):
    """Sub-blocks x [blocks, subs, n] as `d * sc * q`: q in [qmin, -qmin - 1], sc in [smin,
    -smin - 1]; each sub-block's (and the block's) largest magnitude lands on the negative end
    exactly. Returns the f16 bytes of d, sc and q (int)."""
    scale = _extreme(x) / qmin  # [blocks, subs]
    d_bytes, d = _f16(_extreme(scale) / smin)
    sc = np.rint(_ratio(scale, d[:, None])).clip(smin, -smin - 1)
    q = np.rint(_ratio(x, (d[:, None] * sc)[:, :, None])).clip(qmin, -qmin - 1)
    return d_bytes, sc.astype(np.int16), q.astype(np.int16)


def _blocks(weights: np.ndarray, kind: str, sub: int) -> np.ndarray:
    if weights.ndim != 2 or weights.shape[1] % QK_K:
        raise ValueError(f"{kind} rows must be whole blocks of {QK_K}, got {weights.shape}.")
    return weights.astype(np.float32).reshape(-1, QK_K // sub, sub)


def _low_bits_16(q: np.ndarray) -> np.ndarray:
    """2-bit fields of 256 values in 64 bytes as Q2_K / Q3_K store them: value p in byte
    (p // 128) * 32 + p % 32, at bit 2 * ((p // 32) % 4)."""
    v = (q.reshape(-1, 2, 4, 32) & 3).astype(np.uint8)  # [blocks, half, shift, byte]
    return (v[:, :, 0] | (v[:, :, 1] << 2) | (v[:, :, 2] << 4) | (v[:, :, 3] << 6)).reshape(-1, 64)


def _scales_6bit(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K's 12 bytes: 8 six-bit scales and 8 six-bit mins."""
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 0x3F) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (m[:, 0:4] & 0x3F) | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((m[:, 4:8] & 0x0F) << 4)
    return out


def _nibbles_32(q: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K's 128 bytes: per pair of 32-value sub-blocks, the first's low nibbles and
    the second's in the high ones."""
    pairs = (q.reshape(-1, 4, 2, 32) & 0xF).astype(np.uint8)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)


def quantize_q4_k(weights: np.ndarray) -> np.ndarray:
    """[rows, cols] float (cols a multiple of 256) -> [rows, cols / 256 * 144] uint8."""
    x = _blocks(weights, "Q4_K", 32)
    d, dmin, sc, m, q = _affine(x, 15, 63)
    blocks = np.concatenate([d, dmin, _scales_6bit(sc, m), _nibbles_32(q)], axis=1)
    return blocks.reshape(weights.shape[0], -1)


def quantize_q5_k(weights: np.ndarray) -> np.ndarray:
    """[rows, cols] -> [rows, cols / 256 * 176] uint8: Q4_K's fields plus a plane of fifth
    bits (bit j of byte l: sub-block j's value l)."""
    x = _blocks(weights, "Q5_K", 32)
    d, dmin, sc, m, q = _affine(x, 31, 63)
    high = (q >> 4).astype(np.uint8)  # [blocks, 8, 32]
    qh = np.zeros((x.shape[0], 32), dtype=np.uint8)
    for j in range(8):
        qh |= high[:, j] << j
    blocks = np.concatenate([d, dmin, _scales_6bit(sc, m), qh, _nibbles_32(q)], axis=1)
    return blocks.reshape(weights.shape[0], -1)


def quantize_q6_k(weights: np.ndarray) -> np.ndarray:
    """[rows, cols] -> [rows, cols / 256 * 210] uint8: low nibbles, high 2-bit pairs, 16
    signed scales, f16 d."""
    x = _blocks(weights, "Q6_K", 16)
    d, sc, q = _symmetric(x, -32, -128)
    u = (q + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # [blocks, half, quarter, l]
    ql = np.concatenate([u[:, :, 0] & 0xF | ((u[:, :, 2] & 0xF) << 4),
                         u[:, :, 1] & 0xF | ((u[:, :, 3] & 0xF) << 4)], axis=2)
    qh = (u[:, :, 0] >> 4) | ((u[:, :, 1] >> 4) << 2) | ((u[:, :, 2] >> 4) << 4) | \
        ((u[:, :, 3] >> 4) << 6)
    blocks = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64),
                             sc.astype(np.int8).view(np.uint8), d], axis=1)
    return blocks.reshape(weights.shape[0], -1)


def quantize_q3_k(weights: np.ndarray) -> np.ndarray:
    """[rows, cols] -> [rows, cols / 256 * 110] uint8: high-bit mask, 2-bit fields, 16 six-bit
    scales (stored + 32), f16 d."""
    x = _blocks(weights, "Q3_K", 16)
    d, sc, q = _symmetric(x, -4, -32)
    u = (q + 4).astype(np.uint8).reshape(-1, 8, 32)  # [blocks, p // 32, p % 32]
    hmask = np.zeros((x.shape[0], 32), dtype=np.uint8)
    for bit in range(8):
        hmask |= (u[:, bit] >> 2) << bit
    s = (sc + 32).astype(np.uint8)  # [blocks, 16]
    scales = np.empty((x.shape[0], 12), dtype=np.uint8)
    scales[:, 0:4] = (s[:, 0:4] & 0xF) | ((s[:, 8:12] & 0xF) << 4)
    scales[:, 4:8] = (s[:, 4:8] & 0xF) | ((s[:, 12:16] & 0xF) << 4)
    scales[:, 8:12] = (s[:, 0:4] >> 4) | ((s[:, 4:8] >> 4) << 2) | ((s[:, 8:12] >> 4) << 4) | \
        ((s[:, 12:16] >> 4) << 6)
    blocks = np.concatenate([hmask, _low_bits_16(u), scales, d], axis=1)
    return blocks.reshape(weights.shape[0], -1)


def quantize_q2_k(weights: np.ndarray) -> np.ndarray:
    """[rows, cols] -> [rows, cols / 256 * 84] uint8: 16 (scale | min << 4) bytes, 2-bit
    fields, f16 d and dmin."""
    x = _blocks(weights, "Q2_K", 16)
    d, dmin, sc, m, q = _affine(x, 3, 15)
    blocks = np.concatenate([sc | (m << 4), _low_bits_16(q), d, dmin], axis=1)
    return blocks.reshape(weights.shape[0], -1)


QUANTIZERS = {"Q2_K": quantize_q2_k, "Q3_K": quantize_q3_k, "Q4_K": quantize_q4_k,
              "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}
