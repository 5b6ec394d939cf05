/* Weight-only quantized matrix multiply for x86 CPUs with AVX2, FMA and F16C:
 *   y[M, N] = x[M, K] @ dequant(W)^T (+ bias)
 * reading the int8 / int4 weights directly, so a decode step streams 1 or 1/2 byte per weight
 * instead of 4 (decode on a CPU is bound by memory bandwidth).
 *
 * Weights are row-major by output channel [N, ...] and quantized in groups of `group` inputs
 * (group == K: one scale per output channel):
 *   int8: w = q * scale[n, g]                      q: int8 [N, K], scale float32
 *   int4: w = q * scale[n, g] + min[n, g]          q: 0..15, uint8 [N, K/2] in GGUF's Q4 layout
 *         (per 32 inputs 16 bytes, byte j holds input j in its low nibble, j + 16 in its high);
 *         scale and min are float16, as GGUF Q4_1 keeps them (1/16 byte per weight at group 32).
 *
 * int4: each tile computes NB output channels for MB rows of x: 8 weights at a time are
 * unpacked to floats (scale and min applied) once and used for MB rows, with NB x MB
 * independent accumulators. Few rows: 4 channels x up to 3 rows; more: 2 channels x 4 rows.
 * Built at run time by tokenmill/csrc/__init__.py; threads come from OpenMP (the
 * same libgomp torch loaded, so there is one thread pool). */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

static inline __m256 i8x8_to_ps(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

static inline __m256 u8x8_to_ps(__m128i v) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
}

/* acc[j][i] += x[row m0 + i, k .. k+8) * w8 for output channel j */
#define ACCUMULATE(J, WV, K_)                                                             \
    for (int i = 0; i < MB_; i++)                                                         \
        acc[J][i] = _mm256_fmadd_ps(_mm256_loadu_ps(x + (m0 + i) * K + (K_)), (WV),       \
                                    acc[J][i]);

#define STORE_TILE()                                                                      \
    for (int j = 0; j < NB_; j++)                                                         \
        for (int i = 0; i < MB_; i++)                                                     \
            y[(m0 + i) * N + n0 + j] = hsum8(acc[j][i]) + (bias ? bias[n0 + j] : 0.0f);

#define INT4_TILE(NB, MB)                                                                 \
static void int4_tile_##NB##_##MB(const float *x, const uint8_t *w, const uint16_t *scale,\
                                  const uint16_t *min, const float *bias, float *y,       \
                                  int64_t n0, int64_t m0, int64_t N, int64_t K,           \
                                  int64_t group) {                                        \
    enum { NB_ = NB, MB_ = MB };                                                          \
    const int64_t groups = K / group;                                                     \
    const __m128i low = _mm_set1_epi8(0x0F);                                              \
    __m256 acc[NB][MB];                                                                   \
    for (int j = 0; j < NB; j++)                                                          \
        for (int i = 0; i < MB; i++) acc[j][i] = _mm256_setzero_ps();                     \
    for (int64_t g = 0; g < groups; g++) {                                                \
        for (int j = 0; j < NB; j++) {                                                    \
            const int64_t n = n0 + j;                                                     \
            const __m256 s = _mm256_set1_ps(_cvtsh_ss(scale[n * groups + g]));            \
            const __m256 mn = _mm256_set1_ps(_cvtsh_ss(min[n * groups + g]));             \
            for (int64_t k = g * group; k < (g + 1) * group; k += 32) {                   \
                const __m128i bytes = _mm_loadu_si128((const __m128i *)(w + n * (K / 2)   \
                                                                        + k / 2));        \
                const __m128i lo = _mm_and_si128(bytes, low);                             \
                const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);          \
                const __m256 w0 = _mm256_fmadd_ps(u8x8_to_ps(lo), s, mn);                 \
                ACCUMULATE(j, w0, k)                                                      \
                const __m256 w1 = _mm256_fmadd_ps(u8x8_to_ps(_mm_srli_si128(lo, 8)), s, mn); \
                ACCUMULATE(j, w1, k + 8)                                                  \
                const __m256 w2 = _mm256_fmadd_ps(u8x8_to_ps(hi), s, mn);                 \
                ACCUMULATE(j, w2, k + 16)                                                 \
                const __m256 w3 = _mm256_fmadd_ps(u8x8_to_ps(_mm_srli_si128(hi, 8)), s, mn); \
                ACCUMULATE(j, w3, k + 24)                                                 \
            }                                                                             \
        }                                                                                 \
    }                                                                                     \
    STORE_TILE()                                                                          \
}

INT4_TILE(4, 1) INT4_TILE(4, 2) INT4_TILE(4, 3) INT4_TILE(2, 4) INT4_TILE(1, 1)

/* Tiles over [N, M]: a column of tiles per block of channels (threads split the channels).
 * Rows: 4 at a time when there are >= 4 (2-channel tiles), else all (1..3) at once;
 * leftover channels (N not a multiple of the tile width) go one by one, row by row. */
#define DISPATCH(KIND, ...)                                                               \
    _Pragma("omp parallel for schedule(static)")                                          \
    for (int64_t n0 = 0; n0 < N - N % 4; n0 += 4) {                                       \
        int64_t m0 = 0;                                                                   \
        for (; m0 + 4 <= M; m0 += 4) {                                                    \
            KIND##_tile_2_4(__VA_ARGS__, n0, m0, N, K, group);                            \
            KIND##_tile_2_4(__VA_ARGS__, n0 + 2, m0, N, K, group);                        \
        }                                                                                 \
        switch (M - m0) {                                                                 \
            case 3: KIND##_tile_4_3(__VA_ARGS__, n0, m0, N, K, group); break;             \
            case 2: KIND##_tile_4_2(__VA_ARGS__, n0, m0, N, K, group); break;             \
            case 1: KIND##_tile_4_1(__VA_ARGS__, n0, m0, N, K, group); break;             \
        }                                                                                 \
    }                                                                                     \
    for (int64_t n0 = N - N % 4; n0 < N; n0++)                                            \
        for (int64_t m0 = 0; m0 < M; m0++)                                                \
            KIND##_tile_1_1(__VA_ARGS__, n0, m0, N, K, group);

void tm_int4_gemm(const float *x, const uint8_t *w, const uint16_t *scale,
                  const uint16_t *min, const float *bias, float *y, int64_t M, int64_t N,
                  int64_t K, int64_t group) {
    DISPATCH(int4, x, w, scale, min, bias, y)
}

/* int8: one output channel x 4 rows at a time; per-group partial sums scaled once per group
 * (measured faster than the int4 tiles' convert-and-scale per 8 weights: int8 needs no
 * unpacking, so the extra multiply per weight vector is what would bound it). */
#define MB 4

void tm_int8_gemm(const float *x, const int8_t *w, const float *scale, const float *bias,
                  float *y, int64_t M, int64_t N, int64_t K, int64_t group) {
    const int64_t groups = K / group;
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *wn = w + n * K;
        const float *sn = scale + n * groups;
        for (int64_t m0 = 0; m0 < M; m0 += MB) {
            const int64_t mb = M - m0 < MB ? M - m0 : MB;
            __m256 acc[MB], part[MB];
            for (int i = 0; i < MB; i++) acc[i] = _mm256_setzero_ps();
            for (int64_t g = 0; g < groups; g++) {
                for (int i = 0; i < MB; i++) part[i] = _mm256_setzero_ps();
                const int64_t k0 = g * group;
                for (int64_t k = k0; k < k0 + group; k += 8) {
                    const __m256 wv = i8x8_to_ps(wn + k);
                    for (int i = 0; i < mb; i++)
                        part[i] = _mm256_fmadd_ps(_mm256_loadu_ps(x + (m0 + i) * K + k), wv,
                                                  part[i]);
                }
                const __m256 s = _mm256_set1_ps(sn[g]);
                for (int i = 0; i < mb; i++) acc[i] = _mm256_fmadd_ps(part[i], s, acc[i]);
            }
            for (int i = 0; i < mb; i++)
                y[(m0 + i) * N + n] = hsum8(acc[i]) + (bias ? bias[n] : 0.0f);
        }
    }
}

/* ---- integer dot products with 16-bit activations --------------------------------------
 * The float-activation kernels above convert every weight to float (~3 uops per 8 weights).
 * These quantize each row of activations instead, per block of 32 inputs, to int16
 * (symmetric, scale = absmax / 32767, round to nearest even) and multiply by the int8 / int4
 * weights widened to int16 with vpmaddwd into exact int32 block sums, scaled once per block.
 * llama.cpp rounds activations to int8 for this (vpmaddubsw); on the default SmolLM2-135M that
 * turned the chat answer to "What is the capital of France?" into nonsense (llama.cpp's own
 * answer on that file is the same nonsense), while 16 bits keep the relative rounding at ~1e-5
 * for the same number of instructions. Equal to dequantize(x_q16) @ dequantize(W)^T up to
 * float summation order (quantization/schemes.py has that reference). K must be a multiple
 * of 32. Overflow: |w| <= 127 (int4: <= 15), |x| <= 32767, 32 products < 2^31. */

/* x [M, K] -> xq int16 [M, K], xs [M, K/32] block scales, xsum [M, K/32] = xs * sum(xq). */
void tm_quantize_rows_q16(const float *x, int16_t *xq, float *xs, float *xsum, int64_t M,
                          int64_t K) {
    const int64_t blocks = K / 32;
#pragma omp parallel for schedule(static) if (M * K >= 65536)
    for (int64_t i = 0; i < M * blocks; i++) {
        __m256i q[4];
        const float d = round_block32(x + i * 32, 32767.0f, q);
        __m256i total = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) total = _mm256_add_epi32(total, q[j]);
        /* int32 x 16 -> int16 x 16 in input order (packs interleaves the 128-bit lanes) */
        for (int j = 0; j < 2; j++)
            _mm256_storeu_si256((__m256i *)(xq + i * 32 + 16 * j),
                                _mm256_permute4x64_epi64(
                                    _mm256_packs_epi32(q[2 * j], q[2 * j + 1]), 0xD8));
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total),
                                  _mm256_extracti128_si256(total, 1));
        t = _mm_hadd_epi32(t, t);
        t = _mm_hadd_epi32(t, t);
        xs[i] = d;
        xsum[i] = d * (float)_mm_cvtsi128_si32(t);
    }
}

/* 8 int32 partial sums of w[0..32) . x[0..32): w's two halves already widened to int16. */
static inline __m256i dot_16(__m256i w_lo, __m256i w_hi, const int16_t *x) {
    return _mm256_add_epi32(_mm256_madd_epi16(w_lo, _mm256_loadu_si256((const __m256i *)x)),
                            _mm256_madd_epi16(w_hi,
                                              _mm256_loadu_si256((const __m256i *)(x + 16))));
}

#define QMB 4 /* rows sharing each loaded weight block */

/* The row count of a tile is a compile-time constant (1..QMB) in these bodies, so the
 * compiler unrolls the row loops and keeps every accumulator in a register; with a run-time
 * count they lived on the stack and each block waited on a store-to-load round trip. */
INLINE void int8_q16_tile(const int16_t *xq, const float *xs, const int8_t *wn,
                          const float *sn, float *y, float bias, int64_t m0, int64_t n,
                          int64_t N, int64_t K, int64_t group, const int mb) {
    const int64_t blocks = K / 32, per_group = group / 32;
    __m256 acc[QMB], part[QMB];
    for (int i = 0; i < mb; i++) acc[i] = part[i] = _mm256_setzero_ps();
    /* One flat loop over blocks; a group's partial sums join acc at its last block. Nested
     * group and block loops kept their counters in vector registers and spent ~3x the
     * instructions per block on them (GGUF Q8_0 has one block per group): the batch-1 GEMV
     * moved ~17 GB/s instead of the ~30 the memory gives. */
    for (int64_t b = 0, left = per_group, g = 0; b < blocks; b++) {
        const __m128i *wb = (const __m128i *)(wn + b * 32);
        const __m256i w_lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(wb));
        const __m256i w_hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(wb + 1));
        for (int i = 0; i < mb; i++)
            part[i] = _mm256_fmadd_ps(
                _mm256_cvtepi32_ps(dot_16(w_lo, w_hi, xq + (m0 + i) * K + b * 32)),
                _mm256_set1_ps(xs[(m0 + i) * blocks + b]), part[i]);
        if (--left == 0) {
            const __m256 s = _mm256_set1_ps(sn[g++]);
            for (int i = 0; i < mb; i++) {
                acc[i] = _mm256_fmadd_ps(part[i], s, acc[i]);
                part[i] = _mm256_setzero_ps();
            }
            left = per_group;
        }
    }
    for (int i = 0; i < mb; i++) y[(m0 + i) * N + n] = hsum8(acc[i]) + bias;
}

void tm_int8_gemm_q16(const int16_t *xq, const float *xs, const int8_t *w, const float *scale,
                      const float *bias, float *y, int64_t M, int64_t N, int64_t K,
                      int64_t group) {
    const int64_t groups = K / group;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *wn = w + n * K;
        const float *sn = scale + n * groups, b = bias ? bias[n] : 0.0f;
        int64_t m0 = 0;
        for (; m0 + QMB <= M; m0 += QMB)
            int8_q16_tile(xq, xs, wn, sn, y, b, m0, n, N, K, group, QMB);
        switch (M - m0) {
            case 3: int8_q16_tile(xq, xs, wn, sn, y, b, m0, n, N, K, group, 3); break;
            case 2: int8_q16_tile(xq, xs, wn, sn, y, b, m0, n, N, K, group, 2); break;
            case 1: int8_q16_tile(xq, xs, wn, sn, y, b, m0, n, N, K, group, 1); break;
        }
    }
}

/* int4 (Q4 layout, group 32: one fp16 scale and min per block). Per block b and row:
 * y += (s_b * xs_b) * sum(q * xq) + m_b * xsum_b; the per-block factors of 8 blocks are
 * computed together in vector registers. */
INLINE void int4_q16_tile(const int16_t *xq, const float *xs, const float *xsum,
                          const uint8_t *wn, const uint16_t *sn, const uint16_t *mn, float *y,
                          float bias, int64_t m0, int64_t n, int64_t N, int64_t K,
                          const int mb) {
    const int64_t blocks = K / 32;
    const __m128i low = _mm_set1_epi8(0x0F);
    __m256 acc[QMB], macc[QMB];
    float ds[QMB][8] __attribute__((aligned(32)));
    float extra[QMB] = {0};
    for (int i = 0; i < mb; i++) acc[i] = macc[i] = _mm256_setzero_ps();
    for (int64_t c = 0; c < blocks; c += 8) {
        const int nb = blocks - c < 8 ? (int)(blocks - c) : 8;
        if (nb == 8) {
            const __m256 s8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sn + c)));
            const __m256 m8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mn + c)));
            for (int i = 0; i < mb; i++) {
                const int64_t xb = (m0 + i) * blocks + c;
                _mm256_store_ps(ds[i], _mm256_mul_ps(s8, _mm256_loadu_ps(xs + xb)));
                macc[i] = _mm256_fmadd_ps(m8, _mm256_loadu_ps(xsum + xb), macc[i]);
            }
        } else {
            for (int i = 0; i < mb; i++) {
                const int64_t xb = (m0 + i) * blocks + c;
                for (int j = 0; j < nb; j++) {
                    ds[i][j] = _cvtsh_ss(sn[c + j]) * xs[xb + j];
                    extra[i] += _cvtsh_ss(mn[c + j]) * xsum[xb + j];
                }
            }
        }
        for (int j = 0; j < nb; j++) {
            const int64_t b = c + j;
            const __m128i bytes = _mm_loadu_si128((const __m128i *)(wn + b * 16));
            const __m256i w_lo = _mm256_cvtepu8_epi16(_mm_and_si128(bytes, low));
            const __m256i w_hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(bytes, 4),
                                                                    low));
            for (int i = 0; i < mb; i++)
                acc[i] = _mm256_fmadd_ps(
                    _mm256_cvtepi32_ps(dot_16(w_lo, w_hi, xq + (m0 + i) * K + b * 32)),
                    _mm256_set1_ps(ds[i][j]), acc[i]);
        }
    }
    for (int i = 0; i < mb; i++)
        y[(m0 + i) * N + n] = hsum8(acc[i]) + hsum8(macc[i]) + extra[i] + bias;
}

void tm_int4_gemm_q16(const int16_t *xq, const float *xs, const float *xsum, const uint8_t *w,
                      const uint16_t *scale, const uint16_t *min, const float *bias, float *y,
                      int64_t M, int64_t N, int64_t K) {
    const int64_t blocks = K / 32;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *wn = w + n * (K / 2);
        const uint16_t *sn = scale + n * blocks, *mn = min + n * blocks;
        const float b = bias ? bias[n] : 0.0f;
        int64_t m0 = 0;
        for (; m0 + QMB <= M; m0 += QMB)
            int4_q16_tile(xq, xs, xsum, wn, sn, mn, y, b, m0, n, N, K, QMB);
        switch (M - m0) {
            case 3: int4_q16_tile(xq, xs, xsum, wn, sn, mn, y, b, m0, n, N, K, 3); break;
            case 2: int4_q16_tile(xq, xs, xsum, wn, sn, mn, y, b, m0, n, N, K, 2); break;
            case 1: int4_q16_tile(xq, xs, xsum, wn, sn, mn, y, b, m0, n, N, K, 1); break;
        }
    }
}
