"""The Triton kernels of triton_ops.py (imported only when a GPU tensor needs them)."""

import triton
import triton.language as tl


@triton.jit
def add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, n, eps, stride_x, stride_r, stride_o,
                  HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RES:  # the sum, rounded to the stream's dtype, is the new residual
        x = (x.to(tl.float32) + tl.load(res_ptr + row * stride_r + cols, mask=ok,
                                        other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(res_ptr + row * stride_r + cols, x, mask=ok)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    y = (xf * rstd).to(x.dtype).to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=ok)

@triton.jit
def rotary_kernel(x_ptr, cos_ptr, sin_ptr, pos_ptr, out_ptr, stride_xt, stride_xh, stride_c,
            D, HALF, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK)
    ok = d < D
    pos = tl.load(pos_ptr + t)
    src = x_ptr + t * stride_xt + h * stride_xh
    x = tl.load(src + d, mask=ok, other=0.0)
    rolled = tl.load(src + (d + HALF) % D, mask=ok, other=0.0)
    dt = x.dtype
    cos = tl.load(cos_ptr + pos * stride_c + d, mask=ok, other=0.0).to(dt)
    sin = tl.load(sin_ptr + pos * stride_c + d, mask=ok, other=0.0).to(dt)
    y = ((x * cos).to(dt) + (rolled * sin).to(dt)).to(dt)
    tl.store(out_ptr + (t * tl.num_programs(1) + h) * D + d, y, mask=ok)

@triton.jit
def gated_kernel(x_ptr, out_ptr, n, stride_x, stride_o, GELU: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n + cols, mask=ok, other=0.0)
    g = gate.to(tl.float32)
    if GELU:  # 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3)))
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        act = 0.5 * g * (2.0 * tl.sigmoid(2.0 * z))
    else:
        act = g * tl.sigmoid(g)
    y = act.to(gate.dtype).to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def grouped_matmul_kernel(a_ptr, w_ptr, scale_ptr, min_ptr, out_ptr, slots_ptr, expert_ptr,
                          weights_ptr, rows, a_per_slot, N, K, groups, group, stride_a,
                          stride_we, stride_wn, stride_se, stride_o, QUANT: tl.constexpr,
                          HAS_WEIGHTS: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          PRECISION: tl.constexpr):
    """One block of BLOCK_M (token, expert) slots, all of one expert, times BLOCK_N of its
    output columns (fused_moe.py). QUANT 0: float weights; 8: int8 or float8 with a scale per
    group of `group` inputs; 4: int4 in the Q4 layout (byte j of a 32-input block: input j
    low nibble, j + 16 high) with a scale and a min per group. Dequantized in registers."""
    b = tl.program_id(0)
    expert = tl.load(expert_ptr + b)
    if expert >= 0:
        m = b * BLOCK_M + tl.arange(0, BLOCK_M)
        slot = tl.load(slots_ptr + m)
        ok = slot < rows
        a_row = tl.where(ok, slot // a_per_slot, 0)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        kk = tl.arange(0, BLOCK_K)
        w = w_ptr + expert.to(tl.int64) * stride_we
        se = expert.to(tl.int64) * stride_se + n * groups  # each column's first scale
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = k0 + kk < K
            a = tl.load(a_ptr + a_row[:, None].to(tl.int64) * stride_a + (k0 + kk)[None, :],
                        mask=ok[:, None] & k_ok[None, :], other=0.0)
            if QUANT == 4:
                byte = tl.load(w + n[None, :].to(tl.int64) * stride_wn
                               + (k0 // 2 + kk % 16)[:, None], mask=n_ok[None, :], other=0)
                q = tl.where((kk >= 16)[:, None], byte >> 4, byte & 0x0F).to(tl.float32)
            else:
                w_ok = n_ok[None, :] & k_ok[:, None]
                # (no `other`: Triton's interpreter cannot fill a float8 load with it)
                q = tl.load(w + n[None, :].to(tl.int64) * stride_wn + (k0 + kk)[:, None],
                            mask=w_ok)
                q = tl.where(w_ok, q.to(tl.float32), 0.0)
            if QUANT == 0:
                wt = q.to(a.dtype)
            else:
                g = k0 // group
                scale = tl.load(scale_ptr + se + g, mask=n_ok, other=0.0).to(tl.float32)
                wt = q.to(tl.float32) * scale[None, :]
                if QUANT == 4:
                    low = tl.load(min_ptr + se + g, mask=n_ok, other=0.0).to(tl.float32)
                    wt = wt + low[None, :]
                wt = wt.to(a.dtype)
            acc += tl.dot(a, wt, input_precision=PRECISION)
        if HAS_WEIGHTS:
            acc *= tl.load(weights_ptr + slot, mask=ok, other=0.0)[:, None]
        tl.store(out_ptr + slot[:, None].to(tl.int64) * stride_o + n[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=ok[:, None] & n_ok[None, :])
