"""tokenmill's compiled CPU kernels (the `.c` files beside this module): built once per machine
with the system C compiler into one cached library, then called through ctypes on tensors'
memory.

- `gemm.c`: int8 / int4 weight-only matmul. torch's own (`_weight_int8pack_mm`,
  `_weight_int4pack_mm_for_cpu`) are 2.6x / 5x slower than fp32 on AVX2 CPUs (bench/NOTES.md).
- `f32_panel.c`: fp32 matmul over oneDNN's packed weight panels, any row count (AVX2 tiles, or
  AVX-512 tiles where the CPU has it: the build is `-march=native`).
- `bf16_panel.c`: bf16 weights in panels of the same shape, times fp32 activations rounded
  to bf16 (`vdpbf16ps` on AVX512-BF16 CPUs, widened to fp32 elsewhere); `panel_gemm.c`
  shares the threads' schedule of both panel kernels out (`panel.h`).
- `dequant_panels.c`: int8 / int4 weights unpacked into those panels, so prompt-sized
  matmuls of quantized layers run the fp32 panel kernel.
- `vnni_panels.c`: int8 / int4 / fp4 (MXFP4 codes) weights in panels of 16 channels times
  int16 activations with `vpdpwssd` (AVX-512 VNNI CPUs: their kernel at every row count,
  ~1.6x the fp32 panels); the tile kernel itself is in `vnni_tile.h`.
- `fp4_experts.c`: a mixture-of-experts layer's fp4 experts (gpt-oss' MXFP4) in one call:
  both products of every active expert, the clamped SwiGLU and the weighted sum.
- `kquant_panels.c`: GGUF Q4_K / Q6_K / Q5_0 / Q5_1 weights in such panels at about their
  stored size (the K-quants' byte scales and per-256 factors kept, high bits in planes of
  their own), times activations split into two int8 halves with byte dot products
  (`vpdpbusd`, `vpmaddubsw`).
- `paged_attention.c`: decode attention reading the paged KV cache in place, where torch ops
  must gather a padded copy of every sequence's K/V first.
- `prompt_attention.c`: causal prompt attention (fresh or with cached context) over the
  paged cache in place, flash-attention style (1.4-1.8x torch's CPU SDPA on 128-token
  prompts; chunks with context need no gather).
- `layer_ops.c`: RMSNorm with its residual add, rotary, SiLU-and-multiply, the K/V cache
  write, the greedy argmax, each one call instead of several torch ops (dispatch dominates at
  decode sizes).
- `shm_allreduce.c`: the sum over tensor-parallel ranks of one node through shared memory
  (gloo's TCP all-reduce took ~1.5 ms per call here, even for one row).
- `decode_step.c`: all decoder layers of a decode step in one call over the kernels above
  (`kernels.h`), so the per-layer Python and ctypes work of the small kernels disappears.

`build.py` compiles and loads the library. The ctypes wrappers of the attention kernels and
`layer_ops.c` are in `layer_kernels.py`, those of `vnni_panels.c` and `fp4_experts.c` in
`vnni.py`, those of `kquant_panels.c` in `kquant.py`, those of `bf16_panel.c` in `bf16.py`;
this module re-exports them.

Plain C files need no torch headers (they build in about a second). Without a compiler, or
without AVX2/FMA/F16C, `available()` is False and callers use their torch paths."""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch

from tokenmill.csrc.build import address
from tokenmill.csrc.build import loaded as _library
from tokenmill.csrc.vnni import quantize_rows_q16


def library() -> ctypes.CDLL:
    """The loaded kernels (call only when `available()`)."""
    return _library()


def available() -> bool:
    return _library() is not None


def int8_gemm(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
              bias: torch.Tensor | None, group: int) -> torch.Tensor:
    """x [M, K] float32 contiguous; qweight int8 [N, K]; scale float32 [N, K // group]."""
    m, k = x.shape
    n = qweight.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    _library().tm_int8_gemm(address(x), address(qweight), address(scale), address(bias), address(y),
                            m, n, k, group)
    return y


def int4_gemm(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor,
              bias: torch.Tensor | None, group: int) -> torch.Tensor:
    """x [M, K] float32 contiguous; qweight uint8 [N, K // 2] (Q4 layout); scale, mins float16
    [N, K // group]."""
    m, k = x.shape
    n = qweight.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    _library().tm_int4_gemm(address(x), address(qweight), address(scale), address(mins),
                            address(bias), address(y), m, n, k, group)
    return y


def int8_gemm_int_dot(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                      bias: torch.Tensor | None, group: int) -> torch.Tensor:
    """As `int8_gemm`, with x rounded to int16 per 32 inputs first (integer dot products);
    group a multiple of 32."""
    m, k = x.shape
    n = qweight.shape[0]
    xq, xs, _ = quantize_rows_q16(x)
    y = torch.empty(m, n, dtype=torch.float32)
    _library().tm_int8_gemm_q16(address(xq), address(xs), address(qweight), address(scale),
                                address(bias), address(y), m, n, k, group)
    return y


def int4_gemm_int_dot(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                      mins: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """As `int4_gemm` with group 32, x rounded to int16 per 32 inputs first."""
    m, k = x.shape
    n = qweight.shape[0]
    xq, xs, xsum = quantize_rows_q16(x)
    y = torch.empty(m, n, dtype=torch.float32)
    _library().tm_int4_gemm_q16(address(xq), address(xs), address(xsum), address(qweight),
                                address(scale), address(mins), address(bias), address(y),
                                m, n, k)
    return y


class LinearForm(NamedTuple):
    """How the compiled decode step multiplies by one linear layer (decode_step.c's tm_linear):
    which kernel, its integer parameter (F32_PANEL, BF16_PANEL: the padded K; int8 / int4:
    the group; KQUANT: which K-quant, kquant.KQUANT_KINDS), the most rows it is the fastest
    kernel for, and the addresses of the weight tensors, which the layer's kernel keeps
    alive."""

    kind: int
    param: int
    max_rows: int
    weight: int
    scale: int | None = None
    min: int | None = None


# decode_step.c's kernel kinds
F32_PANEL, INT8, INT8_Q16, INT4, INT4_Q16, INT8_VNNI, INT4_VNNI, KQUANT, PARTS, BF16_PANEL = \
    range(10)


def f32_panel_stride(packed: torch.Tensor, n: int, k: int) -> int | None:
    """KP, the padded input length of a weight packed by `torch.ops.mkldnn._reorder_linear_weight`
    if its bytes fit the [N/64][KP][64] panel layout (what oneDNN picks on AVX2), else None.
    The byte count cannot prove the layout: callers compare one product with oneDNN's."""
    panels = -(-n // 64)
    floats = torch.ops.mkldnn._nbytes(packed) // 4
    if floats % (panels * 64):
        return None
    kp = floats // (panels * 64)
    return kp if k <= kp < k + 64 else None


def f32_panel_gemm(x: torch.Tensor, packed: torch.Tensor, kp: int, n: int,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] float32 contiguous @ the packed [N, K] weight (panel layout, see
    `f32_panel_stride`) -> [M, N]."""
    return _panel_gemm(x, torch.ops.mkldnn.data_ptr(packed), kp, n, bias)


def _panel_gemm(x: torch.Tensor, panels: int, kp: int, n: int,
                bias: torch.Tensor | None) -> torch.Tensor:
    m, k = x.shape
    y = torch.empty(m, n, dtype=torch.float32)
    _library().tm_f32_panel_gemm(address(x), panels, address(bias), address(y), m, n, k, kp)
    return y


def f32_panel_glu(x: torch.Tensor, packed: torch.Tensor, kp: int, inter: int,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """silu(x @ gate^T) * (x @ up^T) for x [M, K] float32 contiguous and a merged gate|up
    weight of 2 * inter channels packed as for `f32_panel_gemm` (inter a multiple of 64):
    bitwise `silu_and_mul(f32_panel_gemm(...))` without the [M, 2 * inter] product -> [M, inter]."""
    m, k = x.shape
    act = torch.empty(m, inter, dtype=torch.float32)
    if _library().tm_f32_panel_glu(address(x), torch.ops.mkldnn.data_ptr(packed), address(bias),
                                   address(act), m, inter, k, kp):
        raise ValueError(f"intermediate size {inter} is not a multiple of 64")
    return act


def _panel_buffer(n: int, k: int) -> torch.Tensor:
    """Room for a dequantized [N/64][K][64] weight, for one call (a kept fp32 copy would undo
    the quantization; below glibc's mmap threshold, which the model runner raises to 32 MB,
    the heap hands the same memory back call after call)."""
    return torch.empty(-(-n // 64) * 64 * k, dtype=torch.float32)


def int8_panel_gemm(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                    bias: torch.Tensor | None, group: int) -> torch.Tensor:
    """As `int8_gemm`, for many rows: the weight dequantized into fp32 panels, then the fp32
    panel kernel (the same sums as dequantize() @ x in k order)."""
    n, k = qweight.shape
    panels = _panel_buffer(n, k)
    _library().tm_int8_to_panels(address(qweight), address(scale), n, k, group,
                                 address(panels))
    return _panel_gemm(x, address(panels), k, n, bias)


def int4_panel_gemm(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                    mins: torch.Tensor, bias: torch.Tensor | None, group: int) -> torch.Tensor:
    """As `int4_gemm`, for many rows (see `int8_panel_gemm`)."""
    n, k = qweight.shape[0], qweight.shape[1] * 2
    panels = _panel_buffer(n, k)
    _library().tm_int4_to_panels(address(qweight), address(scale), address(mins), n, k, group,
                                 address(panels))
    return _panel_gemm(x, address(panels), k, n, bias)


def usable(x: torch.Tensor) -> bool:
    """Whether the compiled kernels can take this activation (float32 on the CPU)."""
    return x.dtype == torch.float32 and x.device.type == "cpu" and available()


# The wrappers of vnni_panels.c and of the per-layer kernels live in their own modules;
# re-exported here (after the helpers they use) so callers keep writing csrc.<name>.
from tokenmill.csrc.bf16 import *  # noqa: E402, F403
from tokenmill.csrc.kquant import *  # noqa: E402, F403
from tokenmill.csrc.layer_kernels import *  # noqa: E402, F403
from tokenmill.csrc.vnni import *  # noqa: E402, F403
