"""ctypes wrappers of vnni_panels.c: int8, int4 and fp4 weights as panels of 16 output channels
with input pairs interleaved, multiplied by int16 activations with `vpdpwssd` (the CPU's VNNI
instructions; a `vpmaddwd` build with the same results elsewhere). Re-exported by
`tokenmill.csrc`."""

from __future__ import annotations

import torch

from tokenmill.csrc.build import address
from tokenmill.csrc.build import loaded as _library

__all__ = ["vnni_native", "int8_to_vnni", "int8_from_vnni", "int4_to_vnni", "int4_from_vnni",
           "int8_vnni_rows", "int4_vnni_rows", "int8_vnni_gemm", "int4_vnni_gemm",
           "fp4_vnni_gemm", "fp4_experts"]


def quantize_rows_q16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] float32 contiguous (K % 32 == 0) -> (int16 [M, K], block scales [M, K/32],
    block sums of the dequantized values [M, K/32])."""
    m, k = x.shape
    xq = torch.empty(m, k, dtype=torch.int16)
    xs = torch.empty(m, k // 32)
    xsum = torch.empty(m, k // 32)
    _library().tm_quantize_rows_q16(address(x), address(xq), address(xs), address(xsum), m, k)
    return xq, xs, xsum


def vnni_native() -> bool:
    """Whether this build runs vnni_panels.c with VNNI instructions (AVX-512 VNNI), where its
    layouts are the fastest int8 / int4 kernels at every row count; elsewhere it is a
    portable equivalent that only the tests use."""
    return bool(_library().tm_vnni_native())


def int8_to_vnni(qweight: torch.Tensor, scale: torch.Tensor,
                 group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 [N, K] weight and its float32 [N, K // group] scales -> vnni_panels.c's panels
    ([ceil(N/16), K/2, 16, 2] int8) and panel scales ([ceil(N/16), K // group, 16])."""
    n, k = qweight.shape
    panels = -(-n // 16)
    wp = torch.empty(panels, k // 2, 16, 2, dtype=torch.int8)
    sp = torch.empty(panels, k // group, 16)
    _library().tm_int8_to_vnni(address(qweight), address(scale), n, k, group, address(wp),
                               address(sp))
    return wp, sp


def int8_from_vnni(wp: torch.Tensor, sp: torch.Tensor,
                   n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `int8_to_vnni`: the [N, K] weight and its [N, K // group] scales."""
    return _pairs_to_rows(wp, n).contiguous(), _from_panels(sp, n)


def int4_to_vnni(qweight: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor,
                 group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int4 weight (uint8 [N, K/2], Q4 layout) and its float16 [N, K // group] scales and mins
    -> panels ([ceil(N/16), K/2, 16] uint8: inputs 2j, 2j + 1 in the low, high nibble) and
    panel scales and mins ([ceil(N/16), K // group, 16] float16)."""
    n, k = qweight.shape[0], qweight.shape[1] * 2
    panels = -(-n // 16)
    wp = torch.empty(panels, k // 2, 16, dtype=torch.uint8)
    sp = torch.empty(panels, k // group, 16, dtype=torch.float16)
    mp = torch.empty_like(sp)
    _library().tm_int4_to_vnni(address(qweight), address(scale), address(mins), n, k, group,
                               address(wp), address(sp), address(mp))
    return wp, sp, mp


def int4_from_vnni(wp: torch.Tensor, sp: torch.Tensor, mp: torch.Tensor,
                   n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of `int4_to_vnni`: the Q4-layout weight, its scales and mins."""
    from tokenmill.quantization.schemes import pack_int4

    pairs = _pairs_to_rows(torch.stack([wp & 15, wp >> 4], dim=-1), n)
    return pack_int4(pairs), _from_panels(sp, n), _from_panels(mp, n)


def int8_vnni_rows(wp: torch.Tensor, sp: torch.Tensor,
                   ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows `ids` of `int8_from_vnni`'s weight and scales, read from the panels (an embedding
    lookup in a tied LM head)."""
    panel, lane = ids // 16, ids % 16
    return wp[panel, :, lane].reshape(len(ids), -1), sp[panel, :, lane]


def int4_vnni_rows(wp: torch.Tensor, sp: torch.Tensor, mp: torch.Tensor,
                   ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows `ids` of the int4 weight as values 0..15 [T, K] (not packed), scales and mins."""
    panel, lane = ids // 16, ids % 16
    pairs = wp[panel, :, lane]  # [T, K/2]: inputs 2j, 2j + 1 in the low, high nibble
    return (torch.stack([pairs & 15, pairs >> 4], dim=-1).reshape(len(ids), -1),
            sp[panel, :, lane], mp[panel, :, lane])


def _pairs_to_rows(pairs: torch.Tensor, n: int) -> torch.Tensor:
    """[P, K/2, 16, 2] input pairs of each panel's channels -> the [N, K] rows (a view)"""
    panels, half_k = pairs.shape[:2]
    return pairs.permute(0, 2, 1, 3).reshape(panels * 16, half_k * 2)[:n]


def _from_panels(per_panel: torch.Tensor, n: int) -> torch.Tensor:
    """[P, groups, 16] panel factors -> [N, groups]"""
    panels, groups = per_panel.shape[:2]
    return per_panel.permute(0, 2, 1).reshape(panels * 16, groups)[:n].contiguous()


def int8_vnni_gemm(x: torch.Tensor, wp: torch.Tensor, sp: torch.Tensor, n: int,
                   bias: torch.Tensor | None, group: int) -> torch.Tensor:
    """x [M, K] float32 contiguous (K, group multiples of 32) @ the weight `int8_to_vnni`
    laid out, with x rounded to int16 per 32 inputs -> [M, N]."""
    m, k = x.shape
    xq, xs, _ = quantize_rows_q16(x)
    y = torch.empty(m, n, dtype=torch.float32)
    _library().tm_int8_vnni_gemm(address(xq), address(xs), address(wp), address(sp),
                                 address(bias), address(y), m, n, k, group)
    return y


def int4_vnni_gemm(x: torch.Tensor, wp: torch.Tensor, sp: torch.Tensor, mp: torch.Tensor,
                   n: int, bias: torch.Tensor | None, group: int) -> torch.Tensor:
    """As `int8_vnni_gemm`, for the weight `int4_to_vnni` laid out."""
    m, k = x.shape
    xq, xs, xsum = quantize_rows_q16(x)
    y = torch.empty(m, n, dtype=torch.float32)
    _library().tm_int4_vnni_gemm(address(xq), address(xs), address(xsum), address(wp),
                                 address(sp), address(mp), address(bias), address(y), m, n, k,
                                 group)
    return y


def fp4_vnni_gemm(x: torch.Tensor, wp: torch.Tensor, sp: torch.Tensor, n: int,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """As `int8_vnni_gemm`, for E2M1 codes in int4's panels ([ceil(N/16), K/2, 16] uint8)
    with bfloat16 scales per 32 inputs ([ceil(N/16), K/32, 16]; quantization/mxfp4.py)."""
    m, k = x.shape
    xq, xs, _ = quantize_rows_q16(x)
    y = torch.empty(m, n, dtype=torch.float32)
    _library().tm_fp4_vnni_gemm(address(xq), address(xs), address(wp), address(sp),
                                address(bias), address(y), m, n, k)
    return y


def fp4_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, parts: torch.Tensor,
                intermediate: int, alpha: float, limit: float) -> torch.Tensor:
    """A mixture-of-experts layer's routed experts over fp4 panels with gpt-oss' clamped
    SwiGLU (fp4_experts.c): x [M, H] float32 contiguous, ids int64 / weights float32
    [M, top_k] contiguous, parts int64 [E, 9] (each expert's gate, up and down panels, panel
    scales and bias addresses, 0 for none; the tensors kept alive by the caller) -> [M, H]."""
    m, h = x.shape
    out = torch.empty(m, h, dtype=torch.float32)
    _library().tm_fp4_experts(address(x), m, h, intermediate, ids.shape[1], address(ids),
                              address(weights), parts.shape[0], address(parts), alpha, limit,
                              address(out))
    return out
