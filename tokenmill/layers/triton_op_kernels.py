"""The Triton kernels of triton_ops.py (imported only when a GPU tensor needs them)."""

import triton
import triton.language as tl

from tokenmill.quantization.triton_kernels import fp8_e4m3_values


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
def rotate_row(src, cos_ptr, sin_ptr, pos, stride_c, d, ok, D, HALF):
    """One head's row at `src` rotated to position `pos` (x * cos + roll(x) * signed_sin in
    x's dtype, as rotary.py); masked lanes 0. Also used by the attention's fused K/V write."""
    x = tl.load(src + d, mask=ok, other=0.0)
    rolled = tl.load(src + (d + HALF) % D, mask=ok, other=0.0)
    dt = x.dtype
    cos = tl.load(cos_ptr + pos * stride_c + d, mask=ok, other=0.0).to(dt)
    sin = tl.load(sin_ptr + pos * stride_c + d, mask=ok, other=0.0).to(dt)
    return ((x * cos).to(dt) + (rolled * sin).to(dt)).to(dt)


@triton.jit
def rotary_kernel(x_ptr, cos_ptr, sin_ptr, pos_ptr, out_ptr, stride_xt, stride_xh, stride_c,
            D, HALF, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK)
    ok = d < D
    y = rotate_row(x_ptr + t * stride_xt + h * stride_xh, cos_ptr, sin_ptr,
                   tl.load(pos_ptr + t), stride_c, d, ok, D, HALF)
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
    group of `group` inputs; 9: the same float8 read as bytes (cards without float8 in
    Triton); 4: int4 in the Q4 layout (byte j of a 32-input block: input j low nibble, j + 16
    high) with a scale and a min per group. Dequantized in registers."""
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
            elif QUANT == 9:
                w_ok = n_ok[None, :] & k_ok[:, None]
                q = fp8_e4m3_values(tl.load(w + n[None, :].to(tl.int64) * stride_wn
                                            + (k0 + kk)[:, None], mask=w_ok, other=0))
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


@triton.jit
def _skinny_products(x_ptr, w_rows, rows, row_ok, col_ok, k_lo, k_hi, stride_xm,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_M, BLOCK_N] float32 sums over inputs k_lo..k_hi of x's rows times the weight
    rows at `w_rows`. BLOCK_M 1: products accumulated elementwise, summed once at the end
    (no tensor cores for one row); 16: tl.dot."""
    if BLOCK_M == 1:
        part = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < k_hi
            w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_ptr + ks, mask=k_ok, other=0.0)
            part += w.to(tl.float32) * x.to(tl.float32)[None, :]
        acc = tl.sum(part, 1)[None, :]
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < k_hi
            w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            acc += tl.dot(x, tl.trans(w))
    return acc


@triton.jit
def skinny_linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, per_split, stride_xm, stride_wn,
                         stride_ym, HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr,
                         GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    """y[:M, cols] (+)= x[:M, ks] @ w[cols, ks]^T (+ bias) for one block of BLOCK_N output
    columns and one range of `per_split` inputs (ATOMIC: ranges summed into a float32 y).
    GATED: w = [gate | up] (2N rows) and y = silu(gate product) * (up product), rounded as
    the gated kernel rounds the two products' outputs (the [M, 2N] product never stored)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    col_ok = cols < N
    row_ok = rows < M
    k_lo = tl.program_id(1) * per_split
    k_hi = tl.minimum(k_lo + per_split, K)
    acc = _skinny_products(x_ptr, w_ptr + cols[:, None].to(tl.int64) * stride_wn, rows, row_ok,
                           col_ok, k_lo, k_hi, stride_xm, BLOCK_M, BLOCK_N, BLOCK_K)
    if HAS_BIAS:
        b = tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        if ATOMIC:  # added by the first K range only
            b = b * (tl.program_id(1) == 0).to(tl.float32)
        acc += b[None, :]
    if GATED:
        up = _skinny_products(x_ptr, w_ptr + (cols + N)[:, None].to(tl.int64) * stride_wn,
                              rows, row_ok, col_ok, k_lo, k_hi, stride_xm, BLOCK_M, BLOCK_N,
                              BLOCK_K)
        if HAS_BIAS:
            up += tl.load(b_ptr + N + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        dt = y_ptr.dtype.element_ty
        gate = acc.to(dt).to(tl.float32)
        acc = (gate * tl.sigmoid(gate)).to(dt).to(tl.float32) * up.to(dt).to(tl.float32)
    out = y_ptr + rows[:, None] * stride_ym + cols[None, :]
    ok = row_ok[:, None] & col_ok[None, :]
    if ATOMIC:
        tl.atomic_add(out, acc, mask=ok)
    else:
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=ok)


# The engine's settings (BLOCK_N, BLOCK_K, warps) of skinny_linear_kernel, one set per row
# shape, each layer shape timed once on its first call, outside any CUDA-graph capture
# (layers/skinny.py). One row: narrow column blocks so that even 896 outputs make 56-224
# programs; 2-16 rows: tl.dot needs 16 columns at least.
ONE_ROW_SETTINGS = [(4, 512, 4), (8, 256, 4), (8, 512, 4), (16, 256, 4), (16, 512, 8)]
ROWS_SETTINGS = [(16, 128, 4), (16, 256, 4), (32, 128, 4), (32, 256, 4), (64, 128, 4)]


def _quick_bench(fn, quantiles):
    # replayed in a CUDA graph, as decode steps run: timed launch by launch, a few-microsecond
    # kernel would measure the host's launch cost, the same for every setting
    return triton.testing.do_bench_cudagraph(fn, rep=10, quantiles=quantiles)


def _autotuned(settings):
    configs = [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w) for n, k, w in settings]
    key = ["N", "K", "HAS_BIAS", "GATED"]
    try:
        return triton.autotune(configs, key=key, do_bench=_quick_bench)(skinny_linear_kernel)
    except TypeError:  # an older Triton without `do_bench`: its default timing
        return triton.autotune(configs, key=key)(skinny_linear_kernel)


skinny_one_row = _autotuned(ONE_ROW_SETTINGS)
skinny_rows = _autotuned(ROWS_SETTINGS)
