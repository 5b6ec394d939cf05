/* Decode attention over the paged KV cache, read in place (x86 AVX2 + FMA).
 *
 * Each decode sequence has one query token; its keys and values sit in cache blocks listed by
 * its block-table row. torch ops would first gather every sequence's blocks into a padded
 * contiguous copy (for every layer of every step) and then read that copy again in SDPA; here
 * each (sequence, KV head) pair reads its rows straight from the blocks once for the scores
 * and once for the values. The query heads sharing a KV head (grouped-query attention) are
 * scored together, so a K or V row is loaded once per group.
 *
 * Layouts: q [B, Hq, D] float32 with its token rows q_stride floats apart (a view of the qkv
 * projection's output needs no copy), out [B, Hq, D] contiguous; caches [num_blocks, block_size, Hkv, row] with row = D
 * float32, or (int8 cache) D int8 followed by their float32 scale (quantization/kv_cache.py);
 * block_table [num_seqs, table_stride] int64; seq_lens [B] int64. D must be a multiple of 8.
 * Softmax is exact (max-subtracted, two passes); exp uses a polynomial accurate to ~2 ulp. */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

static inline __m256 load8(const void *row, int64_t d, int kv_int8) {
    if (!kv_int8) return _mm256_loadu_ps((const float *)row + d);
    __m128i b = _mm_loadl_epi64((const __m128i *)((const int8_t *)row + d));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}

static inline float row_scale(const void *row, int64_t D, int kv_int8) {
    float s = 1.0f;
    if (kv_int8) memcpy(&s, (const int8_t *)row + D, sizeof s);
    return s;
}

/* One work item: sequence b, KV heads [h0, h1) (all of a sequence's heads when there are enough
 * sequences to keep every thread busy, so each thread streams whole contiguous token rows). */
static void attend_item(const float *q, const void *k_cache, const void *v_cache,
                        const int64_t *table, int64_t L, float *out, int64_t Hq, int64_t Hkv,
                        int64_t h0, int64_t h1, int64_t D, int64_t block_size, float scale,
                        int kv_int8, float *scores, float *acc) {
    const int64_t G = Hq / Hkv, H = (h1 - h0) * G; /* query heads of this item */
    const int64_t row_bytes = kv_int8 ? D + 4 : D * 4;
    const int64_t token_bytes = Hkv * row_bytes;
    const int64_t Lp = (L + 7) & ~(int64_t)7;
    const float *qh = q + h0 * G * D;
#define TOKEN_ROW(cache, t) ((const char *)(cache) + \
    (table[(t) / block_size] * block_size + (t) % block_size) * token_bytes + h0 * row_bytes)
    /* Scores: s[h, t] = scale * q_h . k_t (int8 rows: times the row's scale). */
    for (int64_t t = 0; t < L; t++) {
        const char *token = TOKEN_ROW(k_cache, t);
        if (t + 2 < L) _mm_prefetch(TOKEN_ROW(k_cache, t + 2), _MM_HINT_T0);
        for (int64_t kvh = 0; kvh < h1 - h0; kvh++) {
            const char *row = token + kvh * row_bytes;
            const float rs = row_scale(row, D, kv_int8) * scale;
            for (int64_t g = 0; g < G; g++) {
                const float *qg = qh + (kvh * G + g) * D;
                __m256 s = _mm256_setzero_ps();
                for (int64_t d = 0; d < D; d += 8)
                    s = _mm256_fmadd_ps(_mm256_loadu_ps(qg + d), load8(row, d, kv_int8), s);
                scores[(kvh * G + g) * Lp + t] = hsum8(s) * rs;
            }
        }
    }
    /* Softmax weights per query head (padding lanes set to -inf give 0). */
    for (int64_t h = 0; h < H; h++) {
        float *s = scores + h * Lp;
        for (int64_t t = L; t < Lp; t++) s[t] = -INFINITY;
        __m256 mx = _mm256_set1_ps(-INFINITY);
        for (int64_t t = 0; t < Lp; t += 8) mx = _mm256_max_ps(mx, _mm256_load_ps(s + t));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const __m256 m = _mm256_set1_ps(_mm_cvtss_f32(m4));
        __m256 sum = _mm256_setzero_ps();
        for (int64_t t = 0; t < Lp; t += 8) {
            __m256 e = exp8(_mm256_sub_ps(_mm256_load_ps(s + t), m));
            _mm256_store_ps(s + t, e);
            sum = _mm256_add_ps(sum, e);
        }
        const float inv = 1.0f / hsum8(sum);
        for (int64_t t = 0; t < L; t++) s[t] *= inv;
    }
    /* Values: out_h = sum_t p[h, t] * v_t. */
    memset(acc, 0, H * D * sizeof(float));
    for (int64_t t = 0; t < L; t++) {
        const char *token = TOKEN_ROW(v_cache, t);
        if (t + 2 < L) _mm_prefetch(TOKEN_ROW(v_cache, t + 2), _MM_HINT_T0);
        for (int64_t kvh = 0; kvh < h1 - h0; kvh++) {
            const char *row = token + kvh * row_bytes;
            const float rs = row_scale(row, D, kv_int8);
            for (int64_t d = 0; d < D; d += 8) {
                const __m256 v = load8(row, d, kv_int8);
                for (int64_t g = 0; g < G; g++) {
                    const int64_t h = kvh * G + g;
                    __m256 a = _mm256_loadu_ps(acc + h * D + d);
                    a = _mm256_fmadd_ps(_mm256_set1_ps(scores[h * Lp + t] * rs), v, a);
                    _mm256_storeu_ps(acc + h * D + d, a);
                }
            }
        }
    }
#undef TOKEN_ROW
    memcpy(out + h0 * G * D, acc, H * D * sizeof(float));
}

void tm_paged_decode_attention(const float *q, int64_t q_stride, const void *k_cache,
                               const void *v_cache,
                               const int64_t *block_table, int64_t table_stride,
                               const int64_t *seq_lens, float *out, int64_t B, int64_t Hq,
                               int64_t Hkv, int64_t D, int64_t block_size, float scale,
                               int64_t kv_int8) {
    const int64_t split = B >= 2 * omp_get_max_threads() ? 1 : Hkv; /* items per sequence */
    const int64_t heads_per_item = Hkv / split;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t item = 0; item < B * split; item++) {
        const int64_t b = item / split, h0 = item % split * heads_per_item;
        const int64_t L = seq_lens[b];
        if (L <= 0) {
            memset(out + (b * Hq + h0 * (Hq / Hkv)) * D, 0,
                   heads_per_item * (Hq / Hkv) * D * sizeof(float));
            continue;
        }
        const int64_t Lp = (L + 7) & ~(int64_t)7, H = heads_per_item * (Hq / Hkv);
        float *scores = aligned_alloc(32, (size_t)(H * Lp + H * D) * sizeof(float));
        attend_item(q + b * q_stride, k_cache, v_cache, block_table + b * table_stride, L,
                    out + b * Hq * D, Hq, Hkv, h0, h0 + heads_per_item, D, block_size, scale,
                    (int)kv_int8, scores, scores + H * Lp);
        free(scores);
    }
}
