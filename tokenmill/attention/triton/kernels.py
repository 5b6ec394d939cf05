"""Triton kernels over the paged KV cache: the K/V write and one attention kernel for mixed
steps (decodes and prompt chunks with cached context in the same launch).

Attention: one program per (sequence, KV head, block of query tokens). Its rows are the
query tokens times the G query heads sharing that KV head (grouped-query attention without
copying K/V), so a decode's G heads fill one `tl.dot`. Keys are read where they lie, a
`BLOCK_N` run at a time through the block table, with an online softmax in float32;
causality is bottom-right (query i of a sequence with context c sees keys 0..c+i), optionally
limited to a sliding window and soft-capped (Gemma 2). Decode-only launches can split each
sequence's keys over `splits` programs (flash-decoding) whose partial sums a second kernel
merges, so a batch of one still fills the GPU on long contexts.

int8 caches hold D int8 values and their float32 scale per row (quantization/kv_cache.py);
the kernels read and write that layout. Checked on the CPU under TRITON_INTERPRET=1 against
attention/reference.py; the same code runs on GPUs."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.layers.triton_op_kernels import rotate_row


@triton.jit
def _store_row(x, cache, dst, d, ok, D, INT8: tl.constexpr):
    """One (token, head) row into the cache at offset `dst`; int8: its values and scale."""
    if INT8:
        scale = tl.maximum(tl.max(tl.abs(x.to(tl.float32)), 0) / 127.0, 1e-12)
        # round half to even, as torch.round: the float32 magic-number trick
        q = (x.to(tl.float32) / scale + 12582912.0) - 12582912.0
        q = tl.minimum(tl.maximum(q, -127.0), 127.0)
        tl.store(cache + dst + d, q.to(tl.int8), mask=ok)
        tl.store((cache + dst + D).to(tl.pointer_type(tl.float32)), scale)
    else:
        tl.store(cache + dst + d, x.to(cache.dtype.element_ty), mask=ok)


@triton.jit
def _write_kv(k_ptr, v_ptr, k_cache, v_cache, slots, stride_kt, stride_kh, stride_vt,
              stride_vh, stride_slot, stride_head, D, D_PAD: tl.constexpr, INT8: tl.constexpr,
              HAS_V: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slots + t).to(tl.int64)
    if slot >= 0:  # a negative slot: a padding row (CUDA-graph batches), written nowhere
        d = tl.arange(0, D_PAD)
        ok = d < D
        dst = slot * stride_slot + h * stride_head
        k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=ok, other=0.0)
        _store_row(k, k_cache, dst, d, ok, D, INT8)
        if HAS_V:  # (without: one cache of rows, DeepSeek's latents)
            v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=ok, other=0.0)
            _store_row(v, v_cache, dst, d, ok, D, INT8)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v [T, Hkv, D] into the caches [blocks, block_size, Hkv, D (+4 for int8)] at
    `slot_mapping` (negative slots skipped)."""
    t, hkv, d = k.shape
    if t == 0:
        return
    _write_kv[(t, hkv)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1),
                        v.stride(0), v.stride(1), k_cache.stride(1), k_cache.stride(2), d,
                        D_PAD=triton.next_power_of_2(d), INT8=k_cache.dtype == torch.int8,
                        HAS_V=True)


@triton.jit
def _rotary_write_kv(x_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, out_ptr, k_cache, v_cache, slots,
                     stride_xt, stride_xh, stride_vt, stride_vh, stride_c, stride_slot,
                     stride_head, Q_HEADS, D, HALF, D_PAD: tl.constexpr, INT8: tl.constexpr):
    """Program (token, head) of x = [T, q heads | KV heads, D]: the head rotated into out;
    a KV head's rotated row is its K, written to the cache with the token's V row."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, D_PAD)
    ok = d < D
    y = rotate_row(x_ptr + t * stride_xt + h * stride_xh, cos_ptr, sin_ptr,
                   tl.load(pos_ptr + t), stride_c, d, ok, D, HALF)
    tl.store(out_ptr + (t * tl.num_programs(1) + h) * D + d, y, mask=ok)
    if h >= Q_HEADS:
        slot = tl.load(slots + t).to(tl.int64)
        if slot >= 0:  # (a negative slot: a graph batch's padding row)
            kv = h - Q_HEADS
            dst = slot * stride_slot + kv * stride_head
            _store_row(y, k_cache, dst, d, ok, D, INT8)
            v = tl.load(v_ptr + t * stride_vt + kv * stride_vh + d, mask=ok, other=0.0)
            _store_row(v, v_cache, dst, d, ok, D, INT8)


def rotary_write_kv(x: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                    signed_sin: torch.Tensor, positions: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    q_heads: int) -> torch.Tensor:
    """x [T, q_heads + Hkv, D] (q heads, then K heads; rows of D contiguous) rotated to each
    token's position into a new tensor, as triton_ops.rotary, and in the same launch the
    rotated K heads and v [T, Hkv, D] written to the caches at `slot_mapping`, as write_kv
    (one launch instead of two)."""
    t, h, d = x.shape
    out = torch.empty(t, h, d, dtype=x.dtype, device=x.device)
    if t:
        _rotary_write_kv[(t, h)](x, v, cos, signed_sin, positions, out, k_cache, v_cache,
                                 slot_mapping, x.stride(0), x.stride(1), v.stride(0),
                                 v.stride(1), cos.stride(0), k_cache.stride(1),
                                 k_cache.stride(2), q_heads, d, d // 2,
                                 D_PAD=triton.next_power_of_2(d),
                                 INT8=k_cache.dtype == torch.int8)
    return out


def write_rows(rows: torch.Tensor, flat: torch.Tensor, slots: torch.Tensor) -> None:
    """rows [T, D] into flat [slots, D] (one row per slot, as DeepSeek's latent cache) at
    `slots` (negative slots skipped)."""
    if rows.shape[0]:
        _write_kv[(rows.shape[0], 1)](rows, rows, flat, flat, slots, rows.stride(0), 0,
                                      rows.stride(0), 0, flat.stride(0), 0, rows.shape[1],
                                      D_PAD=triton.next_power_of_2(rows.shape[1]),
                                      INT8=False, HAS_V=False)


@triton.jit
def _load_rows(cache, s_off, d, D, n_ok, d_ok, INT8: tl.constexpr, dtype: tl.constexpr):
    """[D_PAD, BLOCK_N] of the keys / values at row offsets `s_off`, in `dtype`."""
    ok = n_ok[None, :] & d_ok[:, None]
    if INT8:
        x = tl.load(cache + s_off[None, :] + d[:, None], mask=ok, other=0)
        scale = tl.load((cache + s_off + D).to(tl.pointer_type(tl.float32)), mask=n_ok,
                        other=0.0)
        return (x.to(tl.float32) * scale[None, :]).to(dtype)
    # (no `other`: Triton's interpreter cannot fill a float8 load with it)
    x = tl.load(cache + s_off[None, :] + d[:, None], mask=ok)
    return tl.where(ok, x.to(dtype), 0.0)


@triton.jit
def _attention(q_ptr, k_cache, v_cache, out_ptr, part_ptr, block_table, seq_lens, q_start,
               stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_slot,
               stride_head, scale, softcap, window, block_size, D, DV, HQ,
               G: tl.constexpr, HEAD_BLOCK: tl.constexpr, BLOCK_Q: tl.constexpr,
               D_PAD: tl.constexpr, DV_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
               SPLITS: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr,
               INT8: tl.constexpr, PRECISION: tl.constexpr):
    s = tl.program_id(0)
    kvh = tl.program_id(1) // tl.cdiv(G, HEAD_BLOCK)  # (KV head, block of its query heads)
    first_head = tl.program_id(1) % tl.cdiv(G, HEAD_BLOCK) * HEAD_BLOCK
    pid2 = tl.program_id(2)  # the query block, or (decode splits) the key range
    m = pid2 // SPLITS
    split = pid2 % SPLITS
    q_lo = tl.load(q_start + s)
    q_len = tl.load(q_start + s + 1) - q_lo
    if m * BLOCK_Q < q_len:
        seq_len = tl.load(seq_lens + s).to(tl.int32)
        context = seq_len - q_len
        r = tl.arange(0, BLOCK_Q * HEAD_BLOCK)
        tok = m * BLOCK_Q + r // HEAD_BLOCK
        g = first_head + r % HEAD_BLOCK
        head = kvh * G + g
        row_ok = (tok < q_len) & (g < G)
        d = tl.arange(0, D_PAD)
        d_ok = d < D
        dv = tl.arange(0, DV_PAD)
        dv_ok = dv < DV
        q = tl.load(q_ptr + (q_lo + tok)[:, None].to(tl.int64) * stride_qt
                    + head[:, None] * stride_qh + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        pos = context + tok  # each row's position in its sequence
        hi = context + tl.minimum((m + 1) * BLOCK_Q, q_len)  # past the block's last query
        lo = 0
        if WINDOW:
            lo = tl.maximum(context + m * BLOCK_Q - window + 1, 0)
        lo = lo // BLOCK_N * BLOCK_N
        if SPLITS > 1:  # this program's share of the keys, whole BLOCK_N runs
            per = tl.cdiv(tl.cdiv(hi - lo, SPLITS), BLOCK_N) * BLOCK_N
            lo = lo + split * per
            hi = tl.minimum(hi, lo + per)
        m_i = tl.full((BLOCK_Q * HEAD_BLOCK,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_Q * HEAD_BLOCK,), tl.float32)
        acc = tl.zeros((BLOCK_Q * HEAD_BLOCK, DV_PAD), tl.float32)
        bt = block_table + s.to(tl.int64) * stride_bt
        for start in range(lo, hi, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            n_ok = n < hi
            blk = tl.load(bt + n // block_size, mask=n_ok, other=0).to(tl.int64)
            s_off = (blk * block_size + n % block_size) * stride_slot + kvh * stride_head
            k = _load_rows(k_cache, s_off, d, D, n_ok, d_ok, INT8, q.dtype)  # [D_PAD, BLOCK_N]
            qk = tl.dot(q, k, input_precision=PRECISION) * scale
            if SOFTCAP:
                qk = softcap * (2.0 * tl.sigmoid(2.0 * qk / softcap) - 1.0)  # cap * tanh
            visible = n_ok[None, :] & (n[None, :] <= pos[:, None])
            if WINDOW:
                visible = visible & (n[None, :] > pos[:, None] - window)
            qk = tl.where(visible, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(qk - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.trans(_load_rows(v_cache, s_off, dv, DV, n_ok, dv_ok, INT8, q.dtype))
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
            m_i = m_new
        rows = (q_lo + tok).to(tl.int64)
        if SPLITS > 1:  # partial (max, sum, acc) per row for the merge kernel
            part = part_ptr + ((rows * HQ + head) * SPLITS + split) * (DV_PAD + 2)
            tl.store(part[:, None] + dv[None, :], acc, mask=row_ok[:, None])
            tl.store(part + DV_PAD, m_i, mask=row_ok)
            tl.store(part + DV_PAD + 1, l_i, mask=row_ok)
        else:
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            tl.store(out_ptr + rows[:, None] * stride_ot + head[:, None] * stride_oh
                     + dv[None, :], out.to(out_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & dv_ok[None, :])


@triton.jit
def _merge_splits(part_ptr, out_ptr, stride_ot, stride_oh, H, D, D_PAD: tl.constexpr,
                  SPLITS: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, SPLITS)
    d = tl.arange(0, D_PAD)
    part = part_ptr + ((t.to(tl.int64) * H + h) * SPLITS + sp) * (D_PAD + 2)
    m = tl.load(part + D_PAD)
    l_s = tl.load(part + D_PAD + 1)
    acc = tl.load(part[:, None] + d[None, :])
    top = tl.max(m, 0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - tl.where(top == float("-inf"), 0.0, top)))
    total = tl.sum(l_s * w, 0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + d,
             out.to(out_ptr.dtype.element_ty), mask=d < D)


# Launch settings: rows = query tokens x padded query heads per program (>= 16 for tl.dot).
# 16-bit prompts: the fastest of 16 settings on an H100 (bench/attention_sweep.py, 2048-token
# prompt, Qwen2-0.5B heads: 0.071 ms vs 0.089 ms for PROMPT; cuDNN SDPA 0.039 ms).
DECODE = {"rows": 16, "block_n": 32}
SHORT = 8  # the longest query rows a sequence that still takes DECODE and key splits
PROMPT = {"rows": 64, "block_n": 64}
PROMPT_16BIT = {"rows": 128, "block_n": 64, "num_warps": 8, "num_stages": 2}


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    out: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                    q_start: torch.Tensor, max_query_len: int, scale: float,
                    window: int | None = None, softcap: float | None = None,
                    splits: int = 1, tune: dict | None = None) -> torch.Tensor:
    """out [T, Hq, Dv] = attention of q [T, Hq, D] (rows of each sequence at q_start[s] ..
    q_start[s + 1]) over its sequence's cached keys (seq_lens[s] of them, this step's
    included); values are the first Dv = out.shape[-1] entries of each v_cache row (Dv = D,
    or DeepSeek's latent attention: v_cache is k_cache, its rows latent | rotary key, the
    values the latents). `splits`: key ranges per query block, merged by a second kernel;
    only for steps of short queries (max_query_len <= SHORT: decodes, decodes with their
    drafts), which also take the decode launch settings. `tune`: launch settings (rows,
    block_n, num_warps, num_stages) instead of the defaults."""
    num_seqs = block_table.shape[0]
    hq, d, dv = q.shape[1], q.shape[2], out.shape[2]
    hkv = k_cache.shape[2]
    g = hq // hkv
    head_block = min(triton.next_power_of_2(g), 16)
    int8 = k_cache.dtype == torch.int8
    if int8 and d % 4:
        raise ValueError("int8 KV caches need a head size that is a multiple of 4")
    short = max_query_len <= SHORT
    base = DECODE if short else (
        PROMPT_16BIT if q.dtype in (torch.float16, torch.bfloat16) and q.is_cuda else PROMPT)
    tune = {**base, **(tune or {})}
    block_q = max(1, tune["rows"] // head_block)
    if not short:
        splits = 1
    d_pad, dv_pad = max(16, triton.next_power_of_2(d)), max(16, triton.next_power_of_2(dv))
    grid = (num_seqs, hkv * triton.cdiv(g, head_block),
            triton.cdiv(max_query_len, block_q) * splits)
    part = (torch.empty(q.shape[0], hq, splits, dv_pad + 2, dtype=torch.float32,
                        device=q.device) if splits > 1 else out)
    _attention[grid](
        q, k_cache, v_cache, out, part, block_table, seq_lens, q_start, q.stride(0),
        q.stride(1), out.stride(0), out.stride(1), block_table.stride(0), k_cache.stride(1),
        k_cache.stride(2), scale, float(softcap or 1.0), int(window or 0),
        k_cache.shape[1], d, dv, hq, G=g, HEAD_BLOCK=head_block, BLOCK_Q=block_q,
        D_PAD=d_pad, DV_PAD=dv_pad, BLOCK_N=tune["block_n"], SPLITS=splits,
        SOFTCAP=softcap is not None, WINDOW=window is not None, INT8=int8,
        # float32 queries: TF32 only where torch's own matmuls would use it
        PRECISION="tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee",
        **{k: tune[k] for k in ("num_warps", "num_stages") if k in tune})
    if splits > 1:
        _merge_splits[(q.shape[0], hq)](part, out, out.stride(0), out.stride(1), hq, dv,
                                        D_PAD=dv_pad, SPLITS=splits)
    return out
