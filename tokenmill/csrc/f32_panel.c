/* fp32 linear layers in oneDNN's packed layout: y[M, N] = x[M, K] @ W^T (+ bias).
 *
 * fp32 layers keep their weight in the layout torch.ops.mkldnn._reorder_linear_weight gives
 * (one copy; oneDNN runs the layers this kernel cannot read): panels of 64 output channels,
 * each [KP][64] with K zero-padded to KP ([N/64][KP][64]; csrc.f32_panel_stride derives KP and
 * layers check this kernel against oneDNN once before using it). oneDNN's own single-row GEMV
 * reads it at ~12 GB/s here; one pass per panel with 8 accumulators reaches the machine's
 * streaming rate. From 2 rows on, register tiles of up to 6 rows walk k-chunks of the panel
 * that stay in L1 while every tile of the chunk uses them, with the next chunk prefetched in
 * memory order (strips read alone would stride through the panel and defeat the hardware
 * prefetcher). On AVX2 a tile is 16 columns wide (12 sums in registers); with AVX-512 it spans
 * the whole 64-column panel (24 of the 32 zmm registers), so each weight is loaded once per
 * tile instead of being re-read, with fewer loads per FMA: on a Zen 4 that moved the 16-2048
 * row range from 0.8-0.9x oneDNN's AVX-512 kernels to at least par (bench/NOTES.md).
 * Every tile adds each product in k order with one FMA, in either ISA, so a row's result
 * does not depend on how many rows run with it, and equals the single-row pass. Tiles keep
 * their sums in a per-thread buffer between k-chunks and store the last chunk's straight
 * into y (+ bias), between their FMAs rather than in a copy pass after them (2,048-row
 * prompts 1.02x). tm_f32_panel_glu runs a merged gate|up weight with the MLP's activation
 * applied to the sums: the [M, 2I] product never reaches memory (1.07-1.11x for gate|up and
 * the SiLU pass together from 16 rows up). The row walk, the prefetch pacing and the threads'
 * schedule are shared with bf16_panel.c (panel.h, panel_gemm.c). */
#include <immintrin.h>
#include <stdint.h>

#include "kernels.h"
#include "panel.h"

#ifdef __AVX512F__
/* c[0 .. mr, 0 .. 64) += x rows times panel rows [k0, k1): mr x 4 zmm sums. Cache lines
 * [lo, hi) of `fetch` (the next chunk) are prefetched evenly over the k loop, into
 * L2: a 32 KB chunk being used already fills L1, and an L1 hint evicted it (the default
 * model's 120 projections streaming from memory: 16-64 rows 4-10 % faster with T1 than T0). */
INLINE void f32_panel_tile(const float *x, const float *panel, int64_t col, int64_t k0,
                           int64_t k1, float *c, const char *fetch, int64_t lo, int64_t hi,
                           const int mr, const tm_out *out, const int64_t K) {
    (void)col; /* (one strip: the whole panel) */
    __m512 acc[6][4];
    _Pragma("GCC unroll 8")
    for (int i = 0; i < mr; i++)
        for (int v = 0; v < 4; v++)
            acc[i][v] = k0 ? _mm512_load_ps(c + i * 64 + 16 * v) : _mm512_setzero_ps();
    FETCH_PLAN(lo, hi, k1 - k0);
    for (int64_t k = k0; k < k1; k++) {
        FETCH_DUE(fetch, lo, TM_FETCH_HINT);
        __m512 w[4];
        for (int v = 0; v < 4; v++) w[v] = _mm512_loadu_ps(panel + k * 64 + 16 * v);
        _Pragma("GCC unroll 8")
        for (int i = 0; i < mr; i++) {
            const __m512 xb = _mm512_set1_ps(x[i * K + k]);
            for (int v = 0; v < 4; v++) acc[i][v] = _mm512_fmadd_ps(xb, w[v], acc[i][v]);
        }
    }
    if (out && k1 == K) { /* last chunk: the sums (+ bias) go straight to y */
        __m512 b[4];
        for (int v = 0; v < 4; v++)
            b[v] = out->bias ? _mm512_loadu_ps(out->bias + 16 * v) : _mm512_setzero_ps();
        _Pragma("GCC unroll 8")
        for (int i = 0; i < mr; i++)
            for (int v = 0; v < 4; v++)
                _mm512_storeu_ps(out->y + i * out->ld + 16 * v,
                                 out->bias ? _mm512_add_ps(acc[i][v], b[v]) : acc[i][v]);
        return;
    }
    _Pragma("GCC unroll 8")
    for (int i = 0; i < mr; i++)
        for (int v = 0; v < 4; v++) _mm512_store_ps(c + i * 64 + 16 * v, acc[i][v]);
}
#else
/* c[0 .. mr, col .. col+16) += x rows times panel rows [k0, k1): mr x 2 ymm sums. Cache lines
 * [lo, hi) of `fetch` (the next chunk) are prefetched evenly over the k loop. */
INLINE void f32_panel_tile(const float *x, const float *panel, int64_t col, int64_t k0,
                           int64_t k1, float *c, const char *fetch, int64_t lo, int64_t hi,
                           const int mr, const tm_out *out, const int64_t K) {
    panel += col;
    __m256 acc[6][2];
    _Pragma("GCC unroll 8")
    for (int i = 0; i < mr; i++) {
        acc[i][0] = k0 ? _mm256_load_ps(c + i * 64) : _mm256_setzero_ps();
        acc[i][1] = k0 ? _mm256_load_ps(c + i * 64 + 8) : _mm256_setzero_ps();
    }
    FETCH_PLAN(lo, hi, k1 - k0);
    for (int64_t k = k0; k < k1; k++) {
        FETCH_DUE(fetch, lo, TM_FETCH_HINT);
        const __m256 w0 = _mm256_loadu_ps(panel + k * 64);
        const __m256 w1 = _mm256_loadu_ps(panel + k * 64 + 8);
        _Pragma("GCC unroll 8")
        for (int i = 0; i < mr; i++) {
            const __m256 xb = _mm256_broadcast_ss(x + i * K + k);
            acc[i][0] = _mm256_fmadd_ps(xb, w0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(xb, w1, acc[i][1]);
        }
    }
    if (out && k1 == K) { /* last chunk: the sums (+ bias) go straight to y */
        const __m256 b0 = out->bias ? _mm256_loadu_ps(out->bias) : _mm256_setzero_ps();
        const __m256 b1 = out->bias ? _mm256_loadu_ps(out->bias + 8) : _mm256_setzero_ps();
        _Pragma("GCC unroll 8")
        for (int i = 0; i < mr; i++) {
            _mm256_storeu_ps(out->y + i * out->ld, out->bias ? _mm256_add_ps(acc[i][0], b0) : acc[i][0]);
            _mm256_storeu_ps(out->y + i * out->ld + 8, out->bias ? _mm256_add_ps(acc[i][1], b1) : acc[i][1]);
        }
        return;
    }
    _Pragma("GCC unroll 8")
    for (int i = 0; i < mr; i++) {
        _mm256_store_ps(c + i * 64, acc[i][0]);
        _mm256_store_ps(c + i * 64 + 8, acc[i][1]);
    }
}
#endif

/* One row over a whole panel (64 columns, 8 accumulators): a single sequential pass, what a
 * memory-bound GEMV wants, with a software prefetch ROW_AHEAD panel rows (4 KB) ahead, into
 * the next panel at the end (the hardware prefetcher alone: ~80 % of the read bandwidth on an
 * Intel Xeon; with it the f32 Qwen2.5-0.5B-shaped decode went 12.4 -> 15.0 tok/s, at the
 * measured bandwidth; bench/NOTES.md, 2026-11-27). Same k-order FMA sums as the tiles. */
#define ROW_AHEAD 16
static void f32_panel_row(const float *x, int64_t K, const float *panel, float *c) {
    __m256 acc[8];
    for (int v = 0; v < 8; v++) acc[v] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        const __m256 xb = _mm256_broadcast_ss(x + k);
        for (int v = 0; v < 4; v++) /* the 4 lines of a panel row */
            _mm_prefetch((const char *)(panel + (k + ROW_AHEAD) * 64 + 16 * v), _MM_HINT_T0);
        for (int v = 0; v < 8; v++)
            acc[v] = _mm256_fmadd_ps(xb, _mm256_loadu_ps(panel + k * 64 + 8 * v), acc[v]);
    }
    for (int v = 0; v < 8; v++) _mm256_store_ps(c + 8 * v, acc[v]);
}

/* The tiles' signature for TM_PANEL_ROWS (K, the row stride of x, last) */
#define F32_TILE(x, panel, col, k0, k1, c, next, lo, hi, R, out) \
    f32_panel_tile(x, panel, col, k0, k1, c, next, lo, hi, R, out, K)

/* tm_gemm's sums for fp32 panels ([KP][64] floats each) */
static void f32_sums(const tm_gemm *g, const char *xb, int64_t rows, const char *pb,
                     const char *after, float *c, const tm_out *out) {
    const float *x = (const float *)xb, *panel = (const float *)pb;
    const int64_t K = g->K;
    if (rows == 1)
        f32_panel_row(x, K, panel, c);
    else
        TM_PANEL_ROWS(F32_TILE, x, K, rows, K, panel, after, c, TM_KC(g->M), out);
}

static void f32_gemm(const float *x, const float *w, const float *bias, float *y, int64_t M,
                     int64_t N, int64_t K, int64_t KP, int64_t glu) {
    const tm_gemm g = {(const char *)x, (const char *)w, bias, y, M, N, K, KP, glu,
                       K * (int64_t)sizeof(float), KP * 64 * (int64_t)sizeof(float), f32_sums};
    tm_panel_gemm(&g);
}

void tm_f32_panel_gemm(const float *x, const float *w, const float *bias, float *y, int64_t M,
                       int64_t N, int64_t K, int64_t KP) {
    f32_gemm(x, w, bias, y, M, N, K, KP, 0);
}

/* act[M, I] = silu(x @ Wgate^T + bg) * (x @ Wup^T + bu) for a merged gate|up weight of 2I
 * output channels, I a multiple of 64 (-1 otherwise): each gate panel's sums meet their up
 * panel's in registers, so the [M, 2I] product is never written and read back. Bitwise the
 * same as tm_f32_panel_gemm then tm_silu_and_mul. */
int64_t tm_f32_panel_glu(const float *x, const float *w, const float *bias, float *act,
                         int64_t M, int64_t I, int64_t K, int64_t KP) {
    if (I % 64) return -1;
    f32_gemm(x, w, bias, act, M, I, K, KP, 1);
    return 0;
}
