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
#include <stdint.h>

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

/* acc[j][i] += x[row m0 + i, k .. k+8) * w8 for output channel j */
#define ACCUMULATE(J, WV, K_)                                                             \
    for (int i = 0; i < MB_; i++)                                                         \
        acc[J][i] = _mm256_fmadd_ps(_mm256_loadu_ps(x + (m0 + i) * K + (K_)), (WV),       \
                                    acc[J][i]);

#define STORE_TILE()                                                                      \
    for (int j = 0; j < NB_; j++)                                                         \
        for (int i = 0; i < MB_; i++)                                                     \
            y[(m0 + i) * N + n0 + j] = hsum(acc[j][i]) + (bias ? bias[n0 + j] : 0.0f);

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
                y[(m0 + i) * N + n] = hsum(acc[i]) + (bias ? bias[n] : 0.0f);
        }
    }
}
