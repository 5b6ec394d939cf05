/* Weight-only quantized matrix multiply for x86 CPUs with AVX2, FMA and F16C:
 *   y[M, N] = x[M, K] @ dequant(W)^T (+ bias)
 * reading the int8 / int4 weights directly, so a decode step streams 1 or 1/2 byte per weight
 * instead of 4 (decode on a CPU is bound by memory bandwidth).
 *
 * Weights are row-major by output channel [N, ...] and quantized in groups of `group` inputs
 * (group == K: one scale per output channel):
 *   int8: w = q * scale[n, g]                      q: int8 [N, K]
 *   int4: w = q * scale[n, g] + min[n, g]          q: 0..15, uint8 [N, K/2] in GGUF's Q4 layout
 *         (per 32 inputs 16 bytes, byte j holds input j in its low nibble, j + 16 in its high);
 *         scale and min are float16, as GGUF Q4_1 keeps them (1/16 byte per weight at group 32).
 * Rows of x are processed four at a time so each weight vector is converted once per four rows.
 * Built at run time by tokenmill/quantization/cpu_kernels.py; threads come from OpenMP (the
 * same libgomp torch loaded, so there is one thread pool). */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define MB 4

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __m256 i8x8_to_ps(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

static inline __m256 u8x8_to_ps(__m128i v) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
}

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
                y[(m0 + i) * N + n] = hsum(acc[i]) + (bias ? bias[n] : 0.0f);
        }
    }
}

/* Sum of x over each group: the `min` term of int4 weights is min[n, g] * xsum[m, g]. */
static void group_sums(const float *x, float *xsum, int64_t M, int64_t K, int64_t group) {
    const int64_t groups = K / group;
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < groups; g++) {
            __m256 s = _mm256_setzero_ps();
            for (int64_t k = g * group; k < (g + 1) * group; k += 8)
                s = _mm256_add_ps(s, _mm256_loadu_ps(x + m * K + k));
            xsum[m * groups + g] = hsum(s);
        }
}

void tm_int4_gemm(const float *x, const uint8_t *w, const uint16_t *scale, const uint16_t *min,
                  const float *bias, float *xsum, float *y, int64_t M, int64_t N, int64_t K,
                  int64_t group) {
    const int64_t groups = K / group;
    const __m128i low = _mm_set1_epi8(0x0F);
    group_sums(x, xsum, M, K, group);
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *wn = w + n * (K / 2);
        const uint16_t *sn = scale + n * groups, *mn = min + n * groups;
        for (int64_t m0 = 0; m0 < M; m0 += MB) {
            const int64_t mb = M - m0 < MB ? M - m0 : MB;
            __m256 acc[MB], part[MB];
            float offset[MB] = {0};
            for (int i = 0; i < MB; i++) acc[i] = _mm256_setzero_ps();
            for (int64_t g = 0; g < groups; g++) {
                for (int i = 0; i < MB; i++) part[i] = _mm256_setzero_ps();
                for (int64_t k = g * group; k < (g + 1) * group; k += 32) {
                    const __m128i bytes = _mm_loadu_si128((const __m128i *)(wn + k / 2));
                    const __m128i lo = _mm_and_si128(bytes, low);
                    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);
                    const __m256 w0 = u8x8_to_ps(lo), w1 = u8x8_to_ps(_mm_srli_si128(lo, 8));
                    const __m256 w2 = u8x8_to_ps(hi), w3 = u8x8_to_ps(_mm_srli_si128(hi, 8));
                    for (int i = 0; i < mb; i++) {
                        const float *xk = x + (m0 + i) * K + k;
                        __m256 p = _mm256_fmadd_ps(_mm256_loadu_ps(xk), w0, part[i]);
                        p = _mm256_fmadd_ps(_mm256_loadu_ps(xk + 8), w1, p);
                        p = _mm256_fmadd_ps(_mm256_loadu_ps(xk + 16), w2, p);
                        part[i] = _mm256_fmadd_ps(_mm256_loadu_ps(xk + 24), w3, p);
                    }
                }
                const __m256 s = _mm256_set1_ps(_cvtsh_ss(sn[g]));
                const float mg = _cvtsh_ss(mn[g]);
                for (int i = 0; i < mb; i++) {
                    acc[i] = _mm256_fmadd_ps(part[i], s, acc[i]);
                    offset[i] += mg * xsum[(m0 + i) * groups + g];
                }
            }
            for (int i = 0; i < mb; i++)
                y[(m0 + i) * N + n] = hsum(acc[i]) + offset[i] + (bias ? bias[n] : 0.0f);
        }
    }
}
