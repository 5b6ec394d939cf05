/* GGUF Q4_K and Q6_K weights kept at (about) their stored size, times activations split into
 * two int8 halves, with the byte dot products of `vpdpbusd` (AVX-512 VNNI) or
 * `vpmaddubsw` (AVX2).
 *
 * vnni_panels.c's int4 / int8 layouts hold a Q4_K weight in 5 bits (fp16 scale and min per
 * 32 inputs) and a Q6_K one in 10 (int8 plus a float32 scale per 16): 1.1x and 1.5x the
 * file. Here the K-quants' two-level scales stay as they are stored: 6-bit group scales (and
 * mins) in bytes, times a float32 factor per 256 inputs and channel, applied per block as the
 * sums come out. A panel (16 output channels, K a multiple of 256) is one run of
 * super-blocks of 256 inputs, each holding, in the order a block's sums read them:
 *   Q4_K: d [16] f32 | dmin [16] f32 | scales [8][16] u8 | mins [8][16] u8
 *         | values [32][16][4] u8                                      (2432 bytes: 4.75 bits)
 *   Q6_K: d [16] f32 | scales [16][16] i8 | high bits [16][16][4] u8
 *         | values [32][16][4] u8                                      (3392 bytes: 6.625 bits)
 * so the weights stream through memory in one pass (factors kept apart from the values cost
 * every panel cache misses the prefetcher did not cover: 1.6x slower from DRAM). values[g][c]
 * are channel c's inputs 8g .. 8g + 8: byte t holds input 8g + t in its low nibble and
 * 8g + 4 + t in its high one, so a load and a mask give 16 channels x 4 inputs, one per byte,
 * what a byte dot product multiplies by 4 broadcast activation bytes. Q6_K's high bits[h][c]
 * are channel c's inputs 16h .. 16h + 16: byte t holds the high two bits of inputs 16h + t,
 * 16h + 4 + t, 16h + 8 + t, 16h + 12 + t in bits 0-1, 2-3, 4-5, 6-7, each moved into place
 * by one shift. Q4_K's weight is d sc q - dmin m (q 0..15); Q6_K's d sc (q - 32) (q 0..63,
 * scales per 16 inputs).
 *
 * Activations (tm_quantize_rows_q8x2): per 32 inputs, integers a in [-32639, 32639] (scale
 * absmax / 32639, ties to even: the 15 bits of the int16 kernels, not llama.cpp's 8, whose
 * rounding vnni_panels.c's notes found too coarse), each split as a = 256 hi + lo with hi in
 * [-127, 127] and lo in [-128, 127], stored per row as a plane of his then a plane of los.
 * The byte products of unsigned weight values and signed halves then give exact int32 sums
 * q . a = 256 (q . hi) + (q . lo) per block (Q6_K: per 16-input half, minus 32 times the
 * half's sum of a), and per block and row y += float(sum) * ((d * sc) * xs) (Q4_K: then
 * y -= (dmin * m) * xsum). The AVX2 build runs the same float operations per lane, so both
 * builds give identical results. Overflow: AVX2's int16 sums of byte products stay below
 * 2^15 (Q4_K: 8 products of 2 x 15 x 128; Q6_K: 2 of 2 x 63 x 128). */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"
#include "simd.h"

#define KP 16 /* output channels per panel */
/* rows per register tile: fewer than the other panel kernels' (each row's block sums need an
 * int16 and an int32 accumulator besides its float one); AVX2 at 16 or 32 rows: 4 rows
 * 10-20 % faster than 3 or 6 */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define KQ_ROWS 8
#else
#define KQ_ROWS 4
#endif
#define TOP 32639 /* 127 * 256 + 127: the largest integer whose halves are both int8 */

#define SUPER(q6) ((q6) ? 3392 : 2432) /* bytes of a super-block of 256 inputs */
#define VALUES(q6) ((q6) ? 1344 : 384) /* where a super-block's values start */

int64_t tm_kquant_panel_bytes(int64_t K, int64_t q6) { return K / 256 * SUPER(q6); }

static inline int32_t hsum_epi32(__m256i v) {
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    t = _mm_hadd_epi32(t, t);
    return _mm_cvtsi128_si32(_mm_hadd_epi32(t, t));
}

/* x [M, K] -> xq int8 [M][2][K] (per row the his, then the los), xs [M, K/32] block scales,
 * xsum [M, K/32] = xs * sum(a), hsum [M, K/16] int32 sums of a per 16 inputs. */
void tm_quantize_rows_q8x2(const float *x, int8_t *xq, float *xs, float *xsum, int32_t *hsum,
                           int64_t M, int64_t K) {
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7), top = _mm256_set1_epi32(TOP);
    const __m256i neg = _mm256_sub_epi32(_mm256_setzero_si256(), top);
    const int64_t blocks = K / 32;
#pragma omp parallel for schedule(static) if (M * K >= 65536)
    for (int64_t i = 0; i < M * blocks; i++) {
        const int64_t row = i / blocks, b = i % blocks;
        __m256i a[4], hi[4], lo[4];
        const float d = round_block32(x + i * 32, (float)TOP, a);
        for (int j = 0; j < 4; j++) {
            a[j] = _mm256_max_epi32(_mm256_min_epi32(a[j], top), neg);
            hi[j] = _mm256_srai_epi32(_mm256_add_epi32(a[j], _mm256_set1_epi32(128)), 8);
            lo[j] = _mm256_sub_epi32(a[j], _mm256_slli_epi32(hi[j], 8));
        }
        const int32_t h0 = hsum_epi32(_mm256_add_epi32(a[0], a[1]));
        const int32_t h1 = hsum_epi32(_mm256_add_epi32(a[2], a[3]));
        xs[i] = d;
        xsum[i] = d * (float)(h0 + h1);
        hsum[2 * i] = h0;
        hsum[2 * i + 1] = h1;
        /* int32 x 32 -> int8 x 32 in input order (the packs interleave 128-bit lanes) */
        int8_t *h = xq + row * 2 * K + b * 32;
        _mm256_storeu_si256((__m256i *)h, _mm256_permutevar8x32_epi32(_mm256_packs_epi16(
            _mm256_packs_epi32(hi[0], hi[1]), _mm256_packs_epi32(hi[2], hi[3])), order));
        _mm256_storeu_si256((__m256i *)(h + K), _mm256_permutevar8x32_epi32(_mm256_packs_epi16(
            _mm256_packs_epi32(lo[0], lo[1]), _mm256_packs_epi32(lo[2], lo[3])), order));
    }
}

/* Software prefetch two super-blocks ahead, a few lines per block of the current one (past
 * the panel's end: the next panel, which this thread runs next). The hardware prefetcher
 * alone left one thread streaming a model's expert matrices at ~6 GB/s, two at ~8. */
#define PREFETCH_SUPERS 2
#define PREFETCH_LINES 5 /* x 8 (Q4_K) or 16 (Q6_K) blocks: a super-block's lines */

INLINE void prefetch_ahead(const uint8_t *sb, int h, const int q6) {
    const char *ahead = (const char *)sb + PREFETCH_SUPERS * SUPER(q6);
    for (int l = 0; l < PREFETCH_LINES; l++)
        _mm_prefetch(ahead + (h / (q6 ? 1 : 2) * PREFETCH_LINES + l) * 64, _MM_HINT_T0);
}

/* 4 activation bytes as a dword, to broadcast */
static inline int32_t quad(const int8_t *x) {
    int32_t v;
    memcpy(&v, x, sizeof v);
    return v;
}

/* the vector types and float / int32 operations of this build's width */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
typedef __m512 VF;
typedef __m512i VI;
#define F_MUL _mm512_mul_ps
#define F_ADD _mm512_add_ps
#define F_FMADD _mm512_fmadd_ps
#define F_FMSUB _mm512_fmsub_ps
#define F_SET1 _mm512_set1_ps
#define F_CVT _mm512_cvtepi32_ps
#define I_SUB _mm512_sub_epi32
#define I_SET1 _mm512_set1_epi32
#else
typedef __m256 VF;
typedef __m256i VI;
#define F_MUL _mm256_mul_ps
#define F_ADD _mm256_add_ps
#define F_FMADD _mm256_fmadd_ps
#define F_FMSUB _mm256_fmsub_ps
#define F_SET1 _mm256_set1_ps
#define F_CVT _mm256_cvtepi32_ps
#define I_SUB _mm256_sub_epi32
#define I_SET1 _mm256_set1_epi32
#endif

/* acc[i] (rows i < mr) += block b's int32 sums (Q6_K: of its 16-input half `half` of the
 * row's K/16) in float: Q6_K (q - 32) . a times d sc xs; Q4_K q . a times d sc xs, less
 * dmin m xsum (that part apart, then one add: a short dependency chain on acc). ws = d sc,
 * wm = dmin m per channel. One body for both vector widths (VF / VI and the F_ / I_
 * operations the two builds define). */
INLINE void block_out(VF *acc, VI *sum, VF ws, VF wm, const float *xs, const float *xsum,
                      const int32_t *hsum, int64_t blocks, int64_t b, int64_t half,
                      const int mr, const int q6) {
    for (int i = 0; i < mr; i++) {
        const VF wx = F_MUL(ws, F_SET1(xs[i * blocks + b]));
        if (q6) {
            sum[i] = I_SUB(sum[i], I_SET1(32 * hsum[i * 2 * blocks + half]));
            acc[i] = F_FMADD(F_CVT(sum[i]), wx, acc[i]);
        } else {
            acc[i] = F_ADD(acc[i], F_FMSUB(F_CVT(sum[i]), wx,
                                           F_MUL(wm, F_SET1(xsum[i * blocks + b]))));
        }
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)

/* v[j]: the 16 channels' values of inputs 16h + 4j .. 16h + 4j + 4 (j < 4), a byte each,
 * from super-block sb (h: which 16 inputs of its 256) */
INLINE void values16(__m512i *v, const uint8_t *sb, int h, const int q6) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const uint8_t *at = sb + VALUES(q6) + h * 128;
    const __m512i a = _mm512_loadu_si512(at), c = _mm512_loadu_si512(at + 64);
    v[0] = _mm512_and_si512(a, m4);
    v[1] = _mm512_and_si512(_mm512_srli_epi16(a, 4), m4);
    v[2] = _mm512_and_si512(c, m4);
    v[3] = _mm512_and_si512(_mm512_srli_epi16(c, 4), m4);
    if (!q6) return;
    const __m512i hb = _mm512_loadu_si512(sb + 320 + h * 64), m2 = _mm512_set1_epi8(0x30);
    /* v | (high bits moved to bits 4-5 & 0x30) */
    v[0] = _mm512_ternarylogic_epi32(v[0], _mm512_slli_epi16(hb, 4), m2, 0xF8);
    v[1] = _mm512_ternarylogic_epi32(v[1], _mm512_slli_epi16(hb, 2), m2, 0xF8);
    v[2] = _mm512_ternarylogic_epi32(v[2], hb, m2, 0xF8);
    v[3] = _mm512_ternarylogic_epi32(v[3], _mm512_srli_epi16(hb, 2), m2, 0xF8);
}

/* sum[i] (rows i < mr): the exact int32 sums q . a over the inputs in0 .. in0 + 4 nv of
 * value vectors v: the his' sums times 256, plus the los' */
INLINE void dots16(__m512i *sum, const __m512i *v, const int nv, const int8_t *xq, int64_t K,
                   int64_t in0, const int mr) {
    for (int i = 0; i < mr; i++) sum[i] = _mm512_setzero_si512();
#pragma GCC unroll 2
    for (int part = 0; part < 2; part++) {
        if (part)
            for (int i = 0; i < mr; i++) sum[i] = _mm512_slli_epi32(sum[i], 8);
#pragma GCC unroll 8
        for (int j = 0; j < nv; j++)
#pragma GCC unroll 12
            for (int i = 0; i < mr; i++)
                sum[i] = _mm512_dpbusd_epi32(
                    sum[i], v[j], _mm512_set1_epi32(quad(xq + i * 2 * K + part * K + in0 + 4 * j)));
    }
}

INLINE void ktile(const int8_t *xq, const float *xs, const float *xsum, const int32_t *hsum,
                  const uint8_t *blob, float *y, const float *bias, int64_t n0, int64_t N,
                  int64_t K, const int mr, const int q6) {
    const int64_t blocks = K / 32;
    __m512 acc[PANEL_ROWS];
    for (int i = 0; i < mr; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t s = 0; s < K / 256; s++) {
        const uint8_t *sb = blob + s * SUPER(q6);
        const __m512 d = _mm512_loadu_ps((const float *)sb);
        for (int h = 0; h < 16; h += q6 ? 1 : 2) { /* Q6_K: 16 inputs a scale; Q4_K: 32 */
            const int64_t b = s * 8 + h / 2;
            __m512i v[8], sum[PANEL_ROWS];
            prefetch_ahead(sb, h, q6);
            values16(v, sb, h, q6);
            if (!q6) values16(v + 4, sb, h + 1, 0);
            dots16(sum, v, q6 ? 4 : 8, xq, K, s * 256 + h * 16, mr);
            const __m128i raw = _mm_loadu_si128(
                (const __m128i *)(sb + (q6 ? 64 + h * KP : 128 + h / 2 * KP)));
            const __m512 ws = _mm512_mul_ps(d, _mm512_cvtepi32_ps(
                q6 ? _mm512_cvtepi8_epi32(raw) : _mm512_cvtepu8_epi32(raw)));
            const __m512 wm = q6 ? _mm512_setzero_ps() : _mm512_mul_ps(
                _mm512_loadu_ps((const float *)(sb + 64)),
                _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                    _mm_loadu_si128((const __m128i *)(sb + 256 + h / 2 * KP)))));
            block_out(acc, sum, ws, wm, xs, xsum, hsum, blocks, b, s * 16 + h, mr, q6);
        }
    }
    store_panel16(acc, mr, y, bias, n0, N);
}
#else

/* values16 for the channels [8 c8, 8 c8 + 8) of the panel */
INLINE void values8(__m256i *v, const uint8_t *sb, int h, int c8, const int q6) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const uint8_t *at = sb + VALUES(q6) + h * 128 + 32 * c8;
    const __m256i a = _mm256_loadu_si256((const __m256i *)at);
    const __m256i c = _mm256_loadu_si256((const __m256i *)(at + 64));
    v[0] = _mm256_and_si256(a, m4);
    v[1] = _mm256_and_si256(_mm256_srli_epi16(a, 4), m4);
    v[2] = _mm256_and_si256(c, m4);
    v[3] = _mm256_and_si256(_mm256_srli_epi16(c, 4), m4);
    if (!q6) return;
    const __m256i hb = _mm256_loadu_si256((const __m256i *)(sb + 320 + h * 64 + 32 * c8));
    const __m256i m2 = _mm256_set1_epi8(0x30);
    v[0] = _mm256_or_si256(v[0], _mm256_and_si256(_mm256_slli_epi16(hb, 4), m2));
    v[1] = _mm256_or_si256(v[1], _mm256_and_si256(_mm256_slli_epi16(hb, 2), m2));
    v[2] = _mm256_or_si256(v[2], _mm256_and_si256(hb, m2));
    v[3] = _mm256_or_si256(v[3], _mm256_and_si256(_mm256_srli_epi16(hb, 2), m2));
}

/* dots16 with `vpmaddubsw`: the int16 pair sums of `run` vectors added up (below 2^15), then
 * widened by `vpmaddwd` against 256 (the his) or 1 (the los) */
INLINE void dots8(__m256i *sum, const __m256i *v, const int nv, const int8_t *xq, int64_t K,
                  int64_t in0, const int mr, const int run) {
    for (int i = 0; i < mr; i++) sum[i] = _mm256_setzero_si256();
#pragma GCC unroll 2
    for (int part = 0; part < 2; part++) {
        const __m256i widen = _mm256_set1_epi16(part ? 1 : 256);
#pragma GCC unroll 4
        for (int j0 = 0; j0 < nv; j0 += run) {
            __m256i s16[PANEL_ROWS];
            for (int i = 0; i < mr; i++) s16[i] = _mm256_setzero_si256();
#pragma GCC unroll 8
            for (int j = j0; j < j0 + run; j++)
#pragma GCC unroll 6
                for (int i = 0; i < mr; i++)
                    s16[i] = _mm256_add_epi16(s16[i], _mm256_maddubs_epi16(v[j], _mm256_set1_epi32(
                        quad(xq + i * 2 * K + part * K + in0 + 4 * j))));
            for (int i = 0; i < mr; i++)
                sum[i] = _mm256_add_epi32(sum[i], _mm256_madd_epi16(s16[i], widen));
        }
    }
}

INLINE void ktile(const int8_t *xq, const float *xs, const float *xsum, const int32_t *hsum,
                  const uint8_t *blob, float *y, const float *bias, int64_t n0, int64_t N,
                  int64_t K, const int mr, const int q6) {
    const int64_t blocks = K / 32;
    for (int c8 = 0; c8 < 2; c8++) {
        __m256 acc[PANEL_ROWS];
        for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_ps();
        for (int64_t s = 0; s < K / 256; s++) {
            const uint8_t *sb = blob + s * SUPER(q6);
            const __m256 d = _mm256_loadu_ps((const float *)sb + 8 * c8);
            for (int h = 0; h < 16; h += q6 ? 1 : 2) {
                const int64_t b = s * 8 + h / 2;
                __m256i v[8], sum[PANEL_ROWS];
                if (c8 == 0) prefetch_ahead(sb, h, q6); /* the pass that reads every line */
                values8(v, sb, h, c8, q6);
                if (!q6) values8(v + 4, sb, h + 1, c8, 0);
                dots8(sum, v, q6 ? 4 : 8, xq, K, s * 256 + h * 16, mr, q6 ? 2 : 8);
                const __m128i raw = _mm_loadl_epi64(
                    (const __m128i *)(sb + (q6 ? 64 + h * KP : 128 + h / 2 * KP) + 8 * c8));
                const __m256 ws = _mm256_mul_ps(d, _mm256_cvtepi32_ps(
                    q6 ? _mm256_cvtepi8_epi32(raw) : _mm256_cvtepu8_epi32(raw)));
                const __m256 wm = q6 ? _mm256_setzero_ps() : _mm256_mul_ps(
                    _mm256_loadu_ps((const float *)(sb + 64) + 8 * c8),
                    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
                        (const __m128i *)(sb + 256 + h / 2 * KP + 8 * c8)))));
                block_out(acc, sum, ws, wm, xs, xsum, hsum, blocks, b, s * 16 + h, mr, q6);
            }
        }
        store_panel8(acc, mr, y, bias, n0 + 8 * c8, N);
    }
}
#endif

/* Rows [0, M) of panel p in tiles of KQ_ROWS rows. Each exported kernel has its own
 * parallel loop over the panels: OpenMP outlines a loop's body before inlining, so a loop
 * shared by both would see q6 as a run-time value and leave every inner loop rolled. */
INLINE void kpanel(const int8_t *xq, const float *xs, const float *xsum, const int32_t *hsum,
                   const uint8_t *blob, const float *bias, float *y, int64_t M, int64_t N,
                   int64_t K, int64_t p, const int q6) {
    const int64_t blocks = K / 32;
    const uint8_t *panel = blob + p * tm_kquant_panel_bytes(K, q6);
#define TILE(m0, R) ktile(xq + (m0) * 2 * K, xs + (m0) * blocks, xsum + (m0) * blocks, \
                          hsum + (m0) * 2 * blocks, panel, y + (m0) * N, bias, p * KP, N, K, \
                          R, q6)
    PANEL_ROW_TILES_OF(M, TILE, KQ_ROWS);
#undef TILE
}

/* tm_q4k_gemm, tm_q6k_gemm: y [M, N] = x @ the layer's panels (+ bias), x as
 * tm_quantize_rows_q8x2 left it */
#define KQUANT_GEMM(name, q6)                                                               \
    void name(const int8_t *xq, const float *xs, const float *xsum, const int32_t *hsum,    \
              const uint8_t *blob, const float *bias, float *y, int64_t M, int64_t N,       \
              int64_t K) {                                                                  \
        _Pragma("omp parallel for schedule(static)")                                        \
        for (int64_t p = 0; p < (N + KP - 1) / KP; p++)                                     \
            kpanel(xq, xs, xsum, hsum, blob, bias, y, M, N, K, p, q6);                      \
    }
KQUANT_GEMM(tm_q4k_gemm, 0)
KQUANT_GEMM(tm_q6k_gemm, 1)
