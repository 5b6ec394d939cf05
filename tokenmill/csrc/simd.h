/* AVX2 helpers shared by the kernels in this folder. */
#pragma once
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

/* for kernel bodies whose loop counts must be compile-time constants to stay in registers */
#define INLINE static inline __attribute__((always_inline))

/* fp32 -> bf16, rounded to nearest, ties to even (NaN stays a quiet NaN) */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

/* sum of the 8 lanes */
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* e^x on 8 lanes: Cody-Waite reduction to 2^n * e^r, |r| <= ln2/2, then a degree-6
 * polynomial (~2 ulp). Below -87 the result is 0 (so -inf gives 0), above 88 it saturates at
 * e^88. */
static inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    const __m256 underflow = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.3981999507e-3f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                         _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(underflow, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

#ifdef __AVX512F__
/* exp8's arithmetic on 16 lanes (lane for lane the same results) */
static inline __m512 exp16(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.0f);
    const __mmask16 underflow = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_min_ps(_mm512_max_ps(x, lo), _mm512_set1_ps(88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.3981999507e-3f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n),
                                                         _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps((__mmask16)~underflow, p, _mm512_castsi512_ps(e));
}
#endif

/* silu(g) * u = g / (1 + e^-g) * u on 8 lanes: the MLP's gated activation, whether run as its
 * own pass (layer_ops.c) or on a GEMM's sums (f32_panel.c), with the same roundings. */
static inline __m256 silu_mul8(__m256 g, __m256 u) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u);
}

/* The largest of s[0 .. n) (-inf for none), 8 lanes at a time: the scalar loop a compiler
 * keeps for a float maximum cost as much as the exponentials of a softmax chunk. */
static inline float max_of(const float *s, int64_t n) {
    __m256 mv = _mm256_set1_ps(-__builtin_inff());
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + j));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    float mx = _mm_cvtss_f32(h);
    for (; j < n; j++) mx = s[j] > mx ? s[j] : mx;
    return mx;
}

/* s[0 .. n) = e^(s - mx) in place, 8 at a time (n rounded up to 8: pad with -inf, which
 * gives 0); returns their sum. The weights of one softmax chunk. */
static inline float exp_minus_max(float *s, int64_t n, float mx) {
    const __m256 mv = _mm256_set1_ps(mx);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; j += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
        _mm256_storeu_ps(s + j, e);
        sum = _mm256_add_ps(sum, e);
    }
    return hsum8(sum);
}

/* The integer-dot kernels' activation rounding (gemm.c's int16, kquant_panels.c's split
 * halves): x[0 .. 32) times top / max|x|, rounded to the nearest integer (ties to even) into
 * q[0 .. 4) (8 lanes each); returns the block's scale max|x| / top (an all-zero block: 0,
 * its integers 0). */
static inline float round_block32(const float *x, float top, __m256i *q) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++) {
        v[j] = _mm256_loadu_ps(x + 8 * j);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[j]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float m = _mm_cvtss_f32(m4);
    const __m256 id = _mm256_set1_ps(m != 0.0f ? top / m : 0.0f);
    for (int j = 0; j < 4; j++)
        q[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[j], id),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    return m / top;
}

/* The panel kernels (vnni_panels.c, kquant_panels.c): output channels in panels of 16 across
 * the lanes, rows in register tiles of PANEL_ROWS (12 with AVX-512 VNNI's 32 registers, 6
 * with AVX2's 16). */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define PANEL_ROWS 12
#define PANEL_TILES_WIDE(TILE)                                                           \
    PANEL_TILE_CASE(TILE, 6) PANEL_TILE_CASE(TILE, 7) PANEL_TILE_CASE(TILE, 8)           \
    PANEL_TILE_CASE(TILE, 9) PANEL_TILE_CASE(TILE, 10) PANEL_TILE_CASE(TILE, 11)

/* y[i, n0 .. n0 + 16) = acc[i] + bias for rows i < mr (channels past N left alone) */
static inline void store_panel16(const __m512 *acc, int mr, float *y, const float *bias,
                                 int64_t n0, int64_t N) {
    const int64_t width = N - n0 < 16 ? N - n0 : 16;
    const __mmask16 keep = (__mmask16)((1u << width) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(keep, bias + n0) : _mm512_setzero_ps();
    for (int i = 0; i < mr; i++)
        _mm512_mask_storeu_ps(y + i * N + n0, keep, _mm512_add_ps(acc[i], bv));
}
#else
#define PANEL_ROWS 6
#define PANEL_TILES_WIDE(TILE)
#endif

/* y[i, n0 .. n0 + 8) = acc[i] + bias for rows i < mr, lane by lane (channels past N left
 * alone): the AVX2 builds' half panels */
static inline void store_panel8(const __m256 *acc, int mr, float *y, const float *bias,
                                int64_t n0, int64_t N) {
    float out[PANEL_ROWS][8] __attribute__((aligned(32)));
    for (int i = 0; i < mr; i++) _mm256_store_ps(out[i], acc[i]);
    for (int c = 0; c < 8 && n0 + c < N; c++)
        for (int i = 0; i < mr; i++) y[i * N + n0 + c] = out[i][c] + (bias ? bias[n0 + c] : 0.0f);
}

/* Rows [0, M) of one panel: whole tiles of PANEL_ROWS, then the rest as one tile of its own
 * constant height (so the tile's loops stay unrolled). TILE(m0, rows) runs one. */
#define PANEL_ROW_TILES(M, TILE) PANEL_ROW_TILES_OF(M, TILE, PANEL_ROWS)
/* the same in tiles of ROWS (at most PANEL_ROWS) */
#define PANEL_ROW_TILES_OF(M, TILE, ROWS)                                                \
    do {                                                                                 \
        int64_t m0 = 0;                                                                  \
        for (; m0 + (ROWS) <= (M); m0 += (ROWS)) TILE(m0, (ROWS));                       \
        switch ((M) - m0) {                                                              \
            PANEL_TILE_CASE(TILE, 1) PANEL_TILE_CASE(TILE, 2) PANEL_TILE_CASE(TILE, 3)   \
            PANEL_TILE_CASE(TILE, 4) PANEL_TILE_CASE(TILE, 5)                            \
            PANEL_TILES_WIDE(TILE)                                                       \
        }                                                                                \
    } while (0)
#define PANEL_TILE_CASE(TILE, R) case R: TILE(m0, R); break;

