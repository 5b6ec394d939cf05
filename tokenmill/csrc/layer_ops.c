/* The small per-layer operations of a decoder layer, fused (x86 AVX2 + FMA, float32).
 *
 * At decode batch sizes each of these is a handful of torch ops whose dispatch (~5-10 us per
 * op) costs more than their arithmetic: RMSNorm with its residual add is ~7 ops, rotary ~5,
 * SiLU-and-multiply 3, the K/V cache write 2. One call each removes ~0.2 ms per layer.
 * Results match the torch formulas to float rounding (products and sums are rounded as torch
 * rounds them: no fused multiply-add where torch has a separate multiply and add; build with
 * -ffp-contract=off). */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kv_rows.h"

/* residual += x (when residual is given), then out = weight * (r / sqrt(mean(r^2) + eps)) */
void tm_add_rms_norm(float *x, float *residual, const float *weight, float *out, int64_t T,
                     int64_t D, float eps) {
#pragma omp parallel for schedule(static) if (T > 8)
    for (int64_t t = 0; t < T; t++) {
        float *xt = x + t * D, *ot = out + t * D;
        float *rt = residual ? residual + t * D : xt;
        if (residual)
            for (int64_t d = 0; d < D; d++) rt[d] = xt[d] + rt[d];
        __m256 acc = _mm256_setzero_ps();
        int64_t d = 0;
        for (; d + 8 <= D; d += 8) {
            const __m256 v = _mm256_loadu_ps(rt + d);
            acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
        }
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        s = _mm_add_ss(s, _mm_movehdup_ps(s));
        float sum = _mm_cvtss_f32(s);
        for (; d < D; d++) sum += rt[d] * rt[d];
        const float inv = 1.0f / sqrtf(sum / (float)D + eps);
        for (d = 0; d < D; d++) ot[d] = weight[d] * (rt[d] * inv);
    }
}

/* Neox rotary in place on H heads of T tokens (token rows `stride` floats apart):
 * x = x * cos[pos] + roll(x, D/2) * signed_sin[pos], tables [max_pos, D] (signed_sin has
 * its first half negated). */
void tm_rotary(float *x, int64_t T, int64_t H, int64_t D, int64_t stride, const float *cos,
               const float *signed_sin, const int64_t *positions) {
    const int64_t half = D / 2;
#pragma omp parallel for schedule(static) if (T > 8)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos + positions[t] * D, *s = signed_sin + positions[t] * D;
        for (int64_t h = 0; h < H; h++) {
            float *v = x + t * stride + h * D;
            for (int64_t i = 0; i < half; i++) {
                const float a = v[i], b = v[i + half];
                v[i] = a * c[i] + b * s[i];
                v[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
}

/* out[t, i] = silu(x[t, i]) * x[t, I + i]  (x = gate | up, [T, 2I]) */
void tm_silu_and_mul(const float *x, float *out, int64_t T, int64_t I) {
#pragma omp parallel for schedule(static) if (T * I > 65536)
    for (int64_t t = 0; t < T; t++) {
        const float *g = x + t * 2 * I, *u = g + I;
        float *o = out + t * I;
        int64_t i = 0;
        for (; i + 8 <= I; i += 8)
            _mm256_storeu_ps(o + i, silu_mul8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
        for (; i < I; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* Write T tokens' K and V rows (H heads of D floats; token rows k_stride / v_stride floats
 * apart) into cache slots, in kv_rows.h's format `kv_kind`: float32 copied; bfloat16 rounded
 * to nearest even (torch's .to(torch.bfloat16)); int8 each row quantized symmetric by its
 * absmax / 127 and stored as D int8 + the float32 scale (quantization/kv_cache.py). */
void tm_write_kv(const float *k, const float *v, int64_t k_stride, int64_t v_stride,
                 void *k_cache, void *v_cache,
                 const int64_t *slots, int64_t T, int64_t H, int64_t D, int64_t kv_kind) {
    const int64_t row_bytes = kv_row_bytes(D, (int)kv_kind);
    for (int64_t t = 0; t < T; t++) {
        for (int which = 0; which < 2; which++) {
            const float *src = which ? v + t * v_stride : k + t * k_stride;
            char *dst = (char *)(which ? v_cache : k_cache) + slots[t] * H * row_bytes;
            if (kv_kind == TM_KV_F32) {
                memcpy(dst, src, H * D * sizeof(float));
                continue;
            }
            if (kv_kind == TM_KV_BF16) {
                uint16_t *b = (uint16_t *)dst;
                for (int64_t i = 0; i < H * D; i++) b[i] = to_bf16(src[i]);
                continue;
            }
            for (int64_t h = 0; h < H; h++) {
                const float *row = src + h * D;
                int8_t *q = (int8_t *)(dst + h * row_bytes);
                float amax = 0.0f;
                for (int64_t d = 0; d < D; d++) amax = fmaxf(amax, fabsf(row[d]));
                float scale = amax / 127.0f;
                if (scale < 1e-12f) scale = 1e-12f;
                for (int64_t d = 0; d < D; d++) {
                    float r = nearbyintf(row[d] / scale);
                    q[d] = (int8_t)(r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r));
                }
                memcpy(q + D, &scale, sizeof scale);
            }
        }
    }
}

/* out[r] = the index of row r's largest value, the first one where several tie, and the first
 * NaN where there is one (torch.argmax's answer). A step's greedy tokens: torch's reduction
 * takes ~0.4 ms over a 16 x 49,152 logits matrix, this ~0.07. */
static int64_t argmax_row(const float *x, int64_t n) {
    __m256 top = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 v = _mm256_loadu_ps(x + j);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        top = _mm256_max_ps(top, v);
    }
    float best = max_of((const float *)&top, 8);
    int any_nan = _mm256_movemask_ps(nan) != 0;
    for (int64_t t = j; t < n; t++) {
        any_nan |= x[t] != x[t];
        best = x[t] > best ? x[t] : best;
    }
    if (any_nan) {
        for (int64_t t = 0; t < n; t++)
            if (x[t] != x[t]) return t;
    }
    const __m256 b = _mm256_set1_ps(best);
    for (j = 0; j + 8 <= n; j += 8) {
        const int hits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + j), b, _CMP_EQ_OQ));
        if (hits) return j + __builtin_ctz(hits);
    }
    for (; j < n; j++)
        if (x[j] == best) return j;
    return 0; /* n == 0 */
}

void tm_argmax_rows(const float *x, int64_t rows, int64_t n, int64_t stride, int64_t *out) {
#pragma omp parallel for schedule(static) if (rows > 1 && rows * n > 65536)
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(x + r * stride, n);
}
