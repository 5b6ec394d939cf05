/* bf16 linear layers on the CPU: y[M, N] = x[M, K] @ W^T (+ bias), W stored in bf16, x and y
 * fp32 (the model computes in fp32; only the weights are 16-bit, as llama.cpp runs a BF16
 * file).
 *
 * The weight lives in panels of 64 output channels by k-pairs, [N/64][KP/2][64][2] (KP: K
 * rounded up to even, zero-padded; tm_bf16_to_panels): one k-pair of a panel is 256 bytes,
 * the same as one k of f32_panel.c's fp32 panels, so the same row walk, prefetch pacing and
 * thread schedule serve both (panel.h, panel_gemm.c). x is rounded to bf16 once per call
 * (ties to even) and each row's pair (x[k], x[k+1]) multiplies a panel pair-row:
 * - on CPUs with AVX512-BF16, `vdpbf16ps` adds both products of 16 channels into fp32 sums:
 *   twice the products of an fp32 FMA a cycle, so compute-bound prompts run up to ~2x fp32;
 * - elsewhere (AVX-512F, AVX2) the pair is widened to two fp32 vectors (a shift and a mask)
 *   and added with two FMAs: fp32 speed for compute, half the bytes for memory-bound decode.
 * Products of two bf16 values are exact in fp32, so both paths differ only in how the sums
 * round (checked against `F.linear` of the bf16-rounded operands in tests). */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "panel.h"

/* w [N, K] bf16 -> [ceil(N/64)][KP/2][64][2], channels past N and k past K zero */
void tm_bf16_to_panels(const uint16_t *w, int64_t N, int64_t K, int64_t KP, uint16_t *out) {
    const int64_t panels = (N + 63) / 64, pairs = KP / 2;
#pragma omp parallel for
    for (int64_t p = 0; p < panels; p++) {
        uint16_t *dst = out + p * pairs * 128;
        memset(dst, 0, pairs * 128 * sizeof(uint16_t));
        for (int64_t j = 0; j < 64 && p * 64 + j < N; j++) {
            const uint16_t *row = w + (p * 64 + j) * K;
            for (int64_t k = 0; k < K; k++) dst[(k / 2) * 128 + j * 2 + (k & 1)] = row[k];
        }
    }
}

/* x [M, K] -> xb [M, KP] in bf16 (a zero past K) */
static void round_rows(const float *x, uint16_t *xb, int64_t M, int64_t K, int64_t KP) {
    for (int64_t i = 0; i < M; i++) {
        for (int64_t k = 0; k < K; k++) xb[i * KP + k] = to_bf16(x[i * K + k]);
        for (int64_t k = K; k < KP; k++) xb[i * KP + k] = 0;
    }
}

/* The pair (x[2kk], x[2kk+1]) of a bf16 row as one 32-bit word */
static inline int32_t pair_at(const uint16_t *x, int64_t kk) {
    int32_t v;
    memcpy(&v, x + 2 * kk, 4);
    return v;
}

#ifdef __AVX512F__
/* acc += the products of pair xp with 16 channels' weight pairs w (16 x 2 bf16) */
INLINE __m512 pair_fma16(__m512 acc, int32_t xp, __m512i w) {
#ifdef __AVX512BF16__
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(xp), (__m512bh)w);
#else
    const __m512 x0 = _mm512_castsi512_ps(_mm512_set1_epi32(xp << 16));
    const __m512 x1 = _mm512_castsi512_ps(_mm512_set1_epi32(xp & (int32_t)0xffff0000u));
    acc = _mm512_fmadd_ps(x0, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)), acc);
    return _mm512_fmadd_ps(x1, _mm512_castsi512_ps(
        _mm512_and_si512(w, _mm512_set1_epi32((int32_t)0xffff0000u))), acc);
#endif
}

/* c[0 .. mr, 0 .. 64) += x rows (stride KP) times panel pair-rows [k0, k1): mr x 4 zmm sums
 * (as f32_panel.c's tile, one k-pair a step) */
INLINE void bf16_panel_tile(const uint16_t *x, const uint16_t *panel, int64_t col, int64_t k0,
                            int64_t k1, float *c, const char *fetch, int64_t lo, int64_t hi,
                            const int mr, const tm_out *out, const int64_t KP) {
    (void)col;
    __m512 acc[6][4];
    _Pragma("GCC unroll 8")
    for (int i = 0; i < mr; i++)
        for (int v = 0; v < 4; v++)
            acc[i][v] = k0 ? _mm512_load_ps(c + i * 64 + 16 * v) : _mm512_setzero_ps();
    FETCH_PLAN(lo, hi, k1 - k0);
    for (int64_t kk = k0; kk < k1; kk++) {
        FETCH_DUE(fetch, lo, TM_FETCH_HINT);
        __m512i w[4];
        for (int v = 0; v < 4; v++) w[v] = _mm512_loadu_si512(panel + kk * 128 + 32 * v);
        _Pragma("GCC unroll 8")
        for (int i = 0; i < mr; i++) {
            const int32_t xp = pair_at(x + i * KP, kk);
            for (int v = 0; v < 4; v++) acc[i][v] = pair_fma16(acc[i][v], xp, w[v]);
        }
    }
    if (out && k1 == KP / 2) { /* last chunk: the sums (+ bias) go straight to y */
        _Pragma("GCC unroll 8")
        for (int i = 0; i < mr; i++)
            for (int v = 0; v < 4; v++) {
                const __m512 b = out->bias ? _mm512_loadu_ps(out->bias + 16 * v)
                                           : _mm512_setzero_ps();
                _mm512_storeu_ps(out->y + i * out->ld + 16 * v, _mm512_add_ps(acc[i][v], b));
            }
        return;
    }
    _Pragma("GCC unroll 8")
    for (int i = 0; i < mr; i++)
        for (int v = 0; v < 4; v++) _mm512_store_ps(c + i * 64 + 16 * v, acc[i][v]);
}

/* One row over a whole panel: two sets of 4 sums (even and odd pair-rows) so the adds of one
 * do not wait on the other's, a software prefetch 16 pair-rows (4 KB) ahead */
static void bf16_panel_row(const uint16_t *x, int64_t KP, const uint16_t *panel, float *c) {
    __m512 acc[2][4];
    for (int s = 0; s < 2; s++)
        for (int v = 0; v < 4; v++) acc[s][v] = _mm512_setzero_ps();
    const int64_t pairs = KP / 2;
    for (int64_t kk = 0; kk < pairs; kk++) {
        const int s = kk & 1;
        const int32_t xp = pair_at(x, kk);
        for (int v = 0; v < 4; v++) {
            _mm_prefetch((const char *)(panel + (kk + 16) * 128 + 32 * v), _MM_HINT_T0);
            acc[s][v] = pair_fma16(acc[s][v], xp,
                                   _mm512_loadu_si512(panel + kk * 128 + 32 * v));
        }
    }
    for (int v = 0; v < 4; v++) _mm512_store_ps(c + 16 * v, _mm512_add_ps(acc[0][v], acc[1][v]));
}
#else
/* acc0|acc1 (8 channels each) += the products of pair xp with 16 channels' weight pairs */
INLINE void pair_fma8x2(__m256 *acc, int32_t xp, const uint16_t *w) {
    const __m256 x0 = _mm256_castsi256_ps(_mm256_set1_epi32(xp << 16));
    const __m256 x1 = _mm256_castsi256_ps(_mm256_set1_epi32(xp & (int32_t)0xffff0000u));
    const __m256i hi = _mm256_set1_epi32((int32_t)0xffff0000u);
    for (int h = 0; h < 2; h++) {
        const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + 16 * h));
        acc[h] = _mm256_fmadd_ps(x0, _mm256_castsi256_ps(_mm256_slli_epi32(wv, 16)), acc[h]);
        acc[h] = _mm256_fmadd_ps(x1, _mm256_castsi256_ps(_mm256_and_si256(wv, hi)), acc[h]);
    }
}

/* c[0 .. mr, col .. col+16) += x rows times panel pair-rows [k0, k1): mr x 2 ymm sums */
INLINE void bf16_panel_tile(const uint16_t *x, const uint16_t *panel, int64_t col, int64_t k0,
                            int64_t k1, float *c, const char *fetch, int64_t lo, int64_t hi,
                            const int mr, const tm_out *out, const int64_t KP) {
    panel += 2 * col;
    __m256 acc[6][2];
    _Pragma("GCC unroll 8")
    for (int i = 0; i < mr; i++)
        for (int h = 0; h < 2; h++)
            acc[i][h] = k0 ? _mm256_load_ps(c + i * 64 + 8 * h) : _mm256_setzero_ps();
    FETCH_PLAN(lo, hi, k1 - k0);
    for (int64_t kk = k0; kk < k1; kk++) {
        FETCH_DUE(fetch, lo, TM_FETCH_HINT);
        _Pragma("GCC unroll 8")
        for (int i = 0; i < mr; i++) pair_fma8x2(acc[i], pair_at(x + i * KP, kk), panel + kk * 128);
    }
    if (out && k1 == KP / 2) {
        _Pragma("GCC unroll 8")
        for (int i = 0; i < mr; i++)
            for (int h = 0; h < 2; h++) {
                const __m256 b = out->bias ? _mm256_loadu_ps(out->bias + 8 * h)
                                           : _mm256_setzero_ps();
                _mm256_storeu_ps(out->y + i * out->ld + 8 * h, _mm256_add_ps(acc[i][h], b));
            }
        return;
    }
    _Pragma("GCC unroll 8")
    for (int i = 0; i < mr; i++)
        for (int h = 0; h < 2; h++) _mm256_store_ps(c + i * 64 + 8 * h, acc[i][h]);
}

static void bf16_panel_row(const uint16_t *x, int64_t KP, const uint16_t *panel, float *c) {
    __m256 acc[8];
    for (int v = 0; v < 8; v++) acc[v] = _mm256_setzero_ps();
    for (int64_t kk = 0; kk < KP / 2; kk++) {
        const int32_t xp = pair_at(x, kk);
        for (int v = 0; v < 4; v++) {
            _mm_prefetch((const char *)(panel + (kk + 16) * 128 + 32 * v), _MM_HINT_T0);
            pair_fma8x2(acc + 2 * v, xp, panel + kk * 128 + 32 * v);
        }
    }
    for (int v = 0; v < 8; v++) _mm256_store_ps(c + 8 * v, acc[v]);
}
#endif

#define BF16_TILE(x, panel, col, k0, k1, c, next, lo, hi, R, out) \
    bf16_panel_tile(x, panel, col, k0, k1, c, next, lo, hi, R, out, KP)

/* tm_gemm's sums for bf16 panels; x already rounded ([M][KP] bf16) */
static void bf16_sums(const tm_gemm *g, const char *xb, int64_t rows, const char *pb,
                      const char *after, float *c, const tm_out *out) {
    const uint16_t *x = (const uint16_t *)xb, *panel = (const uint16_t *)pb;
    const int64_t KP = g->KP;
    if (rows == 1)
        bf16_panel_row(x, KP, panel, c);
    else
        TM_PANEL_ROWS(BF16_TILE, x, KP, rows, KP / 2, panel, after, c, TM_KC(g->M), out);
}

static int64_t bf16_gemm(const float *x, const uint16_t *w, const float *bias, float *y,
                         int64_t M, int64_t N, int64_t K, int64_t KP, int64_t glu) {
    if (KP % 2 || KP < K) return -1;
    if (M <= 0) return 0;
    uint16_t *xb = malloc((size_t)(M * KP) * sizeof(uint16_t));
    if (!xb) return -2;
    round_rows(x, xb, M, K, KP);
    const tm_gemm g = {(const char *)xb, (const char *)w, bias, y, M, N, K, KP, glu,
                       KP * (int64_t)sizeof(uint16_t), KP * 64 * (int64_t)sizeof(uint16_t),
                       bf16_sums};
    tm_panel_gemm(&g);
    free(xb);
    return 0;
}

/* y[M, N] = x @ W^T (+ bias): 0, or -1 (KP not even, or below K) / -2 (out of memory) */
int64_t tm_bf16_panel_gemm(const float *x, const uint16_t *w, const float *bias, float *y,
                           int64_t M, int64_t N, int64_t K, int64_t KP) {
    return bf16_gemm(x, w, bias, y, M, N, K, KP, 0);
}

/* act[M, I] = silu(x @ Wgate^T + bg) * (x @ Wup^T + bu), a merged gate|up weight of 2I
 * channels, I a multiple of 64 (as tm_f32_panel_glu; -3 otherwise) */
int64_t tm_bf16_panel_glu(const float *x, const uint16_t *w, const float *bias, float *act,
                          int64_t M, int64_t I, int64_t K, int64_t KP) {
    if (I % 64) return -3;
    return bf16_gemm(x, w, bias, act, M, I, K, KP, 1);
}

/* 1 where this build multiplies with AVX512-BF16's dot products, else 0 (widened to fp32) */
int64_t tm_bf16_native(void) {
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}
