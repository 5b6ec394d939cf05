/* The KV cache's row formats, one token's one KV head a row (quantization/kv_cache.py;
 * layer_kernels.py's `kv_kind`): float32 (D floats), int8 (D int8 then their float32 scale:
 * value = q * scale) or bfloat16 (D bf16, rounded to nearest even on write). */
#pragma once
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

enum { TM_KV_F32 = 0, TM_KV_INT8 = 1, TM_KV_BF16 = 2 };

INLINE int64_t kv_row_bytes(int64_t D, int kind) {
    return kind == TM_KV_INT8 ? D + 4 : kind == TM_KV_BF16 ? D * 2 : D * 4;
}

/* an int8 row's scale (1 for the float formats) */
INLINE float kv_row_scale(const void *row, int64_t D, int kind) {
    float s = 1.0f;
    if (kind == TM_KV_INT8) memcpy(&s, (const int8_t *)row + D, sizeof s);
    return s;
}

/* elements d .. d + 8 of a row as floats (int8: unscaled) */
INLINE __m256 kv_load8(const void *row, int64_t d, int kind) {
    if (kind == TM_KV_F32) return _mm256_loadu_ps((const float *)row + d);
    if (kind == TM_KV_BF16) {
        const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + d));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    const __m128i b = _mm_loadl_epi64((const __m128i *)((const int8_t *)row + d));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}

/* a row's D values as floats (int8: times the row's scale, as dequantize_kv computes them) */
static inline void kv_row_floats(const void *row, int64_t D, int kind, float *out) {
    const __m256 s = _mm256_set1_ps(kv_row_scale(row, D, kind));
    for (int64_t d = 0; d < D; d += 8) {
        const __m256 v = kv_load8(row, d, kind);
        _mm256_storeu_ps(out + d, kind == TM_KV_INT8 ? _mm256_mul_ps(v, s) : v);
    }
}
