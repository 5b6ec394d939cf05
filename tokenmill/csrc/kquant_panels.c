/* GGUF Q4_K, Q6_K, Q5_0 and Q5_1 weights kept at (about) their stored size, times activations
 * split into two int8 halves, with the byte dot products of `vpdpbusd` (AVX-512 VNNI) or
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
 * and Q5_0 / Q5_1 (fp16 factors per 32 inputs, so K need only be a multiple of 64) in
 * super-blocks of 64 inputs:
 *   Q5_0: d [2][16] f16 | fifth bits [2][16][4] u8 | values [8][16][4] u8  (704 bytes: 5.5)
 *   Q5_1: d [2][16] f16 | m [2][16] f16 | fifth bits | values              (768 bytes: 6)
 * so the weights stream through memory in one pass (factors kept apart from the values cost
 * every panel cache misses the prefetcher did not cover: 1.6x slower from DRAM). values[g][c]
 * are channel c's inputs 8g .. 8g + 8: byte t holds input 8g + t in its low nibble and
 * 8g + 4 + t in its high one, so a load and a mask give 16 channels x 4 inputs, one per byte,
 * what a byte dot product multiplies by 4 broadcast activation bytes. Q6_K's high bits[h][c]
 * are channel c's inputs 16h .. 16h + 16: byte t holds the high two bits of inputs 16h + t,
 * 16h + 4 + t, 16h + 8 + t, 16h + 12 + t in bits 0-1, 2-3, 4-5, 6-7, each moved into place
 * by one shift; Q5's fifth bits[b][c] are channel c's 32 inputs of block b: bit j of byte t
 * is input 4j + t's. Q4_K's weight is d sc q - dmin m (q 0..15); Q6_K's d sc (q - 32) (q
 * 0..63, scales per 16 inputs); Q5_0's d (q - 16), Q5_1's d q + m (q 0..31).
 *
 * Activations (tm_quantize_rows_q8x2): per 32 inputs, integers a in [-32639, 32639] (scale
 * absmax / 32639, ties to even: the 15 bits of the int16 kernels, not llama.cpp's 8, whose
 * rounding vnni_panels.c's notes found too coarse), each split as a = 256 hi + lo with hi in
 * [-127, 127] and lo in [-128, 127], stored per row as a plane of his then a plane of los.
 * The byte products of unsigned weight values and signed halves then give exact int32 sums
 * q . a = 256 (q . hi) + (q . lo) per block (Q6_K: per 16-input half, minus 32 times the
 * half's sum of a; Q5_0: minus 16 times the block's), and per block and row
 * y += float(sum) * ((d * sc) * xs) (Q4_K: then y -= (dmin * m) * xsum; Q5_1: y += m xsum).
 * The AVX2 build runs the same float operations per lane, so both builds give identical
 * results. Overflow: AVX2's int16 sums of byte products stay below 2^15 (Q4_K: 8 products
 * of 2 x 15 x 128; Q6_K: 2 of 2 x 63 x 128; Q5: 4 of 2 x 31 x 128). */
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

/* the kinds (tm_kquant_gemm's `kind`), and per kind: inputs and bytes of a super-block,
 * where its high bits and its values start, 16-input units per block of sums (a scale) */
enum { Q4K = 0, Q6K = 1, Q50 = 2, Q51 = 3 };
#define INPUTS(kd) ((kd) == Q4K || (kd) == Q6K ? 256 : 64)
#define SUPER(kd) ((kd) == Q4K ? 2432 : (kd) == Q6K ? 3392 : (kd) == Q50 ? 704 : 768)
#define HIGH(kd) ((kd) == Q6K ? 320 : (kd) == Q50 ? 64 : 128)
#define VALUES(kd) ((kd) == Q4K ? 384 : (kd) == Q6K ? 1344 : (kd) == Q50 ? 192 : 256)
#define STEP(kd) ((kd) == Q6K ? 1 : 2)

int64_t tm_kquant_panel_bytes(int64_t K, int64_t kind) { return K / INPUTS(kind) * SUPER(kind); }

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
/* lines a block of sums: x 8 (Q4_K), 16 (Q6_K) or 2 (Q5) blocks cover a super-block */
#define PREFETCH_LINES(kd) ((kd) == Q50 || (kd) == Q51 ? 6 : 5)

INLINE void prefetch_ahead(const uint8_t *sb, int h, const int kd) {
    const char *ahead = (const char *)sb + PREFETCH_SUPERS * SUPER(kd);
    for (int l = 0; l < PREFETCH_LINES(kd); l++)
        _mm_prefetch(ahead + (h / STEP(kd) * PREFETCH_LINES(kd) + l) * 64, _MM_HINT_T0);
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

/* acc[i] (rows i < mr) += the int32 sums of the block of sums starting at 16-input unit u of
 * the row (Q4_K, Q5: a block of 32 inputs, b = u / 2; Q6_K: 16 inputs) in float: Q6_K
 * (q - 32) . a and Q5_0 (q - 16) . a times d sc xs (ws = d sc per channel); Q4_K q . a
 * times d sc xs less dmin m xsum (wm = dmin m), Q5_1 plus m xsum (wm = m): that part apart,
 * then one add (a short dependency chain on acc). One body for both vector widths (VF / VI
 * and the F_ / I_ operations the two builds define). */
INLINE void block_out(VF *acc, VI *sum, VF ws, VF wm, const float *xs, const float *xsum,
                      const int32_t *hsum, int64_t blocks, int64_t u, const int mr,
                      const int kd) {
    const int64_t b = u / 2;
    for (int i = 0; i < mr; i++) {
        const VF wx = F_MUL(ws, F_SET1(xs[i * blocks + b]));
        const int32_t *hs = hsum + i * 2 * blocks;
        if (kd == Q6K || kd == Q50) {
            const int32_t zero = kd == Q6K ? 32 * hs[u] : 16 * (hs[2 * b] + hs[2 * b + 1]);
            sum[i] = I_SUB(sum[i], I_SET1(zero));
            acc[i] = F_FMADD(F_CVT(sum[i]), wx, acc[i]);
        } else {
            const VF mx = F_MUL(wm, F_SET1(xsum[i * blocks + b]));
            acc[i] = F_ADD(acc[i], kd == Q4K ? F_FMSUB(F_CVT(sum[i]), wx, mx)
                                             : F_FMADD(F_CVT(sum[i]), wx, mx));
        }
    }
}

/* Loading a panel's parts, LANES channels a vector: all 16 of a panel (AVX-512) or 8 at a
 * time (AVX2: the panel in two passes, c = 0, 1, the second from cache) */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define LANES 16
#define V_LOAD(p) _mm512_loadu_si512(p)
#define V_AND _mm512_and_si512
#define V_SET1_8 _mm512_set1_epi8
#define V_SLL _mm512_slli_epi16
#define V_SRL _mm512_srli_epi16
#define BITS_OR(v, s, m) _mm512_ternarylogic_epi32(v, s, m, 0xF8) /* v | (s & m) */
#define F_LOAD(p) _mm512_loadu_ps((const float *)(p))
#define F_HALVES(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define F_BYTES(p, cvt) _mm512_cvtepi32_ps(cvt(_mm_loadu_si128((const __m128i *)(p))))
#define F_U8 _mm512_cvtepu8_epi32
#define F_I8 _mm512_cvtepi8_epi32
#define F_ZERO _mm512_setzero_ps
#define STORE_PANEL store_panel16
#else
#define LANES 8
#define V_LOAD(p) _mm256_loadu_si256((const __m256i *)(p))
#define V_AND _mm256_and_si256
#define V_SET1_8 _mm256_set1_epi8
#define V_SLL _mm256_slli_epi16
#define V_SRL _mm256_srli_epi16
#define BITS_OR(v, s, m) _mm256_or_si256(v, _mm256_and_si256(s, m))
#define F_LOAD(p) _mm256_loadu_ps((const float *)(p))
#define F_HALVES(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define F_BYTES(p, cvt) _mm256_cvtepi32_ps(cvt(_mm_loadl_epi64((const __m128i *)(p))))
#define F_U8 _mm256_cvtepu8_epi32
#define F_I8 _mm256_cvtepi8_epi32
#define F_ZERO _mm256_setzero_ps
#define STORE_PANEL store_panel8
#endif

/* v[j]: channels [LANES c, LANES c + LANES)' values of inputs 16h + 4j .. 16h + 4j + 4
 * (j < 4), a byte each, from super-block sb (h: which 16 inputs of it); Q6_K with its high
 * bits, Q5 without its fifth bits */
INLINE void values(VI *v, const uint8_t *sb, int h, int c, const int kd) {
    const VI m4 = V_SET1_8(0x0F);
    const uint8_t *at = sb + VALUES(kd) + h * 128 + 4 * LANES * c;
    const VI a = V_LOAD(at), e = V_LOAD(at + 64);
    v[0] = V_AND(a, m4);
    v[1] = V_AND(V_SRL(a, 4), m4);
    v[2] = V_AND(e, m4);
    v[3] = V_AND(V_SRL(e, 4), m4);
    if (kd != Q6K) return;
    const VI hb = V_LOAD(sb + HIGH(kd) + h * 64 + 4 * LANES * c), m2 = V_SET1_8(0x30);
    v[0] = BITS_OR(v[0], V_SLL(hb, 4), m2); /* high bits moved to bits 4-5 */
    v[1] = BITS_OR(v[1], V_SLL(hb, 2), m2);
    v[2] = BITS_OR(v[2], hb, m2);
    v[3] = BITS_OR(v[3], V_SRL(hb, 2), m2);
}

/* the 8 value vectors of a block of 32 inputs (h, h + 1 its 16-input units); Q5: bit j of
 * the fifth bits' byte t (input 4j + t, v[j]'s byte t) moved to bit 4 */
INLINE void block_values(VI *v, const uint8_t *sb, int h, int c, const int kd) {
    values(v, sb, h, c, kd);
    values(v + 4, sb, h + 1, c, kd);
    if (kd != Q50 && kd != Q51) return;
    const VI hb = V_LOAD(sb + HIGH(kd) + h / 2 * 64 + 4 * LANES * c), m1 = V_SET1_8(0x10);
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++)
        v[j] = BITS_OR(v[j], j <= 4 ? V_SLL(hb, 4 - j) : V_SRL(hb, j - 4), m1);
}

/* ws = d sc (Q5: d), wm = dmin m (Q5_1: m) of the block of sums at unit h of sb */
INLINE void factors(VF *ws, VF *wm, const uint8_t *sb, int h, int c, const int kd) {
    const int64_t lane = LANES * c;
    *wm = F_ZERO();
    if (kd == Q4K) {
        *ws = F_MUL(F_LOAD((const float *)sb + lane),
                    F_BYTES(sb + 128 + h / 2 * 16 + lane, F_U8));
        *wm = F_MUL(F_LOAD((const float *)sb + 16 + lane),
                    F_BYTES(sb + 256 + h / 2 * 16 + lane, F_U8));
    } else if (kd == Q6K) {
        *ws = F_MUL(F_LOAD((const float *)sb + lane), F_BYTES(sb + 64 + h * 16 + lane, F_I8));
    } else {
        *ws = F_HALVES((const uint16_t *)sb + h / 2 * 16 + lane);
        if (kd == Q51) *wm = F_HALVES((const uint16_t *)sb + 32 + h / 2 * 16 + lane);
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* sum[i] (rows i < mr): the exact int32 sums q . a over the inputs in0 .. in0 + 4 nv of
 * value vectors v: the his' sums times 256, plus the los' */
INLINE void dots(__m512i *sum, const __m512i *v, const int nv, const int8_t *xq, int64_t K,
                 int64_t in0, const int mr, const int run) {
    (void)run;
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
#else
/* the same with `vpmaddubsw`: the int16 pair sums of `run` vectors added up (below 2^15),
 * then widened by `vpmaddwd` against 256 (the his) or 1 (the los) */
INLINE void dots(__m256i *sum, const __m256i *v, const int nv, const int8_t *xq, int64_t K,
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
#endif

/* rows [0, mr) of one panel (blob) into y's columns n0 .. n0 + 16 */
INLINE void ktile(const int8_t *xq, const float *xs, const float *xsum, const int32_t *hsum,
                  const uint8_t *blob, float *y, const float *bias, int64_t n0, int64_t N,
                  int64_t K, const int mr, const int kd) {
    const int64_t blocks = K / 32, units = INPUTS(kd) / 16;
    for (int c = 0; c < KP / LANES; c++) {
        VF acc[PANEL_ROWS];
        for (int i = 0; i < mr; i++) acc[i] = F_ZERO();
        for (int64_t s = 0; s < K / INPUTS(kd); s++) {
            const uint8_t *sb = blob + s * SUPER(kd);
            for (int h = 0; h < units; h += STEP(kd)) {
                VI v[8], sum[PANEL_ROWS];
                VF ws, wm;
                if (c == 0) prefetch_ahead(sb, h, kd); /* the pass that reads every line */
                if (kd == Q6K)
                    values(v, sb, h, c, kd);
                else
                    block_values(v, sb, h, c, kd);
                /* int16 runs (AVX2): 8 x 2 x 15 x 128, 2 x 2 x 63 x 128, 4 x 2 x 31 x 128 */
                dots(sum, v, kd == Q6K ? 4 : 8, xq, K, (s * units + h) * 16, mr,
                     kd == Q4K ? 8 : kd == Q6K ? 2 : 4);
                factors(&ws, &wm, sb, h, c, kd);
                block_out(acc, sum, ws, wm, xs, xsum, hsum, blocks, s * units + h, mr, kd);
            }
        }
        STORE_PANEL(acc, mr, y, bias, n0 + LANES * c, N);
    }
}

/* Rows [0, M) of panel p in tiles of KQ_ROWS rows. Each kind has its own parallel loop over
 * the panels: OpenMP outlines a loop's body before inlining, so a loop shared by all kinds
 * would see the kind as a run-time value and leave every inner loop rolled. */
INLINE void kpanel(const int8_t *xq, const float *xs, const float *xsum, const int32_t *hsum,
                   const uint8_t *blob, const float *bias, float *y, int64_t M, int64_t N,
                   int64_t K, int64_t p, const int kd) {
    const int64_t blocks = K / 32;
    const uint8_t *panel = blob + p * tm_kquant_panel_bytes(K, kd);
#define TILE(m0, R) ktile(xq + (m0) * 2 * K, xs + (m0) * blocks, xsum + (m0) * blocks, \
                          hsum + (m0) * 2 * blocks, panel, y + (m0) * N, bias, p * KP, N, K, \
                          R, kd)
    PANEL_ROW_TILES_OF(M, TILE, KQ_ROWS);
#undef TILE
}

#define KQUANT_GEMM(name, kd)                                                               \
    static void name(const int8_t *xq, const float *xs, const float *xsum,                  \
                     const int32_t *hsum, const uint8_t *blob, const float *bias, float *y, \
                     int64_t M, int64_t N, int64_t K) {                                     \
        _Pragma("omp parallel for schedule(static)")                                        \
        for (int64_t p = 0; p < (N + KP - 1) / KP; p++)                                     \
            kpanel(xq, xs, xsum, hsum, blob, bias, y, M, N, K, p, kd);                      \
    }
KQUANT_GEMM(q4k_gemm, Q4K)
KQUANT_GEMM(q6k_gemm, Q6K)
KQUANT_GEMM(q50_gemm, Q50)
KQUANT_GEMM(q51_gemm, Q51)

/* y [M, N] = x @ the layer's panels of `kind` (+ bias), x as tm_quantize_rows_q8x2 left it
 * (K a multiple of the kind's super-block) */
void tm_kquant_gemm(int64_t kind, const int8_t *xq, const float *xs, const float *xsum,
                    const int32_t *hsum, const uint8_t *blob, const float *bias, float *y,
                    int64_t M, int64_t N, int64_t K) {
    switch (kind) {
        case Q4K: q4k_gemm(xq, xs, xsum, hsum, blob, bias, y, M, N, K); break;
        case Q6K: q6k_gemm(xq, xs, xsum, hsum, blob, bias, y, M, N, K); break;
        case Q50: q50_gemm(xq, xs, xsum, hsum, blob, bias, y, M, N, K); break;
        case Q51: q51_gemm(xq, xs, xsum, hsum, blob, bias, y, M, N, K); break;
    }
}
