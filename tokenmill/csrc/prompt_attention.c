/* Prompt attention over the paged KV cache, read in place (x86 AVX2 + FMA, AVX-512 where
 * the CPU has it; float32, bfloat16 or int8 caches).
 *
 * A prompt step's queries attend causally over their sequence's keys: the cached context and
 * this step's own tokens, whose K/V were written to the cache first. torch's SDPA needs the
 * heads transposed into a batch and, for a chunk with context, the blocks gathered into a
 * copy; its CPU flash kernel then runs many small MKL products (~60 GFLOP/s here). Here a work
 * item is one sequence, one KV head and QB query tokens with all G query heads of that KV head
 * (QB * G <= RT rows, so each K/V row is read once for all of them), and keys come in blocks
 * of KB. The item's rows lie across the vector lanes: its queries are transposed once
 * ([D][rows]), so scores for a block come out as [key][rows] from register tiles of TK keys by
 * NV row vectors (each key element broadcast, no transposed copy of the keys), the online
 * softmax (each row rescaled to its running maximum, as in flash attention) is lane-wise with
 * no horizontal maxima or sums, and P @ V accumulates into the output transposed ([D][rows])
 * in tiles of TK dims by NV row vectors, written back row-major at the item's end. Before
 * (rows down, keys across, the keys transposed per block): 135 GFLOP/s on a 2048-token chunk
 * after 14,000 cached tokens (Qwen2.5-0.5B's heads, two Zen 4 threads); now ~170.
 * Layouts: q [T, Hq, D] with token rows q_stride floats apart, out [T, Hq, D] contiguous,
 * caches [num_blocks, block_size, Hkv, row] in kv_rows.h's format kv_kind (a block of rows
 * other than float32 is converted to floats once per work item); seqs [S][3] int64: a sequence's first token row,
 * its query tokens, its context (tokens cached before them); block_table rows table_stride
 * apart, one per sequence. D must be a multiple of 32 (other head sizes stay with SDPA). */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kv_rows.h"

#define KB 32 /* keys per block */

/* VL rows a vector; a tile keeps TK x NV vector sums in registers; RT rows an item (more rows
 * share each pass over K/V). Chosen on 2048 query tokens after 14,000 cached (Zen 4, two
 * threads; GFLOP/s): AVX-512 8 x 3 by 288 rows 173 (x 3 by 96 153, by 192 165, by 384 171;
 * 8 x 2 by 256 165; 16 x 1 by 288 159); AVX2 (the same CPU, AVX-512 off) 8 x 1 by 128 110
 * (4 x 2 by 128 86, 4 x 3 by 192 99; the keys-across kernel before it 92). */
#ifdef __AVX512F__
typedef __m512 vec;
#define VL 16
#define TK 8
#define NV 3
#define RT 288
#define vload _mm512_loadu_ps
#define vstore _mm512_storeu_ps
#define vset1 _mm512_set1_ps
#define vfma _mm512_fmadd_ps
#define vmul _mm512_mul_ps
#define vadd _mm512_add_ps
#define vsub _mm512_sub_ps
#define vmax _mm512_max_ps
#define vzero _mm512_setzero_ps
#define vexp exp16
/* s with its first n lanes (0 <= n <= VL) set to -inf */
static inline vec hide_first(vec s, int64_t n) {
    return _mm512_mask_mov_ps(s, (__mmask16)((1u << n) - 1), _mm512_set1_ps(-INFINITY));
}
#else
typedef __m256 vec;
#define VL 8
#define TK 8
#define NV 1
#define RT 128
#define vload _mm256_loadu_ps
#define vstore _mm256_storeu_ps
#define vset1 _mm256_set1_ps
#define vfma _mm256_fmadd_ps
#define vmul _mm256_mul_ps
#define vadd _mm256_add_ps
#define vsub _mm256_sub_ps
#define vmax _mm256_max_ps
#define vzero _mm256_setzero_ps
#define vexp exp8
static inline vec hide_first(vec s, int64_t n) {
    static const int32_t first[2 * VL] = {-1, -1, -1, -1, -1, -1, -1, -1};
    const __m256 m = _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i *)(first + VL - n)));
    return _mm256_blendv_ps(s, _mm256_set1_ps(-INFINITY), m);
}
#endif

/* token t's row of KV head h (row_bytes a row) */
static inline const void *cache_row(const void *cache, const int64_t *table, int64_t t,
                                    int64_t block_size, int64_t Hkv, int64_t row_bytes,
                                    int64_t h) {
    return (const char *)cache +
           ((table[t / block_size] * block_size + t % block_size) * Hkv + h) * row_bytes;
}

/* sT[j][0 .. nv * VL) = scale * key_j . q_r for nk <= TK keys and nv row vectors (qT: the
 * queries transposed, [D][Rp]): each score the same FMAs in d order as a dot product. */
INLINE void score_tile(const float *qT, int64_t Rp, const float *const *krow, int64_t D,
                       float scale, float *sT, const int nk, const int nv) {
    vec acc[TK][NV];
    for (int j = 0; j < nk; j++)
        for (int v = 0; v < nv; v++) acc[j][v] = vzero();
    for (int64_t d = 0; d < D; d++) {
        vec qv[NV];
        for (int v = 0; v < nv; v++) qv[v] = vload(qT + d * Rp + v * VL);
        for (int j = 0; j < nk; j++) {
            const vec b = vset1(krow[j][d]);
            for (int v = 0; v < nv; v++) acc[j][v] = vfma(b, qv[v], acc[j][v]);
        }
    }
    const vec sc = vset1(scale);
    for (int j = 0; j < nk; j++)
        for (int v = 0; v < nv; v++) vstore(sT + j * Rp + v * VL, vmul(acc[j][v], sc));
}

/* oT[d0 + e][0 .. nv * VL) = alpha * oT[d0 + e] + sum_j pT[j] * vrow_j[d0 + e] for TK dims
 * and nk keys, in j order */
INLINE void value_tile(const float *pT, int64_t Rp, const float *const *vrow, int64_t nk,
                       int64_t d0, float *oT, const vec *alpha, const int nv) {
    vec acc[TK][NV];
    for (int e = 0; e < TK; e++)
        for (int v = 0; v < nv; v++) acc[e][v] = vmul(vload(oT + (d0 + e) * Rp + v * VL), alpha[v]);
    for (int64_t j = 0; j < nk; j++) {
        vec pv[NV];
        for (int v = 0; v < nv; v++) pv[v] = vload(pT + j * Rp + v * VL);
        for (int e = 0; e < TK; e++) {
            const vec b = vset1(vrow[j][d0 + e]);
            for (int v = 0; v < nv; v++) acc[e][v] = vfma(b, pv[v], acc[e][v]);
        }
    }
    for (int e = 0; e < TK; e++)
        for (int v = 0; v < nv; v++) vstore(oT + (d0 + e) * Rp + v * VL, acc[e][v]);
}

/* Query tokens [i0, i1) of one sequence (context ctx) with the G query heads of KV head h.
 * Row r is token i0 + r / G, query head h * G + r % G; the rows lie across the lanes
 * (queries, scores and sums transposed, Rp rows padded to whole vectors with zero queries), so
 * the online softmax is lane-wise: no transposes of keys, no horizontal maxima or sums. */
static void prompt_item(const float *q, int64_t q_stride, const void *k_cache,
                        const void *v_cache, const int64_t *table, int64_t ctx, int64_t i0,
                        int64_t i1, int64_t h, int64_t G, int64_t Hkv, int64_t D,
                        int64_t block_size, float scale, int kind, float *out, float *work) {
    const int64_t R = (i1 - i0) * G, Rp = (R + VL - 1) / VL * VL, Hq = Hkv * G;
    const int64_t row_bytes = kv_row_bytes(D, kind);
    /* (kb, vb: a block's rows as floats, for the caches that hold another format) */
    float *kb = work, *vb = kb + KB * D, *qT = vb + KB * D, *sT = qT + D * RT,
          *oT = sT + KB * RT, *m = oT + D * RT, *l = m + RT, *alpha = l + RT;
    for (int64_t r = 0; r < Rp; r++) {
        const float *src = q + (i0 + r / G) * q_stride + (h * G + r % G) * D;
        for (int64_t d = 0; d < D; d++) qT[d * Rp + r] = r < R ? src[d] : 0.0f;
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    memset(oT, 0, D * Rp * sizeof(float));
    const int64_t last = ctx + i1 - 1; /* the last key any row sees */
    for (int64_t j0 = 0; j0 <= last; j0 += KB) {
        const int64_t nk = last + 1 - j0 < KB ? last + 1 - j0 : KB;
        const float *krow[KB], *vrow[KB];
        for (int64_t j = 0; j < nk; j++) {
            const void *kr = cache_row(k_cache, table, j0 + j, block_size, Hkv, row_bytes, h);
            const void *vr = cache_row(v_cache, table, j0 + j, block_size, Hkv, row_bytes, h);
            if (kind == TM_KV_F32) {
                krow[j] = kr;
                vrow[j] = vr;
                continue;
            }
            kv_row_floats(kr, D, kind, kb + j * D);
            kv_row_floats(vr, D, kind, vb + j * D);
            krow[j] = kb + j * D;
            vrow[j] = vb + j * D;
        }
        for (int64_t r0 = 0; r0 < Rp; r0 += NV * VL) {
            const int nv = Rp - r0 < NV * VL ? (Rp - r0) / VL : NV;
            for (int64_t k0 = 0; k0 < nk; k0 += TK) {
                const int64_t kn = nk - k0 < TK ? nk - k0 : TK;
                float *st = sT + k0 * Rp + r0;
#define SCORE_ROWS(n)                                                                    \
    switch (nv) {                                                                        \
        case 1: score_tile(qT + r0, Rp, krow + k0, D, scale, st, n, 1); break;           \
        case 2: score_tile(qT + r0, Rp, krow + k0, D, scale, st, n, NV > 1 ? 2 : 1); break; \
        default: score_tile(qT + r0, Rp, krow + k0, D, scale, st, n, NV); break;         \
    }
#define SCORES(n) case n: SCORE_ROWS(n); break;
                switch (kn) {
                    SCORES(1) SCORES(2) SCORES(3) SCORES(4)
#if TK > 4
                    SCORES(5) SCORES(6) SCORES(7) SCORES(8)
#endif
                }
#undef SCORES
#undef SCORE_ROWS
            }
        }
        /* Online softmax, lane-wise: key t is hidden from rows r < G * (t - ctx - i0) (later
         * tokens only); each row rescaled to its running maximum, as in flash attention. The
         * first block holds key 0, which every row sees, so m is finite from then on. */
        for (int64_t r0 = 0; r0 < Rp; r0 += VL) {
            const vec m_old = vload(m + r0);
            vec mx = m_old;
            for (int64_t j = 0; j < nk; j++) {
                float *s = sT + j * Rp + r0;
                const int64_t hidden = G * (j0 + j - ctx - i0) - r0;
                if (hidden > 0) vstore(s, hide_first(vload(s), hidden < VL ? hidden : VL));
                mx = vmax(mx, vload(s));
            }
            vec sum = vzero();
            for (int64_t j = 0; j < nk; j++) {
                float *s = sT + j * Rp + r0;
                const vec e = vexp(vsub(vload(s), mx));
                vstore(s, e);
                sum = vadd(sum, e);
            }
            const vec a = vexp(vsub(m_old, mx));
            vstore(alpha + r0, a);
            vstore(l + r0, vadd(vmul(vload(l + r0), a), sum));
            vstore(m + r0, mx);
        }
        for (int64_t r0 = 0; r0 < Rp; r0 += NV * VL) {
            const int nv = Rp - r0 < NV * VL ? (Rp - r0) / VL : NV;
            /* keys of this block the tile's last real row sees (the rest weigh 0 for all of
             * its rows; padding rows are never written out) */
            const int64_t rl = (r0 + nv * VL < R ? r0 + nv * VL : R) - 1;
            const int64_t seen = ctx + i0 + rl / G + 1 - j0;
            const int64_t nt = seen < nk ? (seen > 0 ? seen : 0) : nk;
            vec a[NV];
            for (int v = 0; v < nv; v++) a[v] = vload(alpha + r0 + v * VL);
            for (int64_t d0 = 0; d0 < D; d0 += TK) {
                switch (nv) {
#define VALUES(n) case n: value_tile(sT + r0, Rp, vrow, nt, d0, oT + r0, a, n); break;
                    VALUES(1)
#if NV > 1
                    VALUES(2)
#endif
#if NV > 2
                    VALUES(3)
#endif
#undef VALUES
                }
            }
        }
    }
    for (int64_t r = 0; r < R; r++) {
        const float inv = 1.0f / l[r];
        float *dst = out + ((i0 + r / G) * Hq + h * G + r % G) * D;
        for (int64_t d = 0; d < D; d++) dst[d] = oT[d * Rp + r] * inv;
    }
}

/* Returns 0, or -1 when the shapes are outside what the kernel takes (nothing is written). */
int64_t tm_prompt_attention(const float *q, int64_t q_stride, const void *k_cache,
                            const void *v_cache, const int64_t *block_table,
                            int64_t table_stride, const int64_t *seqs, int64_t S, float *out,
                            int64_t Hq, int64_t Hkv, int64_t D, int64_t block_size,
                            float scale, int64_t kv_kind) {
    const int64_t G = Hq / Hkv, QB = RT / (G > 0 ? G : 1);
    if (D % 32 || G > 16 || G * Hkv != Hq) return -1;
    /* items of sequence s: Hkv * blocks[s], the query blocks in descending order (the
     * costliest first, so the dynamic schedule ends on small ones) */
    int64_t *first = malloc((size_t)(S + 1) * sizeof(int64_t));
    first[0] = 0;
    for (int64_t s = 0; s < S; s++)
        first[s + 1] = first[s] + Hkv * ((seqs[3 * s + 1] + QB - 1) / QB);
    const int64_t items = first[S];
#pragma omp parallel
    {
        float *work = malloc((size_t)((2 * D + KB + 3) * RT + 2 * KB * D) * sizeof(float));
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
                        scale, (int)kv_kind, out + row0 * Hq * D, work);
        }
        free(work);
    }
    free(first);
    return 0;
}
