"""ctypes wrappers of kquant_panels.c: GGUF Q4_K / Q6_K weights in panels of 16 output
channels at about their stored size, times int16 activations. Re-exported by
`tokenmill.csrc`.

A layer's panels are one uint8 blob, [ceil(N/16), K/256 super-blocks x their bytes];
`kquant_blob` builds it from the row-major tensors a checkpoint keeps (each [N, columns]: a
channel's bytes in input order), `kquant_parts` views it back per part."""

from __future__ import annotations

import torch

from tokenmill.csrc import _library, address, quantize_rows_q16

__all__ = ["KQUANT_PARTS", "kquant_blob", "kquant_parts", "kquant_gemm"]

# per kind: a super-block's parts in order, (leaf, dtype, inputs per column)
KQUANT_PARTS = {
    "q4k": [("d", torch.float32, 256), ("dmin", torch.float32, 256), ("sc", torch.uint8, 32),
            ("mn", torch.uint8, 32), ("qweight", torch.uint8, 2)],
    "q6k": [("d", torch.float32, 256), ("sc", torch.int8, 16), ("qhigh", torch.uint8, 4),
            ("qweight", torch.uint8, 2)],
}


def kquant_blob(kind: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The panels of a layer's row-major tensors: per panel of 16 channels and super-block of
    256 inputs, each part [columns][16] after the other (channels past N zero)."""
    n, k = tensors["qweight"].shape[0], tensors["qweight"].shape[1] * 2
    panels, supers = -(-n // 16), k // 256
    parts = []
    for leaf, dtype, _ in KQUANT_PARTS[kind]:
        t = tensors[leaf].to(dtype)
        padded = torch.zeros(panels * 16, t.shape[1], dtype=dtype)
        padded[:n] = t
        lanes = padded.view(panels, 16, supers, -1).permute(0, 2, 3, 1).contiguous()
        parts.append(lanes.view(panels, supers, -1).view(torch.uint8))  # [P, S, bytes]
    return torch.cat(parts, dim=2).reshape(panels, -1).contiguous()


def kquant_parts(kind: str, blob: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
    """Views [panels, super-blocks, columns of one, 16] of each part of `blob`."""
    supers = k // 256
    blocks = blob.view(blob.shape[0], supers, -1)
    out, at = {}, 0
    for leaf, dtype, per in KQUANT_PARTS[kind]:
        size = 256 // per * 16 * torch.empty(0, dtype=dtype).element_size()
        out[leaf] = blocks[:, :, at:at + size].view(dtype).view(blob.shape[0], supers,
                                                                  256 // per, 16)
        at += size
    return out


def kquant_gemm(kind: str, x: torch.Tensor, blob: torch.Tensor, n: int,
                bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] float32 contiguous (K a multiple of 256) @ the layer `blob` holds, x rounded
    to int16 per 32 inputs -> [M, N]."""
    m, k = x.shape
    xq, xs, xsum = quantize_rows_q16(x)
    y = torch.empty(m, n, dtype=torch.float32)
    gemm = _library().tm_q6k_gemm if kind == "q6k" else _library().tm_q4k_gemm
    gemm(address(xq), address(xs), address(xsum), address(blob), address(bias), address(y),
         m, n, k)
    return y
