/* Quantized weights unpacked into the fp32 panel layout, for prompt-sized matmuls.
 *
 * From a few hundred rows on, a weight-only quantized layer is compute-bound: the integer
 * kernels (gemm.c) convert every weight once per 4 rows, while an fp32 GEMM converts it once
 * per call. That GEMM used to be torch's on a dequantized copy (MKL, which re-packs the weight
 * each call and on AMD CPUs runs its AVX2 kernels); here the weight is written straight into
 * the [N/64][K][64] panels the fp32 panel kernel (f32_panel.c) reads, so prompts of int8 and
 * int4 layers run the same tiles as fp32 ones. Values equal quantization/schemes.py's
 * dequantize_int8 / dequantize_int4 exactly (one multiply; int4: then one add, no FMA).
 * Columns of a last panel past N are zero. Layouts as in gemm.c. */
#include <immintrin.h>
#include <stdint.h>

#include "kernels.h"
#include "simd.h"

/* 8 rows x 8 inputs -> 8 inputs x 8 rows, stored at dst + i * 64 for input i */
static inline void store_transposed(const __m256 r[8], float *dst) {
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 u[8] = {_mm256_shuffle_ps(t0, t2, 0x44), _mm256_shuffle_ps(t0, t2, 0xEE),
                         _mm256_shuffle_ps(t1, t3, 0x44), _mm256_shuffle_ps(t1, t3, 0xEE),
                         _mm256_shuffle_ps(t4, t6, 0x44), _mm256_shuffle_ps(t4, t6, 0xEE),
                         _mm256_shuffle_ps(t5, t7, 0x44), _mm256_shuffle_ps(t5, t7, 0xEE)};
    for (int i = 0; i < 4; i++) {
        _mm256_storeu_ps(dst + i * 64, _mm256_permute2f128_ps(u[i], u[i + 4], 0x20));
        _mm256_storeu_ps(dst + (i + 4) * 64, _mm256_permute2f128_ps(u[i], u[i + 4], 0x31));
    }
}

/* The quantized weight of either kind, as gemm.c lays it out. */
typedef struct {
    const void *w;
    const void *scale; /* int8: float32; int4: float16 */
    const uint16_t *min;
    int64_t K, group, groups; /* groups = K / group */
} quantized;

/* weights [k, k + 8) of output channel n, in group g, as floats: q * scale (int8) */
static inline __m256 int8_row8(const quantized *q, int64_t n, int64_t k, int64_t g) {
    const __m128i b = _mm_loadl_epi64((const __m128i *)((const int8_t *)q->w + n * q->K + k));
    const float s = ((const float *)q->scale)[n * q->groups + g];
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_set1_ps(s));
}

/* ... q * scale + min (int4, the Q4 layout: per 32 inputs 16 bytes, byte i holding input i
 * in its low nibble and i + 16 in its high one) */
static inline __m256 int4_row8(const quantized *q, int64_t n, int64_t k, int64_t g) {
    const uint8_t *row = (const uint8_t *)q->w + n * (q->K / 2);
    const __m256i b = _mm256_cvtepu8_epi32(
        _mm_loadl_epi64((const __m128i *)(row + k / 32 * 16 + k % 16)));
    const __m256i v = _mm256_and_si256(_mm256_srli_epi32(b, k % 32 < 16 ? 0 : 4),
                                       _mm256_set1_epi32(15));
    const int64_t i = n * q->groups + g;
    return _mm256_add_ps(
        _mm256_mul_ps(_mm256_cvtepi32_ps(v),
                      _mm256_set1_ps(_cvtsh_ss(((const uint16_t *)q->scale)[i]))),
        _mm256_set1_ps(_cvtsh_ss(q->min[i])));
}

/* Panels are filled 8 inputs x 8 channels at a time: each channel's 8 weights are unpacked
 * as one vector and the 8 x 8 tile is transposed in registers, so the stores are whole rows
 * of the panel (writing one float per 256-byte panel row ran at ~1.4 GB/s). `group` is a
 * multiple of 8, so the 8 inputs share their group. */
INLINE void to_panels(const quantized *q, int64_t N, float *out, const int int4) {
    const int64_t panels = (N + 63) / 64, K = q->K;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++)
        for (int64_t k = 0; k < K; k += 8) {
            const int64_t g = k / q->group;
            for (int64_t j = 0; j < 64; j += 8) {
                __m256 r[8];
                for (int i = 0; i < 8; i++) {
                    const int64_t n = p * 64 + j + i;
                    r[i] = n >= N ? _mm256_setzero_ps()
                           : int4 ? int4_row8(q, n, k, g) : int8_row8(q, n, k, g);
                }
                store_transposed(r, out + (p * K + k) * 64 + j);
            }
        }
}

void tm_int8_to_panels(const int8_t *w, const float *scale, int64_t N, int64_t K,
                       int64_t group, float *out) {
    const quantized q = {w, scale, NULL, K, group, K / group};
    to_panels(&q, N, out, 0);
}

void tm_int4_to_panels(const uint8_t *w, const uint16_t *scale, const uint16_t *min,
                       int64_t N, int64_t K, int64_t group, float *out) {
    const quantized q = {w, scale, min, K, group, K / group};
    to_panels(&q, N, out, 1);
}
