"""The arithmetic of each quantization scheme, in plain torch on any device: quantize a weight,
dequantize it back, quantize activations. Kernels (`linear_kernels.py`) store what these return;
their fallback path and the tests use the dequantizers as the definition of the numbers.
`QuantizedShard`: a checkpoint weight that arrives already in one of these forms."""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT4_BLOCK = 32  # the Q4 layout packs 32 inputs into 16 bytes; groups are multiples of it
FP8_MAX = 448.0  # largest finite float8_e4m3fn
_TINY = 1e-12


def _grouped(w: torch.Tensor, group: int) -> torch.Tensor:
    n, k = w.shape
    if k % group:
        raise ValueError(f"group size {group} does not divide the input size {k}")
    return w.reshape(n, k // group, group)


def quantize_int8(w: torch.Tensor, group: int | None = None,
                  row_absmax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel (group None) or per `group` inputs.
    Returns q int8 [N, K] and scale float32 [N, K // group]. `row_absmax` [N]: per-channel
    scales from the whole rows' absolute maxima, where `w` is one tensor-parallel rank's
    slice of the inputs (every rank then uses the scales one rank would)."""
    group = group or w.shape[1]
    wg = _grouped(w.float(), group)
    absmax = wg.abs().amax(-1)
    if row_absmax is not None and group == w.shape[1]:
        absmax = row_absmax.float().reshape(absmax.shape)
    scale = absmax.clamp(min=_TINY) / 127
    q = torch.round(wg / scale[..., None]).clamp(-127, 127).to(torch.int8)
    return q.reshape(w.shape), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    group = q.shape[1] // scale.shape[1]
    return (_grouped(q.float(), group) * scale[..., None].float()).reshape(q.shape)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q in 0..15, [N, K] -> uint8 [N, K // 2] in GGUF's Q4 layout: per 32 inputs, byte j holds
    input j in its low nibble and input j + 16 in its high nibble."""
    n, k = q.shape
    blocks = q.to(torch.uint8).reshape(n, k // INT4_BLOCK, 2, INT4_BLOCK // 2)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    n, half = packed.shape
    blocks = packed.reshape(n, half // (INT4_BLOCK // 2), 1, INT4_BLOCK // 2)
    return torch.cat([blocks & 0x0F, blocks >> 4], dim=2).reshape(n, half * 2)


def quantize_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, ...]:
    """Asymmetric 4-bit per `group` inputs: w ~ q * scale + min, q in 0..15 (GGUF Q4_1's
    scheme). Returns packed uint8 [N, K // 2], scale and min float16 [N, K // group]."""
    if group % INT4_BLOCK:
        raise ValueError(f"int4 group size must be a multiple of {INT4_BLOCK}, got {group}")
    wg = _grouped(w.float(), group)
    low, high = wg.amin(-1), wg.amax(-1)
    # Round the parameters to float16 first: q is chosen against the values the kernel reads.
    scale = ((high - low) / 15).clamp(min=1e-7).half()
    low16 = low.half()
    q = torch.round((wg - low16.float()[..., None]) / scale.float()[..., None]).clamp(0, 15)
    return pack_int4(q.reshape(w.shape)), scale, low16


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor
                    ) -> torch.Tensor:
    return dequantize_int4_values(unpack_int4(packed), scale, mins)


def dequantize_int4_values(q: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor
                           ) -> torch.Tensor:
    """`dequantize_int4` of unpacked values q [N, K] in 0..15."""
    q = q.float()
    group = q.shape[1] // scale.shape[1]
    wg = _grouped(q, group) * scale.float()[..., None] + mins.float()[..., None]
    return wg.reshape(q.shape)


# the largest activation integer the K-quant kernels take: 256 hi + lo with both int8
SPLIT_TOP = 127 * 256 + 127


def fake_quantize_blocks(x: torch.Tensor, bits: int = 16, top: int | None = None) -> torch.Tensor:
    """x [..., K] (K % 32 == 0) rounded as the compiled CPU kernels' integer-dot activations
    are: per 32 inputs, symmetric integers up to `top` (default 2^(bits-1) - 1: the int16
    kernels; SPLIT_TOP: the K-quant kernels' two int8 halves) with scale absmax / top, ties
    to even (bits=8 is llama.cpp's Q8_0 activations), returned dequantized in float32."""
    top = float(2 ** (bits - 1) - 1 if top is None else top)
    blocks = x.float().reshape(*x.shape[:-1], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax != 0, top / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inverse) * (amax / top)).reshape(x.shape)


def quantize_fp8(w: torch.Tensor, per_channel: bool = True,
                 row_absmax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """float8 e4m3 with a float32 scale per output channel ([N]) or per tensor ([1]);
    `row_absmax` as for `quantize_int8`."""
    w = w.float()
    rows = w.abs().amax(1) if row_absmax is None else row_absmax.float()
    absmax = rows if per_channel else rows.amax().reshape(1)
    scale = absmax.clamp(min=_TINY) / FP8_MAX
    q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[:, None]


def fake_quantize_fp8(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """x rounded through float8 e4m3 with a per-tensor scale (None: dynamic, from x)."""
    if scale is None:
        scale = x.abs().amax().clamp(min=_TINY) / FP8_MAX
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(x.dtype) * scale


# Activations use 7 of uint8's 8 bits: x86 int8 GEMMs without VNNI (AVX2's vpmaddubsw) add
# pairs of u8 x s8 products in int16, which saturates with full-range inputs (fbgemm's
# `reduce_range`). Measured: 8-bit activations turned the default model's output to nonsense.
ACT_LEVELS = 127


def uint8_activation_params(low: torch.Tensor, high: torch.Tensor) -> tuple[float, int]:
    """Per-tensor asymmetric parameters covering [low, high] and zero in 0..ACT_LEVELS,
    computed as fbgemm's dynamic quantization does (float32 scale, zero point from the end
    with the smaller error, rounded half to even), so the emulation matches it exactly."""
    low, high = float(min(low, 0.0)), float(max(high, 0.0))
    scale = float(torch.tensor((high - low) / ACT_LEVELS, dtype=torch.float32))
    if scale == 0.0:
        return 1.0, 0
    from_low, from_high = -low / scale, ACT_LEVELS - high / scale
    zero = from_low if abs(low / scale) < ACT_LEVELS + abs(high / scale) else from_high
    return scale, int(min(max(round(zero), 0), ACT_LEVELS))


def row_scales(x: torch.Tensor) -> torch.Tensor:
    """Per-row max |x| ([T, 1], never 0): dividing by it puts every token in [-1, 1]."""
    return x.abs().amax(-1, keepdim=True).clamp(min=_TINY)


def quantize_uint8(x: torch.Tensor, scale: float, zero_point: int,
                   upper: int = 255) -> torch.Tensor:
    """x -> q (as float) the way fbgemm's quantizer does it: x * (1 / scale) + zero point in
    float32, rounded to the nearest integer (ties to even), clamped to 0..upper. Dynamic
    ranges put x within 0..ACT_LEVELS + 1 by construction; static ones clamp at
    ACT_LEVELS (inputs beyond the calibrated range must not reach int16 saturation)."""
    inverse = torch.tensor(1.0, dtype=torch.float32) / scale
    return torch.clamp(torch.round(x.float() * inverse + zero_point), 0, upper)


def fake_quantize_uint8(x: torch.Tensor, scale: float, zero_point: int,
                        upper: int = 255) -> torch.Tensor:
    return (quantize_uint8(x, scale, zero_point, upper) - zero_point) * scale


def smoothing_factors(act_absmax: torch.Tensor, weight: torch.Tensor,
                      alpha: float = 0.5) -> torch.Tensor:
    """SmoothQuant: per input channel s = max|X|^a / max|W|^(1-a). The layer computes
    (X / s) @ (W * s)^T, moving activation outliers into the weights, where per-channel int8
    absorbs them. Returns s (float32 [K])."""
    w_absmax = weight.float().abs().amax(0).clamp(min=1e-5)
    s = act_absmax.float().clamp(min=1e-5).pow(alpha) / w_absmax.pow(1 - alpha)
    return s.clamp(min=1e-5)


@dataclass
class QuantizedShard:
    """One checkpoint weight kept in its quantized form (GGUF Q8_0 / Q4_0 / Q4_1), rows =
    output channels, so the shards of a merged layer concatenate."""

    method: str  # "int8" or "int4"
    tensors: dict[str, torch.Tensor]
