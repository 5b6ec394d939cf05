/* Prompt attention over the paged KV cache, read in place (x86 AVX2 + FMA, AVX-512 score tiles
 * where the CPU has them; float32 caches).
 *
 * A prompt step's queries attend causally over their sequence's keys: the cached context and
 * this step's own tokens, whose K/V were written to the cache first. torch's SDPA needs the
 * heads transposed into a batch and, for a chunk with context, the blocks gathered into a
 * copy; its CPU flash kernel then runs many small MKL products (~60 GFLOP/s here: 7 % of a
 * 2,048-token step of the default model). Here a work item is one sequence, one KV head and
 * QB query tokens with all G query heads of that KV head (QB * G rows, so each K/V row is read
 * once for all of them), and keys come in blocks of KB: scores as a register-tiled product
 * against the block transposed (4 rows x 32 keys per tile, 8 rows with AVX-512), then an
 * online softmax (each row rescaled to its running maximum, as in flash attention), then
 * P @ V tiled 4 rows x 32 dims.
 * Layouts: q [T, Hq, D] with token rows q_stride floats apart, out [T, Hq, D] contiguous,
 * caches [num_blocks, block_size, Hkv, D]; seqs [S][3] int64: a sequence's first token row,
 * its query tokens, its context (tokens cached before them); block_table rows table_stride
 * apart, one per sequence. D must be a multiple of 32 (other head sizes stay with SDPA). */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define QB 16 /* query tokens per work item */
#define KB 32 /* keys per block: one row of scores is 4 ymm */

static inline const float *cache_row(const float *cache, const int64_t *table, int64_t t,
                                     int64_t block_size, int64_t Hkv, int64_t D, int64_t h) {
    return cache + ((table[t / block_size] * block_size + t % block_size) * Hkv + h) * D;
}

/* kt[d][j0 .. j0 + 8) = rows[j0 + jj][d] for all d: 8 x 8 register transposes */
static void transpose8(const float *const *rows, int64_t D, float *kt) {
    for (int64_t d = 0; d < D; d += 8) {
        __m256 r[8], t[8];
        for (int j = 0; j < 8; j++) r[j] = _mm256_loadu_ps(rows[j] + d);
        for (int j = 0; j < 8; j += 2) {
            t[j] = _mm256_unpacklo_ps(r[j], r[j + 1]);
            t[j + 1] = _mm256_unpackhi_ps(r[j], r[j + 1]);
        }
        for (int j = 0; j < 8; j += 4)
            for (int u = 0; u < 2; u++) {
                r[j + u] = _mm256_shuffle_ps(t[j + u], t[j + 2 + u], 0x44);
                r[j + 2 + u] = _mm256_shuffle_ps(t[j + u], t[j + 2 + u], 0xEE);
            }
        /* r[0], r[2], r[1], r[3] (rows 0-3) and r[4], r[6], r[5], r[7] (rows 4-7) now hold
         * dims 0/4, 1/5, 2/6, 3/7 in their 128-bit halves */
        const int order[4] = {0, 2, 1, 3};
        for (int u = 0; u < 4; u++) {
            const __m256 a = r[order[u]], b = r[4 + order[u]];
            _mm256_storeu_ps(kt + (d + u) * KB, _mm256_permute2f128_ps(a, b, 0x20));
            _mm256_storeu_ps(kt + (d + 4 + u) * KB, _mm256_permute2f128_ps(a, b, 0x31));
        }
    }
}

#ifdef __AVX512F__
#define SR 8 /* rows per score tile */
/* s[i][0 .. KB) = scale * q_i . keys (kt: the block transposed, [D][KB]) for mr rows, 8 x 2
 * zmm sums. The AVX2 tile's 4 x 4 ymm sums ran here with every FMA reading its key vector
 * from memory again (the compiler's choice): 20 loads per 16 FMAs held the prompt kernel to
 * ~70 GFLOP/s. This one loads 2 key vectors per 16 FMAs: 1.19-1.27x for the whole kernel
 * (16 x 128-token prompts, 9/3 and 14/2 heads, fresh or after 64 cached tokens), each score
 * still the same FMAs in d order, so the same results. */
INLINE void score_tile(const float *const *qrow, const float *kt, int64_t D, float scale,
                       float *s, const int mr) {
    __m512 acc[8][2];
    for (int i = 0; i < mr; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        const __m512 w0 = _mm512_loadu_ps(kt + d * KB), w1 = _mm512_loadu_ps(kt + d * KB + 16);
        for (int i = 0; i < mr; i++) {
            const __m512 b = _mm512_set1_ps(qrow[i][d]);
            acc[i][0] = _mm512_fmadd_ps(b, w0, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(b, w1, acc[i][1]);
        }
    }
    const __m512 sc = _mm512_set1_ps(scale);
    for (int i = 0; i < mr; i++) {
        _mm512_storeu_ps(s + i * KB, _mm512_mul_ps(acc[i][0], sc));
        _mm512_storeu_ps(s + i * KB + 16, _mm512_mul_ps(acc[i][1], sc));
    }
}
#else
#define SR 4
/* s[i][0 .. KB) = scale * q_i . keys (kt: the block transposed, [D][KB]) for mr rows, 4 x 4
 * ymm sums */
INLINE void score_tile(const float *const *qrow, const float *kt, int64_t D, float scale,
                       float *s, const int mr) {
    __m256 acc[4][4];
    for (int i = 0; i < mr; i++)
        for (int v = 0; v < 4; v++) acc[i][v] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        __m256 w[4];
        for (int v = 0; v < 4; v++) w[v] = _mm256_loadu_ps(kt + d * KB + 8 * v);
        for (int i = 0; i < mr; i++) {
            const __m256 b = _mm256_broadcast_ss(qrow[i] + d);
            for (int v = 0; v < 4; v++) acc[i][v] = _mm256_fmadd_ps(b, w[v], acc[i][v]);
        }
    }
    const __m256 sc = _mm256_set1_ps(scale);
    for (int i = 0; i < mr; i++)
        for (int v = 0; v < 4; v++) _mm256_storeu_ps(s + i * KB + 8 * v,
                                                     _mm256_mul_ps(acc[i][v], sc));
}
#endif

/* o[i][d0 .. d0 + 32) += sum_j p[i][j] * vrow_j[d0 ..] for mr rows and nk keys */
INLINE void value_tile(const float *p, const float *const *vrow, int64_t nk, int64_t d0,
                       float *o, int64_t D, const int mr) {
    __m256 acc[4][4];
    for (int i = 0; i < mr; i++)
        for (int v = 0; v < 4; v++) acc[i][v] = _mm256_loadu_ps(o + i * D + d0 + 8 * v);
    for (int64_t j = 0; j < nk; j++) {
        __m256 w[4];
        for (int v = 0; v < 4; v++) w[v] = _mm256_loadu_ps(vrow[j] + d0 + 8 * v);
        for (int i = 0; i < mr; i++) {
            const __m256 b = _mm256_broadcast_ss(p + i * KB + j);
            for (int v = 0; v < 4; v++) acc[i][v] = _mm256_fmadd_ps(b, w[v], acc[i][v]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int v = 0; v < 4; v++) _mm256_storeu_ps(o + i * D + d0 + 8 * v, acc[i][v]);
}

/* Query tokens [i0, i1) of one sequence (context ctx) with the G query heads of KV head h.
 * Row r is token i0 + r / G, query head h * G + r % G. */
static void prompt_item(const float *q, int64_t q_stride, const float *k_cache,
                        const float *v_cache, const int64_t *table, int64_t ctx, int64_t i0,
                        int64_t i1, int64_t h, int64_t G, int64_t Hkv, int64_t D,
                        int64_t block_size, float scale, float *out, float *work) {
    const int64_t R = (i1 - i0) * G, Hq = Hkv * G;
    float *kt = work, *p = kt + D * KB, *o = p + R * KB, *m = o + R * D, *l = m + R;
    const float *qrow[QB * 16], *vrow[KB];
    for (int64_t r = 0; r < R; r++) {
        qrow[r] = q + (i0 + r / G) * q_stride + (h * G + r % G) * D;
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    memset(o, 0, R * D * sizeof(float));
    const int64_t last = ctx + i1 - 1; /* the last key any row sees */
    for (int64_t j0 = 0; j0 <= last; j0 += KB) {
        const int64_t nk = last + 1 - j0 < KB ? last + 1 - j0 : KB;
        const float *krow[KB];
        for (int64_t j = 0; j < nk; j++) {
            krow[j] = cache_row(k_cache, table, j0 + j, block_size, Hkv, D, h);
            vrow[j] = cache_row(v_cache, table, j0 + j, block_size, Hkv, D, h);
        }
        for (int64_t j = 0; j < KB; j += 8) {
            if (j + 8 <= nk) {
                transpose8(krow + j, D, kt + j);
                continue;
            }
            for (int64_t jj = j; jj < j + 8; jj++)
                for (int64_t d = 0; d < D; d++) kt[d * KB + jj] = jj < nk ? krow[jj][d] : 0.0f;
        }
        for (int64_t r0 = 0; r0 < R; r0 += SR) {
            float *s = p + r0 * KB;
            switch (R - r0 < SR ? R - r0 : SR) {
#define SCORES(n) case n: score_tile(qrow + r0, kt, D, scale, s, n); break;
                SCORES(1) SCORES(2) SCORES(3) SCORES(4)
#if SR > 4
                SCORES(5) SCORES(6) SCORES(7) SCORES(8)
#endif
#undef SCORES
            }
        }
        /* Online softmax: keys past a row's position (or the block) weigh 0. The first block
         * holds key 0, which every row sees, so m[r] is finite from then on. */
        for (int64_t r = 0; r < R; r++) {
            float *pr = p + r * KB;
            const int64_t visible = ctx + i0 + r / G + 1 - j0; /* keys of this block it sees */
            const int64_t n = visible < nk ? visible : nk;
            const float top = max_of(pr, n > 0 ? n : 0), mx = top > m[r] ? top : m[r];
            for (int64_t j = n > 0 ? n : 0; j < KB; j++) pr[j] = -INFINITY;
            const float alpha = expf(m[r] - mx);
            l[r] = l[r] * alpha + exp_minus_max(pr, KB, mx);
            m[r] = mx;
            if (alpha != 1.0f)
                for (int64_t d = 0; d < D; d++) o[r * D + d] *= alpha;
        }
        for (int64_t r0 = 0; r0 < R; r0 += 4) {
            const int64_t mr = R - r0 < 4 ? R - r0 : 4;
            /* keys of this block the tile's last row sees (the rest weigh 0 for all of it) */
            const int64_t seen = ctx + i0 + (r0 + mr - 1) / G + 1 - j0;
            const int64_t nt = seen < nk ? seen : nk;
            for (int64_t d0 = 0; d0 < D; d0 += 32) {
                switch (mr) {
                    case 1: value_tile(p + r0 * KB, vrow, nt, d0, o + r0 * D, D, 1); break;
                    case 2: value_tile(p + r0 * KB, vrow, nt, d0, o + r0 * D, D, 2); break;
                    case 3: value_tile(p + r0 * KB, vrow, nt, d0, o + r0 * D, D, 3); break;
                    default: value_tile(p + r0 * KB, vrow, nt, d0, o + r0 * D, D, 4); break;
                }
            }
        }
    }
    for (int64_t r = 0; r < R; r++) {
        const float inv = 1.0f / l[r];
        float *dst = out + ((i0 + r / G) * Hq + h * G + r % G) * D;
        for (int64_t d = 0; d < D; d++) dst[d] = o[r * D + d] * inv;
    }
}

/* Returns 0, or -1 when the shapes are outside what the kernel takes (nothing is written). */
int64_t tm_prompt_attention(const float *q, int64_t q_stride, const float *k_cache,
                            const float *v_cache, const int64_t *block_table,
                            int64_t table_stride, const int64_t *seqs, int64_t S, float *out,
                            int64_t Hq, int64_t Hkv, int64_t D, int64_t block_size,
                            float scale) {
    const int64_t G = Hq / Hkv;
    if (D % 32 || G > 16 || G * Hkv != Hq) return -1;
    /* items of sequence s: Hkv * blocks[s], the query blocks in descending order (the
     * costliest first, so the dynamic schedule ends on small ones) */
    int64_t *first = malloc((size_t)(S + 1) * sizeof(int64_t));
    first[0] = 0;
    for (int64_t s = 0; s < S; s++)
        first[s + 1] = first[s] + Hkv * ((seqs[3 * s + 1] + QB - 1) / QB);
    const int64_t items = first[S], R = QB * G;
#pragma omp parallel
    {
        float *work = malloc((size_t)(D * KB + R * KB + R * D + 2 * R) * sizeof(float));
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            int64_t s = 0;
            while (first[s + 1] <= item) s++;
            const int64_t blocks = (first[s + 1] - first[s]) / Hkv, k = item - first[s];
            const int64_t h = k % Hkv, b = blocks - 1 - k / Hkv;
            const int64_t row0 = seqs[3 * s], n = seqs[3 * s + 1], ctx = seqs[3 * s + 2];
            const int64_t i0 = b * QB, i1 = i0 + QB < n ? i0 + QB : n;
            prompt_item(q + row0 * q_stride, q_stride, k_cache, v_cache,
                        block_table + s * table_stride, ctx, i0, i1, h, G, Hkv, D, block_size,
                        scale, out + row0 * Hq * D, work);
        }
        free(work);
    }
    free(first);
    return 0;
}
