/* The panel tile kernel over vnni_panels.c's layouts (int8, int4 and fp4 weights times int16
 * activations, output channels across the lanes): `vnni_panel` computes one panel of 16
 * channels for M rows. Shared by vnni_panels.c's products and fp4_experts.c's mixture of
 * experts; everything here is static, inlined with the kind a constant. */
#ifndef TM_VNNI_TILE_H
#define TM_VNNI_TILE_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

#define VP 16 /* output channels per panel */

/* the kinds of weight vnni_tile reads */
#define KIND_INT8 0
#define KIND_INT4 1
#define KIND_FP4 2
/* E2M1 codes -> twice their value */
static const int8_t FP4_TWICE[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static inline int32_t pair_at(const int16_t *x) {
    int32_t v;
    memcpy(&v, x, sizeof v);
    return v;
}

/* a panel's weights and block factors */
typedef struct {
    const void *w, *scale;
    const uint16_t *min; /* int4 only */
} panel;

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)

#define TM_VNNI_NATIVE 1

/* Software prefetch: block b + PREFETCH_BLOCKS's lines and its group's factors (past the
 * panel's end: the next panel's, which this thread runs next). The hardware prefetcher alone
 * streamed a batch-1 decode's weights at ~60 % of the read bandwidth on an Intel Xeon
 * (AVX-512 VNNI); with it the Qwen3-MoE Q8_0 decode went 54 -> 68 tok/s (bench/NOTES.md,
 * 2026-11-27). Only a panel's first row tile fetches: the later ones find it in cache. */
#define PREFETCH_BLOCKS 8
INLINE void prefetch_ahead(panel pn, int64_t b, int64_t block_bytes, int64_t group,
                           const int kind) {
    const char *ahead = (const char *)pn.w + (b + PREFETCH_BLOCKS) * block_bytes;
    for (int64_t l = 0; l < block_bytes; l += 64) _mm_prefetch(ahead + l, _MM_HINT_T0);
    const int64_t g = (b + PREFETCH_BLOCKS) * 32 / group * VP; /* its (first) group's factors */
    _mm_prefetch((const char *)pn.scale + g * (kind != KIND_INT8 ? 2 : 4), _MM_HINT_T0);
    if (kind == KIND_INT4) _mm_prefetch((const char *)(pn.min + g), _MM_HINT_T0);
}

/* input pair j = j4 + c of a 32-input block as 16 x 2 int16: int8 sign-extended; int4 byte b
 * becomes the dword (b & 15) | (b >> 4) << 16, i.e. ((b | b << 12) & 0x000F000F); fp4: the
 * words of pairs j4 .. j4 + 3 shifted right by 4c, each lane's low five bits looked up */
INLINE __m512i pair16(const void *block, int j4, int c, const int kind) {
    const int j = j4 + c; /* (j4 a multiple of 4, c = j % 4) */
    if (kind == KIND_INT8)
        return _mm512_cvtepi8_epi16(
            _mm256_loadu_si256((const __m256i *)((const int8_t *)block + j * 2 * VP)));
    if (kind == KIND_FP4) {
        const __m512i words = _mm512_loadu_si512((const uint8_t *)block + j4 / 4 * 4 * VP);
        const __m512i table = _mm512_cvtepi8_epi16(_mm256_broadcastsi128_si256(
            _mm_loadu_si128((const __m128i *)FP4_TWICE)));
        return _mm512_permutexvar_epi16(_mm512_srli_epi32(words, 4 * c), table);
    }
    const __m512i b = _mm512_cvtepu8_epi32(
        _mm_loadu_si128((const __m128i *)((const uint8_t *)block + j * VP)));
    return _mm512_ternarylogic_epi32(b, _mm512_slli_epi32(b, 12),
                                     _mm512_set1_epi32(0x000F000F), 0xA8);
}

/* 16 channels' factors of group g: int8 float32, int4 float16, fp4 bfloat16 */
INLINE __m512 scales16(const void *scale, int64_t g, const int kind) {
    if (kind == KIND_INT8) return _mm512_loadu_ps((const float *)scale + g);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)scale + g));
    if (kind == KIND_INT4) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

#define CHAINS 4
INLINE void vnni_tile(const int16_t *xq, const float *xs, const float *xsum, panel pn,
                      float *y, const float *bias, int64_t n0, int64_t N, int64_t K,
                      int64_t group, const int mr, const int kind, const int fetch) {
    const int64_t blocks = K / 32, per_group = group / 32;
    const int64_t block_bytes = kind != KIND_INT8 ? 16 * VP : 32 * VP;
    const int parts = group == 16 ? 2 : 1; /* int8 groups of 16: two scales a block */
    const int chains = mr == 1 ? 4 : mr <= 3 ? 2 : 1; /* (dividing 4) */
    __m512 acc[PANEL_ROWS];
    for (int i = 0; i < mr; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const void *wb = (const uint8_t *)pn.w + b * block_bytes;
        if (fetch) prefetch_ahead(pn, b, block_bytes, group, kind);
        for (int part = 0; part < parts; part++) {
            __m512i sum[CHAINS][PANEL_ROWS];
            for (int c = 0; c < chains; c++)
                for (int i = 0; i < mr; i++) sum[c][i] = _mm512_setzero_si512();
            for (int j = part * 16 / parts; j < (part + 1) * 16 / parts; j += 4)
#pragma GCC unroll 4
                for (int c = 0; c < 4; c++) {
                    const __m512i w = pair16(wb, j, c, kind);
                    for (int i = 0; i < mr; i++)
                        sum[c % chains][i] = _mm512_dpwssd_epi32(
                            sum[c % chains][i], w,
                            _mm512_set1_epi32(pair_at(xq + i * K + b * 32 + 2 * (j + c))));
                }
            for (int c = 1; c < chains; c++)
                for (int i = 0; i < mr; i++) sum[0][i] = _mm512_add_epi32(sum[0][i], sum[c][i]);
            const int64_t g = (parts == 2 ? 2 * b + part : b / per_group) * VP;
            const __m512 ws = scales16(pn.scale, g, kind);
            for (int i = 0; i < mr; i++)
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[0][i]),
                                         _mm512_mul_ps(ws, _mm512_set1_ps(xs[i * blocks + b])),
                                         acc[i]);
        }
        const int64_t g = b / (per_group ? per_group : 1) * VP;
        if (kind == KIND_INT4) {
            const __m512 wm = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(pn.min + g)));
            for (int i = 0; i < mr; i++)
                acc[i] = _mm512_fmadd_ps(wm, _mm512_set1_ps(xsum[i * blocks + b]), acc[i]);
        }
    }
    store_panel16(acc, mr, y, bias, n0, N);
}
#else

/* Without VNNI these layouts are no faster than gemm.c's kernels (Zen 4 built for AVX2,
 * int8: 0.9x at 4-32 rows, 0.8x of the fp32 panels at 2,048), so layers keep those; this
 * build exists for the tests and gives the same results. */
#define TM_VNNI_NATIVE 0

/* channels [8h, 8h + 8) of input pair j as 8 x 2 int16 */
INLINE __m256i pair16(const void *block, int j, int h, const int kind) {
    if (kind == KIND_INT8)
        return _mm256_cvtepi8_epi16(_mm_loadu_si128(
            (const __m128i *)((const int8_t *)block + j * 2 * VP + 16 * h)));
    if (kind == KIND_INT4) {
        const __m256i b = _mm256_cvtepu8_epi32(
            _mm_loadl_epi64((const __m128i *)((const uint8_t *)block + j * VP + 8 * h)));
        return _mm256_and_si256(_mm256_or_si256(b, _mm256_slli_epi32(b, 12)),
                                _mm256_set1_epi32(0x000F000F));
    }
    const __m256i words = _mm256_loadu_si256(
        (const __m256i *)((const uint8_t *)block + j / 4 * 4 * VP + 32 * h));
    const __m256i codes = _mm256_and_si256(_mm256_srli_epi32(words, 4 * (j % 4)),
                                           _mm256_set1_epi32(0x000F000F));
    /* each int16 lane's low byte looked up (its high byte indexes 0x80: zero), then the
     * int8 value sign-extended over the lane */
    const __m256i table = _mm256_broadcastsi128_si256(
        _mm_loadu_si128((const __m128i *)FP4_TWICE));
    const __m256i looked = _mm256_shuffle_epi8(
        table, _mm256_or_si256(codes, _mm256_set1_epi16((short)0x8000)));
    return _mm256_srai_epi16(_mm256_slli_epi16(looked, 8), 8);
}

/* channels [8h, 8h + 8) of group g's factors */
INLINE __m256 scales8(const void *scale, int64_t g, const int kind) {
    if (kind == KIND_INT8) return _mm256_loadu_ps((const float *)scale + g);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)scale + g));
    if (kind == KIND_INT4) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* 16 channels as two halves of 8: vpmaddwd + vpaddd give the same int32 sums */
INLINE void vnni_tile(const int16_t *xq, const float *xs, const float *xsum, panel pn,
                      float *y, const float *bias, int64_t n0, int64_t N, int64_t K,
                      int64_t group, const int mr, const int kind, const int fetch) {
    (void)fetch; /* (this build is for the tests: no prefetch) */
    const int64_t blocks = K / 32, per_group = group / 32;
    const int64_t block_bytes = kind != KIND_INT8 ? 16 * VP : 32 * VP;
    const int parts = group == 16 ? 2 : 1; /* int8 groups of 16: two scales a block */
    for (int h = 0; h < 2; h++) {
        __m256 acc[PANEL_ROWS];
        for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_ps();
        for (int64_t b = 0; b < blocks; b++) {
            const void *wb = (const uint8_t *)pn.w + b * block_bytes;
            for (int part = 0; part < parts; part++) {
                __m256i sum[PANEL_ROWS];
                for (int i = 0; i < mr; i++) sum[i] = _mm256_setzero_si256();
                for (int j = part * 16 / parts; j < (part + 1) * 16 / parts; j++) {
                    const __m256i w = pair16(wb, j, h, kind);
                    for (int i = 0; i < mr; i++)
                        sum[i] = _mm256_add_epi32(sum[i], _mm256_madd_epi16(
                            w, _mm256_set1_epi32(pair_at(xq + i * K + b * 32 + 2 * j))));
                }
                const int64_t g = (parts == 2 ? 2 * b + part : b / per_group) * VP + 8 * h;
                const __m256 ws = scales8(pn.scale, g, kind);
                for (int i = 0; i < mr; i++)
                    acc[i] = _mm256_fmadd_ps(
                        _mm256_cvtepi32_ps(sum[i]),
                        _mm256_mul_ps(ws, _mm256_set1_ps(xs[i * blocks + b])), acc[i]);
            }
            const int64_t g = b / (per_group ? per_group : 1) * VP + 8 * h;
            if (kind == KIND_INT4) {
                const __m256 wm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(pn.min + g)));
                for (int i = 0; i < mr; i++)
                    acc[i] = _mm256_fmadd_ps(wm, _mm256_set1_ps(xsum[i * blocks + b]), acc[i]);
            }
        }
        store_panel8(acc, mr, y, bias, n0 + 8 * h, N);
    }
}
#endif

/* Work: whole panels per thread (each weight byte is read by one thread), all rows of a
 * panel in tiles of PANEL_ROWS rows while the panel stays in L1/L2. Each entry point has its
 * own parallel loop over this, so the kind is a constant in the code OpenMP outlines (one
 * loop shared by the three would test it at every weight load). */
INLINE void vnni_panel(int64_t p, const int16_t *xq, const float *xs, const float *xsum,
                       const void *wp, const void *sp, const uint16_t *mp, const float *bias,
                       float *y, int64_t M, int64_t N, int64_t K, int64_t group,
                       const int kind) {
    const int64_t blocks = K / 32, groups = K / group;
    const int64_t panel_bytes = kind != KIND_INT8 ? K / 2 * VP : K * VP;
    const int64_t scale_bytes = groups * VP * (kind != KIND_INT8 ? 2 : 4);
    const panel pn = {(const uint8_t *)wp + p * panel_bytes, (const uint8_t *)sp + p * scale_bytes,
                      kind == KIND_INT4 ? mp + p * groups * VP : NULL};
#define TILE(m0, R) vnni_tile(xq + (m0) * K, xs + (m0) * blocks, xsum + (m0) * blocks, pn, \
                             y + (m0) * N, bias, p * VP, N, K, group, R, kind, (m0) == 0)
    PANEL_ROW_TILES(M, TILE);
#undef TILE
}

#endif
