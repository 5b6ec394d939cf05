"""Weight-only int8 / int4 / float8 matrix multiply for GPUs in Triton: each program loads a
tile of quantized weights, dequantizes it in registers (scale, and min for int4) and
multiplies with `tl.dot` in the activations' dtype, accumulating in float32, so weights cross
memory at 1 or 1/2 byte each. Same tensors and layouts as the CPU kernels (int4: GGUF's Q4
layout; float8 e4m3: a scale per group of inputs, fp8_blocks.py). Float8 weights are read by
the card's own conversion where it has one (compute capability >= 8.9), else as bytes
decoded by `fp8_e4m3_values` (Triton has no float8 e4m3 before that: A100s).
Tested on the CPU with TRITON_INTERPRET=1; its speed needs a GPU run."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_K = 32  # one int4 block of the Q4 layout; every group size is a multiple of it
# how a kernel reads float8 weights: the card's conversion, or bytes decoded in registers
FP8_NATIVE, FP8_BYTES = 1, 2


def fp8_mode(device: torch.device) -> int:
    """FP8_NATIVE where Triton has float8 e4m3 (CUDA compute capability >= 8.9, and its
    interpreter), else FP8_BYTES."""
    if device.type != "cuda":
        return FP8_NATIVE
    return FP8_NATIVE if torch.cuda.get_device_capability(device) >= (8, 9) else FP8_BYTES


def fp8_weights(w: torch.Tensor, mode: int) -> torch.Tensor:
    """What a kernel is handed for float8 weights `w` read in `mode`."""
    return w.view(torch.uint8) if mode == FP8_BYTES else w


@triton.jit
def fp8_e4m3_values(byte):
    """float32 values of float8 e4m3fn bytes (uint8), without float8 arithmetic: sign,
    exponent and mantissa placed in a float16's fields, times 2^8 (the two formats' exponent
    biases, 15 and 7, apart); exact for every finite value and for subnormals (NaN bytes,
    which weights do not hold, come out as +-480)."""
    b = byte.to(tl.int32)
    bits = (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.int16)
    return bits.to(tl.float16, bitcast=True).to(tl.float32) * 256.0


@triton.jit
def _weight_only_matmul(x_ptr, w_ptr, scale_ptr, min_ptr, bias_ptr, y_ptr, M, N, K, groups,
                        group, stride_xm, stride_wn, stride_ym, INT4: tl.constexpr,
                        FP8: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_j = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + offs_j
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None], other=0.0)
        if INT4:
            # byte j % 16 of this 32-input block: input j in the low nibble, j + 16 high
            byte = tl.load(w_ptr + offs_n[None, :] * stride_wn + (k0 // 2 + offs_j % 16)[:, None],
                           mask=n_mask[None, :], other=0)
            q = tl.where((offs_j >= 16)[:, None], byte >> 4, byte & 0x0F).to(tl.float32)
        elif FP8 == 2:  # (FP8_BYTES)
            q = fp8_e4m3_values(tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None],
                                        mask=n_mask[None, :], other=0))
        elif FP8 == 1:  # (FP8_NATIVE; no `other`: the interpreter cannot fill float8 with it)
            q = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None],
                        mask=n_mask[None, :])
            q = tl.where(n_mask[None, :], q.to(tl.float32), 0.0)
        else:
            q = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None],
                        mask=n_mask[None, :], other=0).to(tl.float32)
        g = k0 // group
        scale = tl.load(scale_ptr + offs_n * groups + g, mask=n_mask, other=0.0).to(tl.float32)
        w = q * scale[None, :]
        if INT4:
            low = tl.load(min_ptr + offs_n * groups + g, mask=n_mask, other=0.0).to(tl.float32)
            w = w + low[None, :]
        acc += tl.dot(x, w.to(x.dtype), input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def weight_only_matmul(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                       mins: torch.Tensor | None, bias: torch.Tensor | None,
                       group: int, fp8: int | None = None) -> torch.Tensor:
    """y = x @ dequant(W)^T (+ bias). int4 when `mins` is given (qweight uint8 [N, K/2]),
    else int8 or float8 e4m3 (qweight [N, K]; float8 read as `fp8` says, default
    `fp8_mode`); scale (and mins) [N, K // group]."""
    fp8_read = 0
    if qweight.dtype == torch.float8_e4m3fn:
        fp8_read = fp8 or fp8_mode(qweight.device)
        qweight = fp8_weights(qweight, fp8_read)
    x = x.contiguous()
    m, k = x.shape
    n = qweight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else 64
    block_n = 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _weight_only_matmul[grid](
        x, qweight, scale, mins if mins is not None else scale,
        bias if bias is not None else scale, y, m, n, k, k // group, group, x.stride(0),
        qweight.stride(0), y.stride(0), INT4=mins is not None, FP8=fp8_read,
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK_K,
        # float32 activations: TF32 only where torch's own matmuls would use it
        PRECISION="tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee")
    return y
