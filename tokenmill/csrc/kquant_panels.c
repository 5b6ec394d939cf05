/* GGUF Q4_K and Q6_K weights times int16 activations, kept at (about) their stored size.
 *
 * vnni_panels.c's int4 / int8 layouts hold a Q4_K weight in 5 bits (fp16 scale and min per
 * 32 inputs) and a Q6_K one in 10 (int8 plus a float32 scale per 16): 1.1x and 1.5x the
 * file. Here the K-quants' two-level scales stay as they are stored: 6-bit group scales (and
 * mins) in bytes, times a float32 factor per 256 inputs and channel, applied per block as the
 * sums come out; Q6_K's six bits are a nibble plane (as the int4 panels) plus a plane of the
 * two high bits. Per panel of 16 output channels, K a multiple of 256, one contiguous blob:
 *   Q4_K: nibble pairs [K/2][16] | scales [K/32][16] u8 | mins [K/32][16] u8
 *         | d [K/256][16] f32 | dmin [K/256][16] f32                           (4.75 bits)
 *   Q6_K: nibble pairs [K/2][16] | high bits [K/4][16] (2 per input, 4 inputs a byte)
 *         | scales [K/16][16] i8 | d [K/256][16] f32                            (6.625 bits)
 * A nibble pair byte holds inputs 2j (low) and 2j + 1 (high) of its channel. Q4_K's weight is
 * d sc q - dmin m (q 0..15); Q6_K's d sc (q - 32) (q 0..63, scales per 16 inputs).
 *
 * Rounding as vnni_panels.c: activations in int16 per 32 inputs (tm_quantize_rows_q16),
 * exact int32 sums per block (Q6_K: per 16-input half), then per block and row
 * y += float(sum) * ((d * sc) * xs) (Q4_K: then y -= (dmin * m) * xsum). The AVX2 build runs
 * the same float operations per lane, so both give identical results. */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"
#include "simd.h"

#define KP 16 /* output channels per panel */

int64_t tm_kquant_panel_bytes(int64_t K, int64_t q6) {
    return q6 ? K / 2 * KP + K / 4 * KP + K / 16 * KP + K / 256 * KP * 4
              : K / 2 * KP + 2 * (K / 32 * KP) + 2 * (K / 256 * KP * 4);
}

typedef struct {
    const uint8_t *w, *hi, *sc, *mn;
    const float *d, *dmin;
} kpanel;

static kpanel kpanel_at(const uint8_t *blob, int64_t K, const int q6) {
    kpanel p = {blob, NULL, NULL, NULL, NULL, NULL};
    const uint8_t *at = blob + K / 2 * KP;
    if (q6) {
        p.hi = at;
        p.sc = at + K / 4 * KP;
        p.d = (const float *)(p.sc + K / 16 * KP);
    } else {
        p.sc = at;
        p.mn = at + K / 32 * KP;
        p.d = (const float *)(p.mn + K / 32 * KP);
        p.dmin = p.d + K / 256 * KP;
    }
    return p;
}

static inline int32_t pair_of(const int16_t *x) {
    int32_t v;
    memcpy(&v, x, sizeof v);
    return v;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define KMR 12

/* pair j of the 16 channels as dwords (input 2j | input 2j + 1 << 16) */
INLINE __m512i pairs16(kpanel pn, int64_t j, const int q6) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(pn.w + j * KP)));
    const __m512i lo = _mm512_ternarylogic_epi32(b, _mm512_slli_epi32(b, 12),
                                                 _mm512_set1_epi32(0x000F000F), 0xA8);
    if (!q6) return lo;
    const __m512i h = _mm512_srli_epi32(
        _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(pn.hi + j / 2 * KP))),
        (unsigned)(j & 1) * 4);
    const __m512i three = _mm512_set1_epi32(3);
    const __m512i high = _mm512_or_si512(
        _mm512_slli_epi32(_mm512_and_si512(h, three), 4),
        _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h, 2), three), 20));
    return _mm512_sub_epi16(_mm512_or_si512(lo, high), _mm512_set1_epi16(32));
}

INLINE void ktile(const int16_t *xq, const float *xs, const float *xsum, kpanel pn, float *y,
                  const float *bias, int64_t n0, int64_t N, int64_t K, const int mr,
                  const int q6) {
    const int64_t blocks = K / 32;
    const int parts = q6 ? 2 : 1;
    __m512 acc[KMR];
    for (int i = 0; i < mr; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const __m512 d = _mm512_loadu_ps(pn.d + b / 8 * KP);
        for (int part = 0; part < parts; part++) {
            __m512i sum[KMR];
            for (int i = 0; i < mr; i++) sum[i] = _mm512_setzero_si512();
            for (int j = part * 16 / parts; j < (part + 1) * 16 / parts; j++) {
                const __m512i w = pairs16(pn, b * 16 + j, q6);
                for (int i = 0; i < mr; i++)
                    sum[i] = _mm512_dpwssd_epi32(
                        sum[i], w, _mm512_set1_epi32(pair_of(xq + i * K + b * 32 + 2 * j)));
            }
            const __m128i raw = _mm_loadu_si128(
                (const __m128i *)(pn.sc + (q6 ? 2 * b + part : b) * KP));
            const __m512 sc = _mm512_cvtepi32_ps(q6 ? _mm512_cvtepi8_epi32(raw)
                                                    : _mm512_cvtepu8_epi32(raw));
            const __m512 ws = _mm512_mul_ps(d, sc);
            for (int i = 0; i < mr; i++)
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[i]),
                                         _mm512_mul_ps(ws, _mm512_set1_ps(xs[i * blocks + b])),
                                         acc[i]);
        }
        if (!q6) {
            const __m512 m = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                _mm_loadu_si128((const __m128i *)(pn.mn + b * KP))));
            const __m512 wm = _mm512_mul_ps(_mm512_loadu_ps(pn.dmin + b / 8 * KP), m);
            for (int i = 0; i < mr; i++)
                acc[i] = _mm512_fnmadd_ps(wm, _mm512_set1_ps(xsum[i * blocks + b]), acc[i]);
        }
    }
    const int64_t width = N - n0 < KP ? N - n0 : KP;
    const __mmask16 keep = (__mmask16)((1u << width) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(keep, bias + n0) : _mm512_setzero_ps();
    for (int i = 0; i < mr; i++)
        _mm512_mask_storeu_ps(y + i * N + n0, keep, _mm512_add_ps(acc[i], bv));
}
#else
#define KMR 6

/* channels [8h, 8h + 8) of pair j as dwords */
INLINE __m256i pairs8(kpanel pn, int64_t j, int h, const int q6) {
    const __m256i b = _mm256_cvtepu8_epi32(
        _mm_loadl_epi64((const __m128i *)(pn.w + j * KP + 8 * h)));
    const __m256i lo = _mm256_and_si256(_mm256_or_si256(b, _mm256_slli_epi32(b, 12)),
                                        _mm256_set1_epi32(0x000F000F));
    if (!q6) return lo;
    const __m256i h8 = _mm256_srli_epi32(
        _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(pn.hi + j / 2 * KP + 8 * h))),
        (int)(j & 1) * 4);
    const __m256i three = _mm256_set1_epi32(3);
    const __m256i high = _mm256_or_si256(
        _mm256_slli_epi32(_mm256_and_si256(h8, three), 4),
        _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(h8, 2), three), 20));
    return _mm256_sub_epi16(_mm256_or_si256(lo, high), _mm256_set1_epi16(32));
}

INLINE void ktile(const int16_t *xq, const float *xs, const float *xsum, kpanel pn, float *y,
                  const float *bias, int64_t n0, int64_t N, int64_t K, const int mr,
                  const int q6) {
    const int64_t blocks = K / 32;
    const int parts = q6 ? 2 : 1;
    for (int h = 0; h < 2; h++) {
        __m256 acc[KMR];
        for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_ps();
        for (int64_t b = 0; b < blocks; b++) {
            const __m256 d = _mm256_loadu_ps(pn.d + b / 8 * KP + 8 * h);
            for (int part = 0; part < parts; part++) {
                __m256i sum[KMR];
                for (int i = 0; i < mr; i++) sum[i] = _mm256_setzero_si256();
                for (int j = part * 16 / parts; j < (part + 1) * 16 / parts; j++) {
                    const __m256i w = pairs8(pn, b * 16 + j, h, q6);
                    for (int i = 0; i < mr; i++)
                        sum[i] = _mm256_add_epi32(sum[i], _mm256_madd_epi16(
                            w, _mm256_set1_epi32(pair_of(xq + i * K + b * 32 + 2 * j))));
                }
                const __m128i raw = _mm_loadl_epi64(
                    (const __m128i *)(pn.sc + (q6 ? 2 * b + part : b) * KP + 8 * h));
                const __m256 sc = _mm256_cvtepi32_ps(q6 ? _mm256_cvtepi8_epi32(raw)
                                                        : _mm256_cvtepu8_epi32(raw));
                const __m256 ws = _mm256_mul_ps(d, sc);
                for (int i = 0; i < mr; i++)
                    acc[i] = _mm256_fmadd_ps(
                        _mm256_cvtepi32_ps(sum[i]),
                        _mm256_mul_ps(ws, _mm256_set1_ps(xs[i * blocks + b])), acc[i]);
            }
            if (!q6) {
                const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                    _mm_loadl_epi64((const __m128i *)(pn.mn + b * KP + 8 * h))));
                const __m256 wm = _mm256_mul_ps(_mm256_loadu_ps(pn.dmin + b / 8 * KP + 8 * h),
                                                m);
                for (int i = 0; i < mr; i++)
                    acc[i] = _mm256_fnmadd_ps(wm, _mm256_set1_ps(xsum[i * blocks + b]),
                                              acc[i]);
            }
        }
        float out[KMR][8] __attribute__((aligned(32)));
        for (int i = 0; i < mr; i++) _mm256_store_ps(out[i], acc[i]);
        for (int c = 0; c < 8; c++) {
            const int64_t n = n0 + 8 * h + c;
            if (n >= N) break;
            for (int i = 0; i < mr; i++) y[i * N + n] = out[i][c] + (bias ? bias[n] : 0.0f);
        }
    }
}
#endif

/* Whole panels per thread; all rows of a panel in tiles of KMR rows. */
INLINE void kgemm(const int16_t *xq, const float *xs, const float *xsum, const uint8_t *blob,
                  const float *bias, float *y, int64_t M, int64_t N, int64_t K, const int q6) {
    const int64_t panels = (N + KP - 1) / KP, blocks = K / 32;
    const int64_t bytes = tm_kquant_panel_bytes(K, q6);
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        const kpanel pn = kpanel_at(blob + p * bytes, K, q6);
        int64_t m0 = 0;
        for (; m0 + KMR <= M; m0 += KMR)
            ktile(xq + m0 * K, xs + m0 * blocks, xsum + m0 * blocks, pn, y + m0 * N, bias,
                  p * KP, N, K, KMR, q6);
        switch (M - m0) {
#define TILE(R) case R: ktile(xq + m0 * K, xs + m0 * blocks, xsum + m0 * blocks, pn, \
                              y + m0 * N, bias, p * KP, N, K, R, q6); break;
            TILE(1) TILE(2) TILE(3) TILE(4) TILE(5)
#if KMR > 6
            TILE(6) TILE(7) TILE(8) TILE(9) TILE(10) TILE(11)
#endif
#undef TILE
        }
    }
}

void tm_q4k_gemm(const int16_t *xq, const float *xs, const float *xsum, const uint8_t *blob,
                 const float *bias, float *y, int64_t M, int64_t N, int64_t K) {
    kgemm(xq, xs, xsum, blob, bias, y, M, N, K, 0);
}

void tm_q6k_gemm(const int16_t *xq, const float *xs, const float *xsum, const uint8_t *blob,
                 const float *bias, float *y, int64_t M, int64_t N, int64_t K) {
    kgemm(xq, xs, xsum, blob, bias, y, M, N, K, 1);
}
