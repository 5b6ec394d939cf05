/* Decode attention over the paged KV cache, read in place (x86 AVX2 + FMA).
 *
 * Each decode sequence has one query token; its keys and values sit in cache blocks listed by
 * its block-table row. torch ops would first gather every sequence's blocks into a padded
 * contiguous copy (for every layer of every step) and then read that copy again in SDPA; here
 * each chunk of a sequence's tokens reads its rows straight from the blocks once for the scores
 * and once for the values, and the chunks' partial softmax sums are merged at the end (as in
 * flash-decoding). The query heads sharing a KV head (grouped-query attention) are scored
 * together, so a K or V row is loaded once per group.
 * Layouts: q [B, Hq, D] float32 with its token rows q_stride floats apart (a view of the qkv
 * projection's output needs no copy), out [B, Hq, D] contiguous; caches [num_blocks,
 * block_size, Hkv, row] with row = D float32, or (int8 cache) D int8 followed by their float32
 * scale (quantization/kv_cache.py), or D bfloat16 (widened a chunk at a time into float32
 * rows, then the float32 path); block_table [num_seqs, table_stride] int64; seq_lens [B]
 * int64. D must be a multiple of 8. Softmax is exact: each chunk subtracts its own maximum and
 * the merge rescales the chunks to the largest; exp uses a polynomial accurate to ~2 ulp.
 * window > 0: the query (position seq_len - 1) sees the last `window` keys only (Mistral's,
 * gpt-oss' sliding layers); sinks [Hq] (or NULL): a logit per head that joins each softmax's
 * denominator and adds no value (gpt-oss), taken in the merge like one more chunk. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kv_rows.h"

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

/* Work is split into chunks of CHUNK tokens of one sequence, all heads at once: a thread then
 * streams whole contiguous token rows, and a single long sequence still keeps every thread
 * busy. The chunk boundaries depend only on the sequence's own length, so a sequence gets the
 * same result whatever else is in the batch and however many threads run. */
#define CHUNK 64

/* Token rows are prefetched this many tokens ahead into L2, not L1: on a Zen 4 the L1 hint's
 * requests filled L1's few miss buffers and the loads queued behind them (a 32-sequence,
 * 160-token decode step of the default model's 30 layers, cache blocks in random order:
 * 14.5 ms with L1 hints 4 tokens ahead, 12.0 ms now; bench/NOTES.md). */
#define AHEAD 8

/* Token t's row of all KV heads in a paged cache (table, block_size, token_bytes in scope). */
#define TOKEN_ROW(cache, t) ((const char *)(cache) + \
    (table[(t) / block_size] * block_size + (t) % block_size) * token_bytes)

/* Token t's row prefetched into L2. */
static inline void fetch_row(const void *cache, const int64_t *table, int64_t t,
                             int64_t block_size, int64_t token_bytes) {
    const char *row = TOKEN_ROW(cache, t);
    for (int64_t b = 0; b < token_bytes; b += 64) _mm_prefetch(row + b, _MM_HINT_T2);
}

/* Token t + AHEAD's row, while it is still in the chunk [.., t1), prefetched into L2. */
static inline void fetch_ahead(const void *cache, const int64_t *table, int64_t t, int64_t t1,
                               int64_t block_size, int64_t token_bytes) {
    if (t + AHEAD < t1) fetch_row(cache, table, t + AHEAD, block_size, token_bytes);
}

/* acc[h] = sum over the chunk's tokens t of p[h, t] * v_t (p = scores, CHUNK apart per head)
 * for the G heads of each KV head, NB x 8 dims at a time: those G x NB sums stay in registers
 * while the chunk's tokens go by (the score pass prefetched the rows), one FMA per token in
 * token order, as values_any adds them, so the same results. Keeping them in memory instead
 * (values_any) costs a load and a store per FMA: a decode step's attention of 16 sequences at
 * 160 tokens, the default model's 9/3 heads (G 3, NB 4), runs 1.5x faster in cache this way;
 * with Qwen2.5-0.5B's 14/2 heads (G 7, NB 1: each row read in 8 passes) 1.26x. */
INLINE void values(const void *v_cache, const int64_t *table, int64_t t0, int64_t t1,
                   int64_t Hkv, int64_t D, int64_t block_size, int kv_int8,
                   const float *scores, float *acc, const int G, const int NB) {
    const int64_t row_bytes = kv_int8 ? D + 4 : D * 4, token_bytes = Hkv * row_bytes;
    for (int64_t kvh = 0; kvh < Hkv; kvh++)
        for (int64_t d = 0; d < D; d += 8 * NB) {
            __m256 a[12];
            for (int i = 0; i < G * NB; i++) a[i] = _mm256_setzero_ps();
            for (int64_t t = t0; t < t1; t++) {
                const char *row = TOKEN_ROW(v_cache, t) + kvh * row_bytes;
                const float rs = row_scale(row, D, kv_int8);
                __m256 v[8];
                for (int n = 0; n < NB; n++) v[n] = load8(row, d + 8 * n, kv_int8);
                for (int g = 0; g < G; g++) {
                    const __m256 p = _mm256_set1_ps(scores[(kvh * G + g) * CHUNK + t - t0] * rs);
                    for (int n = 0; n < NB; n++)
                        a[g * NB + n] = _mm256_fmadd_ps(p, v[n], a[g * NB + n]);
                }
            }
            for (int g = 0; g < G; g++)
                for (int n = 0; n < NB; n++)
                    _mm256_storeu_ps(acc + (kvh * G + g) * D + d + 8 * n, a[g * NB + n]);
        }
}

/* The same for any G (more than 12 query heads per KV head): token by token, each row read
 * once, the sums kept in acc. */
static void values_any(const void *v_cache, const int64_t *table, int64_t t0, int64_t t1,
                       int64_t Hq, int64_t Hkv, int64_t D, int64_t block_size, int kv_int8,
                       const float *scores, float *acc) {
    const int64_t G = Hq / Hkv, row_bytes = kv_int8 ? D + 4 : D * 4;
    const int64_t token_bytes = Hkv * row_bytes;
    memset(acc, 0, Hq * D * sizeof(float));
    for (int64_t t = t0; t < t1; t++) {
        const char *token = TOKEN_ROW(v_cache, t);
        for (int64_t kvh = 0; kvh < Hkv; kvh++) {
            const char *row = token + kvh * row_bytes;
            const float rs = row_scale(row, D, kv_int8);
            for (int64_t d = 0; d < D; d += 8) {
                const __m256 v = load8(row, d, kv_int8);
                for (int64_t g = 0; g < G; g++) {
                    const int64_t h = kvh * G + g;
                    __m256 a = _mm256_loadu_ps(acc + h * D + d);
                    a = _mm256_fmadd_ps(_mm256_set1_ps(scores[h * CHUNK + t - t0] * rs), v, a);
                    _mm256_storeu_ps(acc + h * D + d, a);
                }
            }
        }
    }
}

/* Chunk [t0, t1) of one sequence, for all Hq query heads: the chunk's score maximum m[h], the
 * sum of exp(s - m[h]) in l[h], and acc[h] = sum_t exp(s_t - m[h]) * v_t (unnormalized). */
static void attend_chunk(const float *q, const void *k_cache, const void *v_cache,
                         const int64_t *table, int64_t t0, int64_t t1, int64_t Hq, int64_t Hkv,
                         int64_t D, int64_t block_size, float scale, int kv_int8, float *m,
                         float *l, float *acc) {
    const int64_t G = Hq / Hkv, n = t1 - t0;
    const int64_t row_bytes = kv_int8 ? D + 4 : D * 4;
    const int64_t token_bytes = Hkv * row_bytes;
    float scores[Hq * CHUNK];
    /* the chunk's first rows, which fetch_ahead (AHEAD tokens on) never asks for: a chunk's
     * start was a string of misses (default model, 16 x 160 tokens, 30 layers from memory:
     * 6-10 % faster primed) */
    for (int64_t t = t0; t < t0 + AHEAD && t < t1; t++) {
        fetch_row(k_cache, table, t, block_size, token_bytes);
        fetch_row(v_cache, table, t, block_size, token_bytes);
    }
    /* Scores: s[h, t] = scale * q_h . k_t (int8 rows: times the row's scale). */
    for (int64_t t = t0; t < t1; t++) {
        const char *token = TOKEN_ROW(k_cache, t);
        /* the value rows too: the value pass runs through them faster than memory answers
         * (without this, in registers it was 1.5x faster in cache but slower from memory) */
        fetch_ahead(k_cache, table, t, t1, block_size, token_bytes);
        fetch_ahead(v_cache, table, t, t1, block_size, token_bytes);
        for (int64_t kvh = 0; kvh < Hkv; kvh++) {
            const char *row = token + kvh * row_bytes;
            const float rs = row_scale(row, D, kv_int8) * scale;
            for (int64_t g = 0; g < G; g++) {
                const float *qg = q + (kvh * G + g) * D;
                __m256 s = _mm256_setzero_ps();
                for (int64_t d = 0; d < D; d += 8)
                    s = _mm256_fmadd_ps(_mm256_loadu_ps(qg + d), load8(row, d, kv_int8), s);
                scores[(kvh * G + g) * CHUNK + t - t0] = hsum8(s) * rs;
            }
        }
    }
    /* Per query head: the chunk's maximum, then the weights exp(s - m) and their sum. */
    for (int64_t h = 0; h < Hq; h++) {
        float *s = scores + h * CHUNK;
        const float mx = max_of(s, n);
        for (int64_t t = n; t < (n + 7) / 8 * 8; t++) s[t] = -INFINITY; /* exp gives 0 */
        m[h] = mx;
        l[h] = exp_minus_max(s, n, mx);
    }
    /* Values: acc_h = sum_t p[h, t] * v_t, as many 8-dim steps at a time as 12 sums in
     * registers allow (a power of 2 dividing D / 8). */
    int nb = G <= 12 ? 12 / (int)G : 0;
    nb = nb >= 8 ? 8 : nb >= 4 ? 4 : nb >= 2 ? 2 : nb;
    while (nb > 1 && (D / 8) % nb) nb /= 2;
    switch (nb ? G * 16 + nb : 0) { /* one case per (G, NB) pair; 0: G above 12 */
#define VALUES(g, n) \
    case g * 16 + n: \
        values(v_cache, table, t0, t1, Hkv, D, block_size, kv_int8, scores, acc, g, n); break;
        VALUES(1, 8) VALUES(1, 4) VALUES(1, 2) VALUES(1, 1)
        VALUES(2, 4) VALUES(2, 2) VALUES(2, 1) VALUES(3, 4) VALUES(3, 2) VALUES(3, 1)
        VALUES(4, 2) VALUES(4, 1) VALUES(5, 2) VALUES(5, 1) VALUES(6, 2) VALUES(6, 1)
        VALUES(7, 1) VALUES(8, 1) VALUES(9, 1) VALUES(10, 1) VALUES(11, 1) VALUES(12, 1)
#undef VALUES
        default: values_any(v_cache, table, t0, t1, Hq, Hkv, D, block_size, kv_int8, scores, acc);
    }
}

/* bf16 caches: the chunk's K and V rows widened into float32 scratch (2 x CHUNK token rows),
 * then the float32 path over them. (One path reading all three formats row by row made the
 * compiler stop splitting its loops by format: float32 ran 20 % slower.) */
static void attend_chunk_bf16(const float *q, const void *k_cache, const void *v_cache,
                              const int64_t *table, int64_t t0, int64_t t1, int64_t Hq,
                              int64_t Hkv, int64_t D, int64_t block_size, float scale, float *m,
                              float *l, float *acc, float *scratch) {
    const int64_t row = Hkv * D, token_bytes = row * 2;
    float *kf = scratch, *vf = scratch + CHUNK * row;
    for (int64_t t = t0; t < t1; t++) {
        kv_row_floats(TOKEN_ROW(k_cache, t), row, TM_KV_BF16, kf + (t - t0) * row);
        kv_row_floats(TOKEN_ROW(v_cache, t), row, TM_KV_BF16, vf + (t - t0) * row);
    }
    const int64_t whole[1] = {0}; /* the scratch: one block of CHUNK tokens */
    attend_chunk(q, kf, vf, whole, 0, t1 - t0, Hq, Hkv, D, CHUNK, scale, 0, m, l, acc);
}

void tm_paged_decode_attention(const float *q, int64_t q_stride, const void *k_cache,
                               const void *v_cache,
                               const int64_t *block_table, int64_t table_stride,
                               const int64_t *seq_lens, float *out, int64_t B, int64_t Hq,
                               int64_t Hkv, int64_t D, int64_t block_size, float scale,
                               int64_t kv_kind, int64_t window, const float *sinks) {
    /* first[b] .. first[b + 1]: sequence b's chunks from its oldest visible key (none for an
     * empty sequence) */
#define OLDEST(b) (window > 0 && seq_lens[b] > window ? seq_lens[b] - window : 0)
    int64_t *first = malloc((size_t)(B + 1) * sizeof(int64_t));
    first[0] = 0;
    for (int64_t b = 0; b < B; b++)
        first[b + 1] = first[b] + (seq_lens[b] - OLDEST(b) + CHUNK - 1) / CHUNK;
    const int64_t items = first[B], per_item = Hq * (D + 2);
    float *part = malloc((size_t)(items > 0 ? items : 1) * per_item * sizeof(float));
#pragma omp parallel
    {
        float *scratch = kv_kind == TM_KV_BF16
                             ? malloc((size_t)(2 * CHUNK * Hkv * D) * sizeof(float)) : NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            int64_t lo = 0, hi = B; /* the sequence b with first[b] <= item < first[b + 1] */
            while (hi - lo > 1) {
                const int64_t mid = (lo + hi) / 2;
                if (first[mid] <= item) lo = mid; else hi = mid;
            }
            const int64_t t0 = OLDEST(lo) + (item - first[lo]) * CHUNK;
            const int64_t t1 = t0 + CHUNK < seq_lens[lo] ? t0 + CHUNK : seq_lens[lo];
            float *p = part + item * per_item;
            if (kv_kind == TM_KV_BF16)
                attend_chunk_bf16(q + lo * q_stride, k_cache, v_cache,
                                  block_table + lo * table_stride, t0, t1, Hq, Hkv, D,
                                  block_size, scale, p, p + Hq, p + 2 * Hq, scratch);
            else
                attend_chunk(q + lo * q_stride, k_cache, v_cache,
                             block_table + lo * table_stride, t0, t1, Hq, Hkv, D, block_size,
                             scale, kv_kind == TM_KV_INT8, p, p + Hq, p + 2 * Hq);
        }
        /* Merge each sequence's chunks: rescale to the largest maximum, then normalize. */
#pragma omp for schedule(static)
        for (int64_t b = 0; b < B; b++) {
            float *o = out + b * Hq * D;
            if (first[b + 1] == first[b]) {
                memset(o, 0, Hq * D * sizeof(float));
                continue;
            }
            for (int64_t h = 0; h < Hq; h++) {
                float mx = sinks ? sinks[h] : -INFINITY, sum = 0.0f;
                for (int64_t c = first[b]; c < first[b + 1]; c++) {
                    const float mc = part[c * per_item + h];
                    mx = mc > mx ? mc : mx;
                }
                if (sinks) sum = expf(sinks[h] - mx);
                for (int64_t d = 0; d < D; d++) o[h * D + d] = 0.0f;
                for (int64_t c = first[b]; c < first[b + 1]; c++) {
                    const float *p = part + c * per_item;
                    const float w = expf(p[h] - mx);
                    sum += w * p[Hq + h];
                    for (int64_t d = 0; d < D; d++) o[h * D + d] += w * p[2 * Hq + h * D + d];
                }
                const float inv = 1.0f / sum;
                for (int64_t d = 0; d < D; d++) o[h * D + d] *= inv;
            }
        }
        free(scratch);
    }
    free(part);
    free(first);
#undef OLDEST
}
