"""GGUF block formats turned into the int8 / int4 kernels' tensors without expanding them to
float: each block's integers kept, its scales split out.

- Q8_0 (32 x int8, one fp16 scale) -> int8, groups of 32.
- Q4_0 / Q4_1 (32 x 4 bits, scale (and min)) -> int4 (w = q x scale + min; Q4_0's
  w = d (q - 8) is min = -8 d), groups of 32, their nibbles as they are.
- Q5_0 / Q5_1 (32 x 5 bits, w = d (q - 16) / d q + m) -> kept as stored (kquant_kernels.py:
  nibbles, fifth bits, fp16 d and m: exact, the file's size) where K is a multiple of 64; else
  (or with TOKENMILL_GGUF_COMPACT=0) int8, groups of 32 (Q5_1 with an offset): exact.
- Q4_K (256-blocks of 8 groups of 32 x 4 bits, 6-bit group scales and mins times fp16 d and
  dmin, w = d sc q - dmin m) -> kept as stored (kquant_kernels.py: its bits, byte scales and
  float32 factors per 256 inputs): exact, 1.06x the file.
- Q6_K (256-blocks of 16 groups of 16 x 6 bits, int8 group scales times an fp16 d,
  w = d sc (q - 32)) -> kept as stored too (1.01x the file); with TOKENMILL_GGUF_COMPACT=0
  int8, groups of 16: exact, 1.5x the file.
- Q3_K (256-blocks of 16 groups of 16 x 3 bits, 6-bit group scales times an fp16 d,
  w = d (sc - 32) q with q in -4..3) -> int8, groups of 16: exact.
- Q5_K (Q4_K's groups with a fifth bit, q in 0..31) -> int8 q with a float32 scale and
  offset per group of 32 (the int8 kernel adds the offsets times the activations' group
  sums): exact.
- Q2_K (256-blocks of 16 groups of 16 x 2 bits, 4-bit scales and mins times fp16 d and dmin)
  -> int8 q (0..3) with a float32 scale d sc and offset -dmin m per group of 16: exact (the
  int4 kernels' float16 scales would round them, and their compiled forms take groups of 32).
- MXFP4 (32 x 4-bit E2M1, one E8M0 power of two; gpt-oss' experts) -> int8 (each value
  times two, a whole number) with a float32 scale (half the power of two) per 32: exact;
  served by mxfp4.py's kernel (4-bit codes again on VNNI CPUs).
Each function takes a weight's [N, bytes per row] uint8 rows and returns the kernel tensors
(rows = output channels)."""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.config import kernels as kernel_switches
from tokenmill.quantization.kquant_kernels import q5_servable
from tokenmill.quantization.mxfp4 import E2M1

# block type -> (weights a block, bytes a block)
BLOCKS = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22),
          "Q5_1": (32, 24), "Q6_K": (256, 210), "Q3_K": (256, 110), "Q4_K": (256, 144),
          "Q5_K": (256, 176), "Q2_K": (256, 84), "MXFP4": (32, 17)}
METHODS = {"Q8_0": "int8", "Q5_0": "q5_0", "Q5_1": "q5_1", "Q3_K": "int8", "Q5_K": "int8",
           "Q4_0": "int4", "Q4_1": "int4", "Q2_K": "int8", "Q4_K": "q4k", "Q6_K": "q6k",
           "MXFP4": "mxfp4"}


def _blocks(data: np.ndarray, kind: str, n: int, k: int) -> np.ndarray:
    size, nbytes = BLOCKS[kind]
    return np.ascontiguousarray(data).view(np.uint8).reshape(n, k // size, nbytes)


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view(np.float16)[..., 0].astype(np.float32)


# Rows converted at a time: a large table (a 152k-token LM head) is converted a slice at a
# time into its final tensors, so the conversion's temporaries (widened values, scales) are
# a slice's, not the whole table's (they once added 290 MB to a 0.5B model's peak).
ROW_CHUNK = 8192


def to_kernel_tensors(data: np.ndarray, kind: str, n: int, k: int
                      ) -> tuple[str, dict[str, torch.Tensor]]:
    """(kernel method, its tensors) of a [N, K] weight's blocks; Q6_K, Q5_0 and Q5_1 widened
    to int8 (exactly) with TOKENMILL_GGUF_COMPACT=0, Q5 also where K is not a multiple of
    the kernel's 64. Every tensor is by rows (its first dimension N), so a table of more than
    ROW_CHUNK rows is converted ROW_CHUNK rows at a time into tensors allocated once."""
    if n <= ROW_CHUNK:
        return _to_kernel_tensors(data, kind, n, k)
    rows = np.asarray(data).view(np.uint8).reshape(n, -1)
    method, first = _to_kernel_tensors(rows[:ROW_CHUNK], kind, ROW_CHUNK, k)
    out = {leaf: torch.empty((n, *t.shape[1:]), dtype=t.dtype) for leaf, t in first.items()}
    for leaf, t in first.items():
        out[leaf][:ROW_CHUNK] = t
    del first
    for start in range(ROW_CHUNK, n, ROW_CHUNK):
        stop = min(start + ROW_CHUNK, n)
        part_method, part = _to_kernel_tensors(rows[start:stop], kind, stop - start, k)
        assert part_method == method  # (decided by the kind and K alone)
        for leaf, t in part.items():
            out[leaf][start:stop] = t
    return method, out


def _to_kernel_tensors(data: np.ndarray, kind: str, n: int, k: int
                       ) -> tuple[str, dict[str, torch.Tensor]]:
    blocks = _blocks(data, kind, n, k)
    compact = kernel_switches.current().cpu.gguf_compact
    if kind == "Q6_K" and not compact:
        return "int8", _q6_k_int8(blocks, n, k)
    return q5_servable(METHODS[kind], _CONVERT[kind](blocks, n, k), widen=not compact)


def _q8_0(blocks, n, k):
    q = blocks[..., 2:].copy().view(np.int8).reshape(n, k)
    return {"qweight": torch.from_numpy(q), "scale": torch.from_numpy(_f16(blocks[..., 0:2]))}


def _q4(blocks, n, k, with_min: bool):
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    if with_min:
        mins, qs = blocks[..., 2:4].copy().view(np.float16)[..., 0], blocks[..., 4:]
    else:
        mins, qs = (d.astype(np.float32) * -8).astype(np.float16), blocks[..., 2:]
    return {"qweight": torch.from_numpy(qs.reshape(n, k // 2).copy()),
            "scale": torch.from_numpy(d.copy()), "min": torch.from_numpy(mins.copy())}


def _q5(blocks, n, k, with_min: bool):
    """Kept as stored (kquant_kernels.Q50Kernel / Q51Kernel): the nibbles as pairs in input
    order, the fifth bits as they are (bit s of byte i: input 8i + s), d (and m)."""
    at = 4 if with_min else 2
    qs = blocks[..., at + 4:]
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, k)  # inputs 0..31
    out = {"qweight": torch.from_numpy(_pairs(low)),
           "qbit": torch.from_numpy(blocks[..., at:at + 4].reshape(n, k // 8).copy()),
           "d": torch.from_numpy(blocks[..., 0:2].copy().view(np.float16).reshape(n, k // 32))}
    if with_min:
        out["m"] = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16).reshape(n, k // 32))
    return out


def _q6_values(blocks, n, k) -> np.ndarray:
    """Q6_K's values q (0..63) [N, K], inputs in order."""
    ql, qh = blocks[..., :128], blocks[..., 128:192]
    q = np.empty(blocks.shape[:2] + (256,), dtype=np.uint8)
    for half in range(2):  # each 128 inputs: ql 64 bytes, qh 32 bytes
        low, hi = ql[..., 64 * half: 64 * half + 64], qh[..., 32 * half: 32 * half + 32]
        base = 128 * half
        q[..., base: base + 32] = (low[..., :32] & 0xF) | ((hi & 3) << 4)
        q[..., base + 32: base + 64] = (low[..., 32:] & 0xF) | (((hi >> 2) & 3) << 4)
        q[..., base + 64: base + 96] = (low[..., :32] >> 4) | (((hi >> 4) & 3) << 4)
        q[..., base + 96: base + 128] = (low[..., 32:] >> 4) | (((hi >> 6) & 3) << 4)
    return q.reshape(n, k)


def _q6_k_int8(blocks, n, k):
    """Widened to int8 groups of 16 (exact): ~2x faster to multiply than as stored."""
    sc = blocks[..., 192:208].copy().view(np.int8).astype(np.float32)
    scale = (_f16(blocks[..., 208:210])[..., None] * sc).reshape(n, k // 16)  # per 16 inputs
    q = _q6_values(blocks, n, k).astype(np.int16) - 32
    return {"qweight": torch.from_numpy(q.astype(np.int8)), "scale": torch.from_numpy(scale)}


def _q6_k(blocks, n, k):
    """Kept as stored (kquant_kernels.Q6KKernel): low nibbles, high bits, scales, d."""
    q = _q6_values(blocks, n, k)
    high = (q >> 4).reshape(n, k // 4, 4)
    return {"qweight": torch.from_numpy(_pairs(q & 0xF)),
            "qhigh": torch.from_numpy(high[..., 0] | (high[..., 1] << 2) | (high[..., 2] << 4)
                                      | (high[..., 3] << 6)),
            "sc": torch.from_numpy(blocks[..., 192:208].copy().view(np.int8).reshape(n, k // 16)),
            "d": torch.from_numpy(_f16(blocks[..., 208:210]))}


def _pairs(q: np.ndarray) -> np.ndarray:
    """[N, K] values 0..15 -> [N, K/2] bytes: input 2j low nibble, 2j + 1 high."""
    return np.ascontiguousarray((q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8))


def _q3_k(blocks, n, k):
    hmask, qs = blocks[..., :32], blocks[..., 32:96]
    a, b, c = blocks[..., 96:100], blocks[..., 100:104], blocks[..., 104:108]
    sc = np.concatenate([(a & 0xF) | ((c & 3) << 4), (b & 0xF) | (((c >> 2) & 3) << 4),
                         (a >> 4) | (((c >> 4) & 3) << 4), (b >> 4) | (((c >> 6) & 3) << 4)],
                        axis=-1).astype(np.float32) - 32
    d = _f16(blocks[..., 108:110])
    q = np.empty(blocks.shape[:2] + (256,), dtype=np.int8)
    for half in range(2):  # each 128 inputs: 32 bytes of 2-bit pairs, 4 shifts
        low = qs[..., 32 * half: 32 * half + 32]
        for j in range(4):
            high = (hmask & (1 << (4 * half + j))) != 0  # set: no offset; clear: minus 4
            start = 128 * half + 32 * j
            q[..., start: start + 32] = ((low >> (2 * j)) & 3).astype(np.int8) - 4 * ~high
    scale = (d[..., None] * sc).reshape(n, k // 16)  # a scale per 16 inputs, in order
    return {"qweight": torch.from_numpy(q.reshape(n, k)), "scale": torch.from_numpy(scale)}


def _k_scales(blocks):
    """Q4_K / Q5_K: per 256-block d and dmin ([N, K/256] float32), and the 8 groups' 6-bit
    scales and mins ([N, blocks, 8] integers)."""
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    packed = blocks[..., 4:16].reshape(*blocks.shape[:2], 3, 4)
    a, b, c = packed[..., 0, :], packed[..., 1, :], packed[..., 2, :]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], axis=-1)
    return d, dmin, sc, mn


def _q4_k(blocks, n, k):
    """Kept as stored (kquant_kernels.Q4KKernel): nibbles, 6-bit scales and mins, d, dmin."""
    d, dmin, sc, mn = _k_scales(blocks)
    qs = blocks[..., 16:].reshape(*blocks.shape[:2], 4, 32)  # 4 x (32 bytes: 2 groups)
    q = np.stack([qs & 0x0F, qs >> 4], axis=-2).reshape(n, k)  # groups of 32 in order
    return {"qweight": torch.from_numpy(_pairs(q)),
            "sc": torch.from_numpy(sc.reshape(n, k // 32).astype(np.uint8)),
            "mn": torch.from_numpy(mn.reshape(n, k // 32).astype(np.uint8)),
            "d": torch.from_numpy(d), "dmin": torch.from_numpy(dmin)}


def _q5_k(blocks, n, k):
    d, dmin, sc, mn = _k_scales(blocks)
    scale, offset = d[..., None] * sc, -(dmin[..., None] * mn)
    qh = blocks[..., 16:48]  # bit 2c / 2c + 1 of byte l: input l of group 2c / 2c + 1
    qs = blocks[..., 48:].reshape(*blocks.shape[:2], 4, 32)
    low = np.stack([qs & 0x0F, qs >> 4], axis=-2)  # [.., 4, 2, 32]: groups of 32 in order
    shifts = np.arange(8, dtype=np.uint8).reshape(4, 2, 1)
    high = (qh[..., None, None, :] >> shifts) & 1
    q = (low | (high << 4)).reshape(n, k)
    return {"qweight": torch.from_numpy(q.astype(np.int8)),
            "scale": torch.from_numpy(scale.reshape(n, k // 32).astype(np.float32)),
            "offset": torch.from_numpy(offset.reshape(n, k // 32).astype(np.float32))}


def _q2_k(blocks, n, k):
    sc = blocks[..., :16]  # per group of 16: scale in the low nibble, min in the high one
    qs = blocks[..., 16:80].reshape(*blocks.shape[:2], 2, 32)  # 2 x 128 inputs
    d, dmin = _f16(blocks[..., 80:82]), _f16(blocks[..., 82:84])
    # each 128 inputs: 4 shifts x (16 from bytes 0..15, 16 from bytes 16..31)
    shifts = np.arange(0, 8, 2, dtype=np.uint8).reshape(4, 1)
    q = ((qs[..., None, :] >> shifts[None, None, None]) & 3).reshape(n, k)
    scale = (d[..., None] * (sc & 0x0F)).reshape(n, k // 16).astype(np.float32)
    offset = (-(dmin[..., None] * (sc >> 4))).reshape(n, k // 16).astype(np.float32)
    return {"qweight": torch.from_numpy(q.astype(np.int8)), "scale": torch.from_numpy(scale),
            "offset": torch.from_numpy(offset)}


_E2M1_TWICE = np.array([int(2 * v) for v in E2M1], np.int8)


def _mxfp4(blocks, n, k):
    """llama.cpp's MXFP4 block: the E8M0 byte, then 16 bytes whose low nibbles are values
    0..15 and high nibbles 16..31."""
    qs = blocks[..., 1:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    scale = np.ldexp(np.float32(1.0), blocks[..., 0].astype(np.int32) - 128).astype(np.float32)
    return {"qweight": torch.from_numpy(_E2M1_TWICE[codes].reshape(n, k)),
            "scale": torch.from_numpy(scale)}


_CONVERT = {"Q8_0": _q8_0, "MXFP4": _mxfp4, "Q4_0": lambda b, n, k: _q4(b, n, k, False),
            "Q4_1": lambda b, n, k: _q4(b, n, k, True),
            "Q5_0": lambda b, n, k: _q5(b, n, k, False),
            "Q5_1": lambda b, n, k: _q5(b, n, k, True), "Q6_K": _q6_k, "Q3_K": _q3_k,
            "Q4_K": _q4_k, "Q5_K": _q5_k, "Q2_K": _q2_k}
