"""int8 K/V: each (token, head) row of D values stored as D int8 plus its float32 scale in the
same cache row (D + 4 bytes), so the cache keeps the one paged layout
[num_blocks, block_size, Hkv, D + 4] and a gather moves values and scales together."""

from __future__ import annotations

import torch

SCALE_BYTES = 4


def quantize_kv(x: torch.Tensor) -> torch.Tensor:
    """[..., D] float -> [..., D + 4] int8: symmetric per row, scale = absmax / 127."""
    scale = (x.abs().amax(-1, keepdim=True).float() / 127).clamp(min=1e-12)
    q = torch.round(x.float() / scale).clamp(-127, 127).to(torch.int8)
    return torch.cat([q, scale.view(torch.int8)], dim=-1)


def dequantize_kv(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., D + 4] int8 -> [..., D] in `dtype`."""
    scale = rows[..., -SCALE_BYTES:].contiguous().view(torch.float32)
    return (rows[..., :-SCALE_BYTES].to(torch.float32) * scale).to(dtype)


def row_bytes(head_dim: int, kv_dtype: torch.dtype) -> int:
    """Bytes of one (token, head) row of K or V in the cache."""
    if kv_dtype == torch.int8:
        return head_dim + SCALE_BYTES
    return head_dim * torch.empty((), dtype=kv_dtype).element_size()
