"""ctypes wrappers of kquant_panels.c: GGUF Q4_K / Q6_K / Q5_0 / Q5_1 weights in panels of 16
output channels at about their stored size, times activations split into two int8 halves.
Re-exported by `tokenmill.csrc`.

A layer's panels are one uint8 blob, [ceil(N/16), K/256 (Q5: K/64) super-blocks x their
bytes];
`kquant_blob` builds it from the row-major tensors a checkpoint keeps (each [N, columns]: a
channel's bytes in input order), `kquant_rows` reads rows of them back."""

from __future__ import annotations

import torch

from tokenmill.csrc.build import address
from tokenmill.csrc.build import loaded as _library

__all__ = ["KQUANT_INPUTS", "KQUANT_KINDS", "KQUANT_PARTS", "kquant_blob", "kquant_parts",
           "kquant_rows", "kquant_gemm", "quantize_rows_q8x2"]

# per kind: kquant_panels.c's number for it, the inputs of a super-block, and its parts in
# order, (leaf, dtype, inputs per column); the values (and the high bits) in the kernel's
# order of inputs (`_to_kernel`), 4 bytes a column
KQUANT_KINDS = {"q4k": 0, "q6k": 1, "q5_0": 2, "q5_1": 3}
KQUANT_INPUTS = {"q4k": 256, "q6k": 256, "q5_0": 64, "q5_1": 64}
KQUANT_PARTS = {
    "q4k": [("d", torch.float32, 256), ("dmin", torch.float32, 256), ("sc", torch.uint8, 32),
            ("mn", torch.uint8, 32), ("qweight", torch.int32, 8)],
    "q6k": [("d", torch.float32, 256), ("sc", torch.int8, 16), ("qhigh", torch.int32, 16),
            ("qweight", torch.int32, 8)],
    "q5_0": [("d", torch.float16, 32), ("qbit", torch.int32, 32), ("qweight", torch.int32, 8)],
    "q5_1": [("d", torch.float16, 32), ("m", torch.float16, 32), ("qbit", torch.int32, 32),
             ("qweight", torch.int32, 8)],
}


def _regroup(t: torch.Tensor, bits: int, shape: tuple[int, int]) -> torch.Tensor:
    """Bytes [N, columns] of `bits`-bit fields (low bits first) with each run of a x b fields
    (`shape`) transposed to b x a, packed back the same way."""
    n, per = t.shape[0], 8 // bits
    fields = torch.stack([(t >> (bits * i)) & ((1 << bits) - 1) for i in range(per)], dim=-1)
    fields = fields.reshape(n, -1, *shape).transpose(2, 3).reshape(n, -1, per)
    out = fields[..., 0]
    for i in range(1, per):
        out = out | (fields[..., i] << (bits * i))
    return out.contiguous()


# kquant_panels.c's order of a part's bytes from the checkpoint's: `qweight` (byte j: inputs
# 2j, 2j + 1 in the low, high nibble) by 8 inputs, byte t holding input 8g + t low and
# 8g + 4 + t high; Q6_K's `qhigh` (bits 2s, 2s + 1 of byte i: input 4i + s) by 16 inputs,
# byte t holding inputs 16h + 4s + t in bits 2s, 2s + 1; Q5's `qbit` (bit s of byte i: input
# 8i + s) by 32 inputs, bit j of byte t holding input 32b + 4j + t. Per leaf: (bits, runs to
# the kernel's order, runs back).
_REGROUP = {"qweight": (4, (2, 4), (4, 2)), "qhigh": (2, (4, 4), (4, 4)),
            "qbit": (1, (8, 4), (4, 8))}


def _to_kernel(leaf: str, t: torch.Tensor) -> torch.Tensor:
    if leaf not in _REGROUP:
        return t
    bits, there, _ = _REGROUP[leaf]
    return _regroup(t, bits, there)


def _from_kernel(leaf: str, t: torch.Tensor) -> torch.Tensor:
    if leaf not in _REGROUP:
        return t.contiguous()
    bits, _, back = _REGROUP[leaf]
    return _regroup(t, bits, back)


# Bytes of checkpoint rows converted at a time: the regrouping's temporaries (a byte per
# field, several copies) are a slice's, not the layer's (a 0.5B model's gate|up and down
# projections added ~40 MB to its load's peak).
BLOB_CHUNK_BYTES = 1 << 20


def kquant_blob(kind: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The panels of a layer's row-major tensors: per panel of 16 channels and super-block,
    each part [columns][16] after the other (channels past N zero). Built about
    BLOB_CHUNK_BYTES of rows at a time into the blob."""
    n, k = tensors["qweight"].shape[0], tensors["qweight"].shape[1] * 2
    panels, supers = -(-n // 16), k // KQUANT_INPUTS[kind]
    row_bytes = sum(t[:1].numel() * t.element_size() for t in tensors.values())
    step = max(1, BLOB_CHUNK_BYTES // (16 * row_bytes))
    blob = None
    for p0 in range(0, panels, step):
        p1 = min(panels, p0 + step)
        rows = {leaf: t[p0 * 16:min(n, p1 * 16)] for leaf, t in tensors.items()}
        chunk = _panels(kind, rows, p1 - p0, supers)
        if blob is None:
            blob = torch.empty(panels, chunk.shape[1], dtype=torch.uint8)
        blob[p0:p1] = chunk
    return blob


def _panels(kind: str, tensors: dict[str, torch.Tensor], panels: int,
            supers: int) -> torch.Tensor:
    n = tensors["qweight"].shape[0]
    parts = []
    for leaf, dtype, _ in KQUANT_PARTS[kind]:
        t = _to_kernel(leaf, tensors[leaf])
        t = t.contiguous().view(dtype) if dtype == torch.int32 else t.to(dtype)
        padded = torch.zeros(panels * 16, t.shape[1], dtype=dtype)
        padded[:n] = t
        lanes = padded.view(panels, 16, supers, -1).permute(0, 2, 3, 1).contiguous()
        parts.append(lanes.view(panels, supers, -1).view(torch.uint8))  # [P, S, bytes]
    return torch.cat(parts, dim=2).reshape(panels, -1)


def kquant_parts(kind: str, blob: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
    """Views [panels, super-blocks, columns of one, 16] of each part of `blob`."""
    inputs = KQUANT_INPUTS[kind]
    supers = k // inputs
    blocks = blob.view(blob.shape[0], supers, -1)
    out, at = {}, 0
    for leaf, dtype, per in KQUANT_PARTS[kind]:
        size = inputs // per * 16 * torch.empty(0, dtype=dtype).element_size()
        out[leaf] = blocks[:, :, at:at + size].view(dtype).view(blob.shape[0], supers,
                                                                  inputs // per, 16)
        at += size
    return out


def kquant_rows(kind: str, blob: torch.Tensor, k: int,
                ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Rows `ids` of the checkpoint layout `kquant_blob` was built from, read back."""
    out = {}
    for leaf, t in kquant_parts(kind, blob, k).items():
        rows = t[ids // 16, :, :, ids % 16].reshape(len(ids), -1)
        if rows.dtype == torch.int32:
            rows = rows.contiguous().view(torch.uint8)
        out[leaf] = _from_kernel(leaf, rows)
    return out


def quantize_rows_q8x2(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """x [M, K] float32 contiguous (K % 32 == 0) -> (int8 [M, 2, K]: per 32 inputs integers
    a = 256 hi + lo, the his then the los; block scales [M, K/32]; block sums of the
    dequantized values [M, K/32]; int32 sums of a per 16 inputs [M, K/16])."""
    m, k = x.shape
    xq = torch.empty(m, 2, k, dtype=torch.int8)
    xs, xsum = torch.empty(m, k // 32), torch.empty(m, k // 32)
    hsum = torch.empty(m, k // 16, dtype=torch.int32)
    _library().tm_quantize_rows_q8x2(address(x), address(xq), address(xs), address(xsum),
                                     address(hsum), m, k)
    return xq, xs, xsum, hsum


def kquant_gemm(kind: str, x: torch.Tensor, blob: torch.Tensor, n: int,
                bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] float32 contiguous (K a multiple of KQUANT_INPUTS[kind]) @ the layer `blob`
    holds, x rounded to 15-bit integers per 32 inputs -> [M, N]."""
    m, k = x.shape
    xq, xs, xsum, hsum = quantize_rows_q8x2(x)
    y = torch.empty(m, n, dtype=torch.float32)
    _library().tm_kquant_gemm(KQUANT_KINDS[kind], address(xq), address(xs), address(xsum),
                              address(hsum), address(blob), address(bias), address(y), m, n, k)
    return y
