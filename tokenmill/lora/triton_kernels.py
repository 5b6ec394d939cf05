"""The Triton kernels of lora/triton_ops.py (imported only when a GPU tensor needs them)."""

import triton
import triton.language as tl


@triton.jit
def lora_shrink_kernel(x_ptr, at_ptr, tmp_ptr, rows_ptr, block_slot_ptr, widths_ptr, T, K,
                       stride_x, stride_as, stride_ak, stride_t, BLOCK_M: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """tmp[row, r] = x[row] @ A^T[slot][:, r] for one block of BLOCK_M rows of one slot
    (row indices at rows_ptr, padding rows >= T) and BLOCK_R of the slot's columns in use."""
    b = tl.program_id(0)
    slot = tl.load(block_slot_ptr + b)
    if slot >= 0:
        width = tl.load(widths_ptr + slot)
        r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        if tl.program_id(1) * BLOCK_R < width:
            rows = tl.load(rows_ptr + b * BLOCK_M + tl.arange(0, BLOCK_M))
            ok = rows < T
            r_ok = r < width
            kk = tl.arange(0, BLOCK_K)
            at = at_ptr + slot.to(tl.int64) * stride_as
            acc = tl.zeros((BLOCK_M, BLOCK_R), tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k_ok = k0 + kk < K
                x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + (k0 + kk)[None, :],
                            mask=ok[:, None] & k_ok[None, :], other=0.0)
                a = tl.load(at + (k0 + kk)[:, None].to(tl.int64) * stride_ak + r[None, :],
                            mask=k_ok[:, None] & r_ok[None, :], other=0.0)
                acc += tl.dot(x, a.to(x.dtype), input_precision=PRECISION)
            tl.store(tmp_ptr + rows[:, None].to(tl.int64) * stride_t + r[None, :],
                     acc.to(tmp_ptr.dtype.element_ty), mask=ok[:, None] & r_ok[None, :])


@triton.jit
def lora_expand_kernel(tmp_ptr, bt_ptr, out_ptr, rows_ptr, block_slot_ptr, widths_ptr, T, N,
                       stride_t, stride_bs, stride_br, stride_o, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                       PRECISION: tl.constexpr):
    """out[row, n] += tmp[row, :width] @ B^T[slot][:width, n] for one block of BLOCK_M rows
    of one slot and BLOCK_N output columns: the product rounded to out's dtype, then added
    (as `add_reference` rounds it)."""
    b = tl.program_id(0)
    slot = tl.load(block_slot_ptr + b)
    if slot >= 0:
        width = tl.load(widths_ptr + slot)
        rows = tl.load(rows_ptr + b * BLOCK_M + tl.arange(0, BLOCK_M))
        ok = rows < T
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        rr = tl.arange(0, BLOCK_R)
        bt = bt_ptr + slot.to(tl.int64) * stride_bs
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for r0 in range(0, width, BLOCK_R):
            r_ok = r0 + rr < width
            t = tl.load(tmp_ptr + rows[:, None].to(tl.int64) * stride_t + (r0 + rr)[None, :],
                        mask=ok[:, None] & r_ok[None, :], other=0.0)
            w = tl.load(bt + (r0 + rr)[:, None].to(tl.int64) * stride_br + n[None, :],
                        mask=r_ok[:, None] & n_ok[None, :], other=0.0)
            acc += tl.dot(t, w.to(t.dtype), input_precision=PRECISION)
        where = out_ptr + rows[:, None].to(tl.int64) * stride_o + n[None, :]
        both = ok[:, None] & n_ok[None, :]
        base = tl.load(where, mask=both, other=0.0)
        total = base.to(tl.float32) + acc.to(base.dtype).to(tl.float32)
        tl.store(where, total.to(base.dtype), mask=both)
