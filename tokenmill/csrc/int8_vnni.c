/* int8 weights times int16 activations with the output channels across the vector lanes.
 *
 * gemm.c's integer kernels put the 32 inputs of a block across the lanes: each (row, channel,
 * block) then needs its own int32->float conversion and FMA, as many instructions per
 * multiply-add as an fp32 GEMM. Here the weight is laid out as panels of 16 channels, each
 * input pair of a channel next to each other ([N/16][K/2][16][2] int8), so one widened load
 * is 16 channels x 2 inputs and `vpdpwssd` against a broadcast activation pair adds 32
 * products into 16 per-channel sums; the block's scale is applied once per 16 channels. On a
 * Zen 4 that is ~1.5x the fp32 panel kernel's multiply-adds per cycle (bench/NOTES.md).
 *
 * Same rounding as gemm.c's `_q16` kernels: activations in int16 per 32 inputs
 * (tm_quantize_rows_q16), exact int32 block sums, then per block and row
 * y += float(sum) * (w_scale[group] * x_scale[block]). Without AVX-512 VNNI the same sums come
 * from vpmaddwd + vpaddd on 8 channels at a time, with the same float operations per lane, so
 * both builds give identical results (and the tests run everywhere). K is a multiple of 32,
 * the group a multiple of 32. */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"
#include "simd.h"

#define VP 16 /* output channels per panel */

/* w int8 [N, K] and scale [N, K / group] -> panels [ceil(N/16)][K/2][16][2] and scales
 * [ceil(N/16)][K / group][16]; channels past N are zero. */
void tm_int8_to_vnni(const int8_t *w, const float *scale, int64_t N, int64_t K,
                     int64_t group, int8_t *wp, float *sp) {
    const int64_t panels = (N + VP - 1) / VP, groups = K / group;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        int8_t *dst = wp + p * K * VP;
        for (int c = 0; c < VP; c++) {
            const int64_t n = p * VP + c;
            for (int64_t g = 0; g < groups; g++)
                sp[(p * groups + g) * VP + c] = n < N ? scale[n * groups + g] : 0.0f;
            if (n >= N) {
                for (int64_t k = 0; k < K; k += 2) dst[k * VP + 2 * c] = dst[k * VP + 2 * c + 1] = 0;
                continue;
            }
            const int8_t *row = w + n * K;
            for (int64_t k = 0; k < K; k += 2) {
                dst[k * VP + 2 * c] = row[k];
                dst[k * VP + 2 * c + 1] = row[k + 1];
            }
        }
    }
}

static inline int32_t pair_at(const int16_t *x) {
    int32_t v;
    memcpy(&v, x, sizeof v);
    return v;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define VMR 12 /* rows per register tile: 12 int32 + 12 float sums of 16 channels */

int64_t tm_int8_vnni_native(void) { return 1; }

INLINE void vnni_tile(const int16_t *xq, const float *xs, const int8_t *panel,
                      const float *pscale, float *y, const float *bias, int64_t n0, int64_t N,
                      int64_t K, int64_t group, const int mr) {
    const int64_t blocks = K / 32, per_group = group / 32;
    __m512 acc[VMR];
    for (int i = 0; i < mr; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m512i sum[VMR];
        for (int i = 0; i < mr; i++) sum[i] = _mm512_setzero_si512();
        const int8_t *wb = panel + b * 32 * VP;
        for (int j = 0; j < 16; j++) {
            const __m512i w = _mm512_cvtepi8_epi16(
                _mm256_loadu_si256((const __m256i *)(wb + j * 2 * VP)));
            for (int i = 0; i < mr; i++)
                sum[i] = _mm512_dpwssd_epi32(
                    sum[i], w, _mm512_set1_epi32(pair_at(xq + i * K + b * 32 + 2 * j)));
        }
        const __m512 ws = _mm512_loadu_ps(pscale + b / per_group * VP);
        for (int i = 0; i < mr; i++)
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[i]),
                                     _mm512_mul_ps(ws, _mm512_set1_ps(xs[i * blocks + b])),
                                     acc[i]);
    }
    const int64_t width = N - n0 < VP ? N - n0 : VP;
    const __mmask16 keep = (__mmask16)((1u << width) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(keep, bias + n0) : _mm512_setzero_ps();
    for (int i = 0; i < mr; i++)
        _mm512_mask_storeu_ps(y + i * N + n0, keep, _mm512_add_ps(acc[i], bv));
}
#else
#define VMR 6 /* 16 ymm registers: 6 int32 + 6 float sums */

/* Without VNNI this layout is no faster than gemm.c's kernels (Zen 4 built for AVX2: 0.9x
 * at 4-32 rows, 0.8x of the fp32 panels at 2,048), so layers keep those; this build exists
 * for the tests, and gives the same results. */
int64_t tm_int8_vnni_native(void) { return 0; }

/* 16 channels as two halves of 8: vpmaddwd + vpaddd give the same int32 sums */
INLINE void vnni_tile(const int16_t *xq, const float *xs, const int8_t *panel,
                      const float *pscale, float *y, const float *bias, int64_t n0, int64_t N,
                      int64_t K, int64_t group, const int mr) {
    const int64_t blocks = K / 32, per_group = group / 32;
    for (int h = 0; h < 2; h++) {
        __m256 acc[VMR];
        for (int i = 0; i < mr; i++) acc[i] = _mm256_setzero_ps();
        for (int64_t b = 0; b < blocks; b++) {
            __m256i sum[VMR];
            for (int i = 0; i < mr; i++) sum[i] = _mm256_setzero_si256();
            const int8_t *wb = panel + b * 32 * VP + 16 * h;
            for (int j = 0; j < 16; j++) {
                const __m256i w = _mm256_cvtepi8_epi16(
                    _mm_loadu_si128((const __m128i *)(wb + j * 2 * VP)));
                for (int i = 0; i < mr; i++)
                    sum[i] = _mm256_add_epi32(sum[i], _mm256_madd_epi16(
                        w, _mm256_set1_epi32(pair_at(xq + i * K + b * 32 + 2 * j))));
            }
            const __m256 ws = _mm256_loadu_ps(pscale + b / per_group * VP + 8 * h);
            for (int i = 0; i < mr; i++)
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[i]),
                                         _mm256_mul_ps(ws, _mm256_set1_ps(xs[i * blocks + b])),
                                         acc[i]);
        }
        float out[VMR][8] __attribute__((aligned(32)));
        for (int i = 0; i < mr; i++) _mm256_store_ps(out[i], acc[i]);
        for (int c = 0; c < 8; c++) {
            const int64_t n = n0 + 8 * h + c;
            if (n >= N) break;
            for (int i = 0; i < mr; i++) y[i * N + n] = out[i][c] + (bias ? bias[n] : 0.0f);
        }
    }
}
#endif

void tm_int8_vnni_gemm(const int16_t *xq, const float *xs, const int8_t *wp, const float *sp,
                       const float *bias, float *y, int64_t M, int64_t N, int64_t K,
                       int64_t group) {
    const int64_t panels = (N + VP - 1) / VP, blocks = K / 32, groups = K / group;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        const int8_t *panel = wp + p * K * VP;
        const float *pscale = sp + p * groups * VP;
        int64_t m0 = 0;
        for (; m0 + VMR <= M; m0 += VMR)
            vnni_tile(xq + m0 * K, xs + m0 * blocks, panel, pscale, y + m0 * N, bias, p * VP,
                      N, K, group, VMR);
        switch (M - m0) {
#define TILE(R) case R: vnni_tile(xq + m0 * K, xs + m0 * blocks, panel, pscale, y + m0 * N, \
                                  bias, p * VP, N, K, group, R); break;
            TILE(1) TILE(2) TILE(3) TILE(4) TILE(5)
#if VMR > 6
            TILE(6) TILE(7) TILE(8) TILE(9) TILE(10) TILE(11)
#endif
#undef TILE
        }
    }
}
