/* GGUF Q4_K and Q6_K weights times int16 activations, kept at (about) their stored size.
 *
 * vnni_panels.c's int4 / int8 layouts hold a Q4_K weight in 5 bits (fp16 scale and min per
 * 32 inputs) and a Q6_K one in 10 (int8 plus a float32 scale per 16): 1.1x and 1.5x the
 * file. Here the K-quants' two-level scales stay as they are stored: 6-bit group scales (and
 * mins) in bytes, times a float32 factor per 256 inputs and channel, applied per block as the
 * sums come out; Q6_K's six bits are a nibble plane (as the int4 panels) plus a plane of the
 * two high bits. A panel (16 output channels, K a multiple of 256) is one run of
 * super-blocks of 256 inputs, each holding, in the order a block's sums read them:
 *   Q4_K: d [16] f32 | dmin [16] f32 | scales [8][16] u8 | mins [8][16] u8
 *         | nibble pairs [128][16]                                     (2432 bytes: 4.75 bits)
 *   Q6_K: d [16] f32 | scales [16][16] i8 | high bits [64][16] (2 per input, 4 a byte)
 *         | nibble pairs [128][16]                                     (3392 bytes: 6.625 bits)
 * so the weights stream through memory in one pass (factors kept apart from the values cost
 * every panel cache misses the prefetcher did not cover: 1.6x slower from DRAM). A nibble
 * pair byte holds inputs 2j (low) and 2j + 1 (high) of its channel. Q4_K's weight is
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

#define SUPER(q6) ((q6) ? 3392 : 2432) /* bytes of a super-block of 256 inputs */

int64_t tm_kquant_panel_bytes(int64_t K, int64_t q6) { return K / 256 * SUPER(q6); }

typedef struct {
    const uint8_t *blob; /* the panel's run of super-blocks */
} kpanel;

/* the parts of block b (32 inputs), found in its super-block */
static inline const uint8_t *super_of(kpanel pn, int64_t b, const int q6) {
    return pn.blob + b / 8 * SUPER(q6);
}

static inline const float *d_of(kpanel pn, int64_t b, const int q6) {
    return (const float *)super_of(pn, b, q6);
}

static inline const float *dmin_of(kpanel pn, int64_t b) { /* Q4_K */
    return (const float *)(super_of(pn, b, 0) + 64);
}

/* the 16 channels' scales of block b (Q6_K: of its half `part`) */
static inline const uint8_t *sc_of(kpanel pn, int64_t b, int part, const int q6) {
    return q6 ? super_of(pn, b, 1) + 64 + (b % 8 * 2 + part) * KP
              : super_of(pn, b, 0) + 128 + b % 8 * KP;
}

static inline const uint8_t *mn_of(kpanel pn, int64_t b) { /* Q4_K */
    return super_of(pn, b, 0) + 256 + b % 8 * KP;
}

/* pair j (0..15) of block b: its nibble bytes, and (Q6_K) its high-bit bytes */
static inline const uint8_t *w_of(kpanel pn, int64_t b, int j, const int q6) {
    return super_of(pn, b, q6) + (q6 ? 1344 : 384) + (b % 8 * 16 + j) * KP;
}

static inline const uint8_t *hi_of(kpanel pn, int64_t b, int j) {
    return super_of(pn, b, 1) + 320 + (b % 8 * 16 + j) / 2 * KP;
}

static inline int32_t pair_of(const int16_t *x) {
    int32_t v;
    memcpy(&v, x, sizeof v);
    return v;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)

/* pair j of block b, the 16 channels as dwords (input 2j | input 2j + 1 << 16) */
INLINE __m512i pairs16(kpanel pn, int64_t b, int j, const int q6) {
    const __m512i v = _mm512_cvtepu8_epi32(
        _mm_loadu_si128((const __m128i *)w_of(pn, b, j, q6)));
    const __m512i lo = _mm512_ternarylogic_epi32(v, _mm512_slli_epi32(v, 12),
                                                 _mm512_set1_epi32(0x000F000F), 0xA8);
    if (!q6) return lo;
    /* the byte's bits 2t..2t+1 are input 4i + t's high bits: an even pair's two inputs move
     * from bits 0-1 / 2-3 to 4-5 / 20-21, an odd pair's from 4-5 / 6-7 */
    const __m512i h = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)hi_of(pn, b, j)));
    const __m512i high = _mm512_ternarylogic_epi32(
        (j & 1) ? h : _mm512_slli_epi32(h, 4), _mm512_slli_epi32(h, (j & 1) ? 14 : 18),
        _mm512_set1_epi32(0x00300030), 0xA8);
    return _mm512_sub_epi16(_mm512_or_si512(lo, high), _mm512_set1_epi16(32));
}

/* the int32 sums of pairs [j0, j1) of block b (compile-time bounds: unrolled) */
INLINE void sums16(__m512i *sum, const int16_t *xq, int64_t K, kpanel pn, int64_t b,
                   const int j0, const int j1, const int mr, const int q6) {
    for (int i = 0; i < mr; i++) sum[i] = _mm512_setzero_si512();
    for (int j = j0; j < j1; j++) {
        const __m512i w = pairs16(pn, b, j, q6);
        for (int i = 0; i < mr; i++)
            sum[i] = _mm512_dpwssd_epi32(
                sum[i], w, _mm512_set1_epi32(pair_of(xq + i * K + b * 32 + 2 * j)));
    }
}

INLINE void ktile(const int16_t *xq, const float *xs, const float *xsum, kpanel pn, float *y,
                  const float *bias, int64_t n0, int64_t N, int64_t K, const int mr,
                  const int q6) {
    const int64_t blocks = K / 32;
    const int parts = q6 ? 2 : 1;
    __m512 acc[PANEL_ROWS];
    for (int i = 0; i < mr; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const __m512 d = _mm512_loadu_ps(d_of(pn, b, q6));
        for (int part = 0; part < parts; part++) {
            __m512i sum[PANEL_ROWS];
            if (!q6)
                sums16(sum, xq, K, pn, b, 0, 16, mr, q6);
            else if (part == 0)
                sums16(sum, xq, K, pn, b, 0, 8, mr, q6);
            else
                sums16(sum, xq, K, pn, b, 8, 16, mr, q6);
            const __m128i raw = _mm_loadu_si128((const __m128i *)sc_of(pn, b, part, q6));
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
                _mm_loadu_si128((const __m128i *)mn_of(pn, b))));
            const __m512 wm = _mm512_mul_ps(_mm512_loadu_ps(dmin_of(pn, b)), m);
            for (int i = 0; i < mr; i++)
                acc[i] = _mm512_fnmadd_ps(wm, _mm512_set1_ps(xsum[i * blocks + b]), acc[i]);
        }
    }
    store_panel16(acc, mr, y, bias, n0, N);
}
#else

/* channels [8h, 8h + 8) of pair j as dwords */
INLINE __m256i pairs8(kpanel pn, int64_t b, int j, int h, const int q6) {
    const __m256i v = _mm256_cvtepu8_epi32(
        _mm_loadl_epi64((const __m128i *)(w_of(pn, b, j, q6) + 8 * h)));
    const __m256i lo = _mm256_and_si256(_mm256_or_si256(v, _mm256_slli_epi32(v, 12)),
                                        _mm256_set1_epi32(0x000F000F));
    if (!q6) return lo;
    const __m256i h8 = _mm256_cvtepu8_epi32(
        _mm_loadl_epi64((const __m128i *)(hi_of(pn, b, j) + 8 * h)));
    const __m256i high = _mm256_and_si256(
        _mm256_or_si256((j & 1) ? h8 : _mm256_slli_epi32(h8, 4),
                        _mm256_slli_epi32(h8, (j & 1) ? 14 : 18)),
        _mm256_set1_epi32(0x00300030));
    return _mm256_sub_epi16(_mm256_or_si256(lo, high), _mm256_set1_epi16(32));
}

INLINE void sums8(__m256i *sum, const int16_t *xq, int64_t K, kpanel pn, int64_t b, int h,
                  const int j0, const int j1, const int mr, const int q6) {
    for (int i = 0; i < mr; i++) sum[i] = _mm256_setzero_si256();
    for (int j = j0; j < j1; j++) {
        const __m256i w = pairs8(pn, b, j, h, q6);
        for (int i = 0; i < mr; i++)
            sum[i] = _mm256_add_epi32(sum[i], _mm256_madd_epi16(
                w, _mm256_set1_epi32(pair_of(xq + i * K + b * 32 + 2 * j))));
    }
}

INLINE void ktile(const int16_t *xq, const float *xs, const float *xsum, kpanel pn, float *y,
                  const float *bias, int64_t n0, int64_t N, int64_t K, const int mr,
                  const int q6) {
    const int64_t blocks = K / 32;
    const int parts = q6 ? 2 : 1;
    for (int h = 0; h < 2; h++) {
        __m256 acc[PANEL_ROWS];
        for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_ps();
        for (int64_t b = 0; b < blocks; b++) {
            const __m256 d = _mm256_loadu_ps(d_of(pn, b, q6) + 8 * h);
            for (int part = 0; part < parts; part++) {
                __m256i sum[PANEL_ROWS];
                if (!q6)
                    sums8(sum, xq, K, pn, b, h, 0, 16, mr, q6);
                else if (part == 0)
                    sums8(sum, xq, K, pn, b, h, 0, 8, mr, q6);
                else
                    sums8(sum, xq, K, pn, b, h, 8, 16, mr, q6);
                const __m128i raw =
                    _mm_loadl_epi64((const __m128i *)(sc_of(pn, b, part, q6) + 8 * h));
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
                    _mm_loadl_epi64((const __m128i *)(mn_of(pn, b) + 8 * h))));
                const __m256 wm = _mm256_mul_ps(_mm256_loadu_ps(dmin_of(pn, b) + 8 * h), m);
                for (int i = 0; i < mr; i++)
                    acc[i] = _mm256_fnmadd_ps(wm, _mm256_set1_ps(xsum[i * blocks + b]),
                                              acc[i]);
            }
        }
        store_panel8(acc, mr, y, bias, n0 + 8 * h, N);
    }
}
#endif

/* Whole panels per thread; all rows of a panel in tiles of PANEL_ROWS rows. */
INLINE void kgemm(const int16_t *xq, const float *xs, const float *xsum, const uint8_t *blob,
                  const float *bias, float *y, int64_t M, int64_t N, int64_t K, const int q6) {
    const int64_t panels = (N + KP - 1) / KP, blocks = K / 32;
    const int64_t bytes = tm_kquant_panel_bytes(K, q6);
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        const kpanel pn = {blob + p * bytes};
#define TILE(m0, R) ktile(xq + (m0) * K, xs + (m0) * blocks, xsum + (m0) * blocks, pn, \
                         y + (m0) * N, bias, p * KP, N, K, R, q6)
        PANEL_ROW_TILES(M, TILE);
#undef TILE
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
